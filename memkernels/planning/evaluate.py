"""Measure before you decide: two training steps side by side.

- :func:`evaluate`: peak bytes, step time and the largest batch that fits a budget, for a baseline and an
  optimized training step;
- :func:`compare_steps`: one metered forward + backward of two models on the same batch (saved bytes per
  category, peak, loss and gradient parity, time), the measured half of ``memkernels report``.
"""
import time

import torch

from memkernels.runtime import allocator
from memkernels.runtime.ledger import CATEGORIES, ledger_forward
from memkernels.runtime.meters import PeakBytesMeter
from memkernels.runtime.sizes import format_size, text_table

__all__ = ["evaluate", "EvaluationResult", "compare_steps", "StepComparison"]


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
        rows = [(name, format_size(r["peak_bytes"]), f"{r['step_seconds'] * 1e3:.1f} ms",
                 f"{r['max_batch']}{'+' if r['max_batch_capped'] else ''}") for name, r in self.results.items()]
        return (f"peak bytes and step time at batch {self.batch_size}; largest batch within "
                f"{format_size(self.budget_bytes)}\n" + text_table(("step", "peak", "time", "max batch"), rows))

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
                rows.append((category, format_size(base[category]), format_size(opt[category]), f"{change:+.0%}"))
        total_b, total_o = self.baseline["ledger"].new_bytes, self.optimized["ledger"].new_bytes
        rows.append(("total", format_size(total_b), format_size(total_o),
                     f"{(total_o - total_b) / total_b:+.0%}" if total_b else ""))
        return text_table(("saved for backward", "baseline", "memkernels", "change"), rows)

    def step_table(self):
        rows = [("loss", f"{self.baseline['loss']:.6f}", f"{self.optimized['loss']:.6f}",
                 f"|diff| {self.loss_difference:.2e}"),
                ("gradients", "", "", f"max rel err {self.max_grad_error:.2e}"),
                ("peak bytes (fwd+bwd)", format_size(self.baseline["peak_bytes"]),
                 format_size(self.optimized["peak_bytes"]),
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
