"""The ``memkernels`` command.

- ``memkernels report``: one training step of two small built-in models (GPT-2
  style and Llama style), as eager PyTorch and with memkernels' kernels, on
  whatever device is present;
  saved bytes by category, peak bytes, loss/gradient parity; then a per-GPU
  estimate of a large model across configurations, with a stacked-bar PNG.
- ``memkernels estimate``: per-GPU breakdown of one configuration and the
  cheapest optimizations that make it fit ``--gpu-mem``.
- ``memkernels replay``: recorded PyTorch memory snapshots replayed through a
  model of PyTorch's allocator and through memkernels' pool
  (:mod:`memkernels.runtime.allocator`).
- ``memkernels explain``: the post-mortem of a recorded snapshot
  (:mod:`memkernels.forensics.explain`).

The logic lives in :mod:`memkernels.planning.evaluate` and :mod:`memkernels.planning.estimate`;
this module only parses arguments and prints. Each subcommand registers
itself in ``_SUBCOMMANDS``.
"""
import argparse
import copy
import os
import re
import sys

from memkernels.runtime.sizes import MEMORY_FORMS, SizeError, format_size, parse_device_size


def _size_argument(parse, what):
    """An argparse ``type`` from a :mod:`memkernels.runtime.sizes` parser: SizeError becomes argparse's error."""
    def parse_argument(text):
        try:
            return parse(text, what=what)
        except SizeError as error:
            raise argparse.ArgumentTypeError(error.detail) from None
    return parse_argument


def _size_used(what, nbytes):
    """The line that says which figure a size argument was read as."""
    return f"{what}: {format_size(nbytes)} = {nbytes:,} bytes (K, M, G, T are powers of 2: G = GB = GiB = 2^30)"


def _integer(text, minimum, what):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text} must be {what}")
    return value


def _positive(text):
    return _integer(text, 1, "positive")


def _nonnegative(text):
    return _integer(text, 0, "0 or more")


def _progress(step, total, message):
    print(f"[{step}/{total}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- report

REPORT_BATCH, REPORT_SEQ = 4, 256  # the embedded training steps: 4 x 256 tokens
# The embedded models, each one training step eager vs memkernels.
REPORT_MODELS = (("tiny-gpt", "GPT-2 style: LayerNorm, GELU MLP, tied head"),
                 ("tiny-llama", "Llama style: RMSNorm, SwiGLU MLP, grouped-query attention, untied head"))
ESTIMATE_BATCH, ESTIMATE_SEQ = 1, 8192  # the large-model estimate of report and estimate


def _report_configurations(batch, seq, dtype, shard):
    """The cumulative ladder fp32 → mixed → +checkpointing → +offload → +memkernels."""
    common = {"batch": batch, "seq": seq, "shard_degree": shard}
    return [
        ("fp32", {"dtype": "fp32"}),
        (f"{dtype} mixed", {"dtype": dtype}),
        ("+ checkpointing", {"dtype": dtype, "checkpointing": True}),
        ("+ offload", {"dtype": dtype, "checkpointing": True, "offload": True}),
        ("+ memkernels", {"dtype": dtype, "checkpointing": True, "offload": True, "use_memkernels": True}),
        # Not cumulative: what the kernels buy alone, with no recompute and no PCIe traffic.
        (f"{dtype} + memkernels\n(no ckpt/offload)", {"dtype": dtype, "use_memkernels": True}),
    ], common


def run_report(args):
    import torch

    from memkernels._backend import get_backend, resolve
    from memkernels.models import TransformerLM, load_config, synthetic_batch
    from memkernels.planning.estimate import MARGIN_TEXT, breakdown_chart, estimate, estimate_table
    from memkernels.planning.evaluate import compare_steps
    from memkernels.runtime.sizes import format_size

    load_config(args.model)  # a bad --model or --out fails now, not after the training step
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.path.isdir(out_dir):
        raise ValueError(f"--out {args.out!r}: " + ("is a directory; name the PNG file to write, e.g. "
                         f"{os.path.join(args.out, 'memkernels-report.png')!r}" if os.path.isdir(args.out)
                         else f"its directory {out_dir!r} does not exist"))
    if args.gpu_mem is not None:
        print(_size_used("--gpu-mem", args.gpu_mem))
    total = 4
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _progress(1, total, f"building the embedded models ({', '.join(n for n, _ in REPORT_MODELS)}) on {device}")
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    embedded = [(name, style, TransformerLM(name).to(device),
                 synthetic_batch(name, REPORT_BATCH, REPORT_SEQ, generator=generator).to(device))
                for name, style in REPORT_MODELS]
    path = resolve(embedded[0][3], "report")
    kernels = "Triton kernels" if path == "triton" else "PyTorch reference path (same memory contract)"
    print(f"memkernels runs its {kernels}"
          f" (backend {get_backend()!r}); each embedded model: one training step of {REPORT_BATCH} x {REPORT_SEQ} "
          f"random tokens in fp32 on {device}\n")

    _progress(2, total, "one training step per embedded model: eager PyTorch vs memkernels")
    failure = None
    measured = []  # one line per embedded model, for the chart: what was measured, beside the estimated bars
    for name, style, baseline, ids in embedded:
        n_params = sum(p.numel() for p in baseline.parameters())
        print(f"== {name} ({n_params / 1e6:.1f}M parameters, {style})")
        try:
            from memkernels.fusions.apply import apply
            optimized = copy.deepcopy(baseline)
            # measure=False: the step below measures the saved bytes of this very step; apply()'s own
            # figure (a meta forward of another token count) would be a second, different percentage.
            patch_report = apply(optimized, measure=False)
        except (ImportError, RuntimeError) as error:
            failure = f"memkernels kernels unavailable: {error}"
            print(f"ERROR: {failure}\n")
            continue
        comparison = compare_steps(baseline, optimized, ids, ids, timed_steps=args.timed_steps)
        peaks = comparison.baseline["peak_bytes"], comparison.optimized["peak_bytes"]
        measured.append(f"{name}: one training step of {REPORT_BATCH} x {REPORT_SEQ} tokens, fp32 on {device}: peak "
                        f"{format_size(peaks[0])} eager -> {format_size(peaks[1])} memkernels "
                        f"({(peaks[1] - peaks[0]) / peaks[0]:+.0%})")
        print(patch_report.summary())
        print()
        print(comparison.step_table())
        if device == "cpu" and args.timed_steps:
            print("(times on the CPU: memkernels runs its PyTorch reference path there, not its Triton kernels; "
                  "not indicative of GPU step time)")
        print()
        print(f"bytes saved for backward by this training step ({REPORT_BATCH} x {REPORT_SEQ} tokens), by category:")
        print(comparison.category_table())
        print()

    _progress(3, total, f"estimating {args.model} at batch {args.batch} x seq {args.seq} (meta device)")
    ladder, common = _report_configurations(args.batch, args.seq, args.dtype, args.gpus)
    estimates = []
    for label, flags in ladder:
        try:
            estimates.append((label, estimate(args.model, **common, **flags)))
        except (ImportError, RuntimeError) as error:
            print(f"ERROR: configuration {label!r} could not be estimated: {error}")
            failure = failure or str(error)
    if estimates:
        first = estimates[0][1]
        print(f"{first.model}: {first.num_parameters / 1e9:.2f}B parameters, per-GPU batch {args.batch} x seq "
              f"{args.seq}{f', ZeRO-3 over {args.gpus} GPUs' if args.gpus > 1 else ''}, AdamW")
        print(estimate_table(estimates))
        print(f"(a run also needs a margin kept free: {MARGIN_TEXT}, as estimate --gpu-mem and plan keep)")

    _progress(4, total, f"writing {args.out}")
    if estimates:
        try:
            breakdown_chart(estimates, args.out, gpu_bytes=args.gpu_mem, measured=measured,
                            title=f"{estimates[0][1].model}, batch {args.batch} x seq {args.seq}"
                                  f"{f', ZeRO-3 x {args.gpus}' if args.gpus > 1 else ''}: memory per GPU")
            print(f"\nwrote {os.path.abspath(args.out)}")
        except ImportError as error:
            print(f"\nno chart: {error}")
    return 1 if failure else 0


# ----------------------------------------------------------------------------- estimate

def run_estimate(args):
    from memkernels.planning.estimate import MARGIN_TEXT, default_margin, estimate, fitting_options
    from memkernels.runtime.sizes import format_size, text_table

    options = {"batch": args.batch, "seq": args.seq, "dtype": args.dtype, "optimizer": args.optimizer,
               "shard_degree": args.gpus, "zero_stage": args.zero_stage}
    if args.gpu_mem is not None:
        print(_size_used("--gpu-mem", args.gpu_mem))
    result = estimate(args.model, checkpointing=args.checkpointing, offload=args.offload,
                      use_memkernels=args.memkernels, **options)
    print(result.table())
    if args.gpu_mem is None:
        return 0
    margin = default_margin(args.gpu_mem)
    need = result.total + margin
    print(f"\nmargin kept free: {format_size(margin)} ({MARGIN_TEXT}; plan keeps the same)")
    if need <= args.gpu_mem:
        print(f"fits in {format_size(args.gpu_mem)}: {format_size(result.total)} + {format_size(margin)} margin, "
              f"{format_size(args.gpu_mem - need)} to spare")
        return 0
    print(f"does not fit in {format_size(args.gpu_mem)} (needs {format_size(result.total)} + "
          f"{format_size(margin)} margin); optimizations, cheapest first:")
    rows, best = [], None
    for row in fitting_options(args.model, args.gpu_mem, **options):
        if row["error"]:
            rows.append((row["name"], row["cost"], "unavailable", row["error"][:60]))
            continue
        rows.append((row["name"], row["cost"], format_size(row["total"]), "fits" if row["fits"] else "no"))
        if row["fits"] and best is None:
            best = row["name"]
    print(text_table(("option", "cost", "per GPU", "fits with the margin"), rows))
    if best:
        print(f"\ncheapest that fits: {best}")
        return 0
    print("\nnothing fits at this shard degree; shard over more GPUs or lower the micro-batch / sequence")
    return 0


def _add_report(subparsers):
    from memkernels.models import BUILTIN_CONFIGS
    from memkernels.planning.estimate import DTYPES

    models = ", ".join(name for name in BUILTIN_CONFIGS if not name.startswith("tiny-"))
    report = subparsers.add_parser(
        "report", help="baseline vs memkernels training step, and a large-model estimate",
        description="One training step of the embedded tiny-gpt and tiny-llama models, eager vs memkernels, then a "
        "per-GPU "
        "estimate of --model across configurations (fp32, mixed precision, checkpointing, offload, memkernels).")
    report.add_argument("--model", default="llama-3-8b",
                        help=f"model to estimate (default llama-3-8b): {models} (any case), a Hugging Face "
                        "config.json path or a model directory holding one")
    report.add_argument("--batch", type=_positive, default=ESTIMATE_BATCH, help="per-GPU micro-batch of the estimate")
    report.add_argument("--seq", type=_positive, default=ESTIMATE_SEQ, help="sequence length of the estimate")
    report.add_argument("--dtype", choices=[d for d in DTYPES if d != "fp32"], default="bf16",
                        help="mixed precision of the estimate's configurations")
    report.add_argument("--gpus", "--shard", dest="gpus", type=_positive, default=8,
                        help="data-parallel GPUs of the estimate, model state sharded over them as ZeRO-3 / FSDP "
                        "(default 8; --shard is its older name)")
    report.add_argument("--gpu-mem", type=_size_argument(parse_device_size, "--gpu-mem"), default=None,
                        help=f"draw a capacity line: {MEMORY_FORMS}")
    report.add_argument("--timed-steps", type=_nonnegative, default=3,
                        help="unmetered training steps timed per embedded model after the metered one, their median "
                        "printed (default 3; 0: no time row)")
    report.add_argument("--out", default="memkernels-report.png",
                        help="path of the PNG chart (default: memkernels-report.png in the working directory; the "
                        "full path is printed at the end)")
    report.set_defaults(run=run_report)


def _add_estimate(subparsers):
    from memkernels.models import BUILTIN_CONFIGS
    from memkernels.planning.estimate import DTYPES, OPTIMIZERS

    models = ", ".join(name for name in BUILTIN_CONFIGS if not name.startswith("tiny-"))
    est = subparsers.add_parser("estimate", help="per-GPU memory of a training run, and what makes it fit")
    est.add_argument("--model", required=True, 
                     help=f"{models} (any case), a Hugging Face config.json path or a model directory holding one")
    est.add_argument("--batch", type=_positive, default=ESTIMATE_BATCH,
                     help=f"per-GPU micro-batch (default {ESTIMATE_BATCH})")
    est.add_argument("--seq", type=_positive, default=ESTIMATE_SEQ, help=f"sequence length (default {ESTIMATE_SEQ})")
    est.add_argument("--dtype", choices=list(DTYPES), default="bf16",
                     help="training precision: bf16/fp16 mixed (fp32 master weights) or plain fp32 (default: bf16)")
    est.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw",
                     help="optimizer whose state is counted (default: adamw)")
    est.add_argument("--gpus", "--shard", dest="gpus", type=_positive, default=1,
                     help="data-parallel GPUs the model state is sharded over, as plan's --gpus (default: 1, no "
                     "sharding; --shard is its older name)")
    est.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                     help="what is sharded over --gpus: 1 optimizer state, 2 + gradients, 3 + parameters (FSDP) "
                     "(default: 3 when --gpus > 1; plan chooses the stage itself)")
    est.add_argument("--gpu-mem", type=_size_argument(parse_device_size, "--gpu-mem"), default=None,
                     help=f"GPU capacity: {MEMORY_FORMS}")
    est.add_argument("--checkpointing", action="store_true",
                     help="estimate with every layer checkpointed (only its input kept for backward)")
    est.add_argument("--offload", action="store_true",
                     help="estimate with the saved activations offloaded to host memory")
    est.add_argument("--memkernels", action="store_true", help="estimate with memkernels.apply()'d kernels")
    est.set_defaults(run=run_estimate)


def _add_replay(subparsers):
    parser = subparsers.add_parser(
        "replay",
        help="replay recorded PyTorch memory snapshots: PyTorch's policy vs memkernels vs ideal",
        description="Replay torch.cuda.memory._dump_snapshot pickles through a model of PyTorch's caching "
        "allocator and through memkernels' pool (virtual addresses, no GPU needed), and print peak "
        "reserved / peak requested and device allocations side by side.",
    )
    parser.add_argument("traces", nargs="+", metavar="TRACE",
                        help="snapshot pickle(s), or directories: every *.pickle in them")
    parser.add_argument("--device", type=_nonnegative, default=None,
                        help="replay only this device (default: every device)")
    parser.add_argument("--capacity", type=_size_argument(parse_device_size, "--capacity"), default=None,
                        help=f"device memory (default: unlimited): {MEMORY_FORMS}. Says per policy whether "
                        "the trace fit, how many requests failed and the first that did; exit status 1 if any "
                        "policy's replay did not fit")
    parser.add_argument("--repeats", type=_positive, default=5, help="replays per trace for the ns/op median")
    parser.add_argument(
        "--simulated-device",
        action="store_true",
        help="run memkernels' pool on the simulated CUDA device (cudaMalloc, cudaEvent) instead of plain addresses",
    )
    parser.add_argument(
        "--expandable-segments",
        action="store_true",
        help="both columns with expandable segments (PyTorch's expandable_segments:True, memkernels' VMM pool)",
    )

    def run(args):
        from memkernels.forensics.replay import print_replay_table, trace_files

        if args.capacity is not None:
            print(_size_used("--capacity", args.capacity))
        unreadable = []

        def report_unreadable(message):
            unreadable.append(message)
            print(f"memkernels replay: error: {message}", file=sys.stderr, flush=True)

        rows = print_replay_table(
            trace_files(args.traces),
            on_error=report_unreadable,
            device=args.device,
            capacity=args.capacity,
            repeats=args.repeats,
            simulated_device=args.simulated_device,
            expandable_segments=args.expandable_segments,
        )
        status = 0
        if unreadable:
            print(f"memkernels replay: {len(unreadable)} trace(s) could not be read (see the errors above)",
                  file=sys.stderr)
            status = 1
        misfits = [f"{row['trace']} (device {row['device']}) under {label}" for row in rows
                   for label, policy in (("PyTorch's policy", "pytorch"), ("memkernels", "memkernels"))
                   if row[policy]["num_ooms"]]
        if misfits:
            print(f"memkernels replay: does not fit the {format_size(args.capacity)} capacity: {', '.join(misfits)} "
                  "(exit status 1)", file=sys.stderr)
            status = 1
        return status

    parser.set_defaults(run=run)


# ----------------------------------------------------------------------------- explain

def _add_explain(subparsers):
    parser = subparsers.add_parser(
        "explain",
        help="post-mortem of a recorded PyTorch memory snapshot: the OOM, who held the memory, would another "
        "allocator have fit",
        description="Explain torch.cuda.memory._dump_snapshot pickles, per device: the failing request and the "
        "free bytes the device reported, reserved vs allocated and the largest free block at the OOM (or the "
        "peak), the top live allocations by the innermost frame of your code, the trace replayed through "
        "PyTorch's policy, expandable segments and memkernels' pool on a device of the same size, and the next "
        "step. Files are loaded as plain data only: a pickle that refers to code is refused.",
    )
    parser.add_argument("snapshots", nargs="+", metavar="SNAPSHOT",
                        help="snapshot pickle(s), or a directory: every *.pickle in it (as replay takes them)")
    parser.add_argument("--device", type=int, default=None, help="explain only this device (default: every device)")
    parser.add_argument("--top", type=_positive, default=10, help="groups of live allocations to list")
    parser.add_argument("--capacity", default=None, metavar="SIZE",
                        help="device memory for the counterfactual, e.g. 80GiB (default: after an OOM, reserved + "
                        "the free bytes the device reported; without one, unknown)")

    def run(args):
        from memkernels.forensics.explain import explain
        from memkernels.forensics.replay import trace_files
        from memkernels.runtime.sizes import parse_size

        capacity = None if args.capacity is None else parse_size(args.capacity, what="--capacity")
        for i, path in enumerate(trace_files(args.snapshots)):
            if i:
                print()
            print(explain(path, device=args.device, top=args.top, capacity=capacity).text())
        return 0

    parser.set_defaults(run=run)


# ----------------------------------------------------------------------------- plan

# plan()'s errors start "plan(argument=value): ..."; the CLI says "--flag value: ..." instead.
_PLAN_ARGUMENT = re.compile(r"^plan\((\w+)=(.*?)\):")
_PLAN_FLAGS = {"model": "--model", "gpu_mem": "--gpu-mem", "seq": "--seq", "gpus": "--gpus",
               "global_batch_tokens": "--global-tokens", "host_mem": "--host-mem", "dtype": "--dtype",
               "optimizer": "--optimizer", "finetune": "--finetune", "lora_rank": "--lora-rank",
               "zero_stage": "--zero-stage", "max_overhead": "--max-overhead", "link_gbps": "--link-gbps"}


def _seq_or_max(text):
    """--seq: a number of tokens, or "max"; anything else goes to plan() as typed, whose one-line error names it."""
    try:
        return int(text)
    except ValueError:
        return "max" if text.strip().lower() == "max" else text


def _add_plan(subparsers):
    """``memkernels plan``: the decision flow automated (logic in memkernels.planning.plan)."""
    from memkernels.models import BUILTIN_CONFIGS
    from memkernels.planning.estimate import DTYPES, FINETUNE_MODES, OPTIMIZERS
    from memkernels.runtime.sizes import MEMORY_FORMS

    parser = subparsers.add_parser(
        "plan", help="what to turn on so that a training run fits, and its micro-batch / accumulation",
        description="Walk the decision flow (mixed precision, kernels, ZeRO, selective checkpointing, offload, "
        "LoRA/QLoRA), choose keep/recompute/offload per layer against the memory budget, and size the "
        f"micro-batch. Sizes: {MEMORY_FORMS}.")
    models = ", ".join(name for name in BUILTIN_CONFIGS if not name.startswith("tiny-"))
    parser.add_argument("--model", required=True,
                        help=f"{models} (any case), a Hugging Face config.json path or a model directory holding one")
    parser.add_argument("--gpu-mem", required=True, help="memory of one GPU, e.g. 24GB or 80GiB")
    parser.add_argument("--seq", type=_seq_or_max, default=ESTIMATE_SEQ,
                        help=f"tokens per sequence (default {ESTIMATE_SEQ}, as estimate's and report's), or 'max': "
                        "the longest that fits in the fine-tuning mode asked for (within --max-overhead when given), "
                        "by doubling and bisection (a plan per length tried: a minute or more, several with --host-mem)")
    parser.add_argument("--gpus", type=int, default=1, help="data-parallel ranks (default: 1)")
    parser.add_argument("--global-tokens", default=None,
                        help="tokens per optimizer step: decimal units (4M = 4,000,000) or binary ones (64Ki = "
                        "65,536); not a multiple of seq x gpus: the nearest that is, said in a note (default: "
                        "one micro-batch, no accumulation)")
    parser.add_argument("--host-mem", default="auto",
                        help="host memory of all the GPUs' machines for offload, e.g. 512GB; 0: none (default auto: on "
                        "a machine with GPUs, half of its memory per machine the run needs; without a GPU, none)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16",
                        help="training precision: bf16/fp16 mixed (fp32 master weights) or plain fp32 (default: bf16)")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw",
                        help="optimizer whose state is counted (default: adamw)")
    parser.add_argument("--finetune", default="full",
                        help=f"first mode tried: {', '.join(FINETUNE_MODES)} (default: full; the flow falls back to "
                        "LoRA, then QLoRA)")
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA rank of the LoRA/QLoRA modes (default: 16)")
    parser.add_argument("--zero-stage", type=int, default=None,
                        help="force a ZeRO stage (default: of those that fit, the one adding the least step time)")
    parser.add_argument("--max-overhead", default=None,
                        help="most added step time accepted, e.g. 10%% or 0.1 (modelled: recompute, offload not hidden "
                        "behind compute, ZeRO-3's all-gathers); plans above it do not count as fitting")
    parser.add_argument("--link-gbps", type=float, default=100.0,
                        help="per-GPU collective bandwidth in GB/s for ZeRO-3's parameter all-gathers (default 100; "
                        "about 350 in an H100 node's NVLink, 45 over 400 Gb/s InfiniBand)")
    parser.add_argument("--no-kernels", action="store_true", help="plan without memkernels' fused kernels")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")

    def run(args):
        import json

        from memkernels.planning.plan import plan
        from memkernels.runtime.sizes import parse_count, parse_device_size, parse_size

        gpu_mem = parse_device_size(args.gpu_mem, what="--gpu-mem")
        host_mem = args.host_mem.strip().lower()
        if host_mem not in ("auto", "0", "none"):
            host_mem = parse_size(args.host_mem, what="--host-mem")
        elif host_mem != "auto":
            host_mem = None
        tokens = None if args.global_tokens is None else parse_count(args.global_tokens, what="--global-tokens")
        try:
            result = plan(args.model, gpu_mem=gpu_mem, seq=args.seq, gpus=args.gpus,
                          global_batch_tokens=tokens, host_mem=host_mem, dtype=args.dtype,
                          optimizer=args.optimizer, finetune=args.finetune, lora_rank=args.lora_rank,
                          kernels=not args.no_kernels, zero_stage=args.zero_stage,
                          max_overhead=args.max_overhead, link_gbps=args.link_gbps)
        except ValueError as error:  # plan() names its Python argument; the user typed a flag
            raise ValueError(_PLAN_ARGUMENT.sub(lambda m: f"{_PLAN_FLAGS.get(m[1], m[1])} {m[2]}:", str(error),
                                                count=1)) from error
        print(json.dumps(result.to_dict(), indent=2) if args.json else result.table())
        return 0

    parser.set_defaults(run=run)


_SUBCOMMANDS = [_add_report, _add_estimate, _add_plan, _add_replay, _add_explain]


def _refuse_unknown(subparser, unknown):
    """Unrecognized arguments: the subcommand's own usage (not the top-level one), with the nearest of its
    flags for each mistyped one ("--seqlen": did you mean --seq?)."""
    import difflib

    flags = [flag for action in subparser._actions for flag in action.option_strings]
    hints = []
    for word in unknown:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.6)
            if close:
                hints.append(f"{word}: did you mean {close[0]}?")
    subparser.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else ""))


def main(argv=None):
    from memkernels import __version__

    parser = argparse.ArgumentParser(prog="memkernels", description="memkernels: measure, then save GPU memory.")
    parser.add_argument("--version", action="version", version=f"memkernels {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(subparsers)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(subparsers.choices[args.command], unknown)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"memkernels {args.command}: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
