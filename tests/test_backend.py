"""Backend selection: MEMKERNELS_BACKEND / set_backend and the per-tensor resolution."""
import subprocess
import sys

import pytest
import torch

from memkernels import _backend


@pytest.fixture
def restore_backend():
    saved = _backend.get_backend()
    yield
    _backend.set_backend(saved)


def test_auto_runs_reference_on_cpu(restore_backend):
    _backend.set_backend("auto")
    assert _backend.resolve(torch.zeros(1), "op") == "torch"
    assert _backend.resolve(torch.zeros(1, device="meta"), "op") == "torch"


def test_torch_is_always_reference(restore_backend):
    _backend.set_backend("torch")
    assert _backend.resolve(torch.zeros(1), "op") == "torch"


def test_forced_triton_on_cpu(restore_backend, monkeypatch):
    _backend.set_backend("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _backend.resolve(torch.zeros(1), "op") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _backend.resolve(torch.zeros(1), "rms_norm")


def test_unknown_backend_is_rejected(restore_backend):
    with pytest.raises(ValueError, match="set_backend.*'cuda'.*auto, triton, torch"):
        _backend.set_backend("cuda")


def test_environment_variable_is_read_and_validated():
    code = "import memkernels; print(memkernels.get_backend())"
    ok = subprocess.run([sys.executable, "-c", code], env={"MEMKERNELS_BACKEND": "TORCH", "PATH": ""},
                        capture_output=True, text=True)
    assert ok.stdout.strip() == "torch", ok.stderr
    bad = subprocess.run([sys.executable, "-c", code], env={"MEMKERNELS_BACKEND": "gpu", "PATH": ""},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "MEMKERNELS_BACKEND='gpu'" in bad.stderr


def test_triton_fixture_puts_tensors_where_the_kernels_run():
    """The op tests' "triton" backend makes its tensors on CUDA with a GPU, on the CPU under the
    interpreter: either way the forced backend accepts them (a CPU tensor on a GPU machine would
    make every kernel test raise instead of running on the GPU)."""
    import torch

    from backends import triton_device, use_backend
    from memkernels._backend import resolve
    with use_backend("triton"):
        tensor = torch.empty(1)
        assert tensor.device.type == triton_device()
        assert resolve(tensor, "test") == "triton"
    assert torch.empty(1).device.type == "cpu"


def _calls():
    """Every public op of memkernels.functional, called on small CPU (or meta) tensors with a given backend=."""
    from memkernels import functional as mf

    def tensors(device):
        torch.manual_seed(0)
        x = torch.randn(4, 8, device=device)
        weight = torch.randn(6, 8, device=device)
        target = torch.zeros(4, dtype=torch.long, device=device)
        q, k = torch.randn(1, 2, 4, 8, device=device), torch.randn(1, 2, 4, 8, device=device)
        cos, sin = torch.randn(1, 4, 8, device=device), torch.randn(1, 4, 8, device=device)
        return x, weight, target, q, k, cos, sin

    return {
        "rms_norm": lambda d, b: mf.rms_norm(tensors(d)[0], backend=b),
        "add_rms_norm": lambda d, b: mf.add_rms_norm(tensors(d)[0], tensors(d)[0], backend=b),
        "layer_norm": lambda d, b: mf.layer_norm(tensors(d)[0], backend=b),
        "add_layer_norm": lambda d, b: mf.add_layer_norm(tensors(d)[0], tensors(d)[0], backend=b),
        "gelu_linear": lambda d, b: mf.gelu_linear(tensors(d)[0], tensors(d)[1], backend=b),
        "gated_linear": lambda d, b: mf.gated_linear(tensors(d)[0], tensors(d)[0], tensors(d)[1], backend=b),
        "silu_mul": lambda d, b: mf.silu_mul(tensors(d)[0], tensors(d)[0], backend=b),
        "cross_entropy": lambda d, b: mf.cross_entropy(tensors(d)[0], tensors(d)[2], backend=b),
        "linear_cross_entropy": lambda d, b: mf.linear_cross_entropy(tensors(d)[0], tensors(d)[1], tensors(d)[2],
                                                                     backend=b),
        "linear_logprobs": lambda d, b: mf.linear_logprobs(tensors(d)[0], tensors(d)[1], tensors(d)[2], backend=b),
        "rope": lambda d, b: mf.rope(*tensors(d)[3:], backend=b),
        "dyt": lambda d, b: mf.dyt(tensors(d)[0], tensors(d)[0][0, :1], tensors(d)[0][0], backend=b),
    }


@pytest.mark.parametrize("op", sorted(_calls()))
def test_every_op_takes_the_same_backend_argument(op, restore_backend):
    """One backend= on every public op, resolved in one place (memkernels._backend.resolve): "torch" runs the
    reference, an unknown name and "triton" where Triton cannot run are errors naming the argument and the fix."""
    call = _calls()[op]
    _backend.set_backend("auto")
    call("cpu", "torch")
    with pytest.raises(ValueError, match=f"{op}: backend='cuda' is not supported; use None"):
        call("cpu", "cuda")
    with pytest.raises(ValueError, match=f"{op}: backend='triton' cannot run on meta tensors.*use backend='torch'"):
        call("meta", "triton")
