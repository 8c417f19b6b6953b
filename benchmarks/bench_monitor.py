"""What ``MemoryMonitor`` costs per training step, with PyTorch-allocator statistics.

    python benchmarks/bench_monitor.py [--steps 2000]

No GPU is needed: the monitor reads ``torch.cuda.memory_stats_as_nested_dict`` (the statistics
``torch.cuda.memory_stats`` flattens), here a stand-in that builds a fresh dict of the layout
the CUDA caching allocator returns on every call, so the cost measured is the monitor's plus
building that dict in Python; the C++ call that fills it on a GPU is left out. Each step
marks the three phases (what the forward / optimizer hooks do) and ends with ``step()``,
writing CSV and JSONL rows; a second run adds TensorBoard scalars. Prints the median cost per
step over repeats and checks issue 21's target: under 1 ms per step (exit status 1 if missed).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from memkernels.forensics.monitor import MemoryMonitor, TorchCudaStats  # noqa: E402

TARGET_SECONDS = 1e-3
STATS = ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes", "inactive_split_bytes", "allocation",
         "segment", "active", "inactive_split")


def nested_stats(device=None):
    """The layout of ``torch.cuda.memory_stats_as_nested_dict()`` on a GPU, with plausible figures."""
    stats = {name: {pool: {"current": 1 << 30, "peak": 2 << 30, "allocated": 7 << 30, "freed": 6 << 30}
                    for pool in ("all", "small_pool", "large_pool")} for name in STATS}
    stats["oversize_allocations"] = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
    stats["oversize_segments"] = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
    stats["reserved_bytes_by_private_pools"] = {}
    stats.update(num_alloc_retries=0, num_ooms=0, num_sync_all_streams=0, num_device_alloc=40, num_device_free=3,
                 num_oom_rejections=0, max_split_size=-1)
    return stats


def time_steps(steps, repeats, **outputs):
    """Median seconds per monitored step (three phase marks + step()) over ``repeats`` runs."""
    per_step = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            options = {k: os.path.join(tmp, v) for k, v in outputs.items()}
            source = TorchCudaStats(device=0, nested_stats=nested_stats, reset_peak=lambda device: None)
            with MemoryMonitor(source=source, **options) as monitor:
                start = time.perf_counter()
                for _ in range(steps):
                    for phase in ("forward", "backward", "optimizer"):
                        monitor._mark(phase)  # what the module / optimizer hooks call
                    monitor.step()
                per_step.append((time.perf_counter() - start) / steps)
    return statistics.median(per_step)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.cuda.memory.memory_stats_as_nested_dict = nested_stats  # no CUDA here: PyTorch's layout, its flattening
    keys = len(torch.cuda.memory_stats(0))
    print(f"MemoryMonitor.step() with PyTorch-allocator statistics ({keys} figures per read, 4 reads per step), "
          f"{args.steps} steps, median of {args.repeats} runs, on the CPU")
    failed = False
    for label, outputs in (("CSV + JSONL", {"csv": "m.csv", "jsonl": "m.jsonl"}),
                           ("CSV + JSONL + TensorBoard", {"csv": "m.csv", "jsonl": "m.jsonl", "log_dir": "tb"})):
        seconds = time_steps(args.steps, args.repeats, **outputs)
        ok = seconds < TARGET_SECONDS
        failed |= not ok
        print(f"  {label:<28} {seconds * 1e6:8.1f} us per step   target < {TARGET_SECONDS * 1e3:.0f} ms: "
              f"{'met' if ok else 'MISSED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
