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
