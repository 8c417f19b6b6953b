"""What a forward saves for backward, per module: the activation ledger.

:func:`activation_ledger`: bytes saved for backward during one forward, per module, split into new
(activations) and aliased (parameters, inputs). Works on the CPU and on the ``meta`` device, where a 70B
model's ledger costs nothing; :func:`meta_forward` makes a meta forward save what a real run saves.
"""
import contextlib
import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from memkernels.runtime.meters import SavedBytesMeter
from memkernels.runtime.sizes import format_size, text_table

__all__ = ["activation_ledger", "ActivationLedger", "ledger_forward", "meta_forward", "FlashAttentionOnMeta",
           "categorize", "CATEGORIES"]

CATEGORIES = ("embedding", "norm", "attention", "mlp", "logits/loss", "other")


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class FlashAttentionOnMeta(TorchFunctionMode):
    """Route unmasked SDPA on meta tensors to the flash kernel's op.

    On ``meta``, ``F.scaled_dot_product_attention`` picks the math fallback,
    which saves the (seq × seq) attention matrix; a GPU (and the CPU) runs a
    flash kernel that saves only q, k, v, the output and the log-sum-exp. The
    CPU flash op has a meta kernel, so calling it makes a meta forward save
    what a real run saves.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = dict(zip(_SDPA_ARGS, args), **kwargs)
            query = bound["query"]
            if query.device.type == "meta" and bound.get("attn_mask") is None:
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    query, bound["key"], bound["value"], dropout_p=bound.get("dropout_p", 0.0),
                    is_causal=bound.get("is_causal", False), scale=bound.get("scale"))[0]
        return func(*args, **kwargs)


class _GroupedMatmulOnMeta(TorchDispatchMode):
    """Let ``torch._grouped_mm`` (Hugging Face's default for mixture-of-experts experts) run on meta in any dtype.

    Its meta kernel takes bfloat16 only (torch 2.13) where the CPU and CUDA kernels take float32 too; the output's
    shape does not depend on the dtype, so other dtypes get the meta kernel's own shape rule.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].device.type == "meta" \
                and args[0].dtype != torch.bfloat16:
            from torch._meta_registrations import _create_grouped_mm_output_tensor
            bound = dict(zip(("mat_a", "mat_b", "offs", "bias", "out_dtype"), args), **kwargs)
            return _create_grouped_mm_output_tensor(bound["mat_a"], bound["mat_b"], bound.get("offs"),
                                                    bound.get("out_dtype"))
        return func(*args, **kwargs)


def _has_stacked_weights(model):
    """Whether ``model`` holds 3-D weights not in bfloat16 (stacked mixture-of-experts experts, which
    ``torch._grouped_mm`` multiplies): only then does a meta run need :class:`_GroupedMatmulOnMeta`, a dispatch
    mode every op of the run would pass through (10-20% of a profile's time)."""
    return any(p.dim() == 3 and p.is_floating_point() and p.dtype != torch.bfloat16 for p in model.parameters())


@contextlib.contextmanager
def meta_forward(model=None):
    """Make a meta forward of ``model`` save what a real run saves, and not stop on data-dependent checks.

    Hugging Face's mask code asks whether position ids describe packed sequences
    (``.all()`` on a tensor: a meta tensor has no values); the ledger's meta
    inputs are ordinary unpacked sequences, so the answer is "not packed".
    """
    import sys
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)

    def unpacked_on_meta(position_ids, *args, **kwargs):
        if position_ids.device.type == "meta":
            return None
        return original(position_ids, *args, **kwargs)

    if original is not None:
        masking.find_packed_sequence_indices = unpacked_on_meta
    try:
        grouped = _GroupedMatmulOnMeta() if model is not None and _has_stacked_weights(model) \
            else contextlib.nullcontext()
        with FlashAttentionOnMeta(), grouped:
            yield
    finally:
        if original is not None:
            masking.find_packed_sequence_indices = original


def _on_meta(model, values):
    first_parameter = next(model.parameters(), None)
    tensors = [t for t in values if isinstance(t, torch.Tensor)] + [first_parameter]
    return any(t is not None and t.device.type == "meta" for t in tensors)


_CATEGORY_RULES = (
    ("norm", re.compile(r"norm|dyt|dynamictanh", re.I)),  # DyT stands where a norm would
    ("logits/loss", re.compile(r"loss|lm_head|crossentropy|logits", re.I)),
    ("embedding", re.compile(r"embed|wte|wpe", re.I)),
    ("attention", re.compile(r"atten|attn", re.I)),
    ("mlp", re.compile(r"mlp|feedforward|ffn|intermediate|gelulinear", re.I)),
)


def categorize(name, types):
    """Category of the module ``name`` (qualified), given ``types``: {qualified name: type name}.

    The innermost module on the path from ``name`` up to the root whose type
    name or own name says norm / logits-loss / embedding / attention / MLP
    decides; a root that is a causal LM (its loss is computed at top level, as
    in Hugging Face) counts as logits/loss; anything else is ``other``.
    """
    parts = name.split(".") if name else []
    for depth in range(len(parts), 0, -1):
        type_name = types.get(".".join(parts[:depth]), "")
        for category, pattern in _CATEGORY_RULES:
            if pattern.search(type_name) or pattern.search(parts[depth - 1]):
                return category
    if not name and types.get("", "").endswith(("ForCausalLM", "LMHeadModel")):
        return "logits/loss"
    return "other"


class ActivationLedger:
    """Bytes saved for backward by one forward, per module.

    ``rows``: list of dicts ``name`` (qualified module name, ``''`` = the model
    itself), ``type``, ``category``, ``new_bytes`` (storages created in the
    forward: activations), ``aliased_bytes`` (storages that existed before:
    parameters, inputs), ``tensors`` (saved storages). A storage saved by
    several modules belongs to the first. ``records``: the meter's raw records.
    """

    def __init__(self, meter, types):
        self.records = list(meter.records)
        self.types = dict(types)
        rows = {}
        for record in self.records:
            name = record["label"] or ""
            row = rows.setdefault(name, {"name": name, "type": self.types.get(name, "?"),
                                         "category": categorize(name, self.types),
                                         "new_bytes": 0, "aliased_bytes": 0, "tensors": 0})
            row["new_bytes" if record["new"] else "aliased_bytes"] += record["nbytes"]
            row["tensors"] += 1
        self.rows = list(rows.values())

    @property
    def new_bytes(self):
        return sum(r["new_bytes"] for r in self.rows)

    @property
    def aliased_bytes(self):
        return sum(r["aliased_bytes"] for r in self.rows)

    def by_category(self, new_only=True):
        """{category: bytes} in :data:`CATEGORIES` order (new bytes only unless ``new_only=False``)."""
        totals = dict.fromkeys(CATEGORIES, 0)
        for row in self.rows:
            totals[row["category"]] += row["new_bytes"] + (0 if new_only else row["aliased_bytes"])
        return totals

    def per_token(self, num_tokens):
        """New saved bytes per token (``num_tokens`` = batch × sequence length)."""
        if not isinstance(num_tokens, int) or num_tokens <= 0:
            raise ValueError(f"per_token(num_tokens={num_tokens!r}): num_tokens must be a positive int")
        return self.new_bytes / num_tokens

    def to_dict(self):
        return {"new_bytes": self.new_bytes, "aliased_bytes": self.aliased_bytes,
                "by_category": self.by_category(), "modules": [dict(r) for r in self.rows]}

    def table(self, top=None):
        """Modules by new bytes, largest first (``top``: keep the first N rows)."""
        rows = sorted(self.rows, key=lambda r: -r["new_bytes"])[:top]
        lines = [(r["name"] or "<model>", r["type"], r["category"], format_size(r["new_bytes"]),
                  format_size(r["aliased_bytes"]), r["tensors"]) for r in rows]
        lines.append(("total", "", "", format_size(self.new_bytes), format_size(self.aliased_bytes),
                      sum(r["tensors"] for r in self.rows)))
        return text_table(("module", "type", "category", "new", "aliased", "tensors"), lines)

    __str__ = table

    def __repr__(self):
        return f"ActivationLedger(new_bytes={self.new_bytes}, aliased_bytes={self.aliased_bytes}, modules={len(self.rows)})"


@contextlib.contextmanager
def _labelled_by_module(model, meter):
    """Set ``meter.label`` to the qualified name of the innermost module running."""
    stack = []
    names = {}
    for name, module in model.named_modules():
        names.setdefault(id(module), name)

    def push(module, _args):
        stack.append(names[id(module)])
        meter.label = stack[-1]

    def pop(module, _args, _output):
        if stack:
            stack.pop()
        meter.label = stack[-1] if stack else None

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop, always_call=True))
    try:
        yield {name: type(module).__name__ for name, module in model.named_modules()}
    finally:
        for handle in handles:
            handle.remove()


def ledger_forward(model, *inputs, **kwargs):
    """Run ``model(*inputs, **kwargs)`` with grad enabled; return ``(ActivationLedger, output)``.

    For a caller that goes on to run backward on the output (the ledger alone:
    :func:`activation_ledger`).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"activation_ledger(model=...) needs an nn.Module, got {type(model).__name__}")
    meter = SavedBytesMeter()
    meta = _on_meta(model, list(inputs) + list(kwargs.values()))
    with torch.enable_grad(), meta_forward(model) if meta else contextlib.nullcontext():
        with meter, _labelled_by_module(model, meter) as types:
            output = model(*inputs, **kwargs)
    return ActivationLedger(meter, types), output


def activation_ledger(model, *inputs, **kwargs):
    """Bytes saved for backward during ``model(*inputs, **kwargs)``, per module.

    Works on any device; on ``meta`` (model built under ``torch.device('meta')``,
    meta inputs) nothing is allocated, and attention is measured as the flash
    kernel a GPU runs (q, k, v, output, log-sum-exp), not the math fallback.
    Returns an :class:`ActivationLedger` (``.table()``, ``.to_dict()``,
    ``.by_category()``).
    """
    ledger, _output = ledger_forward(model, *inputs, **kwargs)
    return ledger
