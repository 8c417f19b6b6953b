"""The planner's placement DP in the C++ core (csrc/plan/, ``memkernels._C.plan.cheapest_placement``) against
brute force over every path, and its errors. No torch: the module runs under the sanitizers too
(tests/test_sanitizers.py); placement.solve's own brute-force test (tests/test_plan.py) covers the figures
Python prepares for it."""
import itertools
import random

import pytest

from memkernels._C import plan

pytestmark = pytest.mark.cpp


def walk(needs, steps, choices):
    """The bytes saved after ``choices`` (None where an option's need is not met)."""
    options, saved = len(steps), 0
    for layer, option in enumerate(choices):
        if saved < needs[layer * options + option]:
            return None
        saved += steps[option]
    return saved


def brute_force(needs, steps, seconds, end):
    """The least cost of a path saving at least ``end`` bytes (None: none does)."""
    costs = []
    for choices in itertools.product(range(len(steps)), repeat=len(needs) // len(steps)):
        saved = walk(needs, steps, choices)
        if saved is not None and saved >= end:
            costs.append(sum(seconds[o] for o in choices))
    return min(costs) if costs else None


def random_case(rng):
    layers, options = rng.randint(1, 5), rng.randint(1, 4)
    steps = [rng.choice((0, rng.randint(0, 40))) for _ in range(options)]
    # whole seconds make ties common: the DP must still return a cheapest path
    seconds = [float(rng.randint(0, 4)) if rng.random() < 0.6 else rng.random() * 4 for _ in range(options)]
    needs = [rng.randint(0, 60) if rng.random() < 0.5 else 0 for _ in range(layers * options)]
    return needs, steps, seconds, rng.randint(0, 80)


def test_cheapest_placement_is_a_cheapest_path_or_none_when_no_path_exists():
    """On 600 random cases (up to 5 layers x 4 options, many ties): None exactly when brute force finds no path;
    else a path that meets every need, saves at least end and costs what the cheapest path costs."""
    rng = random.Random(1234)
    feasible = 0
    for _ in range(600):
        needs, steps, seconds, end = random_case(rng)
        best = brute_force(needs, steps, seconds, end)
        found = plan.cheapest_placement(needs, steps, seconds, end)
        if best is None:
            assert found is None, (needs, steps, seconds, end, found)
            continue
        feasible += 1
        saved = walk(needs, steps, found)
        assert saved is not None and saved >= end, (needs, steps, end, found)
        assert sum(seconds[o] for o in found) == best
    assert 150 < feasible < 550  # both outcomes are exercised


def test_no_byte_is_rounded():
    """Savings of 10^12 + 1 bytes a layer, needs one byte short of what every layer before saves, over 32 layers:
    exact to the byte (a DP over savings in 4,096 steps of the largest need rounds 32 quanta of 7.8 GB away), and
    one byte more at the end than all layers save has no path."""
    step, layers = 10 ** 12 + 1, 32
    needs = [max(0, i * step - 1) for i in range(layers) for _option in range(2)]
    assert plan.cheapest_placement(needs, [0, step], [0.0, 1.0], end=layers * step) == [1] * layers
    assert plan.cheapest_placement(needs, [0, step], [0.0, 1.0], end=layers * step + 1) is None


def test_ties_go_to_the_option_listed_first():
    """Two options of equal cost and savings: every layer takes the first (placement.py's "keep before recompute
    before offload"); a saving needed once at the end is taken at the first layer, as the later ones keep."""
    assert plan.cheapest_placement([0] * 6, [5, 5], [1.0, 1.0], end=0) == [0, 0, 0]
    assert plan.cheapest_placement([0] * 6, [0, 5], [0.0, 1.0], end=5) == [1, 0, 0]


def test_zero_layers():
    """No layers: the empty path, which saves nothing."""
    assert plan.cheapest_placement([], [3], [1.0], end=0) == []
    assert plan.cheapest_placement([], [3], [1.0], end=1) is None


@pytest.mark.parametrize("arguments, named", [
    (dict(needs=[0, 0], steps=[], seconds=[], end=0), "steps must name"),
    (dict(needs=[0, 0], steps=[1, 2], seconds=[1.0], end=0), "seconds has 1 entries"),
    (dict(needs=[0, 0, 0], steps=[1, 2], seconds=[1.0, 2.0], end=0), "not a multiple of the options"),
    (dict(needs=[0, -1], steps=[1, 2], seconds=[1.0, 2.0], end=0), "needs must be >= 0"),
    (dict(needs=[0, 0], steps=[1, 2], seconds=[1.0, 2.0], end=-2), "end must be"),
    (dict(needs=[0, 0], steps=[1, -2], seconds=[1.0, 2.0], end=0), "steps[1] is negative"),
])
def test_bad_arguments_raise_value_errors_that_name_them(arguments, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        plan.cheapest_placement(**arguments)
