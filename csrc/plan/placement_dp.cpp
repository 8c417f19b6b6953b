#include "plan/placement_dp.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "common/check.hpp"

namespace mk::plan {

namespace {

struct Point {
  std::int64_t saved;  // bytes saved by the layers so far (saturated at the largest need)
  double cost;
  std::int32_t parent;  // index in the previous layer's front
  std::int32_t option;
};

}  // namespace

std::optional<std::vector<int>> cheapest_placement(const std::vector<std::int64_t>& needs,
                                                   const std::vector<std::int64_t>& steps,
                                                   const std::vector<double>& seconds, std::int64_t end) {
  const std::size_t options = steps.size();
  MK_EXPECTS(options > 0, "cheapest_placement: steps must name at least one option");
  MK_EXPECTS(seconds.size() == options, "cheapest_placement: seconds has " + std::to_string(seconds.size()) +
                                            " entries; give one per option (" + std::to_string(options) + ")");
  MK_EXPECTS(needs.size() % options == 0, "cheapest_placement: needs has " + std::to_string(needs.size()) +
                                              " entries, not a multiple of the options (" + std::to_string(options) +
                                              "); give layers x options, row-major");
  MK_EXPECTS(end >= 0, "cheapest_placement: end must be >= 0, got " + std::to_string(end));
  for (std::size_t k = 0; k < options; ++k) {
    MK_EXPECTS(steps[k] >= 0, "cheapest_placement: steps[" + std::to_string(k) + "] is negative");
  }
  // Savings past the largest need meet every need alike: saturating there keeps the fronts short.
  std::int64_t cap = end;
  for (const std::int64_t need : needs) {
    MK_EXPECTS(need >= 0, "cheapest_placement: needs must be >= 0 (a need met by nothing saved is 0)");
    cap = std::max(cap, need);
  }
  const std::size_t layers = needs.size() / options;
  std::vector<std::vector<Point>> fronts(1, std::vector<Point>{{0, 0.0, -1, -1}});
  std::vector<Point> reached;
  for (std::size_t i = 0; i < layers; ++i) {
    const std::vector<Point>& front = fronts.back();
    reached.clear();
    for (std::size_t j = 0; j < front.size(); ++j) {
      for (std::size_t k = 0; k < options; ++k) {
        if (front[j].saved < needs[i * options + k]) continue;
        reached.push_back({std::min(cap, front[j].saved + steps[k]), front[j].cost + seconds[k],
                           static_cast<std::int32_t>(j), static_cast<std::int32_t>(k)});
      }
    }
    // The Pareto front: by savings from the most, a point stays only if it costs less than every point saving more.
    std::sort(reached.begin(), reached.end(), [](const Point& a, const Point& b) {
      if (a.saved != b.saved) return a.saved > b.saved;
      if (a.cost != b.cost) return a.cost < b.cost;
      if (a.option != b.option) return a.option < b.option;
      return a.parent < b.parent;
    });
    std::vector<Point> next;
    double cheapest = std::numeric_limits<double>::infinity();
    for (const Point& point : reached) {
      if (point.cost < cheapest) {
        next.push_back(point);
        cheapest = point.cost;
      }
    }
    if (next.empty()) return std::nullopt;
    fronts.push_back(std::move(next));
  }
  // Along a front the cost falls with the savings: the cheapest point saving at least `end` is the last such.
  const std::vector<Point>& last = fronts.back();
  std::int64_t index = -1;
  for (std::size_t j = 0; j < last.size() && last[j].saved >= end; ++j) index = static_cast<std::int64_t>(j);
  if (index < 0) return std::nullopt;
  std::vector<int> choice(layers);
  for (std::size_t i = layers; i > 0; --i) {
    const Point& point = fronts[i][static_cast<std::size_t>(index)];
    choice[i - 1] = point.option;
    index = point.parent;
  }
  return choice;
}

}  // namespace mk::plan
