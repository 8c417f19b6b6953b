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
  (:mod:`memkernels.allocator`).

The logic lives in :mod:`memkernels.profile` and :mod:`memkernels.estimate`;
this module only parses arguments and prints. Each subcommand registers
itself in ``_SUBCOMMANDS``.
"""
import argparse
import copy
import re
import sys

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text):
    """'80GB' → 80e9 bytes, '80GiB' → 80·2³⁰; a bare number means GB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", str(text), re.I)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 80GB, 79.6GiB or 24000MiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "gb").lower()])


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def _progress(step, total, message):
    print(f"[{step}/{total}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- report

REPORT_BATCH, REPORT_SEQ = 4, 256  # the embedded training steps: 4 x 256 tokens
# The embedded models, each one training step eager vs memkernels.
REPORT_MODELS = (("tiny-gpt", "GPT-2 style: LayerNorm, GELU MLP, tied head"),
                 ("tiny-llama", "Llama style: RMSNorm, SwiGLU MLP, grouped-query attention, untied head"))


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
    from memkernels.estimate import breakdown_chart, estimate
    from memkernels.models import TransformerLM, load_config, synthetic_batch
    from memkernels.profile import _table, compare_steps, format_bytes

    load_config(args.model)  # a bad --model fails now, not after the training step
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
    for name, style, baseline, ids in embedded:
        n_params = sum(p.numel() for p in baseline.parameters())
        print(f"== {name} ({n_params / 1e6:.1f}M parameters, {style})")
        try:
            from memkernels.patch import apply
            optimized = copy.deepcopy(baseline)
            patch_report = apply(optimized)
        except (ImportError, RuntimeError) as error:
            failure = f"memkernels kernels unavailable: {error}"
            print(f"ERROR: {failure}\n")
            continue
        comparison = compare_steps(baseline, optimized, ids, ids)
        print(patch_report.summary())
        print()
        print(comparison.step_table())
        print()
        print(comparison.category_table())
        print()

    _progress(3, total, f"estimating {args.model} at batch {args.batch} x seq {args.seq} (meta device)")
    ladder, common = _report_configurations(args.batch, args.seq, args.dtype, args.shard)
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
              f"{args.seq}{f', {args.shard}-way sharded' if args.shard > 1 else ''}, AdamW")
        header = ["configuration", "params", "grads", "master", "optimizer", "activations", "logits", "FSDP",
                  "total"]
        rows = [[label.replace("\n", " ")] + [format_bytes(v) for v in result.breakdown().values()]
                + [format_bytes(result.total)] for label, result in estimates]
        print(_table(header, rows))

    _progress(4, total, f"writing {args.out}")
    if estimates:
        try:
            breakdown_chart(estimates, args.out, gpu_bytes=args.gpu_mem,
                            title=f"{estimates[0][1].model}, batch {args.batch} x seq {args.seq}"
                                  f"{f', shard {args.shard}' if args.shard > 1 else ''}: memory per GPU")
            print(f"\nwrote {args.out}")
        except ImportError as error:
            print(f"\nno chart: {error}")
    return 1 if failure else 0


# ----------------------------------------------------------------------------- estimate

def run_estimate(args):
    from memkernels.estimate import estimate, fitting_options
    from memkernels.profile import _table, format_bytes

    options = {"batch": args.batch, "seq": args.seq, "dtype": args.dtype, "optimizer": args.optimizer,
               "shard_degree": args.shard}
    result = estimate(args.model, checkpointing=args.checkpointing, offload=args.offload,
                      use_memkernels=args.memkernels, **options)
    print(result.table())
    if args.gpu_mem is None:
        return 0
    print()
    if result.total <= args.gpu_mem:
        print(f"fits in {format_bytes(args.gpu_mem)}: {format_bytes(args.gpu_mem - result.total)} to spare")
        return 0
    print(f"does not fit in {format_bytes(args.gpu_mem)} (needs {format_bytes(result.total)}); "
          "optimizations, cheapest first:")
    rows, best = [], None
    for row in fitting_options(args.model, args.gpu_mem, **options):
        if row["error"]:
            rows.append((row["name"], row["cost"], "unavailable", row["error"][:60]))
            continue
        rows.append((row["name"], row["cost"], format_bytes(row["total"]), "fits" if row["fits"] else "no"))
        if row["fits"] and best is None:
            best = row["name"]
    print(_table(("option", "cost", "per GPU", "fits"), rows))
    if best:
        print(f"\ncheapest that fits: {best}")
        return 0
    print("\nnothing fits at this shard degree; shard over more GPUs or lower the micro-batch / sequence")
    return 0


def _add_report(subparsers):
    from memkernels.estimate import DTYPES
    from memkernels.models import BUILTIN_CONFIGS

    models = ", ".join(name for name in BUILTIN_CONFIGS if not name.startswith("tiny-"))
    report = subparsers.add_parser(
        "report", help="baseline vs memkernels training step, and a large-model estimate",
        description="One training step of the embedded tiny-gpt and tiny-llama models, eager vs memkernels, then a "
        "per-GPU "
        "estimate of --model across configurations (fp32, mixed precision, checkpointing, offload, memkernels).")
    report.add_argument("--model", default="llama-3-8b", help=f"model to estimate: {models} or a config.json path")
    report.add_argument("--batch", type=_positive, default=1, help="per-GPU micro-batch of the estimate")
    report.add_argument("--seq", type=_positive, default=8192, help="sequence length of the estimate")
    report.add_argument("--dtype", choices=[d for d in DTYPES if d != "fp32"], default="bf16",
                        help="mixed precision of the estimate's configurations")
    report.add_argument("--shard", type=_positive, default=8, help="FSDP/ZeRO-3 shard degree of the estimate")
    report.add_argument("--gpu-mem", type=parse_bytes, default=None, help="draw a capacity line, e.g. 80GB")
    report.add_argument("--out", default="memkernels-report.png", help="path of the PNG chart")
    report.set_defaults(run=run_report)


def _add_estimate(subparsers):
    from memkernels.estimate import DTYPES, OPTIMIZERS
    from memkernels.models import BUILTIN_CONFIGS

    models = ", ".join(name for name in BUILTIN_CONFIGS if not name.startswith("tiny-"))
    est = subparsers.add_parser("estimate", help="per-GPU memory of a training run, and what makes it fit")
    est.add_argument("--model", required=True, help=f"{models} or a Hugging Face config.json path")
    est.add_argument("--batch", type=_positive, required=True, help="per-GPU micro-batch")
    est.add_argument("--seq", type=_positive, required=True, help="sequence length")
    est.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    est.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
    est.add_argument("--shard", type=_positive, default=1, help="FSDP/ZeRO-3 shard degree")
    est.add_argument("--gpu-mem", type=parse_bytes, default=None, help="GPU capacity, e.g. 80GB or 79.6GiB")
    est.add_argument("--checkpointing", action="store_true")
    est.add_argument("--offload", action="store_true")
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
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="snapshot pickle(s)")
    parser.add_argument("--device", type=int, default=None, help="replay only this device (default: every device)")
    parser.add_argument("--capacity", type=int, default=None, help="device memory in bytes (default: unlimited)")
    parser.add_argument("--repeats", type=int, default=5, help="replays per trace for the ns/op median")
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
        from memkernels.allocator import print_replay_table

        print_replay_table(
            args.traces,
            device=args.device,
            capacity=args.capacity,
            repeats=args.repeats,
            simulated_device=args.simulated_device,
            expandable_segments=args.expandable_segments,
        )
        return 0

    parser.set_defaults(run=run)


_SUBCOMMANDS = [_add_report, _add_estimate, _add_replay]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="memkernels", description="memkernels: measure, then save GPU memory.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"memkernels {args.command}: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
