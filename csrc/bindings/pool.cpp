// Bindings of the caching pool (csrc/core/): marshalling only. Calls that may
// block or take the pool's lock release the GIL, so Python threads really run
// malloc/free concurrently.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/check.hpp"
#include "core/allocator.hpp"
#include "core/virtual_upstream.hpp"

namespace py = pybind11;
using namespace mk::core;

namespace {

py::dict stat_dict(const Stat& s) {
  py::dict d;
  d["current"] = s.current;
  d["peak"] = s.peak;
  d["allocated"] = s.allocated;
  d["freed"] = s.freed;
  return d;
}

py::dict pool_stats_dict(const PoolStats& s) {
  py::dict d;
  d["allocated_bytes"] = stat_dict(s.allocated_bytes);
  d["requested_bytes"] = stat_dict(s.requested_bytes);
  d["active_bytes"] = stat_dict(s.active_bytes);
  d["reserved_bytes"] = stat_dict(s.reserved_bytes);
  d["allocation"] = stat_dict(s.allocation_count);
  d["segment"] = stat_dict(s.segment_count);
  d["active"] = stat_dict(s.active_count);
  return d;
}

const char* pool_name(PoolKind pool) { return pool == PoolKind::small ? "small" : "large"; }

const char* block_state_name(BlockState state) {
  switch (state) {
    case BlockState::allocated: return "active_allocated";
    case BlockState::waiting: return "active_pending_free";
    default: return "inactive";
  }
}

py::dict device_stats_dict(const DeviceStats& s) {
  py::dict d = pool_stats_dict(s.total);
  py::dict pools;
  for (int p = 0; p < kNumPools; ++p) pools[pool_name(PoolKind(p))] = pool_stats_dict(s.pools[p]);
  d["pools"] = pools;
  d["num_device_alloc"] = s.num_device_alloc;
  d["num_device_free"] = s.num_device_free;
  d["num_alloc_retries"] = s.num_alloc_retries;
  d["num_ooms"] = s.num_ooms;
  d["num_early_releases"] = s.num_early_releases;
  d["num_gc_releases"] = s.num_gc_releases;
  d["num_steps"] = s.num_steps;
  d["num_repeated_steps"] = s.num_repeated_steps;
  d["repeating_loop"] = s.repeating_loop;
  d["fragmentation"] = s.fragmentation();
  d["external_fragmentation"] = s.external_fragmentation();
  d["free_bytes"] = s.free_bytes;
  d["largest_free_block"] = s.largest_free_block;
  d["memory_cap"] = s.memory_cap;
  py::dict histogram;  // lower bound of each power-of-two bucket -> number of free blocks
  for (int b = 0; b < kHistogramBuckets; ++b)
    if (s.free_histogram[b] != 0) histogram[py::int_(std::uint64_t(1) << b)] = s.free_histogram[b];
  d["free_block_histogram"] = histogram;
  return d;
}

py::list segments_list(int device, const std::vector<SegmentInfo>& segments) {
  py::list out;
  for (const SegmentInfo& seg : segments) {
    py::list blocks;
    for (const BlockInfo& b : seg.blocks) {
      py::dict block;
      block["address"] = b.address;
      block["size"] = b.size;
      block["requested_size"] = b.requested;
      block["state"] = block_state_name(b.state);
      block["frames"] = py::list();
      blocks.append(block);
    }
    py::dict d;
    d["device"] = device;
    d["address"] = seg.address;
    d["total_size"] = seg.total_size;
    d["allocated_size"] = seg.allocated_size;
    d["active_size"] = seg.active_size;
    d["requested_size"] = seg.requested_size;
    d["stream"] = seg.stream;
    d["segment_type"] = pool_name(seg.pool);
    d["segment_pool_id"] = py::make_tuple(0, 0);
    d["is_expandable"] = seg.expandable;
    d["is_reserved"] = seg.kept;
    d["frames"] = py::list();
    d["blocks"] = blocks;
    out.append(d);
  }
  return out;
}

py::list trace_list(const std::vector<TraceEntry>& entries) {
  py::list out;
  for (const TraceEntry& e : entries) {
    py::dict d;
    d["action"] = trace_action_name(e.action);
    d["addr"] = e.addr;
    d["size"] = e.size;
    d["stream"] = e.stream;
    d["time_us"] = e.time_us;
    if (e.action == TraceAction::oom) d["device_free"] = e.device_free;
    d["frames"] = py::list();
    out.append(d);
  }
  return out;
}

}  // namespace

void bind_pool(py::module_& m) {
  py::class_<Policy>(m, "PoolPolicy", "Size rounding, segment sizing and splitting rules (csrc/core/policy.hpp).")
      .def(py::init<>())
      .def_static("pytorch", &Policy::pytorch, "PyTorch's documented caching-allocator defaults.")
      .def_readwrite("min_block", &Policy::min_block)
      .def_readwrite("small_request", &Policy::small_request)
      .def_readwrite("small_segment", &Policy::small_segment)
      .def_readwrite("segment_granularity", &Policy::segment_granularity)
      .def_readwrite("fitted_request_limit", &Policy::fitted_request_limit)
      .def_readwrite("fitted_segment_max", &Policy::fitted_segment_max)
      .def_readwrite("large_split_min", &Policy::large_split_min)
      .def_readwrite("release_before_growth", &Policy::release_before_growth)
      .def_readwrite("oversize_block", &Policy::oversize_block)
      .def_readwrite("oversize_ratio", &Policy::oversize_ratio)
      .def("round_size", &Policy::round_size)
      .def("pool_for", [](const Policy& p, std::size_t rounded) { return pool_name(p.pool_for(rounded)); })
      .def("segment_size", &Policy::segment_size)
      .def("should_split",
           [](const Policy& p, const std::string& pool, std::size_t block, std::size_t rounded) {
             MK_EXPECTS(pool == "small" || pool == "large", "pool must be 'small' or 'large', got '" + pool + "'");
             return p.should_split(pool == "small" ? PoolKind::small : PoolKind::large, block, rounded);
           })
      .def("largest_block_for", &Policy::largest_block_for)
      .def("validate", &Policy::validate);

  py::class_<PoolConfig>(m, "PoolConfig")
      .def(py::init<>())
      .def_readwrite("policy", &PoolConfig::policy)
      .def_readwrite("memory_cap_bytes", &PoolConfig::memory_cap_bytes)
      .def_readwrite("memory_cap_fraction", &PoolConfig::memory_cap_fraction)
      .def_readwrite("gc_threshold", &PoolConfig::gc_threshold)
      .def_readwrite("trace_capacity", &PoolConfig::trace_capacity)
      .def_readwrite("expandable_segments", &PoolConfig::expandable_segments)
      .def_readwrite("expandable_range_bytes", &PoolConfig::expandable_range_bytes)
      .def("validate", &PoolConfig::validate);

  py::class_<Upstream, std::shared_ptr<Upstream>>(m, "Upstream").def_property_readonly("name", &Upstream::name);
  py::class_<EventSource, std::shared_ptr<EventSource>>(m, "EventSource");

  py::class_<VirtualUpstream, Upstream, std::shared_ptr<VirtualUpstream>>(
      m, "VirtualUpstream",
      "Hands out virtual addresses (no memory touched) up to a capacity per device; with virtual memory "
      "(address ranges, pages of page_bytes mapped into them) for expandable segments.")
      .def(py::init<std::size_t, std::size_t>(), py::arg("capacity"), py::arg("page_bytes") = std::size_t(2) << 20)
      .def("fail_nth", &VirtualUpstream::fail_nth, py::arg("n"),
           "Refuse the n-th allocation or page mapping from now (1 = the next); 0 disarms.")
      .def("used", &VirtualUpstream::used, py::arg("device") = 0)
      .def("map_calls", &VirtualUpstream::map_calls, py::arg("device") = 0)
      .def("unmap_calls", &VirtualUpstream::unmap_calls, py::arg("device") = 0)
      .def("mapped", &VirtualUpstream::mapped, py::arg("device") = 0, "Bytes mapped now.");

  py::class_<DelayedEvents, EventSource, std::shared_ptr<DelayedEvents>>(
      m, "DelayedEvents", "Events that complete after a random number (0..max_delay) of queries.")
      .def(py::init<std::uint32_t, std::uint64_t>(), py::arg("max_delay"), py::arg("seed"))
      .def("live_events", &DelayedEvents::live_events)
      .def("set_paused", &DelayedEvents::set_paused, py::arg("paused"),
           "While paused no event completes; synchronize() still completes one.");

  using Guard = py::call_guard<py::gil_scoped_release>;
  py::class_<Allocator, std::shared_ptr<Allocator>>(m, "Pool", "memkernels' caching pool: one per device, created on use.")
      .def(py::init<PoolConfig, std::shared_ptr<Upstream>, std::shared_ptr<EventSource>>(), py::arg("config"),
           py::arg("upstream"), py::arg("events") = nullptr)
      .def(
          "malloc", [](Allocator& a, std::size_t size, StreamId stream, int device) {
            return a.pool(device).malloc(size, stream);
          },
          py::arg("size"), py::arg("stream") = 0, py::arg("device") = 0, Guard())
      .def(
          "free", [](Allocator& a, std::uintptr_t addr, int device) { return a.pool(device).free(addr); },
          py::arg("addr"), py::arg("device") = 0, Guard(), "False if addr is not a live allocation (nothing changes).")
      .def(
          "record_stream",
          [](Allocator& a, std::uintptr_t addr, StreamId stream, int device) {
            a.pool(device).record_stream(addr, stream);
          },
          py::arg("addr"), py::arg("stream"), py::arg("device") = 0, Guard())
      .def(
          "empty_cache", [](Allocator& a, int device) { a.pool(device).empty_cache(); }, py::arg("device") = 0,
          Guard())
      .def(
          "reserve", [](Allocator& a, std::size_t bytes, StreamId stream, int device) {
            a.pool(device).reserve(bytes, stream);
          },
          py::arg("bytes"), py::arg("stream") = 0, py::arg("device") = 0, Guard())
      .def(
          "release_reserved", [](Allocator& a, int device) { a.pool(device).release_reserved(); },
          py::arg("device") = 0)
      .def(
          "set_memory_cap",
          [](Allocator& a, std::size_t bytes, double fraction, int device) {
            a.pool(device).set_memory_cap(bytes, fraction);
          },
          py::arg("bytes") = 0, py::arg("fraction") = 0.0, py::arg("device") = 0)
      .def(
          "set_trace_capacity", [](Allocator& a, std::size_t entries, int device) {
            a.pool(device).set_trace_capacity(entries);
          },
          py::arg("entries"), py::arg("device") = 0)
      .def(
          "reset_peak_stats", [](Allocator& a, int device) { a.pool(device).reset_peak_stats(); },
          py::arg("device") = 0)
      .def(
          "end_step", [](Allocator& a, int device) { a.pool(device).end_step(); }, py::arg("device") = 0, Guard(),
          "The loop ended a step (a training loop: the optimizer's step); see docs/allocator.md, \"Repeating loops\".")
      .def(
          "stats", [](Allocator& a, int device) { return device_stats_dict(a.pool(device).stats()); },
          py::arg("device") = 0)
      .def(
          "segments", [](Allocator& a, int device) { return segments_list(device, a.pool(device).segments()); },
          py::arg("device") = 0)
      .def(
          "trace", [](Allocator& a, int device) { return trace_list(a.pool(device).trace()); }, py::arg("device") = 0)
      .def(
          "check_invariants", [](Allocator& a, int device) { a.pool(device).check_invariants(); },
          py::arg("device") = 0, Guard())
      .def("devices", [](const Allocator& a) {
        py::list used;
        for (int d = 0; d < Allocator::kMaxDevices; ++d)
          if (a.find(d) != nullptr) used.append(d);
        return used;
      })
      .def(
          "replay",
          [](Allocator& a, const std::vector<std::tuple<std::uint32_t, bool, std::size_t, StreamId>>& ops,
             std::size_t num_slots, int device) {
            std::vector<ReplayOp> converted;
            converted.reserve(ops.size());
            for (auto& [slot, is_alloc, size, stream] : ops) converted.push_back({slot, is_alloc, size, stream});
            ReplayResult r;
            {
              py::gil_scoped_release release;
              r = replay(a.pool(device), converted, num_slots);
            }
            py::dict d;
            d["ops"] = r.ops;
            d["failed_allocs"] = r.failed_allocs;
            d["first_failed_op"] = r.first_failed_op;
            d["elapsed_ns"] = r.elapsed_ns;
            return d;
          },
          py::arg("ops"), py::arg("num_slots"), py::arg("device") = 0,
          "Run (slot, is_alloc, size, stream) steps through the pool; times the pool calls only.");
}
