"""``memkernels.apply(model)``: swap in the fused kernels without rewriting the model.

What it replaces (each switch off with ``norms=False`` / ``mlp=False`` / ``loss=False``):

- norms: ``nn.LayerNorm`` → ``FusedLayerNorm``; ``nn.RMSNorm`` → ``FusedRMSNorm``;
  any other class named ``...RMSNorm`` (Hugging Face has one per family) →
  ``FusedRMSNorm`` with the offset and casting mode of the formula its forward
  computes: Llama's (normalize in fp32, cast, then scale: Llama, Mistral, Qwen 2/3,
  Phi-3, Granite, DeepSeek-V3), Gemma's (scale by 1 + weight in fp32: Gemma 1-3, Qwen3.5) or
  OLMo-2's (scale in fp32, then cast: OLMo-2, GPT-OSS, Gemma 4); a class named ``...LayerNorm``
  that normalizes in fp32 and casts once (Cohere's, without a bias) → ``FusedLayerNorm``.
  The formula is found once per class by running its forward on a CPU copy with
  random weights, in float32 and bfloat16, and comparing bit for bit
  (:data:`NORM_FORMULAS`); a class that computes none of them, needs more than one
  input or holds more than its 1-D weight (and bias) is left alone and listed as
  skipped, with the reason.
- GELU MLPs: memkernels' own ``MLP`` → ``FusedMLP``; Hugging Face GPT-2's
  Conv1D MLP, BERT's intermediate/output pair and the vision towers' fc1/fc2 MLPs
  (SigLIP's, CLIP's: :data:`_FC_MLPS`) → the same MLP computed with
  ``gelu_linear`` (the activated tensor is never stored).
- gated MLPs (SwiGLU / GeGLU: Llama, Mistral, Qwen2/3, Gemma 1-4, OLMo-2, Phi-3's packed
  ``gate_up_proj``, memkernels' own ``GatedMLP``) → ``gated_linear`` for the down
  projection: gate and up are saved, act(gate) * up never is. ``mlp="recompute"``
  saves only the MLP's input and recomputes gate and up in backward, a long input in
  token chunks (plain Linear projections; LoRA MLPs keep the saving variant). ``peft`` LoRA projections are
  fused too: adapters on gate/up are called as they are, the adapter on down_proj
  gets one more ``gated_linear`` with lora_A as its weight. Left alone, with the
  reason: quantized (bitsandbytes) or DoRA down
  projections, and LoRA dropout on down_proj (it needs the product materialized).
- mixture-of-experts experts in transformers' stacked layout (``gate_up_proj`` [E, 2*I, H],
  ``down_proj`` [E, H, I], gate first, no bias) → the same routing with the down projection as
  ``grouped_gated_linear``: gate_up saved per routed token, act(gate) * up never. Other layouts
  (GPT-OSS's) are left alone, with the reason.
- rope: an attention module whose forward calls a module-level function named like a RoPE
  (``apply_rotary_pos_emb``) that computes ``x * cos + rotate_half(x) * sin`` for q and k (probed once
  per function in float64) → the same class with that one call redirected to ``memkernels.functional.rope``
  (one kernel each way for q and k where eager runs 25 a layer; the same bytes saved: cos and sin).
  The model's module is not patched: other
  models of the family in the process keep the original. Calls the fused RoPE does not take (other
  arguments, tables that need a gradient, float64 on a GPU) run the original. Multimodal and partial
  rotary RoPEs compute another formula and are left alone.
- loss: a Hugging Face causal LM of a family in :data:`CAUSAL_LM_HEADS` (its head's
  logit scaling and softcapping are part of the fused loss), called with ``labels``
  in training mode, computes its loss with ``linear_cross_entropy`` from the final
  hidden states; the logits are never materialized (the output's ``logits`` is None
  then). In eval mode, without labels, or with ``skip_logits=False`` the model's own
  forward runs and returns the logits. Other families keep their loss (listed as
  skipped, with the reason). The patched ``forward`` keeps the original's signature
  and docstring, so tools that inspect it (``Trainer``'s ``remove_unused_columns``)
  keep working. A ``peft`` model is seen through: its base model's loss is patched.
  TRL's trainers (SFT, GRPO, RLOO, DPO, KTO; TRL 1.16) do not reach this loss:
  ``add_fused_lm_head`` replaces ``model.forward`` with their own chunked LM-head
  scoring (``fused_lm_head=True``). ``memkernels.integrations.trl.patch_trainer(trainer)``,
  called after the trainer is built, scores their tokens with ``linear_logprobs``
  instead (the report says so).

Vision-language models (``...ForConditionalGeneration`` over a model with a ``language_model``: Qwen2.5-VL,
Gemma 3) are the same walk over both towers: the language model's norms, gated MLPs and RoPE, the vision
tower's norms and MLPs where their formulas match, the projector's norm; the loss is the wrapper's (its head
is in :data:`CAUSAL_LM_HEADS`; the images go through the vision tower as before, and ``labels`` reach a
multimodal model whose forward takes them, as Gemma 3's does). The report gives each row a ``tower`` and
its summary lists what was fused and left alone per tower. Saved bytes per token are measured on a
text-only forward (the vision tower's saving is not in that figure).

apply() never goes around a module's own forward: a module whose weights the fused
path would read directly (GPT-2's ``c_proj``, BERT's ``output.dense``, the LM head,
the norms) is fused only when it is exactly the plain class (``nn.Linear``,
``Conv1D``, ``nn.LayerNorm``, ...) with no hooks. A ``peft`` LoRA layer, a quantized
or other subclassed linear, or a module with hooks is left alone and listed as
skipped with the reason (a LoRA ``c_proj`` needs gelu(h) stored for its low-rank
path, so fusing it would save nothing).

The model keeps its parameters: the new modules share the old modules'
``nn.Parameter`` objects under the same names, so ``state_dict`` keys, values
and layouts are unchanged (a checkpoint loads either way) and an optimizer
built before ``apply`` still holds the right tensors. Hugging Face modules are
patched by switching their class to a subclass with a fused ``forward``, so
their submodules and keys stay where they were.
"""
import copy
import dataclasses
import functools
import inspect
import itertools
import sys
import types
import typing

import torch
import torch.nn.functional as F
from torch import nn

from memkernels.distributed import is_dtensor, layout_hooks_only, sharded_along
from memkernels.models import MLP, LogitsLoss, TransformerLM
from memkernels.runtime.ledger import ledger_forward
from memkernels.runtime.sizes import text_table

__all__ = ["apply", "PatchReport", "CAUSAL_LM_HEADS"]

# A norm class of a model library (Hugging Face has an RMSNorm per family, ~180 in transformers 5) is
# fused when its forward computes, bit for bit on probe inputs, one of these formulas, keyed by the
# fused norm ("rms": FusedRMSNorm, "layer": FusedLayerNorm), offset and casting_mode (see _norm_formula).
NORM_FORMULAS = {
    ("rms", 0.0, "llama"): "RMS-normalized in float32, cast to the input dtype, then times the weight (Llama, "
                           "Mistral, Qwen 2/3, Phi-3, Granite, DeepSeek-V3)",
    ("rms", 1.0, "gemma"): "RMS-normalized in float32, times (1 + weight) in float32, then cast (Gemma 1-3, "
                           "Qwen3.5)",
    ("rms", 0.0, "gemma"): "RMS-normalized in float32, times the weight in float32, then cast (OLMo-2, GPT-OSS, "
                           "Gemma 4)",
    ("layer", 0.0, "gemma"): "mean-centred and normalized in float32, times the weight (plus the bias) in float32, "
                             "then cast (Cohere)",
}
# Hugging Face activation classes → nn.GELU(approximate=...) they compute.
_HF_GELUS = {"GELUActivation": "none", "NewGELUActivation": "tanh", "GELUTanh": "tanh",
             "PytorchGELUTanh": "tanh", "FastGELUActivation": "tanh"}


@dataclasses.dataclass(frozen=True)
class LMHead:
    """What a causal LM's head does to ``hidden @ lm_head.weight.T + bias`` before the loss.

    ``logit_scale(config)``: the factor the logits are multiplied by (None: 1); the fused
    loss multiplies the hidden states (and bias) instead, which is the same product.
    ``softcap``: the config attribute holding ``c`` of ``c * tanh(logits / c)`` (None: none).
    ``router_aux``: a mixture-of-experts LM whose forward, when ``output_router_logits`` (the argument, else the
    config's), adds ``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts,
    num_experts_per_tok, attention_mask)`` (its modeling module's function) to the loss and returns that term
    as ``aux_loss``; the fused forward does the same.
    """
    logit_scale: object = None
    softcap: str = None
    router_aux: bool = False


# Hugging Face causal LMs whose forward is ``logits = head transform(lm_head(hidden))`` then
# ``self.loss_function``, as read in transformers' modeling files. A family not listed keeps its own loss.
CAUSAL_LM_HEADS = {
    "LlamaForCausalLM": LMHead(),
    "MistralForCausalLM": LMHead(),
    "Qwen2ForCausalLM": LMHead(),
    "Qwen3ForCausalLM": LMHead(),
    "Qwen3_5ForCausalLM": LMHead(),
    "GemmaForCausalLM": LMHead(),
    "Gemma2ForCausalLM": LMHead(softcap="final_logit_softcapping"),
    "Gemma3ForCausalLM": LMHead(softcap="final_logit_softcapping"),
    "Gemma4ForCausalLM": LMHead(softcap="final_logit_softcapping"),
    "Olmo2ForCausalLM": LMHead(),
    "Phi3ForCausalLM": LMHead(),
    "GPT2LMHeadModel": LMHead(),
    **{name: LMHead() for name in ("Olmo3ForCausalLM", "SmolLM3ForCausalLM", "MinistralForCausalLM",
                                   "Ministral3ForCausalLM", "SeedOssForCausalLM", "Ernie4_5ForCausalLM",
                                   "Exaone4ForCausalLM", "Glm4ForCausalLM")},
    **{name: LMHead(router_aux=True) for name in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM",
                                                  "OlmoeForCausalLM")},
    "GraniteForCausalLM": LMHead(logit_scale=lambda config: 1.0 / config.logits_scaling),
    "CohereForCausalLM": LMHead(logit_scale=lambda config: config.logit_scale),
    # vision-language models: the wrapper's forward is ``lm_head(language model's hidden states)`` then
    # ``self.loss_function`` (Gemma 3's wrapper does not softcap, unlike Gemma3ForCausalLM)
    "Qwen2_5_VLForConditionalGeneration": LMHead(),
    "Gemma3ForConditionalGeneration": LMHead(),
}


def _require(what):
    """Import the fused op(s) ``what`` needs, or raise naming what is missing."""
    try:
        if what == "norms":
            from memkernels.nn import FusedLayerNorm, FusedRMSNorm
            return FusedLayerNorm, FusedRMSNorm
        if what == "mlp":
            from memkernels.nn import FusedMLP
            from memkernels.ops.gelu_linear import gelu_linear
            return FusedMLP, gelu_linear
        from memkernels.ops.linear_cross_entropy import linear_cross_entropy
        return linear_cross_entropy
    except ImportError as error:
        raise RuntimeError(
            f"memkernels.apply({what}=True): the fused op it needs is not available in this memkernels "
            f"installation ({error}). Install a memkernels that ships it, or pass {what}=False.") from error


def _why_not_plain(module, classes, what):
    """Why the fused path may not read ``module``'s weights itself (None when it may).

    Only exactly one of ``classes`` with no hooks: a subclass or wrapper (a peft LoRA layer, a
    quantized linear) or a hook does something in its forward that reading the weights would skip.
    """
    if type(module) not in classes:
        kind = f"{type(module).__module__}.{type(module).__qualname__}"
        return (f"{what} is a {kind}, not a plain {'/'.join(c.__name__ for c in classes)}: fusing would go around "
                "its forward (e.g. a peft LoRA layer's adapter, a quantized linear)")
    return _dtensor_reason(module, what) or _hooks_reason(module, what)


def _hooks_reason(module, what):
    if module._forward_hooks or module._forward_pre_hooks:
        return f"{what} has forward hooks, which fusing would skip"
    return None


def _dtensor_reason(module, what):
    """Why ``module`` keeps its forward when tensor parallelism (``parallelize_module``) made its weights DTensors
    in a layout the fused path does not take; its hooks redistribute its inputs and outputs."""
    if any(is_dtensor(p) for p in module.parameters(recurse=False)):
        return (f"{what}'s weights are DTensors (tensor parallelism) in a layout the fused path does not take "
                "(it takes colwise gate/up with a rowwise down_proj, an lm_head split over its classes, and "
                "sequence-parallel norms with replicated weights), so it keeps its own forward")
    return None


def _conv1d():
    from transformers.pytorch_utils import Conv1D
    return Conv1D


def _gelu_approximation(act):
    """'none' / 'tanh' for a GELU activation module, None for anything else."""
    if isinstance(act, nn.GELU):
        return act.approximate
    return _HF_GELUS.get(type(act).__name__)


# ----------------------------------------------------------------------------- Hugging Face subclasses

class _FusedGPT2MLP:
    """GPT-2's MLP (Conv1D c_fc → GELU → Conv1D c_proj → dropout) with gelu_linear.

    Conv1D stores its weight as (in, out); ``gelu_linear`` takes (out, in), so it
    gets the transposed view: same parameter, same state_dict.
    """

    def forward(self, hidden_states):
        from memkernels.ops.gelu_linear import gelu_linear
        h = self.c_fc(hidden_states)
        out = gelu_linear(h, self.c_proj.weight.t(), self.c_proj.bias, approximate=self._memkernels_gelu)
        return self.dropout(out)


class _FusedFcMLP:
    """A vision tower's MLP (fc1 → GELU activation_fn → fc2: SigLIP's, CLIP's) with gelu_linear for fc2."""

    def forward(self, hidden_states):
        from memkernels.ops.gelu_linear import gelu_linear
        h = self.fc1(hidden_states)
        return gelu_linear(h, self.fc2.weight, self.fc2.bias, approximate=self._memkernels_gelu)


# Hugging Face MLP classes whose forward is exactly fc2(activation_fn(fc1(x))) (read in transformers 5's modeling
# files); fused when the activation is a GELU.
_FC_MLPS = ("SiglipMLP", "CLIPMLP")


class _FusedBertLayer:
    """BERT's feed-forward (intermediate.dense → GELU → output.dense → dropout → LayerNorm(+x)) fused."""

    def feed_forward_chunk(self, attention_output):
        from memkernels.ops.gelu_linear import gelu_linear
        h = self.intermediate.dense(attention_output)
        out = gelu_linear(h, self.output.dense.weight, self.output.dense.bias, approximate=self._memkernels_gelu)
        return self.output.LayerNorm(self.output.dropout(out) + attention_output)


class CausalLMLoss(nn.Module):
    """Next-token cross-entropy from hidden states through the LM head, logits never materialized.

    A module (no parameters, nothing in state_dict) so that the ledger files
    its saved tensors under logits/loss. ``strategy``: the op's (``"auto"``; a plan's
    ``apply(model, plan)`` sets ``"recompute"``, the strategy the plan counted).
    """

    strategy = "auto"

    def forward(self, hidden, weight, targets, bias=None, softcap=None, num_items_in_batch=None):
        from memkernels.ops.linear_cross_entropy import linear_cross_entropy
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = linear_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=-100, reduction=reduction,
                                    softcap=softcap, strategy=self.strategy)
        if num_items_in_batch is None:
            return loss
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch


def _unpatched_class(cls):
    """The class memkernels switched a module from, found in the MRO of ``cls``: the module's class may have been
    switched again since (fully_shard makes it ``FSDP<class>``, a subclass of memkernels' class)."""
    patched = next(k for k in cls.__mro__ if k.__module__ == __name__ and k.__name__.startswith("Memkernels"))
    return patched.__bases__[-1]


@functools.lru_cache(maxsize=None)
def _forward_signature(cls):
    """The signature of ``cls.forward`` before memkernels patched it (self included)."""
    return inspect.signature(_unpatched_class(cls).forward)


def _keyword_arguments(cls, args, kwargs):
    """``args`` and ``kwargs`` of a call to ``cls.forward`` as keyword arguments only."""
    signature = _forward_signature(cls)
    named = {}
    for name, value in signature.bind(None, *args, **kwargs).arguments.items():
        if signature.parameters[name].kind == inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    named.pop("self", None)
    return named


def _output_class(cls):
    """The ModelOutput class the original forward returns (CausalLMOutputWithPast when unannotated)."""
    annotation = _forward_signature(cls).return_annotation
    for candidate in (annotation, *typing.get_args(annotation)):  # ``tuple | XOutput`` (vision-language models)
        if dataclasses.is_dataclass(candidate) and isinstance(candidate, type) \
                and {"loss", "logits"} <= {f.name for f in dataclasses.fields(candidate)}:
            return candidate
    from transformers.modeling_outputs import CausalLMOutputWithPast
    return CausalLMOutputWithPast


class _FusedCausalLM:
    """A Hugging Face *ForCausalLM whose training loss skips the logits when labels are given.

    ``skip_logits`` (not in the signature; popped from the keyword arguments): True forces the
    fused loss, False the model's own forward; default: fused in training mode with labels.
    """

    def forward(self, *args, **kwargs):
        skip_logits = kwargs.pop("skip_logits", None)
        if args:  # name positional arguments as the original forward does
            kwargs = _keyword_arguments(type(self), args, kwargs)
        labels = kwargs.get("labels")
        if skip_logits is None:
            skip_logits = self.training
        # A head wrapped after apply() (a peft adapter added later) has a forward of its own: run the model's.
        if labels is None or not skip_logits or type(self.get_output_embeddings()) is not nn.Linear:
            return super().forward(**kwargs)
        return self._memkernels_fused_forward(dict(kwargs))

    def _memkernels_fused_forward(self, kwargs):
        labels = kwargs.pop("labels")
        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        return_dict = kwargs.pop("return_dict", None)
        kwargs.pop("logits_to_keep", None)  # every position is scored
        if _takes_labels(type(self.base_model)):  # Gemma 3's multimodal model is given them by its wrapper
            kwargs["labels"] = labels
        spec = CAUSAL_LM_HEADS[_unpatched_class(type(self)).__name__]
        if spec.router_aux and kwargs.get("output_router_logits") is None:
            kwargs["output_router_logits"] = self.config.output_router_logits
        outputs = self.base_model(**kwargs)
        hidden = outputs[0]
        if shift_labels is None:  # Hugging Face's shift: position t predicts labels[t + 1]
            shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        head = self.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if spec.logit_scale is not None:
            scale = spec.logit_scale(self.config)
            hidden = hidden * scale
            bias = None if bias is None else bias * scale
        softcap = getattr(self.config, spec.softcap) if spec.softcap else None
        loss = self._memkernels_loss(hidden, weight, shift_labels.to(hidden.device), bias, softcap, num_items)
        extra = {}
        if spec.router_aux and kwargs["output_router_logits"]:
            balance = inspect.getmodule(_unpatched_class(type(self))).load_balancing_loss_func
            extra["aux_loss"] = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                        kwargs.get("attention_mask"))
            loss = loss + self.router_aux_loss_coef * extra["aux_loss"].to(loss.device)
        output_class = _output_class(type(self))
        fields = {f.name for f in dataclasses.fields(output_class)} - {"loss", "logits"} - set(extra)
        output = output_class(loss=loss, logits=None, **extra, **{k: v for k, v in outputs.items() if k in fields})
        return output.to_tuple() if return_dict is False else output


@functools.lru_cache(maxsize=None)
def _takes_labels(cls):
    return "labels" in inspect.signature(cls.forward).parameters


def _switch_class(module, mixin):
    """Give ``module`` a subclass of its class with ``mixin``'s methods (same attributes, same keys).

    The subclass is registered in this module under its name so it pickles.
    """
    base = type(module)
    name = f"Memkernels{base.__name__}"
    cls = getattr(sys.modules[__name__], name, None)
    if cls is None or cls.__bases__[-1] is not base:
        # Each overridden method shows the original's signature and docstring (tools inspect them).
        methods = {attr: functools.wraps(getattr(base, attr))(_copy_function(fn)) for attr, fn in vars(mixin).items()
                   if inspect.isfunction(fn) and hasattr(base, attr)}
        cls = type(name, (mixin, base), {"__module__": __name__, **methods})
        setattr(sys.modules[__name__], name, cls)
    module.__class__ = cls


def _copy_function(fn):
    return type(fn)(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _is_hf_causal_lm(module):
    """A Hugging Face causal LM with an output head (patched or not; whether the head is a plain
    nn.Linear memkernels can fuse is :func:`_loss_blocker`'s question)."""
    name = type(module).__name__
    # a vision-language model (``...ForConditionalGeneration`` over a model with a ``language_model``), not an
    # encoder-decoder of that name (T5, BART, Whisper)
    vision_language = name.endswith("ForConditionalGeneration") and hasattr(
        getattr(module, "base_model", None), "language_model")
    return ((name.endswith(("ForCausalLM", "LMHeadModel")) or vision_language) and hasattr(module, "base_model")
            and hasattr(module, "get_output_embeddings") and isinstance(module.get_output_embeddings(), nn.Module)
            and module.base_model is not module)


# ----------------------------------------------------------------------------- the report

class PatchReport:
    """What :func:`apply` did.

    ``replaced``: list of dicts ``name`` (qualified module name, ``''`` = the model),
    ``before``, ``after`` (type names; a gated MLP's adds its mode, "(saves gate, up)" or
    "(recompute)"); ``skipped``: dicts ``name``, ``type``, ``reason``; ``notes``: sentences on
    when a replacement takes effect; ``bytes_per_token``: ``{"before": float, "after": float}`` saved
    for backward per token by a training forward (measured on a meta copy at
    ``measured_tokens``), or None with ``measure_note`` saying why.
    """

    def __init__(self):
        self.replaced, self.skipped, self.notes = [], [], []
        self.bytes_per_token, self.measured_tokens, self.measure_note = None, None, ""

    def to_dict(self):
        return {"replaced": list(self.replaced), "skipped": list(self.skipped), "notes": list(self.notes),
                "bytes_per_token": self.bytes_per_token, "measured_tokens": self.measured_tokens,
                "measure_note": self.measure_note}

    def summary(self):
        counts = {}
        for row in self.replaced:
            key = (row["before"], row["after"])
            counts[key] = counts.get(key, 0) + 1
        rows = [(before, after, n) for (before, after), n in counts.items()]
        lines = ["memkernels.apply replaced:",
                 text_table(("module type", "now", "count"), rows) if rows else "  nothing"]
        skipped = {}
        for row in self.skipped:
            skipped.setdefault((row["type"], row["reason"]), 0)
            skipped[(row["type"], row["reason"])] += 1
        lines += [f"  left alone: {n} x {t} ({reason})" for (t, reason), n in skipped.items()]
        lines += self._tower_lines()
        lines += [f"note: {note}" for note in self.notes]
        if self.bytes_per_token:
            before, after = self.bytes_per_token["before"], self.bytes_per_token["after"]
            lines.append(f"saved for backward per token: {before:,.0f} B -> {after:,.0f} B "
                         f"({(after - before) / before:+.0%}; meta forward of {self.measured_tokens} tokens)")
        elif self.measure_note:
            lines.append(f"saved bytes per token: {self.measure_note}")
        return "\n".join(lines)

    __str__ = summary

    def _tower_lines(self):
        """A vision-language model's rows by tower (their ``tower`` key, which apply() sets for such models)."""
        towers = {}
        for key, rows in (("fused", self.replaced), ("left alone", self.skipped)):
            for row in rows:
                if "tower" in row:
                    kinds = towers.setdefault(row["tower"], {"fused": {}, "left alone": {}})[key]
                    kind = row["before"] if key == "fused" else row["type"]
                    kinds[kind] = kinds.get(kind, 0) + 1
        lines = ["by tower:"] if towers else []
        for tower, parts in towers.items():
            said = [f"{key} " + ", ".join(f"{n} x {kind}" for kind, n in kinds.items())
                    for key, kinds in parts.items() if kinds]
            lines.append(f"  {tower}: {'; '.join(said)}")
        return lines


# ----------------------------------------------------------------------------- measuring on a meta copy

def _meta_copy(model):
    """A deep copy of ``model`` whose parameters and buffers are on ``meta`` (no real memory)."""
    memo = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _lm_forward_args(model, tokens):
    """(args, kwargs) of a training forward with labels, on meta; None if the model is not a known LM."""
    ids = torch.empty(1, tokens, dtype=torch.long, device="meta")
    if isinstance(model, TransformerLM):
        return (ids, ids), {}
    if _causal_lm(model) is not None:
        return (), {"input_ids": ids, "labels": ids, "use_cache": False}
    return None


def _saved_bytes_per_token(model, tokens):
    args, kwargs = _lm_forward_args(model, tokens)
    ledger, _ = ledger_forward(_meta_copy(model).train(), *args, **kwargs)
    return ledger.new_bytes / tokens


def _max_positions(model):
    config = getattr(model, "config", None)
    for attr in ("max_seq_len", "max_position_embeddings", "n_positions"):
        if getattr(config, attr, None):
            return getattr(config, attr)
    return 128


# ----------------------------------------------------------------------------- apply

def _norm_kind(module):
    """Whether ``module`` is a norm apply() considers: torch's own, or a class named ...RMSNorm or
    ...LayerNorm (not memkernels' own: fused already)."""
    from memkernels.nn.norms import FusedLayerNorm, FusedRMSNorm

    name = type(module).__name__.lower()
    return type(module) in (nn.LayerNorm, nn.RMSNorm) or (
        name.endswith(("rmsnorm", "layernorm")) and not isinstance(module, (FusedRMSNorm, FusedLayerNorm)))


_PROBED_FORMULAS = {}  # class -> its key of NORM_FORMULAS, or the reason it matches none


def _norm_formula(module):
    """The key of NORM_FORMULAS whose fused norm computes what ``module``'s class computes, or a string
    saying why none does. Decided once per class, by running its forward on a CPU copy with random
    weights (never the module itself: no hooks fire, no device work) in float32 and bfloat16 and
    comparing bit for bit with each formula written as such a class writes it."""
    cls = type(module)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    parameters = dict(module.named_parameters())
    if not parameters:
        return (f"{cls.__name__} has no weight (an unweighted norm): fused norms take their normalized shape from "
                "the weight")
    if (parameters.keys() not in ({"weight"}, {"weight", "bias"}) or any(p.dim() != 1 for p in parameters.values())
            or next(module.buffers(), None) is not None or next(module.children(), None) is not None):
        return (f"{cls.__name__} is not a norm over the last dimension with a 1-D weight (and bias) alone (no "
                "other parameters, buffers or submodules)")
    if not isinstance(eps, float):
        return f"{cls.__name__} keeps its epsilon in neither .variance_epsilon nor .eps as a float"
    if cls not in _PROBED_FORMULAS:
        _PROBED_FORMULAS[cls] = _probe_norm(module, eps, sorted(parameters), parameters["weight"].shape[0])
    return _PROBED_FORMULAS[cls]


def _formulas(x, weight, bias, eps):
    """Each NORM_FORMULAS entry's output for ``x``, computed in the op order the classes it names use."""
    dtype, h = x.dtype, x.float()
    outputs = {}
    if bias is None:
        rms = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        outputs.update({("rms", 0.0, "llama"): weight * rms.to(dtype),
                        ("rms", 1.0, "gemma"): (rms * (1.0 + weight.float())).to(dtype),
                        ("rms", 0.0, "gemma"): (weight * rms).to(dtype)})
    centered = h - h.mean(-1, keepdim=True)
    layer = weight.float() * (centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps))
    outputs[("layer", 0.0, "gemma")] = (layer if bias is None else layer + bias.float()).to(dtype)
    return outputs


def _probe_norm(module, eps, names, hidden):
    generator = torch.Generator().manual_seed(0)
    probe = object.__new__(type(module))
    probe.__dict__.update(module.__dict__)
    matching = set(NORM_FORMULAS)
    for dtype in (torch.float32, torch.bfloat16):
        values = {name: torch.randn(hidden, generator=generator).to(dtype) for name in names}
        probe._parameters = {name: nn.Parameter(value, requires_grad=False) for name, value in values.items()}
        # rows at mean squares ~1, ~eps (where eps is half of the denominator) and ~100, off-centre; 3-D, so that
        # a norm over another dimension (a channels-first LayerNorm) shows
        scale = torch.tensor([[1.0], [max(eps, 1e-12) ** 0.5], [10.0]])
        x = (torch.randn(2, 3, hidden, generator=generator).add(0.5) * scale).to(dtype)
        try:
            with torch.no_grad():
                got = probe.forward(x)  # not __call__: no global module hooks fire
        except Exception as error:  # a forward that needs more than x (a gate, a residual) is not this norm
            return f"{type(module).__name__}'s forward did not run on a lone input: {type(error).__name__}: {error}"
        expected = _formulas(x, values["weight"], values.get("bias"), eps)
        matching = {f for f in matching & expected.keys() if isinstance(got, torch.Tensor)
                    and got.dtype == expected[f].dtype and torch.equal(got, expected[f])}
    if not matching:
        return (f"{type(module).__name__}'s forward is none of the norm formulas memkernels fuses "
                "(memkernels.patch.NORM_FORMULAS), checked bit for bit in float32 and bfloat16")
    return min(matching)


def _mlp_blockers(kind, module):
    """Why the MLP ``module`` (action ``kind``) cannot be fused: the modules whose weights it would read."""
    if kind == "mlp":
        reads = (("fc1", module.fc1, (nn.Linear,)), ("fc2", module.fc2, (nn.Linear,)))
    elif kind == "gpt2_mlp":
        reads = (("c_proj", module.c_proj, (_conv1d(),)),)
    elif kind == "fc_mlp":
        reads = (("fc2", module.fc2, (nn.Linear,)),)
    else:
        reads = (("output.dense", module.output.dense, (nn.Linear,)),)
    return next((why for why in (_why_not_plain(m, kinds, what) for what, m, kinds in reads) if why), None)


def _causal_lm(model):
    """(qualified name, module) of the Hugging Face causal LM inside ``model`` (itself, or a peft
    model's base model), or None."""
    if _is_hf_causal_lm(model) and not hasattr(model, "get_base_model"):
        return "", model
    get_base_model = getattr(model, "get_base_model", None)  # peft.PeftModel
    inner = get_base_model() if callable(get_base_model) else None
    if inner is not None and inner is not model and _is_hf_causal_lm(inner):
        name = next(n for n, m in model.named_modules() if m is inner)
        return name, inner
    return None


def _loss_blocker(module):
    """Why the causal LM ``module``'s loss stays its own (None when memkernels can compute it)."""
    family = type(module).__name__
    if family not in CAUSAL_LM_HEADS:
        return (f"{family}'s head is not one memkernels knows (see memkernels.patch.CAUSAL_LM_HEADS): its forward "
                "may scale, cap or add to the loss, which the fused loss would drop; its own loss is kept")
    return _head_reason(module.get_output_embeddings())


def _head_reason(head):
    """Why the fused loss may not read the LM head's weights (None when it may). A plain Linear, or one
    ``parallelize_module`` split over its classes (ColwiseParallel: weight and bias placed Shard(0) on a 1-D mesh):
    linear_cross_entropy takes those DTensors (vocabulary-parallel), and the hooks ColwiseParallel adds only lay the
    head's input and output out, which the fused loss never reads."""
    if (type(head) is nn.Linear and sharded_along(head.weight, 0) and layout_hooks_only(head)
            and (head.bias is None or sharded_along(head.bias, 0))):
        return None
    return _why_not_plain(head, (nn.Linear,), "lm_head")


def _plan(model, norms, mlp, loss, rope, report):
    """Collect (qualified name, action) pairs; nothing is changed yet."""
    actions = []
    for name, module in model.named_modules():
        cls_name = type(module).__name__
        kind, why = None, None
        if norms and _norm_kind(module):
            kind = "norm"
            why = None if _sequence_parallel_norm(module) else _why_not_plain(module, (type(module),), "the norm")
            if why is None and type(module) not in (nn.LayerNorm, nn.RMSNorm):
                formula = _norm_formula(module)
                why = formula if isinstance(formula, str) else None
        elif mlp and isinstance(module, MLP):
            kind = "mlp"
            why = "activation is not GELU" if _gelu_approximation(module.act) is None else None
        elif mlp and cls_name == "GPT2MLP":
            kind = "gpt2_mlp"
        elif mlp and cls_name in _FC_MLPS and not isinstance(module, _FusedFcMLP):
            kind = "fc_mlp"
            act = getattr(module, "activation_fn", None)
            why = f"activation {type(act).__name__} is not GELU" if _gelu_approximation(act) is None else None
        elif mlp and cls_name in ("BertLayer", "RobertaLayer") and hasattr(module, "intermediate"):
            kind = "bert_ffn"
        elif mlp and _is_gated_mlp(module):
            _plan_gated_mlp(name, module, actions, report)
        elif loss and isinstance(module, LogitsLoss):
            kind = "lm_loss"
        elif rope and (site := _rope_site(type(module))) is not None:
            kind = "rope"
            replacement = _rope_class(type(module), *site) if isinstance(site, tuple) else site
            why = replacement if isinstance(replacement, str) else None
        if kind in ("mlp", "gpt2_mlp", "bert_ffn", "fc_mlp") and why is None:
            why = _mlp_blockers(kind, module)
        if kind is not None and why is not None:
            report.skipped.append({"name": name, "type": cls_name, "reason": why})
        elif kind is not None:
            actions.append((name, kind, module))
    found = _causal_lm(model) if loss else None
    if found is not None and not isinstance(found[1], _FusedCausalLM):
        name, module = found
        why = _loss_blocker(module)
        if why is None:
            actions.append((name, "hf_loss", module))
        else:
            report.skipped.append({"name": name, "type": type(module).__name__, "reason": why})
    return actions


_LOSS_NOTE = ("the fused loss runs when the model is called with labels in training mode (a plain training loop, "
              "transformers.Trainer); eval mode or skip_logits=False runs the model's own forward and returns the "
              "logits. TRL's trainers (SFTTrainer, GRPOTrainer, RLOOTrainer, DPOTrainer, KTOTrainer) do NOT use it: "
              "they replace model.forward with their own chunked LM-head scoring (fused_lm_head=True). Call "
              "memkernels.integrations.trl.patch_trainer(trainer) after building the trainer to score their tokens "
              "with memkernels' linear_logprobs; without it only the norm, MLP and RoPE replacements take effect "
              "under TRL.")


def _set_child(model, name, new):
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _sequence_parallel_norm(module):
    """Whether ``parallelize_module`` made ``module`` a sequence-parallel norm the fused norm can stand in for: its
    parameters replicated DTensors on a 1-D mesh, its hooks only the layout ones (kept on the fused norm), whose
    rms_norm / layer_norm take the token-sharded DTensor input."""
    from torch.distributed.tensor import Replicate

    parameters = list(module.parameters(recurse=False))
    return (bool(parameters) and layout_hooks_only(module)
            and all(is_dtensor(p) and p.device_mesh.ndim == 1 and tuple(p.placements) == (Replicate(),)
                    for p in parameters))


def _fused_norm(module, fused_layer_norm, fused_rms_norm):
    if type(module) is nn.LayerNorm:
        new = fused_layer_norm.from_module(module)
    elif type(module) is nn.RMSNorm:
        new = fused_rms_norm.from_module(module, casting_mode="llama")
    else:
        kind, offset, casting_mode = _norm_formula(module)
        new = (fused_rms_norm.from_module(module, offset=offset, casting_mode=casting_mode) if kind == "rms"
               else fused_layer_norm.from_module(module))
    # Share, don't copy: keeps optimizers, tied weights and FSDP/DDP registrations valid.
    if module.weight is not None:
        new.weight = module.weight
    if getattr(module, "bias", None) is not None:
        new.bias = module.bias
    # A sequence-parallel norm's layout hooks (parallelize_module's) move over with it.
    new._forward_pre_hooks.update(module._forward_pre_hooks)
    new._forward_hooks.update(module._forward_hooks)
    return new


# ----------------------------------------------------------------------------- gated MLPs (SwiGLU / GeGLU)

def _is_gated_mlp(module):
    """A gated MLP (gate_proj + up_proj, or gate_up_proj, + down_proj) or a mixture-of-experts' experts."""
    cls_name = type(module).__name__
    return cls_name.endswith("Experts") or (cls_name.endswith("MLP") and hasattr(module, "down_proj")
                                            and (hasattr(module, "gate_proj") or hasattr(module, "gate_up_proj")))


def _lora_down(down):
    """(base nn.Linear, [(lora_A weight, lora_B module, scaling)] of the active adapters) of a down
    projection, or a string saying why it cannot be fused. A peft LoRA layer is recognized by its
    attributes (peft need not be importable)."""
    if type(down) is nn.Linear:
        return down, []
    base = getattr(down, "base_layer", down)
    if type(base).__module__.startswith("bitsandbytes"):
        return f"bitsandbytes-quantized down_proj ({type(base).__name__}): the fused GEMM needs a dense weight"
    if type(base) is not nn.Linear or not hasattr(down, "lora_A"):
        return f"down_proj is {type(down).__name__}, not nn.Linear or a LoRA layer over one"
    if down.disable_adapters and down.merged:
        return "down_proj's merged LoRA adapter is disabled (peft unmerges it in its forward)"
    if down.disable_adapters or down.merged:  # the base weight alone is the layer
        return base, []
    adapters = []
    for adapter in down.active_adapters:
        if adapter not in down.lora_A.keys():
            continue
        if adapter in getattr(down, "lora_variant", {}) or getattr(down, "use_dora", {}).get(adapter):
            return f"LoRA variant (e.g. DoRA) {adapter!r} on down_proj"
        if not isinstance(down.lora_dropout[adapter], nn.Identity):
            return f"LoRA dropout on down_proj (adapter {adapter!r}) needs act(gate) * up materialized"
        adapters.append((down.lora_A[adapter].weight, down.lora_B[adapter], down.scaling[adapter]))
    return base, adapters


def _plan_gated_mlp(name, module, actions, report):
    from memkernels.nn.mlp import gated_activation, gated_mlp_parts

    cls_name = type(module).__name__
    if isinstance(module, _FusedGatedMLPForward):  # patched by an earlier apply()
        return
    if isinstance(module, _FusedExperts):
        return
    if cls_name.endswith("Experts"):
        reason = _experts_blocker(module)
        if reason is None:
            actions.append((name, "experts", module))
            return
    else:
        gate, up, down, act = gated_mlp_parts(module)
        down_parts = _lora_down(down)
        tensor_parallel = _tensor_parallel_mlp(gate, up, down)
        # Checked here, not per call: a measuring tool's own hooks (activation_ledger) must not
        # switch the fused path off.
        hooked = not tensor_parallel and any(m._forward_hooks or m._forward_pre_hooks
                                             for m in (down, getattr(down, "base_layer", down)))
        reason = (f"gated MLP activation {type(act).__name__} is not SiLU or GELU" if gated_activation(act) is None
                  else down_parts if isinstance(down_parts, str)
                  else (None if tensor_parallel else _dtensor_reason(getattr(down, "base_layer", down), "down_proj"))
                  or ("down_proj has forward hooks, which fusing would skip" if hooked
                      else _gated_mlp_formula_blocker(module)))
    if reason:
        report.skipped.append({"name": name, "type": cls_name, "reason": reason})
    else:
        actions.append((name, "gated_mlp", module))


def _tensor_parallel_mlp(gate, up, down):
    """Whether ``parallelize_module`` split the gated MLP colwise then rowwise, as the fused forward can run it:
    gate (and up) plain Linears with weights placed Shard(0), down a plain Linear with its weight placed Shard(1)
    on the same 1-D mesh (each rank: I/tp of the intermediate features), each with only the hooks that lay its
    input and output out. gated_linear then takes this rank's gate and up with down's weight shard and gives
    partial sums, which down's own output hook adds up (RowwiseParallel's layout)."""
    if up is None:  # a packed gate_up split colwise gives one rank gates and the other ups, not halves of each
        return False
    projections = [gate, up]
    return (all(type(p) is nn.Linear and layout_hooks_only(p) for p in (*projections, down))
            and sharded_along(down.weight, 1) and all(sharded_along(p.weight, 0) for p in projections)
            and all(p.weight.device_mesh == down.weight.device_mesh for p in projections))


# Attributes a gated MLP's forward may scale by, as down(act(gate * gate_multiplier) * up) * down_multiplier
# (Falcon-H1's mlp_multipliers); honoured when the probe finds its forward uses them that way.
GATED_MLP_MULTIPLIERS = ("gate_multiplier", "down_multiplier")

# gated MLP class -> why its forward is not the fused formula (None when it is), probed once per class
_PROBED_GATED_MLPS = {}


def _gated_mlp_formula_blocker(module):
    """Why ``module``'s forward is not down(act(gate [* gate_multiplier]) * up) [* down_multiplier] (None when it
    is). Fusing by attribute names alone would silently drop whatever else a forward does (Falcon-H1 scales
    gate and output); the class's own forward is run once, in float64, on small stand-in projections."""
    cls = type(module)
    if cls not in _PROBED_GATED_MLPS:
        _PROBED_GATED_MLPS[cls] = _probe_gated_mlp(module)
    return _PROBED_GATED_MLPS[cls]


def _probe_gated_mlp(module):
    from memkernels.nn.mlp import gated_activation, gated_mlp_parts
    from memkernels.reference.act_linear import activation

    gate, up, _, act = gated_mlp_parts(module)
    hidden, width = 5, 7
    generator = torch.Generator().manual_seed(0)

    def stand_in(features_in, features_out, like):
        linear = nn.Linear(features_in, features_out, bias=like.bias is not None, dtype=torch.float64)
        with torch.no_grad():
            for parameter in linear.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
        return linear.requires_grad_(False)

    probe = object.__new__(type(module))
    probe.__dict__.update(module.__dict__)
    projections = {"down_proj": stand_in(width, hidden, module.down_proj)}
    if up is None:
        projections["gate_up_proj"] = stand_in(hidden, 2 * width, gate)
    else:
        projections.update(gate_proj=stand_in(hidden, width, gate), up_proj=stand_in(hidden, width, up))
    probe._modules = {**module._modules, **projections}
    sizes = {"hidden_size": hidden, "intermediate_size": width}
    probe.__dict__.update({name: value for name, value in sizes.items() if name in module.__dict__})
    # Values no model uses, so a forward that ignores or misreads one shows.
    multipliers = {"gate_multiplier": 0.75, "down_multiplier": 1.5}
    multipliers = {name: multipliers[name] if hasattr(module, name) else 1.0 for name in GATED_MLP_MULTIPLIERS}
    probe.__dict__.update({name: value for name, value in multipliers.items() if hasattr(module, name)})
    x = torch.randn(2, 3, hidden, generator=generator, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = probe.forward(x)  # not __call__: no global module hooks fire
    except Exception as error:
        return f"{type(module).__name__}'s forward did not run on a lone input: {type(error).__name__}: {error}"
    with torch.no_grad():
        if up is None:
            gate_out, up_out = projections["gate_up_proj"](x).split(width, dim=-1)
        else:
            gate_out, up_out = projections["gate_proj"](x), projections["up_proj"](x)
        product = activation(gate_out * multipliers["gate_multiplier"], gated_activation(act)) * up_out
        expected = projections["down_proj"](product) * multipliers["down_multiplier"]
    if not (isinstance(got, torch.Tensor) and got.shape == expected.shape
            and torch.allclose(got, expected, rtol=1e-12, atol=1e-12)):
        return (f"{type(module).__name__}'s forward is not down_proj(act(gate) * up) (with its "
                f"{' and '.join(GATED_MLP_MULTIPLIERS)}, when it has them), checked in float64")
    return None


def gated_mlp_multipliers(mlp):
    """(gate_multiplier, down_multiplier) of a gated MLP, 1.0 where it has none."""
    return tuple(float(getattr(mlp, name, 1.0)) for name in GATED_MLP_MULTIPLIERS)


# ----------------------------------------------------------------------------- mixture-of-experts experts

def _experts_blocker(module):
    """Why a mixture-of-experts' experts module cannot take :func:`fused_experts_forward` (None when it can).

    Recognized by structure: Hugging Face's stacked layout (``gate_up_proj`` [E, 2*I, H] and ``down_proj``
    [E, H, I] Parameters, gate first, no bias, not transposed: Qwen2/3-MoE, Mixtral, DeepSeek-V2/V3, OLMoE
    and the others built on transformers' ``use_experts_implementation``), the default gating
    act(gate) * up with a SiLU or GELU activation."""
    from memkernels.nn.mlp import gated_activation

    layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
              "has_post_expert_norm": False, "_is_expert_parallel": False}
    odd = [f"{key}={getattr(module, key)}" for key, expected in layout.items()
           if getattr(module, key, expected) != expected]
    if odd:
        return f"mixture-of-experts experts with {', '.join(odd)}: only gate-first, bias-free stacked experts are fused"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[0] == down.shape[0]):
        return ("mixture-of-experts experts not in the stacked layout (gate_up_proj [E, 2*I, H] and down_proj "
                "[E, H, I] parameters)")
    gating = getattr(type(module), "_apply_gate", None)
    if gating is not None and gating.__name__ != "_default_apply_gate":
        return (f"mixture-of-experts experts with their own gating ({type(module).__name__}._apply_gate, e.g. "
                "GPT-OSS's clamped SwiGLU), not act(gate) * up")
    activation = gated_activation(getattr(module, "act_fn", None))
    if activation is None:
        return f"mixture-of-experts activation {type(getattr(module, 'act_fn', None)).__name__} is not SiLU or GELU"
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation not in (None, "eager", "grouped_mm"):
        return f"experts_implementation={implementation!r} (only 'eager' and 'grouped_mm' compute what is fused)"
    return None


class _FusedExperts:
    """A mixture-of-experts' experts whose down projection is grouped_gated_linear (see fused_experts_forward)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return fused_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def fused_experts_forward(experts, hidden_states, top_k_index, top_k_weights):
    """What transformers' experts forward computes (the routed tokens' gated MLPs, weighted and summed per
    token) with the down projection through grouped_gated_linear: per routed token only the [2*I] gate_up is
    saved for backward, act(gate) and act(gate) * up never are (eager keeps both: 4*I).

    hidden_states [T, H]; top_k_index [T, k] (int); top_k_weights [T, k]. Routed tokens are sorted by
    expert (stable), projected by one grouped GEMM, down-projected by another, weighted, put back in
    token order and summed over the k choices (in the weights' dtype, then the input's, as
    transformers' grouped_mm path does)."""
    from memkernels.ops.grouped_gated_linear import grouped_gated_linear, grouped_mm

    tokens, top_k = top_k_index.shape
    count = experts.gate_up_proj.shape[0]
    expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    # histc, not bincount: a fixed number of bins (meta tensors and CUDA graphs need the shape); float ids on the
    # CPU (exact below 2**24), integers on CUDA, as transformers' grouped_mm path counts them
    ids = expert_ids.int() if expert_ids.is_cuda else expert_ids.float()
    offsets = torch.histc(ids, bins=count, min=0, max=count - 1).cumsum(0, dtype=torch.int32)
    gate_up = grouped_mm(hidden_states[order // top_k], experts.gate_up_proj.transpose(-2, -1), offsets)
    routed = grouped_gated_linear(gate_up, experts.down_proj, offsets,
                                  activation=experts._memkernels_gated_activation)
    routed = routed * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=order.device)
    return routed[restore].view(tokens, top_k, -1).sum(1).to(hidden_states.dtype)


def _patch_experts(module):
    from memkernels.nn.mlp import gated_activation

    _switch_class(module, _FusedExperts)
    module._memkernels_gated_activation = gated_activation(module.act_fn)


class _FusedGatedMLPForward:
    """A gated MLP whose down projection is gated_linear (its forward; see gated_mlp_forward)."""

    def forward(self, x):
        return gated_mlp_forward(self, x)


def can_recompute_gated_mlp(module):
    """Whether ``module`` is a gated MLP apply() fused whose projections gated_mlp_recompute can read itself
    (plain, hook-free nn.Linear: LoRA or hooked ones keep the saving variant, which calls them as modules)."""
    from memkernels.nn.mlp import gated_mlp_parts

    return isinstance(module, _FusedGatedMLPForward) and gated_mlp_multipliers(module)[0] == 1.0 and all(
        p is None or _why_not_plain(p, (nn.Linear,), "projection") is None for p in gated_mlp_parts(module)[:3])


def gated_mlp_forward(mlp, x, recompute=None):
    """The forward of a gated MLP apply() fused: gated_mlp_recompute (saves only x; long inputs in token chunks)
    when ``recompute`` (default: as apply() set it) and the projections allow it, else the saving variant
    (gate and up saved, gated_linear for the down projection, LoRA adapters on their own)."""
    from memkernels.nn.mlp import gated_mlp_parts
    from memkernels.ops.gated_linear import gated_linear, gated_mlp_recompute

    gate_proj, up_proj, down_proj, _ = gated_mlp_parts(mlp)
    activation = mlp._memkernels_gated_activation
    gate_multiplier, down_multiplier = gated_mlp_multipliers(mlp)
    recompute = mlp._memkernels_recompute if recompute is None else recompute
    if recompute and gate_multiplier == 1.0 and not is_dtensor(down_proj.weight) and all(
            p is None or type(p) is nn.Linear for p in (gate_proj, up_proj, down_proj)):
        up_weight, up_bias = (None, None) if up_proj is None else (up_proj.weight, up_proj.bias)
        out = gated_mlp_recompute(x, gate_proj.weight, gate_proj.bias, up_weight, up_bias, down_proj.weight,
                                  down_proj.bias, activation=activation)
        return out if down_multiplier == 1.0 else out * down_multiplier
    down = _lora_down(down_proj)
    if isinstance(down, str):  # a LoRA state changed after apply(): run the module's own forward
        return super(_FusedGatedMLPForward, mlp).forward(x)
    base, adapters = down
    if adapters and is_dtensor(base.weight):  # LoRA added to a tensor-parallel MLP after apply(): its own forward
        return super(_FusedGatedMLPForward, mlp).forward(x)
    gate = gate_proj(x)
    if up_proj is None:
        if gate_multiplier != 1.0:  # the gate half scaled, as a new packed tensor (the scaled half alone would
            half = gate.shape[-1] // 2  # keep the whole unscaled one alive through its up half)
            gate = torch.cat((gate[..., :half] * gate_multiplier, gate[..., half:]), dim=-1)
        operands = {"gate_up": gate}
    else:
        operands = {"gate": gate if gate_multiplier == 1.0 else gate * gate_multiplier, "up": up_proj(x)}
    if is_dtensor(base.weight):  # colwise then rowwise (_tensor_parallel_mlp): this rank's I/tp features
        return _tensor_parallel_down(base, operands, activation, down_multiplier)
    out = gated_linear(**operands, weight=base.weight, bias=base.bias, activation=activation)
    for lora_a_weight, lora_b, scaling in adapters:
        cast = {key: value.to(lora_a_weight.dtype) for key, value in operands.items()}
        out = out + lora_b(gated_linear(**cast, weight=lora_a_weight, activation=activation)) * scaling
    return out if down_multiplier == 1.0 else out * down_multiplier


def _tensor_parallel_down(down, operands, activation, down_multiplier):
    """down_proj of a tensor-parallel gated MLP, fused: the colwise projections' outputs (this rank's features:
    plain tensors, or DTensors with use_local_output=False) as DTensors sharded over their last dim, gated_linear
    with down's weight shard (partial sums, its replicated bias added once), then down's own output hook, which
    lays the result out as RowwiseParallel was asked to (e.g. all-reduced and local)."""
    from torch.distributed.tensor import Shard

    from memkernels.distributed import contiguous_stride, dtensor_class
    from memkernels.ops.gated_linear import gated_linear

    mesh, features = down.weight.device_mesh, down.weight.shape[1]

    def sharded(local):  # the global shape given: Shard splits an uneven I as torch.chunk does
        shape = (*local.shape[:-1], features)
        return dtensor_class().from_local(local, mesh, [Shard(local.dim() - 1)], shape=torch.Size(shape),
                                          stride=contiguous_stride(shape))

    operands = {key: value if is_dtensor(value) else sharded(value) for key, value in operands.items()}
    out = gated_linear(**operands, weight=down.weight, bias=down.bias, activation=activation)
    for hook in down._forward_hooks.values():
        out = hook(down, (), out)
    return out if down_multiplier == 1.0 else out * down_multiplier


def _patch_gated_mlp(module, recompute):
    """Switch ``module`` to its fused subclass; returns the mode shown in the report."""
    from memkernels.nn.mlp import gated_activation, gated_mlp_parts

    _switch_class(module, _FusedGatedMLPForward)
    module._memkernels_gated_activation = gated_activation(gated_mlp_parts(module)[3])
    module._memkernels_recompute = recompute and can_recompute_gated_mlp(module)
    return "recompute" if module._memkernels_recompute else "saves gate, up"


# ----------------------------------------------------------------------------- RoPE in attention

# Module-level functions an attention forward calls are RoPE candidates when their names say so; one is
# replaced only when it computes the rotate-half formula (probed once per function, in float64).
_ROPE_NAME_PARTS = ("rotary", "rope")
_PROBED_ROPE = {}  # function -> True, or the reason it is not the rotate-half RoPE
_ROPE_SITES = {}  # attention class -> _rope_site's answer


def _defined_forward(cls):
    """The plain function ``cls`` runs as its forward (its own or inherited), or None."""
    forward = next((klass.__dict__["forward"] for klass in cls.__mro__ if "forward" in klass.__dict__), None)
    return forward if isinstance(forward, types.FunctionType) and forward is not nn.Module.forward else None


def _rope_site(cls):
    """(global name, function) of the RoPE that ``cls.forward`` calls, a string saying why it is not
    replaced, or None when its forward calls nothing named like a RoPE (not an attention module).
    Decided once per class."""
    if cls not in _ROPE_SITES:
        _ROPE_SITES[cls] = _find_rope_site(cls)
    return _ROPE_SITES[cls]


def _is_function(value):
    """A plain function, or one the ``kernels`` package turned into a module instance so that a hub kernel can
    replace it (transformers >= 5.25 with ``kernels`` installed: ``@use_kernel_forward_from_hub`` on
    ``apply_rotary_pos_emb``); called outside a kernelized model, such an instance runs the function."""
    return isinstance(value, types.FunctionType) or (isinstance(value, nn.Module)
                                                      and hasattr(value, "kernel_layer_name"))


def _find_rope_site(cls):
    forward = _defined_forward(cls)
    if forward is None or getattr(cls, "_memkernels_rope", None):
        return None
    inner = inspect.unwrap(forward)  # under functools.wraps decorators (transformers' deprecate_kwarg)
    named = [(name, inner.__globals__[name]) for name in inner.__code__.co_names
             if any(part in name.lower() for part in _ROPE_NAME_PARTS) and name in inner.__globals__
             and _is_function(inner.__globals__[name])]
    if not named:
        return None
    reasons = []
    for name, function in named:
        if function not in _PROBED_ROPE:
            _PROBED_ROPE[function] = _probe_rope(function)
        if _PROBED_ROPE[function] is True:
            return name, function
        reasons.append(_PROBED_ROPE[function])
    return "; ".join(reasons)


def _probe_rope(function):
    """True when ``function(q, k, cos, sin)`` computes ``x * cos + rotate_half(x) * sin`` for q and k (float64,
    random tables that are not Hugging Face's repeated halves, q as a transposed view); else why not."""
    from memkernels.reference import rope as reference

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 3, 8, generator=generator, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(2, 5, 2, 8, generator=generator, dtype=torch.float64).transpose(1, 2)
    cos, sin = (torch.randn(2, 5, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    who = f"{function.__module__}.{getattr(function, '__qualname__', type(function).__qualname__)}"
    try:
        with torch.no_grad():
            got = function(q, k, cos, sin)
    except Exception as error:  # another signature (multimodal RoPE's sections, a partial rotary's slice)
        return f"{who}(q, k, cos, sin) did not run as the rotate-half RoPE: {type(error).__name__}: {error}"
    expected = reference.rotate(q, k, cos, sin, torch.float64, torch.float64, False)
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(
            isinstance(t, torch.Tensor) and t.shape == e.shape and torch.allclose(t, e, rtol=0, atol=1e-12)
            for t, e in zip(got, expected))):
        return f"{who} is not the rotate-half RoPE x * cos + rotate_half(x) * sin (checked in float64)"
    return True


def _fused_rope_function(original):
    """``original``'s stand-in: memkernels' rope where it takes the call, ``original`` itself elsewhere
    (other arguments, tables that need a gradient, shapes or dtypes rope does not take)."""
    from memkernels.ops import rope as rope_op

    # Not functools.wraps: torch.compile would take the stand-in for the model module's function of that name
    # and guard on the original's closure.
    def fused(q, k, cos, sin, *args, **kwargs):
        if args or kwargs and (kwargs.keys() != {"unsqueeze_dim"} or kwargs["unsqueeze_dim"] != 1) \
                or rope_op.unsupported(q, k, cos, sin) is not None:
            return original(q, k, cos, sin, *args, **kwargs)
        return rope_op.rope(q, k, cos, sin)

    return fused


def _with_globals(fn, replacements):
    """``fn`` rebuilt so that the function under its ``functools.wraps`` decorators looks ``replacements`` up
    as globals (the module stays as it is); None when a decorator does not hold what it wraps in a closure."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        rebuilt = types.FunctionType(fn.__code__, _redirected_namespace(fn.__globals__, replacements), fn.__name__,
                                     fn.__defaults__, fn.__closure__)
    else:
        cells = fn.__closure__ or ()
        holding = [index for index, cell in enumerate(cells) if _cell_contents(cell) is inner]
        rebuilt_inner = _with_globals(inner, replacements) if len(holding) == 1 else None
        if rebuilt_inner is None:
            return None
        cells = tuple(types.CellType(rebuilt_inner) if index == holding[0] else cell
                      for index, cell in enumerate(cells))
        rebuilt = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    rebuilt.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(rebuilt, fn, updated=())
    rebuilt.__dict__.update(fn.__dict__)
    if inner is None:
        del rebuilt.__wrapped__
    else:
        rebuilt.__wrapped__ = rebuilt_inner
    return rebuilt


def _redirected_namespace(namespace, replacements):
    """A copy of a module's ``namespace`` with ``replacements``, as the namespace of a module of its own in
    sys.modules: torch.compile finds a function's globals through ``__name__``'s module, and must find the
    replacements there, not the model module's originals."""
    name = f"_memkernels_redirected_{namespace['__name__'].replace('.', '_')}"
    module = sys.modules.get(name)
    if module is None or any(module.__dict__.get(key) is not value for key, value in replacements.items()):
        module = types.ModuleType(name)
        module.__dict__.update({**namespace, **replacements, "__name__": name})
        sys.modules[name] = module
    return module.__dict__


def _cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _rope_class(base, name, original):
    """The subclass of attention class ``base`` whose forward calls the fused RoPE for global ``name``;
    a string saying why there is none. Registered in this module under its name so it pickles."""
    cls_name = f"MemkernelsRope{base.__name__}"
    cls = getattr(sys.modules[__name__], cls_name, None)
    if cls is None or cls.__bases__ != (base,) or cls._memkernels_rope != (name, original):
        forward = _with_globals(_defined_forward(base), {name: _fused_rope_function(original)})
        if forward is None:
            return (f"{base.__name__}.forward is wrapped by a decorator that does not keep the function in a "
                    "closure: its RoPE call cannot be redirected")
        cls = type(cls_name, (base,), {"__module__": __name__, "forward": forward, "_memkernels_rope": (name, original)})
        setattr(sys.modules[__name__], cls_name, cls)
    return cls


# Attribute names Hugging Face's vision-language models give their towers (transformers 5), and how the report
# calls them.
_TOWERS = {"visual": "vision", "vision_tower": "vision", "vision_model": "vision",
           "multi_modal_projector": "projector", "language_model": "language model"}


def _label_towers(model, report):
    """Give each row of a vision-language model's report a ``tower`` (by its qualified name): the vision tower,
    the projector, the language model, or its LM head and loss."""
    found = _causal_lm(model)
    if found is None or not type(found[1]).__name__.endswith("ForConditionalGeneration"):
        return
    prefixes = {}
    for name, _ in model.named_modules():
        label = _TOWERS.get(name.rpartition(".")[2])
        if label and not any(name.startswith(prefix + ".") for prefix in prefixes):
            prefixes[name] = f"{label} ({name})"
    for row in report.replaced + report.skipped:
        row["tower"] = next((label for prefix, label in prefixes.items()
                             if row["name"] == prefix or row["name"].startswith(prefix + ".")),
                            "LM head and loss" if row["name"] == found[0] else "other")


def _check_flag(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"memkernels.apply({name}={value!r}): must be True or False")


def apply(model, *, norms=True, mlp=True, loss=True, rope=True, measure=True):
    """Swap the fused memkernels kernels into ``model`` in place; returns a :class:`PatchReport`.
    (``memkernels.apply(model, plan)``, which also carries out a plan, is
    :func:`memkernels.planning.apply_plan.apply`: patching never imports the planner.)

    ``model``: any nn.Module (a memkernels :class:`~memkernels.models.TransformerLM`,
    a Hugging Face model, or your own module containing nn.LayerNorm/nn.RMSNorm).
    ``norms`` / ``mlp`` / ``loss`` / ``rope``: which kinds to replace (see the module doc);
    ``mlp="recompute"`` also recomputes gated MLPs' gate and up in backward instead of saving them.
    ``measure``: for a causal LM, also measure saved bytes per token before and
    after on a meta copy (no real memory, a fraction of a second). Call it
    before wrapping the model in DDP/FSDP or ``torch.compile``.

    Raises RuntimeError naming the missing op when a fused op needed by the
    model is not available.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"memkernels.apply(model=...) needs an nn.Module, got {type(model).__name__}")
    for name, value in (("norms", norms), ("loss", loss), ("rope", rope), ("measure", measure)):
        _check_flag(name, value)
    if mlp not in (True, False, "recompute"):
        raise ValueError(f"memkernels.apply(mlp={mlp!r}): must be True, False or 'recompute'")
    report = PatchReport()
    before = None
    if measure and _lm_forward_args(model, 1) is not None:
        report.measured_tokens = min(128, _max_positions(model))
        before = _measure_or_note(model, report)
    elif measure:
        report.measure_note = "not measured (not a causal LM this function can feed; use activation_ledger)"

    actions = _plan(model, norms, mlp, loss, rope, report)
    kinds = {kind for _, kind, _ in actions}
    fused_layer_norm, fused_rms_norm = _require("norms") if "norm" in kinds else (None, None)
    fused_mlp = _require("mlp")[0] if kinds & {"mlp", "gpt2_mlp", "bert_ffn", "fc_mlp", "experts"} else None
    if kinds & {"lm_loss", "hf_loss"}:
        _require("loss")
    for name, kind, module in actions:
        before_type = type(module).__name__
        if kind == "norm":
            _set_child(model, name, _fused_norm(module, fused_layer_norm, fused_rms_norm))
        elif kind == "mlp":
            fused = fused_mlp.from_modules(module.fc1, nn.GELU(approximate=_gelu_approximation(module.act)),
                                           module.fc2)
            _set_child(model, name, fused)
        elif kind in ("gpt2_mlp", "bert_ffn"):
            act = module.act if kind == "gpt2_mlp" else module.intermediate.intermediate_act_fn
            approximate = _gelu_approximation(act)
            if approximate is None:
                report.skipped.append({"name": name, "type": before_type,
                                       "reason": f"activation {type(act).__name__} is not GELU"})
                continue
            _switch_class(module, _FusedGPT2MLP if kind == "gpt2_mlp" else _FusedBertLayer)
            module._memkernels_gelu = approximate
        elif kind == "fc_mlp":
            _switch_class(module, _FusedFcMLP)
            module._memkernels_gelu = _gelu_approximation(module.activation_fn)
        elif kind == "lm_loss":
            _set_child(model, name, CausalLMLoss())
        elif kind == "hf_loss":
            _switch_class(module, _FusedCausalLM)
            module._memkernels_loss = CausalLMLoss()
            report.notes.append(_LOSS_NOTE)
        elif kind == "gated_mlp":
            mode = _patch_gated_mlp(module, mlp == "recompute")
        elif kind == "experts":
            _patch_experts(module)
        elif kind == "rope":
            module.__class__ = _rope_class(type(module), *_rope_site(type(module)))
        after = model.get_submodule(name) if name else model
        after_type = f"{type(after).__name__} ({mode})" if kind == "gated_mlp" else type(after).__name__
        report.replaced.append({"name": name, "before": before_type, "after": after_type})
    _label_towers(model, report)
    if before is not None:
        after = _measure_or_note(model, report)
        if after is not None:
            report.bytes_per_token = {"before": before, "after": after}
    return report


def _measure_or_note(model, report):
    """Saved bytes per token on a meta copy; a model whose forward cannot run on meta gets a note instead."""
    try:
        return _saved_bytes_per_token(model, report.measured_tokens)
    except (RuntimeError, NotImplementedError, TypeError) as error:
        report.measure_note = f"not measured: the model's forward does not run on the meta device ({error})"
        return None
