#include "core/virtual_upstream.hpp"

#include <iterator>
#include <string>

#include "common/check.hpp"

namespace mk::core {

VirtualUpstream::VirtualUpstream(std::size_t capacity_bytes, std::size_t page_bytes)
    : capacity_(capacity_bytes), page_(page_bytes) {
  MK_EXPECTS(capacity_bytes > 0, "VirtualUpstream: capacity must be positive");
  MK_EXPECTS(page_bytes >= 512 && (page_bytes & (page_bytes - 1)) == 0,
             "VirtualUpstream: page_bytes must be a power of two of at least 512, got " + std::to_string(page_bytes));
}

VirtualUpstream::DeviceSpace& VirtualUpstream::space(int device) {
  auto it = devices_.find(device);
  if (it != devices_.end()) return it->second;
  DeviceSpace fresh;
  // Each device gets its own 16 TiB window, far from 0 (0 means "refused").
  fresh.next_address = (std::uintptr_t(1) << 44) * std::uintptr_t(device + 1);
  // Address ranges come from a separate 64 PiB window per device above every segment window.
  fresh.next_range = (std::uintptr_t(1) << 58) + (std::uintptr_t(1) << 56) * std::uintptr_t(device);
  return devices_.emplace(device, fresh).first->second;
}

bool VirtualUpstream::refuse_next() { return fail_countdown_ != 0 && --fail_countdown_ == 0; }

std::uintptr_t VirtualUpstream::allocate(int device, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (refuse_next()) return 0;
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

std::uintptr_t VirtualUpstream::reserve_range(int device, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  MK_ASSERT(bytes > 0 && bytes % page_ == 0, "reserve_range: size is not a positive multiple of the page size");
  DeviceSpace& s = space(device);
  const std::uintptr_t window_end = (std::uintptr_t(1) << 58) + (std::uintptr_t(1) << 56) * std::uintptr_t(device + 1);
  if (bytes > window_end - s.next_range) return 0;  // address space exhausted
  std::uintptr_t base = s.next_range;
  s.next_range += bytes;
  s.ranges.emplace(base, bytes);
  return base;
}

void VirtualUpstream::release_range(int device, std::uintptr_t base, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceSpace& s = space(device);
  auto it = s.ranges.find(base);
  MK_ASSERT(it != s.ranges.end() && it->second == bytes, "releasing a range the upstream never reserved");
  auto run = s.runs.lower_bound(base);
  MK_ASSERT(run == s.runs.end() || run->first >= base + bytes, "releasing a range that still has pages mapped");
  s.ranges.erase(it);
}

bool VirtualUpstream::map(int device, std::uintptr_t address, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceSpace& s = space(device);
  MK_ASSERT(bytes > 0 && address % page_ == 0 && bytes % page_ == 0, "map: range is not page-aligned");
  auto range = s.ranges.upper_bound(address);
  MK_ASSERT(range != s.ranges.begin() && std::prev(range)->first + std::prev(range)->second >= address + bytes,
            "map: range is not inside one reserved range");
  auto next = s.runs.lower_bound(address);
  MK_ASSERT(next == s.runs.end() || next->first >= address + bytes, "map: pages already mapped");
  auto prev = next == s.runs.begin() ? s.runs.end() : std::prev(next);
  MK_ASSERT(prev == s.runs.end() || prev->first + prev->second <= address, "map: pages already mapped");
  if (refuse_next() || s.used + bytes > capacity_) return false;
  s.used += bytes;
  s.mapped += bytes;
  ++s.map_calls;
  // Keep runs coalesced so that unmap can check coverage in one pass.
  std::uintptr_t start = address;
  std::size_t size = bytes;
  if (prev != s.runs.end() && prev->first + prev->second == address) {
    start = prev->first;
    size += prev->second;
    s.runs.erase(prev);
  }
  if (next != s.runs.end() && next->first == address + bytes) {
    size += next->second;
    s.runs.erase(next);
  }
  s.runs.emplace(start, size);
  return true;
}

void VirtualUpstream::unmap(int device, std::uintptr_t address, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceSpace& s = space(device);
  MK_ASSERT(bytes > 0 && address % page_ == 0 && bytes % page_ == 0, "unmap: range is not page-aligned");
  auto run = s.runs.upper_bound(address);
  MK_ASSERT(run != s.runs.begin(), "unmap: pages not mapped");
  --run;
  const std::uintptr_t run_start = run->first, run_end = run->first + run->second;
  MK_ASSERT(run_end >= address + bytes, "unmap: pages not mapped");
  s.runs.erase(run);
  if (run_start < address) s.runs.emplace(run_start, address - run_start);
  if (address + bytes < run_end) s.runs.emplace(address + bytes, run_end - address - bytes);
  s.used -= bytes;
  s.mapped -= bytes;
  ++s.unmap_calls;
}

std::uint64_t VirtualUpstream::map_calls(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  return space(device).map_calls;
}

std::uint64_t VirtualUpstream::unmap_calls(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  return space(device).unmap_calls;
}

std::size_t VirtualUpstream::mapped(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  return space(device).mapped;
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
