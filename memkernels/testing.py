"""Compare an op with its eager reference in float64, at eager PyTorch's own accuracy.

The rule, for every output and every input gradient::

    err(x)  = max |x - float64 reference|          (elementwise, in float64)
    pass if err(fn) <= 2 * err(eager) + floor
    floor   = eps(dtype) / 2 * sqrt(K) * max |float64 reference|

with K the length of the longest floating-point sum behind the quantity, as
the test declares it (``sum_length``; 1 when not declared: one rounding).

``eager`` is the same reference function run in the inputs' own precision: the
accuracy plain PyTorch achieves in that dtype, so the tolerance follows the
dtype and the op instead of being a hand-picked number.

Why absolute error at the reference's scale, not a per-element relative one:
a per-element ratio is dominated by elements that happen to be near zero, and
eager's per-element error is exactly zero by luck far too often to be a bound.
The report also shows each error relative to max|reference| for reading.

Why the floor: in float32, eager's error can be ~0 (an op whose float32
result is the correctly rounded one), and then any different summation order
would fail. The floor is one rounding of the output dtype at the reference's
scale: rounding the float64 answer to the dtype moves it by at most
eps/2 * |value|, so the correctly rounded answer always passes. In bf16/fp16
eager's own error is typically one such rounding or more, so the floor adds
at most about half to the bound and does not make those checks vacuous
(tests/test_testing.py pins the smallest systematic error caught per dtype).
Integer and bool outputs get no floor.

Why sqrt(K): "2x eager" alone makes the verdict depend on the machine. How
accurately eager's float32 sums come out depends on the order its BLAS or
CPU kernel adds the terms in, and that differs between Intel and AMD,
AVX2 and AVX-512, and with the shape: measured on an AMD EPYC with MKL, a
length-32003 float32 GEMM sums in short blocks for 8 rows (~10 half-ulps of
max|result|) and in one running total for 1-3 rows (~100). A correct op whose
sums are ordered differently from eager's then passes on one machine and
fails on another. The floor must therefore admit the error of a length-K sum
in whatever order a correct implementation uses. In the standard
probabilistic model of rounding (Higham & Mary, SIAM J. Sci. Comput. 2019:
each rounding an independent, mean-zero relative error of at most u =
eps/2), a sum of K terms in one running total errs by about
u * sqrt(sum_j S_j**2) over its partial sums S_j; with partial sums no larger
than the result's scale that is at most u * sqrt(K) * max|result|, and a
blocked or pairwise order is below it. (The worst-case bound, K * u * sum|terms|,
is loose by about sqrt(K) for such data and would excuse anything.) Measured:
one running total of 4096 standard normals per row reaches 0.70 of this
floor at most over 30 seeds, the MKL case above 0.56-0.75 of it. It costs
detection: a systematic error of e ulps of max|reference| passes once
sqrt(K) half-ulps exceed 2e; tests/test_testing.py pins that 16 ulps still
fail at K = 256 (floor 8 ulps), while at K = 32003 the floor is 90 ulps.
Declare K only for quantities whose summation order differs from eager's
(a chunked or tiled GEMM, a kernel's own reduction); elsewhere the floor stays
one rounding.

Output gradients (drawn, or given as ``grad_outputs``) are rounded to each
output's dtype before any run, and the float64 run gets those rounded values
too. fn and eager can only receive gradients of their output's dtype; with an
unrounded float64 gradient the reference answered a slightly different
question, and the rounding of the incoming gradient (up to half an ulp of it)
became an error that fn and eager share. On an output of many elements that
shared part washes out; on a few elements eager's own roundings sometimes
cancel it by luck while fn's add to it, and a correct fn failed (measured on
linear cross-entropy with one token, float16/bfloat16: 8 of 1600 runs failed
before this rounding, 0 of 1600 after).

float32: eager's error is estimated from several runs, not one. The "2x
eager" standard is about low precision, where eager's error is large and
stable from run to run. In float32 the kernels (fp32 accumulation) and eager
are equally accurate, and ``err(eager)`` on one input is one draw of a random
quantity: with few elements its max is small by luck often enough that a
correct kernel failed 0.1-0.6% of seeds per case (~1 CI run in 10 over the
suite). So for float32 outputs and gradients::

    err(eager) = max over FLOAT32_EAGER_RUNS runs of the reference in float32:
                 the given inputs, and copies with every nonzero float input
                 moved one ulp up or down at random, each against its own
                 float64 reference

A one-ulp change is a different but equally valid input of the same size and
conditioning (the same rounding of some other real data), and it reshuffles
which intermediate values round up or down, so each run is a fresh draw of
eager's rounding error on this op at this size. Their max estimates what eager
float32 error the op can show here, instead of one lucky draw; the bound is
still twice an error plain PyTorch really made, so a systematic error past a
few float32 roundings still fails (tests/test_testing.py). What it cannot fix:
where eager's error is tiny on every rerun (measured: the RMSNorm weight
gradient at hidden size 1, whose normalized value is +-1 up to eps, ~1e-9
while one float32 rounding there is ~3e-8), an op one rounding less accurate
fails as before: that is a real one-ulp difference from eager, not noise.
Measured on correct fp32 ops (fresh seeds, both backends, small shapes):
norms 16 of 5520 checks failed with one eager run, 4 with four (3 of them the
hidden-size-1 case above); gelu_linear 6 of 1896, then 0.
Where the op's summation order differs from eager's, the float32 floor
also carries sqrt(K) (above). float16/bfloat16 rows
keep the single eager run: there eager's own error is the standard.

Quantities of few elements (at most FEW_ELEMENTS: a scalar loss, the gradient
of one token, one class or one bias), in every dtype: one value is one draw of
a handful of roundings, for fn as for eager, and their error distributions
were measured the same (CE with one class, float32, over 20,000 rows: median
0.75 vs 0.77 half-ulps, 99th percentile 6.8 vs 7.5), so a single draw of each
failed "2x eager" by luck in 0.5-1% of seeds; a sum that cancels (a bias
gradient 10x smaller than its terms) is one such value too. For these rows
fn also runs on the perturbed inputs, FEW_ELEMENTS_RUNS runs in all, float32
inputs moved by 1 to FEW_ELEMENTS_ULPS ulps (one ulp gives one logit only two
neighbours, so the reruns repeated the same rounding pattern), half inputs by
one ulp, and the rule compares worst with worst over the same inputs::

    err(fn) = max over the runs of fn's error, err(eager) = max over the same runs

A systematic error shows in every run of fn, so it still fails
(tests/test_testing.py: a scalar off by 16 float32 ulps, or 3 half ulps). Measured on
cross_entropy with one class, float32, combined options, both backends:
11 of 720 runs failed with the previous rule, 0 of 720 with this one.

Also here, for step times on the simulated device (``memkernels.device.sim``), shared by the tests and
benchmarks/bench_offload.py: :class:`ModelledKernel`, a stand-in for a kernel of a given duration on the
simulator's modelled clock, and :func:`settle_offload_copies`, which lets the simulator's copy threads finish
an OffloadActivations block's copies before modelled times are read.
"""
import math
import time
from dataclasses import dataclass, field

import torch

__all__ = ["check_against_reference", "CheckReport", "CheckRow", "FLOAT32_EAGER_RUNS", "ModelledKernel",
           "settle_offload_copies"]

# Eager float32 runs whose largest error is the float32 rows' err(eager): the given
# inputs and FLOAT32_EAGER_RUNS - 1 one-ulp perturbations (module docstring).
FLOAT32_EAGER_RUNS = 4
# Quantities this small (any dtype) are one or a few draws of rounding error: fn runs on the
# same perturbed inputs as eager, and the rule compares fn's worst with eager's worst.
FEW_ELEMENTS = 16
FEW_ELEMENTS_RUNS = 8
# ... and their perturbations move each input by up to this many ulps: one logit moved by one
# ulp has only two neighbours, so one-ulp reruns repeat the same few rounding patterns.
FEW_ELEMENTS_ULPS = 64


@dataclass
class CheckRow:
    """One compared quantity (an output or an input gradient)."""

    quantity: str  # "output[0]", "grad inputs[2]"
    dtype: torch.dtype
    shape: tuple
    err_fn: float
    err_eager: float  # float32: the largest of eager_errors
    floor: float
    scale: float  # max |float64 reference|
    sum_length: int = 1  # K: the longest sum behind the quantity, as declared by the test
    problem: str = ""  # set when the comparison could not be made (non-finite, shape, ...)
    eager_errors: tuple = ()  # float32: err(eager) of each eager run, the given inputs first
    fn_errors: tuple = ()  # float32 quantities of few elements: err(fn) on the same inputs as eager_errors

    @property
    def bound(self):
        return 2.0 * self.err_eager + self.floor

    @property
    def passed(self):
        return not self.problem and self.err_fn <= self.bound


@dataclass
class CheckReport:
    """Errors of ``fn`` and of eager PyTorch against float64, per output and gradient."""

    name: str
    rows: list = field(default_factory=list)

    @property
    def passed(self):
        return all(row.passed for row in self.rows)

    def __str__(self):
        header = f"{'quantity':<18}{'dtype':<10}{'shape':<18}{'err(fn)':>11}{'err(eager)':>11}" \
                 f"{'floor':>11}{'bound':>11}{'rel err(fn)':>13}  ok"
        lines = [f"check_against_reference({self.name}): {'passed' if self.passed else 'FAILED'}", header]
        for row in self.rows:
            dtype = str(row.dtype).replace("torch.", "")
            relative = row.err_fn / row.scale if row.scale > 0 else row.err_fn
            verdict = "ok" if row.passed else f"FAIL {row.problem}".rstrip()
            lines.append(f"{row.quantity:<18}{dtype:<10}{str(tuple(row.shape)):<18}{row.err_fn:>11.3e}"
                         f"{row.err_eager:>11.3e}{row.floor:>11.3e}{row.bound:>11.3e}{relative:>13.3e}  {verdict}")
        lines.append("rule: err = max|x - float64 reference|; pass if err(fn) <= 2*err(eager) + floor, "
                     "floor = eps(dtype)/2 * sqrt(K) * max|float64 reference|")
        declared = [f"{row.quantity} {row.sum_length}" for row in self.rows if row.sum_length != 1]
        lines.append(f"K (longest sum): {', '.join(declared)}; others 1" if declared else "K (longest sum): 1")
        if any(row.eager_errors for row in self.rows):
            runs = max(len(row.eager_errors) for row in self.rows)
            lines.append(f"float32 rows: err(eager) is the largest over {runs} eager runs (the given inputs and "
                         f"one-ulp perturbations of them); rows of <= {FEW_ELEMENTS} elements, any dtype: err(fn) "
                         "and err(eager) are their largest over the same perturbed inputs")
        return "\n".join(lines)


def _is_float(value):
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _prepare(inputs, to_float64):
    """Fresh leaf copies of the inputs for one run; floating tensors upcast if asked."""
    prepared = []
    for value in inputs:
        if not isinstance(value, torch.Tensor):
            prepared.append(value)
            continue
        copy = value.detach().clone()
        if to_float64 and copy.is_floating_point():
            copy = copy.to(torch.float64)
        prepared.append(copy.requires_grad_(value.requires_grad))
    return prepared


def _as_tuple(outputs, who):
    if isinstance(outputs, torch.Tensor):
        return (outputs,)
    if isinstance(outputs, (tuple, list)) and all(isinstance(o, torch.Tensor) or o is None for o in outputs):
        return tuple(outputs)
    raise TypeError(f"{who} must return a tensor or a tuple of tensors, got {type(outputs).__name__}")


def _max_abs_diff(value, reference):
    if value.numel() == 0:
        return 0.0
    return (value.detach().to(torch.float64) - reference.detach().to(torch.float64)).abs().max().item()


def _scale(reference):
    return reference.detach().abs().max().item() if reference.numel() else 0.0


def _compare(quantity, fn_value, eager_value, reference, sum_lengths):
    shape = tuple(reference.shape)
    dtype = fn_value.dtype if fn_value is not None else eager_value.dtype
    row = CheckRow(quantity, dtype, shape, float("nan"), float("nan"), 0.0, 0.0, sum_length=sum_lengths(quantity))
    if fn_value is None:
        row.problem = "(fn returned None)"
        return row
    if tuple(fn_value.shape) != shape:
        row.problem = f"(fn shape {tuple(fn_value.shape)} != reference shape {shape})"
        return row
    if fn_value.dtype != eager_value.dtype:
        row.problem = f"(fn dtype {fn_value.dtype} != eager dtype {eager_value.dtype})"
        return row
    non_finite = [who for who, value in (("fn", fn_value), ("eager", eager_value), ("float64 reference", reference))
                  if value.is_floating_point() and not torch.isfinite(value).all()]
    if non_finite:
        row.problem = f"(non-finite values in {', '.join(non_finite)})"
        return row
    row.scale = _scale(reference)
    row.err_fn = _max_abs_diff(fn_value, reference)
    row.err_eager = _max_abs_diff(eager_value, reference)
    if dtype.is_floating_point:
        row.floor = torch.finfo(dtype).eps / 2 * math.sqrt(row.sum_length) * row.scale
    return row


def _perturbed(inputs, ulps=1):
    """Copies of the inputs with every nonzero finite float element moved up or down at random by
    1 to ``ulps`` units in the last place (float32/float64 inputs; half inputs move by one ulp,
    already thousands of float32 ulps)."""
    perturbed = []
    for value in inputs:
        if not _is_float(value):
            perturbed.append(value)
            continue
        data = value.detach()
        spacing = torch.nextafter(data, torch.full_like(data, torch.inf)) - data
        limit = ulps if torch.finfo(data.dtype).bits >= 32 else 1
        steps = torch.randint(1, limit + 1, data.shape, device=data.device).to(data.dtype)
        sign = torch.where(torch.rand(data.shape, device=data.device) < 0.5, 1.0, -1.0).to(data.dtype)
        moved = data + sign * steps * spacing
        keep = (data == 0) | ~torch.isfinite(data)  # zeros and infinities keep their meaning
        perturbed.append(torch.where(keep, data, moved).requires_grad_(value.requires_grad))
    return perturbed


def _quantities(function, inputs, kwargs, grads64, differentiable, who, to_float64=False):
    """{quantity: value}: the outputs of ``function`` on fresh copies of ``inputs`` and, with
    ``grads64``, the gradients of the differentiable inputs."""
    run_inputs = _prepare(inputs, to_float64)
    outputs = _as_tuple(function(*run_inputs, **kwargs), who)
    quantities = {f"output[{index}]": output for index, output in enumerate(outputs)}
    if grads64 is not None:
        for input_index, gradient in zip(differentiable, _input_grads(outputs, run_inputs, grads64, who)):
            quantities[f"grad inputs[{input_index}]"] = \
                torch.zeros_like(run_inputs[input_index]) if gradient is None else gradient
    return quantities


def _widen_errors(report, fn, reference, inputs, kwargs, grads64, differentiable):
    """float32 rows: err(eager) becomes the largest over the given run and perturbed reruns. Rows of
    at most FEW_ELEMENTS elements, any dtype: err(eager) and err(fn) become their largest over the
    same FEW_ELEMENTS_RUNS inputs."""
    valid = [row for row in report.rows if not row.problem]
    few_rows = [row for row in valid if math.prod(row.shape) <= FEW_ELEMENTS]
    widened = [row for row in valid if row.dtype == torch.float32 or row in few_rows]
    for row in widened:
        row.eager_errors = (row.err_eager,)
    for row in few_rows:
        row.fn_errors = (row.err_fn,)
    reruns = FEW_ELEMENTS_RUNS if few_rows else FLOAT32_EAGER_RUNS if widened else 1
    # A rerun runs backward only when a row it widens is a gradient: a scalar loss's reruns of an
    # interpreted kernel are then forward passes alone (the same verdict at about half the cost).
    reference_grads = grads64 if any(row.quantity.startswith("grad") for row in widened) else None
    fn_grads = grads64 if any(row.quantity.startswith("grad") for row in few_rows) else None
    for _ in range(reruns - 1):
        perturbed = _perturbed(inputs, FEW_ELEMENTS_ULPS if few_rows else 1)
        eager = _quantities(reference, perturbed, kwargs, reference_grads, differentiable, "reference")
        truth = _quantities(reference, perturbed, kwargs, reference_grads, differentiable, "reference",
                            to_float64=True)
        ours = _quantities(fn, perturbed, kwargs, fn_grads, differentiable, "fn") if few_rows else {}
        for row in widened:
            error = _max_abs_diff(eager[row.quantity], truth[row.quantity])
            # A rerun that leaves the op's domain (overflow, a log of a now-negative value) says nothing of rounding.
            if error == float("inf"):
                continue
            row.eager_errors += (error,)
            if row.fn_errors:
                row.fn_errors += (_max_abs_diff(ours[row.quantity], truth[row.quantity]),)
    for row in widened:
        row.err_eager = max(row.eager_errors)
    for row in few_rows:
        row.err_fn = max(row.fn_errors)


def _grad_outputs_float64(grad_outputs, reference_outputs, eager_outputs):
    """One float64 gradient per output (None for outputs that carry no gradient), each holding values of
    the eager output's dtype: the float64 run then gets exactly the gradients fn and eager get."""
    if grad_outputs is None:
        drawn = [torch.randn(o.shape, dtype=torch.float64, device=o.device) if o is not None and o.requires_grad
                 else None for o in reference_outputs]
    else:
        drawn = _given_grad_outputs(grad_outputs, reference_outputs)
    return [None if grad is None else grad.to(eager.dtype).to(torch.float64)
            for grad, eager in zip(drawn, eager_outputs)]


def _given_grad_outputs(grad_outputs, reference_outputs):
    """The caller's grad_outputs in float64, checked against the outputs' shapes."""
    given = _as_tuple(grad_outputs, "grad_outputs")
    if len(given) != len(reference_outputs):
        raise ValueError(f"check_against_reference(grad_outputs=...): got {len(given)} gradients for "
                         f"{len(reference_outputs)} outputs; pass one per output (None for an output without one)")
    converted = []
    for index, (grad, output) in enumerate(zip(given, reference_outputs)):
        if grad is not None and tuple(grad.shape) != tuple(output.shape):
            raise ValueError(f"check_against_reference(grad_outputs=...): gradient {index} has shape "
                             f"{tuple(grad.shape)}, output {index} has shape {tuple(output.shape)}")
        converted.append(None if grad is None or output is None or not output.requires_grad
                         else grad.detach().to(torch.float64))
    return converted


def _input_grads(outputs, inputs, grads64, who):
    """Gradients of ``inputs`` (those requiring grad) given float64 output gradients cast per run."""
    pairs = []
    for index, (output, grad) in enumerate(zip(outputs, grads64)):
        if grad is None:
            continue
        if output is None or not output.requires_grad:
            raise AssertionError(f"check_against_reference: output[{index}] of {who} is not differentiable, "
                                 "but the float64 reference's is")
        pairs.append((output, grad.to(output.dtype)))
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not pairs:
        return [None] * len(leaves)
    return torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)


def _sum_lengths(sum_length):
    """quantity -> K from check_against_reference's ``sum_length`` (None, an int, or a dict)."""
    given = {} if sum_length is None else sum_length if isinstance(sum_length, dict) else {None: sum_length}
    for key, value in given.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"check_against_reference(sum_length=...): {key or 'K'} must be a positive int "
                             f"(the number of terms in the longest sum), got {value!r}")
    if not isinstance(sum_length, dict):
        return lambda quantity: given.get(None, 1)
    return lambda quantity: given.get(quantity, 1)


def check_against_reference(fn, reference, inputs, *, kwargs=None, grad=True, name=None, grad_outputs=None,
                            sum_length=None):
    """Check ``fn`` against ``reference`` at the accuracy eager PyTorch reaches in the same dtype.

    Args:
      fn: the op under test, called as ``fn(*inputs, **kwargs)``; returns a tensor
        or a tuple of tensors.
      reference: the eager implementation with the same signature. It runs twice:
        on the inputs upcast to float64 (the truth) and on the inputs as given
        (eager PyTorch's own low-precision error).
      inputs: sequence of positional arguments. Floating tensors are upcast for
        the float64 run; integer/bool tensors and non-tensors are passed
        unchanged. Every run gets fresh copies, so in-place ops cannot leak.
      kwargs: keyword arguments passed unchanged to all three runs (options such
        as ``eps``; put tensors in ``inputs``).
      grad: also compare the gradients of every input with ``requires_grad``.
      name: shown in the report (default: ``fn.__name__``).
      grad_outputs: gradients for the outputs (a tensor or tuple, any dtype);
        default: standard normal, drawn once in float64. Either way each is
        rounded to its output's dtype, and all three runs get those values.
      sum_length: K, the number of terms in the longest sum behind a quantity,
        where the op sums in another order than eager (a chunked GEMM's inner
        dimension, a kernel's row reduction): an int for every quantity, or a
        dict such as ``{"grad inputs[0]": V}`` (others 1). The floor becomes
        eps/2 * sqrt(K) * max|reference| (module docstring).

    Returns a :class:`CheckReport`. Raises AssertionError carrying the report's
    table if any output or gradient fails the rule in the module docstring or is
    non-finite.
    """
    if not callable(fn) or not callable(reference):
        raise TypeError("check_against_reference(fn, reference, ...): fn and reference must be callables")
    if isinstance(inputs, torch.Tensor) or not isinstance(inputs, (tuple, list)):
        raise TypeError("check_against_reference(inputs=...): pass a tuple or list of positional arguments, "
                        f"got {type(inputs).__name__} (wrap a single tensor as (x,))")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"check_against_reference(kwargs=...): expected a dict, got {type(kwargs).__name__}")
    kwargs = kwargs or {}
    name = name or getattr(fn, "__name__", repr(fn))
    sum_lengths = _sum_lengths(sum_length)
    differentiable = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    if grad and not differentiable:
        raise ValueError(f"check_against_reference({name}): grad=True but no input has requires_grad; "
                         "set requires_grad on the inputs whose gradients to check, or pass grad=False")

    runs = {}
    for who, function, to_float64 in (("fn", fn, False), ("eager", reference, False), ("reference", reference, True)):
        run_inputs = _prepare(inputs, to_float64)
        runs[who] = (run_inputs, _as_tuple(function(*run_inputs, **kwargs), who if who == "fn" else "reference"))

    fn_outputs, eager_outputs, ref_outputs = (runs[who][1] for who in ("fn", "eager", "reference"))
    if not len(fn_outputs) == len(eager_outputs) == len(ref_outputs):
        raise AssertionError(f"check_against_reference({name}): fn returned {len(fn_outputs)} outputs, "
                             f"the reference {len(ref_outputs)}")
    report = CheckReport(name)
    for index, (value, eager, ref) in enumerate(zip(fn_outputs, eager_outputs, ref_outputs)):
        if ref is not None:
            report.rows.append(_compare(f"output[{index}]", value, eager, ref, sum_lengths))

    grads64 = None
    if grad and not any(row.problem for row in report.rows):
        grads64 = _grad_outputs_float64(grad_outputs, ref_outputs, eager_outputs)
        grads = {who: _input_grads(runs[who][1], runs[who][0], grads64, who) for who in runs}
        for position, input_index in enumerate(differentiable):
            leaf = runs["reference"][0][input_index]
            ref_grad = grads["reference"][position]
            ref_grad = torch.zeros_like(leaf) if ref_grad is None else ref_grad
            fn_grad = grads["fn"][position]
            fn_leaf = runs["fn"][0][input_index]
            eager_grad = grads["eager"][position]
            eager_grad = torch.zeros_like(runs["eager"][0][input_index]) if eager_grad is None else eager_grad
            # fn leaving an input's gradient undefined is only right where the reference's is zero.
            fn_grad = torch.zeros_like(fn_leaf) if fn_grad is None else fn_grad
            report.rows.append(_compare(f"grad inputs[{input_index}]", fn_grad, eager_grad, ref_grad, sum_lengths))
    _widen_errors(report, fn, reference, inputs, kwargs, grads64, differentiable)
    if isinstance(sum_length, dict):
        unknown = sorted(set(sum_length) - {row.quantity for row in report.rows})
        if unknown:
            raise ValueError(f"check_against_reference(sum_length=...): no quantity named {unknown}; "
                             f"the quantities are {[row.quantity for row in report.rows]}")

    if not report.passed:
        raise AssertionError(str(report))
    return report


# ------------------------------------------------------------ modelled step times on the simulated device


class ModelledKernel(torch.autograd.Function):
    """``ModelledKernel.apply(x, seconds)``: the identity (a view of ``x``) that stands for a kernel of
    ``seconds`` in forward and twice that in backward, on the simulator's modelled clock of the compute
    stream (``memkernels.device.sim.run_kernel``); nothing runs.

    Why: on the simulated device the tensors are CPU tensors and copies take modelled link time, so a model
    built of these stand-ins has a step time that is modelled, deterministic and independent of the
    machine's load: what offloading hides behind the compute can be asserted exactly (tests/test_offload.py)
    and tabulated (benchmarks/bench_offload.py --sim). It saves nothing for backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        from memkernels.runtime.device import sim

        ctx.seconds = seconds
        sim.run_kernel(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        from memkernels.runtime.device import sim

        sim.run_kernel(2 * ctx.seconds)
        return grad, None


def settle_offload_copies(offload, timeout=None):
    """Wait, in real time only, until the simulator's copy threads have finished every device-to-host copy
    that the OffloadActivations ``offload`` issued so far, freeing the device copies; raise TimeoutError
    after ``timeout`` seconds of real time (None: no limit).

    Why: the modelled clocks do not move here, so the copies stay where the link model put them, behind the
    forward's kernels, and backward then restores each offloaded tensor over the modelled link.
    ``offload.wait_for_offloads()`` would instead make the host wait for the copies' modelled end (moving
    the host clock), and not waiting at all would let how far the threads got, i.e. the machine's load,
    decide whether an unpack reads the device copy for free: the modelled step times would depend on it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while offload.offloads_in_flight():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"the simulator's copy threads did not finish the offload copies within {timeout} s")
        time.sleep(1e-3)


# ------------------------------------------------------------ the benchmarks' pytest-benchmark entry points


def benchmark_step(benchmark, run, device):
    """Time ``run`` (one forward + backward) with pytest-benchmark's ``benchmark`` fixture on ``device``: on CUDA
    its own calibration, each round ending in ``torch.cuda.synchronize()`` so that the GPU's time is counted; on a
    CPU a fixed 10 rounds after one warm-up (on a shared CPU the calibration can ask for hundreds of slow ones)."""
    if device == "cuda":
        benchmark(lambda: (run(), torch.cuda.synchronize()))
    else:
        benchmark.pedantic(run, rounds=10, warmup_rounds=1, iterations=1)
