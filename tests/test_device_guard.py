"""Every Triton launcher in memkernels/fusions runs with its tensors' CUDA device current.

Triton launches on the current device and stream, so a tensor on cuda:1 with cuda:0 current
would run on the wrong GPU. No GPU here: the guard's presence is checked on the source of every
launch site, and its effect with a stand-in for ``torch.cuda.device`` and a tensor that reports
``cuda:1``.
"""
import ast
import contextlib
import glob
import os

import pytest
import torch

from memkernels.fusions.common import device_guard as _device_guard
from memkernels.fusions.common.device_guard import on_tensor_device

FUSIONS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "memkernels", "fusions")


def _launchers():
    """(file, function, decorators) of every function that launches a kernel: ``kernel[grid](...)`` in a module
    of memkernels/fusions that imports triton."""
    found = []
    for path in sorted(glob.glob(os.path.join(FUSIONS, "**", "*.py"), recursive=True)):
        with open(path) as f:
            source = f.read()
        if "import triton" not in source:  # no kernel to launch (a rule's ``modules[name](x)`` is no launch)
            continue
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript) for call in ast.walk(node)):
                found.append((os.path.relpath(path, FUSIONS), node.name, [ast.unparse(d) for d in node.decorator_list]))
    return found


def test_every_launcher_in_the_fusions_is_device_guarded():
    launchers = _launchers()
    assert len(launchers) >= 8  # norms, act-linear passes, the three losses, RoPE: as many as memkernels/ops held
    unguarded = [f"{path}:{name}" for path, name, decorators in launchers if "on_tensor_device" not in decorators]
    assert not unguarded, f"launchers without @on_tensor_device: {unguarded}"


class _OnCuda1(torch.Tensor):
    """A CPU tensor that reports cuda:1, as a tensor on the second GPU would."""

    @property
    def device(self):
        return torch.device("cuda", 1)


@pytest.fixture
def current_device(monkeypatch):
    """A stand-in for torch.cuda.device that records which device each launch ran under."""
    state = {"current": 0, "entered": []}

    @contextlib.contextmanager
    def device(target):
        previous, state["current"] = state["current"], torch.device(target).index
        state["entered"].append(state["current"])
        try:
            yield
        finally:
            state["current"] = previous

    monkeypatch.setattr(_device_guard.torch.cuda, "device", device)
    monkeypatch.setattr(_device_guard.torch.cuda, "current_device", lambda: state["current"])
    return state


def test_the_guard_makes_the_tensor_device_current(current_device):
    seen = []

    @on_tensor_device
    def launcher(scale, x, out=None):  # the first tensor argument decides, wherever it is
        seen.append(current_device["current"])
        return x

    x = torch.zeros(4).as_subclass(_OnCuda1)
    assert launcher(2.0, x) is x
    assert seen == [1] and current_device["entered"] == [1] and current_device["current"] == 0
    launcher(2.0, torch.zeros(4))  # CPU (the Triton interpreter): nothing to guard
    assert current_device["entered"] == [1] and seen == [1, 0]
    launcher(2.0, x=torch.zeros(4).as_subclass(_OnCuda1))  # keyword tensors count too
    assert current_device["entered"] == [1, 1]


def test_the_real_launchers_carry_the_guard():
    from memkernels.fusions.common import act_linear as _act_linear
    from memkernels.fusions.loss import cross_entropy
    from memkernels.fusions.loss import linear_cross_entropy
    from memkernels.fusions.norm import kernels as _norm_kernels

    for launcher in (_norm_kernels.norm_forward, _norm_kernels.norm_backward, cross_entropy._launch,
                     _act_linear._product_triton, _act_linear._product_backward_triton,
                     linear_cross_entropy._scale_triton):
        assert getattr(launcher, "device_guarded", False), launcher.__name__


def test_a_tensor_on_the_current_device_launches_without_switching(current_device):
    seen = []

    @on_tensor_device
    def launcher(x):
        seen.append(current_device["current"])
        return x

    current_device["current"] = 1
    launcher(torch.zeros(4).as_subclass(_OnCuda1))
    assert seen == [1] and current_device["entered"] == []  # no device switch, and none needed
