"""Activation offload: step time and activation memory, per mode, in one table.

Modes, each trained for --steps steps on the same model (the first two are not measured: "auto"'s first
block offloads everything and measures the forward's time):
  none        no offload;
  everything  memkernels.OffloadActivations(budget=None): every eligible saved tensor;
  auto        memkernels.OffloadActivations(): what the link hides behind the forward (bandwidth x forward
              time per block), the rest kept on the device ("kept for budget");
  recompute   torch.utils.checkpoint (non-reentrant) around each block, no offload;
  checkpoints offloaded checkpoints: recompute, with memkernels.OffloadActivations(only_checkpoint_inputs=True)
              moving each block's input to the host (the last one stays), one block ahead in backward.

Columns: the median step time; per step, the bytes offloaded and those the budget kept on the device; the
device bytes allocated after forward (offload copies completed, their device buffers freed) and at the
step's peak; and the resident saved bytes: what the forward allocated and left on the device for backward,
measured by memkernels.meters.PeakBytesMeter opened just before the forward (storages that existed before
it, and their frees, do not count).

On a CUDA GPU: a stack of nn.TransformerEncoderLayer blocks under bf16 autocast; step times with
torch.cuda.synchronize and perf_counter, the memory columns from one more step. Allocated bytes after
forward and at the peak are torch.cuda's own counters, absolute: the first GPU run (H200) measured
"resident" as a difference from a base taken before the context was entered, and printed -3195 MiB and
"173% saved", because the base held memory the offload context released at its entry (the meter above
does not count such frees).

Without one (or with --sim): the simulated device (memkernels.device.sim), whose tensors are CPU tensors,
with its link model. Each layer is Linear + GELU + a stand-in kernel of --sim-kernel-ms forward and twice
that backward; the step times are MODELLED, read from the simulator's clocks (the link's copies and the
stand-in kernels), not measured, and deterministic. Allocated bytes are a PeakBytesMeter's, opened before
the model was built: every tensor of the run, weights included.

    python benchmarks/bench_offload.py [--layers 8] [--dim 2048] [--heads 16] [--seq 2048] [--batch 4]
                                       [--steps 6]
    python benchmarks/bench_offload.py --sim [--sim-link-mib-s 64] [--sim-layers 8] [--sim-tokens 256]
                                             [--sim-dim 64] [--sim-kernel-ms 1.0] [--steps 6]
"""
import argparse
import contextlib
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import memkernels
from memkernels import device
from memkernels.device import sim
from memkernels.meters import PeakBytesMeter
from memkernels.testing import ModelledKernel, settle_offload_copies

MiB = 1 << 20
MODES = ("none", "everything", "auto", "recompute", "checkpoints")
RECOMPUTED = ("recompute", "checkpoints")  # the modes that checkpoint each block
SKIPPED_STEPS = 2
# Real time the simulator's threads may take over a step's copies (settle_offload_copies) or a blocking call,
# before failing.
SIM_TIMEOUT_S = 600.0


def make_manager(mode, **kwargs):
    """The OffloadActivations of `mode`, or None for the modes without offload."""
    if mode == "everything":
        return memkernels.OffloadActivations(budget=None, **kwargs)
    if mode == "auto":
        return memkernels.OffloadActivations(**kwargs)
    if mode == "checkpoints":
        return memkernels.OffloadActivations(only_checkpoint_inputs=True, **kwargs)
    return None


def counters(manager):
    """(bytes offloaded, bytes kept for the budget) so far; None without offload."""
    if manager is None:
        return None
    stats = manager.stats()
    return stats["bytes_offloaded"], stats["kept_by_reason"]["budget"]


def per_step(before, after):
    """The step's bytes offloaded and kept for the budget, from counters() before and after it."""
    if before is None:
        return {}
    return {"offloaded": after[0] - before[0], "kept_budget": after[1] - before[1]}


def auto_figures(mode, manager):
    """What "auto" based its budget on, from stats(): kept in its row."""
    if mode != "auto":
        return {}
    stats = manager.stats()
    return {"budget": stats["budget_bytes"], "forward_s": stats["forward_seconds"], "link": stats["link_bandwidth"]}


def format_table(rows):
    def mib(value):
        return "-" if value is None else f"{value / MiB:.2f}"

    lines = [f"{'mode':12}{'step ms':>10}{'offloaded/step':>16}{'after forward':>15}{'step peak':>11}"
             f"{'resident saved':>16}{'kept for budget':>17}"]
    for row in rows:
        lines.append(f"{row['mode']:12}{row['step_s'] * 1e3:10.2f}{mib(row.get('offloaded')):>16}"
                     f"{mib(row['after_forward']):>15}{mib(row['peak']):>11}{mib(row['resident']):>16}"
                     f"{mib(row.get('kept_budget')):>17}")
    by_mode = {row["mode"]: row for row in rows}
    auto, none = by_mode["auto"], by_mode["none"]
    lines.append(f"auto: budget {mib(auto['budget'])} MiB per block = link {auto['link'] / 1e9:.3g} GB/s x forward "
                 f"{auto['forward_s'] * 1e3:.2f} ms")
    recompute, checkpoints = by_mode["recompute"], by_mode["checkpoints"]
    lines.append(f"auto step / none step {auto['step_s'] / none['step_s']:.3f}; recompute step / none step "
                 f"{recompute['step_s'] / none['step_s']:.3f}; checkpoints step / recompute step "
                 f"{checkpoints['step_s'] / recompute['step_s']:.3f}")
    return "\n".join(lines)


def summarize(mode, steps, extra):
    """One table row: the median of each figure over the measured steps."""
    return {"mode": mode, **{key: statistics.median(step[key] for step in steps) for key in steps[0]}, **extra}


# ------------------------------------------------------------------------------------------------ CUDA


def build(layers, dim, heads):
    blocks = [nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
              for _ in range(layers)]
    return nn.Sequential(*blocks).cuda()


def cuda_step(model, x, mode, manager):
    """Forward of one step, under the mode's offload context; returns the loss."""
    with manager if manager is not None else contextlib.nullcontext(), torch.autocast("cuda", dtype=torch.bfloat16):
        for block in model:
            x = checkpoint(block, x, use_reentrant=False) if mode in RECOMPUTED else block(x)
        return x.float().pow(2).mean()


def timed(model, x, mode, manager, steps):
    """Median wall time of a training step (forward + backward) after the skipped steps."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        cuda_step(model, x, mode, manager).backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[SKIPPED_STEPS:])


def memory_of_a_step(model, x, mode, manager):
    """Absolute device bytes allocated at forward's end (after the offload copies completed: their device
    buffers are freed then) and at the step's peak; the forward's resident bytes; the offload counters."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = counters(manager)
    with PeakBytesMeter() as forward:
        loss = cuda_step(model, x, mode, manager)
        if manager is not None:
            manager.wait_for_offloads()
    after_forward = torch.cuda.memory_allocated()
    loss.backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return {"after_forward": after_forward, "peak": torch.cuda.max_memory_allocated(),
            "resident": forward.current_bytes, **per_step(before, counters(manager))}


def run_cuda(args):
    torch.manual_seed(0)
    model = build(args.layers, args.dim, args.heads)
    x = torch.randn(args.batch, args.seq, args.dim, device="cuda", requires_grad=True)
    rows = []
    for mode in MODES:
        manager = make_manager(mode)
        try:
            step_s = timed(model, x, mode, manager, args.steps)
            rows.append(summarize(mode, [memory_of_a_step(model, x, mode, manager)],
                                  {"step_s": step_s, **auto_figures(mode, manager)}))
        finally:
            if manager is not None:
                manager.close()
    print(f"{args.layers} blocks, dim {args.dim}, batch {args.batch} x seq {args.seq}, bf16 autocast; step times "
          f"measured (median of steps {SKIPPED_STEPS + 1}-{args.steps}); device MiB allocated (torch.cuda counters)")
    print(format_table(rows))
    return rows


# ------------------------------------------------------------------------------------------------ simulated device


class TimedLayers(nn.Module):
    """`layers` of Linear + GELU + a kernel of `seconds` forward (2x backward): each layer saves two
    [tokens, dim] float32 storages (the Linear's input, GELU's input)."""

    def __init__(self, layers, dim, seconds):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.seconds = seconds

    def layer(self, linear, x):
        return ModelledKernel.apply(F.gelu(linear(x)), self.seconds)

    def forward(self, x, recompute=False):
        for linear in self.linears:
            if recompute:
                # Early stop off: recomputation would stop at the layer's last saved tensor, before the kernel
                # (it saves nothing), which stands for the compute a GPU runs again.
                with set_checkpoint_early_stop(False):
                    x = checkpoint(self.layer, linear, x, use_reentrant=False)
            else:
                x = self.layer(linear, x)
        return x.pow(2).mean()


def sim_step(model, x, mode, manager, allocated):
    """One step's modelled time, allocated bytes (from the `allocated` meter) and offload counters."""
    before = counters(manager)
    allocated.restart_peak()
    start = max(sim.clock(), sim.host_clock())  # when a kernel issued now would start
    with PeakBytesMeter() as forward:
        with manager if manager is not None else contextlib.nullcontext():
            loss = model(x, recompute=mode in RECOMPUTED)
        if manager is not None:
            settle_offload_copies(manager, timeout=SIM_TIMEOUT_S)
    after_forward = allocated.current_bytes
    loss.backward()
    model.zero_grad()
    device.synchronize()  # the step ends when the device is done, copies included
    return {"step_s": max(sim.clock(), sim.host_clock()) - start, "after_forward": after_forward,
            "peak": allocated.peak_bytes, "resident": forward.current_bytes, **per_step(before, counters(manager))}


def run_sim(args):
    device.use_sim()
    sim.configure(device_count=1, capacity=1 << 30, host_capacity=None, granularity=64 << 10, memory="backed",
                  address_space=1 << 36, sync_timeout_s=SIM_TIMEOUT_S)
    sim.set_link_bandwidth(args.sim_link_mib_s * MiB)
    rows = []
    with PeakBytesMeter() as allocated:
        torch.manual_seed(0)
        model = TimedLayers(args.sim_layers, args.sim_dim, args.sim_kernel_ms / 1e3)
        x = torch.randn(args.sim_tokens, args.sim_dim, requires_grad=True)
        for mode in MODES:
            # min_offload_bytes=0: the model's saved storages (tokens x dim float32) are under the 1 MiB default
            manager = make_manager(mode, min_offload_bytes=0)
            try:
                steps = [sim_step(model, x, mode, manager, allocated) for _ in range(args.steps)]
                rows.append(summarize(mode, steps[SKIPPED_STEPS:], auto_figures(mode, manager)))
            finally:
                if manager is not None:
                    manager.close()
    print(f"MODELLED step times (simulated device: a {args.sim_link_mib_s:g} MiB/s link and stand-in kernels of "
          f"{args.sim_kernel_ms:g} ms forward, {2 * args.sim_kernel_ms:g} ms backward per layer, on its clocks), "
          "not measured")
    print(f"{args.sim_layers} layers (Linear + GELU + kernel), {args.sim_tokens} tokens x dim {args.sim_dim}, fp32; "
          f"median of steps {SKIPPED_STEPS + 1}-{args.steps}; MiB allocated (PeakBytesMeter over the run)")
    print(format_table(rows))
    return rows


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help=f"steps per mode, the first {SKIPPED_STEPS} unmeasured")
    parser.add_argument("--sim", action="store_true", help="the simulated device (the default without CUDA)")
    parser.add_argument("--sim-link-mib-s", type=float, default=64.0)
    parser.add_argument("--sim-layers", type=int, default=8)
    parser.add_argument("--sim-tokens", type=int, default=256)
    parser.add_argument("--sim-dim", type=int, default=64)
    parser.add_argument("--sim-kernel-ms", type=float, default=1.0)
    args = parser.parse_args(argv)
    if args.steps <= SKIPPED_STEPS:
        parser.error(f"--steps: more than {SKIPPED_STEPS} (the first {SKIPPED_STEPS} are not measured)")
    return args


def main(argv=None):
    """Print the table; return its rows (dicts; bytes and seconds)."""
    args = parse(argv)
    if args.sim or not torch.cuda.is_available():
        return run_sim(args)
    return run_cuda(args)


if __name__ == "__main__":
    main()
