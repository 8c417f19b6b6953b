"""memkernels.audit.gpu_audit: exact counts per op at one small shape, and the counter itself.

The pins are derived element by element in the comments: an extra tl.load, a float32 matmul on
half inputs or a host sync in any op changes a pinned number and fails here.
"""
import subprocess

import pytest
import torch
import triton
import triton.language as tl

import memkernels
from memkernels.audit import gpu_audit
from memkernels.fusions.dyt import audit as dyt_audit
from memkernels.fusions.loss import audit as loss_audit
from memkernels.fusions.rope import audit as rope_audit

pytestmark = pytest.mark.skipif(not memkernels._backend.triton_interpreted(),
                                reason="counts Triton kernels through the interpreter")

CASES = {}
for _case in gpu_audit.cases():
    if _case.op != "linear_cross_entropy":
        CASES.setdefault(_case.op, _case)  # an op's first case: gated_linear's SwiGLU
# linear-CE is audited per strategy: {"chunked": case, "recompute": case}
LINEAR_CE = {case.label.rsplit(" ", 1)[-1]: case for case in gpu_audit.cases() if case.op == "linear_cross_entropy"}


def _measure(op, dtype=torch.bfloat16, **shape):
    case = LINEAR_CE[op.split(":")[1]] if op.startswith("linear_cross_entropy:") else CASES[op]
    return gpu_audit.measure(case, shape, dtype)


def _matmuls(counts):
    return [(x.name, x.hbm_bytes, x.flops, x.matmul_dtypes) for x in counts.launches if x.matmul_dtypes]


def _triton(counts):
    launches = [x for x in counts.launches if x.kind == "triton"]
    return (len(launches), sum(x.requested_bytes for x in launches), sum(x.hbm_bytes for x in launches))


def _aten(counts):
    return sorted(x.name for x in counts.launches if x.kind == "aten" and x.hbm_bytes)


def test_rms_norm_counts():
    n, h, p, e = 4, 64, 2, 2
    run = _measure("rms_norm", N=n, H=h, P=p)
    # forward: x, the weight once per row, y, rstd (fp32); the weight's re-reads stay in L2
    assert _triton(run["forward"]) == (1, 3 * n * h * e + n * 4, 2 * n * h * e + h * e + n * 4)
    assert _aten(run["forward"]) == []
    # backward, two launches and no aten op (no zero fills: ctx.set_materialize_grads(False)):
    # 1. dy and x per row, the weight once per program (held across its rows; from L2 after the
    #    first: counted once), rstd, dx, and each program's float32 dw partial row, written once;
    # 2. the partials read once, dw written in the weight's dtype
    partials = p * h * 4
    requested = (2 * n * h * e + p * h * e + n * h * e + n * 4 + partials) + (partials + h * e)
    assert _triton(run["backward"]) == (2, requested, requested - (p - 1) * h * e)
    assert _aten(run["backward"]) == []
    assert len(run["backward"].launches) == 2
    assert run["forward"].syncs == run["backward"].syncs == []


def test_layer_norm_counts():
    n, h, p, e = 4, 64, 2, 2
    run = _measure("layer_norm", N=n, H=h, P=p)
    # forward: x, weight and bias per row, y, mean and rstd
    assert _triton(run["forward"]) == (1, 4 * n * h * e + 2 * n * 4, 2 * n * h * e + 2 * h * e + 2 * n * 4)
    partials = 2 * p * h * 4  # dw and db
    # as RMSNorm's (weight once per program), plus the mean; one reduction launch for dw and db
    requested = (2 * n * h * e + p * h * e + n * h * e + 2 * n * 4 + partials) + (partials + 2 * h * e)
    assert _triton(run["backward"]) == (2, requested, requested - (p - 1) * h * e)
    assert len(run["backward"].launches) == 2


def test_layer_norm_rows_up_to_8192_read_once():
    """LayerNorm rows of 4096 < H <= 8192 a multiple of 16 wide (one register-resident block with
    the weight and the dw/db sums): x and dy are read once, and each program writes its dw/db
    partial rows once."""
    n, h, p, e = 131, 4112, 2, 2
    run = _measure("layer_norm", N=n, H=h, P=p)
    stats = 2 * n * 4  # fp32 mean and rstd, one of each per row
    partial_rows = 2 * h * 4  # dw and db
    # per row: x and dy, mean and rstd; dx out; per program: the weight, the partial rows
    requested = 2 * n * h * e + stats + n * h * e + p * h * e + p * partial_rows
    hbm = 2 * n * h * e + h * e + stats + n * h * e + p * partial_rows
    reduction = p * partial_rows + 2 * h * e
    assert _triton(run["backward"]) == (2, requested + reduction, hbm + reduction)
    assert _aten(run["backward"]) == []


def test_layer_norm_wide_rows_write_each_partial_once():
    """Rows wider than the widest block (8192) take two passes; the dw/db partials stay in
    registers per column chunk (4096 wide) and are written once, not read and written per row."""
    n, h, p, e, chunks = 4, 8200, 2, 2, 3
    run = _measure("layer_norm", N=n, H=h, P=p)
    stats = 2 * n * 4  # fp32 mean and rstd, one of each per row
    # pass 1, per row: the weight, x and dy over all chunks, mean and rstd; stores the two row sums
    first = 3 * n * h * e + stats + 2 * n * 4
    # pass 2, per chunk: the weight once per program; per chunk and row: x, dy, mean and rstd, the two
    # row sums; dx out; then each program's dw and db partials once
    partials = 2 * p * h * 4
    second = 2 * n * h * e + p * h * e + chunks * stats + chunks * 2 * n * 4 + n * h * e + partials
    # the reduction: the partials once, dw and db out
    assert _triton(run["backward"])[:2] == (2, first + second + partials + 2 * h * e)
    assert _aten(run["backward"]) == []


def test_eager_layer_norm_backward_is_two_cuda_kernels():
    """PyTorch's CUDA native_layer_norm_backward: a grad-input kernel and a gamma/beta kernel, each
    reading dy and x (layer_norm_kernel.cu, LayerNormBackwardKernelImplInternal)."""
    case = CASES["layer_norm"]
    n, h, e = case.shape["N"], case.shape["H"], 2
    kernels = gpu_audit.exact(case, torch.bfloat16)["backward"].kernels
    stats = 2 * n * 4  # fp32 mean and rstd
    assert {name: k["hbm"] for (_, name), k in kernels.items()} == {
        "layer_norm_grad_input_kernel": 3 * n * h * e + stats + h * e,  # dy, x, gamma in; dx out
        "GammaBetaBackwardCUDAKernel": 2 * n * h * e + stats + 2 * h * e,  # dy, x in; dgamma, dbeta out
    }


def test_add_rms_norm_counts():
    n, h, p, e = 4, 64, 2, 2
    run = _measure("add_rms_norm", N=n, H=h, P=p)
    # forward: x, residual, the weight per row; y, residual_out, rstd
    assert _triton(run["forward"]) == (1, 5 * n * h * e + n * 4, 4 * n * h * e + h * e + n * 4)


def test_cross_entropy_counts():
    n, v, e = 3, 100, 2
    run = _measure("cross_entropy", N=n, V=v)
    # forward: the target, the row of logits, the target's logit (still cached), ce and the
    # two-float logsumexp per row
    requested = n * 8 + n * v * e + n * e + n * 4 + n * 8
    assert _triton(run["forward"]) == (1, requested, requested - n * e)
    # float64: per row a block of 128 widened exp terms (padded lanes compute too), plus 9 scalar
    # float64 operations (widenings, rescale, logsumexp, the loss)
    assert run["forward"].flops("fp64") == n * 128 + n * 9
    # backward: target, logsumexp and scale per row, the logits read again, the gradient written
    requested = n * 8 + n * 8 + n * 4 + n * v * e + n * v * e
    assert _triton(run["backward"])[:2] == (1, requested)
    assert run["forward"].syncs == run["backward"].syncs == []
    assert run["forward"].matmul_dtypes == run["backward"].matmul_dtypes == []
    # The small launches beside the kernel (4 us each in the model, of a 550 us step at V = 32000):
    # forward, the kept targets' count, the float64 sum of the rows and the mean; backward, the
    # count again and the incoming gradient over it. No fill for the logsumexp's and the z-term's
    # gradients, no ones for a denominator "mean" does not use, no z scale without a z-loss.
    assert [x.name for x in run["forward"].launches] == ["_cross_entropy_kernel", "ne", "sum", "sum", "div",
                                                         "_to_copy"]
    assert [x.name for x in run["backward"].launches] == ["ones_like", "ne", "sum", "div", "_to_copy",
                                                          "_cross_entropy_kernel"]  # ones_like: the engine's


def test_gelu_linear_counts():
    m = k = n = 64  # tokens, in_features (the activated width), out_features
    e = 2
    run = _measure("gelu_linear", M=m, K=k, N=n)
    # forward: one elementwise pass reads x and writes gelu(x); cuBLAS's addmm reads gelu(x), W and the
    # bias and writes y. One bf16 GEMM of 2*M*N*K.
    assert _triton(run["forward"]) == (1, 2 * m * k * e, 2 * m * k * e)
    assert _matmuls(run["forward"]) == [("addmm", (m * k + n * k + n + m * n) * e, {"bf16": 2 * m * n * k},
                                         (("bf16", "bf16"),))]
    # backward: g = dY @ W (dY, W in, g out); one pass reads g and x and writes dX and gelu(x) over g;
    # dW = dY^T @ gelu(x) (dY, gelu(x) in, dW out); the bias gradient one sum (float32 accumulation inside)
    assert [x.name for x in run["backward"].launches] == ["mm", "_product_backward_kernel", "mm", "sum"]
    assert _triton(run["backward"]) == (1, 4 * m * k * e, 4 * m * k * e)
    assert [(name, hbm) for name, hbm, _, _ in _matmuls(run["backward"])] == [
        ("mm", (m * n + n * k + m * k) * e), ("mm", (m * n + m * k + n * k) * e)]
    assert run["backward"].flops() == run["backward"].flops("bf16") == 4 * m * n * k
    assert {dtypes for _, dtypes in run["backward"].matmul_dtypes} == {("bf16", "bf16")}
    assert run["forward"].syncs == run["backward"].syncs == []


def test_rope_counts():
    n, q_heads, k_heads, dim, e = 4, 4, 2, 8, 2
    run = _measure("rope", N=n, HQ=q_heads, HK=k_heads, D=dim)
    # each way one launch: q and k (their gradients) read once and written once, both tables read once a
    # position (both halves: the kernel does not assume Hugging Face's repeated halves); no aten op, no copy
    # of the gradients (they come laid out as q_proj's output), the minimum
    moved = (2 * n * (q_heads + k_heads) * dim + 2 * n * dim) * e
    for phase in ("forward", "backward"):
        assert [x.name for x in run[phase].launches] == ["_rope_kernel"]
        assert _triton(run[phase]) == (1, moved, moved)
        assert rope_audit.minimum({"N": n, "HQ": q_heads, "HK": k_heads, "D": dim}, e)[phase] == (moved, 0)
    assert run["forward"].syncs == run["backward"].syncs == []
    # eager (Hugging Face's formula): 10 launches forward, 16 backward (the copy back into q_proj's layout is
    # the transpose's backward, outside the audited function)
    eager = gpu_audit.measure(CASES["rope"], {"N": n, "HQ": q_heads, "HK": k_heads, "D": dim}, torch.bfloat16,
                              impl="eager")
    assert (len(eager["forward"].launches), len(eager["backward"].launches)) == (10, 16)


def test_dyt_counts():
    n, h, e = 4, 64, 2
    run = _measure("dyt", N=n, H=h)
    parameters = (2 * h + 1) * e  # weight, bias, alpha
    # forward: one launch reading x and the parameters, writing y: the minimum
    assert [x.name for x in run["forward"].launches] == ["_dyt_forward_kernel"]
    assert _triton(run["forward"]) == (1, 2 * n * h * e + parameters, 2 * n * h * e + parameters)
    assert dyt_audit.minimum({"N": n, "H": h}, e)["forward"][0] == 2 * n * h * e + parameters
    # backward: x and y's gradient in, dx out, one float32 partial row each of dw and db and one alpha partial per
    # (program, column block); then one launch summing them into the parameters' gradients. No aten op.
    partials = 2 * h * 4 + 4
    moved = (3 * n * h * e + h * e + e + partials) + (partials + parameters)
    assert [x.name for x in run["backward"].launches] == ["_dyt_backward_kernel", "_dyt_reduce_kernel"]
    assert _triton(run["backward"]) == (2, moved, moved)
    assert run["forward"].syncs == run["backward"].syncs == []
    # eager (DyT's own module): 4 launches forward, 8 backward
    eager = gpu_audit.measure(CASES["dyt"], {"N": n, "H": h}, torch.bfloat16, impl="eager")
    assert (len(eager["forward"].launches), len(eager["backward"].launches)) == (4, 8)


def test_silu_mul_counts():
    m, k, e = 4, 64, 2
    run = _measure("silu_mul", M=m, K=k)
    # one pass each way at the minimum: a, b in and c out; dc, a, b in and da, db out (the product recomputed)
    assert [x.name for x in run["forward"].launches] == ["_product_kernel"]
    assert _triton(run["forward"]) == (1, 3 * m * k * e, 3 * m * k * e)
    assert [x.name for x in run["backward"].launches] == ["_product_backward_kernel"]
    assert _triton(run["backward"]) == (1, 5 * m * k * e, 5 * m * k * e)
    assert run["forward"].syncs == run["backward"].syncs == []
    eager = gpu_audit.measure(CASES["silu_mul"], {"M": m, "K": k}, torch.bfloat16, impl="eager")
    assert (len(eager["forward"].launches), len(eager["backward"].launches)) == (2, 3)


def test_gated_linear_counts():
    m = k = n = 64  # tokens, intermediate (the width of gate and up), hidden
    e = 2
    run = _measure("gated_linear", M=m, K=k, N=n)
    # forward: one pass reads gate and up and writes the product (3 I-wide tensors), which cuBLAS reads
    # with W to write y; the product is freed at once. One bf16 GEMM of 2*M*N*K.
    assert _triton(run["forward"]) == (1, 3 * m * k * e, 3 * m * k * e)
    assert _matmuls(run["forward"]) == [("mm", (m * k + n * k + m * n) * e, {"bf16": 2 * m * n * k},
                                         (("bf16", "bf16"),))]
    # backward: g = dY @ W; one pass reads g, gate and up and writes d_gate, d_up and the product over g
    # (6 I-wide tensors); dW = dY.T @ product. No aten op but the two GEMMs.
    assert [x.name for x in run["backward"].launches] == ["mm", "_product_backward_kernel", "mm"]
    assert _triton(run["backward"]) == (1, 6 * m * k * e, 6 * m * k * e)
    assert [(name, hbm) for name, hbm, _, _ in _matmuls(run["backward"])] == [
        ("mm", (m * n + n * k + m * k) * e), ("mm", (m * n + m * k + n * k) * e)]
    assert run["backward"].flops() == run["backward"].flops("bf16") == 4 * m * n * k
    assert {dtypes for _, dtypes in run["forward"].matmul_dtypes + run["backward"].matmul_dtypes} == {
        ("bf16", "bf16")}
    assert run["forward"].syncs == run["backward"].syncs == []


def test_gated_linear_eager_sequence_counts():
    """What gated_linear is compared with: Hugging Face's ``down_proj(act(gate) * up)``, op by op."""
    m = k = n = 64
    e = 2
    eager = gpu_audit.measure(CASES["gated_linear"], dict(M=m, K=k, N=n), torch.bfloat16, "eager")
    # forward: silu reads gate, writes act; mul reads act and up, writes the product; mm reads it and W
    assert [(x.name, x.hbm_bytes) for x in eager["forward"].launches] == [
        ("silu", 2 * m * k * e), ("mul", 3 * m * k * e), ("mm", (m * k + n * k + m * n) * e)]
    # backward: dW and d(product) GEMMs, d_up = d * act, d_act = d * up, silu_backward(d_act, gate)
    assert sorted(x.name for x in eager["backward"].launches) == ["mm", "mm", "mul", "mul", "silu_backward"]
    assert eager["backward"].hbm_bytes == (2 * (m * n + m * k + n * k) + 3 * 3 * m * k) * e


def test_gated_mlp_counts():
    """FusedGatedMLP: the gate and up projections are aten GEMMs around gated_linear's passes and GEMMs."""
    m = k = n = 64  # tokens, intermediate, hidden
    e = 2
    plain, recompute = (gpu_audit.measure(case, dict(M=m, K=k, N=n), torch.bfloat16)
                        for case in gpu_audit.cases() if case.op == "gated_mlp")
    projection = (m * n + k * n + m * k) * e  # x and W in, gate (or up) out
    down = (m * k + n * k + m * n) * e  # the product and W in, y out
    assert [(x.name, x.hbm_bytes) for x in plain["forward"].launches if x.kind == "aten"] == [
        ("mm", projection)] * 2 + [("mm", down)]
    assert _triton(plain["forward"])[:2] == (1, 3 * m * k * e)
    # backward: gated_linear's pass and two GEMMs (test_gated_linear_counts), then per projection a dx and a
    # dW GEMM, and the two dx summed
    assert _triton(plain["backward"])[:2] == (1, 6 * m * k * e)
    assert _aten(plain["backward"]) == ["add"] + ["mm"] * 6
    assert (plain["forward"].flops("bf16"), plain["backward"].flops("bf16")) == (6 * m * n * k, 12 * m * n * k)
    # recompute=True: gate and up computed again in backward (two more GEMMs); the two projections' dx summed as
    # eager's autograd sums them (mm, mm, add_: the gradients bitwise the saving variant's)
    assert _aten(recompute["backward"]) == ["add_"] + ["mm"] * 8
    assert recompute["backward"].flops("bf16") == recompute["backward"].flops() == 16 * m * n * k
    for run in (plain, recompute):
        assert {dtypes for counts in run.values() for _, dtypes in counts.matmul_dtypes} == {("bf16", "bf16")}
        assert run["forward"].syncs == run["backward"].syncs == []


def test_linear_cross_entropy_half_inputs_run_half_operand_gemms():
    """Every GEMM of the chunked strategy on bf16 inputs takes bf16 operands (fp32 accumulation)."""
    n, h, v = 8, 16, 40
    run = _measure("linear_cross_entropy:chunked", N=n, H=h, V=v, C=2)
    dtypes = {dtypes for counts in run.values() for _, dtypes in counts.matmul_dtypes}
    assert dtypes == {("bf16", "bf16")}
    # three GEMMs of 2*N*H*V: logits, dX, dW
    assert run["forward"].flops() - run["forward"].flops("fp64") == 3 * 2 * n * h * v
    assert run["forward"].syncs == run["backward"].syncs == []
    # per chunk of r = 4 rows (e = 2): logits (r x H, V x H read, r x V written); dW into the float32 accumulator,
    # one addmm with a float32 result per part of it (rows [0, V/2), whose storage becomes dW, then the other
    # V/2): the part read and written (V/2 x H x 4 each way), its columns of the gradient (r x V/2) and the
    # hidden rows read; dX (the gradient, W read, r x H written)
    r, e, part = n // 2, 2, v // 2
    gemm = (("bf16", "bf16"),)
    dw = ("addmm", 2 * part * h * 4 + (r * part + r * h) * e, {"bf16": 2 * r * h * part}, gemm)
    chunk = [("mm", (r * h + v * h + r * v) * e, {"bf16": 2 * r * h * v}, gemm), dw, dw,
             ("mm", (r * v + v * h + r * h) * e, {"bf16": 2 * r * h * v}, gemm)]
    assert _matmuls(run["forward"]) == chunk * 2
    # the accumulator's two parts zeroed once (V/2 x H x 4 bytes each), and no Triton kernel but the loss
    # kernel, one per chunk: no scratch block, no add pass
    assert [x.hbm_bytes for x in run["forward"].launches if x.name == "zeros"] == [part * h * 4] * 2
    assert [x.name for x in run["forward"].launches if x.kind == "triton"] == ["_cross_entropy_kernel"] * 2
    # backward: dX scaled (Triton), then the accumulator rounded into its first part's storage (dW), read 4 and
    # written 2 bytes per element; that part's first block (int(20 / 16) = 1 row) through a temporary (2 bytes
    # more each way), then blocks [1, 2), [2, 4), [4, 8), [8, 16), [16, 20) and the other part: 7 muls, each
    # reading the 4-byte scale
    finish = [x for x in run["backward"].launches if x.kind == "aten" and x.name in ("mul", "copy_")]
    assert [x.name for x in finish] == ["mul", "copy_"] + ["mul"] * 6
    assert sum(x.hbm_bytes for x in finish) == v * h * (4 + 2) + h * (2 + 2) + 7 * 4
    assert [x.name for x in run["backward"].launches if x.kind == "triton"] == ["_scale_kernel"]


def test_linear_cross_entropy_recompute_counts():
    """recompute, bf16: C=2 gives chunk_size = 4 tokens, so the forward runs 2 token chunks of r = 4 rows and
    the backward 2 vocabulary tiles of t = 4 * V // N = 20 classes. Every GEMM takes bf16 operands."""
    n, h, v, e = 8, 16, 40, 2
    r, t = 4, 20
    run = _measure("linear_cross_entropy:recompute", N=n, H=h, V=v, C=2)
    # forward, per chunk: logits = hidden rows @ W.T (reads r x H and V x H, writes r x V), then the loss kernel
    logits = ("mm", (r * h + v * h + r * v) * e, {"bf16": 2 * r * h * v}, (("bf16", "bf16"),))
    assert _matmuls(run["forward"]) == [logits] * 2
    # the loss kernel per row: target (8), the row of logits, the target's logit, the loss (4), (max, log-sum) (8)
    assert _triton(run["forward"])[:2] == (2, n * (8 + v * e + e + 4 + 8))
    # backward, per tile: the tile's logits (N x H and t x H read, N x t written); dX += gradient @ W[tile] with
    # the float32 N x H accumulator read and written (half operands: addmm with a float32 result); dW[tile] =
    # gradient.T @ hidden
    tile = [("mm", (n * h + t * h + n * t) * e, {"bf16": 2 * n * h * t}, (("bf16", "bf16"),)),
            ("addmm", n * h * 4 * 2 + (n * t + t * h) * e, {"bf16": 2 * n * h * t}, (("bf16", "bf16"),)),
            ("mm", (n * t + n * h + t * h) * e, {"bf16": 2 * n * h * t}, (("bf16", "bf16"),))]
    assert _matmuls(run["backward"]) == tile * 2
    # the gradient kernel, per tile and row: target, (max, log-sum), the incoming gradient's scale (4), the tile's
    # logits read and its gradient written in place (bf16: no float32 tile without a bias)
    assert _triton(run["backward"])[:2] == (2, 2 * n * (8 + 8 + 4 + 2 * t * e))
    assert run["forward"].syncs == run["backward"].syncs == []


@pytest.mark.parametrize("op", ["rms_norm", "cross_entropy"])
def test_fit_reproduces_a_held_out_shape(op):
    """The polynomial fit is exact: a shape outside the fit (the case's own check) is predicted to the byte."""
    case = CASES[op]
    small = {"rms_norm": {"H": 64}, "cross_entropy": {"V": 100}}[op]
    case = gpu_audit.Case(case.op, "small", dict(case.shape, **small), case.variables, case.fit_values,
                          case.check_values, case.build, case.minimum, setup=case.setup)
    result = gpu_audit.fit(case, torch.bfloat16)
    assert result["forward"].hbm_bytes > 0


def test_fit_refuses_counts_that_are_not_polynomial():
    case = gpu_audit.Case("toy", "toy", {"N": 100}, ("N",), {"N": (1, 2)}, ({"N": 3},), None, None)

    def measure(case, shape, dtype, impl):
        counts = gpu_audit.Counts([gpu_audit.Launch("aten", "op", hbm_bytes=shape["N"] ** 2)])
        return {"forward": counts, "backward": gpu_audit.Counts()}
    with pytest.raises(RuntimeError, match="not the polynomial"):
        gpu_audit.fit(case, torch.float32, measure_fn=measure)


def test_masked_lanes_move_nothing_and_an_extra_load_counts():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr, EXTRA: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        x = tl.load(src + cols, mask=cols < n)
        if EXTRA:
            x += tl.load(src + cols, mask=cols < n)
        tl.store(dst + cols, x, mask=cols < n)

    src, dst = torch.ones(16), torch.empty(16)
    with gpu_audit.count() as plain:
        copy[(1,)](src, dst, 10, BLOCK=16, EXTRA=False)
    with gpu_audit.count() as extra:
        copy[(1,)](src, dst, 10, BLOCK=16, EXTRA=True)
    assert (plain.requested_bytes, plain.hbm_bytes) == (2 * 10 * 4, 2 * 10 * 4)
    assert extra.requested_bytes == 3 * 10 * 4


def test_an_in_place_update_is_read_and_written_back():
    """A store to bytes the launch loaded is a write-back to HBM: an in-place update moves its bytes twice
    (Liger's cross-entropy writes its gradient over the logits); reading back one's own store moves nothing."""
    import triton
    import triton.language as tl

    @triton.jit
    def scale(src, dst, n, BLOCK: tl.constexpr, READ_BACK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        x = tl.load(src + cols, mask=cols < n)
        tl.store(dst + cols, x * 2, mask=cols < n)
        if READ_BACK:
            tl.store(dst + cols, tl.load(dst + cols, mask=cols < n) + 1, mask=cols < n)

    x, y = torch.ones(16), torch.empty(16)
    with gpu_audit.count() as in_place:
        scale[(1,)](x, x, 10, BLOCK=16, READ_BACK=False)
    with gpu_audit.count() as read_back:
        scale[(1,)](x, y, 10, BLOCK=16, READ_BACK=True)
    assert (in_place.requested_bytes, in_place.hbm_bytes) == (2 * 10 * 4, 2 * 10 * 4)
    # x read, y written (its read-back and second store stay in L2, one write-back)
    assert (read_back.requested_bytes, read_back.hbm_bytes) == (4 * 10 * 4, 2 * 10 * 4)


def test_aten_counts_bytes_flops_float32_matmuls_and_syncs():
    a, b = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(4, 6, dtype=torch.bfloat16)
    with gpu_audit.count() as counts:
        a.t()  # a view: nothing moves
        a.float() @ b.float()
        (a > 0).nonzero()
    names = [x.name for x in counts.launches]
    assert names == ["_to_copy", "_to_copy", "mm", "gt", "nonzero"]
    mm = counts.launches[2]
    assert (mm.hbm_bytes, mm.flops, mm.matmul_dtypes) == ((8 * 4 + 4 * 6 + 8 * 6) * 4, {"fp32": 2 * 8 * 4 * 6},
                                                          (("fp32", "fp32"),))
    assert counts.syncs == ["nonzero"]


def test_linear_cross_entropy_float32_counts_the_gpu_path():
    """float32 chunked: per chunk one logits GEMM, the dW addmm_ into the float32 accumulator and one dX GEMM, as on a
    GPU (the CPU path's dX by blocks of 128 classes summed in float64 is not what a GPU runs)."""
    n, h, v = 8, 16, 300
    run = _measure("linear_cross_entropy:chunked", torch.float32, N=n, H=h, V=v, C=2)
    assert [name for name, _ in run["forward"].matmul_dtypes] == ["mm", "addmm_", "mm"] * 2
    assert run["forward"].flops("fp32") == 3 * 2 * n * h * v  # the rest is the loss kernel's float64 row sums


def test_linear_cross_entropy_recompute_real_shape_uses_the_ops_chunks():
    """At Llama-3-8B's head (8192 tokens, bf16) the op runs 590-token chunks (14) and 2360-class tiles (55)."""
    case = LINEAR_CE["recompute"]
    assert case.real_shape(case.shape, torch.bfloat16, "forward")["C"] == -(-8192 // 590) == 14
    assert case.real_shape(case.shape, torch.bfloat16, "backward")["C"] == -(-128256 // 2360) == 55


def test_aten_counts_in_place_and_float32_result_matmuls():
    """addmm_ is a matmul (its FLOPs and operand dtypes count); addmm with out_dtype=float32 into its own
    accumulator reads the accumulator once and its FLOPs run at the operands' precision."""
    from memkernels.fusions.common.half_gemm import addmm_float32_
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    accumulator = torch.zeros(8, 6)
    with gpu_audit.count() as counts:
        accumulator.addmm_(a, b)
        addmm_float32_(accumulator, a.bfloat16(), b.bfloat16())
    in_place, half = counts.launches[0], counts.launches[-1]
    assert (in_place.name, in_place.flops, in_place.matmul_dtypes) == ("addmm_", {"fp32": 2 * 8 * 4 * 6},
                                                                        (("fp32", "fp32"),))
    assert in_place.hbm_bytes == (8 * 6 * 2 + 8 * 4 + 4 * 6) * 4
    assert (half.name, half.flops, half.matmul_dtypes) == ("addmm", {"bf16": 2 * 8 * 4 * 6}, (("bf16", "bf16"),))
    assert half.hbm_bytes == 8 * 6 * 4 * 2 + (8 * 4 + 4 * 6) * 2  # accumulator read once and written


def test_step_row_adds_forward_and_backward():
    def result(launches, hbm, flops):
        return gpu_audit.PassResult({("aten", "mm"): {"launches": launches, "hbm": hbm, "requested": hbm,
                                                      "flops": {"bf16": flops}}}, [], [])
    forward = gpu_audit.Row("op", "s", "bf16", "forward", result(1, 100, 10 ** 12), 80, 10, result(1, 50, 0))
    backward = gpu_audit.Row("op", "s", "bf16", "backward", result(4, 10 ** 9, 0), 20, 0, result(1, 50, 0))
    step = gpu_audit.step_row(forward, backward)
    assert (step.phase, step.result.hbm_bytes, step.result.launches, step.minimum_bytes) == ("step", 10 ** 9 + 100,
                                                                                             5, 100)
    h100 = gpu_audit.GPUS["H100-SXM"]
    # each pass keeps its own launches: not one average launch over both
    assert step.result.seconds(h100) == forward.result.seconds(h100) + backward.result.seconds(h100)
    assert step.eager.seconds(h100) == forward.eager.seconds(h100) + backward.eager.seconds(h100)


def test_eager_counts_on_fake_tensors_at_the_real_shape():
    result = gpu_audit.exact(CASES["cross_entropy"], torch.bfloat16)  # 8192 x 32000 logits, no data
    n, v = 8192, 32000
    # at least: the bf16 logits read and their float32 copy written and read again
    assert result["forward"].hbm_bytes >= n * v * (2 + 4 + 4)
    assert result["forward"].syncs == []


@pytest.mark.parametrize("arch, registers, warps, shared, blocks", [
    (80, 64, 4, 0, 8),  # 64 regs x 128 threads = 8192 per block: 65536 / 8192
    (80, 32, 4, 0, 16),  # thread-limited: 2048 / 128
    (80, 128, 8, 0, 2),
    (90, 32, 4, 100 * 1024, 2),  # shared-memory limited: 228 KiB / (100 KiB + 1 KiB reserved)
    (80, 40, 4, 0, 12),  # 40 regs round to 1280 per warp (units of 256): 65536 / 5120 = 12
])
def test_blocks_per_sm(arch, registers, warps, shared, blocks):
    assert gpu_audit.blocks_per_sm(arch, registers, warps, shared) == blocks


def test_half_gemm_float32_result_matches_widened_operands():
    from memkernels.fusions.common.half_gemm import addmm_float32_
    a, b = torch.randn(5, 7, dtype=torch.bfloat16), torch.randn(7, 3, dtype=torch.bfloat16)
    accumulator = torch.ones(5, 3)
    with gpu_audit.count() as counts:
        addmm_float32_(accumulator, a, b)
    torch.testing.assert_close(accumulator, 1 + a.float() @ b.float(), rtol=0, atol=0)
    assert counts.matmul_dtypes == [("addmm", ("bf16", "bf16"))]  # what a GPU runs: half operands


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_gpu_check_says_so_and_exits_0_without_a_gpu():
    import os
    import subprocess
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_check.sh")
    run = subprocess.run(["bash", script], capture_output=True, text=True)
    assert run.returncode == 0
    assert "no CUDA GPU" in run.stdout


def test_prediction_line_is_the_audit_model_at_the_benchmarks_shape(monkeypatch):
    """What a benchmark's GPU section prints beside its measured time: the audit's model at the benchmark's
    own shape, on the modelled GPU that matches the device name; the same line from a child process when
    the benchmark's process runs compiled Triton (no interpreter)."""
    shape = {"N": 16, "H": 128}
    case = gpu_audit.case_at("rms_norm", shape)
    assert case.shape == {"N": 16, "H": 128, "P": CASES["rms_norm"].shape["P"]}
    # the backward's programs are those of the benchmark's rows (two per SM below 16 warps), not the case's
    assert CASES["rms_norm"].shape["P"] == 264
    assert case.real_shape(case.shape, torch.bfloat16, "backward")["P"] == 264
    ours, eager = gpu_audit.fit(case, torch.bfloat16), gpu_audit.exact(case, torch.bfloat16)
    h100 = gpu_audit.GPUS["H100-SXM"]

    def part(impl, result):
        forward, backward = (result[phase].seconds(h100) * 1e3 for phase in ("forward", "backward"))
        return f"{impl} fwd {forward:.3f} + bwd {backward:.3f} = {forward + backward:.3f} ms"
    line = gpu_audit.prediction_line("rms_norm", shape, "bf16", "NVIDIA H100 80GB HBM3")
    assert line == ("audit MODEL for H100-SXM (not a measurement; bf16): " + part("memkernels", ours) + ", "
                    + part("eager", eager))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert gpu_audit.prediction_line("rms_norm", shape, torch.bfloat16, "NVIDIA H100 80GB HBM3") == line


def test_prediction_that_cannot_be_counted_says_why_instead_of_aborting_the_benchmark(monkeypatch):
    """On the H200 machine (triton 3.6) the interpreted child failed: the benchmark's measured times must
    still print, beside a line saying why the model is missing."""
    monkeypatch.delenv("TRITON_INTERPRET")

    def failed_child(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 1, stdout="", stderr="Traceback ...\nTypeError: no scalar here\n")

    monkeypatch.setattr(gpu_audit.subprocess, "run", failed_child)
    line = gpu_audit.prediction_line("rms_norm", {"N": 16, "H": 32}, "bf16", "NVIDIA H100 80GB HBM3")
    assert line.startswith("audit model: counting rms_norm at {'N': 16, 'H': 32} failed")
    assert line.endswith("TypeError: no scalar here; no prediction printed")


def test_prediction_names_what_it_cannot_model():
    assert gpu_audit.model_gpu("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert gpu_audit.model_gpu("NVIDIA H200") == "H200-SXM"
    assert gpu_audit.model_gpu("NVIDIA H200 NVL") is None  # 600 W less, other clocks
    assert gpu_audit.model_gpu("NVIDIA H100 PCIe") is None  # 2.0 TB/s, not the SXM board's 3.35
    assert gpu_audit.model_gpu("NVIDIA A100-PCIE-40GB") is None
    assert gpu_audit.model_gpu("NVIDIA L4") is None
    assert "no figures for NVIDIA L4" in gpu_audit.prediction_line("rms_norm", {"N": 16}, "bf16", "NVIDIA L4")
    with pytest.raises(ValueError, match="not T"):
        gpu_audit.case_at("rms_norm", {"T": 16})
    with pytest.raises(ValueError, match="not audited"):
        gpu_audit.case_at("softmax", {})


def test_case_at_linear_cross_entropy_takes_the_strategy_auto_picks():
    """The benchmarks' prediction lines model what the op runs: "auto" picks chunked for bf16 and fp32 at
    Llama-3-8B's head (pick_strategy's count, no device to ask for memory), and recompute at 1024 bf16 tokens
    (under the 1376 from which chunked's accumulator passes cost less than recompute's extra GEMM there)."""
    head = {"N": 8192, "H": 4096, "V": 128256}
    assert gpu_audit.case_at("linear_cross_entropy", head, "bf16").real_shape.__name__ == "_linear_ce_real_shape"
    assert gpu_audit.case_at("linear_cross_entropy", head, "fp32").real_shape.__name__ == "_linear_ce_real_shape"
    assert gpu_audit.case_at("linear_cross_entropy", dict(head, N=1024), "bf16").real_shape.__name__ == \
        "_linear_ce_recompute_real_shape"


def test_liger_kernels_count_through_the_interpreter():
    """Liger's column (bench extra): its norm kernels take a Python float eps, which triton 3.9's interpreter
    passes unwrapped; the audit's Liger runner wraps it (and replaces libdevice's empty stubs), then undoes it."""
    pytest.importorskip("liger_kernel")
    from triton.runtime import interpreter
    original = interpreter._implicit_cvt
    n, h, e = 4, 64, 2
    run = gpu_audit.measure(CASES["rms_norm"], dict(N=n, H=h, P=2), torch.bfloat16, "liger")
    # forward: x, the weight once per row (in L2 after the first), y, rstd (fp32)
    assert _triton(run["forward"]) == (1, 3 * n * h * e + n * 4, 2 * n * h * e + h * e + n * 4)
    assert interpreter._implicit_cvt is original
    # backward at the fit's P programs (Liger's grid is the device's SM count, 1 off a GPU): each program
    # writes its float32 dw partial row, which torch's sum reads back
    from liger_kernel.ops import rms_norm
    liger_backward = rms_norm.rms_norm_backward
    for p in (1, 3):
        run = gpu_audit.measure(CASES["rms_norm"], dict(N=6, H=h, P=p), torch.bfloat16, "liger")
        kernel, = (x for x in run["backward"].launches if x.kind == "triton")
        assert kernel.programs == p
        assert [x.hbm_bytes for x in run["backward"].launches if x.name == "sum"] == [p * h * 4 + h * 4]
    assert rms_norm.rms_norm_backward is liger_backward  # put back
    # Liger's fused linear-CE at the fit's chunk count; at Llama-3-8B's head its own rule gives 32 chunks
    run = gpu_audit.measure(LINEAR_CE["recompute"], dict(N=16, H=16, V=40, C=2), torch.bfloat16, "liger")
    assert [x.name for x in run["forward"].launches if x.kind == "triton"] == ["liger_cross_entropy_kernel"] * 2
    assert loss_audit.liger_chunk_count(8192, 4096, 128256) == 32


@pytest.mark.parametrize("strategy", ["chunked", "recompute"])
def test_linear_cross_entropy_counts_fit_their_held_out_shape(strategy):
    """The audit's fit (exact, checked at a held-out shape) must hold for each strategy at small
    vocabularies too: a kernel whose grid is cdiv(N * H, block) (dX's float32 scaling) broke it for
    "chunked" until its small-shape block covered N * H in one program."""
    import dataclasses
    case = dataclasses.replace(LINEAR_CE[strategy], shape=dict(LINEAR_CE[strategy].shape, V=300))
    result = gpu_audit.fit(case, torch.bfloat16)
    assert result["forward"].launches > 0 and result["backward"].launches > 0
    # The cross-entropy kernel pads a row to its block, and a GPU's masked lanes still compute: its
    # elementwise ops are no polynomial in V, so they are scaled from the largest measured shape and named.
    if strategy == "recompute":
        assert result["backward"].ops_scaled == ["_cross_entropy_kernel"]
        ops = result["backward"].kernels[("triton", "_cross_entropy_kernel")]["ops"]
        assert ops["sfu"] > 0 and ops["alu"] > ops["sfu"]


def test_the_audit_finds_every_fusions_cases_without_a_registry():
    """Each fusion's cases live in its own audit.py (memkernels/fusions/<family>/audit.py), found by walking the
    fusions: a new fusion's audit.py is audited with nothing registered, and every audited op names its kernels."""
    import pathlib

    import memkernels.fusions
    on_disk = {path.parent.name for path in pathlib.Path(memkernels.fusions.__path__[0]).glob("*/audit.py")}
    found = {module.__name__.split(".")[-2] for module in gpu_audit.fusion_audits()}
    assert found == on_disk >= {"norm", "loss", "gelu_mlp", "gated_mlp", "rope", "dyt"}
    ops = {case.op: case for case in gpu_audit.cases()}
    assert {"rms_norm", "add_layer_norm", "cross_entropy", "linear_cross_entropy", "gelu_linear", "gated_linear",
            "gated_mlp", "silu_mul", "rope", "dyt"} <= set(ops)
    assert all(case.aot_kernels for case in ops.values())


def test_linear_logprobs_counts_fit_their_held_out_shape():
    """linear_logprobs is audited on linear_cross_entropy's recompute tiling (its chunk and tile rules): the exact
    fit holds at a held-out shape, every GEMM on bf16 operands, no host sync."""
    import dataclasses
    case = next(case for case in gpu_audit.cases() if case.op == "linear_logprobs")
    result = gpu_audit.fit(dataclasses.replace(case, shape=dict(case.shape, V=300)), torch.bfloat16)
    for phase in ("forward", "backward"):
        assert result[phase].launches > 0 and result[phase].syncs == []
        matmuls = result[phase].matmul_dtypes
        assert matmuls and all(dtypes == ("bf16", "bf16") for _, dtypes in matmuls), matmuls


# The act-GEMM issue 31 measured at 0.21x eager on an H200: an activation applied to operand tiles inside
# a GEMM's k-loop runs once per output tile, N / BLOCK_N times over. Counted bytes and FLOPs missed it.
_ACT_BLOCK = 16


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def _gelu_pass(X, Y, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offsets, _gelu(tl.load(X + offsets).to(tl.float32)))


@triton.jit
def _gemm(A, B, C, M, N, K, BLOCK: tl.constexpr, ACTIVATE: tl.constexpr):
    """C = A @ B, or with ACTIVATE gelu(A) @ B applied to each A tile inside the k-loop (the deleted design)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        ks = k + tl.arange(0, BLOCK)
        a = tl.load(A + rows[:, None] * K + ks[None, :]).to(tl.float32)
        if ACTIVATE:
            a = _gelu(a)
        acc += tl.dot(a, tl.load(B + ks[:, None] * N + cols[None, :]).to(tl.float32))
    tl.store(C + rows[:, None] * N + cols[None, :], acc)


def test_work_repeated_inside_a_tile_loop_is_counted():
    m, n, k = 32, 64, 32
    a, b = torch.randn(m, k), torch.randn(k, n)
    in_loop, activated, separate = torch.empty(m, n), torch.empty(m, k), torch.empty(m, n)
    with gpu_audit.count() as counts:
        _gemm[(m // _ACT_BLOCK, n // _ACT_BLOCK)](a, b, in_loop, m, n, k, BLOCK=_ACT_BLOCK, ACTIVATE=True)
        _gelu_pass[(m * k // 256,)](a, activated, BLOCK=256)
        _gemm[(m // _ACT_BLOCK, n // _ACT_BLOCK)](activated, b, separate, m, n, k, BLOCK=_ACT_BLOCK, ACTIVATE=False)
    torch.testing.assert_close(in_loop, separate)
    fused, gelu_pass, gemm = counts.launches
    # gelu: one erf (sfu) and 5 alu instructions an element (two multiplies, an add, a multiply, a multiply)
    assert gelu_pass.ops["sfu"] == m * k and fused.ops["sfu"] == m * k * (n // _ACT_BLOCK)
    assert fused.ops["alu"] > (n // _ACT_BLOCK) * (gelu_pass.ops["alu"] - m * k)  # casts aside
    # At Llama-3-8B's down projection, 8192 tokens x 14336 -> 4096 in bf16, the same kernels: the repeated
    # activation (N / BLOCK_N = 4096 / 64) takes longer than the GEMM's tensor-core time, so the model
    # predicts the fused kernel slower than the separate pass and GEMM, which its bytes and FLOPs alone
    # (fewer bytes, the same FLOPs) did not.
    h100 = gpu_audit.GPUS["H100-SXM"]
    tokens, inner, out, block_n = 8192, 14336, 4096, 64
    per_element = {unit: n_ops / (m * k) for unit, n_ops in gelu_pass.ops.items()}
    repeated = gpu_audit.Launch("triton", "act_in_k_loop", hbm_bytes=2 * (tokens * inner + inner * out + tokens * out),
                                flops={"bf16": 2 * tokens * inner * out},
                                ops={u: per * tokens * inner * out // block_n for u, per in per_element.items()})
    once = [gpu_audit.Launch("triton", "gelu_pass", hbm_bytes=2 * 2 * tokens * inner,
                             ops={u: per * tokens * inner for u, per in per_element.items()}),
            gpu_audit.Launch("aten", "mm", hbm_bytes=2 * (tokens * inner + inner * out + tokens * out),
                             flops={"bf16": 2 * tokens * inner * out})]
    assert repeated.compute_seconds(h100) > 2 * repeated.flops["bf16"] / h100.peak_flops["bf16"]
    assert repeated.seconds(h100) > 1.5 * sum(launch.seconds(h100) for launch in once)
    assert repeated.hbm_bytes < sum(launch.hbm_bytes for launch in once)
