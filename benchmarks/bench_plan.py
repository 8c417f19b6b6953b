"""memkernels.plan against PyTorch's compile-time activation_memory_budget and checkpointing every layer.

On the CPU, on one tiny memkernels TransformerLM (Llama-shaped), for budgets of 25/50/75/100%
of the eager step's activation peak, it prints side by side:

- memkernels: ``place()`` at that budget in bytes, applied with ``memkernels.apply`` (eager);
- PyTorch: ``torch._functorch.config.activation_memory_budget`` = the same fraction, under
  ``torch.compile`` with the ``aot_eager`` backend (AOTAutograd's min-cut partitioner picks
  what to recompute; the budget is a ratio of saved activations, not a peak). The backend is
  aot_eager's own definition with instrumented no-op compilers: the meters are opened when
  the compiled forward starts and closed when the compiled backward ends, because an active
  dispatch mode around the call makes Dynamo run the model eagerly instead;
- checkpointing every layer (eager, non-reentrant).

Peak bytes of one training step (PeakBytesMeter, gradients allocated beforehand) and the
FLOPs recomputed (FlopCounterMode over the step, minus the same model's step without
recompute). Then the time ``plan()`` takes for Llama-3-70B's config (80 layers, 8 x 80 GB).

Known gap: below budget 1.0 the compiled step's counted FLOPs come out *lower* than at 1.0
(a negative "recompute"), which recomputation cannot do; the cause (ops the counter does not
see inside the window the meters are open, or a different graph) is not understood, so the
torch recompute column is not a trustworthy figure yet; its peak column is measured over the
same window.

    python benchmarks/bench_plan.py [--layers 8] [--hidden 128] [--seq 256] [--batch 2]
"""
import argparse
import json
import subprocess
import sys
import time

import torch
from functorch.compile import min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

import memkernels
from memkernels.meters import PeakBytesMeter
from memkernels.models import ModelConfig, TransformerLM
from memkernels.tools import plan_apply
from memkernels.tools.placement import OPTION_BY_NAME, flop_counter
from memkernels.tools.plan import place, plan

LLAMA_3_70B = ModelConfig(name="llama-3-70b", vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
                          num_kv_heads=8, intermediate_size=28672, max_seq_len=8192, rope_theta=500000.0)


def measure(model, ids):
    """(peak bytes, FLOPs) of one training step; FLOPs in a second step (the counter holds tensors)."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    with PeakBytesMeter() as meter:
        model(ids, ids).backward()
    with flop_counter() as counter:
        model(ids, ids).backward()
    return meter.peak_bytes, counter.get_total_flops()


class _Probe:
    """Meters (context managers) to open at the compiled forward's start and close at the backward's end."""

    meters = None


def _nop(kind):
    def compiler(graph, _example_inputs):
        def run(args):
            if kind == "forward" and _Probe.meters:
                for meter in _Probe.meters:
                    meter.__enter__()
            out = torch.fx.Interpreter(graph).boxed_run(args)
            if kind == "backward" and _Probe.meters:
                for meter in reversed(_Probe.meters):
                    meter.__exit__(None, None, None)
                _Probe.meters = None
            return out
        run._boxed_call = True
        return run
    return compiler


# torch._dynamo.backends.debugging.aot_eager, with the no-op compilers above.
AOT_EAGER = aot_autograd(fw_compiler=_nop("forward"), bw_compiler=_nop("backward"),
                         partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True)


def measure_compiled(model, ids):
    """:func:`measure` for a torch.compile'd model: the meters run inside the compiled graphs."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    peak = PeakBytesMeter()
    _Probe.meters = [peak]
    model(ids, ids).backward()
    counter = flop_counter()
    _Probe.meters = [counter]
    model(ids, ids).backward()
    return peak.peak_bytes, counter.get_total_flops()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--torch-budget", type=float, default=None,
                        help="internal: measure the compiled model at this activation_memory_budget and print JSON")
    args = parser.parse_args()
    config = ModelConfig(name="bench", vocab_size=256, hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                         num_kv_heads=2, intermediate_size=4 * args.hidden, max_seq_len=args.seq)

    def build():
        torch.manual_seed(0)
        return TransformerLM(config)

    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    if args.torch_budget is not None:
        # One budget per process: after torch._dynamo.reset() a second compile in the same
        # process did not call the backend's compilers again.
        torch._functorch.config.activation_memory_budget = args.torch_budget
        compiled = torch.compile(build(), backend=AOT_EAGER)
        compiled(ids, ids).backward()  # compile outside the meters
        print(json.dumps(measure_compiled(compiled, ids)))
        return
    eager_peak, eager_flops = measure(build(), ids)
    every = build()
    plan_apply.apply_placement(every, [OPTION_BY_NAME["recompute layer"]] * config.num_layers)
    every_peak, every_flops = measure(every, ids)

    compiled_flops_full = None
    rows, totals = [], []
    for fraction in (1.0, 0.75, 0.5, 0.25):
        budget = int(fraction * eager_peak)
        placement = place(build(), batch=args.batch, seq=args.seq, budget=budget)
        planned = build()
        memkernels.apply(planned, placement)
        plan_peak, plan_flops = measure(planned, ids)

        command = [sys.executable, __file__, "--layers", str(args.layers), "--hidden", str(args.hidden), "--seq",
                   str(args.seq), "--batch", str(args.batch), "--torch-budget", str(fraction)]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        torch_peak, torch_flops = json.loads(output.strip().splitlines()[-1])
        if compiled_flops_full is None:
            compiled_flops_full = torch_flops
        rows.append((fraction, budget, placement.predicted_peak, plan_peak, plan_flops - eager_flops,
                     torch_peak, torch_flops - compiled_flops_full, placement.describe()))
        totals.append((fraction, plan_flops, torch_flops))

    kib = 1024
    print(f"tiny TransformerLM: {config.num_layers} layers, hidden {config.hidden_size}, batch {args.batch} x seq "
          f"{args.seq}, fp32, CPU")
    print(f"eager, no checkpointing: peak {eager_peak / kib:,.0f} KiB")
    print(f"checkpoint every layer:  peak {every_peak / kib:,.0f} KiB, recompute {(every_flops - eager_flops) / 1e6:,.1f}"
          " MFLOP")
    print(f"{'budget':>8} {'bytes':>10} | {'plan pred':>10} {'plan peak':>10} {'recompute':>10} | "
          f"{'torch peak':>10} {'recompute':>10} | placement")
    for fraction, budget, predicted, peak, flops, tpeak, tflops, described in rows:
        print(f"{fraction:>8.0%} {budget / kib:>9,.0f}K | {predicted / kib:>9,.0f}K {peak / kib:>9,.0f}K "
              f"{flops / 1e6:>8,.1f}MF | {tpeak / kib:>9,.0f}K {tflops / 1e6:>8,.1f}MF | {described}")
    print("(torch's recompute: compiled step FLOPs minus the compiled step's at budget 1.0)")
    print(f"step FLOPs, eager without recompute: {eager_flops / 1e6:,.1f} MFLOP; per budget (plan | compiled): "
          + ", ".join(f"{f:.0%} {p / 1e6:,.1f} | {t / 1e6:,.1f}" for f, p, t in totals))

    start = time.perf_counter()
    result = plan(LLAMA_3_70B, gpu_mem="80GB", gpus=8, seq=8192, global_batch_tokens=8192 * 8 * 16)
    elapsed = time.perf_counter() - start
    print(f"\nplan() for Llama-3-70B (80 layers), 8 x 80 GB, seq 8192: {elapsed:.1f} s "
          f"(target: under 10 s on 2 cores); {result.config.label(8)}, micro-batch {result.micro_batch}, "
          f"accumulation {result.accumulation}")


if __name__ == "__main__":
    main()
