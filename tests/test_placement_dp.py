"""The planner's placement DP in the C++ core (csrc/plan/, ``memkernels._C.plan.cheapest_placement``) against
brute force over every path, and its errors. No torch: the module runs under the sanitizers too
(tests/test_sanitizers.py); placement.solve's own brute-force test (tests/test_plan.py) covers the figures
Python prepares for it."""
import itertools
import random

import pytest

from memkernels._C import plan

pytestmark = pytest.mark.cpp


def walk(needs, steps, cap, choices):
    """The state after each layer of ``choices`` (None where an option's need is not met)."""
    options, state = len(steps), 0
    for layer, option in enumerate(choices):
        if state < needs[layer * options + option]:
            return None
        state = min(cap, state + steps[option])
    return state


def brute_force(needs, steps, seconds, cap, end):
    """The least cost of a path ending at a state >= ``end`` (None: none does)."""
    costs = []
    for choices in itertools.product(range(len(steps)), repeat=len(needs) // len(steps)):
        state = walk(needs, steps, cap, choices)
        if state is not None and state >= end:
            costs.append(sum(seconds[o] for o in choices))
    return min(costs) if costs else None


def random_case(rng):
    layers, options, cap = rng.randint(1, 5), rng.randint(1, 4), rng.randint(0, 30)
    steps = [rng.choice((0, rng.randint(0, 40))) for _ in range(options)]
    # whole seconds make ties common: the DP must still return a cheapest path
    seconds = [float(rng.randint(0, 4)) if rng.random() < 0.6 else rng.random() * 4 for _ in range(options)]
    needs = [rng.randint(0, cap + 4) if rng.random() < 0.5 else 0 for _ in range(layers * options)]
    return needs, steps, seconds, cap, rng.randint(0, cap + 2)


def test_cheapest_placement_is_a_cheapest_path_or_none_when_no_path_exists():
    """On 600 random cases (up to 5 layers x 4 options, states 0..30, many ties): None exactly when brute force finds
    no path; else a path that meets every need, ends at a state >= end and costs what the cheapest path costs."""
    rng = random.Random(1234)
    feasible = 0
    for _ in range(600):
        needs, steps, seconds, cap, end = random_case(rng)
        best = brute_force(needs, steps, seconds, cap, end)
        found = plan.cheapest_placement(needs, steps, seconds, cap, end)
        if best is None:
            assert found is None, (needs, steps, seconds, cap, end, found)
            continue
        feasible += 1
        state = walk(needs, steps, cap, found)
        assert state is not None and state >= end, (needs, steps, cap, end, found)
        assert sum(seconds[o] for o in found) == best
    assert 150 < feasible < 550  # both outcomes are exercised


def test_ties_go_to_the_option_listed_first():
    """Two options of equal cost and savings: every layer takes the first (placement.py's "keep before recompute
    before offload"); a saving needed once at the end is taken at the first layer, as the later ones keep."""
    assert plan.cheapest_placement([0] * 6, [5, 5], [1.0, 1.0], cap=10, end=0) == [0, 0, 0]
    assert plan.cheapest_placement([0] * 6, [0, 5], [0.0, 1.0], cap=10, end=5) == [1, 0, 0]


def test_saturated_state_and_zero_layers():
    """Savings past the cap stay at the cap (a layer's need is met by it); no layers: the empty path, feasible when
    end is 0."""
    assert plan.cheapest_placement([0, 0, 10, 10], [0, 25], [0.0, 1.0], cap=10, end=10) == [1, 0]
    assert plan.cheapest_placement([], [3], [1.0], cap=4, end=0) == []
    assert plan.cheapest_placement([], [3], [1.0], cap=4, end=1) is None
    assert plan.cheapest_placement([0], [3], [1.0], cap=4, end=5) is None  # end above the cap


@pytest.mark.parametrize("arguments, named", [
    (dict(needs=[0, 0], steps=[], seconds=[], cap=4, end=0), "steps must name"),
    (dict(needs=[0, 0], steps=[1, 2], seconds=[1.0], cap=4, end=0), "seconds has 1 entries"),
    (dict(needs=[0, 0, 0], steps=[1, 2], seconds=[1.0, 2.0], cap=4, end=0), "not a multiple of the options"),
    (dict(needs=[0, 0], steps=[1, 2], seconds=[1.0, 2.0], cap=-1, end=0), "cap must be"),
    (dict(needs=[0, 0], steps=[1, 2], seconds=[1.0, 2.0], cap=4, end=-2), "end must be"),
    (dict(needs=[0, 0], steps=[1, -2], seconds=[1.0, 2.0], cap=4, end=0), "steps[1] is negative"),
])
def test_bad_arguments_raise_value_errors_that_name_them(arguments, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        plan.cheapest_placement(**arguments)
