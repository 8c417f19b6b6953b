// Counters the pool keeps as it goes (cheap, exact) and the derived figures
// computed on request (fragmentation, free-block histogram).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/policy.hpp"

namespace mk::core {

// A gauge with its high-water mark and cumulative increases/decreases.
struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  // total increase over the run
  std::int64_t freed = 0;      // total decrease over the run

  void add(std::int64_t n) {
    current += n;
    allocated += n;
    if (current > peak) peak = current;
  }
  void sub(std::int64_t n) {
    current -= n;
    freed += n;
  }
  void reset_peak() { peak = current; }
};

// The gauges kept per pool (small, large) and summed per device.
struct PoolStats {
  Stat allocated_bytes;   // sizes of blocks handed out (rounded)
  Stat requested_bytes;   // sizes callers asked for
  Stat active_bytes;      // allocated + freed but still in use by another stream
  Stat reserved_bytes;    // segments held from the device
  Stat allocation_count;  // blocks handed out
  Stat segment_count;
  Stat active_count;
};

constexpr int kHistogramBuckets = 48;  // free blocks by floor(log2(size))

struct DeviceStats {
  std::array<PoolStats, kNumPools> pools;
  PoolStats total;
  std::int64_t num_device_alloc = 0;
  std::int64_t num_device_free = 0;
  std::int64_t num_alloc_retries = 0;
  std::int64_t num_ooms = 0;
  std::int64_t num_early_releases = 0;  // segments released before the pool grew
  std::int64_t num_gc_releases = 0;     // segments released by the GC threshold
  std::int64_t num_steps = 0;           // steps ended (DevicePool::end_step calls after an allocation)
  std::int64_t num_repeated_steps = 0;  // of those, steps that repeated the one before throughout
  bool repeating_loop = false;          // this step so far repeats the last: the repeating-loop rules hold
  // Derived when the snapshot of stats is taken:
  std::int64_t free_bytes = 0;          // cached free (inactive) bytes
  std::int64_t largest_free_block = 0;
  std::int64_t memory_cap = 0;          // 0: none
  std::array<std::int64_t, kHistogramBuckets> free_histogram{};

  double fragmentation() const {
    return total.reserved_bytes.current == 0
               ? 0.0
               : 1.0 - double(total.allocated_bytes.current) / double(total.reserved_bytes.current);
  }
  double external_fragmentation() const {
    return free_bytes == 0 ? 0.0 : 1.0 - double(largest_free_block) / double(free_bytes);
  }
};

}  // namespace mk::core
