"""The device guard every Triton launcher in memkernels/fusions wears.

A Triton launch runs on the *current* CUDA device and its current stream, not on the device of
its tensors: with ``cuda:0`` current, a kernel given tensors on ``cuda:1`` would launch on the
wrong GPU (an illegal address, or silently wrong memory under UVA). ``on_tensor_device`` makes the
first tensor argument's device current for the launcher, as ``torch.cuda.device(x.device)``; on
another device type (the CPU under the Triton interpreter) it does nothing.
"""
import functools

import torch


def on_tensor_device(launcher):
    """Decorate a launcher: its first tensor argument's CUDA device is current while it runs."""

    @functools.wraps(launcher)
    def guarded(*args, **kwargs):
        # Launchers take a tensor first: look no further then (a generator costs a few microseconds).
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else next(
            (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        device = None if tensor is None else tensor.device
        # Entering torch.cuda.device costs microseconds of Python per launch; the common case, a
        # tensor on the current device, skips it.
        if device is None or device.type != "cuda" or device.index == torch.cuda.current_device():
            return launcher(*args, **kwargs)
        with torch.cuda.device(device):
            return launcher(*args, **kwargs)

    guarded.device_guarded = True
    return guarded
