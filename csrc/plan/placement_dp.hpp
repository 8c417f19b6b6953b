// The placement DP of memkernels/planning/placement.py: one option per decoder layer, the prefix savings as the
// state, the least added seconds for each state. Python prepares the figures (its module docstring has the model);
// this loop is what a plan(seq="max") search runs about a thousand times (32-80 layers x 12 options x 4,097
// states each), which numpy's per-slice calls made the largest cost of a search with host memory.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace mk::plan {

// `needs`: layers x options, row-major: the quantized savings option o needs before layer i (0 and up; above `cap`:
// the option cannot be taken there). `steps`: quantized savings of each option; `seconds`: its cost. States run
// 0..cap, the top one saturated ("cap or more"). Returns the option of each layer of a cheapest path reaching a state
// of at least `end`, or nothing when none does. Ties: the earlier option; at the cap, the source of more
// savings; at the end, the state of fewer savings (the numpy DP's choices, which tests pin by brute force).
std::optional<std::vector<int>> cheapest_placement(const std::vector<std::int64_t>& needs, const std::vector<std::int64_t>& steps,
                                    const std::vector<double>& seconds, std::int64_t cap, std::int64_t end);

}  // namespace mk::plan
