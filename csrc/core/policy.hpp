// Size rounding, pool choice, segment sizing and splitting: the policy, as data
// plus pure functions, so that tests can state every rule directly.
//
// Why this policy (measured on the traces in ../shared/traces, see
// benchmarks/bench_allocator.py): PyTorch's caching allocator loses memory in
// three places, and each knob below answers one of them.
//  1. Segment tails. A 7.8 MiB request gets a 20 MiB segment: two fit, 4.4 MiB
//     is stranded. memkernels sizes mid-size segments as k copies of the
//     request (at most `fitted_segment_max` bytes), choosing the k whose
//     2 MiB-granular segment wastes least: 2 x 7.8 MiB -> 16 MiB (2.3% waste),
//     4 x 2.5 MiB -> exactly 10 MiB.
//  2. Cached segments that are whole and free while the pool grows. PyTorch
//     releases its cache only when the device refuses; until then the peak
//     includes idle segments. memkernels releases whole free segments before a
//     new segment would raise reserved memory above its previous peak, when
//     they amount to at least `release_before_growth` of reserved memory, and
//     only as many as cover the excess (times kReleaseHeadroom): the least
//     recently used segment that covers it alone, else the largest first.
//     Releasing every idle segment there (the rule until issue 18) kept the peak
//     as low but cost 1.5-2.7x PyTorch's device allocations on training loops
//     whose batch changes: the rest of the step needed most of those segments
//     again, and each came back as a cudaMalloc.
//  3. Large pristine segments carved up by much smaller requests, which pins
//     them with a stranded tail. A free block at least `oversize_block` large
//     serves only requests at least 1/`oversize_ratio` of its size.
#pragma once

#include <cstddef>

namespace mk::core {

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * kKiB;

// Larger requests are refused as out of memory before any size arithmetic can overflow.
constexpr std::size_t kMaxRequest = std::size_t(1) << 62;

enum class PoolKind : int { small = 0, large = 1 };
constexpr int kNumPools = 2;

// Rule 2 releases idle segments worth this many times the growth's excess over
// the high-water mark: exactly the excess leaves the next growth nothing.
constexpr double kReleaseHeadroom = 1.5;

struct Policy {
  std::size_t min_block = 512;             // every size is a multiple of this
  std::size_t small_request = 1 * kMiB;    // requests up to this come from the small pool
  std::size_t small_segment = 2 * kMiB;    // small-pool segment size
  std::size_t segment_granularity = 2 * kMiB;  // large segments are multiples of this
  std::size_t fitted_request_limit = 10 * kMiB;  // below: fitted multi-block segments
  std::size_t fitted_segment_max = 28 * kMiB;    // ... of at most this size (below oversize_block)
  std::size_t large_split_min = 1 * kMiB + 1;    // large-pool remainders below this stay attached
  double release_before_growth = 0.02;     // <0 disables; see (2) above
  std::size_t oversize_block = 32 * kMiB;  // 0 disables; see (3) above
  double oversize_ratio = 4.0;

  // PyTorch's documented defaults (the baseline the benchmark compares with).
  static Policy pytorch();

  std::size_t round_size(std::size_t bytes) const;
  PoolKind pool_for(std::size_t rounded) const;
  std::size_t segment_size(std::size_t rounded) const;
  bool should_split(PoolKind pool, std::size_t block_size, std::size_t rounded) const;
  // The largest free block that may serve a request of `rounded` bytes: blocks
  // below `oversize_block` always may, larger ones up to oversize_ratio x the request.
  std::size_t largest_block_for(std::size_t rounded) const;
  void validate() const;
};

}  // namespace mk::core
