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

class VirtualUpstream : public Upstream {
 public:
  explicit VirtualUpstream(std::size_t capacity_bytes);
  std::uintptr_t allocate(int device, std::size_t bytes) override;
  void deallocate(int device, std::uintptr_t address, std::size_t bytes) override;
  std::size_t total_memory(int device) override { return capacity_; }
  std::string name() const override { return "virtual"; }

  // The n-th allocate() from now (1 = the next one) is refused; 0 disarms.
  void fail_nth(std::uint64_t n);
  std::size_t used(int device);

 private:
  struct DeviceSpace {
    std::uintptr_t next_address = 0;
    std::size_t used = 0;
    std::map<std::uintptr_t, std::size_t> live;
  };
  DeviceSpace& space(int device);

  std::mutex mutex_;
  std::size_t capacity_;
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
