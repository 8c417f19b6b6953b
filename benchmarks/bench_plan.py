"""memkernels.plan against PyTorch's compile-time activation_memory_budget and checkpointing every layer.

On the CPU, on one tiny memkernels TransformerLM (Llama-shaped), for budgets of 25/50/75/100%
of the eager step's activation peak, it prints side by side:

- memkernels: ``place()`` at that budget in bytes, applied with ``memkernels.apply`` (eager);
- PyTorch: ``torch._functorch.config.activation_memory_budget`` = the same fraction, under
  ``torch.compile`` with the ``aot_eager`` backend (AOTAutograd's min-cut partitioner picks
  what to recompute; the budget is a ratio of saved activations, not a peak). The backend is
  aot_eager's own definition with instrumented no-op compilers, because an active dispatch
  mode around the call makes Dynamo run the model eagerly instead:
  the peak meter is opened when the compiled forward graph starts and closed after
  ``backward()`` returns; FLOPs are counted by one FlopCounterMode per graph run, opened and
  closed inside it, and summed. (Earlier versions closed the meters inside the backward graph:
  a mode exited there stays on the caller's mode stack, and the leftover meter hid the LM
  head's matmuls from later counters, so torch's "recompute" came out negative.);
- checkpointing every layer (eager, non-reentrant).

Peak: bytes allocated during one training step and alive at its worst moment (PeakBytesMeter,
gradients allocated beforehand, so they are not counted). Recompute FLOPs: FLOPs of the step
(FlopCounterMode: matmuls and attention) minus those of the eager step without any
recompute; a compiled step at budget 1.0 must count exactly the eager step's FLOPs (printed
as a check). Then the time ``plan()`` takes for Llama-3-70B's config (80 layers, 8 x 80 GB), and
Llama-3-8B on 8 x 80 GB (bf16, AdamW, full fine-tuning) at 8k-64k tokens per GPU: the plan (the
fused linear cross-entropy counted, issue 35), its added FLOPs and its cold planning time (no
profile cached).

With ``--longest``, instead: the longest tokens per GPU per micro-batch (``plan(seq="max")``) at
<= 10% added step time and at any cost, each with its plan and planning time, for Llama-3-8B full
fine-tuning on 8 x 80 GB (without host memory and with 1 TB), Llama-3-8B QLoRA on one 24 GB and one
80 GB GPU, without host memory and with 64 GB / 256 GB (beside unsloth's published 78,475 / 342,733
tokens, which offload checkpoints to the host) and Qwen2-72B on 8 x 80 GB with 1 TB and 2 TB of host
memory. Every figure is the plan's model (memory measured on meta, time modelled at
400 TFLOP/s, PCIe 25 GB/s, NCCL 100 GB/s), not a run.

    python benchmarks/bench_plan.py [--layers 8] [--hidden 128] [--seq 256] [--batch 2]
    python benchmarks/bench_plan.py --llama3-8b-only [--llama3-8b-seqs 65536]
    python benchmarks/bench_plan.py --longest
"""
import argparse
import json
import re
import subprocess
import sys
import time

import torch
from functorch.compile import min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import memkernels
from memkernels.meters import PeakBytesMeter
from memkernels.models import ModelConfig, TransformerLM
from memkernels.planning import apply_plan as plan_apply
from memkernels.planning.placement import OPTION_BY_NAME, flop_counter
from memkernels.planning.plan import place, plan

LLAMA_3_8B_SEQS = (8192, 16384, 32768, 65536)
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
    """What the instrumented compilers do on the next step: ``peak`` (a PeakBytesMeter the forward
    graph opens; the caller closes it after backward) and/or ``flops`` (a list the FLOPs of each
    graph run are appended to, counted inside that run)."""

    peak = None
    flops = None


def _nop(kind):
    def compiler(graph, _example_inputs):
        def run(args):
            if kind == "forward" and _Probe.peak is not None:
                _Probe.peak.__enter__()
                _Probe.peak = None
            if _Probe.flops is None:
                return torch.fx.Interpreter(graph).boxed_run(args)
            with flop_counter() as counter:
                out = torch.fx.Interpreter(graph).boxed_run(args)
            _Probe.flops.append(counter.get_total_flops())
            return out
        run._boxed_call = True
        return run
    return compiler


# torch._dynamo.backends.debugging.aot_eager, with the no-op compilers above.
AOT_EAGER = aot_autograd(fw_compiler=_nop("forward"), bw_compiler=_nop("backward"),
                         partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True)


def measure_compiled(model, ids):
    """:func:`measure` for a torch.compile'd model: (peak bytes, FLOPs, graph runs counted).

    The peak meter is closed by the caller, after backward: a dispatch mode exited inside the
    backward graph stays on the caller's mode stack (autograd restores the thread-local state it
    captured when backward() was called), and a leftover meter hid the LM head's matmuls from
    the FLOP counters of the next steps.
    """
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    peak = _Probe.peak = PeakBytesMeter()
    model(ids, ids).backward()
    peak.__exit__(None, None, None)
    flops = _Probe.flops = []
    model(ids, ids).backward()
    _Probe.flops = None
    if _get_current_dispatch_mode_stack():
        raise RuntimeError(f"dispatch modes left on the stack: {_get_current_dispatch_mode_stack()}")
    return peak.peak_bytes, sum(flops), len(flops)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--llama3-8b-only", action="store_true",
                        help="only the Llama-3-8B plans (a few seconds each), not the tiny-model comparison")
    parser.add_argument("--llama3-8b-seqs", default=",".join(map(str, LLAMA_3_8B_SEQS)),
                        help="tokens per GPU per micro-batch to plan Llama-3-8B at, comma-separated")
    parser.add_argument("--longest", action="store_true",
                        help="only the longest-sequence table (plan(seq='max'), 5-40 s a row)")
    parser.add_argument("--torch-budget", type=float, default=None,
                        help="internal: measure the compiled model at this activation_memory_budget and print JSON")
    args = parser.parse_args()
    config = ModelConfig(name="bench", vocab_size=256, hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                         num_kv_heads=2, intermediate_size=4 * args.hidden, max_seq_len=args.seq)

    def build():
        torch.manual_seed(0)
        return TransformerLM(config)

    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    if args.longest:
        longest()
        return
    if args.llama3_8b_only:
        llama_3_8b(int(s) for s in args.llama3_8b_seqs.split(","))
        return
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

    rows = []
    for fraction in (1.0, 0.75, 0.5, 0.25):
        budget = int(fraction * eager_peak)
        placement = place(build(), batch=args.batch, seq=args.seq, budget=budget)
        planned = build()
        memkernels.apply(planned, placement)
        plan_peak, plan_flops = measure(planned, ids)

        command = [sys.executable, __file__, "--layers", str(args.layers), "--hidden", str(args.hidden), "--seq",
                   str(args.seq), "--batch", str(args.batch), "--torch-budget", str(fraction)]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        torch_peak, torch_flops, graph_runs = json.loads(output.strip().splitlines()[-1])
        if graph_runs != 2:
            raise RuntimeError(f"budget {fraction}: {graph_runs} compiled graph runs counted, expected 2 (one "
                               "forward, one backward graph): a graph break; the figures would be partial")
        if fraction == 1.0 and torch_flops < eager_flops:
            raise RuntimeError(f"compiled step at budget 1.0 counts {torch_flops:,} FLOPs, fewer than eager's "
                               f"{eager_flops:,}: the counters miss part of the compiled step")
        rows.append((fraction, budget, placement.predicted_peak, plan_peak, plan_flops - eager_flops,
                     torch_peak, torch_flops - eager_flops, placement.describe()))
        if fraction == 1.0:
            compiled_full = torch_flops

    kib, every_recompute = 1024, every_flops - eager_flops
    print(f"tiny TransformerLM: {config.num_layers} layers, hidden {config.hidden_size}, batch {args.batch} x seq "
          f"{args.seq}, fp32, CPU")
    print(f"eager, no checkpointing: peak {eager_peak / kib:,.0f} KiB, step {eager_flops / 1e6:,.1f} MFLOP; "
          f"torch.compile at budget 1.0: step {compiled_full / 1e6:,.1f} MFLOP (same graph ops: must match)")
    print("peak: KiB allocated in one training step and alive at its worst moment (PeakBytesMeter; gradients "
          "preallocated)")
    print("recompute: MFLOP of the step (FlopCounterMode: matmuls + attention) minus the eager step's without "
          "recompute")
    print("budget: fraction of the eager peak; memkernels plans for it in bytes, torch gets it as "
          "activation_memory_budget (a ratio of saved activations)")
    print(f"{'budget':>7} {'bytes':>9} | {'memkernels plan':^37} | {'torch activation_memory_budget':^30} | "
          f"{'checkpoint every layer':^22}")
    print(f"{'':>7} {'':>9} | {'predicted':>11} {'peak':>11} {'recompute':>12} | {'peak':>11} {'recompute':>17} | "
          f"{'peak':>9} {'recompute':>12}")
    for fraction, budget, predicted, peak, flops, tpeak, tflops, _ in rows:
        print(f"{fraction:>7.0%} {budget / kib:>8,.0f}K | {predicted / kib:>10,.0f}K {peak / kib:>10,.0f}K "
              f"{flops / 1e6:>10,.1f}MF | {tpeak / kib:>10,.0f}K {tflops / 1e6:>15,.1f}MF | "
              f"{every_peak / kib:>8,.0f}K {every_recompute / 1e6:>10,.1f}MF")
    print("memkernels placements: " + "; ".join(f"{f:.0%}: {d}" for f, *_, d in rows))

    start = time.perf_counter()
    result = plan(LLAMA_3_70B, gpu_mem="80GB", gpus=8, seq=8192, global_batch_tokens=8192 * 8 * 16)
    elapsed = time.perf_counter() - start
    print(f"\nplan() for Llama-3-70B (80 layers), 8 x 80 GB, seq 8192: {elapsed:.1f} s "
          f"(target: under 10 s on 2 cores); {result.config.label(8)}, micro-batch {result.micro_batch}, "
          f"accumulation {result.accumulation}")
    llama_3_8b(int(s) for s in args.llama3_8b_seqs.split(","))


def llama_3_8b(seqs):
    """Llama-3-8B, 8 x 80 GB, bf16, AdamW, full fine-tuning, one sequence per GPU per micro-batch (the global
    batch is seq x 8): the plan, its added FLOPs (layers' recompute + the fused loss's logits GEMM) over the
    step's, and the cold planning time (profiles dropped first)."""
    from memkernels.planning import placement
    from memkernels.runtime.sizes import format_size
    print("\nLlama-3-8B, 8 x 80 GB, bf16, AdamW, full fine-tuning, 1 sequence per GPU per micro-batch:")
    print(f"{'tokens':>7} | {'plan':<58} | {'activations':>11} | {'added FLOPs':>11} | {'of which head':>13} | "
          f"{'added time':>10} | {'cold':>6}")
    for seq in seqs:
        placement._profiles.clear()
        start = time.perf_counter()
        result = plan("llama-3-8b", gpu_mem="80GB", gpus=8, seq=seq, global_batch_tokens=seq * 8)
        elapsed = time.perf_counter() - start
        chosen = result.placement
        step_flops = result.step_seconds * 400e12  # the plan's step FLOPs (its cost model runs at 400 TFLOP/s)
        if result.fits:
            recomputed = sum(1 for c in chosen.choices if c.recomputed)
            text = f"{result.config.label(8)}, micro {result.micro_batch}, {recomputed} layers recompute"
            added = f"{chosen.recompute_flops / step_flops:.1%}"
            head = f"{chosen.head_recompute_flops / step_flops:.1%}"
            overhead = f"{result.overhead:.1%}"  # recompute, offload not hidden, ZeRO-3's all-gathers
        else:
            text = f"NOTHING FITS: needs {format_size(result.missing)} more ({result.config.label(8)})"
            added = head = overhead = "-"
        print(f"{seq:>7,} | {text:<58} | {format_size(chosen.predicted_peak):>11} | {added:>11} | {head:>13} | "
              f"{overhead:>10} | {elapsed:>5.1f}s")


# (label, plan() arguments, a published figure to print beside it)
LONGEST = (
    ("Llama-3-8B full, 8 x 80 GB", dict(model_or_config="llama-3-8b", gpu_mem="80GB", gpus=8), ""),
    ("Llama-3-8B full, 8 x 80 GB, 1 TB host", dict(model_or_config="llama-3-8b", gpu_mem="80GB", gpus=8,
                                                   host_mem="1TB"), ""),
    ("Llama-3-8B QLoRA, 1 x 24 GB", dict(model_or_config="llama-3-8b", gpu_mem="24GB", finetune="qlora"),
     "unsloth: 78,475"),
    ("Llama-3-8B QLoRA, 1 x 80 GB", dict(model_or_config="llama-3-8b", gpu_mem="80GB", finetune="qlora"),
     "unsloth: 342,733"),
    # unsloth's figures offload every checkpoint to the host: the same GPUs with host memory given
    ("Llama-3-8B QLoRA, 1 x 24 GB, 64 GB host", dict(model_or_config="llama-3-8b", gpu_mem="24GB", finetune="qlora",
                                                     host_mem="64GB"), "unsloth: 78,475"),
    ("Llama-3-8B QLoRA, 1 x 80 GB, 256 GB host", dict(model_or_config="llama-3-8b", gpu_mem="80GB",
                                                      finetune="qlora", host_mem="256GB"), "unsloth: 342,733"),
    ("Qwen2-72B full, 8 x 80 GB, 1 TB host", dict(model_or_config="qwen2-72b", gpu_mem="80GB", gpus=8,
                                                  host_mem="1TB"), ""),
    ("Qwen2-72B full, 8 x 80 GB, 2 TB host", dict(model_or_config="qwen2-72b", gpu_mem="80GB", gpus=8,
                                                  host_mem="2TB"), ""),
)


def longest():
    """The longest tokens per GPU per micro-batch each configuration of :data:`LONGEST` plans, at <= 10% added step
    time and at any cost, cold (no profile cached before each search)."""
    from memkernels.planning import placement
    print("longest tokens per GPU per micro-batch (plan(seq='max'); modelled, not run):")
    print(f"{'configuration':<40} | {'cap':>5} | {'tokens':>9} | {'plan':<44} | {'added':>6} | {'time':>6} | "
          f"{'lengths measured':>16} | published")
    for label, arguments, published in LONGEST:
        for cap in ("10%", None):
            placement._profiles.clear()
            start = time.perf_counter()
            result = plan(seq="max", max_overhead=cap, **arguments)
            elapsed = time.perf_counter() - start
            found = "longest that fits" in result.notes[-1]
            tokens = f"{result.seq:,}" if found else "none"
            text = (f"{result.config.label(arguments.get('gpus', 1))}, micro {result.micro_batch}" if found
                    else result.notes[-1][:44])
            added = f"{result.overhead:.1%}" if found else "-"
            measured = re.search(r"(\d+) lengths measured", result.notes[-1]).group(1)
            print(f"{label:<40} | {cap or 'any':>5} | {tokens:>9} | {text:<44} | {added:>6} | {elapsed:>5.0f}s | "
                  f"{measured:>16} | {published}")


if __name__ == "__main__":
    main()
