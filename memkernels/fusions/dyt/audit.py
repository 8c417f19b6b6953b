"""DyT at a transformer's hidden sizes, for the GPU audit, against its eager form.

The audit (memkernels.audit.gpu_audit) collects this module's :func:`cases`; the contract is
memkernels/fusions/audit_case.py. Nothing here imports the audit: a training process loads none of it.

Liger-Kernel has a DyT (``liger_dyt``), but its backward sizes its grid by the device's SM count, which it asks only
of a CUDA, XPU or NPU device (on a CPU the count is never set and the call fails): it cannot be counted through the
interpreter, so the case leaves it out and benchmarks/bench_dyt.py times it beside memkernels' on a GPU.
"""
import torch

from memkernels.fusions.audit_case import TOKENS, Case, Problem, leaf


def _dyt_problem(shape, dtype, impl):
    """DyT in place of a norm: x and the parameters in one dtype, with a bias, every gradient needed."""
    from memkernels import functional
    from memkernels.fusions.dyt import reference
    n, h = shape["N"], shape["H"]
    x, weight, bias = leaf(n, h, dtype=dtype), leaf(h, dtype=dtype), leaf(h, dtype=dtype)
    alpha = torch.full((1,), 0.5).to(dtype).requires_grad_()
    grad = torch.randn(n, h).to(dtype)

    def forward():
        fn = functional.dyt if impl == "memkernels" else reference.eager
        return (fn(x, alpha, weight, bias),)
    return Problem(forward, lambda outputs: torch.autograd.backward(outputs, [grad]))


def minimum(shape, e):
    """{"forward", "backward"}: (bytes, FLOPs) each pass must move and compute, at element size ``e``."""
    n, h = shape["N"], shape["H"]
    parameters = (2 * h + 1) * e
    # forward: x and the parameters in, y out; backward: y's gradient, x and the parameters in, dx and the
    # parameters' gradients out
    return {"forward": (2 * n * h * e + parameters, 0), "backward": (3 * n * h * e + 2 * parameters, 0)}


def cases():
    """DyT at Llama-3-8B's and Llama-3-70B's hidden sizes."""
    # N: multiples of the backward's 128 rows a program, so its partial sums (a row of them per 128 rows) are
    # linear in N as the fit assumes
    return [Case("dyt", f"H={h}", {"N": TOKENS, "H": h}, ("N",), {"N": (128, 256)}, ({"N": 384},), _dyt_problem,
                 minimum, aot_kernels=("dyt_forward", "dyt_backward", "dyt_reduce")) for h in (4096, 8192)]
