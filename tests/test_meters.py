"""Known-answer tests of the memory meters (memkernels.meters)."""
import gc
import weakref

import pytest
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from aot_example_kernels import scale_kernel
from memkernels._backend import triton_interpreted
from memkernels.meters import PeakBytesMeter, SavedBytesMeter

MB = 2**20
DEVICES = ["cpu", "meta"]


def megabytes(n, device):
    return torch.empty(n * MB, dtype=torch.uint8, device=device)


def test_storage_pyobject_lives_exactly_as_long_as_the_storage():
    """The meters' free tracking rests on this PyTorch behaviour; pin it."""
    base = torch.empty(1000)
    view = base[10:]
    died = []
    ref = weakref.ref(base.untyped_storage(), lambda _: died.append(True))
    gc.collect()
    assert ref() is not None and not died  # no Python handle left, storage alive: preserved
    del base
    gc.collect()
    assert not died  # a view still holds the storage
    del view
    assert died  # the callback runs at the free itself, no gc needed


@pytest.mark.parametrize("device", DEVICES)
def test_peak_known_answer(device):
    with PeakBytesMeter() as meter:
        a, b, c = megabytes(1, device), megabytes(1, device), megabytes(1, device)
        assert meter.current_bytes == 3 * MB
        del b
        assert meter.current_bytes == 2 * MB
        d = megabytes(2, device)
    assert meter.peak_bytes == 4 * MB
    assert meter.current_bytes == 4 * MB
    del a, c, d


@pytest.mark.parametrize("device", DEVICES)
def test_peak_ignores_preexisting_tensors_and_views(device):
    x = megabytes(3, device)
    with PeakBytesMeter() as meter:
        view = x[MB:]
        x.add_(1)
        y = x.view(3, MB)[0].clone()  # the only allocation: 1 MB
        del view
    assert meter.peak_bytes == MB
    assert meter.current_bytes == MB
    del y


def test_peak_address_reuse_is_not_double_counted():
    with PeakBytesMeter() as meter:
        for _ in range(20):  # the allocator hands back the same block each time
            t = megabytes(1, "cpu")
            del t
    assert meter.peak_bytes == MB
    assert meter.current_bytes == 0


def test_peak_counts_growth_of_an_out_tensor():
    a = torch.randn(256, 256)
    out = torch.empty(0)
    with PeakBytesMeter() as meter:
        torch.mm(a, a, out=out)  # resizes out's storage from 0 to 256 KiB
    assert meter.peak_bytes == out.untyped_storage().nbytes() == 256 * 256 * 4


class _ScratchInBothPasses(torch.autograd.Function):
    """Allocates a known scratch buffer in forward and in backward, then frees it."""

    @staticmethod
    def forward(ctx, x, forward_scratch_mb, backward_scratch_mb):
        scratch = megabytes(forward_scratch_mb, x.device)
        del scratch
        ctx.backward_scratch_mb = backward_scratch_mb
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        scratch = megabytes(ctx.backward_scratch_mb, grad.device)
        del scratch
        return grad * 2, None, None


@pytest.mark.parametrize("device", DEVICES)
def test_peak_sees_custom_function_forward_and_backward(device):
    x = torch.randn(1024, device=device, requires_grad=True)  # 4 KiB
    with PeakBytesMeter() as forward_meter:
        y = _ScratchInBothPasses.apply(x, 3, 2)
    assert forward_meter.peak_bytes == 3 * MB
    assert forward_meter.current_bytes == 4096  # y

    grad = torch.randn(1024, device=device)
    with PeakBytesMeter() as backward_meter:
        y.backward(grad)
    assert backward_meter.peak_bytes == 2 * MB
    assert backward_meter.current_bytes == 4096  # x.grad
    assert x.grad is not None


def test_peak_sees_builtin_backward():
    x = torch.randn(512, 512, requires_grad=True)
    loss = (x.exp() * 3).sum()
    with PeakBytesMeter() as meter:
        loss.backward()
    # Whatever autograd allocates on the way, x.grad (1 MiB) stays and is the largest.
    assert meter.current_bytes == x.grad.untyped_storage().nbytes() == MB
    assert meter.peak_bytes >= 2 * MB  # two 1 MiB gradients coexist in mul's/exp's backward


@pytest.mark.parametrize("device", DEVICES)
def test_saved_splits_new_from_aliased(device):
    n = 1000
    x = torch.randn(n, device=device, requires_grad=True)
    w = torch.randn(n, device=device, requires_grad=True)
    with SavedBytesMeter() as meter:
        y = x.exp()  # saves its result y (new)
        z = y * w  # saves y again (deduplicated) and w (a parameter: aliased)
    assert meter.new_bytes == 4 * n
    assert meter.aliased_bytes == 4 * n
    assert meter.total_bytes == 8 * n
    by_new = {r["new"]: r for r in meter.records}
    assert by_new[True]["saves"] == 2 and by_new[True]["shape"] == (n,)
    assert by_new[False]["dtype"] == torch.float32
    del z


class _SaveTwoViews(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        buffer = torch.empty(2 * x.numel(), dtype=x.dtype, device=x.device)
        ctx.save_for_backward(buffer[: x.numel()], buffer[x.numel():])
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors
        return grad


@pytest.mark.parametrize("device", DEVICES)
def test_saved_views_of_one_storage_count_once_in_full(device):
    x = torch.randn(10, 7, dtype=torch.float16, device=device, requires_grad=True)
    with SavedBytesMeter() as meter:
        _SaveTwoViews.apply(x)
    assert len(meter.records) == 1
    assert meter.records[0]["saves"] == 2
    assert meter.new_bytes == 2 * 70 * 2  # the whole buffer, not one view
    assert meter.aliased_bytes == 0


def test_saved_does_not_change_what_autograd_computes():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    torch.tanh(x @ w).pow(2).sum().backward()
    expected = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    with SavedBytesMeter() as meter:
        out = torch.tanh(x @ w).pow(2).sum()
        out.backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(w.grad, expected[1])
    # mm saves x and w (aliased); tanh saves its output, pow its input (the same storage).
    assert meter.aliased_bytes == x.nbytes + w.nbytes
    assert meter.new_bytes == 64 * 16 * 4


def test_saved_storage_address_reuse_is_a_new_storage():
    x = torch.randn(4096, requires_grad=True)
    with SavedBytesMeter() as meter:
        for _ in range(3):  # each step's activation dies in backward; its address gets reused
            x.exp().sum().backward()
    assert [r["new"] for r in meter.records] == [True, True, True]
    assert meter.new_bytes == 3 * 4096 * 4


def test_saved_labels_and_per_token():
    x = torch.randn(8, 16, requires_grad=True)
    with SavedBytesMeter() as meter:
        meter.label = "first"
        h = x.exp()  # saves its result (new, "first")
        meter.label = "second"
        h = h.sin()  # saves its input: already tagged "first"
        h.sin()  # saves its input (new, "second")
        meter.label = "third"
        x.sin()  # saves x (aliased, "third")
    assert meter.bytes_by_label(new_only=True) == {"first": 512, "second": 512}
    assert meter.bytes_by_label() == {"first": 512, "second": 512, "third": 512}
    assert meter.bytes_per_token(8) == 1024 / 8
    with pytest.raises(ValueError, match="num_tokens"):
        meter.bytes_per_token(0)


def test_saved_meters_nest():
    x = torch.randn(100, requires_grad=True)
    with SavedBytesMeter() as outer:
        a = x.exp()
        with SavedBytesMeter() as inner:
            b = a.sin().exp()  # sin saves `a`, exp its result
    # `a` is new to the outer meter but pre-existing for the inner one.
    assert inner.new_bytes == 400 and inner.aliased_bytes == 400
    assert outer.new_bytes == 800 and outer.aliased_bytes == 0
    del b


def test_meters_refuse_reentry():
    meter = PeakBytesMeter()
    with meter:
        with pytest.raises(RuntimeError, match="already active"):
            meter.__enter__()


class _TritonDouble(torch.autograd.Function):
    """A Triton launcher the way ops write them: allocate with torch.empty_like, launch, save."""

    @staticmethod
    def forward(ctx, x):
        out = torch.empty_like(x)
        scale_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


@pytest.mark.skipif(not triton_interpreted(), reason="runs the Triton kernel on CPU through the interpreter")
def test_meters_see_triton_launcher_allocations_only():
    x = torch.randn(1000, requires_grad=True)
    with PeakBytesMeter() as peak, SavedBytesMeter() as saved:
        y = _TritonDouble.apply(x)
    assert torch.equal(y, x.detach() * 2)
    # The interpreter's own host copies of the arguments cost nothing on CPU and are not counted.
    assert peak.peak_bytes == peak.current_bytes == 4000
    assert saved.new_bytes == 4000 and saved.aliased_bytes == 4000


@torch.library.custom_op("memkernels_test::scratch_double", mutates_args=())
def _scratch_double(x: torch.Tensor, scratch_mb: int) -> torch.Tensor:
    """x * 2, holding scratch_mb MiB of scratch while the output is allocated."""
    scratch = megabytes(scratch_mb, x.device)
    out = x * 2
    del scratch
    return out


@_scratch_double.register_fake
def _scratch_double_fake(x, scratch_mb):
    return torch.empty_like(x)


@torch.library.custom_op("memkernels_test::nested_scratch_double", mutates_args=())
def _nested_scratch_double(x: torch.Tensor, scratch_mb: int) -> torch.Tensor:
    """A custom op calling another: 1 MiB of its own scratch held around the inner op."""
    scratch = megabytes(1, x.device)
    out = _scratch_double(x, scratch_mb)
    del scratch
    return out


def test_peak_sees_allocations_inside_custom_ops():
    x = torch.randn(1024)  # 4 KiB
    with PeakBytesMeter() as meter:
        y = _scratch_double(x, 3)
    assert meter.peak_bytes == 3 * MB + 4096  # scratch and output coexist inside the op
    assert meter.current_bytes == 4096  # the output, counted once
    assert torch.equal(y, x * 2)

    with PeakBytesMeter() as nested:
        y = _nested_scratch_double(x, 2)
    assert nested.peak_bytes == MB + 2 * MB + 4096
    assert nested.current_bytes == 4096


def test_nested_meters_all_see_inside_custom_ops():
    x = torch.randn(1024, requires_grad=True)
    with PeakBytesMeter() as outer, SavedBytesMeter() as saved, PeakBytesMeter() as inner:
        y = _scratch_double(x.detach(), 3).requires_grad_().exp()  # exp saves its 4 KiB output
    assert outer.peak_bytes == inner.peak_bytes == 3 * MB + 4096
    assert outer.current_bytes == inner.current_bytes == 2 * 4096
    assert saved.new_bytes == 4096
    del y


def test_custom_op_on_meta_counts_its_outputs_once():
    x = torch.empty(1024, device="meta")
    with PeakBytesMeter() as meter:
        y = _scratch_double(x, 3)  # the fake implementation: allocates only the output
    assert meter.peak_bytes == meter.current_bytes == 4096
    del y


def test_custom_op_under_a_foreign_mode_is_one_call_that_mode_sees():
    """Skipping the Python key would hide the op from a mode below the watch; it must not."""
    x = torch.randn(1024)
    seen = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Recording(), PeakBytesMeter() as meter:
        y = _scratch_double(x, 3)
    assert torch.ops.memkernels_test.scratch_double.default in seen
    assert meter.current_bytes == 4096  # its output still counted, once
    del y
