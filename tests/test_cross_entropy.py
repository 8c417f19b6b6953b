"""memkernels cross_entropy: Triton kernel (interpreter) and PyTorch reference vs float64 eager."""
import pytest
import torch
import triton
import triton.language as tl

import memkernels
from memkernels.fusions.loss.cross_entropy import cast_rne, cross_entropy
from memkernels.fusions.loss.module import ChunkedCrossEntropyLoss
from memkernels.fusions.loss.reference import eager_cross_entropy
from memkernels.meters import SavedBytesMeter
from memkernels.testing import check_against_reference

from backends import triton_device, use_backend
from loss_cases import case_id

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REDUCTIONS = ["none", "mean", "sum"]
# Option sets: each feature alone, then all together (class weights included).
OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "softcap": {"softcap": 4.0},
    "z_loss": {"z_loss": 1e-2},
    "weight": {"weight": True},
    "combined": {"label_smoothing": 0.2, "softcap": 4.0, "z_loss": 1e-2, "weight": True},
}


def make_target(n_rows, n_classes, ignore_index=-100):
    target = torch.randint(0, n_classes, (n_rows,))
    if n_rows > 1:
        target[1] = ignore_index  # every case keeps one ignored row
    return target


def run_check(dtype, n_rows, n_classes, reduction, option_name, logit_scale=3.0):
    options = dict(OPTIONS[option_name])
    logits = (torch.randn(n_rows, n_classes) * logit_scale).to(dtype).requires_grad_()
    target = make_target(n_rows, n_classes)
    weight = torch.rand(n_classes).add(0.5).to(dtype) if options.pop("weight", False) else None

    def fn(logits, target, weight):
        # memkernels returns float32; compare in the dtype eager PyTorch returns.
        return cross_entropy(logits, target, weight=weight, reduction=reduction, **options).to(logits.dtype)

    def reference(logits, target, weight):
        if logits.dtype == torch.float16 and options.get("label_smoothing"):
            # Eager fp16 label smoothing overflows: it sums -log p over all V classes per row
            # (about V * 10 > 65504 at V = 32003, and over the rows for mean/sum) and returns
            # inf/NaN. The baseline is then eager in float32, rounded to fp16: a stricter bound.
            upcast = eager_cross_entropy(logits.float(), target, None if weight is None else weight.float(),
                                         reduction=reduction, **options)
            return upcast.to(logits.dtype)
        return eager_cross_entropy(logits, target, weight, reduction=reduction, **options)

    check_against_reference(fn, reference, (logits, target, weight), name=f"cross_entropy[{option_name}]")


# Every dtype x reduction x option at the small shapes; at the widest (more rows than a block, a vocabulary of
# several blocks and a remainder), every option in bfloat16 and, in the other dtypes, plain and all options
# together: each dtype's loads and stores at that shape, without the interpreter's seconds a case for each
# dtype x option again (issue 32: one widest case per kernel path, not per dtype x option). There, "none" and
# "mean" stand for the kernel's two scale paths (SCALE_STRIDE 1 and 0); "sum" is "mean"'s path with another
# scale, checked at every small shape.
MATCH_CASES = [(dtype, n_rows, n_classes, reduction, option_name)
               for n_rows, n_classes in [(1, 1), (4, 1), (33, 16), (64, 257)] for dtype in DTYPES
               for reduction in REDUCTIONS for option_name in OPTIONS
               if n_rows < 64 or ((dtype == torch.bfloat16 or option_name in ("plain", "combined"))
                                  and reduction != "sum")]


@pytest.mark.parametrize("dtype,n_rows,n_classes,reduction,option_name", MATCH_CASES, ids=case_id)
def test_matches_float64(backend, dtype, n_rows, n_classes, reduction, option_name):
    run_check(dtype, n_rows, n_classes, reduction, option_name)


# A real vocabulary that is not a block multiple: every reduction x option in bfloat16, each other dtype once
# with every option (a reduction changes only the gradient scale the kernel reads, one or one per row, which
# test_matches_float64 checks in every dtype).
@pytest.mark.parametrize("dtype,reduction,option_name", [
    (torch.bfloat16, reduction, option_name) for reduction in REDUCTIONS for option_name in ("plain", "combined")
] + [(dtype, "mean", "combined") for dtype in (torch.float32, torch.float16)], ids=case_id)
def test_vocab_not_a_block_multiple(backend, dtype, reduction, option_name):
    run_check(dtype, 8, 32003, reduction, option_name)


def test_three_dim_logits_and_none_reduction_shape(backend):
    logits = torch.randn(2, 3, 11, requires_grad=True)
    target = torch.randint(0, 11, (2, 3))
    loss = cross_entropy(logits, target, reduction="none")
    assert loss.shape == (2, 3)
    expected = torch.nn.functional.cross_entropy(logits.double().reshape(6, 11), target.reshape(6), reduction="none")
    torch.testing.assert_close(loss.double().reshape(6), expected)


def test_softcap_padded_lanes_do_not_leak(backend):
    # V=5 fills 5 of an 8-wide block; a mask applied before the soft-cap would add 3 lanes of
    # exp(-softcap) to the sum. Logits near -softcap make that leak a large relative error.
    logits = torch.full((2, 5), -30.0, requires_grad=True)
    target = torch.tensor([0, 4])
    loss = cross_entropy(logits, target, softcap=2.0, reduction="none")
    expected = eager_cross_entropy(logits.double(), target, softcap=2.0, reduction="none")
    torch.testing.assert_close(loss.double(), expected)
    torch.testing.assert_close(loss, torch.full((2,), torch.log(torch.tensor(5.0)).item()))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_targets_ignored_matches_pytorch(backend, reduction, label_smoothing):
    # PyTorch: mean over zero kept targets is NaN (0/0), sum and none are 0; the gradient is zero.
    logits = torch.randn(4, 9, requires_grad=True)
    logits64 = logits.detach().double().requires_grad_()
    target = torch.full((4,), -100)
    loss = cross_entropy(logits, target, reduction=reduction, label_smoothing=label_smoothing)
    expected = torch.nn.functional.cross_entropy(logits64, target, reduction=reduction,
                                                 label_smoothing=label_smoothing)
    torch.testing.assert_close(loss.double(), expected, equal_nan=True)
    loss.sum().backward()
    expected.sum().backward()
    assert torch.equal(logits.grad.double(), logits64.grad)
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_return_z_loss_is_the_z_term(backend):
    logits = torch.randn(6, 10, dtype=torch.float64)
    target = make_target(6, 10)
    loss, z = cross_entropy(logits, target, z_loss=0.1, return_z_loss=True)
    plain = cross_entropy(logits, target)
    kept = target != -100
    expected_z = 0.1 * (torch.logsumexp(logits, 1)[kept] ** 2).mean()
    torch.testing.assert_close(z.double(), expected_z, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss, plain + z)
    assert not z.requires_grad


def test_out_of_range_target_raises_on_the_cpu_reference():
    memkernels.set_backend("torch")
    try:
        with pytest.raises(ValueError, match="class id 12"):
            cross_entropy(torch.randn(3, 10), torch.tensor([1, 12, -100]))
        with pytest.raises(ValueError, match="class id -3"):
            cross_entropy(torch.randn(3, 10), torch.tensor([1, -3, 2]))
    finally:
        memkernels.set_backend("auto")


def test_out_of_range_target_gives_nan_rows_on_the_triton_path():
    # The GPU contract (no host sync): NaN loss and gradient for the bad row only.
    with use_backend("triton"):
        logits = torch.randn(3, 10, requires_grad=True)
        loss = cross_entropy(logits, torch.tensor([1, 12, -100]), reduction="none")
        assert torch.isnan(loss[1]) and torch.isfinite(loss[0]) and loss[2] == 0
        loss.sum().backward()
        assert torch.isnan(logits.grad[1]).all() and torch.isfinite(logits.grad[[0, 2]]).all()
        assert torch.isnan(cross_entropy(logits.detach(), torch.tensor([1, 10, 2])))


def test_saves_only_lse_beyond_its_inputs(backend):
    n_rows, n_classes = 8, 300
    logits = torch.randn(n_rows, n_classes, requires_grad=True) * 1.0  # non-leaf, like an LM head's output
    target = make_target(n_rows, n_classes)
    with SavedBytesMeter() as saved:
        loss = cross_entropy(logits, target, label_smoothing=0.1, z_loss=1e-3)
    assert saved.new_bytes == 8 * n_rows  # (max, log-sum) float32 pair per row; logits and target are aliased
    assert saved.aliased_bytes >= logits.numel() * 4
    loss.backward()


class TestInplaceBackward:
    def test_gradient_matches_and_logits_hold_the_gradient(self, backend):
        base = torch.randn(6, 40, requires_grad=True)
        target = make_target(6, 40)
        options = {"label_smoothing": 0.1, "softcap": 3.0, "z_loss": 1e-2}
        (cross_entropy(base * 2.0, target, **options) * 3.0).backward()
        expected = base.grad.clone()
        base.grad = None
        logits = base * 2.0
        with SavedBytesMeter() as saved:
            loss = cross_entropy(logits, target, inplace_backward=True, **options)
        assert saved.new_bytes == 0  # the gradient lives in the logits' own storage
        (loss * 3.0).backward()
        torch.testing.assert_close(base.grad, expected)
        torch.testing.assert_close(logits.detach(), expected / 2.0)  # d(loss)/d(logits) overwrote them

    def test_none_reduction_scales_each_row(self, backend):
        base = torch.randn(4, 12, requires_grad=True)
        target = make_target(4, 12)
        weights = torch.randn(4)
        (cross_entropy(base * 1.0, target, reduction="none") * weights).sum().backward()
        expected = base.grad.clone()
        base.grad = None
        (cross_entropy(base * 1.0, target, reduction="none", inplace_backward=True) * weights).sum().backward()
        torch.testing.assert_close(base.grad, expected)

    def test_refuses_what_it_cannot_overwrite_safely(self):
        leaf = torch.randn(3, 5, requires_grad=True)
        target = torch.tensor([0, 1, 2])
        with pytest.raises(ValueError, match="leaf"):
            cross_entropy(leaf, target, inplace_backward=True)
        with pytest.raises(ValueError, match="require grad"):
            cross_entropy(torch.randn(3, 5), target, inplace_backward=True)
        with pytest.raises(ValueError, match="view"):
            cross_entropy((leaf * 1.0)[:, :4], target, inplace_backward=True)

    def test_an_op_that_saved_the_logits_makes_autograd_raise(self):
        base = torch.randn(3, 5, requires_grad=True)
        logits = base * 1.0
        other = logits.sin().sum()  # sin saves its input, these logits, for its backward
        loss = cross_entropy(logits, torch.tensor([0, 1, 2]), inplace_backward=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (loss + other).backward()

    def test_second_backward_raises(self):
        logits = torch.randn(3, 5, requires_grad=True) * 1.0
        loss = cross_entropy(logits, torch.tensor([0, 1, 2]), inplace_backward=True)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("call,error,match", [
    (lambda x: cross_entropy(x, torch.zeros(4)), TypeError, "target must hold integer"),
    (lambda x: cross_entropy(x, torch.zeros(3, dtype=torch.long)), ValueError, "target has 3 elements"),
    (lambda x: cross_entropy(x, torch.zeros(4, dtype=torch.long), weight=torch.ones(3)), ValueError,
     r"weight must have shape \(7,\)"),
    (lambda x: cross_entropy(x, torch.zeros(4, dtype=torch.long), reduction="avg"), ValueError, "reduction"),
    (lambda x: cross_entropy(x, torch.zeros(4, dtype=torch.long), label_smoothing=1.5), ValueError,
     "label_smoothing"),
    (lambda x: cross_entropy(x, torch.zeros(4, dtype=torch.long), softcap=0.0), ValueError, "softcap"),
    (lambda x: cross_entropy(x, torch.zeros(4, dtype=torch.long), z_loss=-1.0), ValueError, "z_loss"),
    (lambda x: cross_entropy(x.long(), torch.zeros(4, dtype=torch.long)), TypeError, "logits"),
])
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(4, 7))


def test_module_matches_function(backend):
    logits = torch.randn(5, 13)
    target = make_target(5, 13)
    weight = torch.rand(13)
    module = ChunkedCrossEntropyLoss(weight=weight, label_smoothing=0.1, softcap=5.0, z_loss=1e-3)
    expected = cross_entropy(logits, target, weight=weight, label_smoothing=0.1, softcap=5.0, z_loss=1e-3)
    torch.testing.assert_close(module(logits, target), expected, rtol=0, atol=0)


def test_compiled_model_with_ignored_targets_matches_eager():
    # Liger PR #1338: ignore_index silently changed the compiled loss. The custom op keeps the
    # kernel whole under torch.compile; aot_eager runs dynamo + the fake impls + AOTAutograd.
    torch._dynamo.reset()
    head = torch.nn.Linear(8, 50)
    hidden = torch.randn(24, 8)
    target = torch.randint(0, 50, (24,))
    target[::3] = -100

    def model(hidden, target):
        return cross_entropy(head(hidden), target, label_smoothing=0.1, z_loss=1e-3)

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    eager_loss = model(hidden, target)
    eager_grad = torch.autograd.grad(eager_loss, head.weight)[0]
    compiled_loss = compiled(hidden, target)
    compiled_grad = torch.autograd.grad(compiled_loss, head.weight)[0]
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=0)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=0, atol=0)


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.empty(6, 100)
        target = torch.zeros(6, dtype=torch.long)
        loss, z, lse, predicted = torch.ops.memkernels.cross_entropy(logits, target, None, -100, 0.0, 0.0, 0.1,
                                                                     "none", True, "torch")
        assert loss.shape == (6,) and z.shape == (6,) and lse.shape == (6, 2) and loss.dtype == torch.float32
        assert predicted.shape == (6,) and predicted.dtype == torch.int64
        *_, unasked = torch.ops.memkernels.cross_entropy(logits, target, None, -100, 0.0, 0.0, 0.1, "none", False,
                                                         "torch")
        assert unasked.shape == (0,)


@pytest.mark.slow
def test_kernel_compiles_for_sm80_and_sm90_without_spills(aot_ops_reports):
    reports = [r for r in aot_ops_reports if r.kernel == "cross_entropy"]
    assert reports and all(not r.error for r in reports), [r.error for r in reports if r.error]
    assert {r.arch for r in reports} == {80, 90}
    spilled = [(r.variant, r.arch, r.spill_stores, r.spill_loads) for r in reports if r.spill_stores or r.spill_loads]
    assert not spilled


@pytest.mark.parametrize("option_name", ["plain", "combined"])
def test_cpu_path_works_in_row_blocks(monkeypatch, option_name):
    """The reference (CPU) path's float32 temporaries stay within a few row blocks, whatever N: the
    forward allocates no N x V tensor, the backward only the gradient it returns; same numbers as one
    block."""
    from memkernels.fusions.loss import reference
    from memkernels.meters import PeakBytesMeter

    memkernels.set_backend("torch")
    try:
        n_rows, n_classes = 240, 1000
        logits = (torch.randn(n_rows, n_classes) * 4.0).to(torch.bfloat16).requires_grad_()
        target = make_target(n_rows, n_classes)
        options = dict(OPTIONS[option_name])
        weight = torch.rand(n_classes) + 0.5 if options.pop("weight", False) else None

        def run():
            logits.grad = None
            with PeakBytesMeter() as forward:
                loss = cross_entropy(logits, target, weight=weight, **options)
            with PeakBytesMeter() as backward:
                loss.backward()
            return loss, logits.grad, forward.peak_bytes, backward.peak_bytes

        one_block = run()
        monkeypatch.setattr(reference, "BLOCK_ELEMENTS", 5 * n_classes)  # 20 blocks, the last one partial
        blocked = run()
        assert torch.equal(blocked[0], one_block[0]) and torch.equal(blocked[1], one_block[1])
        block_bytes = 5 * n_classes * 4
        full_fp32_bytes = n_rows * n_classes * 4
        assert blocked[2] <= 10 * block_bytes + 64 * n_rows < full_fp32_bytes / 2
        gradient_bytes = n_rows * n_classes * 2
        assert blocked[3] <= gradient_bytes + 10 * block_bytes + 64 * n_rows
        assert one_block[2] >= full_fp32_bytes  # at this N one block is all rows: the figure pins a change
    finally:
        memkernels.set_backend("auto")


@pytest.mark.parametrize("option_name", ["plain", "combined"])
def test_meta_walks_two_row_blocks_with_the_cpu_peak(monkeypatch, option_name):
    """On meta the reference path runs only its first two and last row blocks (a plan's meta measurement
    of a 128k vocabulary took 43 s per step walking all of them): the forward and backward peaks
    equal the CPU's walking all 20, and so do the counted FLOPs."""
    from memkernels.fusions.loss import reference
    from memkernels.meters import PeakBytesMeter
    from memkernels.planning.placement import flop_counter

    memkernels.set_backend("torch")
    monkeypatch.setattr(reference, "BLOCK_ELEMENTS", 5 * 1000)
    try:
        n_rows, n_classes = 98, 1000  # 20 blocks of 5 rows, the last one of 3
        options = dict(OPTIONS[option_name])
        use_weight = options.pop("weight", False)
        figures, walk = {}, reference.row_blocks
        for device in ("cpu", "meta"):
            logits = (torch.randn(n_rows, n_classes) * 4.0).to(torch.bfloat16).to(device).requires_grad_()
            target = make_target(n_rows, n_classes).to(device)
            weight = (torch.rand(n_classes) + 0.5).to(device) if use_weight else None
            calls = []
            monkeypatch.setattr(reference, "row_blocks", lambda x: calls.append(len(walk(x))) or walk(x))
            with flop_counter() as counter:
                with PeakBytesMeter() as forward:
                    loss = cross_entropy(logits, target, weight=weight, **options)
                with PeakBytesMeter() as backward:
                    loss.backward()
            figures[device] = (forward.peak_bytes, backward.peak_bytes, counter.get_total_flops(), calls)
        assert figures["cpu"][3] and set(figures["cpu"][3]) == {20} and set(figures["meta"][3]) == {3}
        assert figures["meta"][:3] == figures["cpu"][:3]
    finally:
        memkernels.set_backend("auto")


# float32 NaNs of every payload class and the infinities, as bits: cast_rne's bit rounding must keep
# each NaN a NaN (0x7FFFFFFF is CUDA's canonical NaN; 0x7F800001 has its payload in the low half only).
NAN_BITS = {
    "+quiet": 0x7FC00000, "-quiet": 0xFFC00000,
    "+signalling": 0x7F800001, "-signalling": 0xFF800001,
    "+max payload (CUDA's NaN)": 0x7FFFFFFF, "-max payload": 0xFFFFFFFF,
    "+signalling max payload": 0x7FBFFFFF, "-signalling max payload": 0xFFBFFFFF,
    "+quiet, low half 0x8000": 0x7FC08000,
}


def _float32_from_bits(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


@triton.jit
def _cast_rne_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # x_ptr: (n,) float32; out_ptr: (n,) bfloat16
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, cast_rne(tl.load(x_ptr + offsets, mask=mask), tl.bfloat16), mask=mask)


def _cast_rne_bfloat16(x):
    """x rounded by the kernel where Triton runs (CUDA, or the interpreter on the CPU); returned on x's device."""
    source = x.to(triton_device())
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=source.device)
    _cast_rne_kernel[(1,)](source, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return out.to(x.device)


@pytest.mark.parametrize("name", list(NAN_BITS))
def test_bfloat16_rounding_keeps_every_nan_a_nan(name):
    out = _cast_rne_bfloat16(_float32_from_bits([NAN_BITS[name]]))
    assert torch.isnan(out).all(), f"{name} NaN became {out.item()} (bits {out.view(torch.int16).item() & 0xFFFF:#06x})"
    assert (out.view(torch.int16) < 0).item() == name.startswith("-")  # the sign is kept


def test_bfloat16_rounding_of_infinities_and_finite_values_is_round_to_nearest_even():
    specials = _float32_from_bits([0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F808000, 0x3F818000,
                                   0x00000001, 0x80000000])  # +-inf, +-max (to +-inf), two ties, denormal, -0
    values = torch.cat([specials, torch.randn(1000) * 10.0 ** torch.randint(-30, 30, (1000,))])
    out = _cast_rne_bfloat16(values)
    assert torch.equal(out.view(torch.int16), values.to(torch.bfloat16).view(torch.int16))


# bfloat16 NaN logits of every payload class (the high halves of NAN_BITS) and +inf: the row's loss and
# its gradient are NaN, so a diverging run cannot look healthy. -inf is a legal logit (a masked class).
BAD_LOGITS = {"+quiet": 0x7FC0, "-quiet": 0xFFC0, "+signalling": 0x7F81, "-signalling": 0xFF81,
              "+max payload": 0x7FFF, "-max payload": 0xFFFF, "+inf": 0x7F80}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy on NaN/inf
@pytest.mark.parametrize("name", list(BAD_LOGITS))
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "z_loss": 1e-2}])
def test_nan_logits_give_nan_gradients(backend, cuda_nans, name, options):
    logits = torch.randn(4, 37).bfloat16()
    logits.view(torch.int16)[2, 5] = torch.tensor(BAD_LOGITS[name]).to(torch.int16)
    logits.requires_grad_()
    target = torch.tensor([3, 0, 9, 36])
    loss = cross_entropy(logits, target, reduction="none", **options)
    loss.sum().backward()
    assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all()
    assert torch.isnan(logits.grad[2]).all() and torch.isfinite(logits.grad[[0, 1, 3]]).all()
