"""Activation offload on a GPU: step-time overhead and activation memory saved.

A stack of transformer blocks (bf16 autocast) is trained for a few steps with
and without memkernels.OffloadActivations; for each it prints the median step
time and the device memory still allocated at the end of forward (what the
saved activations occupy), from torch.cuda's own counters.

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


def resident_after_forward(model, x, context):
    """Device bytes allocated by forward and still held when it ends (saved activations)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    loss = step(model, x, context)
    if hasattr(context, "wait_for_offloads"):
        context.wait_for_offloads()  # device copies are freed once their D2H copy completed
    resident = torch.cuda.memory_allocated() - base
    loss.backward()
    model.zero_grad(set_to_none=True)
    return resident


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
    base_time, base_resident = timed(model, x, args.steps, plain), resident_after_forward(model, x, plain)
    offload = memkernels.OffloadActivations()
    off_time, off_resident = timed(model, x, args.steps, offload), resident_after_forward(model, x, offload)
    stats = offload.stats()
    offload.close()
    print(f"{args.layers} blocks, dim {args.dim}, batch {args.batch} x seq {args.seq}, bf16 autocast")
    print(f"{'':24}{'step ms':>10}{'resident after fwd MiB':>26}")
    print(f"{'without offload':24}{base_time * 1e3:10.1f}{base_resident / 2**20:26.1f}")
    print(f"{'OffloadActivations':24}{off_time * 1e3:10.1f}{off_resident / 2**20:26.1f}")
    print(f"step-time overhead {off_time / base_time - 1:+.1%}; activation memory saved "
          f"{1 - off_resident / base_resident:.1%}; pinned pool {stats['pinned_bytes'] / 2**20:.0f} MiB, "
          f"prefetch hits {stats['prefetch_hits']}, restores on demand {stats['restores_on_demand']}")


if __name__ == "__main__":
    main()
