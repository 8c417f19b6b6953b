"""RoPE on Llama-3-8B's q and k at real shapes, for the GPU audit, against Hugging Face's and Liger's.

The audit (memkernels.audit.gpu_audit) collects this module's :func:`cases`; the contract is
memkernels/fusions/audit_case.py. Nothing here imports the audit: a training process loads none of it.
"""
import torch

from memkernels.fusions.audit_case import TOKENS, Case, Problem, leaf


def _rope_problem(shape, dtype, impl):
    """Hugging Face's apply_rotary_pos_emb on q and k as its attention passes them (a projection's output
    viewed as [batch, seq, heads, head_dim] and transposed), with its tables (repeated halves)."""
    from memkernels import functional
    from memkernels.fusions.rope import reference
    n, q_heads, k_heads, dim = shape["N"], shape["HQ"], shape["HK"], shape["D"]
    q_base, k_base = leaf(1, n, q_heads, dim, dtype=dtype), leaf(1, n, k_heads, dim, dtype=dtype)
    angles = torch.arange(n).float()[None, :, None] * torch.rand(1, 1, dim // 2)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    grads = [torch.randn(1, q_heads, n, dim).to(dtype), torch.randn(1, k_heads, n, dim).to(dtype)]

    def forward():
        q, k = q_base.transpose(1, 2), k_base.transpose(1, 2)
        if impl == "memkernels":
            return functional.rope(q, k, cos, sin)
        if impl == "liger":
            from liger_kernel.transformers.rope import liger_rotary_pos_emb
            return liger_rotary_pos_emb(q, k, cos, sin)
        return reference.eager(q, k, cos, sin)
    return Problem(forward, lambda outputs: torch.autograd.backward(outputs, grads))


def minimum(shape, e):
    """{"forward", "backward"}: (bytes, FLOPs) each pass must move and compute, at element size ``e``."""
    heads_elements = shape["N"] * (shape["HQ"] + shape["HK"]) * shape["D"]
    # each way: q and k (or their gradients) and the two tables in, q and k (their gradients) out
    moved = (2 * heads_elements + 2 * shape["N"] * shape["D"]) * e
    return {"forward": (moved, 0), "backward": (moved, 0)}


def cases():
    """RoPE on Llama-3-8B's q and k (32 and 8 heads of 128)."""
    return [Case("rope", "Llama-3-8B q, k 32/8 heads of 128", {"N": TOKENS, "HQ": 32, "HK": 8, "D": 128}, ("N",),
                 {"N": (2, 4)}, ({"N": 5},), _rope_problem, minimum, aot_kernels=("rope",), liger=True)]
