"""Memory per GPU of a training run, before you launch it.

``estimate(model_or_config, batch=..., seq=...)`` breaks the memory of one GPU
into parameters, gradients, fp32 master weights, optimizer state, activations
saved for backward, and the logits/loss, plus FSDP's gather buffers and what
offload moves to the host.

Model state is arithmetic on the exact parameter count of the model (built on
the ``meta`` device): under bf16/fp16 mixed precision with AdamW a parameter
costs 2 (low-precision weight) + 2 (gradient) + 4 (fp32 master weight) + 8
(Adam's two fp32 moments) = 16 bytes; in fp32, 4 + 4 + 8 = 16 bytes too.
``shard_degree`` > 1 is FSDP / ZeRO-3: weights, gradients, master weights and
optimizer state are all divided among the ranks, and each rank holds, on
top, the gathered weights of one layer plus the next one prefetched, and one
layer's unsharded gradient before its reduce-scatter.

Activations are *measured*, not derived from a formula: the model is run
forward on the ``meta`` device (no memory, no compute) under
:class:`~memkernels.meters.SavedBytesMeter`, with 1 and with 2 layers.
Blocks are identical, so the 2-layer minus 1-layer difference is exactly what
each extra layer saves, and an L-layer model saves
``one_layer + (L - 1) * per_layer``. This is as exact as a full L-layer meta
forward (tests check it against a real CPU forward) but costs two tiny
forwards, so a 80-layer model at sequence 32k estimates in well under a second.
``batch`` is the per-GPU micro-batch; activations are not sharded.

The step's peak comes in backward, above what forward saved: gradients of
intermediates, a recomputed layer, the loss's backward (eager's float32
logits gradient). ``backward_transient`` is that difference, from the model
``memkernels plan`` uses (:mod:`memkernels.planning.placement`: a few layers'
forward and backward on meta under a peak meter), so ``activations +
logits_loss + backward_transient`` is the figure plan prints as "activations
(peak)" for the same configuration, and :func:`default_margin` is what both
keep free on the GPU.

- ``checkpointing``: per-layer activation checkpointing. Each layer keeps only
  its input; backward recomputes one layer at a time, in the transient as a
  plan's "recompute layer" runs it (``memkernels.apply(model, plan)``).
- ``offload``: every layer's saved tensors go to pinned host memory and come
  back for backward (memkernels' offload engine, as plan models it);
  ``host_offload`` is what goes to the host.
- ``use_memkernels``: the model is patched with :func:`memkernels.apply`
  (fused norms, gated/GELU MLP, RoPE, linear cross-entropy) before it is
  measured; the fused loss with plan's strategy ``"recompute"`` (8 bytes a
  token held; ``"auto"`` takes ``"chunked"``, which holds the float32 dW
  from forward to backward, only when that memory is free).

Measured on the eager PyTorch graph as it runs on CPU/meta: attention as a
flash kernel (q, k, v, output, log-sum-exp), ``nn.RMSNorm`` as PyTorch's
composite (the same thing Hugging Face's RMSNorm does in Python), and the loss
in fp32 after upcasting the logits, as Hugging Face does.
"""
import copy
import dataclasses
import math

import torch
from torch import nn

from memkernels.models import (TRANSLATED_MODEL_TYPES, TransformerLM, hf_config_dict, load_config, translate_hf_config)
from memkernels.planning import placement
from memkernels.runtime.ledger import ledger_forward
from memkernels.runtime.sizes import format_size, text_table

__all__ = ["estimate", "MemoryEstimate", "DTYPES", "OPTIMIZERS", "FINETUNE_MODES", "model_state_bytes",
           "lora_parameters", "QLORA_BYTES_PER_PARAM", "default_margin", "MARGIN_TEXT"]

# dtype -> (bytes per weight, bytes per gradient, bytes per fp32 master weight, torch dtype of compute)
DTYPES = {"fp32": (4, 4, 0, torch.float32), "bf16": (2, 2, 4, torch.bfloat16), "fp16": (2, 2, 4, torch.float16)}
# optimizer -> fp32 bytes of state per parameter
OPTIMIZERS = {"adamw": 8, "adam": 8, "sgd": 4, "lion": 4}

_PARTS = ("parameters", "gradients", "master_weights", "optimizer_state", "activations", "logits_loss",
          "backward_transient", "fsdp_buffers", "grad_accum_buffer")
_LABELS = {"parameters": "parameters", "gradients": "gradients", "master_weights": "fp32 master weights",
           "optimizer_state": "optimizer state", "activations": "activations", "logits_loss": "logits / loss",
           "backward_transient": "backward transient", "fsdp_buffers": "FSDP gather buffers",
           "grad_accum_buffer": "fp32 grad accumulation"}
# The same parts as narrow table columns (estimate_table).
_COLUMNS = {"parameters": "params", "gradients": "grads", "master_weights": "master", "optimizer_state": "optimizer",
            "activations": "activations", "logits_loss": "logits", "backward_transient": "bwd transient",
            "fsdp_buffers": "FSDP",
            "grad_accum_buffer": "grad accum"}
FINETUNE_MODES = ("full", "lora", "qlora")
# QLoRA's NF4 base weights: 4 bits per weight, plus the double-quantized absmax constants
# (one 8-bit constant per 64-weight block, one fp32 constant per 256 of those).
QLORA_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# What a run needs besides its tensors, kept free by `estimate`'s verdict and `plan`'s budget alike.
CONTEXT_BYTES = 1 << 30  # CUDA context + cuBLAS / NCCL workspaces
FRAGMENTATION = 0.05  # of the GPU's memory: the caching allocator's blocks no tensor fits
MARGIN_TEXT = "1 GiB for the CUDA context and library workspaces + 5% of the GPU's memory for fragmentation"


def default_margin(gpu_mem):
    """Bytes to keep free on a GPU of ``gpu_mem`` bytes: :data:`MARGIN_TEXT`."""
    return CONTEXT_BYTES + int(FRAGMENTATION * gpu_mem)


@dataclasses.dataclass
class MemoryEstimate:
    """Per-GPU memory of one training configuration. All sizes in bytes (ints)."""

    model: str
    num_parameters: int
    batch: int
    seq: int
    dtype: str
    optimizer: str
    shard_degree: int
    checkpointing: bool
    offload: bool
    use_memkernels: bool
    parameters: int
    gradients: int
    master_weights: int
    optimizer_state: int
    activations: int
    logits_loss: int
    fsdp_buffers: int
    backward_transient: int  # the step's activation peak (in backward) above activations + logits_loss
    host_offload: int
    notes: list
    zero_stage: int = 0
    finetune: str = "full"
    trainable_parameters: int = None
    grad_accum_buffer: int = 0
    host_optimizer: int = 0  # optimizer-state CPU offload: fp32 master weights + moments of every rank, on the host

    @property
    def model_state(self):
        return self.parameters + self.gradients + self.master_weights + self.optimizer_state

    @property
    def total(self):
        """Bytes one GPU needs (host offload excluded)."""
        return sum(getattr(self, part) for part in _PARTS)

    def breakdown(self):
        """{readable part name: bytes} in a fixed order (GPU parts only)."""
        return {_LABELS[part]: getattr(self, part) for part in _PARTS}

    def to_dict(self):
        data = dataclasses.asdict(self)
        data.update(total=self.total, model_state=self.model_state, activation_peak=self.activation_peak)
        return data

    def describe(self):
        flags = [f"{self.dtype}{' mixed' if self.dtype != 'fp32' else ''}", self.optimizer]
        flags += [f"ZeRO-{self.zero_stage} x {self.shard_degree}"] if self.shard_degree > 1 else []
        flags += [self.finetune] if self.finetune != "full" else []
        flags += [name for name, on in (("checkpointing", self.checkpointing), ("offload", self.offload),
                                        ("memkernels", self.use_memkernels)) if on]
        return ", ".join(flags)

    @property
    def activation_peak(self):
        """The step's activation peak (in backward): what ``memkernels plan`` calls "activations (peak)"."""
        return self.activations + self.logits_loss + self.backward_transient

    def table(self):
        rows = [(name, format_size(nbytes)) for name, nbytes in self.breakdown().items()]
        rows.append(("total per GPU", format_size(self.total)))
        if self.host_offload:
            rows.append(("host (offloaded)", format_size(self.host_offload)))
        if self.host_optimizer:
            rows.append(("host (optimizer state, all ranks)", format_size(self.host_optimizer)))
        head = (f"{self.model}: {self.num_parameters / 1e9:.2f}B parameters, batch {self.batch} x seq {self.seq}, "
                f"{self.describe()}")
        peak = (f"activation peak of the step: {format_size(self.activation_peak)} = activations + logits / loss + "
                "backward transient (plan's \"activations (peak)\")")
        return "\n".join([head, text_table(("per GPU", "bytes"), rows), peak] + [f"  note: {n}" for n in self.notes])

    __str__ = table


def _positive_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"estimate({name}={value!r}): must be a positive int")
    return value


def _hf_layers_attr(config):
    for attr in ("num_hidden_layers", "n_layer"):
        if hasattr(config, attr):
            return attr
    raise ValueError(f"estimate: cannot find the layer count of {type(config).__name__} "
                     "(no num_hidden_layers / n_layer)")


class ModelSource:
    """How to build the model with a given number of layers, on meta."""

    def __init__(self, model_or_config):
        self.hf_config = None
        if isinstance(model_or_config, TransformerLM):
            self.config = model_or_config.config
        elif isinstance(model_or_config, nn.Module):
            hf_config = getattr(model_or_config, "config", None)
            if hf_config is None or not hasattr(hf_config, "model_type"):
                raise ValueError(
                    f"estimate(model_or_config=...): cannot rebuild a {type(model_or_config).__name__} on the meta "
                    "device; pass a memkernels TransformerLM, a Hugging Face model, a built-in name or a config. "
                    "For any other module, measure it with memkernels.activation_ledger on meta inputs.")
            self.hf_class, self.hf_config = type(model_or_config), model_or_config.config
            self.layers_attr = _hf_layers_attr(self.hf_config)
            self.config = None
        else:
            hf = hf_config_dict(model_or_config)  # (dict, name, path read), read once
            if hf is None:
                self.config = load_config(model_or_config)
            elif hf[0].get("model_type") in TRANSLATED_MODEL_TYPES:
                self.config = translate_hf_config(*hf)
            else:
                self._from_transformers(*hf)

    def _from_transformers(self, data, name, read_from):
        """A family memkernels does not translate (mixture-of-experts ones among them): transformers builds it."""
        where = f" (read from {read_from!r})" if read_from else ""
        try:
            import transformers
        except ImportError:
            raise ImportError(f"model {name!r}{where}: model_type {data.get('model_type')!r} is built by transformers, "
                              "which is not installed: pip install transformers") from None
        model_type = data.pop("model_type", None)  # data is hf_config_dict's own copy
        try:
            hf_config = transformers.AutoConfig.for_model(model_type, **data)
        except ValueError as error:
            raise ValueError(f"model config: model_type={model_type!r}{where} is neither one memkernels translates "
                             f"({', '.join(TRANSLATED_MODEL_TYPES)}) nor one transformers {transformers.__version__} "
                             f"knows ({error})") from None
        with torch.device("meta"):
            try:
                model = transformers.AutoModelForCausalLM.from_config(hf_config)
            except ValueError as error:
                raise ValueError(f"model config: model_type={model_type!r}{where} has no causal-LM class in "
                                 f"transformers ({error})") from None
        hf_config._name_or_path = hf_config._name_or_path or name
        self.hf_class, self.hf_config = type(model), model.config
        self.layers_attr = _hf_layers_attr(self.hf_config)
        self.config = None

    @property
    def name(self):
        if self.config is not None:
            return self.config.name
        return getattr(self.hf_config, "_name_or_path", "") or self.hf_class.__name__

    @property
    def num_layers(self):
        return self.config.num_layers if self.config is not None else getattr(self.hf_config, self.layers_attr)

    def build(self, num_layers=None):
        """The model on meta (``num_layers``: override the depth)."""
        with torch.device("meta"):
            if self.config is not None:
                config = self.config if num_layers is None else self.config.replace(num_layers=num_layers)
                return TransformerLM(config)
            config = copy.deepcopy(self.hf_config)
            if num_layers is not None:
                setattr(config, self.layers_attr, num_layers)
            config._attn_implementation = "sdpa"  # measured as the flash kernel a GPU runs (profile.meta_forward)
            try:
                return self.hf_class(config)
            except ValueError as error:  # e.g. GPT-OSS (attention sinks): transformers has no SDPA path for it
                raise ValueError(f"model {self.name!r}: its attention cannot run through PyTorch's SDPA, which the "
                                 f"meta measurement needs to count what a flash kernel saves ({error})") from None

    def key(self):
        return self.config if self.config is not None else (self.hf_class, self.hf_config.to_json_string())


# estimate's (checkpointing, offload) as the per-layer option of plan's placement model
_LAYER_OPTION = {(False, False): "keep", (True, False): "recompute layer", (False, True): "offload layer",
                 (True, True): "offload checkpoint"}

_measured = {}  # (model key, layers, batch, seq, dtype, checkpointing, memkernels) -> result


def _cached_measure(source, *args):
    key = (source.key(),) + args
    if key not in _measured:
        _measured[key] = _measure_saved(source, *args)
    return _measured[key]


def _measure_saved(source, num_layers, batch, seq, dtype, checkpointing, use_memkernels):
    """(new saved bytes, logits/loss part) of one meta forward with labels."""
    model = source.build(num_layers).to(DTYPES[dtype][3])
    if checkpointing:
        _enable_checkpointing(model)
    if use_memkernels:
        from memkernels.fusions.apply import apply
        apply(model, measure=False)
        # The fused loss with plan's strategy ("recompute": 8 B a token held for backward), the one its
        # "auto" takes when memory is short, and the one the step's peak (placement) is measured with.
        placement.install_loss_strategy(model)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    if source.config is not None:
        ledger, _ = ledger_forward(model, ids, ids)
    else:
        ledger, _ = ledger_forward(model, input_ids=ids, labels=ids, use_cache=False)
    return ledger.new_bytes, ledger.by_category()["logits/loss"]


def _enable_checkpointing(model):
    if isinstance(model, TransformerLM):
        model.checkpointing = True
    else:
        # transformers 5.x's name; gradient_checkpointing_enable (older versions) warns there that it will go.
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": True})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.train()


def layer_numel(model):
    blocks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not blocks:
        return 0
    layers = max(blocks, key=lambda m: sum(p.numel() for p in m.parameters()))
    return max(sum(p.numel() for p in layer.parameters()) for layer in layers)


def lora_parameters(model, rank):
    """``(adapter parameters, adapted base parameters)`` of LoRA with ``rank`` on ``model``.

    Adapters sit on every 2-D weight of the decoder layers' attention and MLP projections
    (``nn.Linear``, and GPT-2's ``Conv1D``): a (out x in) weight gets A (rank x in) and
    B (out x rank), ``rank * (in + out)`` parameters. Embeddings, norms and the LM head are not
    adapted (PEFT's ``target_modules="all-linear"`` minus the head).
    """
    from memkernels.planning.apply_plan import find_layers, submodule_name

    adapters = adapted = 0
    for layer in find_layers(model)[1]:
        for part in ("attn", "mlp"):
            name = submodule_name(layer, part)
            if name is None:
                continue
            for module in layer.get_submodule(name).modules():
                weight = getattr(module, "weight", None)
                if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                    adapters += rank * sum(weight.shape)
                    adapted += weight.numel()
    return adapters, adapted


def model_state_bytes(num_parameters, *, dtype="bf16", optimizer="adamw", zero_stage=0, ranks=1,
                      trainable=None, quantized=0, optimizer_offload=False, grad_accumulation=False):
    """Model state of one GPU, in bytes: a dict of ``parameters``, ``gradients``, ``master_weights``,
    ``optimizer_state``, ``grad_accum_buffer`` (per GPU) and ``host_optimizer`` (all ranks, on the host).

    With P = ``num_parameters``, T = ``trainable`` (default P; LoRA: the adapters), Q = ``quantized``
    (QLoRA: frozen weights stored in NF4), N = ``ranks``, and w / g / m / o the bytes per weight,
    gradient, fp32 master weight and optimizer state (:data:`DTYPES`, :data:`OPTIMIZERS`):

    - parameters = (P - Q) * w + Q * 0.516 (NF4 + double-quantized constants); divided by N under ZeRO-3
    - gradients = T * g; divided by N under ZeRO-2 and ZeRO-3
    - master weights = T * m, optimizer state = T * o; divided by N under ZeRO-1, 2 and 3;
      0 on the GPU with ``optimizer_offload`` (then host_optimizer = T * (m + o), all ranks together)
    - grad_accum_buffer: with ``grad_accumulation=True`` (several micro-batches per optimizer step,
      as PyTorch does it), 0: autograd adds each micro-batch's gradient into ``param.grad`` in
      place, in the gradient's dtype, so the T * g of ``gradients`` is all there is (measured in
      tests/test_plan.py). With ``grad_accumulation="fp32"``, T * 4 when g < 4: an fp32 buffer the
      low-precision gradients are summed into besides them (DeepSpeed's bf16 optimizer,
      Megatron's ``main_grad``); sharded like gradients.

    Full fine-tuning under mixed precision with AdamW: 2 + 2 + 4 + 8 = 16 bytes per parameter;
    fp32 with AdamW: 4 + 4 + 8 = 16 as well (112 GB for 7B parameters: 28 + 28 + 56).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"model_state_bytes(zero_stage={zero_stage!r}): use 0, 1, 2 or 3")
    weight_bytes, grad_bytes, master_bytes, _ = DTYPES[dtype]
    trainable = num_parameters if trainable is None else trainable

    def shard(nbytes, from_stage):
        return math.ceil(nbytes / ranks) if zero_stage >= from_stage else int(nbytes)

    optimizer_bytes = trainable * (master_bytes + OPTIMIZERS[optimizer])
    if grad_accumulation not in (False, True, "fp32"):
        raise ValueError(f"model_state_bytes(grad_accumulation={grad_accumulation!r}): use False, True (PyTorch: "
                         "in place into param.grad) or 'fp32' (a separate fp32 accumulation buffer)")
    accum = trainable * 4 if grad_accumulation == "fp32" and grad_bytes < 4 else 0
    state = {
        "parameters": shard((num_parameters - quantized) * weight_bytes + math.ceil(quantized * QLORA_BYTES_PER_PARAM),
                            3),
        "gradients": shard(trainable * grad_bytes, 2),
        "master_weights": 0 if optimizer_offload else shard(trainable * master_bytes, 1),
        "optimizer_state": 0 if optimizer_offload else shard(trainable * OPTIMIZERS[optimizer], 1),
        "grad_accum_buffer": shard(accum, 2),
        "host_optimizer": optimizer_bytes if optimizer_offload else 0,
    }
    return state


def estimate(model_or_config, *, batch, seq, dtype="bf16", optimizer="adamw", shard_degree=1,
             checkpointing=False, offload=False, use_memkernels=False, zero_stage=None, finetune="full",
             lora_rank=16, optimizer_offload=False, grad_accumulation=False):
    """Per-GPU memory of a training step: a :class:`MemoryEstimate` (``.table()``, ``.to_dict()``).

    ``model_or_config``: a built-in name (``gpt2``, ``gpt2-medium``,
    ``llama-2-7b``, ``llama-3-8b``, ``qwen2-72b``), a :class:`ModelConfig`, a
    Hugging Face config (object, dict or config.json path), a memkernels
    :class:`TransformerLM` or a Hugging Face causal LM (rebuilt on meta from
    its config; its weights are not touched). ``batch``: per-GPU micro-batch;
    ``seq``: tokens per sequence. ``dtype``: ``fp32``, or ``bf16`` / ``fp16``
    mixed precision (low-precision weights and gradients, fp32 master weights).
    ``optimizer``: ``adamw``/``adam`` (8 bytes of fp32 state per parameter),
    ``sgd`` (momentum) or ``lion`` (4). ``shard_degree``: data-parallel ranks the
    model state is sharded over; ``zero_stage``: 1 (optimizer state), 2 (+ gradients)
    or 3 (+ parameters, FSDP); default 3 when ``shard_degree`` > 1.
    ``finetune``: ``full``, ``lora`` (frozen base in ``dtype``, rank-``lora_rank``
    adapters on the attention/MLP projections are the only trainable parameters) or
    ``qlora`` (the same with the adapted base weights in NF4, bf16 compute).
    ``optimizer_offload``: fp32 master weights and optimizer state live in host memory.
    ``grad_accumulation``: several micro-batches per optimizer step: ``True`` as PyTorch
    does it (in place into ``param.grad``: no extra buffer), ``"fp32"`` with a separate fp32
    accumulation buffer (DeepSpeed's bf16 optimizer, Megatron). Formulas: :func:`model_state_bytes`.
    """
    _positive_int("batch", batch)
    _positive_int("seq", seq)
    _positive_int("shard_degree", shard_degree)
    if dtype not in DTYPES:
        raise ValueError(f"estimate(dtype={dtype!r}): use one of {', '.join(DTYPES)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"estimate(optimizer={optimizer!r}): use one of {', '.join(OPTIMIZERS)}")
    if finetune not in FINETUNE_MODES:
        raise ValueError(f"estimate(finetune={finetune!r}): use one of {', '.join(FINETUNE_MODES)}")
    if zero_stage is None:
        zero_stage = 3 if shard_degree > 1 else 0
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"estimate(zero_stage={zero_stage!r}): use 0, 1, 2 or 3 (or None)")
    if finetune != "full":
        _positive_int("lora_rank", lora_rank)
    source = ModelSource(model_or_config)
    if source.config is not None and source.config.position == "learned" and seq > source.config.max_seq_len:
        raise ValueError(f"estimate(seq={seq}): {source.name} has learned positions up to "
                         f"{source.config.max_seq_len} tokens")
    full = source.build()
    num_parameters = sum(p.numel() for p in full.parameters())
    numel_per_layer = layer_numel(full)
    num_layers = source.num_layers
    weight_bytes, grad_bytes, master_bytes, _ = DTYPES[dtype]

    def measure(layers, ckpt):
        return _cached_measure(source, layers, batch, seq, dtype, ckpt, use_memkernels)

    one, one_loss = measure(1, checkpointing)
    two, _ = measure(2, checkpointing)
    per_layer = two - one
    activations = one + (num_layers - 1) * per_layer - one_loss
    notes = [f"activations measured on meta: 1 layer saves {format_size(one - one_loss)} besides the loss, "
             f"each further layer {format_size(per_layer)}, x {num_layers - 1}"]
    if checkpointing:
        notes.append("checkpointing keeps each layer's input; backward recomputes one layer at a time")
    # The step's peak: plan's model (memkernels.planning.placement), measured on a meta copy of a few layers
    # running forward and backward, the same figure `memkernels plan` counts for this configuration.
    option = placement.OPTION_BY_NAME[_LAYER_OPTION[checkpointing, offload]]
    profile = placement.measure_profile(source, seq, DTYPES[dtype][3], kernels=use_memkernels, offload=offload)
    peak = placement.predict_peak(profile, batch, [option] * num_layers)
    host = 0
    if offload:
        _, _, savings, _, moved, _ = profile.figures(batch)
        base = _LAYER_OPTION[checkpointing, False]
        activations -= num_layers * (savings[option.name] - savings[base])
        host = num_layers * moved[option.name]
        notes.append(f"offload ({option.name!r} in every layer, as plan models it): "
                     f"{format_size(host)} of saved tensors go to the host and come back for backward")
    backward_transient = peak - activations - one_loss
    notes.append("backward transient: gradients of intermediates, a recomputed layer, the loss's backward: the "
                 "step's peak above what forward saved (a few layers' step measured on meta, as plan does)")

    trainable, quantized = None, 0
    if finetune != "full":
        trainable, adapted = lora_parameters(full, lora_rank)
        quantized = adapted if finetune == "qlora" else 0
        num_parameters += trainable
        notes.append(f"{finetune}: {trainable / 1e6:.1f}M trainable adapter parameters (rank {lora_rank}); the "
                     f"frozen base has no gradients or optimizer state"
                     + (f"; {adapted / 1e9:.2f}B adapted weights in NF4" if quantized else "")
                     + "; activations measured without the adapters' rank-sized intermediates")
    state = model_state_bytes(num_parameters, dtype=dtype, optimizer=optimizer, zero_stage=zero_stage,
                              ranks=shard_degree, trainable=trainable, quantized=quantized,
                              optimizer_offload=optimizer_offload, grad_accumulation=grad_accumulation)
    fsdp = 0
    if shard_degree > 1 and zero_stage == 3:
        layer_grads = numel_per_layer if finetune == "full" else 0
        fsdp = numel_per_layer * 2 * weight_bytes + layer_grads * grad_bytes
        notes.append("FSDP/ZeRO-3: all model state divided by the shard degree; + one layer's gathered weights, "
                     "the next one prefetched, and one layer's unsharded gradients")
    elif shard_degree > 1 and zero_stage:
        sharded = ("optimizer state", "+ gradients")[: zero_stage]
        notes.append(f"ZeRO-{zero_stage}: {' '.join(sharded)} divided by {shard_degree} ranks")
    if optimizer_offload:
        notes.append(f"optimizer-state CPU offload: fp32 master weights and optimizer state of all ranks, "
                     f"{format_size(state['host_optimizer'])}, live in host memory")
    return MemoryEstimate(
        model=source.name, num_parameters=num_parameters, batch=batch, seq=seq, dtype=dtype, optimizer=optimizer,
        shard_degree=shard_degree, checkpointing=checkpointing, offload=offload, use_memkernels=use_memkernels,
        parameters=state["parameters"], gradients=state["gradients"], master_weights=state["master_weights"],
        optimizer_state=state["optimizer_state"],
        activations=activations, logits_loss=one_loss, backward_transient=backward_transient, fsdp_buffers=fsdp,
        host_offload=host, notes=notes, zero_stage=zero_stage, finetune=finetune,
        trainable_parameters=num_parameters if trainable is None else trainable,
        grad_accum_buffer=state["grad_accum_buffer"], host_optimizer=state["host_optimizer"])


# Optimizations in order of what they cost (cheapest first): memkernels' kernels add no
# compute; checkpointing recomputes each layer's forward (~+33% step time); offload
# moves saved activations over PCIe and costs time when the transfer outruns compute.
OPTIONS = (
    ("memkernels", {"use_memkernels": True}, "fused kernels, no extra compute"),
    ("checkpointing", {"checkpointing": True}, "recomputes the forward in backward (~+33% compute)"),
    ("memkernels + checkpointing", {"use_memkernels": True, "checkpointing": True}, "~+33% compute"),
    ("offload", {"offload": True}, "host<->GPU copies of saved activations (PCIe bound)"),
    ("memkernels + offload", {"use_memkernels": True, "offload": True}, "PCIe bound"),
    ("checkpointing + offload", {"checkpointing": True, "offload": True}, "~+33% compute, PCIe bound"),
    ("all three", {"use_memkernels": True, "checkpointing": True, "offload": True}, "~+33% compute, PCIe bound"),
)


def fitting_options(model_or_config, gpu_bytes, **kwargs):
    """Which optimizations make a run fit ``gpu_bytes`` per GPU with :func:`default_margin` kept free,
    cheapest first.

    ``kwargs`` as :func:`estimate` (batch, seq, dtype, optimizer, shard_degree).
    Returns a list of dicts ``name``, ``cost``, ``total`` (bytes), ``fits``, or
    ``error`` (str) when an option cannot be measured (e.g. the fused ops are not
    installed); options the caller already enabled are skipped.
    """
    if not isinstance(gpu_bytes, int) or gpu_bytes <= 0:
        raise ValueError(f"fitting_options(gpu_bytes={gpu_bytes!r}): must be a positive int (bytes)")
    available = gpu_bytes - default_margin(gpu_bytes)
    rows = []
    for name, flags, cost in OPTIONS:
        options = dict(kwargs, **flags)
        try:
            total = estimate(model_or_config, **options).total
        except (ImportError, RuntimeError) as error:
            rows.append({"name": name, "cost": cost, "total": None, "fits": False, "error": str(error)})
            continue
        rows.append({"name": name, "cost": cost, "total": total, "fits": total <= available, "error": None})
    return rows


def estimate_table(estimates):
    """A text table of ``[(label, MemoryEstimate), ...]``: one row each, a column per part, then the total."""
    header = ["configuration"] + [_COLUMNS[part] for part in _PARTS] + ["total"]
    rows = [[label.replace("\n", " ")] + [format_size(getattr(result, part)) for part in _PARTS]
            + [format_size(result.total)] for label, result in estimates]
    return text_table(header, rows)


def breakdown_chart(estimates, path, *, title=None, gpu_bytes=None, measured=()):
    """Write a stacked-bar PNG of :class:`MemoryEstimate` breakdowns (one bar each) to ``path``.

    Needs matplotlib; raises ImportError naming the fix without it. Bars are labeled by
    each estimate's configuration; ``gpu_bytes`` draws the per-GPU capacity line. The title says the bars
    are estimates (meta device); ``measured``: lines of measured results (``memkernels report``'s training
    steps) printed under the chart, so that what was measured and what was estimated stay apart.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("breakdown_chart needs matplotlib: pip install matplotlib") from None
    gib = 2.0 ** 30
    labels = [label for label, _ in estimates]
    colors = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1")
    fig, ax = plt.subplots(figsize=(11, 6.5), dpi=110)
    bottoms = [0.0] * len(estimates)
    for part, color in zip(_PARTS, colors):
        heights = [getattr(result, part) / gib for _, result in estimates]
        if not any(heights):
            continue
        ax.bar(labels, heights, bottom=bottoms, color=color, label=_LABELS[part], edgecolor="white", linewidth=0.5)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    top = max(max(bottoms), (gpu_bytes or 0) / gib) * 1.15
    for x, (_, result) in enumerate(estimates):
        ax.text(x, result.total / gib + top * 0.01, f"{result.total / gib:.1f} GiB", ha="center", va="bottom", fontsize=10,
                fontweight="bold", bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5}, zorder=5)
    if gpu_bytes:
        ax.axhline(gpu_bytes / gib, color="black", linestyle="--", linewidth=1.2, zorder=4)
        ax.text(len(estimates) - 0.5, gpu_bytes / gib,
                f"GPU: {gpu_bytes / gib:.1f} GiB ", va="bottom", ha="right", zorder=5)
    ax.set_ylabel("memory per GPU (GiB)")
    ax.set_title((title or "memory per GPU by configuration") + "\nbars: estimated on the meta device, not measured",
                 fontsize=11)
    ax.legend(loc="upper right", fontsize=9)
    ax.set_ylim(0, top)
    ax.grid(axis="y", alpha=0.3)
    plt.setp(ax.get_xticklabels(), fontsize=10)
    measured = list(measured)
    footer = 0.035 * (len(measured) + 1) if measured else 0.0
    if measured:
        fig.text(0.01, 0.01, "\n".join(["measured on this machine:"] + measured), fontsize=8, va="bottom",
                 family="monospace")
    fig.tight_layout(rect=(0, footer, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path
