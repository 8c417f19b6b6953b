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
  (:data:`memkernels.fusions.norm.rule.NORM_FORMULAS`); a class that computes none of them, needs more than one
  input or holds more than its 1-D weight (and bias) is left alone and listed as
  skipped, with the reason.
- DyT (Dynamic Tanh, the norm-free transformers' stand-in for LayerNorm, switched with ``norms``): a module
  holding one learned scalar and one or two vectors (no buffers, no submodules) whose forward computes
  ``weight * tanh(alpha * x) + bias`` over the last dimension, whatever it calls them (probed once per class in
  float64) → the same module, its forward calling ``memkernels.functional.dyt`` (x saved, not tanh's output);
  names, state_dict keys and hooks unchanged. A channels-first DyT (ConvNeXt's) is listed as skipped.
- GELU MLPs: memkernels' own ``MLP`` → ``FusedMLP``; Hugging Face GPT-2's
  Conv1D MLP, BERT's intermediate/output pair and the vision towers' fc1/fc2 MLPs
  (SigLIP's, CLIP's: :data:`memkernels.fusions.gelu_mlp.rule.FC_MLPS`) → the same MLP computed with
  ``gelu_linear`` (the activated tensor is never stored).
- gated MLPs (SwiGLU / GeGLU: Llama, Mistral, Qwen2/3, Gemma 1-4, OLMo-2, Phi-3's packed
  ``gate_up_proj``, memkernels' own ``GatedMLP``) → ``gated_linear`` for the down
  projection: gate and up are saved, act(gate) * up never is. ``mlp="recompute"``
  saves only the MLP's input and recomputes gate and up in backward, a long input in
  token chunks (plain Linear projections; LoRA MLPs keep the saving variant). ``peft`` LoRA projections are
  fused too: adapters on gate/up are called as they are, the adapter on down_proj
  runs lora_A on the down projection's own c (``gated_linear(adapter=)``). Left alone, with the
  reason: quantized (bitsandbytes) or DoRA down
  projections, and LoRA dropout on down_proj (it needs the product materialized).
- mixture-of-experts experts in transformers' stacked layout (``gate_up_proj`` [E, 2*I, H],
  ``down_proj`` [E, H, I], gate first, no bias) → the same routing with the down projection as
  ``grouped_gather_mm`` (the rows gathered inside the op, not saved) and ``grouped_gated_linear`` (the routing
  weights multiplied in, so no row's output is saved for their gradient): gate_up and each row's token index
  saved per routed token, act(gate) * up never; ``mlp="recompute"``:
  ``grouped_gated_mlp_recompute``, which saves neither gate_up nor the gathered hidden states and recomputes
  both in backward. Other layouts (GPT-OSS's interleaved, Llama-4's transposed) are left alone, with the
  reason, and so are all experts with ``mlp=False`` (the report lists every mixture-of-experts layer).
- rope: an attention module whose forward calls a module-level function named like a RoPE
  (``apply_rotary_pos_emb``) that computes ``x * cos + rotate_half(x) * sin`` for q and k (probed once
  per function in float64) → the same class with that one call redirected to ``memkernels.functional.rope``
  (one kernel each way for q and k where eager runs 25 a layer; the same bytes saved: cos and sin).
  The model's module is not patched: other
  models of the family in the process keep the original. Calls the fused RoPE does not take (other
  arguments, tables that need a gradient, float64 on a GPU) run the original. Multimodal and partial
  rotary RoPEs compute another formula and are left alone.
- loss: a Hugging Face causal LM of a family in :data:`memkernels.fusions.loss.rule.CAUSAL_LM_HEADS` (its head's
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
is in ``CAUSAL_LM_HEADS``; the images go through the vision tower as before, and ``labels`` reach a
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

Each kind is one :class:`~memkernels.fusions.rule.Rule` in its fusion's folder (``fusions/<family>/rule.py``);
:data:`RULES` asks them in order, and the first that recognizes a module decides for it.
"""
import copy
import itertools

import torch
from torch import nn

from memkernels.fusions.dyt.rule import DyTRule
from memkernels.fusions.gated_mlp.rule import ExpertsRule, GatedMLPRule
from memkernels.fusions.gelu_mlp.rule import BertFeedForwardRule, FcMLPRule, GPT2MLPRule, MLPRule
from memkernels.fusions.loss.rule import CausalLMLossRule, LogitsLossRule, causal_lm
from memkernels.fusions.norm.rule import NormRule
from memkernels.fusions.rope.rule import RopeRule
from memkernels.models import TransformerLM
from memkernels.runtime.ledger import ledger_forward
from memkernels.runtime.sizes import text_table

__all__ = ["apply", "PatchReport", "RULES", "MODEL_RULES"]

# Asked of each module in this order; the first rule that recognizes a module decides for it (a norm is never
# taken for an MLP, memkernels' own MLP never for a Hugging Face one).
RULES = (NormRule(), DyTRule(), MLPRule(), GPT2MLPRule(), FcMLPRule(), BertFeedForwardRule(), ExpertsRule(), GatedMLPRule(),
         LogitsLossRule(), RopeRule())
# Asked of the model as a whole (each rule's ``locate``): a causal LM's loss is its forward's.
MODEL_RULES = (CausalLMLossRule(),)


class PatchReport:
    """What :func:`apply` did.

    ``replaced``: list of dicts ``name`` (qualified module name, ``''`` = the model),
    ``before``, ``after`` (type names; a gated MLP's adds its mode, "(saves gate, up)" or
    "(recompute)", stacked experts' "(saves gate_up)" or "(recompute)"); ``skipped``: dicts ``name``, ``type``,
    ``reason``; ``notes``: sentences on when a replacement takes effect; ``bytes_per_token``:
    ``{"before": float, "after": float}`` saved for backward per token by a training forward (measured on a meta
    copy at ``measured_tokens``), or None with ``measure_note`` saying why.
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
    if causal_lm(model) is not None:
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


# Attribute names Hugging Face's vision-language models give their towers (transformers 5), and how the report
# calls them.
_TOWERS = {"visual": "vision", "vision_tower": "vision", "vision_model": "vision",
           "multi_modal_projector": "projector", "language_model": "language model"}


def _label_towers(model, report):
    """Give each row of a vision-language model's report a ``tower`` (by its qualified name): the vision tower,
    the projector, the language model, or its LM head and loss."""
    found = causal_lm(model)
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


def _plan(model, settings, report):
    """(rule, qualified name, module) of each module to fuse, in the model's order; the modules a rule recognizes but
    leaves alone go to ``report.skipped`` with its reason. Nothing is changed yet."""
    actions = []
    rules = [rule for rule in RULES if settings[rule.option]]
    reported_off = [rule for rule in RULES if not settings[rule.option] and rule.reported_when_off]
    for name, module in model.named_modules():
        rule = next((rule for rule in rules if rule.matches(module)), None)
        if rule is not None:
            _decide(rule, name, module, actions, report)
            continue
        off = next((rule for rule in reported_off if rule.matches(module)), None)
        if off is not None:
            report.skipped.append({"name": name, "type": type(module).__name__, "reason": f"{off.option}=False"})
    for rule in MODEL_RULES:
        found = rule.locate(model) if settings[rule.option] else None
        if found is not None:
            _decide(rule, *found, actions, report)
    return actions


def _decide(rule, name, module, actions, report):
    why = rule.blocker(module)
    if why is None:
        actions.append((rule, name, module))
    else:
        report.skipped.append({"name": name, "type": type(module).__name__, "reason": why})


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
    ``mlp="recompute"`` also recomputes gated MLPs' (and stacked experts') gate and up in backward instead of saving
    them.
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

    settings = {"norms": norms, "mlp": mlp, "loss": loss, "rope": rope}
    actions = _plan(model, settings, report)
    for rule in dict.fromkeys(rule for rule, _, _ in actions):  # every op imported before any module changes
        rule.require()
    for rule, name, module in actions:
        before_type = type(module).__name__
        after_type = rule.swap(model, name, module, settings)
        after = model.get_submodule(name) if name else model
        report.replaced.append({"name": name, "before": before_type, "after": after_type or type(after).__name__})
        if rule.note and rule.note not in report.notes:
            report.notes.append(rule.note)
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
