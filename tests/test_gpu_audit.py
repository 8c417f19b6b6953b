"""memkernels.tools.gpu_audit: exact counts per op at one small shape, and the counter itself.

The pins are derived element by element in the comments: an extra tl.load, a float32 matmul on
half inputs or a host sync in any op changes a pinned number and fails here.
"""
import pytest
import torch

import memkernels
from memkernels.tools import gpu_audit

pytestmark = pytest.mark.skipif(not memkernels._backend.triton_interpreted(),
                                reason="counts Triton kernels through the interpreter")

CASES = {case.op: case for case in gpu_audit.cases() if case.op != "linear_cross_entropy"}
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
    # backward: dy, x, the weight once per program, rstd, dx, and each program's float32 dw partial
    # (sum and compensation); then the partials are reduced in torch
    partials = p * 2 * h * 4
    requested = 3 * n * h * e + p * h * e + n * 4 + partials
    assert _triton(run["backward"]) == (1, requested, requested - (p - 1) * h * e)
    assert _aten(run["backward"]) == ["sub", "sum", "sum", "zeros"]
    assert run["forward"].syncs == run["backward"].syncs == []


def test_layer_norm_counts():
    n, h, p, e = 4, 64, 2, 2
    run = _measure("layer_norm", N=n, H=h, P=p)
    # forward: x, weight and bias per row, y, mean and rstd
    assert _triton(run["forward"]) == (1, 4 * n * h * e + 2 * n * 4, 2 * n * h * e + 2 * h * e + 2 * n * 4)
    partials = 2 * p * 2 * h * 4  # dw and db
    requested = 3 * n * h * e + p * h * e + 2 * n * 4 + partials
    assert _triton(run["backward"]) == (1, requested, requested - (p - 1) * h * e)


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


def test_gelu_linear_counts():
    m = k = n = 64
    e = 2
    run = _measure("gelu_linear", M=m, K=k, N=n)
    # forward: one tile program: x, W, the bias, the output; one bf16 dot of 2*M*N*K
    assert _triton(run["forward"]) == (1, (m * k + n * k + n + m * n) * e, (m * k + n * k + n + m * n) * e)
    assert run["forward"].flops() == run["forward"].flops("bf16") == 2 * m * n * k
    # backward: dX = (dY @ W) * gelu'(x) reads dY, W, x and writes dX; dW = dY^T @ gelu(x)
    assert run["backward"].flops() == run["backward"].flops("bf16") == 4 * m * n * k
    assert {dtypes for _, dtypes in run["backward"].matmul_dtypes} == {("bf16", "bf16")}
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
    # per chunk of r = 4 rows (e = 2): logits (r x H, V x H read, r x V written); dW's block product written to the
    # float32 scratch (the gradient r x V and hidden rows read, V x H x 4 written: the scratch is not read); dX
    # (the gradient, W read, r x H written)
    r, e = n // 2, 2
    gemm = (("bf16", "bf16"),)
    chunk = [("mm", (r * h + v * h + r * v) * e, {"bf16": 2 * r * h * v}, gemm),
             ("mm", (r * v + r * h) * e + v * h * 4, {"bf16": 2 * r * h * v}, gemm),
             ("mm", (r * v + v * h + r * h) * e, {"bf16": 2 * r * h * v}, gemm)]
    assert _matmuls(run["forward"]) == chunk * 2
    # the split add per chunk: halves (2 + 2 bytes) and the float32 block read, the halves written
    split = [x for x in run["forward"].launches if x.name == "_add_to_split_float32_kernel"]
    assert [x.requested_bytes for x in split] == [v * h * (2 + 2 + 4 + 2 + 2)] * 2


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
    from memkernels.ops._half_gemm import addmm_float32_
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
    from memkernels.ops._half_gemm import addmm_float32_, mm_float32
    a, b = torch.randn(5, 7, dtype=torch.bfloat16), torch.randn(7, 3, dtype=torch.bfloat16)
    out = torch.empty(5, 3)
    with gpu_audit.count() as counts:
        mm_float32(a, b, out=out)
    torch.testing.assert_close(out, a.float() @ b.float(), rtol=0, atol=0)
    assert counts.matmul_dtypes == [("mm", ("bf16", "bf16"))]  # what a GPU runs: half operands
    accumulator = torch.ones(5, 3)
    addmm_float32_(accumulator, a, b)
    torch.testing.assert_close(accumulator, 1 + a.float() @ b.float(), rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_gpu_check_says_so_and_exits_0_without_a_gpu():
    import os
    import subprocess
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_check.sh")
    run = subprocess.run(["bash", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0
    assert "no CUDA GPU" in run.stdout
