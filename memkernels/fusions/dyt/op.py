"""Dynamic Tanh (DyT): ``y = weight * tanh(alpha * x) + bias`` in one launch forward, two backward.

DyT replaces a transformer's norms with an elementwise squash (Zhu et al., "Transformers without
Normalization", 2025). Eager PyTorch runs it as four kernels forward and eight backward, and
saves two tensors of x's size: x (for alpha's gradient) and tanh's output. Here forward is one pass
(read x, write y) and backward one pass that reads x and y's gradient, recomputes tanh, writes dx and
each program's float32 partial sums of the parameters' gradients, then one small reduction. Saved for
backward: x alone (half of eager's new bytes, measured in tests/test_dyt.py).

- forward:  y = w * tanh(alpha * x) + b                                      one launch, fp32 math, one rounding
- backward: dx = g * w * alpha * (1 - t^2);  dw, db, dalpha partial sums      one launch
            dw, db, dalpha from the partials, in the parameters' dtypes        one launch

The math is memkernels/fusions/dyt/reference.py's (the ``backend="torch"`` path).

File order: kernels → launchers → steps → autograd and OpSpec → public function.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from memkernels import aot
from memkernels.fusions.common.act_linear import tanh_sech2
from memkernels.fusions.common.device_guard import on_tensor_device
from memkernels.fusions.common.host import cdiv, next_power_of_2
from memkernels.fusions.dyt import reference
from memkernels.fusions.op_spec import OpSpec, Step

# A tile of [BLOCK_M, BLOCK_N] = 2048 elements at 4 warps: 16 a thread, 8 contiguous columns each (16-byte
# loads in 16-bit dtypes) while BLOCK_N is 256.
_TILE_ELEMENTS = 2048
_MAX_BLOCK_N = 256
_WARPS = 4
# Rows each backward program sums its partial gradients over. Its float32 partial rows (dw and db: 8 bytes a
# column a program, written once and read once by the reduction) put the backward 2.1% over its minimum
# bytes at 128 rows of 16-bit x, g and dx (the audit's count at [8192, 4096]), where 32 rows would put it
# 8%. A fixed count, not one per SM: the grid, the partials and the sums' order depend on the shape alone.
ROWS_PER_PROGRAM = 128
# The reduction of the partials: 128 columns a program (32 programs at H = 4096), the alpha partials 1024 at a time.
_REDUCE_BLOCK_N = 128
_REDUCE_BLOCK_A = 1024


# --------------------------------------------------------------------------------------------
# Kernels: programs over (row block, column block); rows strided, columns contiguous.


@triton.jit
def _dyt_forward_kernel(
    X, ALPHA, W, B, Y,       # X: [rows, cols] (row stride stride_x); ALPHA: one element; W, B: [cols]; Y: contiguous
    rows, cols, stride_x,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = c < cols
    mask = (r < rows)[:, None] & col_mask[None, :]
    alpha = tl.load(ALPHA).to(tl.float32)
    w = tl.load(W + c, mask=col_mask, other=0.0).to(tl.float32)
    x = tl.load(X + r[:, None].to(tl.int64) * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
    t, _ = tanh_sech2(alpha * x)
    y = t * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + c, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + r[:, None].to(tl.int64) * cols + c[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _dyt_backward_kernel(
    X, G, ALPHA, W,          # X: [rows, cols] (row stride stride_x), G: y's gradient (stride_g); ALPHA; W: [cols]
    DX,                      # [rows, cols] contiguous, x's dtype
    PARTIALS,                # float32 [2, programs, cols]: each program's sums of g * t (dw) and of g (db)
    ALPHA_PARTIALS,          # float32 [programs, column blocks]: each program's sum of g * w * (1 - t^2) * x
    rows, cols, stride_x, stride_g, rows_per_program,
    HAS_BIAS: tl.constexpr, NEEDS_DX: tl.constexpr, NEEDS_PARAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    program = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = c < cols
    alpha = tl.load(ALPHA).to(tl.float32)
    w = tl.load(W + c, mask=col_mask, other=0.0).to(tl.float32)
    sum_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    sum_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    sum_alpha = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = program * rows_per_program
    for start in range(first, tl.minimum(first + rows_per_program, rows), BLOCK_M):
        r = start + tl.arange(0, BLOCK_M)
        mask = (r < rows)[:, None] & col_mask[None, :]
        r64 = r[:, None].to(tl.int64)
        x = tl.load(X + r64 * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + r64 * stride_g + c[None, :], mask=mask, other=0.0).to(tl.float32)
        t, sech2 = tanh_sech2(alpha * x)
        g_w_s = g * w[None, :] * sech2
        if NEEDS_DX:
            tl.store(DX + r64 * cols + c[None, :], (g_w_s * alpha).to(DX.dtype.element_ty), mask=mask)
        if NEEDS_PARAMS:  # masked elements load x = g = 0 and add nothing
            sum_w += tl.sum(g * t, axis=0)
            sum_alpha += tl.sum(g_w_s * x, axis=0)
            if HAS_BIAS:
                sum_b += tl.sum(g, axis=0)
    if NEEDS_PARAMS:
        programs = tl.num_programs(0)
        tl.store(PARTIALS + program * cols + c, sum_w, mask=col_mask)
        if HAS_BIAS:
            tl.store(PARTIALS + (programs + program) * cols + c, sum_b, mask=col_mask)
        tl.store(ALPHA_PARTIALS + program * tl.num_programs(1) + tl.program_id(1), tl.sum(sum_alpha, axis=0))


@triton.jit
def _dyt_reduce_kernel(
    PARTIALS, ALPHA_PARTIALS,  # the backward's: float32 [2 or 1, programs, cols] and [alpha_partials]
    DW, DB, DALPHA,            # [cols], [cols] (with a bias), one element: each in its parameter's dtype
    programs, cols, alpha_partials,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr,
):
    """The parameters' gradients from the backward's partial sums, in program order (deterministic), written
    in the parameters' dtypes: one launch where torch would take two sums and three casts."""
    c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = c < cols
    sum_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    sum_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p in range(0, programs):
        sum_w += tl.load(PARTIALS + p * cols + c, mask=mask, other=0.0)
        if HAS_BIAS:
            sum_b += tl.load(PARTIALS + (programs + p) * cols + c, mask=mask, other=0.0)
    tl.store(DW + c, sum_w.to(DW.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(DB + c, sum_b.to(DB.dtype.element_ty), mask=mask)
    if tl.program_id(0) == 0:
        total = tl.zeros([BLOCK_A], dtype=tl.float32)
        for start in range(0, alpha_partials, BLOCK_A):
            a = start + tl.arange(0, BLOCK_A)
            total += tl.load(ALPHA_PARTIALS + a, mask=a < alpha_partials, other=0.0)
        tl.store(DALPHA, tl.sum(total, axis=0).to(DALPHA.dtype.element_ty))


# --------------------------------------------------------------------------------------------
# Launchers


def _blocks(cols):
    """(BLOCK_M, BLOCK_N) for rows of ``cols`` elements."""
    block_n = min(next_power_of_2(cols), _MAX_BLOCK_N)
    return max(_TILE_ELEMENTS // block_n, 1), block_n


def _rows_of(tensor):
    """``tensor`` [..., H] as [M, H] with contiguous columns (a view when its layout allows)."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] <= 1 else rows.contiguous()


@on_tensor_device
def _forward_triton(x, alpha, weight, bias, dtype):
    rows, cols = x.shape
    y = torch.empty((rows, cols), dtype=dtype, device=x.device)
    if rows and cols:
        block_m, block_n = _blocks(cols)
        _dyt_forward_kernel[(cdiv(rows, block_m), cdiv(cols, block_n))](
            x, alpha, weight, weight if bias is None else bias, y, rows, cols, x.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=_WARPS)
    return y


@on_tensor_device
def _backward_triton(grad, x, alpha, weight, bias_dtype, needs_x, needs_params):
    rows, cols = x.shape
    has_bias = bias_dtype is not None
    block_m, block_n = _blocks(cols)
    rows_per_program = max(ROWS_PER_PROGRAM, block_m)  # a multiple of block_m: both powers of two
    programs, column_blocks = max(cdiv(rows, rows_per_program), 1), cdiv(cols, block_n)
    dx = torch.empty((rows, cols), dtype=x.dtype, device=x.device) if needs_x else None
    if needs_params:  # every program writes all of its partials: no zero fill
        partials = torch.empty((2 if has_bias else 1, programs, cols), dtype=torch.float32, device=x.device)
        alpha_partials = torch.empty((programs, column_blocks), dtype=torch.float32, device=x.device)
    if cols and (needs_x and rows or needs_params):
        _dyt_backward_kernel[(programs, column_blocks)](
            x, grad, alpha, weight, x if dx is None else dx, partials if needs_params else alpha,
            alpha_partials if needs_params else alpha, rows, cols, x.stride(0), grad.stride(0), rows_per_program,
            HAS_BIAS=has_bias, NEEDS_DX=needs_x, NEEDS_PARAMS=needs_params, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=_WARPS)
    if not needs_params:
        return dx, None, None, None
    dweight = torch.empty((cols,), dtype=weight.dtype, device=x.device)
    dbias = torch.empty((cols,), dtype=bias_dtype, device=x.device) if has_bias else None
    if not cols:
        return dx, torch.zeros_like(alpha), dweight, dbias
    dalpha = torch.empty_like(alpha)
    _dyt_reduce_kernel[(cdiv(cols, _REDUCE_BLOCK_N),)](
        partials, alpha_partials, dweight, dweight if dbias is None else dbias, dalpha, programs, cols,
        alpha_partials.numel(), HAS_BIAS=has_bias, BLOCK_N=_REDUCE_BLOCK_N, BLOCK_A=_REDUCE_BLOCK_A, num_warps=_WARPS)
    return dx, dalpha, dweight, dbias


def _aot_variants():
    """Launch variants for memkernels.aot: each dtype with parameters of its own dtype, and 16-bit x with
    float32 parameters (mixed precision without autocast casting them: y and its gradient float32, as eager's
    promotion gives), with a bias, at a wide row (H >= 256: the 256-column block)."""
    short = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    # (x's dtype, the parameters', y's)
    cases = [(t, t, t) for t in short.values()] + [(t, "fp32", "fp32") for t in ("bf16", "fp16")]
    block_m, block_n = _blocks(4096)
    forward, backward = [], []
    for source, parameters, target in cases:
        label = f"x{source}-w{parameters}-y{target}"
        forward.append({
            "signature": {"X": f"*{source}", "ALPHA": f"*{parameters}", "W": f"*{parameters}",
                          "B": f"*{parameters}", "Y": f"*{target}", "rows": "i32", "cols": "i32", "stride_x": "i32"},
            "constexprs": {"HAS_BIAS": True, "BLOCK_M": block_m, "BLOCK_N": block_n},
            "num_warps": _WARPS, "num_stages": 1,
            "aligned": ["X", "W", "B", "Y", "cols", "stride_x"], "label": f"fwd-{label}"})
        for needs_params in (True, False):  # False: frozen parameters (LoRA, QLoRA)
            backward.append({
                "signature": {"X": f"*{source}", "G": f"*{target}", "ALPHA": f"*{parameters}",
                              "W": f"*{parameters}", "DX": f"*{source}", "PARTIALS": "*fp32",
                              "ALPHA_PARTIALS": "*fp32", "rows": "i32", "cols": "i32", "stride_x": "i32",
                              "stride_g": "i32", "rows_per_program": "i32"},
                "constexprs": {"HAS_BIAS": True, "NEEDS_DX": True, "NEEDS_PARAMS": needs_params,
                               "BLOCK_M": block_m, "BLOCK_N": block_n},
                "num_warps": _WARPS, "num_stages": 1,
                "aligned": ["X", "G", "W", "DX", "PARTIALS", "cols", "stride_x", "stride_g"],
                "label": f"bwd-{label}{'' if needs_params else '-frozen'}"})
    reduce = [{
        "signature": {"PARTIALS": "*fp32", "ALPHA_PARTIALS": "*fp32", "DW": f"*{dtype}", "DB": f"*{dtype}",
                      "DALPHA": f"*{dtype}", "programs": "i32", "cols": "i32", "alpha_partials": "i32"},
        "constexprs": {"HAS_BIAS": True, "BLOCK_N": _REDUCE_BLOCK_N, "BLOCK_A": _REDUCE_BLOCK_A},
        "num_warps": _WARPS, "num_stages": 1, "aligned": ["PARTIALS", "DW", "DB", "cols"],
        "label": f"reduce-{dtype}"} for dtype in short.values()]
    return forward, backward, reduce


_FORWARD_VARIANTS, _BACKWARD_VARIANTS, _REDUCE_VARIANTS = _aot_variants()
aot.register(_dyt_forward_kernel, name="dyt_forward", variants=_FORWARD_VARIANTS)
aot.register(_dyt_backward_kernel, name="dyt_backward", variants=_BACKWARD_VARIANTS)
aot.register(_dyt_reduce_kernel, name="dyt_reduce", variants=_REDUCE_VARIANTS)


# --------------------------------------------------------------------------------------------
# Steps (memkernels/fusions/op_spec.py): the forward and the backward, each taking ``backend`` last.


def _forward(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
             backend: str) -> torch.Tensor:
    x2d, dtype = _rows_of(x), reference.output_dtype(x, alpha, weight, bias)
    implementation = _forward_triton if backend == "triton" else reference.forward
    return implementation(x2d, alpha, weight, bias, dtype).view(x.shape)


def _forward_fake(x, alpha, weight, bias, backend):
    return x.new_empty(x.shape, dtype=reference.output_dtype(x, alpha, weight, bias))


def _backward(grad: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor,
              bias_dtype: Optional[torch.dtype], needs_x: bool, needs_params: bool,
              backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dalpha, dweight, dbias), each in its input's dtype (the bias's is ``bias_dtype``; None: no bias); an
    empty tensor for each one not asked for (a custom op returns no None)."""
    implementation = _backward_triton if backend == "triton" else reference.backward
    dx, *params = implementation(_rows_of(grad), _rows_of(x), alpha, weight, bias_dtype, needs_x, needs_params)
    return (x.new_empty(0) if dx is None else dx.view(x.shape), *(x.new_empty(0) if g is None else g for g in params))


def _backward_fake(grad, x, alpha, weight, bias_dtype, needs_x, needs_params, backend):
    cols = x.shape[-1]
    return (x.new_empty(x.shape if needs_x else 0), alpha.new_empty(alpha.shape if needs_params else 0),
            weight.new_empty(cols if needs_params else 0),
            x.new_empty(0) if not needs_params or bias_dtype is None else x.new_empty(cols, dtype=bias_dtype))


# --------------------------------------------------------------------------------------------
# Autograd and the declaration: x alone is saved (and the parameters, which autograd keeps anyway).


def _setup_context(ctx, inputs, output):
    x, alpha, weight, bias, backend = inputs
    ctx.save_for_backward(x, alpha, weight)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.backend = backend


def _backward_formula(ctx, steps, grad):
    x, alpha, weight = ctx.saved_tensors
    needs_x, needs_alpha, needs_weight, needs_bias = ctx.needs_input_grad[:4]
    needs_params = needs_alpha or needs_weight or needs_bias
    if not (needs_x or needs_params):
        return None, None, None, None, None
    dx, dalpha, dweight, dbias = steps.backward(grad, x, alpha, weight, ctx.bias_dtype, needs_x, needs_params,
                                                ctx.backend)
    return (dx if needs_x else None, dalpha if needs_alpha else None, dweight if needs_weight else None,
            dbias if needs_bias else None, None)


DYT = OpSpec("dyt", Step("dyt", _forward, _forward_fake),
             steps={"backward": Step("dyt_backward", _backward, _backward_fake)},
             setup_context=_setup_context, backward=_backward_formula,
             # PyTorch's autocast leaves mul, tanh and add alone: the inputs are taken as they are (16-bit x with
             # float32 parameters promotes to float32, as eager does).
             autocast={"cpu": None, "cuda": None}, fake_on_meta=True)


# --------------------------------------------------------------------------------------------
# Public function


def unsupported(x, alpha, weight, bias=None, backend=None):
    """Why :func:`dyt` cannot take these arguments, as the exception it raises; None when it can.

    ``backend`` as :func:`dyt`'s; with None, the one memkernels.set_backend resolves for x.
    """
    for name, tensor, layout in (("x", x, "[..., hidden]"), ("alpha", alpha, "of one element ([] or [1])"),
                                 ("weight", weight, "[hidden]"), ("bias", bias, "[hidden] or None")):
        if tensor is None and name == "bias":
            continue
        if not isinstance(tensor, torch.Tensor):
            return TypeError(f"dyt: {name} must be a torch.Tensor {layout}, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            return TypeError(f"dyt: {name} is {tensor.dtype}; pass a floating-point tensor")
        if tensor.device != x.device:
            return ValueError(f"dyt: {name} is on {tensor.device} but x is on {x.device}; move them to one device")
    if x.dim() < 1:
        return ValueError("dyt: x is 0-dimensional; pass [..., hidden] (the hidden size last)")
    if alpha.numel() != 1 or alpha.dim() > 1:
        return ValueError(f"dyt: alpha has shape {tuple(alpha.shape)}; pass one element ([] or [1]): DyT's alpha is "
                          "a learned scalar")
    hidden = x.shape[-1]
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tuple(tensor.shape) != (hidden,):
            return ValueError(f"dyt: {name} has shape {tuple(tensor.shape)} but x's last dimension is {hidden}; "
                              f"pass [{hidden}] (DyT scales the last dimension; a channels-first input needs "
                              "x.movedim(1, -1))")
    try:  # an unknown backend, 'triton' where it cannot run or on a dtype it does not take
        if DYT.backend(backend, x, what="x") == "triton":
            for name, tensor in (("alpha", alpha), ("weight", weight), ("bias", bias)):
                if tensor is not None:
                    DYT.backend("triton", tensor, what=name)
    except (ValueError, TypeError, RuntimeError) as error:
        return error
    return None


def dyt(x, alpha, weight, bias=None, *, backend=None):
    """Dynamic Tanh: ``weight * tanh(alpha * x) + bias`` over x's last dimension.

    Args:
        x: [..., hidden], any floating dtype (float32, float16, bfloat16 on the Triton path), any strides.
        alpha: the learned scalar, one element ([] or [1]).
        weight: [hidden]. bias: [hidden] or None.
        backend: None picks by device (Triton on CUDA, the PyTorch reference elsewhere, see
            memkernels.set_backend); "torch" forces the reference, "triton" the kernels.

    Returns:
        y: x's shape, contiguous, in the dtype eager's ``weight * torch.tanh(alpha * x) + bias`` gives (16-bit x
        with float32 parameters: float32). Math in float32, rounded once. Saved for backward: x (and the
        parameters), where eager also saves tanh's output; the gradients come in each input's dtype.
    """
    problem = unsupported(x, alpha, weight, bias, backend)
    if problem is not None:
        raise problem
    return dyt_checked(x, alpha, weight, bias, backend)


def dyt_checked(x, alpha, weight, bias=None, backend=None):
    """:func:`dyt` for arguments :func:`unsupported` has accepted (apply()'s patched forwards ask it first, to
    fall back to the module's own forward): the checks not run twice a call."""
    return DYT(x, alpha, weight, bias, DYT.backend(backend, x, what="x"))
