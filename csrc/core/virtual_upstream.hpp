// Core-only stand-ins for the device: an upstream that hands out virtual
// addresses (no memory is touched, so an 80 GB trace replays on a laptop) and
// an event source whose events complete after a chosen number of queries.
// Tests use both to drive every pool path, including failure injection;
// csrc/cuda/ provides the real and simulated-device counterparts.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <unordered_map>

#include "core/upstream.hpp"

namespace mk::core {

// Segments and, for expandable segments, address ranges with pages mapped into
// them, all counted against `capacity` per device (mapped pages, not ranges).
class VirtualUpstream : public Upstream {
 public:
  explicit VirtualUpstream(std::size_t capacity_bytes, std::size_t page_bytes = std::size_t(2) << 20);
  std::uintptr_t allocate(int device, std::size_t bytes) override;
  void deallocate(int device, std::uintptr_t address, std::size_t bytes) override;
  std::size_t total_memory(int device) override { return capacity_; }
  std::string name() const override { return "virtual"; }

  std::size_t page_size(int) override { return page_; }
  std::uintptr_t reserve_range(int device, std::size_t bytes) override;
  void release_range(int device, std::uintptr_t base, std::size_t bytes) override;
  bool map(int device, std::uintptr_t address, std::size_t bytes) override;
  void unmap(int device, std::uintptr_t address, std::size_t bytes) override;

  // The n-th allocate() or map() from now (1 = the next one) is refused; 0 disarms.
  void fail_nth(std::uint64_t n);
  std::size_t used(int device);
  // map() and unmap() calls so far, and bytes mapped now, on `device`.
  std::uint64_t map_calls(int device);
  std::uint64_t unmap_calls(int device);
  std::size_t mapped(int device);

 private:
  struct DeviceSpace {
    std::uintptr_t next_address = 0;
    std::size_t used = 0;
    std::map<std::uintptr_t, std::size_t> live;
    std::uintptr_t next_range = 0;
    std::map<std::uintptr_t, std::size_t> ranges;  // reserved address ranges
    std::map<std::uintptr_t, std::size_t> runs;    // mapped, disjoint, coalesced
    std::size_t mapped = 0;
    std::uint64_t map_calls = 0;
    std::uint64_t unmap_calls = 0;
  };
  DeviceSpace& space(int device);
  bool refuse_next();  // fail_nth's countdown

  std::mutex mutex_;
  std::size_t capacity_;
  std::size_t page_;
  std::uint64_t fail_countdown_ = 0;
  std::unordered_map<int, DeviceSpace> devices_;
};

class DelayedEvents : public EventSource {
 public:
  // Each event completes after a number of query() calls drawn from [0, max_delay].
  DelayedEvents(std::uint32_t max_delay, std::uint64_t seed);
  EventId record(int device, StreamId stream) override;
  bool query(EventId event) override;
  void synchronize(EventId event) override;
  void destroy(EventId event) override;
  std::size_t live_events();
  // While paused no event completes (query() is false and does not count down).
  void set_paused(bool paused);

 private:
  std::mutex mutex_;
  std::mt19937_64 rng_;
  std::uint32_t max_delay_;
  bool paused_ = false;
  EventId next_ = 1;
  std::unordered_map<EventId, std::uint32_t> remaining_;  // queries left before complete
};

}  // namespace mk::core
