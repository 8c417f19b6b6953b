#include "core/virtual_upstream.hpp"

#include <string>

#include "common/check.hpp"

namespace mk::core {

VirtualUpstream::VirtualUpstream(std::size_t capacity_bytes) : capacity_(capacity_bytes) {
  MK_EXPECTS(capacity_bytes > 0, "VirtualUpstream: capacity must be positive");
}

VirtualUpstream::DeviceSpace& VirtualUpstream::space(int device) {
  auto it = devices_.find(device);
  if (it != devices_.end()) return it->second;
  DeviceSpace fresh;
  // Each device gets its own 16 TiB window, far from 0 (0 means "refused").
  fresh.next_address = (std::uintptr_t(1) << 44) * std::uintptr_t(device + 1);
  return devices_.emplace(device, fresh).first->second;
}

std::uintptr_t VirtualUpstream::allocate(int device, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fail_countdown_ != 0 && --fail_countdown_ == 0) return 0;
  DeviceSpace& s = space(device);
  if (s.used + bytes > capacity_) return 0;
  std::uintptr_t address = s.next_address;
  s.next_address += bytes;
  s.used += bytes;
  s.live.emplace(address, bytes);
  return address;
}

void VirtualUpstream::deallocate(int device, std::uintptr_t address, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceSpace& s = space(device);
  auto it = s.live.find(address);
  MK_ASSERT(it != s.live.end() && it->second == bytes, "deallocating a segment the upstream never handed out");
  s.live.erase(it);
  s.used -= bytes;
}

void VirtualUpstream::fail_nth(std::uint64_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  fail_countdown_ = n;
}

std::size_t VirtualUpstream::used(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  return space(device).used;
}

DelayedEvents::DelayedEvents(std::uint32_t max_delay, std::uint64_t seed) : rng_(seed), max_delay_(max_delay) {}

EventId DelayedEvents::record(int, StreamId) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::uint32_t delay = max_delay_ == 0 ? 0 : std::uint32_t(rng_() % (max_delay_ + 1));
  remaining_.emplace(next_, delay);
  return next_++;
}

bool DelayedEvents::query(EventId event) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = remaining_.find(event);
  MK_ASSERT(it != remaining_.end(), "query of an unknown event");
  if (paused_) return false;
  if (it->second == 0) return true;
  --it->second;
  return false;
}

void DelayedEvents::synchronize(EventId event) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = remaining_.find(event);
  MK_ASSERT(it != remaining_.end(), "synchronize on an unknown event");
  it->second = 0;
}

void DelayedEvents::destroy(EventId event) {
  std::lock_guard<std::mutex> lock(mutex_);
  MK_ASSERT(remaining_.erase(event) == 1, "destroying an unknown event");
}

void DelayedEvents::set_paused(bool paused) {
  std::lock_guard<std::mutex> lock(mutex_);
  paused_ = paused;
}

std::size_t DelayedEvents::live_events() {
  std::lock_guard<std::mutex> lock(mutex_);
  return remaining_.size();
}

}  // namespace mk::core
