"""``memkernels.plan``: what to turn on so that a training run fits, at the least cost in speed.

The flow walks the usual decision list in order of cost and records each step in
``Plan.steps`` (taken or not, what it saves, what it costs, why):

1. mixed precision (the ``dtype`` asked for);
2. memkernels' fused kernels (save memory without recompute);
3. sharding over ``gpus`` ranks: ZeRO-1 (optimizer state), ZeRO-2 (+ gradients), ZeRO-3 / FSDP
   (+ parameters), the lowest stage that fits;
4. selective checkpointing and 5. activation offload: a per-layer placement chosen by
   :func:`memkernels.tools.placement.solve` (a DP over layers against the activation budget);
6. optimizer-state CPU offload (needs ``host_mem`` for the fp32 master weights and moments);
7. LoRA, then QLoRA, when full fine-tuning cannot fit at micro-batch 1.

Then the micro-batch is raised as far as the budget allows and accumulation =
global / (micro x gpus). The activation budget is ``gpu_mem`` minus ``margin`` (default
1 GiB for the CUDA context and library workspaces + 5% of ``gpu_mem`` for fragmentation)
minus model state (:func:`memkernels.tools.estimate.model_state_bytes`) and FSDP's gather buffers.
"""
import dataclasses
import math

from memkernels.tools.estimate import (DTYPES, FINETUNE_MODES, OPTIMIZERS, _layer_numel, _Source, lora_parameters,
                                 model_state_bytes)
from memkernels.tools import placement as placement_mod
from memkernels.tools.sizes import format_size, parse_count, parse_device_size, parse_size

__all__ = ["plan", "place", "Plan", "Step"]

CONTEXT_BYTES = 1 << 30  # CUDA context + cuBLAS / NCCL workspaces
FRAGMENTATION = 0.05


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

    @property
    def per_gpu_state(self):
        return sum(v for k, v in self.state.items() if k != "host_optimizer") + self.fsdp_buffers

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
    ``placement``: its per-layer :class:`~memkernels.tools.placement.Placement` at ``micro_batch``;
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

    @property
    def choices(self):
        return self.placement.choices

    @property
    def overhead(self):
        """Predicted added step time, as a fraction of the step's compute time."""
        return self.placement.added_seconds / self.step_seconds if self.step_seconds else 0.0

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
            out.append(f"predicted overhead: +{self.overhead:.1%} step time (recompute "
                       f"{self.placement.recompute_flops / 1e12:.2f} TFLOP, offload "
                       f"{format_size(self.placement.offload_bytes)} per micro-batch)")
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
                "integrations": self.integrations(), "notes": list(self.notes), "head": self.head}


def _bytes_arg(name, value, device=False, zero=False):
    if isinstance(value, str):
        return (parse_device_size if device else parse_size)(value, what=f"plan({name}=...)")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (value == 0 and not zero):
        kind = "a non-negative" if zero else "a positive"
        raise ValueError(f"plan({name}={value!r}): give bytes as {kind} int or a size like '80GB'")
    return value


_UNITS = {"seq": "tokens per sequence", "gpus": "GPUs", "batch": "sequences", "budget": "bytes",
          "global_batch_tokens": "tokens", "lora_rank": "", "max_micro_batch": "sequences"}


def _positive(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        unit = _UNITS.get(name)
        raise ValueError(f"plan({name}={value!r}): must be a positive int" + (f" ({unit})" if unit else ""))
    return value


def place(model, *, batch, seq, budget, offload=False, kernels=False, tflops=400.0, pcie_gbps=25.0):
    """The cheapest per-layer :class:`~memkernels.tools.placement.Placement` of ``model`` whose
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
    profile = placement_mod.measure_profile(_Source(model), seq, parameter.dtype, offload=offload, kernels=kernels,
                                            backend=backend)
    return placement_mod.solve(profile, batch, budget, offload=offload, tflops=tflops, pcie_gbps=pcie_gbps)


def _micro_candidates(per_rank, max_micro):
    if per_rank is None:
        return [2 ** k for k in range(int(math.log2(max_micro)) + 1)]
    return [d for d in range(1, min(per_rank, max_micro) + 1) if per_rank % d == 0]


def plan(model_or_config, *, gpu_mem, seq, global_batch_tokens=None, gpus=1, host_mem=None, dtype="bf16",
         optimizer="adamw", finetune="full", lora_rank=16, pcie_gbps=25.0, tflops=400.0, margin=None,
         kernels=True, max_micro_batch=1024, zero_stage=None):
    """Plan a training run so that it fits ``gpu_mem`` per GPU: a :class:`Plan` (``.table()``, ``.to_dict()``).

    ``model_or_config``: a built-in name, a config (object, dict, config.json) or a model.
    ``gpu_mem`` / ``host_mem``: bytes or sizes like ``"80GB"`` (JEDEC: 80·2³⁰); ``host_mem`` is the
    host memory of all ``gpus`` together. ``seq``: tokens per sequence. ``global_batch_tokens``:
    tokens per optimizer step (not a multiple of seq x gpus: the nearest that is, said in ``notes``). ``finetune``: ``full``, ``lora`` or
    ``qlora`` (the first mode tried; the flow falls back to LoRA, then QLoRA). ``pcie_gbps``: host
    link GB/s, ``tflops``: sustained TFLOP/s per GPU (cost model). ``margin``: bytes kept free (0 allowed).
    ``kernels``: consider memkernels' fused kernels (measured; skipped when unavailable).
    ``zero_stage``: force a ZeRO stage (default: the lowest that fits at micro-batch 1).
    """
    gpu_mem = _bytes_arg("gpu_mem", gpu_mem, device=True)
    _positive("seq", seq)
    _positive("gpus", gpus)
    _positive("lora_rank", lora_rank)
    _positive("max_micro_batch", max_micro_batch)
    host_mem = None if host_mem is None else _bytes_arg("host_mem", host_mem)
    if finetune not in FINETUNE_MODES:
        raise ValueError(f"plan(finetune={finetune!r}): unknown fine-tuning mode; use one of "
                         f"{', '.join(FINETUNE_MODES)}")
    if dtype not in DTYPES:
        raise ValueError(f"plan(dtype={dtype!r}): use one of {', '.join(DTYPES)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"plan(optimizer={optimizer!r}): use one of {', '.join(OPTIMIZERS)}")
    for name, value in (("pcie_gbps", pcie_gbps), ("tflops", tflops)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"plan({name}={value!r}): must be a positive number")
    if zero_stage is not None and (zero_stage not in (0, 1, 2, 3) or (zero_stage and gpus == 1)):
        raise ValueError(f"plan(zero_stage={zero_stage!r}): use 0, 1, 2 or 3 (1-3 need gpus > 1), or None")
    margin = (CONTEXT_BYTES + int(FRAGMENTATION * gpu_mem) if margin is None
              else _bytes_arg("margin", margin, zero=True))
    per_rank, notes = None, []
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

    source = _Source(model_or_config)
    if source.config is not None and source.config.position == "learned" and seq > source.config.max_seq_len:
        raise ValueError(f"plan(seq={seq}): {source.name} has learned positions up to "
                         f"{source.config.max_seq_len} tokens")
    compute_dtype = DTYPES[dtype][3]
    full = source.build()
    num_parameters = sum(p.numel() for p in full.parameters())
    layer_numel = _layer_numel(full)
    adapters, adapted = lora_parameters(full, lora_rank)
    weight_bytes, grad_bytes = DTYPES[dtype][:2]
    del full

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
    profile = placement_mod.measure_profile(source, seq, compute_dtype, offload=act_offload)
    use_kernels = False
    if kernels:
        try:
            fused = placement_mod.measure_profile(source, seq, compute_dtype, kernels=True, offload=act_offload)
        except (ImportError, RuntimeError) as error:
            steps.append(Step("memkernels kernels", False, "", "", f"unavailable here ({error})"[:200]))
        else:
            plain_peak = placement_mod.solve(profile, 1, 1 << 62).keep_peak
            fused_peak = placement_mod.solve(fused, 1, 1 << 62).keep_peak
            if fused_peak < plain_peak:
                use_kernels, profile = True, fused
                mlp = getattr(source.config, "mlp", None)
                mlps = {"swiglu": "SwiGLU MLPs", "geglu": "GeGLU MLPs"}.get(mlp, "GELU MLPs" if mlp else "MLPs")
                costs = (f"{fused.head_recompute / 1e12:.2f} TFLOP a sequence (the loss recomputes its logits in "
                         "backward)" if fused.head is not None else "no recompute")
                steps.append(Step("memkernels kernels", True, f"{format_size(plain_peak - fused_peak)} of activation "
                                  "peak at micro-batch 1", costs, f"fused norms and {mlps}; " + _head_text(fused.head)))
            else:
                steps.append(Step("memkernels kernels", False, "", "", "they save nothing measurable on this model"))
    else:
        steps.append(Step("memkernels kernels", False, "", "", "kernels=False"))

    def candidate(mode, stage, opt_offload, act_offload):
        trainable = None if mode == "full" else adapters
        params = num_parameters + (0 if mode == "full" else adapters)
        state = model_state_bytes(params, dtype=dtype, optimizer=optimizer, zero_stage=stage, ranks=gpus,
                                  trainable=trainable, quantized=adapted if mode == "qlora" else 0,
                                  optimizer_offload=opt_offload,
                                  grad_accumulation=per_rank is not None and per_rank > 1)
        fsdp = layer_numel * (2 * weight_bytes + (grad_bytes if mode == "full" else 0)) \
            if gpus > 1 and stage == 3 else 0
        per_gpu = sum(v for k, v in state.items() if k != "host_optimizer") + fsdp
        budget = gpu_mem - margin - per_gpu
        found = placement_mod.solve(profile, 1, max(budget, 1), offload=act_offload, tflops=tflops,
                                    pcie_gbps=pcie_gbps)
        host = state["host_optimizer"] + found.offload_bytes * gpus
        return Candidate(mode, stage, opt_offload, state, fsdp, budget, found, host)

    def fits(c):
        return c.budget > 0 and c.placement.fits and (host_mem is None or c.host_needed <= host_mem)

    stages = (zero_stage,) if zero_stage is not None else (0, 1, 2, 3) if gpus > 1 else (0,)
    modes = FINETUNE_MODES[FINETUNE_MODES.index(finetune):]
    chosen, nearest_fail, alternatives = None, None, []
    for mode in modes:
        found = None
        for stage in stages:
            c = candidate(mode, stage, False, act_offload)
            if fits(c):
                found = c
                break
            if nearest_fail is None or c.budget - c.placement.predicted_peak > \
                    nearest_fail.budget - nearest_fail.placement.predicted_peak:
                nearest_fail = c
        if gpus > 1:
            steps.append(_sharding_step(mode, found, c, gpus, forced=zero_stage is not None))
        if found is None:
            # Optimizer-state CPU offload, at the highest stage tried.
            c = candidate(mode, stages[-1], True, act_offload)
            steps.append(_optimizer_offload_step(mode, c, host_mem, gpus))
            if host_mem is not None and c.host_needed <= host_mem and fits(c):
                found = c
            elif c.budget - c.placement.predicted_peak > nearest_fail.budget - nearest_fail.placement.predicted_peak:
                nearest_fail = c
        if found is not None:
            chosen = found
            break
        steps.append(Step(f"{mode} fine-tuning", False, "", "", _why_not(c, host_mem, gpus)))
    if chosen is not None:
        if chosen.finetune != finetune:
            steps.append(Step(f"{chosen.finetune}", True, "", "",
                              f"{finetune} fine-tuning cannot fit at micro-batch 1; {chosen.finetune} fits"))
    # LoRA / QLoRA shown with their own figures whatever was chosen.
    for mode in ("lora", "qlora"):
        if chosen is not None and chosen.finetune == mode:
            continue
        alt = None
        for stage in stages:
            alt = candidate(mode, stage, False, act_offload)
            if fits(alt):
                break
        per_gpu = alt.per_gpu_state + alt.placement.predicted_peak + margin
        alternatives.append({"finetune": mode, "zero_stage": alt.zero_stage, "fits": fits(alt), "per_gpu": per_gpu,
                             "model_state": alt.per_gpu_state, "activations": alt.placement.predicted_peak,
                             "placement": alt.placement.describe(),
                             "recomputed_layers": sum(1 for ch in alt.placement.choices if ch.recomputed)})
        alternatives[-1]["text"] = (f"alternative {alt.label(gpus)}: {format_size(per_gpu)} per GPU at micro-batch 1 "
                            f"({'fits' if fits(alt) else 'does not fit'}; model state {format_size(alt.per_gpu_state)}"
                            f", activations {format_size(alt.placement.predicted_peak)} with "
                            f"{alt.placement.describe()})")

    config = chosen if chosen is not None else nearest_fail
    micro, accumulation = 1, (per_rank or 1)
    best = config.placement
    if chosen is not None:
        candidates = _micro_candidates(per_rank, max_micro_batch)
        lo, hi = 0, len(candidates) - 1
        while lo < hi:  # largest fitting micro-batch: fitting is monotone in it
            mid = (lo + hi + 1) // 2
            trial = placement_mod.solve(profile, candidates[mid], config.budget, offload=act_offload, tflops=tflops,
                                        pcie_gbps=pcie_gbps)
            if trial.fits and (host_mem is None or config.state["host_optimizer"] + trial.offload_bytes * gpus
                               <= host_mem):
                lo = mid
            else:
                hi = mid - 1
        micro = candidates[lo]
        best = placement_mod.solve(profile, micro, config.budget, offload=act_offload, tflops=tflops,
                                   pcie_gbps=pcie_gbps)
        accumulation = per_rank // micro if per_rank else 1
        steps.append(_placement_step(best, act_offload))
        steps.append(Step("micro-batch", True, "", "", f"largest that fits: {micro}"
                          + (f"; accumulation {accumulation} to reach the global batch" if per_rank else "")))
    step_flops = micro * profile.step_flops
    missing = 0 if chosen is not None else max(0, config.placement.predicted_peak - config.budget)
    nearest = "" if chosen is not None else _nearest_fit(config, gpu_mem, gpus, host_mem, margin)
    return Plan(model=source.name, gpu_mem=gpu_mem, gpus=gpus, seq=seq, dtype=dtype, optimizer=optimizer,
                margin=margin, host_mem=host_mem, kernels=use_kernels, steps=steps, config=config, placement=best,
                micro_batch=micro, accumulation=accumulation,
                global_batch_tokens=(per_rank * seq * gpus) if per_rank else None,
                step_seconds=step_flops / (tflops * 1e12), alternatives=alternatives, fits=chosen is not None,
                missing=missing, nearest=nearest, lora_rank=lora_rank, notes=notes,
                head=_head_text(profile.head if use_kernels else None, fused=use_kernels))


def _head_text(head, fused=True):
    """What the plan counts for the LM head and loss, in words."""
    if head is None:
        return ("the model's own LM head and loss, logits materialized ("
                + ("apply() does not fuse this model's loss" if fused else "memkernels' kernels not used") + ")")
    return (f"the fused linear cross-entropy (strategy \"{placement_mod.LOSS_STRATEGY}\": 8 B a token held for "
            f"backward; one chunk of {head.chunk_tokens:,} tokens' logits at a time in forward, one tile of "
            f"{head.tile_classes:,} classes for all tokens in backward; {format_size(head.forward_peak)} / "
            f"{format_size(head.backward_peak)} at its forward / backward peak per sequence, dX and dW included)")


def _sharding_step(mode, found, last, gpus, forced):
    if found is None:
        return Step(f"sharding ({_MODE_LABEL[mode]})", False, "", "", f"even ZeRO-3 over {gpus} GPUs leaves "
                    f"{format_size(max(last.budget, 0))} for activations, not enough")
    if found.zero_stage == 0:
        return Step(f"sharding ({_MODE_LABEL[mode]})", False, "", "", "fits without sharding the model state")
    what = {1: "optimizer state", 2: "optimizer state + gradients", 3: "optimizer state + gradients + parameters"}
    return Step(f"sharding ({_MODE_LABEL[mode]})", True, f"{what[found.zero_stage]} divided by {gpus}",
                "reduce-scatter / all-gather traffic",
                f"ZeRO-{found.zero_stage} " + ("(asked for) fits" if forced else "is the lowest stage that fits"))


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
    text = f"It would fit on GPUs of {format_size(need)}"
    if (config.state["host_optimizer"] and host_mem is not None and config.host_needed > host_mem
            and config.budget > 0 and config.placement.fits):  # the host, not the GPU, is what binds
        text += f", or with {format_size(config.host_needed)} of host memory ({_host_breakdown(config, gpus)})"
    return text + "."
