"""apply()'s rules for the loss: memkernels' own ``TransformerLM`` loss, and a Hugging Face causal LM of a family in
:data:`CAUSAL_LM_HEADS`, compute their loss with ``linear_cross_entropy`` from the final hidden states, in training
mode with labels; the logits are never materialized. Other families keep their loss (with the reason)."""
import dataclasses
import functools
import inspect
import typing

import torch
import torch.nn.functional as F
from torch import nn

from memkernels.distributed import layout_hooks_only, sharded_along
from memkernels.fusions.rule import Rule, missing_op, plain_reason, set_child, switch_class, unpatched_class
from memkernels.models import LogitsLoss


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


class CausalLMLoss(nn.Module):
    """Next-token cross-entropy from hidden states through the LM head, logits never materialized.

    A module (no parameters, nothing in state_dict) so that the ledger files
    its saved tensors under logits/loss. ``strategy``: the op's (``"auto"``; a plan's
    ``apply(model, plan)`` sets ``"recompute"``, the strategy the plan counted).
    """

    strategy = "auto"

    def forward(self, hidden, weight, targets, bias=None, softcap=None, num_items_in_batch=None):
        from memkernels.fusions.loss.linear_cross_entropy import linear_cross_entropy
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = linear_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=-100, reduction=reduction,
                                    softcap=softcap, strategy=self.strategy)
        if num_items_in_batch is None:
            return loss
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch


@functools.lru_cache(maxsize=None)
def _forward_signature(cls):
    """The signature of ``cls.forward`` before memkernels patched it (self included)."""
    return inspect.signature(unpatched_class(cls).forward)


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
        spec = CAUSAL_LM_HEADS[unpatched_class(type(self)).__name__]
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
            balance = inspect.getmodule(unpatched_class(type(self))).load_balancing_loss_func
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



def causal_lm(model):
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
        return (f"{family}'s head is not one memkernels knows (see memkernels.fusions.loss.rule.CAUSAL_LM_HEADS): its "
                "forward may scale, cap or add to the loss, which the fused loss would drop; its own loss is kept")
    return _head_reason(module.get_output_embeddings())


def _head_reason(head):
    """Why the fused loss may not read the LM head's weights (None when it may). A plain Linear, or one
    ``parallelize_module`` split over its classes (ColwiseParallel: weight and bias placed Shard(0) on a 1-D mesh):
    linear_cross_entropy takes those DTensors (vocabulary-parallel), and the hooks ColwiseParallel adds only lay the
    head's input and output out, which the fused loss never reads."""
    if (type(head) is nn.Linear and sharded_along(head.weight, 0) and layout_hooks_only(head)
            and (head.bias is None or sharded_along(head.bias, 0))):
        return None
    return plain_reason(head, (nn.Linear,), "lm_head")


_LOSS_NOTE = ("the fused loss runs when the model is called with labels in training mode (a plain training loop, "
              "transformers.Trainer); eval mode or skip_logits=False runs the model's own forward and returns the "
              "logits. TRL's trainers (SFTTrainer, GRPOTrainer, RLOOTrainer, DPOTrainer, KTOTrainer) do NOT use it: "
              "they replace model.forward with their own chunked LM-head scoring (fused_lm_head=True). Call "
              "memkernels.integrations.trl.patch_trainer(trainer) after building the trainer to score their tokens "
              "with memkernels' linear_logprobs; without it only the norm, MLP and RoPE replacements take effect "
              "under TRL.")


def _require_loss(option):
    try:
        import memkernels.fusions.loss.linear_cross_entropy  # noqa: F401 (CausalLMLoss calls it)
    except ImportError as error:
        raise missing_op(option, error) from error


class LogitsLossRule(Rule):
    """memkernels' own ``TransformerLM``'s ``LogitsLoss`` → :class:`CausalLMLoss`."""

    kind, option = "lm_loss", "loss"

    def matches(self, module):
        return isinstance(module, LogitsLoss)

    def require(self):
        _require_loss(self.option)

    def swap(self, model, name, module, settings):
        set_child(model, name, CausalLMLoss())


class CausalLMLossRule(Rule):
    """A Hugging Face causal LM (the model, or a peft model's base model) whose head is in :data:`CAUSAL_LM_HEADS`:
    its forward computes the loss with :class:`CausalLMLoss` when called with labels in training mode. Asked of
    the model as a whole (:meth:`locate`), not of each module: the loss is the model's forward's."""

    kind, option = "hf_loss", "loss"
    note = _LOSS_NOTE

    def locate(self, model):
        """(qualified name, module) of the causal LM whose loss this rule would fuse, or None."""
        found = causal_lm(model)
        return None if found is None or isinstance(found[1], _FusedCausalLM) else found

    def blocker(self, module):
        return _loss_blocker(module)

    def require(self):
        _require_loss(self.option)

    def swap(self, model, name, module, settings):
        switch_class(module, _FusedCausalLM)
        module._memkernels_loss = CausalLMLoss()
