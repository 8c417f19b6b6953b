"""Activation offload on a GPU: step-time overhead and activation memory saved.

A stack of transformer blocks (bf16 autocast) is trained for a few steps with
and without memkernels.OffloadActivations; for each it prints the median step
time and, from torch.cuda's own counters, the device memory allocated between
steps, at the end of forward (weights, input and what the saved activations
occupy) and at the step's peak. All three are absolute: the first GPU run (H200)
measured "resident" as a difference from a base taken before the context was
entered, and printed -3195 MiB and "173% saved", because the base held memory
the offload context released at its entry.

Needs a CUDA GPU: without one it prints that it skipped and exits 0 (the
simulated-device measurements live in tests/test_offload.py).

    python benchmarks/bench_offload.py [--layers 8] [--dim 2048] [--seq 2048] [--batch 4]
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn


def build(layers, dim, heads):
    blocks = [nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
              for _ in range(layers)]
    return nn.Sequential(*blocks).cuda()


def step(model, x, context):
    with context, torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    return loss


def timed(model, x, steps, context):
    """Median wall time of a training step (forward + backward), after a warm-up step."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(model, x, context).backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def memory_of_a_step(model, x, context):
    """Absolute device bytes allocated: before forward (left by the previous step), at forward's end
    (after the offload copies completed: their device buffers are freed then), and the step's peak."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = step(model, x, context)
    if hasattr(context, "wait_for_offloads"):
        context.wait_for_offloads()
    after_forward = torch.cuda.memory_allocated()
    loss.backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return {"before": before, "after_forward": after_forward, "peak": torch.cuda.max_memory_allocated()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_offload: skipped (needs a CUDA GPU; none is available here)")
        return

    import contextlib

    import memkernels

    torch.manual_seed(0)
    model = build(args.layers, args.dim, args.heads)
    x = torch.randn(args.batch, args.seq, args.dim, device="cuda", requires_grad=True)
    plain = contextlib.nullcontext()
    base_time, base = timed(model, x, args.steps, plain), memory_of_a_step(model, x, plain)
    offload = memkernels.OffloadActivations()
    off_time, off = timed(model, x, args.steps, offload), memory_of_a_step(model, x, offload)
    stats = offload.stats()
    offload.close()
    mib = 2**20
    print(f"{args.layers} blocks, dim {args.dim}, batch {args.batch} x seq {args.seq}, bf16 autocast; "
          "device MiB allocated (torch.cuda counters)")
    print(f"{'':24}{'step ms':>10}{'between steps':>15}{'after forward':>15}{'step peak':>11}")
    for label, t, m in (("without offload", base_time, base), ("OffloadActivations", off_time, off)):
        print(f"{label:24}{t * 1e3:10.1f}{m['before'] / mib:15.1f}{m['after_forward'] / mib:15.1f}"
              f"{m['peak'] / mib:11.1f}")
    print(f"step-time overhead {off_time / base_time - 1:+.1%}; allocated after forward "
          f"{(base['after_forward'] - off['after_forward']) / mib:+.0f} MiB less, step peak "
          f"{(base['peak'] - off['peak']) / mib:+.0f} MiB less; pinned pool {stats['pinned_bytes'] / mib:.0f} MiB, "
          f"prefetch hits {stats['prefetch_hits']}, restores on demand {stats['restores_on_demand']}")


if __name__ == "__main__":
    main()
