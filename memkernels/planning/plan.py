"""``memkernels.plan``: what to turn on so that a training run fits, at the least cost in speed.

The flow walks the usual decision list in order of cost and records each step in
``Plan.steps`` (taken or not, what it saves, what it costs, why):

1. mixed precision (the ``dtype`` asked for);
2. memkernels' fused kernels (save memory without recompute);
3. sharding over ``gpus`` ranks: ZeRO-1 (optimizer state), ZeRO-2 (+ gradients), ZeRO-3 / FSDP
   (+ parameters): of the stages that fit, the one whose best micro-batch and placement add the
   least step time (ZeRO-3's parameter all-gathers counted, see :func:`gather_seconds`; ties go to
   the lower stage);
4. selective checkpointing and 5. activation offload: a per-layer placement chosen by
   :func:`memkernels.planning.placement.solve` (a DP over layers against the activation budget);
6. optimizer-state CPU offload (needs ``host_mem`` for the fp32 master weights and moments);
7. LoRA, then QLoRA, when full fine-tuning cannot fit at micro-batch 1.

The micro-batch is the one of least added step time (a fraction of the step's compute) among those
that fit, the larger on a tie, and accumulation = global / (micro x gpus). ``max_overhead`` refuses
configurations above that fraction (the flow then falls back as when nothing fits, and says what
it would take). The activation budget is ``gpu_mem`` minus ``margin`` (default
1 GiB for the CUDA context and library workspaces + 5% of ``gpu_mem`` for fragmentation)
minus model state (:func:`memkernels.planning.estimate.model_state_bytes`) and FSDP's gather buffers.
"""
import contextlib
import contextvars
import dataclasses
import math

from memkernels.planning import placement as placement_mod
from memkernels.planning.estimate import (DTYPES, FINETUNE_MODES, OPTIMIZERS, ModelSource, default_margin, layer_numel,
                                          lora_parameters, model_state_bytes)
from memkernels.runtime.sizes import format_size, parse_count, parse_device_size, parse_size

__all__ = ["plan", "place", "Plan", "Step", "machine_host_memory"]


@dataclasses.dataclass
class Step:
    """One step of the flow: ``name``, ``taken`` (bool), ``saves`` / ``costs`` (text), ``reason``."""

    name: str
    taken: bool
    saves: str
    costs: str
    reason: str


@dataclasses.dataclass
class Candidate:
    """One configuration the flow tried: fine-tuning mode, ZeRO stage, optimizer offload, and its figures."""

    finetune: str
    zero_stage: int
    optimizer_offload: bool
    state: dict
    fsdp_buffers: int
    budget: int
    placement: object
    host_needed: int
    gather_seconds: float = 0.0  # ZeRO-3's parameter all-gathers, per micro-batch
    sequence_seconds: float = 0.0  # compute of one sequence's training step (cost model)
    micro_batch: int = 1

    @property
    def overhead(self):
        """Added step time of ``placement`` (recompute, offload, ZeRO-3 gathers) over the micro-batch's compute."""
        return (self.placement.added_seconds + self.gather_seconds) / (self.placement.batch * self.sequence_seconds)

    @property
    def per_gpu_state(self):
        return sum(v for k, v in self.state.items() if k != "host_optimizer") + self.fsdp_buffers

    def label_stage(self):
        return f"ZeRO-{self.zero_stage}, " if self.zero_stage else ""

    def label(self, gpus):
        parts = [self.finetune if self.finetune != "full" else "full fine-tuning"]
        if gpus > 1:
            parts.append(f"ZeRO-{self.zero_stage}" if self.zero_stage else "DDP (no sharding)")
        if self.optimizer_offload:
            parts.append("optimizer-state CPU offload")
        return " + ".join(parts)


@dataclasses.dataclass
class Plan:
    """The result of :func:`plan`. ``fits``: whether a configuration fits; ``steps``: the flow;
    ``config``: the chosen :class:`Candidate` (or the nearest one when nothing fits);
    ``placement``: its per-layer :class:`~memkernels.planning.placement.Placement` at ``micro_batch``;
    ``accumulation``: gradient-accumulation steps; ``alternatives``: LoRA / QLoRA figures;
    ``missing``: bytes short per GPU when nothing fits (else 0)."""

    model: str
    gpu_mem: int
    gpus: int
    seq: int
    dtype: str
    optimizer: str
    margin: int
    host_mem: int
    kernels: bool
    steps: list
    config: Candidate
    placement: object
    micro_batch: int
    accumulation: int
    global_batch_tokens: int
    step_seconds: float
    alternatives: list
    fits: bool
    missing: int
    nearest: str
    lora_rank: int = 16
    notes: list = dataclasses.field(default_factory=list)  # what the plan changed of what was asked, in words
    head: str = ""  # what the activations count for the LM head and loss, in words
    max_overhead: float = None
    runners_up: list = dataclasses.field(default_factory=list)  # [{zero_stage, micro_batch, overhead, ...}]

    @property
    def choices(self):
        return self.placement.choices

    @property
    def overhead(self):
        """Predicted added step time (recompute, offload, ZeRO-3's gathers), as a fraction of the step's compute."""
        return self.config.overhead

    def breakdown(self):
        """{part: bytes} of one GPU at the chosen micro-batch."""
        rows = {k.replace("_", " "): v for k, v in self.config.state.items() if k != "host_optimizer"}
        rows["FSDP gather buffers"] = self.config.fsdp_buffers
        rows["activations (peak)"] = self.placement.predicted_peak
        rows["margin (context, workspaces, fragmentation)"] = self.margin
        return rows

    def integrations(self):
        """Configuration text for what other libraries do (PEFT, bitsandbytes, FSDP2 / DeepSpeed)."""
        lines = []
        if self.config.finetune != "full":
            lines.append("peft.LoraConfig(r=%d, lora_alpha=%d, lora_dropout=0.0, target_modules=\"all-linear\", "
                         "task_type=\"CAUSAL_LM\")" % (self.lora_rank, 2 * self.lora_rank))
        if self.config.finetune == "qlora":
            lines.append("transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", "
                         "bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)")
        if self.gpus > 1 and self.config.zero_stage:
            offload = ', "offload_optimizer": {"device": "cpu", "pin_memory": true}' \
                if self.config.optimizer_offload else ""
            lines.append(f'DeepSpeed: "zero_optimization": {{"stage": {self.config.zero_stage}{offload}}}')
            if self.config.zero_stage == 3:
                lines.append("FSDP2: fully_shard(layer) for each decoder layer, then fully_shard(model)"
                             + ("; CPUOffloadPolicy for the optimizer state" if self.config.optimizer_offload
                                else ""))
            else:
                lines.append(f"FSDP2 has no ZeRO-{self.config.zero_stage}: use DeepSpeed, or FSDP2's "
                             "fully_shard(reshard_after_forward=False) (ZeRO-2-like)")
        elif self.config.optimizer_offload:
            lines.append('DeepSpeed: "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}')
        return lines

    def table(self):
        out = [f"plan for {self.model}: {self.gpus} x {format_size(self.gpu_mem)}, seq {self.seq}, {self.dtype}, "
               f"{self.optimizer}" + (f", host {format_size(self.host_mem)}" if self.host_mem else "")]
        out += [f"note: {note}" for note in self.notes]
        out += ["", "flow:"]
        for number, step in enumerate(self.steps, 1):
            mark = "taken" if step.taken else "skipped"
            detail = "; ".join(x for x in (step.saves and f"saves {step.saves}", step.costs and f"costs {step.costs}")
                               if x)
            out.append(f"  {number}. {step.name}: {mark}" + (f" ({detail})" if detail else "") + f" - {step.reason}")
        out.append("")
        if not self.fits:
            out.append(f"NOTHING FITS: the nearest configuration ({self.config.label(self.gpus)}) needs "
                       f"{format_size(self.missing)} more per GPU at micro-batch 1. {self.nearest}"
                       + (f" Counted for the LM head and loss: {self.head}." if self.head else ""))
        else:
            out.append(f"configuration: {self.config.label(self.gpus)}"
                       + (" + memkernels kernels" if self.kernels else ""))
        out.append(f"placement: {self.placement.describe()}")
        if self.head and self.fits:
            out.append(f"LM head and loss: {self.head}")
        out.append("per GPU:")
        for name, nbytes in self.breakdown().items():
            out.append(f"  {name:<46} {format_size(nbytes):>12}")
        total = sum(self.breakdown().values())
        out.append(f"  {'total':<46} {format_size(total):>12}   of {format_size(self.gpu_mem)}")
        if self.config.host_needed:
            out.append(f"host memory needed: {format_size(self.config.host_needed)}")
        if self.fits:
            tokens = self.micro_batch * self.gpus * self.accumulation * self.seq
            out.append(f"micro-batch {self.micro_batch} x {self.gpus} GPUs x {self.accumulation} accumulation steps "
                       f"x seq {self.seq} = {tokens:,} tokens per optimizer step")
            gathers = (f", ZeRO-3 parameter all-gathers {self.config.gather_seconds * 1e3:.0f} ms"
                       if self.config.gather_seconds else "")
            out.append(f"predicted overhead: +{self.overhead:.1%} step time (modelled: recompute "
                       f"{self.placement.recompute_flops / 1e12:.2f} TFLOP, offload "
                       f"{format_size(self.placement.offload_bytes)} per micro-batch{gathers}"
                       + ("; not counted: the optimizer step on the CPU and its PCIe traffic"
                          if self.config.optimizer_offload else "") + ")"
                       + (f"; max_overhead {self.max_overhead:.1%}" if self.max_overhead is not None else ""))
            for other in self.runners_up:
                out.append(f"  runner-up: ZeRO-{other['zero_stage']}, micro-batch {other['micro_batch']}: "
                           f"+{other['overhead']:.1%} ({format_size(other['activations'])} of activations)")
        for alt in self.alternatives:
            out.append(alt["text"])
        lines = self.integrations()
        if lines:
            out.append("configure in other libraries:")
            out += [f"  {line}" for line in lines]
        return "\n".join(out)

    __str__ = table

    def to_dict(self):
        return {"model": self.model, "gpu_mem": self.gpu_mem, "gpus": self.gpus, "seq": self.seq,
                "dtype": self.dtype, "fits": self.fits, "missing": self.missing, "nearest": self.nearest,
                "finetune": self.config.finetune, "zero_stage": self.config.zero_stage,
                "optimizer_offload": self.config.optimizer_offload, "kernels": self.kernels,
                "host_needed": self.config.host_needed, "micro_batch": self.micro_batch,
                "accumulation": self.accumulation, "overhead": self.overhead,
                "placement": self.placement.to_dict(), "breakdown": self.breakdown(),
                "steps": [dataclasses.asdict(s) for s in self.steps], "alternatives": self.alternatives,
                "integrations": self.integrations(), "notes": list(self.notes), "head": self.head,
                "max_overhead": self.max_overhead, "runners_up": self.runners_up}


def _memory_limit_bytes():
    """This machine's memory: MemTotal, or its cgroup's limit (v2 memory.max, v1 memory.limit_in_bytes) when
    lower, as a container sees it. None where /proc/meminfo cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo") as meminfo:
            total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as limit_file:
                limit = limit_file.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def machine_host_memory(gpus):
    """``(bytes, how)``: the host memory ``host_mem="auto"`` assumes for a run on ``gpus`` GPUs, or ``(None, why)``.

    On a machine with CUDA GPUs: half of its memory (:func:`_memory_limit_bytes`) for each machine of its GPU count
    the run needs, ceil(gpus / GPUs here), assuming identical machines. The other half is left to the OS, the
    training processes and their data loaders: offload buffers are pinned (page-locked), so the OS cannot page
    them out. Without a GPU, None: the machine planning is not the one that will train.
    """
    import torch

    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if here == 0:
        return None, ("no host memory assumed for offload: this machine has no CUDA GPU, so its memory is not the "
                      "training machine's; give it with host_mem= / --host-mem")
    total = _memory_limit_bytes()
    if total is None:
        return None, "no host memory assumed for offload: this machine's memory is unknown; give it with --host-mem"
    machines = -(-gpus // here)
    assumed = total // 2 * machines
    return assumed, (f"host memory for offload: {format_size(assumed)} assumed, half of this machine's "
                     f"{format_size(total)} x {machines} machine(s) of {here} GPUs; --host-mem sets it, "
                     "--host-mem 0 plans without host memory")


def _bytes_arg(name, value, device=False, zero=False):
    if isinstance(value, str):
        return (parse_device_size if device else parse_size)(value, what=f"plan({name}=...)")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (value == 0 and not zero):
        kind = "a non-negative" if zero else "a positive"
        raise ValueError(f"plan({name}={value!r}): give bytes as {kind} int or a size like '80GB'")
    return value


_UNITS = {"seq": "tokens per sequence, or 'max'", "gpus": "GPUs", "batch": "sequences", "budget": "bytes",
          "global_batch_tokens": "tokens", "lora_rank": "", "max_micro_batch": "sequences"}


def _positive(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        unit = _UNITS.get(name)
        raise ValueError(f"plan({name}={value!r}): must be a positive int" + (f" ({unit})" if unit else ""))
    return value


def _fraction(name, value):
    """None, or a fraction from 0.1 or "10%"."""
    if value is None:
        return None
    text = value.strip() if isinstance(value, str) else None
    try:
        number = float(text[:-1]) / 100 if text and text.endswith("%") else float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or not math.isfinite(number) or number < 0:
        raise ValueError(f"plan({name}={value!r}): give a non-negative fraction (0.1) or a percentage ('10%')")
    return number


def place(model, *, batch, seq, budget, offload=False, kernels=False, tflops=400.0, pcie_gbps=25.0):
    """The cheapest per-layer :class:`~memkernels.planning.placement.Placement` of ``model`` whose
    predicted activation peak (one training step, on top of model state) fits ``budget`` bytes.

    ``model``: a memkernels TransformerLM or a Hugging Face causal LM (measured on a meta copy of
    4 layers, in the model's dtype, in train mode); ``batch`` x ``seq``: the micro-batch.
    ``kernels``: with memkernels' kernels (fused norms and MLPs, and the fused linear cross-entropy
    where ``apply`` installs it, counted for the backend the model's device runs: Triton on a GPU,
    the PyTorch path on the CPU). Carry it out with ``memkernels.apply(model, placement)``.
    """
    _positive("batch", batch)
    _positive("seq", seq)
    _positive("budget", budget)
    parameter = next(model.parameters())
    backend = "triton" if parameter.device.type == "cuda" else "torch"
    profile = placement_mod.measure_profile(ModelSource(model), seq, parameter.dtype, offload=offload, kernels=kernels,
                                            backend=backend)
    return placement_mod.solve(profile, batch, budget, offload=offload, tflops=tflops, pcie_gbps=pcie_gbps)


def _micro_candidates(per_rank, max_micro):
    if per_rank is None:
        return [2 ** k for k in range(int(math.log2(max_micro)) + 1)]
    return [d for d in range(1, min(per_rank, max_micro) + 1) if per_rank % d == 0]


def plan(model_or_config, *, gpu_mem, seq, global_batch_tokens=None, gpus=1, host_mem=None, dtype="bf16",
         optimizer="adamw", finetune="full", lora_rank=16, pcie_gbps=25.0, tflops=400.0, margin=None,
         kernels=True, max_micro_batch=1024, zero_stage=None, max_overhead=None, link_gbps=100.0):
    """Plan a training run so that it fits ``gpu_mem`` per GPU: a :class:`Plan` (``.table()``, ``.to_dict()``).

    ``model_or_config``: a built-in name, a config (object, dict, config.json) or a model. ``seq="max"``: the
    longest sequence that fits (within ``max_overhead`` when given), found by doubling from 4,096 tokens and then
    bisection to a multiple of :data:`SEQ_STEP`; the plan at that length, with a note saying how it was found.
    ``gpu_mem`` / ``host_mem``: bytes or sizes like ``"80GB"`` (JEDEC: 80·2³⁰); ``host_mem`` is the
    host memory of all ``gpus`` together (None: plan without it; ``"auto"``: :func:`machine_host_memory`, said
    in ``notes``). ``seq``: tokens per sequence. ``global_batch_tokens``:
    tokens per optimizer step (not a multiple of seq x gpus: the nearest that is, said in ``notes``). ``finetune``: ``full``, ``lora`` or
    ``qlora`` (the first mode tried; the flow falls back to LoRA, then QLoRA). ``pcie_gbps``: host
    link GB/s, ``tflops``: sustained TFLOP/s per GPU (cost model). ``margin``: bytes kept free (0 allowed).
    ``kernels``: consider memkernels' fused kernels (measured; skipped when unavailable).
    ``zero_stage``: force a ZeRO stage (default: of those that fit, the one adding the least step time).
    ``max_overhead``: the most added step time accepted, a fraction (0.1) or a percentage ("10%"); configurations
    above it count as not fitting. ``link_gbps``: per-GPU collective bandwidth in GB/s (NCCL bus bandwidth: about
    350 within an H100 node's NVLink, 45 over 400 Gb/s InfiniBand), for ZeRO-3's parameter all-gathers.
    """
    if isinstance(seq, str) and seq.strip().lower() == "max":
        arguments = dict(locals())
        return _longest(arguments.pop("model_or_config"), arguments)
    max_overhead = _fraction("max_overhead", max_overhead)
    gpu_mem = _bytes_arg("gpu_mem", gpu_mem, device=True)
    _positive("seq", seq)
    _positive("gpus", gpus)
    _positive("lora_rank", lora_rank)
    _positive("max_micro_batch", max_micro_batch)
    host_note = None
    if isinstance(host_mem, str) and host_mem.strip().lower() == "auto":
        host_mem, host_note = machine_host_memory(gpus)
    host_mem = None if host_mem is None else _bytes_arg("host_mem", host_mem)
    if finetune not in FINETUNE_MODES:
        raise ValueError(f"plan(finetune={finetune!r}): unknown fine-tuning mode; use one of "
                         f"{', '.join(FINETUNE_MODES)}")
    if dtype not in DTYPES:
        raise ValueError(f"plan(dtype={dtype!r}): use one of {', '.join(DTYPES)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"plan(optimizer={optimizer!r}): use one of {', '.join(OPTIMIZERS)}")
    for name, value in (("pcie_gbps", pcie_gbps), ("tflops", tflops), ("link_gbps", link_gbps)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"plan({name}={value!r}): must be a positive number")
    if zero_stage is not None and (zero_stage not in (0, 1, 2, 3) or (zero_stage and gpus == 1)):
        raise ValueError(f"plan(zero_stage={zero_stage!r}): use 0, 1, 2 or 3 (1-3 need gpus > 1), or None")
    margin = (default_margin(gpu_mem) if margin is None
              else _bytes_arg("margin", margin, zero=True))
    per_rank, notes = None, [host_note] if host_note else []
    if global_batch_tokens is not None:
        tokens = parse_count(global_batch_tokens, what="plan(global_batch_tokens=...)") \
            if isinstance(global_batch_tokens, str) else _positive("global_batch_tokens", global_batch_tokens)
        unit = seq * gpus
        per_rank = max(1, round(tokens / unit))
        if per_rank * unit != tokens:  # "4M" is what people type: plan the nearest batch, and say so
            notes.append(f"a global batch of {tokens:,} tokens is not a multiple of seq x gpus = {unit:,}; planned "
                         f"for {per_rank * unit:,} tokens, the nearest reachable with whole sequences")
    if gpu_mem <= margin:
        raise ValueError(f"plan(gpu_mem={format_size(gpu_mem)}): at most the margin ({format_size(margin)}); "
                         "give the GPU's memory, or a smaller margin=")

    source = ModelSource(model_or_config)
    if source.config is not None and source.config.position == "learned" and seq > source.config.max_seq_len:
        raise ValueError(f"plan(seq={seq}): {source.name} has learned positions up to "
                         f"{source.config.max_seq_len} tokens")
    compute_dtype = DTYPES[dtype][3]
    num_parameters, numel_per_layer, adapters, adapted = _parameter_counts(source, lora_rank)
    weight_bytes, grad_bytes = DTYPES[dtype][:2]

    leanest = model_state_bytes(num_parameters + adapters, dtype=dtype, optimizer=optimizer,
                                zero_stage=3 if gpus > 1 else 0, ranks=gpus, trainable=adapters, quantized=adapted,
                                optimizer_offload=True)
    leanest_bytes = sum(v for k, v in leanest.items() if k != "host_optimizer")
    if leanest_bytes > gpu_mem - margin:
        raise ValueError(f"plan(gpu_mem={format_size(gpu_mem)}): below the model state of the leanest configuration "
                         f"(QLoRA{', ZeRO-3' if gpus > 1 else ''}, optimizer offload: {format_size(leanest_bytes)} per "
                         f"GPU + {format_size(margin)} margin); use GPUs with more memory or more GPUs (gpus=)")

    steps = []
    if dtype == "fp32":
        steps.append(Step("mixed precision", False, "", "", "fp32 asked for: bf16 would halve activations and "
                          "weights (model state stays 16 B/param with AdamW)"))
    else:
        steps.append(Step("mixed precision", True, "half the activation bytes of fp32", "none on tensor cores",
                          f"{dtype} weights and activations, fp32 master weights"))

    act_offload = host_mem is not None
    deciding = _deciding.get()  # a search's question, whether it fits: the micro-batch and alternatives are not asked
    batches = (1,) if deciding else (1, 2)  # micro-batch 2's steps only where micro-batches are compared
    # Without kernels, the keep-everything steps first: the rest of the profile only if the kernels lose.
    profile = placement_mod.measure_profile(source, seq, compute_dtype, offload=act_offload, keep_only=kernels,
                                            batches=batches)
    use_kernels = False
    if kernels:
        try:
            fused = placement_mod.measure_profile(source, seq, compute_dtype, kernels=True, offload=act_offload,
                                                  batches=batches)
        except (ImportError, RuntimeError) as error:
            steps.append(Step("memkernels kernels", False, "", "", f"unavailable here ({error})"[:200]))
        else:
            plain_peak = profile.keep_peak(1)
            fused_peak = fused.keep_peak(1)
            if fused_peak < plain_peak:
                use_kernels, profile = True, fused
                mlp = getattr(source.config, "mlp", None)
                mlps = {"swiglu": "SwiGLU MLPs", "geglu": "GeGLU MLPs"}.get(mlp, "GELU MLPs" if mlp else "MLPs")
                costs = (f"{fused.head_recompute / 1e12:.2f} TFLOP a sequence (the loss recomputes its logits in "
                         "backward)" if fused.head is not None else "no recompute")
                # The two peaks are estimate's "activation peak of the step" for the same run, with and without
                # --memkernels: the figure a reader can check across the commands.
                steps.append(Step("memkernels kernels", True, f"{format_size(plain_peak - fused_peak)} of activation "
                                  f"peak at micro-batch 1, every layer kept: {format_size(plain_peak)} -> "
                                  f"{format_size(fused_peak)}", costs,
                                  f"fused norms and {mlps}; " + _head_text(fused.head)))
            else:
                steps.append(Step("memkernels kernels", False, "", "", "they save nothing measurable on this model"))
    else:
        steps.append(Step("memkernels kernels", False, "", "", "kernels=False"))
    if not use_kernels:
        profile = placement_mod.measure_profile(source, seq, compute_dtype, offload=act_offload, batches=batches)

    sequence_seconds = profile.step_flops / (tflops * 1e12)

    def solve(micro, budget, host_optimizer=0, enough=None):
        host_budget = None if host_mem is None else max(0, host_mem - host_optimizer) // gpus
        return placement_mod.solve(profile, micro, max(budget, 1), offload=act_offload, tflops=tflops,
                                   pcie_gbps=pcie_gbps, host_budget=host_budget, enough=enough)

    def candidate(mode, stage, opt_offload):
        trainable = None if mode == "full" else adapters
        params = num_parameters + (0 if mode == "full" else adapters)
        state = model_state_bytes(params, dtype=dtype, optimizer=optimizer, zero_stage=stage, ranks=gpus,
                                  trainable=trainable, quantized=adapted if mode == "qlora" else 0,
                                  optimizer_offload=opt_offload,
                                  grad_accumulation=per_rank is not None and per_rank > 1)
        fsdp = numel_per_layer * (2 * weight_bytes + (grad_bytes if mode == "full" else 0)) \
            if gpus > 1 and stage == 3 else 0
        per_gpu = sum(v for k, v in state.items() if k != "host_optimizer") + fsdp
        budget = gpu_mem - margin - per_gpu
        gathers = gather_seconds(state["parameters"] * gpus, gpus, link_gbps) if stage == 3 and gpus > 1 else 0.0

        def enough(placement):  # a search asks only whether it fits: any placement within the cap answers
            return max_overhead is None or (placement.added_seconds + gathers) / sequence_seconds <= max_overhead

        found = solve(1, budget, state["host_optimizer"], enough if deciding else None)
        host = state["host_optimizer"] + found.offload_bytes * gpus
        return Candidate(mode, stage, opt_offload, state, fsdp, budget, found, host, gathers, sequence_seconds)

    def host_fits(c, placement):
        return host_mem is None or c.state["host_optimizer"] + placement.offload_bytes * gpus <= host_mem

    def memory_fits(c):
        return c.budget > 0 and c.placement.fits and host_fits(c, c.placement)

    def fits(c):
        return memory_fits(c) and (max_overhead is None or c.overhead <= max_overhead)

    def cheapest_micro(c):
        """``c`` at its micro-batch of least added step time (the larger on a tie) among those that fit."""
        options = _micro_candidates(per_rank, max_micro_batch)
        lo, hi = 0, len(options) - 1
        while lo < hi:  # largest fitting micro-batch: fitting is monotone in it
            mid = (lo + hi + 1) // 2
            trial = solve(options[mid], c.budget, c.state["host_optimizer"])
            if trial.fits and host_fits(c, trial):
                lo = mid
            else:
                hi = mid - 1
        best = c
        for micro in options[1:lo + 1]:
            trial = dataclasses.replace(c, placement=solve(micro, c.budget, c.state["host_optimizer"]), micro_batch=micro)
            if trial.overhead <= best.overhead + 1e-12:
                best = trial
        return best

    def closeness(c):
        """How near a failing candidate comes: fitting the memory (the overhead cap binds) at the least overhead,
        else with the most activation budget to spare."""
        return (1, -c.overhead) if memory_fits(c) else (0, c.budget - c.placement.predicted_peak)

    stages = (zero_stage,) if zero_stage is not None else (0, 1, 2, 3) if gpus > 1 else (0,)
    # The flow falls back to LoRA, then QLoRA; a search asks about the mode given only.
    modes = FINETUNE_MODES[FINETUNE_MODES.index(finetune):][:1 if deciding else None]
    chosen, nearest_fail, alternatives, runners_up = None, None, [], []
    for mode in modes:
        tried = []
        for stage in stages:
            tried.append(candidate(mode, stage, False))
            if deciding and fits(tried[-1]):  # one that fits answers the search's question
                break
        fitting = [c if deciding else cheapest_micro(c) for c in tried if fits(c)]
        nearest_fail = max([c for c in tried if not fits(c)] + ([nearest_fail] if nearest_fail else []),
                           key=closeness, default=nearest_fail)
        ranked = sorted(fitting, key=lambda c: (round(c.overhead, 12), c.zero_stage))
        if ranked:
            found, *runners_up = ranked
        else:
            found = None
        if gpus > 1:
            steps.append(_sharding_step(mode, found, tried[-1], gpus, forced=zero_stage is not None,
                                        others=runners_up, max_overhead=max_overhead))
        if found is None:
            # Optimizer-state CPU offload, at the highest stage tried.
            c = candidate(mode, stages[-1], True)
            steps.append(_optimizer_offload_step(mode, c, host_mem, gpus))
            if host_mem is not None and c.host_needed <= host_mem and fits(c):
                found = c if deciding else cheapest_micro(c)
            elif closeness(c) > closeness(nearest_fail):
                nearest_fail = c
        if found is not None:
            chosen = found
            break
        over_cap = (min((t for t in tried if memory_fits(t)), key=lambda t: t.overhead, default=None)
                    if max_overhead is not None else None)
        steps.append(Step(f"{mode} fine-tuning", False, "", "",
                          _over_cap(over_cap, max_overhead) if over_cap else _why_not(c, host_mem, gpus)))
    if chosen is not None:
        if chosen.finetune != finetune:
            steps.append(Step(f"{chosen.finetune}", True, "", "",
                              f"{finetune} fine-tuning cannot fit at micro-batch 1"
                              + (f" within {max_overhead:.1%} added step time" if max_overhead is not None else "")
                              + f"; {chosen.finetune} fits"))
    # LoRA / QLoRA shown with their own figures whatever was chosen.
    for mode in () if deciding else ("lora", "qlora"):
        if chosen is not None and chosen.finetune == mode:
            continue
        alt = None
        for stage in stages:
            alt = candidate(mode, stage, False)
            if fits(alt):
                break
        per_gpu = alt.per_gpu_state + alt.placement.predicted_peak + margin
        alternatives.append({"finetune": mode, "zero_stage": alt.zero_stage, "fits": fits(alt), "per_gpu": per_gpu,
                             "model_state": alt.per_gpu_state, "activations": alt.placement.predicted_peak,
                             "placement": alt.placement.describe(), "overhead": alt.overhead,
                             "recomputed_layers": sum(1 for ch in alt.placement.choices if ch.recomputed)})
        alternatives[-1]["text"] = (f"alternative {alt.label(gpus)}: {format_size(per_gpu)} per GPU at micro-batch 1 "
                            f"({'fits' if fits(alt) else 'does not fit'}; model state {format_size(alt.per_gpu_state)}"
                            f", activations {format_size(alt.placement.predicted_peak)} with "
                            f"{alt.placement.describe()}; +{alt.overhead:.1%} step time)")

    config = chosen if chosen is not None else nearest_fail
    micro, accumulation = config.micro_batch, (per_rank or 1)
    if chosen is not None:
        accumulation = per_rank // micro if per_rank else 1
        steps.append(_placement_step(config.placement, act_offload))
        steps.append(Step("micro-batch", True, "", "", f"least added step time of those that fit: {micro}"
                          + (f"; accumulation {accumulation} to reach the global batch" if per_rank else "")))
    missing, nearest = 0, ""
    if chosen is None and not deciding and max_overhead is not None and memory_fits(config):  # the cap binds
        need = _budget_within(solve, config, max_overhead)
        missing = 0 if need is None else max(0, need - config.budget)
        nearest = _nearest_within(config, need, max_overhead, margin)
    elif chosen is None and not deciding:
        missing = max(0, config.placement.predicted_peak - config.budget)
        nearest = _nearest_fit(config, gpu_mem, gpus, host_mem, margin)
    return Plan(model=source.name, gpu_mem=gpu_mem, gpus=gpus, seq=seq, dtype=dtype, optimizer=optimizer,
                margin=margin, host_mem=host_mem, kernels=use_kernels, steps=steps, config=config,
                placement=config.placement, micro_batch=micro, accumulation=accumulation,
                global_batch_tokens=(per_rank * seq * gpus) if per_rank else None,
                step_seconds=micro * sequence_seconds, alternatives=alternatives, fits=chosen is not None,
                missing=missing, nearest=nearest, lora_rank=lora_rank, notes=notes,
                head=_head_text(profile.head if use_kernels else None, fused=use_kernels), max_overhead=max_overhead,
                runners_up=[{"zero_stage": c.zero_stage, "micro_batch": c.micro_batch, "overhead": c.overhead,
                             "activations": c.placement.predicted_peak, "placement": c.placement.describe()}
                            for c in runners_up])


_counts = {}  # (model key, LoRA rank) -> _parameter_counts(...)


def _parameter_counts(source, lora_rank):
    """(parameters, parameters a decoder layer, LoRA adapter parameters, parameters LoRA adapts) of ``source``, from
    a meta build of the whole model: once a model and rank (Qwen2-72B's 80 layers take 0.1 s a build; a search
    plans 10-30 lengths)."""
    key = (source.key(), lora_rank)
    if key not in _counts:
        full = source.build()
        _counts[key] = (sum(p.numel() for p in full.parameters()), layer_numel(full),
                        *lora_parameters(full, lora_rank))
    return _counts[key]


SEQ_STEP = 1024  # seq="max" answers in multiples of this many tokens
SEQ_CEILING = 1 << 22
# Set by plan(seq="max")'s search: plan() decides whether it fits and skips what only a shown plan needs.
_deciding = contextvars.ContextVar("memkernels.plan: deciding whether a length fits", default=False)


def _longest(model_or_config, arguments):
    """plan(seq="max"): the Plan at the longest ``seq`` that fits in the fine-tuning mode asked for (a length
    that fits only by falling back to LoRA / QLoRA does not count), assuming fitting is monotone in the
    length (memory grows with it; the added time's share of the step, with it, as a rule).

    The answer rests on measured plans only: L fits and L + :data:`SEQ_STEP` does not, both measured. Two
    lengths are measured first (4,096 and 8,192 tokens, or 1,024 when 4,096 does not fit); then each round
    searches the lengths between the longest measured to fit and the shortest measured not to with profiles
    predicted from those measured (``placement.predicted_lengths``: bytes affine in the length), and measures
    the predicted boundary and the length after it (the first round: the boundary alone). A good prediction ends
    the search in two rounds; after two, it gallops on measurements alone (1,024 x 2, 4, 8, ... tokens from the
    side measured last, then bisection), as predictions can be off by the steps where the DP's choices change."""
    source = ModelSource(model_or_config)
    learned = source.config is not None and source.config.position == "learned"
    ceiling = source.config.max_seq_len if learned else SEQ_CEILING
    # length -> Plan, deciding whether it fits only; predictions are the round's (from the lengths measured so far)
    measured, predicted = {}, {}
    guesses = 0

    def attempt(tokens, guess=False):
        nonlocal guesses
        table = predicted if guess and tokens not in measured else measured
        if tokens not in table:
            guesses += table is predicted
            token = _deciding.set(True)
            try:
                with placement_mod.predicted_lengths() if guess else contextlib.nullcontext():
                    table[tokens] = plan(model_or_config, **{**arguments, "seq": tokens})
            finally:
                _deciding.reset(token)
        return table[tokens]

    def fits(tokens, guess=False):
        result = attempt(tokens, guess)
        return result.fits and result.config.finetune == arguments["finetune"]

    low, high = 0, ceiling + 1  # the longest length measured to fit (0: none), the shortest measured not to
    last_fit = False

    def measure(tokens):
        nonlocal low, high, last_fit
        last_fit = fits(tokens)
        if last_fit:
            low = max(low, tokens)
        else:
            high = min(high, tokens)

    first = min(4 * SEQ_STEP, ceiling)
    measure(first)
    second = min(2 * first, ceiling) if low else SEQ_STEP
    if second != first:
        measure(second)
    rounds, gap = 0, 2 * SEQ_STEP
    while high - low > SEQ_STEP and (low or high > SEQ_STEP):
        rounds += 1
        if rounds > 2:  # the predictions missed twice: gallop from the side measured last, then bisect
            tokens = low + gap if last_fit else high - gap
            gap *= 2
            if not low < tokens < high:
                tokens = max(low + SEQ_STEP, (low + high) // 2 // SEQ_STEP * SEQ_STEP)
            measure(tokens)
            continue
        predicted.clear()  # measured since: a round predicts from every length measured before it
        guess_low, guess_high = low, high  # the predicted boundary, doubling from low, then bisecting
        while guess_high - guess_low > SEQ_STEP:
            step = (2 * max(guess_low, SEQ_STEP) if guess_high > ceiling and guess_low
                    else (guess_low + guess_high) // 2)
            middle = min(step // SEQ_STEP * SEQ_STEP, guess_high - 1)
            if middle <= guess_low:
                break
            if fits(middle, guess=True):
                guess_low = middle
            else:
                guess_high = middle
        # The first round measures one length: its prediction extrapolates from 4,096 and 8,192 tokens (Llama-3-8B
        # on 8 x 80 GB with 1 TB of host memory: 364,544 predicted, 410,624 measured), and the length measured near
        # the boundary is the anchor the next round's prediction needs.
        pair = [tokens for tokens in (guess_low, guess_low + SEQ_STEP) if low < tokens < high]
        for tokens in pair[:1 if rounds == 1 else 2]:
            measure(tokens)
    # The whole flow at the answer (or, when nothing fits, at the shortest length measured), its profiles cached.
    result = plan(model_or_config, **{**arguments, "seq": low or min(measured)})
    within = f" within {result.max_overhead:.1%} added step time" if result.max_overhead is not None else ""
    tried = (f"{len(measured)} lengths measured, {guesses} predicted from them"
             if guesses else f"{len(measured)} lengths measured")
    if not low:
        result.notes.append(f"seq=max: not even {min(measured):,} tokens fit{within} with {arguments['finetune']} "
                            f"fine-tuning; below, the flow at {min(measured):,} tokens ({tried})")
        return result
    limit = f"{high:,} does not" if high <= ceiling else f"the model's limit is {ceiling:,}"
    result.notes.append(f"seq=max: {low:,} tokens per sequence is the longest that fits{within} with "
                        f"{arguments['finetune']} fine-tuning (multiples of {SEQ_STEP:,}; {limit}; {tried})")
    return result


def gather_seconds(parameter_bytes, gpus, link_gbps):
    """Seconds ZeRO-3 adds to a micro-batch: its parameters all-gathered twice (forward, then backward), each rank
    receiving (gpus - 1) / gpus of ``parameter_bytes`` a time at ``link_gbps`` GB/s (NCCL's bus bandwidth),
    counted as not hidden behind compute (an upper bound: FSDP prefetches the next layer's). ZeRO-1/2 move what
    data parallelism moves anyway (gradients reduce-scattered, parameters gathered once a step)."""
    return 2 * parameter_bytes * (gpus - 1) / gpus / (link_gbps * 1e9)


def _budget_within(solve, config, max_overhead):
    """The least activation budget at which ``config``'s micro-batch-1 placement adds at most ``max_overhead``
    (bisection: the DP's added time never rises with the budget); None when keeping everything adds more."""
    keep = solve(1, 1 << 62, config.state["host_optimizer"])
    if dataclasses.replace(config, placement=keep).overhead > max_overhead:
        return None
    lo, hi = config.placement.predicted_peak, max(keep.keep_peak, config.placement.predicted_peak)
    while hi - lo > (1 << 24):  # 16 MiB
        mid = (lo + hi) // 2
        if dataclasses.replace(config, placement=solve(1, mid, config.state["host_optimizer"])).overhead <= max_overhead:
            hi = mid
        else:
            lo = mid
    return hi


def _nearest_within(config, need, max_overhead, margin):
    """What it would take to plan ``config`` within ``max_overhead``, in words."""
    if need is None:
        return (f"Keeping every activation still adds more than {max_overhead:.1%} "
                "(the fused loss's recompute and ZeRO-3's gathers alone); raise --max-overhead.")
    return (f"Within {max_overhead:.1%} it would fit on GPUs of {format_size(config.per_gpu_state + need + margin)}, "
            "or at a shorter sequence (--seq max finds the longest).")


def _head_text(head, fused=True):
    """What the plan counts for the LM head and loss, in words."""
    if head is None:
        return ("the model's own LM head and loss, logits materialized ("
                + ("apply() does not fuse this model's loss" if fused else "memkernels' kernels not used") + ")")
    return (f"the fused linear cross-entropy (strategy \"{placement_mod.LOSS_STRATEGY}\": 8 B a token held for "
            f"backward; one chunk of {head.chunk_tokens:,} tokens' logits at a time in forward, one tile of "
            f"{head.tile_classes:,} classes for all tokens in backward; {format_size(head.forward_peak)} / "
            f"{format_size(head.backward_peak)} at its forward / backward peak per sequence, dX and dW included)")


def _over_cap(c, max_overhead):
    """Why a configuration that fits in memory was refused: its added step time, in words."""
    return (f"fits in memory only at +{c.overhead:.1%} added step time ({c.label_stage()}micro-batch "
            f"{c.micro_batch}: {c.placement.describe()}), above max_overhead={max_overhead:.1%}")


def _sharding_step(mode, found, last, gpus, forced, others=(), max_overhead=None):
    if found is None:
        if max_overhead is not None and last.budget > 0 and last.placement.fits:
            return Step(f"sharding ({_MODE_LABEL[mode]})", False, "", "", "no stage fits within "
                        f"{max_overhead:.1%} added step time")
        return Step(f"sharding ({_MODE_LABEL[mode]})", False, "", "", f"even ZeRO-3 over {gpus} GPUs leaves "
                    f"{format_size(max(last.budget, 0))} for activations, not enough")
    compared = "; ".join(f"ZeRO-{c.zero_stage}: +{c.overhead:.1%}" for c in others)
    if found.zero_stage == 0:
        return Step(f"sharding ({_MODE_LABEL[mode]})", False, "", "", "fits without sharding the model state, at the "
                    f"least added step time (+{found.overhead:.1%}" + (f"; {compared})" if compared else ")"))
    what = {1: "optimizer state", 2: "optimizer state + gradients", 3: "optimizer state + gradients + parameters"}
    costs = "reduce-scatter / all-gather traffic" + (
        f" (parameter all-gathers: {found.gather_seconds * 1e3:.0f} ms a micro-batch, counted)"
        if found.zero_stage == 3 else "")
    reason = "(asked for) fits" if forced else (
        f"adds the least step time of the stages that fit: +{found.overhead:.1%}" + (f" ({compared})" if compared
                                                                                     else ""))
    return Step(f"sharding ({_MODE_LABEL[mode]})", True, f"{what[found.zero_stage]} divided by {gpus}", costs,
                f"ZeRO-{found.zero_stage} {reason}")


# Step names say which fine-tuning mode a step was tried for: "sharding (full)" read as "full sharding".
_MODE_LABEL = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA"}


def _host_breakdown(c, gpus):
    """What ``c.host_needed`` is made of, in words."""
    parts = [f"fp32 master weights and moments {format_size(c.state['host_optimizer'])}"]
    if c.placement.offload_bytes:
        parts.append(f"offloaded activations {format_size(c.placement.offload_bytes)} per GPU x {gpus}")
    return " + ".join(parts)


def _gpu_short(c):
    """Why the GPU side does not fit ``c``, in words."""
    return (f"activations need {format_size(c.placement.predicted_peak)} with {c.placement.describe()}, "
            f"{format_size(max(c.budget, 0))} is left after model state")


def _optimizer_offload_step(mode, c, host_mem, gpus):
    need = c.state["host_optimizer"]
    gpu_fits = c.budget > 0 and c.placement.fits
    if host_mem is None:
        reason = f"needs {format_size(need)} of host memory for fp32 master weights and moments; no host_mem given"
    elif not gpu_fits:
        reason = f"the GPU does not fit even with it: {_gpu_short(c)}" if c.budget > 0 else (
            f"the GPU does not fit even with it: model state alone is {format_size(c.per_gpu_state)} per GPU")
        if c.host_needed > host_mem:
            reason += (f"; the host could not hold it either ({format_size(c.host_needed)}: {_host_breakdown(c, gpus)}"
                       f"; the node has {format_size(host_mem)})")
    elif c.host_needed > host_mem:
        reason = (f"needs {format_size(c.host_needed)} of host memory ({_host_breakdown(c, gpus)}), the node has "
                  f"{format_size(host_mem)}: the host cannot hold it")
    else:
        reason = f"fits with {format_size(need)} of optimizer state on the host"
    taken = host_mem is not None and c.host_needed <= host_mem and gpu_fits
    return Step(f"optimizer-state CPU offload ({_MODE_LABEL[mode]})", taken, format_size(need) + " of GPU memory",
                "optimizer step on the CPU, PCIe traffic of gradients and weights", reason)


def _why_not(c, host_mem, gpus):
    if c.budget > 0 and c.placement.fits and c.optimizer_offload and host_mem is None:
        # The GPU side fits, but only with the optimizer state on the host, and no host memory was given: saying
        # "activations need X, Y (> X) is left" would read as a contradiction.
        return (f"fits on the GPU only with optimizer-state CPU offload ({_gpu_short(c)}), which needs "
                f"{format_size(c.host_needed)} of host memory ({_host_breakdown(c, gpus)}); no host memory was "
                "given (host_mem=, --host-mem)")
    if c.budget > 0 and c.placement.fits and host_mem is not None and c.host_needed > host_mem:
        return (f"the GPU side fits only with optimizer-state offload, which needs {format_size(c.host_needed)} of "
                f"host memory ({_host_breakdown(c, gpus)}); the node has {format_size(host_mem)}")
    if c.budget <= 0:
        return (f"cannot fit at any micro-batch: model state alone is {format_size(c.per_gpu_state)} per GPU, "
                f"more than the {format_size(c.per_gpu_state + c.budget)} left after the margin")
    return f"cannot fit at micro-batch 1: {_gpu_short(c)}"


def _placement_step(p, act_offload):
    recomputed = sum(1 for ch in p.choices if ch.recomputed)
    offloaded = sum(1 for ch in p.choices if ch.offloaded)
    if not recomputed and not offloaded:
        return Step("selective checkpointing / activation offload", False, "", "",
                    "every layer's activations fit: nothing recomputed or offloaded")
    return Step("selective checkpointing" + (" + activation offload" if offloaded else ""), True,
                f"{format_size(p.keep_peak - p.predicted_peak)} of activation peak",
                f"{p.recompute_flops / 1e12:.2f} TFLOP recomputed, {format_size(p.offload_bytes)} offloaded",
                f"at micro-batch {p.batch}: {recomputed} layers recompute, {offloaded} offload (DP over layers, "
                "least added time)"
                + ("" if act_offload else "; activation offload not considered (no host_mem)"))


def _nearest_fit(config, gpu_mem, gpus, host_mem, margin):
    need = config.per_gpu_state + config.placement.predicted_peak + margin
    if need <= gpu_mem and host_mem is not None and config.host_needed > host_mem:
        # the GPU side is held only by moving activations or optimizer state to a host that cannot take them
        return (f"The GPUs would hold it ({format_size(need)} per GPU) with {format_size(config.host_needed)} of host "
                f"memory ({_host_breakdown(config, gpus)}); the node has {format_size(host_mem)}.")
    text = f"It would fit on GPUs of {format_size(need)}"
    if (config.state["host_optimizer"] and host_mem is not None and config.host_needed > host_mem
            and config.budget > 0 and config.placement.fits):  # the host, not the GPU, is what binds
        text += f", or with {format_size(config.host_needed)} of host memory ({_host_breakdown(config, gpus)})"
    return text + "."
