// A bounded ring buffer of allocator events, off by default (capacity 0): the
// `device_traces` half of a snapshot.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/upstream.hpp"

namespace mk::core {

enum class TraceAction : std::uint8_t {
  alloc,
  free_requested,
  free_completed,
  segment_alloc,
  segment_free,
  segment_map,    // expandable segments: pages mapped / unmapped
  segment_unmap,
  oom,
};

const char* trace_action_name(TraceAction action);

struct TraceEntry {
  TraceAction action;
  std::uintptr_t addr;
  std::size_t size;
  StreamId stream;
  std::int64_t time_us;
  std::size_t device_free;  // oom: what the device (or the memory cap) still had
};

class TraceRing {
 public:
  void set_capacity(std::size_t capacity);  // drops what was recorded
  std::size_t capacity() const { return entries_.size(); }
  bool enabled() const { return !entries_.empty(); }
  void record(TraceAction action, std::uintptr_t addr, std::size_t size, StreamId stream,
              std::size_t device_free = 0);
  // Oldest first.
  std::vector<TraceEntry> entries() const;

 private:
  std::vector<TraceEntry> entries_;
  std::size_t next_ = 0;
  std::size_t count_ = 0;
};

}  // namespace mk::core
