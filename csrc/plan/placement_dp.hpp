// The placement DP of memkernels/planning/placement.py: one option per decoder layer, at the least added seconds,
// such that before each layer the bytes saved by the layers before it cover what that layer's option needs. Exact:
// each layer's states are the Pareto front of (bytes saved, seconds) over the paths reaching it, so no byte is
// rounded (a DP over savings quantized to 1/4,096 of the largest need lost up to a quantum a layer: Llama-3-8B at
// 411,648 tokens on 8 x 80 GB with 1 TB of host memory, 0.6 GB of slack in 70 GB, it found no placement within the
// host budget where keeping every layer's checkpoint on the host moves 100 GB). Fronts measured on Llama-3-8B's
// profiles, 8k-400k tokens, every price: 1 to 50 points.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace mk::plan {

// `needs`: layers x options, row-major: bytes option o needs saved before layer i (0 or more). `steps`: bytes each
// option saves; `seconds`: what it costs. Returns the option of each layer of a cheapest path that meets every need
// and saves at least `end` bytes in all, or nothing when none does. Ties (equal savings and cost) go to the option
// listed first, decided from the last layer back (a saving needed once is taken at the first layer).
std::optional<std::vector<int>> cheapest_placement(const std::vector<std::int64_t>& needs,
                                                   const std::vector<std::int64_t>& steps,
                                                   const std::vector<double>& seconds, std::int64_t end);

}  // namespace mk::plan
