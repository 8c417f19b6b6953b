#include "plan/placement_dp.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "common/check.hpp"

namespace mk::plan {

std::optional<std::vector<int>> cheapest_placement(const std::vector<std::int64_t>& needs, const std::vector<std::int64_t>& steps,
                                    const std::vector<double>& seconds, std::int64_t cap, std::int64_t end) {
  const std::size_t options = steps.size();
  MK_EXPECTS(options > 0 && options < 128, "cheapest_placement: steps must name 1 to 127 options, got " +
                                               std::to_string(options));
  MK_EXPECTS(seconds.size() == options, "cheapest_placement: seconds has " + std::to_string(seconds.size()) +
                                            " entries; give one per option (" + std::to_string(options) + ")");
  MK_EXPECTS(needs.size() % options == 0, "cheapest_placement: needs has " + std::to_string(needs.size()) +
                                              " entries, not a multiple of the options (" + std::to_string(options) +
                                              "); give layers x options, row-major");
  MK_EXPECTS(cap >= 0 && cap < (std::int64_t{1} << 24), "cheapest_placement: cap must be in [0, 2^24), got " +
                                                            std::to_string(cap));
  MK_EXPECTS(end >= 0, "cheapest_placement: end must be >= 0, got " + std::to_string(end));
  for (std::size_t k = 0; k < options; ++k) {
    MK_EXPECTS(steps[k] >= 0, "cheapest_placement: steps[" + std::to_string(k) + "] is negative");
  }
  const std::size_t layers = needs.size() / options;
  const std::size_t states = static_cast<std::size_t>(cap) + 1;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> dp(states, inf), next(states);
  dp[0] = 0.0;
  std::vector<signed char> back(layers * states, 0);  // the option that reached (layer, state)
  std::vector<std::int64_t> cap_origin(layers, cap);   // the source of the saturated state, per layer
  for (std::size_t i = 0; i < layers; ++i) {
    std::fill(next.begin(), next.end(), inf);
    signed char* chosen = back.data() + i * states;
    for (std::size_t k = 0; k < options; ++k) {
      const std::int64_t need = needs[i * options + k];
      if (need > cap) continue;
      const std::int64_t shift = std::min(steps[k], cap);
      const double cost = seconds[k];
      // Below the cap each target t has one source, t - shift.
      for (std::int64_t source = std::max<std::int64_t>(need, 0); source < cap - shift; ++source) {
        const double value = dp[source] + cost;
        if (value < next[source + shift]) {
          next[source + shift] = value;
          chosen[source + shift] = static_cast<signed char>(k);
        }
      }
      // The cap takes the cheapest of the sources that reach it, the one of most savings on a tie.
      std::int64_t best_source = cap;
      double best = cap >= need ? dp[cap] + cost : inf;
      for (std::int64_t source = cap - 1; source >= std::max(need, cap - shift); --source) {
        const double value = dp[source] + cost;
        if (value < best) {
          best = value;
          best_source = source;
        }
      }
      if (best < next[cap]) {
        next[cap] = best;
        chosen[cap] = static_cast<signed char>(k);
        cap_origin[i] = best_source;
      }
    }
    dp.swap(next);
  }
  if (end > cap) return std::nullopt;
  std::int64_t state = end;
  for (std::int64_t s = end + 1; s <= cap; ++s) {
    if (dp[s] < dp[state]) state = s;
  }
  if (dp[state] == inf) return std::nullopt;
  std::vector<int> choice(layers);
  for (std::size_t i = layers; i-- > 0;) {
    const int k = back[i * states + state];
    choice[i] = k;
    state = state == cap ? cap_origin[i] : state - std::min(steps[k], cap);
  }
  return choice;
}

}  // namespace mk::plan
