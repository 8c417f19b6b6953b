"""gelu_linear at the shapes of real models (GPT-2's and Llama-3-8B's down projections), for the GPU audit.

The audit (memkernels.audit.gpu_audit) collects this module's :func:`cases`; the contract is
memkernels/fusions/audit_case.py. Nothing here imports the audit: a training process loads none of it.
"""
import torch

from memkernels.fusions.audit_case import TOKENS, Case, Problem, leaf


def _gelu_linear_problem(shape, dtype, impl):
    import torch.nn.functional as F
    from memkernels import functional
    m, k, n = shape["M"], shape["K"], shape["N"]
    x, w, b = leaf(m, k, dtype=dtype), (torch.randn(n, k) / k ** 0.5).to(dtype).requires_grad_(), leaf(n, dtype=dtype)
    grad = torch.randn(m, n).to(dtype)

    def forward():
        if impl == "memkernels":
            return (functional.gelu_linear(x, w, b),)
        return (F.linear(F.gelu(x), w, b),)
    return Problem(forward, lambda outputs: outputs[0].backward(grad))


def _gelu_linear_minimum(shape, e):
    m, k, n = shape["M"], shape["K"], shape["N"]
    inputs = m * k * e + n * k * e + n * e
    return {"forward": (inputs + m * n * e, 2 * m * n * k),
            "backward": (m * n * e + m * k * e + n * k * e + m * k * e + n * k * e + n * e, 4 * m * n * k)}


def cases():
    """gelu_linear at GPT-2's and Llama-3-8B's down projections (Liger has no such op)."""
    return [Case("gelu_linear", label, {"M": TOKENS, "K": k, "N": n}, ("M", "K", "N"),
                 {"M": (64, 128), "K": (64, 128), "N": (64, 128)}, ({"M": 192, "K": 64, "N": 192},),
                 _gelu_linear_problem, _gelu_linear_minimum,
                 aot_kernels=("act_linear_product", "act_linear_product_backward"))
            for label, k, n in (("GPT-2 MLP down 3072->768", 3072, 768),
                                ("Llama-3-8B MLP down 14336->4096", 14336, 4096))]
