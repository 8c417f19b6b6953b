"""The losses at the shapes of real models, for the GPU audit: cross_entropy at Llama's and Gemma's
vocabularies, linear_cross_entropy at Llama-3-8B's head in both strategies, against eager and Liger.

The audit (memkernels.audit.gpu_audit) collects this module's :func:`cases`; the contract is
memkernels/fusions/audit_case.py. Nothing here imports the audit: a training process loads none of it.
"""
import contextlib

import torch

from memkernels.fusions.audit_case import TOKENS, Case, Problem, leaf, liger


def _cross_entropy_problem(shape, dtype, impl):
    import torch.nn.functional as F
    from memkernels import functional
    n, v = shape["N"], shape["V"]
    logits = leaf(n, v, dtype=dtype)
    target = torch.arange(n) % v  # fixed: where the target sits decides whether its logit is still cached

    def forward():
        if impl == "memkernels":
            return (functional.cross_entropy(logits, target),)
        if impl == "liger":
            return (liger().transformers.LigerCrossEntropyLoss()(logits, target),)
        return (F.cross_entropy(logits.float(), target),)  # as Hugging Face upcasts the logits
    return Problem(forward, lambda outputs: outputs[0].backward())


def _cross_entropy_minimum(shape, e):
    n, v = shape["N"], shape["V"]
    return {"forward": (n * v * e + n * 8 + 4, 0), "backward": (n * v * e + n * 8 + 4 + n * v * e, 0)}


def _linear_ce_problem(strategy):
    return lambda shape, dtype, impl: _linear_ce_call(shape, dtype, impl, strategy)


def _linear_ce_call(shape, dtype, impl, strategy):
    import torch.nn.functional as F
    from memkernels import functional
    n, h, v = shape["N"], shape["H"], shape["V"]
    hidden, weight = leaf(n, h, dtype=dtype), (torch.randn(v, h) / h ** 0.5).to(dtype).requires_grad_()
    target = torch.arange(n) % v
    chunk = shape.get("C")

    def forward():
        if impl == "memkernels":
            options = {"chunk_size": -(-n // chunk)} if chunk else {}
            return (functional.linear_cross_entropy(hidden, weight, target, strategy=strategy, **options),)
        if impl == "liger":
            with _liger_linear_ce_chunks(chunk) if chunk else contextlib.nullcontext():
                return (liger().transformers.LigerFusedLinearCrossEntropyLoss()(weight, hidden, target),)
        return (F.cross_entropy((hidden @ weight.t()).float(), target),)
    return Problem(forward, lambda outputs: outputs[0].backward())


def _linear_ce_minimum(shape, e):
    n, h, v = shape["N"], shape["H"], shape["V"]
    inputs = n * h * e + v * h * e + n * 8
    # the chunked strategy computes the gradients in the forward: all three GEMMs are the op's
    return {"forward": (inputs + 4, 6 * n * h * v), "backward": (4 + n * h * e + v * h * e, 0)}


def _linear_ce_recompute_minimum(shape, e):
    n, h, v = shape["N"], shape["H"], shape["V"]
    inputs = n * h * e + v * h * e + n * 8
    # forward: the inputs, the loss, the logits GEMM; backward: the incoming gradient, the inputs again and the
    # saved (max, log-sum) pair per token, dX and dW written, their two GEMMs (the recomputed logits are extra)
    return {"forward": (inputs + 4, 2 * n * h * v),
            "backward": (4 + inputs + n * 8 + n * h * e + v * h * e, 4 * n * h * v)}


def _linear_ce_recompute_real_shape(shape, dtype, phase):
    """The real shape with C = the forward's token chunks, or the backward's vocabulary tiles (the op's rule;
    at the fitted shapes chunk_size = ceil(N / C) gives C of each)."""
    from memkernels.fusions.loss import linear_cross_entropy as lce
    n, v = shape["N"], shape["V"]
    if phase == "forward":
        return dict(shape, C=-(-n // lce.recompute_chunk_tokens(v, dtype)))
    return dict(shape, C=-(-v // lce.recompute_tile_classes(n, v, dtype)))


def _linear_ce_chunks(shape, dtype):
    """Chunks (C) that linear_cross_entropy's "chunked" strategy takes by default (no bias)."""
    from memkernels.fusions.loss import linear_cross_entropy as lce
    n, h, v = shape["N"], shape["H"], shape["V"]
    return -(-n // lce.chunked_chunk_tokens(n, h, v, dtype))


@contextlib.contextmanager
def _linear_ce_small_blocks(shape):
    """Small shapes: the dX scaling's elementwise kernel in blocks of 64 Ki elements instead of 1 Ki (the same
    loads and stores, masks honoured, in one program: with 1 Ki a program, the per-program read of the 4-byte
    scale would count cdiv(N * H, 1024) times, which is no polynomial in N and H; it hits L2 either way, so its
    HBM bytes are the same). float32 dX in one GEMM per chunk, as on a GPU (the CPU's class blocks summed in
    float64 are a CPU-only accuracy measure, see linear_cross_entropy._hidden_grad)."""
    from memkernels.fusions.loss import linear_cross_entropy as lce
    names = ("_SCALE_BLOCK", "HIDDEN_GRAD_VOCAB_BLOCK")
    original = [getattr(lce, name) for name in names]
    for name, value in zip(names, (1 << 16, 1 << 62)):
        setattr(lce, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, original):
            setattr(lce, name, value)


def _liger_linear_ce_real_shape(shape):
    """Liger's fused linear-CE at its own chunk count (the same for both of memkernels' strategies)."""
    return dict(shape, C=liger_chunk_count(shape["N"], shape["H"], shape["V"]))


def _linear_ce_real_shape(shape, dtype, phase):
    return dict(shape, C=_linear_ce_chunks(shape, dtype))


def liger_chunk_count(rows, hidden, vocab, chunk_mem_const=1):
    """Liger's fused linear-CE chunk rule (liger_kernel/ops/fused_linear_cross_entropy.py, 0.8.5): chunks of
    next_power_of_2(ceil(rows / ceil(V / (chunk_mem_const * H)))) rows, at most all of them."""
    increase = -(-vocab // (chunk_mem_const * hidden))
    size = min(1 << max(0, (-(-rows // increase) - 1).bit_length()), rows)
    return -(-rows // size)


@contextlib.contextmanager
def _liger_linear_ce_chunks(chunks):
    """Make Liger's fused linear-CE take ``chunks`` chunks at a small shape, as its own rule gives at the real
    one (32 at Llama-3-8B's head): the fit's C. Its rule sets the chunk count from V / H, which the small
    hidden sizes would turn into one-row chunks; its ``chunk_mem_const`` argument moves it."""
    from liger_kernel.ops import fused_linear_cross_entropy as flce
    original = flce.fused_linear_cross_entropy_forward

    def forward(**kwargs):  # Liger calls it with keywords only
        rows, hidden = kwargs["_input"].shape
        vocab = kwargs["weight"].shape[0]
        constants = [c for c in range(1, vocab + 1) if liger_chunk_count(rows, hidden, vocab, c) == chunks]
        if not constants:
            raise RuntimeError(f"memkernels.gpu_audit: Liger's chunk rule cannot make {chunks} chunks of {rows} rows")
        return original(**dict(kwargs, chunk_mem_const=constants[0]))
    flce.fused_linear_cross_entropy_forward = forward
    try:
        yield
    finally:
        flce.fused_linear_cross_entropy_forward = original


def _linear_logprobs_problem(shape, dtype, impl):
    """linear_logprobs at the head's shape; eager as TRL scores a completion: the logits in float32, their
    log-softmax, the target's entry gathered."""
    from memkernels import functional
    n, h, v = shape["N"], shape["H"], shape["V"]
    hidden, weight = leaf(n, h, dtype=dtype), (torch.randn(v, h) / h ** 0.5).to(dtype).requires_grad_()
    target = torch.arange(n) % v
    grad = torch.randn(n)
    chunk = shape.get("C")

    def forward():
        if impl == "memkernels":
            options = {"chunk_size": -(-n // chunk)} if chunk else {}
            return (functional.linear_logprobs(hidden, weight, target, **options),)
        logits = (hidden @ weight.t()).float()
        return (torch.log_softmax(logits, dim=-1).gather(-1, target[:, None]).squeeze(-1),)
    return Problem(forward, lambda outputs: outputs[0].backward(grad))


def _linear_logprobs_minimum(shape, e):
    n, h, v = shape["N"], shape["H"], shape["V"]
    inputs = n * h * e + v * h * e + n * 8
    # forward: the inputs, each token's float32 log-prob, the logits GEMM; backward: the incoming float32 gradient,
    # the inputs again and the saved statistics (two float32 a token), dX and dW written, their two GEMMs
    return {"forward": (inputs + n * 4, 2 * n * h * v),
            "backward": (n * 4 + inputs + n * 8 + n * h * e + v * h * e, 4 * n * h * v)}


def cases():
    """cross_entropy at three vocabularies; linear_cross_entropy at Llama-3-8B's head, each strategy;
    linear_logprobs (RL's per-token log-probs) at the same head."""
    result = []
    for v, model in ((32000, "Llama-2"), (128256, "Llama-3"), (256000, "Gemma")):
        result.append(Case("cross_entropy", f"V={v} ({model})", {"N": TOKENS, "V": v}, ("N",), {"N": (2, 4)},
                           ({"N": 5},), _cross_entropy_problem, _cross_entropy_minimum,
                           aot_kernels=("cross_entropy",), liger=True))
    # recompute fits over 2-4 vocabulary tiles: a backward with one tile takes its logsumexp from the
    # logits it recomputes (one more read of them), the real head's 55 tiles the forward's
    for strategy, chunks, minimum, real_shape in (
            ("recompute", (2, 3, 4), _linear_ce_recompute_minimum, _linear_ce_recompute_real_shape),
            ("chunked", (1, 2, 3), _linear_ce_minimum, _linear_ce_real_shape)):
        result.append(Case("linear_cross_entropy", f"Llama-3-8B head, {strategy}",
                           {"N": TOKENS, "H": 4096, "V": 128256}, ("N", "H", "C"),
                           {"N": (16, 32), "H": (16, 32), "C": chunks[:2]},
                           ({"N": 48, "H": 48, "C": chunks[2]},), _linear_ce_problem(strategy), minimum,
                           setup=_linear_ce_small_blocks, real_shape=real_shape, step_row=True,
                           liger_real_shape=_liger_linear_ce_real_shape,
                           aot_kernels=("cross_entropy", "scale_in_float32"), liger=True))
    # the same tiling as recompute's (its chunk and tile rules); Liger has no fused log-probs
    result.append(Case("linear_logprobs", "Llama-3-8B head", {"N": TOKENS, "H": 4096, "V": 128256}, ("N", "H", "C"),
                       {"N": (16, 32), "H": (16, 32), "C": (2, 3)}, ({"N": 48, "H": 48, "C": 4},),
                       _linear_logprobs_problem, _linear_logprobs_minimum, setup=_linear_ce_small_blocks,
                       real_shape=_linear_ce_recompute_real_shape, aot_kernels=("linear_logprobs",)))
    return result
