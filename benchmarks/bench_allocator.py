"""Replay every recorded trace: PyTorch's caching-allocator policy (model) vs memkernels vs ideal.

    python benchmarks/bench_allocator.py [TRACE_DIR_OR_FILES...]   (default: ../shared/traces
next to the repository)

Prints, per trace, peak reserved / peak requested (ideal 1.000), device allocations, and
memkernels' ns per malloc/free (median of repeated replays on a virtual-address device), then
checks issue 4's targets: memkernels <= 1.05 and never above PyTorch's ratio, device
allocations <= 1.5x PyTorch's, ns/op <= 250 (a goal). Exit status 1 if a target is missed.
"""
import argparse
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from memkernels.allocator import print_replay_table  # noqa: E402

REPO = os.path.dirname(HERE)
# ../shared/traces next to the checkout; a git worktree sits one level deeper (wt/<name>).
TRACE_DIR_CANDIDATES = [os.path.join(REPO, "..", "shared", "traces"), os.path.join(REPO, "..", "..", "shared", "traces")]


def _trace_files(arguments):
    if not arguments:
        found = [d for d in TRACE_DIR_CANDIDATES if os.path.isdir(d)]
        if not found:
            raise SystemExit(f"no trace directory found at {TRACE_DIR_CANDIDATES}; pass trace files or a directory")
        arguments = found[:1]
    files = []
    for arg in arguments:
        if os.path.isdir(arg):
            files += sorted(glob.glob(os.path.join(arg, "*.pickle")))
        elif os.path.isfile(arg):
            files.append(arg)
        else:
            raise SystemExit(f"{arg!r} is neither a trace file nor a directory")
    if not files:
        raise SystemExit(f"no *.pickle traces found in {arguments}")
    return files


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="*", help="trace files or directories (default: ../shared/traces)")
    parser.add_argument("--repeats", type=int, default=21, help="replays per trace for the ns/op median")
    args = parser.parse_args(argv)
    rows = print_replay_table(_trace_files(args.traces), repeats=args.repeats)
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
            f"device allocations {allocs:.2f}x PyTorch's <= 1.5x": allocs <= 1.5,
            f"{ours['ns_per_op']:.0f} ns/op <= 250 (goal)": ours["ns_per_op"] <= 250,
        }
        missed += sum(not ok for ok in checks.values())
        verdicts = ", ".join(f"{text}: {'ok' if ok else 'MISSED'}" for text, ok in checks.items())
        print(f"{row['trace']} (device {row['device']}): {verdicts}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
