#include "core/policy.hpp"

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/check.hpp"

namespace mk::core {

namespace {
std::size_t round_up(std::size_t n, std::size_t multiple) { return (n + multiple - 1) / multiple * multiple; }
}  // namespace

Policy Policy::pytorch() {
  Policy p;
  p.fitted_request_limit = 10 * kMiB;
  p.fitted_segment_max = 0;  // 0: a fixed 20 MiB segment below fitted_request_limit
  p.release_before_growth = -1.0;
  p.oversize_block = 0;
  return p;
}

std::size_t Policy::round_size(std::size_t bytes) const {
  return bytes < min_block ? min_block : round_up(bytes, min_block);
}

PoolKind Policy::pool_for(std::size_t rounded) const {
  return rounded <= small_request ? PoolKind::small : PoolKind::large;
}

std::size_t Policy::segment_size(std::size_t rounded) const {
  if (rounded <= small_request) return small_segment;
  if (rounded >= fitted_request_limit) return round_up(rounded, segment_granularity);
  if (fitted_segment_max == 0) return 20 * kMiB;
  // k copies of the request in the least wasteful granular segment; ties go to
  // the larger k (fewer device allocations).
  std::size_t best = round_up(rounded, segment_granularity);
  double best_waste = double(best - rounded) / double(best);
  for (std::size_t k = 2; k * rounded <= fitted_segment_max; ++k) {
    std::size_t seg = round_up(k * rounded, segment_granularity);
    double waste = double(seg - k * rounded) / double(seg);
    if (waste <= best_waste) best = seg, best_waste = waste;
  }
  return best;
}

bool Policy::should_split(PoolKind pool, std::size_t block_size, std::size_t rounded) const {
  std::size_t remaining = block_size - rounded;
  return pool == PoolKind::small ? remaining >= min_block : remaining >= large_split_min;
}

std::size_t Policy::largest_block_for(std::size_t rounded) const {
  if (oversize_block == 0) return SIZE_MAX;
  double by_ratio = double(rounded) * oversize_ratio;
  std::size_t ratio_limit = by_ratio >= double(SIZE_MAX) ? SIZE_MAX : std::size_t(by_ratio);
  return std::max(oversize_block - 1, ratio_limit);
}

void Policy::validate() const {
  MK_EXPECTS(min_block > 0 && (min_block & (min_block - 1)) == 0,
             "min_block must be a positive power of two, got " + std::to_string(min_block));
  MK_EXPECTS(small_segment >= small_request && small_segment % min_block == 0,
             "small_segment must be a multiple of min_block and at least small_request");
  MK_EXPECTS(segment_granularity > 0 && segment_granularity % min_block == 0,
             "segment_granularity must be a positive multiple of min_block");
  MK_EXPECTS(oversize_block == 0 || oversize_ratio >= 1.0,
             "oversize_ratio must be >= 1 (or set oversize_block=0 to disable the rule)");
  MK_EXPECTS(large_split_min >= min_block,
             "large_split_min must be at least min_block (a split must leave a real block), got " +
                 std::to_string(large_split_min));
  MK_EXPECTS(release_before_growth < 1.0,
             "release_before_growth must be below 1 (a fraction of reserved memory; negative disables it)");
}

}  // namespace mk::core
