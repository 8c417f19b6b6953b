"""gated_linear and the whole gated MLP at the shapes of real models (Llama-3-8B's SwiGLU, Gemma-2-9B's
GeGLU), for the GPU audit, against eager and Liger.

The audit (memkernels.audit.gpu_audit) collects this module's :func:`cases`; the contract is
memkernels/fusions/audit_case.py. Nothing here imports the audit: a training process loads none of it.
"""
import torch

from memkernels.fusions.audit_case import TOKENS, Case, Problem, leaf


def _gated_linear_problem(activation):
    """The part of a gated MLP that gated_linear replaces: Hugging Face's LlamaMLP is
    ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; gate_proj and up_proj run the same F.linear in both,
    so the audited computation starts from their outputs: ``down_proj(act(gate) * up)`` (no bias, as
    Llama and Gemma), eager as ``F.linear(act(gate) * up, W)``."""
    def build(shape, dtype, impl):
        import torch.nn.functional as F
        from memkernels import functional
        m, k, n = shape["M"], shape["K"], shape["N"]
        gate, up = leaf(m, k, dtype=dtype), leaf(m, k, dtype=dtype)
        w = (torch.randn(n, k) / k ** 0.5).to(dtype).requires_grad_()
        grad = torch.randn(m, n).to(dtype)

        def forward():
            if impl == "memkernels":
                return (functional.gated_linear(gate, up, w, activation=activation),)
            if impl == "liger":
                return (F.linear(_liger_gated_product(activation, gate, up), w),)
            act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
            return (F.linear(act * up, w),)
        return Problem(forward, lambda outputs: outputs[0].backward(grad))
    return build


def _gated_linear_minimum(shape, e):
    m, k, n = shape["M"], shape["K"], shape["N"]
    # forward: gate, up, W in, y out; backward: dy, gate, up, W in, d_gate, d_up, dW out
    return {"forward": ((2 * m * k + n * k + m * n) * e, 2 * m * n * k),
            "backward": ((m * n + 2 * m * k + n * k + 2 * m * k + n * k) * e, 4 * m * n * k)}


def _gated_mlp_problem(recompute):
    """A whole SwiGLU MLP, x [M, N] -> [M, N] through I = K: memkernels.FusedGatedMLP against Hugging Face's
    LlamaMLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (and Liger's LigerSwiGLUMLP), no biases."""
    def build(shape, dtype, impl):
        from torch import nn
        import torch.nn.functional as F
        import memkernels
        m, k, n = shape["M"], shape["K"], shape["N"]
        x = leaf(m, n, dtype=dtype)
        grad = torch.randn(m, n).to(dtype)
        if impl == "memkernels":
            mlp = memkernels.FusedGatedMLP(n, k, recompute=recompute, dtype=dtype)
        elif impl == "liger":
            from types import SimpleNamespace
            from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
            mlp = LigerSwiGLUMLP(SimpleNamespace(hidden_size=n, intermediate_size=k, hidden_act="silu")).to(dtype)
        else:
            linear = dict(bias=False, dtype=dtype)
            mlp = nn.Module()
            mlp.gate_proj, mlp.up_proj = nn.Linear(n, k, **linear), nn.Linear(n, k, **linear)
            mlp.down_proj = nn.Linear(k, n, **linear)
            mlp.forward = lambda h: mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))

        def forward():
            return (mlp(x),)
        return Problem(forward, lambda outputs: outputs[0].backward(grad))
    return build


def _gated_mlp_minimum(shape, e):
    m, k, n = shape["M"], shape["K"], shape["N"]
    # x and the three weights in, y out; backward: dy, x and the weights in, dx and three dW out. Keeping
    # gate and up for backward (or recomputing them) is beyond this minimum for any implementation.
    return {"forward": ((2 * m * n + 3 * n * k) * e, 6 * m * n * k),
            "backward": ((3 * m * n + 6 * n * k) * e, 12 * m * n * k)}


def _silu_mul_problem(shape, dtype, impl):
    """silu_mul alone (``F.silu(a) * b``, a gated MLP's elementwise core for callers who keep their own down
    projection), against eager's two ops and Liger's liger_swiglu."""
    import torch.nn.functional as F
    from memkernels import functional
    a, b = leaf(shape["M"], shape["K"], dtype=dtype), leaf(shape["M"], shape["K"], dtype=dtype)
    grad = torch.randn(shape["M"], shape["K"]).to(dtype)

    def forward():
        if impl == "memkernels":
            return (functional.silu_mul(a, b),)
        if impl == "liger":
            return (_liger_gated_product("silu", a, b),)
        return (F.silu(a) * b,)
    return Problem(forward, lambda outputs: outputs[0].backward(grad))


def _silu_mul_minimum(shape, e):
    elements = shape["M"] * shape["K"]
    # forward: a and b in, c out; backward: dc, a and b in, da and db out
    return {"forward": (3 * elements * e, 0), "backward": (5 * elements * e, 0)}


def _liger_gated_product(activation, gate, up):
    from liger_kernel.transformers.functional import liger_geglu, liger_swiglu
    return (liger_swiglu if activation == "silu" else liger_geglu)(gate, up)


def cases():
    """gated_linear (SwiGLU, GeGLU-tanh), the whole gated MLP, kept and recomputed, and silu_mul alone."""
    kernels = ("act_linear_product", "act_linear_product_backward")
    fit = dict(variables=("M", "K", "N"), fit_values={"M": (64, 128), "K": (64, 128), "N": (64, 128)},
               check_values=({"M": 192, "K": 64, "N": 192},), aot_kernels=kernels, liger=True)
    result = [Case("gated_linear", label, {"M": TOKENS, "K": k, "N": n}, build=_gated_linear_problem(activation),
                   minimum=_gated_linear_minimum, **fit)
              for label, k, n, activation in (("Llama-3-8B SwiGLU 14336->4096", 14336, 4096, "silu"),
                                              ("Gemma-2-9B GeGLU-tanh 14336->3584", 14336, 3584, "gelu_tanh"))]
    result += [Case("gated_mlp", "Llama-3-8B MLP " + ("recompute=True" if recompute else "H=4096 I=14336"),
                    {"M": TOKENS, "K": 14336, "N": 4096}, build=_gated_mlp_problem(recompute),
                    minimum=_gated_mlp_minimum, **fit)
               for recompute in (False, True)]
    result.append(Case("silu_mul", "Llama-3-8B's I=14336", {"M": TOKENS, "K": 14336}, ("M", "K"),
                       {"M": (64, 128), "K": (64, 128)}, ({"M": 192, "K": 64},), _silu_mul_problem,
                       _silu_mul_minimum, aot_kernels=kernels, liger=True))
    return result
