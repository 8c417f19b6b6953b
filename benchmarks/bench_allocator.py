"""Replay every recorded trace: PyTorch's caching-allocator policy (model) vs memkernels vs ideal.

    python benchmarks/bench_allocator.py [TRACE_DIR_OR_FILES...]   (default: ../shared/traces
next to the repository; the traces are not in the repository, README "Traces" says where they
come from)
    python benchmarks/bench_allocator.py --no-traces   (the held-out synthetic workloads alone)

Prints, per trace, peak reserved / peak requested (ideal 1.000), device allocations, and
memkernels' ns per malloc/free (median of repeated replays on a virtual-address device), then
checks issue 4's targets: memkernels <= 1.05 and never above PyTorch's ratio, device
allocations <= 1.25x PyTorch's (issue 18), ns/op <= 250 (a goal). Then the same with expandable segments
(memkernels' and the model of PyTorch's ``expandable_segments:True``), with map / unmap counts,
and issue 8's targets: memkernels <= 1.01 and never above PyTorch's expandable ratio. Exit
status 1 if a target is missed. Then replays synthetic training loops, with the same classic
targets, and for each loop that makes more than 1.25x PyTorch's device allocations, why
(:func:`memkernels.forensics.replay.device_allocation_causes`). Last, every periodic loop (each trace
repeated as one step of a loop, the fixed-scale synthetic loops, the capacity loop's 8-step
triangle wave repeated): device allocations / frees per step from step 3 on, memkernels' pool
(told where each step ends, as ``install()``'s optimizer hook does) beside PyTorch's model
(:func:`memkernels.forensics.replay.replay_periodic`), and issue 33's target: none from step 3 on
(a cudaMalloc inside a step costs that step).

    python benchmarks/bench_allocator.py --no-traces --seeds 3-8   (held-out seeds of the loops)
"""
import statistics
import argparse
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from memkernels.forensics.replay import (  # noqa: E402
    ALLOCATION_CAUSES,
    TraceError,
    device_allocation_causes,
    load_trace,
    print_replay_table,
    replay,
    replay_periodic,
    replay_pytorch_model,
    trace_files,
    trace_ops,
)

REPO = os.path.dirname(HERE)
# Issue 18: each device allocation is a cudaMalloc (milliseconds, a device synchronization).
ALLOC_RATIO_TARGET = 1.25
# ../shared/traces next to the checkout; a git worktree sits one level deeper (wt/<name>).
TRACE_DIR_CANDIDATES = [os.path.join(REPO, "..", "shared", "traces"), os.path.join(REPO, "..", "..", "shared", "traces")]


def _trace_files(arguments):
    if not arguments:
        found = [d for d in TRACE_DIR_CANDIDATES if os.path.isdir(d)]
        if not found:
            raise SystemExit(
                f"no trace directory found at {TRACE_DIR_CANDIDATES}: the recorded traces are not part of the "
                "repository (README, 'Traces', says where they come from). Pass trace files or a directory, or "
                "--no-traces for the held-out synthetic workloads alone")
        arguments = found[:1]
    try:
        return trace_files(arguments)
    except (TraceError, FileNotFoundError) as error:
        raise SystemExit(str(error)) from None


def _trace_writer():
    """(events, alloc(size) -> address, free(address)): a device trace written call by call."""
    events, next_addr = [], [0]

    def alloc(size):
        next_addr[0] += 1
        events.append({"action": "alloc", "addr": next_addr[0], "size": size, "stream": 0})
        return next_addr[0]

    def free(addr):
        events.append({"action": "free_completed", "addr": addr, "size": 0, "stream": 0})

    return events, alloc, free


def synthetic_trace(seed, kind, steps=30, layers=24):
    """A training-loop-shaped trace that played no part in tuning the policy.

    Persistent parameters, then per step: a forward pass whose layers save activations and
    free a temporary each, and a backward pass freeing them in reverse with a gradient-sized
    temporary each. ``kind``: "growing" (the batch grows 10% of the first each step, as in a
    batch-size ramp), "random" (batch scale uniform in [0.5, 2]) or "fixed" (one batch scale,
    drawn uniform in [0.5, 2], and the same requests every step: a periodic loop, period 1 step)."""
    if kind not in ("growing", "random", "fixed"):
        raise ValueError(f"kind must be 'growing', 'random' or 'fixed', got {kind!r}")
    rng = random.Random(seed)
    events, alloc, free = _trace_writer()
    mib = 1 << 20

    for _ in range(40):
        alloc(rng.choice([4, 8, 16, 32, 64]) * mib)
    if kind == "fixed":  # drawn only here: the other kinds keep the requests they always had
        fixed_scale, step_seed = rng.uniform(0.5, 2.0), rng.getrandbits(64)
    for step in range(steps):
        if kind == "fixed":
            scale, rng = fixed_scale, random.Random(step_seed)  # every step draws the same requests
        else:
            scale = 1 + step / 10 if kind == "growing" else rng.uniform(0.5, 2.0)
        saved = []
        for _ in range(layers):
            temporary = alloc(int(scale * rng.choice([3, 6, 12]) * mib) + rng.randrange(1 << 16))
            saved.append(alloc(int(scale * rng.choice([2, 5, 9, 20]) * mib)))
            if rng.random() < 0.5:
                saved.append(alloc(rng.randrange(1, 1 << 20)))
            free(temporary)
        for addr in reversed(saved):
            gradient = alloc(int(scale * 4 * mib))
            free(addr)
            free(gradient)
    return {"segments": [], "device_traces": [events]}


def capacity_trace(seed, steps=24, layers=12):
    """The shape of issue 18's other recorded runs: GiB-sized requests (up to 4.9 GiB) that grow
    and shrink with the batch (a triangle wave, 0.35x to 1x every 8 steps) over ~40 GiB of
    persistent state; replayed on devices close to its peak live bytes."""
    rng = random.Random(seed)
    events, alloc, free = _trace_writer()
    gib = 1 << 30

    for _ in range(30):
        alloc(int(rng.uniform(0.5, 1.5) * gib))
    for step in range(steps):
        phase = step % 8
        scale = 0.35 + 0.65 * min(phase, 8 - phase) / 4
        saved = []
        for _ in range(layers):
            temporary = alloc(int(scale * rng.choice([0.5, 1.0, 2.0]) * gib) + rng.randrange(1 << 20))
            saved.append(alloc(int(scale * rng.choice([0.4, 1.1, 2.5, 4.9]) * gib)))
            free(temporary)
        for addr in reversed(saved):
            gradient = alloc(int(scale * 1.2 * gib))
            free(addr)
            free(gradient)
    return {"segments": [], "device_traces": [events]}


def expandable_table(rows, repeats):
    """Expandable segments next to the classic figures of ``rows`` (from print_replay_table).
    Returns the number of missed targets."""
    print("\nExpandable segments (peak reserved / peak requested; maps / unmaps = num_device_alloc / _free):")
    header = (
        f"{'trace':<38} {'dev':>3} | {'PyTorch':>7} {'PyT exp':>7} {'maps':>5} {'unmaps':>6} | "
        f"{'memkernels':>10} {'mk exp':>7} {'maps':>5} {'unmaps':>6} {'ns/op':>6}"
    )
    print(header)
    print("-" * len(header))
    verdicts, missed = [], 0
    for row in rows:
        trace = load_trace(row["path"])
        ideal = row["ideal_peak_bytes"]
        runs = [replay(trace, device=row["device"], expandable_segments=True) for _ in range(max(1, repeats))]
        ours = runs[0]
        ns = statistics.median(r["ns_per_op"] for r in runs)
        theirs = replay_pytorch_model(trace, device=row["device"], expandable_segments=True)
        ratio, torch_ratio = ours["peak_reserved_bytes"] / ideal, theirs["peak_reserved_bytes"] / ideal
        print(
            f"{row['trace'][:38]:<38} {row['device']:>3} | {row['pytorch']['peak_reserved_bytes'] / ideal:>7.3f} "
            f"{torch_ratio:>7.4f} {theirs['num_device_alloc']:>5} {theirs['num_device_free']:>6} | "
            f"{row['memkernels']['peak_reserved_bytes'] / ideal:>10.3f} {ratio:>7.4f} {ours['num_device_alloc']:>5} "
            f"{ours['num_device_free']:>6} {ns:>6.0f}"
        )
        checks = {
            f"expandable ratio {ratio:.4f} <= 1.01": ratio <= 1.01,
            f"<= PyTorch's expandable {torch_ratio:.4f}": ours["peak_reserved_bytes"] <= theirs["peak_reserved_bytes"],
        }
        missed += sum(not ok for ok in checks.values())
        verdicts.append(f"{row['trace']} (device {row['device']}): " + ", ".join(
            f"{text}: {'ok' if ok else 'MISSED'}" for text, ok in checks.items()))
    print("PyTorch expandable: 2 MiB pages (small pool), 20 MiB (large); memkernels: the device's 2 MiB granularity.")
    print()
    for verdict in verdicts:
        print(verdict)
    return missed


# Seeds 0-2 of the synthetic loops chose issue 18's release rule; 3 and above are held out.
TUNED_SEEDS = range(3)


def _seeds(text):
    """'0-2' or '3,5,7' -> a list of seeds."""
    try:
        if "-" in text:
            first, last = (int(part) for part in text.split("-"))
            seeds = list(range(first, last + 1))
        else:
            seeds = [int(part) for part in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"--seeds must be a range like 0-8 or a list like 3,5 of seeds >= 0, "
                                          f"got {text!r}")
    return seeds


def _extra_allocations_text(trace, capacity):
    """The pool's device allocations on requests that PyTorch's policy served from its cache, by cause."""
    causes = device_allocation_causes(trace, capacity=capacity)
    extra = {cause: causes[cause]["pool"] - causes[cause]["pytorch_too"] for cause in ALLOCATION_CAUSES}
    return "allocations on requests PyTorch served from its cache, by cause: " + ", ".join(
        f"{cause} {extra[cause]}" for cause in ALLOCATION_CAUSES)


def held_out(seeds=TUNED_SEEDS):
    """memkernels vs PyTorch's policy on synthetic loops, with unlimited memory and with a
    device 1.3x the peak live bytes (where PyTorch's policy must release its cache on OOM); and
    on the GiB-request shape of :func:`capacity_trace` on devices 1.1x and 1.03x its peak live.
    Under a row whose device allocations miss the target: the pool's extra allocations by cause.
    Returns the number of missed targets (peak ratio, never above PyTorch, device allocations)."""
    held = [seed for seed in seeds if seed not in TUNED_SEEDS]
    print(f"\nSynthetic training loops, seeds {', '.join(map(str, seeds))} (seeds 0-2 were used to choose issue "
          f"18's release rule{'; held out: ' + ', '.join(map(str, held)) if held else ''}):")
    print(
        f"{'workload':<14} {'device':<16} {'PyTorch':>8} {'dev.alloc':>9} {'memkernels':>10} {'dev.alloc':>9} "
        f"{'alloc x':>7} {'PyT exp':>8} {'mk exp':>8}"
    )
    missed = 0
    workloads = [(f"{kind} #{seed}", synthetic_trace(seed, kind), (1.3,)) for kind in ("growing", "random")
                 for seed in seeds]
    workloads += [(f"capacity #{seed}", capacity_trace(seed), (1.1, 1.03)) for seed in seeds]
    for name, trace, fractions in workloads:
        _, _, ideal = trace_ops(trace["device_traces"][0])
        devices = [("unlimited", None)] + [(f"{f}x peak live", int(f * ideal)) for f in fractions]
        for label, capacity in devices:
            theirs = replay_pytorch_model(trace, capacity=capacity)
            ours = replay(trace, capacity=capacity)
            theirs_exp = replay_pytorch_model(trace, capacity=capacity, expandable_segments=True)
            ours_exp = replay(trace, capacity=capacity, expandable_segments=True)
            ooms = [r["num_ooms"] for r in (theirs, ours, theirs_exp, ours_exp)]
            allocs = ours["num_device_alloc"] / theirs["num_device_alloc"]
            # Issue 33 withdrew the allocation ratio on the capacity loops (it traded against the peak);
            # what a step pays for, allocations per step once a loop repeats, is judged in periodic_table.
            judge_allocs = not name.startswith("capacity")
            ok = (ours["peak_reserved_bytes"] / ideal <= 1.05
                  and ours["peak_reserved_bytes"] <= theirs["peak_reserved_bytes"]
                  and (allocs <= ALLOC_RATIO_TARGET or not judge_allocs))
            missed += not ok
            print(
                f"{name:<14} {label:<16} {theirs['peak_reserved_bytes'] / ideal:>8.3f} "
                f"{theirs['num_device_alloc']:>9} {ours['peak_reserved_bytes'] / ideal:>10.3f} "
                f"{ours['num_device_alloc']:>9} {allocs:>7.2f} {theirs_exp['peak_reserved_bytes'] / ideal:>8.3f} "
                f"{ours_exp['peak_reserved_bytes'] / ideal:>8.3f}"
                + ("" if ok else "  MISSED")
                + ("  (OOMs: PyTorch %d, memkernels %d, PyTorch exp. %d, memkernels exp. %d)" % tuple(ooms)
                   if any(ooms) else "")
            )
            if allocs > ALLOC_RATIO_TARGET:
                print(f"{'':<14} {'':<16} {_extra_allocations_text(trace, capacity)}")
    print(f"targets: memkernels <= 1.05 and <= PyTorch; device allocations <= {ALLOC_RATIO_TARGET}x PyTorch's on the "
          "growing and random loops (withdrawn on the capacity loops by issue 33: see the periodic table)")
    print("causes: no_fit = no free block large enough; oversize = the oversize rule kept the request off a free "
          "block; released = idle segments released before growth first; refused = the device refused, cache released")
    return missed


# Issue 33: a cudaMalloc inside a step costs that step; once a loop repeats, the cache should serve it.
PERIODIC_STEPS = 8  # steps (capacity: 8-step periods) replayed per loop; judged from step 3 on
PERIODIC_FROM = 3


def periodic_loops(files, seeds):
    """The periodic loops: (name, trace of one step or period, [(device label, capacity or None)]).

    Each shared trace is one step, repeated (:func:`memkernels.forensics.replay.periodic_ops`: what it
    leaves live stays, allocated once, or is carried to the next step). The fixed-scale synthetic
    loops repeat one step; :func:`capacity_trace`'s triangle wave repeats its first 8-step period.
    Devices as in :func:`held_out`, but for capacity 1.03x: there both policies fail requests in
    every period (the loop does not fit), so its counts describe out-of-memory retries."""
    loops = [(os.path.basename(path), load_trace(path), [("unlimited", None)]) for path in files]
    for kind, seed_trace, fractions in (("fixed", lambda s: synthetic_trace(s, "fixed", steps=1), (1.3,)),
                                        ("capacity", lambda s: capacity_trace(s, steps=8), (1.1,))):
        for seed in seeds or ():
            trace = seed_trace(seed)
            _, _, ideal = trace_ops(trace["device_traces"][0])
            devices = [("unlimited", None)] + [(f"{f}x peak live", int(f * ideal)) for f in fractions]
            loops.append((f"{kind} #{seed}", trace, devices))
    return loops


def _counts(result, step):
    return f"{result['device_allocs'][step]}/{result['device_frees'][step]}"


def _late(result):
    """(max allocations, max frees) per step from step PERIODIC_FROM on."""
    first = PERIODIC_FROM - 1
    return max(result["device_allocs"][first:]), max(result["device_frees"][first:])


def periodic_table(files, seeds, steps=PERIODIC_STEPS):
    """Device allocations / frees per step of every periodic loop, memkernels' pool beside the model of
    PyTorch's policy, classic segments (and, last, the most per step of both with expandable segments).
    Target: the pool makes none from step 3 on. Returns the number of rows that miss it."""
    loops = periodic_loops(files, seeds)
    if not loops:
        return 0
    print(f"\nPeriodic loops: device allocations / frees per step (a/f), steps {PERIODIC_FROM}-{steps} "
          f"(a trace or fixed-scale loop repeated: per step; capacity: per 8-step period):")
    header = (
        f"{'loop':<38} {'device':<16} | {'step 1':>7} {'step 2':>6} {'3+ max':>6} {'peak':>6} | "
        f"{'step 1':>7} {'step 2':>6} {'3+ max':>6} {'last':>6} {'peak':>6} | {'PyTorch':>7} {'mk':>5}"
    )
    print(f"{'':<55} | {'PyTorch (model)':^28} | {'memkernels':^35} | {'expandable':^13}".rstrip())
    print(header)
    print("-" * len(header))
    missed = 0
    for name, trace, devices in loops:
        for label, capacity in devices:
            row = replay_periodic(trace, steps=steps, capacity=capacity)
            exp = replay_periodic(trace, steps=steps, capacity=capacity, expandable_segments=True)
            ideal = row["ideal_peak_bytes"]
            theirs, ours = row["pytorch"], row["memkernels"]
            late = _late(ours)
            ok = late == (0, 0)
            missed += not ok
            ooms = [r["num_ooms"] for r in (theirs, ours, exp["pytorch"], exp["memkernels"])]
            print(
                f"{name[:38]:<38} {label:<16} | {_counts(theirs, 0):>7} {_counts(theirs, 1):>6} "
                f"{'%d/%d' % _late(theirs):>6} {theirs['peak_reserved_bytes'] / ideal:>6.3f} | "
                f"{_counts(ours, 0):>7} {_counts(ours, 1):>6} {'%d/%d' % late:>6} {_counts(ours, -1):>6} "
                f"{ours['peak_reserved_bytes'] / ideal:>6.3f} | {'%d/%d' % _late(exp['pytorch']):>7} "
                f"{'%d/%d' % _late(exp['memkernels']):>5}"
                + ("" if ok else "  MISSED")
                + ("  (OOMs: PyTorch %d, memkernels %d, PyTorch exp. %d, memkernels exp. %d)" % tuple(ooms)
                   if any(ooms) else "")
            )
    print(f"a/f in step 1, in step 2; 3+ max: the most in one step (capacity: one period) of steps "
          f"{PERIODIC_FROM}-{steps}; last: in step {steps}; peak: peak reserved / peak live bytes of the whole loop. "
          f"expandable: 3+ max with expandable segments (page maps / unmaps).")
    print(f"target: memkernels (classic segments) makes 0 device allocations and 0 frees per step from step "
          f"{PERIODIC_FROM} on (issue 33)")
    return missed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="*", help="trace files or directories (default: ../shared/traces)")
    parser.add_argument("--repeats", type=int, default=21, help="replays per trace for the ns/op median")
    parser.add_argument("--no-held-out", action="store_true",
                        help="skip the synthetic workloads (the loops above and the periodic synthetic loops)")
    parser.add_argument("--no-traces", action="store_true",
                        help="only the synthetic workloads (they need no recorded trace)")
    parser.add_argument("--seeds", type=_seeds, default=list(TUNED_SEEDS),
                        help="seeds of the synthetic loops, e.g. 0-8 or 3,4 (default 0-2, the tuned ones; 3 and up "
                             "are held out)")
    args = parser.parse_args(argv)
    if args.no_traces:
        return 1 if held_out(args.seeds) + periodic_table([], args.seeds) else 0
    files = _trace_files(args.traces)
    rows = print_replay_table(files, repeats=args.repeats)
    by_name = {os.path.basename(f): f for f in files}
    for row in rows:
        row["path"] = by_name[row["trace"]]
    print()
    missed = 0
    for row in rows:
        ideal = row["ideal_peak_bytes"]
        ours, theirs = row["memkernels"], row["pytorch"]
        ratio, torch_ratio = ours["peak_reserved_bytes"] / ideal, theirs["peak_reserved_bytes"] / ideal
        allocs = ours["num_device_alloc"] / theirs["num_device_alloc"]
        checks = {
            f"ratio {ratio:.4f} <= 1.05": ratio <= 1.05,
            f"ratio <= PyTorch's {torch_ratio:.4f}": ours["peak_reserved_bytes"] <= theirs["peak_reserved_bytes"],
            f"device allocations {allocs:.2f}x PyTorch's <= {ALLOC_RATIO_TARGET}x": allocs <= ALLOC_RATIO_TARGET,
            f"{ours['ns_per_op']:.0f} ns/op <= 250 (goal)": ours["ns_per_op"] <= 250,
        }
        missed += sum(not ok for ok in checks.values())
        verdicts = ", ".join(f"{text}: {'ok' if ok else 'MISSED'}" for text, ok in checks.items())
        print(f"{row['trace']} (device {row['device']}): {verdicts}")
    missed += expandable_table(rows, args.repeats)
    if not args.no_held_out:
        missed += held_out(args.seeds)
    missed += periodic_table(files, None if args.no_held_out else args.seeds)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
