"""Measure before you optimize: memory summary, activation ledger, baseline-vs-optimized evaluator.

- :func:`memory_summary`: allocated / reserved / peak bytes and fragmentation of a
  CUDA device, from PyTorch's caching allocator or memkernels' pool, with a
  warning above 30% fragmentation. On a machine without CUDA it says so.
- :func:`activation_ledger`: bytes saved for backward during one forward, per
  module, split into new (activations) and aliased (parameters, inputs). Works
  on CPU and on the ``meta`` device, where a 70B model's ledger costs nothing.
- :func:`evaluate`: peak bytes, step time and the largest batch that fits a
  budget, for a baseline and an optimized training step.
"""
import contextlib
import re
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from memkernels import allocator
from memkernels.allocator import NO_CUDA_MESSAGE
from memkernels.meters import PeakBytesMeter, SavedBytesMeter
from memkernels.tools.sizes import format_size as format_bytes  # "1.50 KiB"; the name profile's callers use

__all__ = ["memory_summary", "MemorySummary", "activation_ledger", "ActivationLedger", "evaluate",
           "EvaluationResult", "format_bytes", "CATEGORIES"]

FRAGMENTATION_WARNING = 0.30
CATEGORIES = ("embedding", "norm", "attention", "mlp", "logits/loss", "other")




def text_table(header, rows):
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


# ----------------------------------------------------------------------------- memory summary

class MemorySummary:
    """Device memory right now. ``available`` is False (with ``message``) without CUDA.

    Bytes (ints): ``allocated`` (held by live tensors), ``reserved`` (held by the
    allocator), ``peak_allocated``, ``peak_reserved``. ``fragmentation`` =
    (reserved − allocated) / reserved: the share of reserved memory no tensor uses.
    ``source``: ``'torch'`` (PyTorch's caching allocator) or ``'memkernels'`` (the pool).
    """

    def __init__(self, device, available, message="", source=None, allocated=0, reserved=0, peak_allocated=0,
                 peak_reserved=0):
        self.device, self.available, self.message, self.source = device, available, message, source
        self.allocated, self.reserved = allocated, reserved
        self.peak_allocated, self.peak_reserved = peak_allocated, peak_reserved
        self.fragmentation = (reserved - allocated) / reserved if reserved > 0 else 0.0

    @property
    def fragmented(self):
        return self.fragmentation > FRAGMENTATION_WARNING

    def to_dict(self):
        return {"device": str(self.device), "available": self.available, "message": self.message,
                "source": self.source, "allocated": self.allocated, "reserved": self.reserved,
                "peak_allocated": self.peak_allocated, "peak_reserved": self.peak_reserved,
                "fragmentation": self.fragmentation}

    def table(self):
        if not self.available:
            return self.message
        rows = [("allocated", format_bytes(self.allocated)), ("reserved", format_bytes(self.reserved)),
                ("peak allocated", format_bytes(self.peak_allocated)),
                ("peak reserved", format_bytes(self.peak_reserved)),
                ("fragmentation", f"{self.fragmentation:.1%}" + ("  (above 30%!)" if self.fragmented else ""))]
        return f"memory on {self.device} ({self.source} allocator)\n" + text_table(("", "bytes"), rows)

    __str__ = table

    def __repr__(self):
        return f"MemorySummary({self.to_dict()})"


def _memkernels_pool_stats(index):
    """The memkernels pool's stats for device ``index`` when it is PyTorch's allocator, else None."""
    try:
        from memkernels import _C
    except ImportError:  # the C++ core is not built: the pool cannot be installed
        return None
    if _C.installed_device_pool() is None:
        return None
    stats = allocator.stats(index)
    return {"allocated_bytes": stats["allocated_bytes"]["current"],
            "reserved_bytes": stats["reserved_bytes"]["current"],
            "peak_allocated_bytes": stats["allocated_bytes"]["peak"],
            "peak_reserved_bytes": stats["reserved_bytes"]["peak"]}


def _summary_from_stats(device, stats, source):
    summary = MemorySummary(device, True, source=source, allocated=stats["allocated_bytes"],
                            reserved=stats["reserved_bytes"], peak_allocated=stats["peak_allocated_bytes"],
                            peak_reserved=stats["peak_reserved_bytes"])
    if summary.fragmented:
        warnings.warn(
            f"memkernels.memory_summary: {summary.fragmentation:.0%} of the memory reserved on {device} is not "
            f"used by any tensor (fragmentation above {FRAGMENTATION_WARNING:.0%}). Large allocations may fail "
            "with memory to spare: try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or memkernels' pool "
            "allocator (memkernels.allocator.install()).", RuntimeWarning, stacklevel=3)
    return summary


def memory_summary(device=None):
    """Allocated, reserved and peak bytes and fragmentation of a CUDA device.

    ``device``: None (the current CUDA device), an int, ``'cuda:N'`` or a
    ``torch.device``. Reads memkernels' pool when it is the installed
    allocator, else PyTorch's caching allocator. Warns (RuntimeWarning) when
    fragmentation is above 30%. Without CUDA it returns a summary with
    ``available=False`` and a plain message instead of raising.
    """
    if device is not None and not isinstance(device, (int, str, torch.device)):
        raise ValueError(f"memory_summary(device={device!r}): pass None, an int, 'cuda:N' or a torch.device")
    if isinstance(device, (str, torch.device)):
        try:
            parsed = torch.device(device)
        except RuntimeError:
            raise ValueError(f"memory_summary(device={device!r}) is not a device name; use 'cuda' or 'cuda:N'") from None
        if parsed.type != "cuda":
            return MemorySummary(parsed, False, f"memory_summary: {parsed} is not a CUDA device; device memory "
                                 "is summarized for CUDA only (use activation_ledger or evaluate on the CPU).")
    if not torch.cuda.is_available():
        return MemorySummary(device, False, NO_CUDA_MESSAGE)
    index = torch.device("cuda", device).index if isinstance(device, int) else torch.cuda._utils._get_device_index(
        device, optional=True)
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"memory_summary(device={device!r}): there are {torch.cuda.device_count()} CUDA devices")
    pool = _memkernels_pool_stats(index)
    if pool is not None:
        return _summary_from_stats(torch.device("cuda", index), pool, "memkernels")
    raw = torch.cuda.memory_stats(index)
    stats = {"allocated_bytes": raw.get("allocated_bytes.all.current", 0),
             "reserved_bytes": raw.get("reserved_bytes.all.current", 0),
             "peak_allocated_bytes": raw.get("allocated_bytes.all.peak", 0),
             "peak_reserved_bytes": raw.get("reserved_bytes.all.peak", 0)}
    return _summary_from_stats(torch.device("cuda", index), stats, "torch")


# ----------------------------------------------------------------------------- activation ledger

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
    ("norm", re.compile(r"norm", re.I)),
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
        lines = [(r["name"] or "<model>", r["type"], r["category"], format_bytes(r["new_bytes"]),
                  format_bytes(r["aliased_bytes"]), r["tensors"]) for r in rows]
        lines.append(("total", "", "", format_bytes(self.new_bytes), format_bytes(self.aliased_bytes),
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


# ----------------------------------------------------------------------------- evaluator

class EvaluationResult:
    """Per step function: ``peak_bytes`` and ``step_seconds`` at ``batch_size``, and
    ``max_batch`` (largest batch whose peak fits ``budget_bytes``; 0 if none, and
    ``max_batch_capped`` when the search stopped at its upper limit)."""

    def __init__(self, budget_bytes, batch_size, results):
        self.budget_bytes, self.batch_size, self.results = budget_bytes, batch_size, results

    def __getitem__(self, name):
        return self.results[name]

    def to_dict(self):
        return {"budget_bytes": self.budget_bytes, "batch_size": self.batch_size,
                "results": {name: dict(r) for name, r in self.results.items()}}

    def table(self):
        rows = [(name, format_bytes(r["peak_bytes"]), f"{r['step_seconds'] * 1e3:.1f} ms",
                 f"{r['max_batch']}{'+' if r['max_batch_capped'] else ''}") for name, r in self.results.items()]
        return (f"peak bytes and step time at batch {self.batch_size}; largest batch within "
                f"{format_bytes(self.budget_bytes)}\n" + text_table(("step", "peak", "time", "max batch"), rows))

    __str__ = table


def _measure_step(step, batch, device_type):
    """(peak bytes above entry, seconds) of one call of ``step(batch)``; peak None on CUDA OOM."""
    if device_type == "cuda":
        counters = allocator.CudaMemoryCounters()
        torch.cuda.synchronize()
        base = counters.allocated()
        counters.reset_peak()
        start = time.perf_counter()
        try:
            step(batch)
            torch.cuda.synchronize()
        except RuntimeError as error:
            if not allocator.is_out_of_memory(error):
                raise
            return None, time.perf_counter() - start
        return counters.peak_allocated() - base, time.perf_counter() - start
    with PeakBytesMeter() as meter:
        start = time.perf_counter()
        step(batch)
        seconds = time.perf_counter() - start
    return meter.peak_bytes, seconds


def _batch_device_type(batch):
    leaves = batch if isinstance(batch, (tuple, list)) else [batch]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return "cpu"


def _largest_batch(step, make_batch, budget_bytes, max_batch):
    """Largest n ≤ max_batch whose step peak fits the budget: doubling, then bisection."""
    def fits(n):
        batch = make_batch(n)
        peak, _ = _measure_step(step, batch, _batch_device_type(batch))
        return peak is not None and peak <= budget_bytes

    if not fits(1):
        return 0
    low, high = 1, None
    while high is None:
        candidate = min(low * 2, max_batch)
        if candidate == low:
            return low
        if fits(candidate):
            low = candidate
        else:
            high = candidate
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def evaluate(baseline_step, optimized_step, *, make_batch, budget_bytes, batch_size=1, max_batch=1024,
             repeats=3):
    """Compare two training steps: peak bytes, step time, largest batch within a budget.

    ``baseline_step(batch)`` / ``optimized_step(batch)``: run one training step
    (forward, backward, optimizer) on ``batch = make_batch(n)`` (a tensor or a
    tuple of tensors of batch size ``n``). Peak bytes are the most memory the
    step allocates above what was live when it started (model and optimizer
    state are not counted): ``torch.cuda.max_memory_allocated`` on CUDA (the pool's own
    statistics once :func:`memkernels.allocator.install` made it torch's allocator), the
    live-storage tracker :class:`~memkernels.meters.PeakBytesMeter` elsewhere.
    Step time is the best of ``repeats`` runs at ``batch_size`` (after one warm-up).
    ``max_batch``: upper limit of the search (the search doubles from 1, then bisects).
    """
    for name, value in (("budget_bytes", budget_bytes), ("batch_size", batch_size), ("max_batch", max_batch),
                        ("repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"evaluate({name}={value!r}): must be a positive int")
    for name, fn in (("baseline_step", baseline_step), ("optimized_step", optimized_step),
                     ("make_batch", make_batch)):
        if not callable(fn):
            raise ValueError(f"evaluate({name}=...): must be callable, got {type(fn).__name__}")
    results = {}
    for name, step in (("baseline", baseline_step), ("optimized", optimized_step)):
        batch = make_batch(batch_size)
        device_type = _batch_device_type(batch)
        _measure_step(step, batch, device_type)  # warm-up: lazy init, caches
        measurements = [_measure_step(step, batch, device_type) for _ in range(repeats)]
        peaks = [peak for peak, _ in measurements if peak is not None]
        largest = _largest_batch(step, make_batch, budget_bytes, max_batch)
        results[name] = {"peak_bytes": max(peaks) if peaks else None,
                         "step_seconds": min(seconds for _, seconds in measurements),
                         "max_batch": largest, "max_batch_capped": largest == max_batch}
    return EvaluationResult(budget_bytes, batch_size, results)


# ----------------------------------------------------------------------------- step comparison

# Unmetered forward + backward passes whose median is a step's time in compare_steps.
TIMED_STEPS = 3


def _run_step(model, inputs, kwargs, timed_steps):
    """One forward (ledger) + backward (peak tracked), then ``timed_steps`` unmetered ones; returns loss,
    ledger, peak, the unmetered steps' median time, grads (of the metered step)."""
    model.zero_grad(set_to_none=True)
    with PeakBytesMeter() as peak:
        ledger, loss = ledger_forward(model, *inputs, **kwargs)
        loss = getattr(loss, "loss", loss)  # Hugging Face outputs carry the loss as .loss
        loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    # Timed apart from the meters: their dispatch mode sees every aten op, which costs the PyTorch reference path
    # (many small ops) up to 15x its own time. The metered step was the warm-up.
    times = []
    for _ in range(timed_steps):
        model.zero_grad(set_to_none=True)
        _synchronize(inputs)
        start = time.perf_counter()
        timed_loss = model(*inputs, **kwargs)
        getattr(timed_loss, "loss", timed_loss).backward()
        _synchronize(inputs)
        times.append(time.perf_counter() - start)
        del timed_loss
    return {"loss": float(loss.detach()), "ledger": ledger, "peak_bytes": peak.peak_bytes,
            "seconds": sorted(times)[len(times) // 2] if times else None, "grads": grads}


def _synchronize(inputs):
    devices = {t.device for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)


class StepComparison:
    """One training step (forward + backward) of a baseline and an optimized model on the same batch.

    ``baseline`` / ``optimized``: dicts with ``loss`` (float), ``ledger``
    (:class:`ActivationLedger`), ``peak_bytes`` (most memory the step allocated,
    forward and backward), ``seconds`` (the median forward + backward time of unmetered steps
    after the metered one; None when none was timed), ``grads`` ({parameter name: tensor}).
    ``loss_difference``: |Δloss|; ``max_grad_error``: the largest |Δgrad| of any
    parameter element divided by the largest |grad| of the model.
    """

    def __init__(self, baseline, optimized, device="cpu", timed_steps=TIMED_STEPS):
        self.baseline, self.optimized = baseline, optimized
        self.device, self.timed_steps = device, timed_steps
        self.loss_difference = abs(baseline["loss"] - optimized["loss"])
        missing = sorted(set(baseline["grads"]) ^ set(optimized["grads"]))
        if missing:
            raise ValueError(f"compare_steps: the models' parameters differ ({', '.join(missing[:5])}); "
                             "the optimized model must keep the baseline's parameter names")
        # Relative to the largest gradient of the model, not of each parameter: some
        # gradients are zero by symmetry (e.g. a key bias under softmax) and hold rounding noise only.
        scale = max((float(g.abs().max()) for g in baseline["grads"].values()), default=0.0)
        self.max_grad_error = max((float((g - optimized["grads"][name]).abs().max()) / scale
                                   for name, g in baseline["grads"].items()), default=0.0) if scale else 0.0

    def category_table(self):
        base, opt = self.baseline["ledger"].by_category(), self.optimized["ledger"].by_category()
        rows = []
        for category in CATEGORIES:
            if base[category] or opt[category]:
                change = (opt[category] - base[category]) / base[category] if base[category] else 0.0
                rows.append((category, format_bytes(base[category]), format_bytes(opt[category]), f"{change:+.0%}"))
        total_b, total_o = self.baseline["ledger"].new_bytes, self.optimized["ledger"].new_bytes
        rows.append(("total", format_bytes(total_b), format_bytes(total_o),
                     f"{(total_o - total_b) / total_b:+.0%}" if total_b else ""))
        return text_table(("saved for backward", "baseline", "memkernels", "change"), rows)

    def step_table(self):
        rows = [("loss", f"{self.baseline['loss']:.6f}", f"{self.optimized['loss']:.6f}",
                 f"|diff| {self.loss_difference:.2e}"),
                ("gradients", "", "", f"max rel err {self.max_grad_error:.2e}"),
                ("peak bytes (fwd+bwd)", format_bytes(self.baseline["peak_bytes"]),
                 format_bytes(self.optimized["peak_bytes"]),
                 f"{(self.optimized['peak_bytes'] - self.baseline['peak_bytes']) / self.baseline['peak_bytes']:+.0%}"),
                ]
        if self.baseline["seconds"] is not None and self.optimized["seconds"] is not None:
            rows.append((f"fwd+bwd time ({self.device_label()})", f"{self.baseline['seconds']:.3f} s",
                         f"{self.optimized['seconds']:.3f} s",
                         f"{self.optimized['seconds'] / self.baseline['seconds']:.2f}x"
                         if self.baseline["seconds"] else ""))
        return text_table(("", "baseline", "memkernels", "parity / change"), rows)

    def device_label(self):
        """What the times were measured on, for their row: "median of N, <device>"."""
        return f"median of {self.timed_steps}, {self.device}"

    def to_dict(self):
        def side(result):
            return {"loss": result["loss"], "peak_bytes": result["peak_bytes"], "seconds": result["seconds"],
                    "saved_bytes": result["ledger"].new_bytes, "by_category": result["ledger"].by_category()}
        return {"baseline": side(self.baseline), "optimized": side(self.optimized),
                "loss_difference": self.loss_difference, "max_grad_error": self.max_grad_error}


def compare_steps(baseline_model, optimized_model, *inputs, timed_steps=TIMED_STEPS, **kwargs):
    """Run one metered forward+backward of each model on ``inputs`` (saved bytes, peak, loss, gradients), then
    ``timed_steps`` unmetered ones for the time (their median); a :class:`StepComparison`.

    The models' forward must return a scalar loss (or an object with ``.loss``). ``timed_steps=0`` skips timing.
    """
    if not isinstance(timed_steps, int) or isinstance(timed_steps, bool) or timed_steps < 0:
        raise ValueError(f"compare_steps(timed_steps={timed_steps!r}): must be an int >= 0")
    devices = {t.device.type for t in inputs if isinstance(t, torch.Tensor)}
    return StepComparison(_run_step(baseline_model, inputs, kwargs, timed_steps),
                          _run_step(optimized_model, inputs, kwargs, timed_steps),
                          device=", ".join(sorted(devices)) or "cpu", timed_steps=timed_steps)
