// The simulated device. Behaviour and deviations from CUDA: see sim.hpp.
//
// One mutex guards all sim state (a simulator needs clarity more than
// throughput); one condition variable announces every state change. Stream
// workers run each operation with the mutex held, so a copy can never race a
// free of its memory: it either runs before the free or is found invalid.
#include "sim/sim.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <system_error>
#include <thread>

namespace mk {
namespace sim {
namespace {

constexpr std::size_t kAllocAlignment = 512;  // cudaMalloc/cudaHostAlloc guarantee at least 256
constexpr int kLeastPriority = 0;             // what current GPUs report
constexpr int kGreatestPriority = -5;

enum class Fn : std::size_t {
#define MK_SIM_ENUM(name) name,
  MK_CUDA_ALL_FUNCTIONS(MK_SIM_ENUM)
#undef MK_SIM_ENUM
  count
};
constexpr const char* kFnNames[] = {
#define MK_SIM_NAME(name) #name,
    MK_CUDA_ALL_FUNCTIONS(MK_SIM_NAME)
#undef MK_SIM_NAME
};

std::size_t round_up(std::size_t n, std::size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// used + bytes <= limit, without overflow (limit may have been lowered below use).
bool fits(std::size_t used, std::size_t bytes, std::size_t limit) { return used <= limit && bytes <= limit - used; }

// Hands out address ranges from one PROT_NONE reservation, mapped on first
// use. Touching a range that nothing was mapped into faults.
class AddressArena {
 public:
  ~AddressArena() { unmap(); }

  // Reserve the arena now (it is otherwise reserved on first use). False if
  // the kernel (or a sanitizer's memory layout) has no such free range.
  bool reserve(std::size_t size) {
    if (base_ != 0) return true;
    void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    base_ = reinterpret_cast<std::uintptr_t>(p);
    size_ = size;
    free_.emplace(base_, size_);
    return true;
  }

  // 0 when the arena is exhausted or cannot be reserved.
  std::uintptr_t allocate(std::size_t size, std::size_t alignment, std::uintptr_t hint, std::size_t arena_size) {
    if (!reserve(arena_size) || size > size_ || alignment > size_) return 0;
    if (hint != 0 && hint % alignment == 0) {  // an unaligned hint is ignored
      if (std::uintptr_t at = carve_at(hint, size)) return at;
    }
    for (const auto& [start, length] : free_) {
      const std::uintptr_t aligned = round_up(start, alignment);
      if (aligned + size <= start + length) return carve_at(aligned, size);
    }
    return 0;
  }

  void release(std::uintptr_t addr, std::size_t size) {
    auto next = free_.lower_bound(addr);
    if (next != free_.end() && addr + size == next->first) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == addr) {
        prev->second += size;
        return;
      }
    }
    free_.emplace(addr, size);
  }

  // Put [addr, addr+size) back to the reserved, inaccessible state.
  bool restore(std::uintptr_t addr, std::size_t size) {
    return mmap(reinterpret_cast<void*>(addr), size, PROT_NONE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) != MAP_FAILED;
  }

  void unmap() {
    if (base_ != 0) munmap(reinterpret_cast<void*>(base_), size_);
    base_ = 0;
    size_ = 0;
    free_.clear();
  }

 private:
  std::uintptr_t carve_at(std::uintptr_t at, std::size_t size) {
    auto it = free_.upper_bound(at);
    if (it == free_.begin()) return 0;
    --it;
    const std::uintptr_t start = it->first, end = it->first + it->second;
    if (at < start || at > end || size > end - at) return 0;
    free_.erase(it);
    if (at > start) free_.emplace(start, at - start);
    if (at + size < end) free_.emplace(at + size, end - (at + size));
    return at;
  }

  std::uintptr_t base_ = 0;
  std::size_t size_ = 0;
  std::map<std::uintptr_t, std::size_t> free_;  // start -> length
};

enum class RegionKind { device, host, mapping };

// A live range of sim memory: a cudaMalloc block, a pinned host block or a
// VMM mapping.
struct Region {
  std::size_t size = 0;
  RegionKind kind = RegionKind::device;
  int device = 0;
  bool readable = true;
  bool writable = true;
  std::size_t arena_bytes = 0;  // >0: the range came from the arena (virtual mode)
  std::uint64_t handle = 0;     // mapping: physical handle
};

struct PhysicalHandle {
  std::size_t size = 0;
  int device = 0;
  int fd = -1;  // backed mode: memfd holding the bytes
  bool released = false;
  int mappings = 0;
};

struct EventState {
  std::uint64_t recorded = 0;   // generation of the latest record
  std::uint64_t completed = 0;  // highest generation reached by its stream
  double time = 0;              // modelled time of the latest record
};

struct Op {
  enum class Kind { copy, record, wait } kind = Kind::copy;
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
  bool dst_device = false;
  bool src_device = false;
  std::shared_ptr<EventState> event;
  std::uint64_t generation = 0;
  std::uint64_t hold_ticket = 0;  // record only; 0: not held
};

struct Stream {
  int device = 0;
  int priority = 0;
  std::deque<Op> queue;
  std::uint64_t enqueued = 0;
  std::uint64_t done = 0;
  double clock = 0;  // modelled time at which the work enqueued so far completes
  bool closing = false;
  bool finished = false;
  std::thread worker;
};

thread_local int tls_device = 0;

class Sim {
 public:
  Sim() { apply_config(Config{}); }
  ~Sim() {
    std::unique_lock<std::mutex> lk(mu);
    shutdown(lk);
  }

  void count(Fn fn) { calls_[static_cast<std::size_t>(fn)].fetch_add(1, std::memory_order_relaxed); }

  std::mutex mu;
  std::condition_variable changed;

  Config cfg;
  std::vector<DeviceStats> devices;
  std::size_t host_in_use = 0, host_peak = 0, reserved_bytes = 0, mapped_bytes = 0, bytes_copied = 0;
  std::size_t injected_failures = 0, async_errors = 0;
  bool sticky_error = false;

  std::uint64_t next_id = 1;
  std::map<std::uintptr_t, Region> regions;
  std::map<std::uintptr_t, std::size_t> reservations;  // start -> size
  std::map<std::uint64_t, PhysicalHandle> handles;
  std::map<std::uintptr_t, std::shared_ptr<Stream>> streams;  // by handle value
  std::vector<std::shared_ptr<Stream>> default_streams;       // per device, lazily
  std::vector<std::shared_ptr<Stream>> all_streams;           // not yet joined
  std::map<std::uintptr_t, std::shared_ptr<EventState>> events;
  AddressArena arena;

  std::uint64_t allocation_requests = 0, fail_from = 0, fail_until = 0;  // [fail_from, fail_until)
  bool holding = false;
  std::uint64_t hold_issued = 0, hold_released = 0;
  std::uint64_t max_delay_us = 0;
  std::mt19937_64 rng;

  // Modelled time (sim.hpp). A device's clock is the latest of its streams'
  // clocks, kept apart so that destroyed streams' work still counts.
  double host_clock = 0, link_bandwidth = 0, link_seconds = 0;
  std::vector<double> device_clocks;

  bool backed() const { return cfg.memory == Memory::backed; }
  int current_device() const { return tls_device < cfg.device_count ? tls_device : 0; }

  // When work enqueued on st now starts: the host issues it no earlier.
  double start_time(const Stream& st) const { return std::max(st.clock, host_clock); }
  void set_clock(Stream& st, double t) {
    st.clock = t;
    device_clocks[st.device] = std::max(device_clocks[st.device], t);
  }

  std::uintptr_t new_handle_value() { return static_cast<std::uintptr_t>(next_id++) << 4 | 0x8; }

  // Count a device allocation request against fault injection and capacity.
  bool admit_device(int device, std::size_t bytes) {
    const std::uint64_t request = ++allocation_requests;
    if (request >= fail_from && request < fail_until) {
      ++injected_failures;
      return false;
    }
    return fits(devices[device].bytes_in_use, bytes, cfg.capacity);
  }
  void charge_device(int device, std::size_t bytes) {
    DeviceStats& d = devices[device];
    d.bytes_in_use += bytes;
    d.allocations += 1;
    d.peak_bytes = std::max(d.peak_bytes, d.bytes_in_use);
  }
  void uncharge_device(int device, std::size_t bytes) {
    devices[device].bytes_in_use -= bytes;
    devices[device].allocations -= 1;
  }

  // Wait with the sim's timeout. False: timed out, or the sim is shutting down.
  template <class Pred>
  bool wait(std::unique_lock<std::mutex>& lk, Pred pred) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(cfg.sync_timeout_s);
    const bool ok = changed.wait_until(lk, deadline, [&] { return stopping_ || pred(); });
    return ok && !stopping_;
  }

  cudaError_t wait_streams(std::unique_lock<std::mutex>& lk, int device /* -1: all */) {
    std::vector<std::pair<std::shared_ptr<Stream>, std::uint64_t>> targets;
    for (const auto& st : all_streams)
      if (device < 0 || st->device == device) targets.emplace_back(st, st->enqueued);
    double until = host_clock;  // taken now: work enqueued while waiting is not waited for
    for (int d = 0; d < cfg.device_count; ++d)
      if (device < 0 || d == device) until = std::max(until, device_clocks[d]);
    const bool ok = wait(lk, [&] {
      for (const auto& [st, target] : targets)
        if (st->done < target && !st->finished) return false;
      return true;
    });
    if (!ok) return cudaErrorLaunchTimeout;
    host_clock = std::max(host_clock, until);
    return sticky_error ? cudaErrorIllegalAddress : cudaSuccess;
  }

  // Region containing addr, or regions.end().
  std::map<std::uintptr_t, Region>::iterator region_at(std::uintptr_t addr) {
    auto it = regions.upper_bound(addr);
    if (it == regions.begin()) return regions.end();
    --it;
    return addr < it->first + it->second.size ? it : regions.end();
  }

  bool is_device_ptr(std::uintptr_t addr) {
    auto it = region_at(addr);
    return it != regions.end() && it->second.kind != RegionKind::host;
  }

  // [addr, addr+bytes) lies in one live cudaMalloc block, or in adjacent VMM
  // mappings (a tensor may straddle the chunks of an expandable segment),
  // with the needed access.
  bool device_range_ok(std::uintptr_t addr, std::size_t bytes, bool write) {
    if (bytes == 0) return true;
    const std::uintptr_t end = addr + bytes;
    if (end < addr) return false;
    auto it = region_at(addr);
    while (it != regions.end()) {
      const Region& r = it->second;
      if (r.kind == RegionKind::host || !(write ? r.writable : r.readable)) return false;
      const std::uintptr_t region_end = it->first + r.size;
      if (end <= region_end) return true;
      if (r.kind != RegionKind::mapping) return false;
      ++it;
      if (it == regions.end() || it->first != region_end || it->second.kind != RegionKind::mapping) return false;
    }
    return false;
  }

  // Host side of a copy: pageable memory (no sim region overlaps it) or
  // inside one pinned block.
  bool host_range_ok(std::uintptr_t addr, std::size_t bytes) {
    if (bytes == 0) return true;
    const std::uintptr_t end = addr + bytes;
    if (end < addr) return false;
    if (auto it = region_at(addr); it != regions.end())
      return it->second.kind == RegionKind::host && end <= it->first + it->second.size;
    auto next = regions.lower_bound(addr);
    return next == regions.end() || next->first >= end;
  }

  bool copy_ok(const Op& op) {
    const auto dst = reinterpret_cast<std::uintptr_t>(op.dst), src = reinterpret_cast<std::uintptr_t>(op.src);
    const bool dst_ok = op.dst_device ? device_range_ok(dst, op.bytes, true) : host_range_ok(dst, op.bytes);
    const bool src_ok = op.src_device ? device_range_ok(src, op.bytes, false) : host_range_ok(src, op.bytes);
    return dst_ok && src_ok;
  }

  // Virtual mode moves bytes only between two pageable host buffers.
  bool copy_moves_bytes(const Op& op) {
    if (backed()) return true;
    return region_at(reinterpret_cast<std::uintptr_t>(op.dst)) == regions.end() &&
           region_at(reinterpret_cast<std::uintptr_t>(op.src)) == regions.end();
  }

  std::shared_ptr<Stream> stream_for(cudaStream_t handle) {
    const auto value = reinterpret_cast<std::uintptr_t>(handle);
    if (handle == nullptr || handle == cudaStreamLegacy || handle == cudaStreamPerThread) {
      const int device = current_device();
      if (!default_streams[device]) default_streams[device] = start_stream(device, kLeastPriority);
      return default_streams[device];
    }
    auto it = streams.find(value);
    return it == streams.end() ? nullptr : it->second;
  }

  std::shared_ptr<Stream> start_stream(int device, int priority) {
    auto st = std::make_shared<Stream>();
    st->device = device;
    st->priority = priority;
    st->worker = std::thread([this, st] { run(st); });
    all_streams.push_back(st);
    return st;
  }

  void enqueue(Stream& st, Op op) {
    st.queue.push_back(std::move(op));
    ++st.enqueued;
    changed.notify_all();
  }

  // Join workers that have exited (destroyed streams that drained).
  void reap(std::unique_lock<std::mutex>& lk) {
    std::vector<std::shared_ptr<Stream>> finished;
    auto keep = std::partition(all_streams.begin(), all_streams.end(), [](const auto& st) { return !st->finished; });
    finished.assign(keep, all_streams.end());
    all_streams.erase(keep, all_streams.end());
    lk.unlock();
    for (auto& st : finished) st->worker.join();
    lk.lock();
  }

  void shutdown(std::unique_lock<std::mutex>& lk) {
    stopping_ = true;
    changed.notify_all();
    std::vector<std::shared_ptr<Stream>> joinable;
    joinable.swap(all_streams);
    lk.unlock();
    for (auto& st : joinable) st->worker.join();
    lk.lock();
    for (auto& [addr, region] : regions) {
      if (region.kind != RegionKind::mapping && region.arena_bytes == 0) std::free(reinterpret_cast<void*>(addr));
    }
    for (auto& [id, handle] : handles)
      if (handle.fd >= 0) close(handle.fd);
    regions.clear();
    reservations.clear();
    handles.clear();
    streams.clear();
    events.clear();
    default_streams.clear();
    arena.unmap();
    stopping_ = false;
  }

  void apply_config(const Config& config) {
    cfg = config;
    devices.assign(cfg.device_count, DeviceStats{});
    default_streams.assign(cfg.device_count, nullptr);
    host_in_use = host_peak = reserved_bytes = mapped_bytes = bytes_copied = 0;
    injected_failures = async_errors = 0;
    sticky_error = false;
    allocation_requests = fail_from = fail_until = 0;
    holding = false;
    hold_issued = hold_released = 0;
    max_delay_us = 0;
    host_clock = link_bandwidth = link_seconds = 0;
    device_clocks.assign(cfg.device_count, 0.0);
    for (auto& c : calls_) c.store(0, std::memory_order_relaxed);
  }

  std::map<std::string, std::uint64_t> counter_map() const {
    std::map<std::string, std::uint64_t> out;
    for (std::size_t i = 0; i < calls_.size(); ++i)
      if (std::uint64_t n = calls_[i].load(std::memory_order_relaxed)) out[kFnNames[i]] = n;
    return out;
  }

 private:
  // Stream worker: runs operations in order until the stream is destroyed
  // and drained, or the sim shuts down (queued work is then abandoned).
  void run(std::shared_ptr<Stream> st) {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      changed.wait(lk, [&] { return stopping_ || !st->queue.empty() || st->closing; });
      if (stopping_ || st->queue.empty()) break;
      if (max_delay_us != 0) {
        const auto delay = std::uniform_int_distribution<std::uint64_t>(0, max_delay_us)(rng);
        lk.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(delay));
        lk.lock();
        if (stopping_) break;
      }
      const Op op = st->queue.front();
      if (!execute(op, lk)) break;
      st->queue.pop_front();
      ++st->done;
      changed.notify_all();
    }
    st->finished = true;
    changed.notify_all();
  }

  // False when the sim shut down while the operation waited.
  bool execute(const Op& op, std::unique_lock<std::mutex>& lk) {
    switch (op.kind) {
      case Op::Kind::copy:
        if (!copy_ok(op)) {
          sticky_error = true;  // memory freed/unmapped between enqueue and execution
          ++async_errors;
        } else {
          if (copy_moves_bytes(op) && op.bytes != 0) std::memmove(op.dst, op.src, op.bytes);
          bytes_copied += op.bytes;
        }
        return true;
      case Op::Kind::record:
        if (op.hold_ticket != 0) {
          changed.wait(lk, [&] { return stopping_ || hold_released >= op.hold_ticket; });
          if (stopping_) return false;
        }
        op.event->completed = std::max(op.event->completed, op.generation);
        return true;
      case Op::Kind::wait:
        changed.wait(lk, [&] { return stopping_ || op.event->completed >= op.generation; });
        return !stopping_;
    }
    return true;
  }

  bool stopping_ = false;
  std::array<std::atomic<std::uint64_t>, static_cast<std::size_t>(Fn::count)> calls_{};
};

Sim& the_sim() {
  static Sim instance;
  return instance;
}

// ---------------------------------------------------------------- entries
// Every entry counts itself, then takes the sim lock. After an asynchronous
// error every call fails, as in a corrupted CUDA context.
#define MK_SIM_RUNTIME_ENTRY(name)            \
  Sim& s = the_sim();                         \
  s.count(Fn::name);                          \
  std::unique_lock<std::mutex> lk(s.mu);      \
  if (s.sticky_error) return cudaErrorIllegalAddress

#define MK_SIM_DRIVER_ENTRY(name)             \
  Sim& s = the_sim();                         \
  s.count(Fn::name);                          \
  std::unique_lock<std::mutex> lk(s.mu);      \
  if (s.sticky_error) return CUDA_ERROR_ILLEGAL_ADDRESS

struct ErrorText {
  int code;
  const char* name;
  const char* text;
};

// The codes the sim produces, with CUDA's names.
constexpr ErrorText kRuntimeErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
    {cudaErrorLaunchTimeout, "cudaErrorLaunchTimeout",
     "the launch timed out and was terminated (simulator: a blocking call waited longer than sync_timeout_s)"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};
constexpr ErrorText kDriverErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
};

template <std::size_t N>
const ErrorText* find_error(const ErrorText (&table)[N], int code) {
  for (const auto& e : table)
    if (e.code == code) return &e;
  return nullptr;
}

namespace entry {

// --- device
cudaError_t cudaGetDeviceCount(int* count) {
  MK_SIM_RUNTIME_ENTRY(cudaGetDeviceCount);
  if (count == nullptr) return cudaErrorInvalidValue;
  *count = s.cfg.device_count;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  MK_SIM_RUNTIME_ENTRY(cudaGetDevice);
  if (device == nullptr) return cudaErrorInvalidValue;
  *device = s.current_device();
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  MK_SIM_RUNTIME_ENTRY(cudaSetDevice);
  if (device < 0 || device >= s.cfg.device_count) return cudaErrorInvalidDevice;
  tls_device = device;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  MK_SIM_RUNTIME_ENTRY(cudaDeviceSynchronize);
  return s.wait_streams(lk, s.current_device());
}

cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  MK_SIM_RUNTIME_ENTRY(cudaMemGetInfo);
  if (free == nullptr || total == nullptr) return cudaErrorInvalidValue;
  const std::size_t used = s.devices[s.current_device()].bytes_in_use;
  *total = s.cfg.capacity;
  *free = used < s.cfg.capacity ? s.cfg.capacity - used : 0;
  return cudaSuccess;
}

// --- memory
// Backed: C heap. Virtual: an arena range. nullptr on failure.
void* take_memory(Sim& s, std::size_t bytes, std::size_t* arena_bytes) {
  *arena_bytes = 0;
  if (s.backed()) {
    void* p = nullptr;
    return posix_memalign(&p, kAllocAlignment, bytes) == 0 ? p : nullptr;
  }
  if (bytes > SIZE_MAX - kAllocAlignment) return nullptr;
  const std::size_t rounded = round_up(bytes, kAllocAlignment);
  const std::uintptr_t at = s.arena.allocate(rounded, kAllocAlignment, 0, s.cfg.address_space);
  if (at != 0) *arena_bytes = rounded;
  return reinterpret_cast<void*>(at);
}

void give_back(Sim& s, std::uintptr_t addr, const Region& region) {
  if (region.arena_bytes != 0)
    s.arena.release(addr, region.arena_bytes);
  else
    std::free(reinterpret_cast<void*>(addr));
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  MK_SIM_RUNTIME_ENTRY(cudaMalloc);
  if (ptr == nullptr) return cudaErrorInvalidValue;
  *ptr = nullptr;
  if (size == 0) return cudaSuccess;
  const int device = s.current_device();
  if (!s.admit_device(device, size)) return cudaErrorMemoryAllocation;
  Region region;
  region.size = size;
  region.kind = RegionKind::device;
  region.device = device;
  void* p = take_memory(s, size, &region.arena_bytes);
  if (p == nullptr) return cudaErrorMemoryAllocation;
  s.regions.emplace(reinterpret_cast<std::uintptr_t>(p), region);
  s.charge_device(device, size);
  *ptr = p;
  return cudaSuccess;
}

cudaError_t free_region(Sim& s, std::unique_lock<std::mutex>& lk, void* ptr, RegionKind kind) {
  if (ptr == nullptr) return cudaSuccess;
  // Like CUDA's, the sim's free waits for all work that could still use the memory.
  if (cudaError_t err = s.wait_streams(lk, -1); err != cudaSuccess) return err;
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = s.regions.find(addr);
  if (it == s.regions.end() || it->second.kind != kind) return cudaErrorInvalidValue;
  const Region region = it->second;
  s.regions.erase(it);
  give_back(s, addr, region);
  if (kind == RegionKind::device)
    s.uncharge_device(region.device, region.size);
  else
    s.host_in_use -= region.size;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  MK_SIM_RUNTIME_ENTRY(cudaFree);
  return free_region(s, lk, ptr, RegionKind::device);
}

cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int flags) {
  MK_SIM_RUNTIME_ENTRY(cudaHostAlloc);
  if (ptr == nullptr) return cudaErrorInvalidValue;
  *ptr = nullptr;
  if (size == 0) return cudaSuccess;
  if (!fits(s.host_in_use, size, s.cfg.host_capacity)) return cudaErrorMemoryAllocation;
  Region region;
  region.size = size;
  region.kind = RegionKind::host;
  void* p = take_memory(s, size, &region.arena_bytes);
  if (p == nullptr) return cudaErrorMemoryAllocation;
  s.regions.emplace(reinterpret_cast<std::uintptr_t>(p), region);
  s.host_in_use += size;
  s.host_peak = std::max(s.host_peak, s.host_in_use);
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  MK_SIM_RUNTIME_ENTRY(cudaFreeHost);
  return free_region(s, lk, ptr, RegionKind::host);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
  MK_SIM_RUNTIME_ENTRY(cudaMemcpyAsync);
  auto st = s.stream_for(stream);
  if (!st) return cudaErrorInvalidResourceHandle;
  Op op;
  op.kind = Op::Kind::copy;
  op.dst = dst;
  op.src = src;
  op.bytes = count;
  switch (kind) {
    case cudaMemcpyHostToHost: break;
    case cudaMemcpyHostToDevice: op.dst_device = true; break;
    case cudaMemcpyDeviceToHost: op.src_device = true; break;
    case cudaMemcpyDeviceToDevice: op.dst_device = op.src_device = true; break;
    case cudaMemcpyDefault:
      op.dst_device = s.is_device_ptr(reinterpret_cast<std::uintptr_t>(dst));
      op.src_device = s.is_device_ptr(reinterpret_cast<std::uintptr_t>(src));
      break;
    default: return cudaErrorInvalidMemcpyDirection;
  }
  if (count != 0 && (dst == nullptr || src == nullptr)) return cudaErrorInvalidValue;
  if (!s.copy_ok(op)) return cudaErrorInvalidValue;
  // Only a copy between two device buffers stays off the link.
  const bool on_link = s.link_bandwidth > 0 && !(op.src_device && op.dst_device);
  const double seconds = on_link ? static_cast<double>(count) / s.link_bandwidth : 0;
  s.set_clock(*st, s.start_time(*st) + seconds);
  s.link_seconds += seconds;
  s.enqueue(*st, std::move(op));
  return cudaSuccess;
}

// --- streams
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags, int priority) {
  MK_SIM_RUNTIME_ENTRY(cudaStreamCreateWithPriority);
  if (stream == nullptr) return cudaErrorInvalidValue;
  s.reap(lk);
  const int clamped = std::min(kLeastPriority, std::max(kGreatestPriority, priority));
  std::shared_ptr<Stream> st;
  try {
    st = s.start_stream(s.current_device(), clamped);
  } catch (const std::system_error&) {
    return cudaErrorUnknown;  // no thread for the worker
  }
  const std::uintptr_t value = s.new_handle_value();
  s.streams.emplace(value, st);
  *stream = reinterpret_cast<cudaStream_t>(value);
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  MK_SIM_RUNTIME_ENTRY(cudaStreamDestroy);
  auto it = s.streams.find(reinterpret_cast<std::uintptr_t>(stream));
  if (it == s.streams.end()) return cudaErrorInvalidResourceHandle;
  // As in CUDA, queued work still completes; the worker exits when drained.
  it->second->closing = true;
  s.streams.erase(it);
  s.changed.notify_all();
  s.reap(lk);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  MK_SIM_RUNTIME_ENTRY(cudaStreamSynchronize);
  auto st = s.stream_for(stream);
  if (!st) return cudaErrorInvalidResourceHandle;
  const std::uint64_t target = st->enqueued;
  const double until = st->clock;
  if (!s.wait(lk, [&] { return st->done >= target; })) return cudaErrorLaunchTimeout;
  s.host_clock = std::max(s.host_clock, until);
  return s.sticky_error ? cudaErrorIllegalAddress : cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  MK_SIM_RUNTIME_ENTRY(cudaStreamQuery);
  auto st = s.stream_for(stream);
  if (!st) return cudaErrorInvalidResourceHandle;
  return st->done >= st->enqueued ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  MK_SIM_RUNTIME_ENTRY(cudaDeviceGetStreamPriorityRange);
  if (least) *least = kLeastPriority;
  if (greatest) *greatest = kGreatestPriority;
  return cudaSuccess;
}

// --- events
std::shared_ptr<EventState> event_for(Sim& s, cudaEvent_t event) {
  auto it = s.events.find(reinterpret_cast<std::uintptr_t>(event));
  return it == s.events.end() ? nullptr : it->second;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  MK_SIM_RUNTIME_ENTRY(cudaEventCreateWithFlags);
  if (event == nullptr) return cudaErrorInvalidValue;
  const std::uintptr_t value = s.new_handle_value();
  s.events.emplace(value, std::make_shared<EventState>());
  *event = reinterpret_cast<cudaEvent_t>(value);
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  MK_SIM_RUNTIME_ENTRY(cudaEventDestroy);
  // Queued records/waits keep their own reference, as CUDA defers the release.
  return s.events.erase(reinterpret_cast<std::uintptr_t>(event)) ? cudaSuccess : cudaErrorInvalidResourceHandle;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  MK_SIM_RUNTIME_ENTRY(cudaEventRecord);
  auto ev = event_for(s, event);
  auto st = s.stream_for(stream);
  if (!ev || !st) return cudaErrorInvalidResourceHandle;
  Op op;
  op.kind = Op::Kind::record;
  op.event = ev;
  op.generation = ++ev->recorded;
  // Decided here, not in the worker, so that release_events() right after a
  // record releases it regardless of how far the worker has got.
  if (s.holding) op.hold_ticket = ++s.hold_issued;
  ev->time = s.start_time(*st);
  s.set_clock(*st, ev->time);
  s.enqueue(*st, std::move(op));
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  MK_SIM_RUNTIME_ENTRY(cudaEventQuery);
  auto ev = event_for(s, event);
  if (!ev) return cudaErrorInvalidResourceHandle;
  return ev->completed >= ev->recorded ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  MK_SIM_RUNTIME_ENTRY(cudaEventSynchronize);
  auto ev = event_for(s, event);
  if (!ev) return cudaErrorInvalidResourceHandle;
  const std::uint64_t target = ev->recorded;
  const double until = ev->time;
  if (!s.wait(lk, [&] { return ev->completed >= target; })) return cudaErrorLaunchTimeout;
  s.host_clock = std::max(s.host_clock, until);
  return s.sticky_error ? cudaErrorIllegalAddress : cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  MK_SIM_RUNTIME_ENTRY(cudaStreamWaitEvent);
  auto ev = event_for(s, event);
  auto st = s.stream_for(stream);
  if (!ev || !st) return cudaErrorInvalidResourceHandle;
  if (ev->recorded == 0) return cudaSuccess;  // never recorded: nothing to wait for
  Op op;
  op.kind = Op::Kind::wait;
  op.event = ev;
  op.generation = ev->recorded;
  s.set_clock(*st, std::max(s.start_time(*st), ev->time));
  s.enqueue(*st, std::move(op));
  return cudaSuccess;
}

const char* cudaGetErrorName(cudaError_t error) {
  the_sim().count(Fn::cudaGetErrorName);
  const ErrorText* e = find_error(kRuntimeErrors, error);
  return e ? e->name : "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  the_sim().count(Fn::cudaGetErrorString);
  const ErrorText* e = find_error(kRuntimeErrors, error);
  return e ? e->text : "unrecognized error code";
}

cudaError_t cudaDriverGetVersion(int* version) {
  MK_SIM_RUNTIME_ENTRY(cudaDriverGetVersion);
  if (version == nullptr) return cudaErrorInvalidValue;
  *version = CUDA_VERSION;
  return cudaSuccess;
}

// --- driver
CUresult cuInit(unsigned int flags) {
  MK_SIM_DRIVER_ENTRY(cuInit);
  return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuDriverGetVersion(int* version) {
  MK_SIM_DRIVER_ENTRY(cuDriverGetVersion);
  if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *version = CUDA_VERSION;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  MK_SIM_DRIVER_ENTRY(cuDeviceGet);
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= s.cfg.device_count) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char** name) {
  the_sim().count(Fn::cuGetErrorName);
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorText* e = find_error(kDriverErrors, error);
  *name = e ? e->name : nullptr;
  return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char** text) {
  the_sim().count(Fn::cuGetErrorString);
  if (text == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorText* e = find_error(kDriverErrors, error);
  *text = e ? e->text : nullptr;
  return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// A pinned allocation on a valid device: the only kind the sim (and PyTorch) uses.
CUresult check_prop(const Sim& s, const CUmemAllocationProp* prop) {
  if (prop == nullptr || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  if (prop->location.id < 0 || prop->location.id >= s.cfg.device_count) return CUDA_ERROR_INVALID_DEVICE;
  return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                       CUmemAllocationGranularity_flags option) {
  MK_SIM_DRIVER_ENTRY(cuMemGetAllocationGranularity);
  if (granularity == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult err = check_prop(s, prop); err != CUDA_SUCCESS) return err;
  *granularity = s.cfg.granularity;  // minimum and recommended are the same here
  return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  MK_SIM_DRIVER_ENTRY(cuMemAddressReserve);
  if (ptr == nullptr || size == 0 || size % s.cfg.granularity != 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (alignment != 0 && (alignment & (alignment - 1)) != 0) return CUDA_ERROR_INVALID_VALUE;
  const std::uintptr_t at = s.arena.allocate(size, std::max<std::size_t>(alignment, s.cfg.granularity),
                                             static_cast<std::uintptr_t>(addr), s.cfg.address_space);
  if (at == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  s.reservations.emplace(at, size);
  s.reserved_bytes += size;
  *ptr = static_cast<CUdeviceptr>(at);
  return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  MK_SIM_DRIVER_ENTRY(cuMemAddressFree);
  const auto at = static_cast<std::uintptr_t>(ptr);
  auto it = s.reservations.find(at);
  if (it == s.reservations.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  auto mapped = s.regions.lower_bound(at);
  if (mapped != s.regions.end() && mapped->first < at + size) return CUDA_ERROR_INVALID_VALUE;  // still mapped
  s.reservations.erase(it);
  s.arena.release(at, size);
  s.reserved_bytes -= size;
  return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                     unsigned long long flags) {
  MK_SIM_DRIVER_ENTRY(cuMemCreate);
  if (handle == nullptr || size == 0 || size % s.cfg.granularity != 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult err = check_prop(s, prop); err != CUDA_SUCCESS) return err;
  const int device = prop->location.id;
  if (!s.admit_device(device, size)) return CUDA_ERROR_OUT_OF_MEMORY;
  PhysicalHandle physical;
  physical.size = size;
  physical.device = device;
  if (s.backed()) {
    physical.fd = memfd_create("memkernels-sim", MFD_CLOEXEC);
    if (physical.fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    if (ftruncate(physical.fd, static_cast<off_t>(size)) != 0) {
      close(physical.fd);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  const std::uint64_t id = s.next_id++;
  s.handles.emplace(id, physical);
  s.charge_device(device, size);
  *handle = id;
  return CUDA_SUCCESS;
}

void destroy_if_unused(Sim& s, std::map<std::uint64_t, PhysicalHandle>::iterator it) {
  if (!it->second.released || it->second.mappings > 0) return;
  if (it->second.fd >= 0) close(it->second.fd);
  s.uncharge_device(it->second.device, it->second.size);
  s.handles.erase(it);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  MK_SIM_DRIVER_ENTRY(cuMemRelease);
  auto it = s.handles.find(handle);
  if (it == s.handles.end() || it->second.released) return CUDA_ERROR_INVALID_VALUE;
  it->second.released = true;  // the memory lives on while mapped, as in CUDA
  destroy_if_unused(s, it);
  return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  MK_SIM_DRIVER_ENTRY(cuMemMap);
  const auto at = static_cast<std::uintptr_t>(ptr);
  const std::size_t g = s.cfg.granularity;
  if (flags != 0 || size == 0 || size % g != 0 || offset % g != 0 || at % g != 0) return CUDA_ERROR_INVALID_VALUE;
  auto h = s.handles.find(handle);
  if (h == s.handles.end() || h->second.released || offset + size > h->second.size) return CUDA_ERROR_INVALID_VALUE;
  auto r = s.reservations.upper_bound(at);
  if (r == s.reservations.begin()) return CUDA_ERROR_INVALID_VALUE;
  --r;
  if (at + size > r->first + r->second) return CUDA_ERROR_INVALID_VALUE;  // not inside one reservation
  auto overlap = s.regions.lower_bound(at);
  if (s.region_at(at) != s.regions.end() || (overlap != s.regions.end() && overlap->first < at + size))
    return CUDA_ERROR_ALREADY_MAPPED;
  if (s.backed() && mmap(reinterpret_cast<void*>(at), size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->second.fd,
                         static_cast<off_t>(offset)) == MAP_FAILED)
    return CUDA_ERROR_OUT_OF_MEMORY;
  Region region;
  region.size = size;
  region.kind = RegionKind::mapping;
  region.device = h->second.device;
  region.readable = region.writable = false;  // until cuMemSetAccess
  region.handle = handle;
  s.regions.emplace(at, region);
  h->second.mappings += 1;
  s.mapped_bytes += size;
  return CUDA_SUCCESS;
}

// The mappings that exactly tile [at, at+size), or an error code.
CUresult whole_mappings(Sim& s, std::uintptr_t at, std::size_t size,
                        std::vector<std::map<std::uintptr_t, Region>::iterator>& out) {
  const std::uintptr_t end = at + size;
  auto first = s.regions.lower_bound(at);
  const bool any = s.region_at(at) != s.regions.end() || (first != s.regions.end() && first->first < end);
  if (!any) return CUDA_ERROR_NOT_MAPPED;
  std::uintptr_t cursor = at;
  for (auto it = s.regions.find(at); cursor < end; ++it) {
    if (it == s.regions.end() || it->first != cursor || it->second.kind != RegionKind::mapping)
      return CUDA_ERROR_INVALID_VALUE;
    cursor += it->second.size;
    out.push_back(it);
  }
  return cursor == end ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  MK_SIM_DRIVER_ENTRY(cuMemUnmap);
  const auto at = static_cast<std::uintptr_t>(ptr);
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  std::vector<std::map<std::uintptr_t, Region>::iterator> mappings;
  if (CUresult err = whole_mappings(s, at, size, mappings); err != CUDA_SUCCESS) return err;
  if (s.backed() && !s.arena.restore(at, size)) return CUDA_ERROR_INVALID_VALUE;
  for (auto it : mappings) {
    auto h = s.handles.find(it->second.handle);
    s.regions.erase(it);
    h->second.mappings -= 1;
    destroy_if_unused(s, h);
  }
  s.mapped_bytes -= size;
  return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  MK_SIM_DRIVER_ENTRY(cuMemSetAccess);
  if (desc == nullptr || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
  for (std::size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    if (desc[i].location.id < 0 || desc[i].location.id >= s.cfg.device_count) return CUDA_ERROR_INVALID_DEVICE;
    if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
        desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      return CUDA_ERROR_INVALID_VALUE;
  }
  std::vector<std::map<std::uintptr_t, Region>::iterator> mappings;
  if (CUresult err = whole_mappings(s, static_cast<std::uintptr_t>(ptr), size, mappings); err != CUDA_SUCCESS)
    return err == CUDA_ERROR_NOT_MAPPED ? CUDA_ERROR_INVALID_VALUE : err;
  for (auto it : mappings) {
    Region& region = it->second;
    // Only the owning device's access is modelled (no peer access).
    for (std::size_t i = 0; i < count; ++i) {
      if (desc[i].location.id != region.device) continue;
      region.readable = desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE;
      region.writable = desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    const int prot = (region.readable ? PROT_READ : 0) | (region.writable ? PROT_WRITE : 0);
    if (s.backed() && mprotect(reinterpret_cast<void*>(it->first), region.size, prot) != 0)
      return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

}  // namespace entry

cuda::Api make_table() {
  cuda::Api t;
  t.backend = "sim";
#define MK_SIM_FILL(name) t.name = &entry::name;
  MK_CUDA_ALL_FUNCTIONS(MK_SIM_FILL)
#undef MK_SIM_FILL
  return t;
}

// The stream a control function names; throws for a handle that is not live.
Stream& control_stream(Sim& s, std::uintptr_t handle) {
  auto st = s.stream_for(reinterpret_cast<cudaStream_t>(handle));
  MK_EXPECTS(st != nullptr, "stream " + std::to_string(handle) + " is not a live stream of the sim");
  return *st;
}

}  // namespace

const cuda::Api& table() {
  static const cuda::Api t = make_table();
  return t;
}

void configure(const Config& config) {
  MK_EXPECTS(config.device_count >= 1 && config.device_count <= 64,
             "sim device_count must be between 1 and 64, got " + std::to_string(config.device_count));
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  MK_EXPECTS(config.granularity >= page && (config.granularity & (config.granularity - 1)) == 0,
             "sim granularity must be a power of two of at least the page size (" + std::to_string(page) +
                 "), got " + std::to_string(config.granularity));
  MK_EXPECTS(config.address_space >= config.granularity && config.address_space % config.granularity == 0,
             "sim address_space must be a positive multiple of granularity, got " +
                 std::to_string(config.address_space));
  MK_EXPECTS(config.sync_timeout_s > 0, "sim sync_timeout_s must be positive, got " +
                                            std::to_string(config.sync_timeout_s));
  Sim& s = the_sim();
  std::unique_lock<std::mutex> lk(s.mu);
  s.shutdown(lk);
  // Reserve now, so that an address space the process cannot have is an
  // error here rather than an out-of-memory code at some later allocation.
  const bool reserved = s.arena.reserve(config.address_space);
  s.apply_config(reserved ? config : s.cfg);
  MK_EXPECTS(reserved,
             "sim address_space of " + std::to_string(config.address_space) +
                 " bytes could not be reserved (mmap failed); choose a smaller address_space "
                 "(under ThreadSanitizer about 256 GiB is the most that reliably fits)");
}

Config config() {
  Sim& s = the_sim();
  std::lock_guard<std::mutex> lk(s.mu);
  return s.cfg;
}

void reset() {
  Sim& s = the_sim();
  std::unique_lock<std::mutex> lk(s.mu);
  s.shutdown(lk);
  s.apply_config(s.cfg);
}

void set_capacity(std::size_t bytes) {
  Sim& s = the_sim();
  std::lock_guard<std::mutex> lk(s.mu);
  s.cfg.capacity = bytes;
}

void fail_allocations(std::uint64_t nth, std::uint64_t count) {
  MK_EXPECTS(nth >= 1, "fail_allocations: nth counts from 1 (the next allocation), got 0");
  Sim& s = the_sim();
  std::lock_guard<std::mutex> lk(s.mu);
  s.fail_from = s.allocation_requests + nth;
  s.fail_until = s.fail_from + count;
}

std::size_t release_events() {
  Sim& s = the_sim();
  std::lock_guard<std::mutex> lk(s.mu);
  const std::size_t released = s.hold_issued - s.hold_released;
  s.hold_released = s.hold_issued;
  s.changed.notify_all();
  return released;
}

void hold_events(bool on) {
  {
    Sim& s = the_sim();
    std::lock_guard<std::mutex> lk(s.mu);
    s.holding = on;
  }
  if (!on) release_events();
}

void set_random_delays(std::uint64_t max_delay_us, std::uint64_t seed) {
  Sim& s = the_sim();
  std::lock_guard<std::mutex> lk(s.mu);
  s.max_delay_us = max_delay_us;
  s.rng.seed(seed);
}

void set_link_bandwidth(double bytes_per_second) {
  MK_EXPECTS(std::isfinite(bytes_per_second) && bytes_per_second >= 0,
             "set_link_bandwidth: bytes_per_second must be finite and >= 0, got " + std::to_string(bytes_per_second));
  Sim& s = the_sim();
  std::lock_guard<std::mutex> lk(s.mu);
  s.link_bandwidth = bytes_per_second;
}

void run_kernel(double seconds, std::uintptr_t stream) {
  MK_EXPECTS(std::isfinite(seconds) && seconds >= 0,
             "run_kernel: seconds must be finite and >= 0, got " + std::to_string(seconds));
  Sim& s = the_sim();
  std::lock_guard<std::mutex> lk(s.mu);
  Stream& st = control_stream(s, stream);
  s.set_clock(st, s.start_time(st) + seconds);
}

double clock(std::uintptr_t stream) {
  Sim& s = the_sim();
  std::lock_guard<std::mutex> lk(s.mu);
  return control_stream(s, stream).clock;
}

double host_clock() {
  Sim& s = the_sim();
  std::lock_guard<std::mutex> lk(s.mu);
  return s.host_clock;
}

Stats stats() {
  Sim& s = the_sim();
  std::lock_guard<std::mutex> lk(s.mu);
  Stats out;
  out.devices = s.devices;
  out.host_bytes_in_use = s.host_in_use;
  out.host_peak_bytes = s.host_peak;
  out.reserved_bytes = s.reserved_bytes;
  out.mapped_bytes = s.mapped_bytes;
  out.bytes_copied = s.bytes_copied;
  out.modelled_link_seconds = s.link_seconds;
  out.injected_failures = s.injected_failures;
  out.async_errors = s.async_errors;
  out.held_events = s.hold_issued - s.hold_released;
  out.live_streams = static_cast<int>(s.streams.size());
  out.live_events = static_cast<int>(s.events.size());
  return out;
}

void reset_peak() {
  Sim& s = the_sim();
  std::lock_guard<std::mutex> lk(s.mu);
  for (auto& d : s.devices) d.peak_bytes = d.bytes_in_use;
  s.host_peak = s.host_in_use;
}

std::map<std::string, std::uint64_t> counters() { return the_sim().counter_map(); }

bool is_device_memory(std::uintptr_t ptr, std::size_t bytes) {
  Sim& s = the_sim();
  std::lock_guard<std::mutex> lk(s.mu);
  return s.device_range_ok(ptr, bytes, true);
}

}  // namespace sim
}  // namespace mk
