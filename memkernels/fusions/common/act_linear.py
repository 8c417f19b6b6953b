"""The activation-linear family: ``y = (act(gate) * up) @ W.T + b`` (gated_linear) and ``y = act(x) @ W.T
+ b`` (gelu_linear, no up) with every GEMM in cuBLAS and one fused elementwise pass around each.

Eager PyTorch keeps act(gate) and the product for backward besides gate and up (a GeLU MLP: gelu(x)
besides x). Here only gate and up (x) are saved; the product is formed when a GEMM needs it, into a
transient buffer that is freed at once:

- forward:  c = act(gate) * up       one elementwise pass: fp32 math, rounded once to the dtype
            y = c @ W.T + b           cuBLAS (mm or addmm into y); c is freed
- backward: g = dy @ W                cuBLAS, [M, I]: dL/dc
            one pass reads g, gate, up and writes d_gate = g * up * act'(gate), d_up = g * act(gate),
            and c over g (the buffer is done with)
            dW = dy.T @ c             cuBLAS
            db = dy.sum(0)            a deterministic torch reduction (the callers')

So backward holds one I-wide buffer beyond the gradients, as eager does. Why not fuse the activation
into the GEMM's tile loads: each element would then be activated once per output tile (N / BLOCK_N
times in the forward, M / BLOCK_M in dW) on CUDA cores while the tensor cores wait; on an H200 such a
Triton GEMM ran at 0.21-0.64x eager (docs/gpu-runs.md).

Where c would exceed ``TRANSIENT_BYTES``, the forward runs in row chunks of at least
``MIN_CHUNK_ROWS`` tokens and the backward in column slabs of at least ``MIN_SLAB_COLS`` features,
each chunk's result final, so that no GEMM falls below the sizes cuBLAS runs efficiently.

The elementwise passes are the Triton kernels below (``backend="triton"``) or their PyTorch
twins in memkernels/fusions/common/act_linear_reference.py (``backend="torch"``): one algorithm on both paths,
so the CPU tests check what runs on the GPU.

File order: activation math → kernels → launchers → the algorithm (the ops' steps call it; their OpSpecs
are gelu_linear's and gated_linear's).
"""
import types

import torch
import triton
import triton.language as tl

from memkernels import aot
from memkernels.distributed import contiguous_stride, dtensor_class, is_dtensor
from memkernels.fusions.common import act_linear_reference as reference
from memkernels.fusions.common.device_guard import on_tensor_device
from memkernels.fusions.common.host import cdiv, next_power_of_2

# --------------------------------------------------------------------------------------------
# Activation math in fp32. The interpreter's libdevice is a stub, so erf and tanh are built from
# tl.exp and polynomials.


@triton.jit
def _erf(x):
    """erf(x) in fp32, max |error| 2.4 * 2**-24 against float64 erf (tests/test_gelu_linear.py bounds it by 3 * 2**-24).

    Coefficients are least-squares fits (float64, Chebyshev nodes) of erf(x)/x as a
    polynomial in x*x on [0, 0.6], and of log(erfc(x)) as a polynomial in x on [0.6, 4];
    beyond 4, 1 - erfc rounds to 1 in fp32.
    """
    a = tl.abs(x)
    a2 = a * a
    small = 1.128379226 + a2 * (-0.3761263788 + a2 * (0.1128372848 + a2 * (
        -0.02685812674 + a2 * (0.005178681109 + a2 * -0.0007369763334))))
    small = a * small
    t = tl.minimum(a, 4.0)
    log_erfc = 1.562877296e-4 + t * (-1.129458666 + t * (-0.6333909035 + t * (-0.1083063558 + t * (
        0.02517550811 + t * (-0.004196306225 + t * (4.323807370e-4 + t * (
            -1.611042171e-5 + t * (-1.458452402e-6 + t * 1.386701740e-7))))))))
    large = 1.0 - tl.exp(log_erfc)
    result = tl.where(a < 0.6, small, large)
    return tl.where(x < 0, -result, result)


@triton.jit
def tanh_sech2(z):
    """(tanh(z), 1 - tanh(z)^2) for fp32 z, each within about one rounding *relative* to its value (measured
    over [-4, 4] in the interpreter against float64: tanh 0.8 ulp, torch.tanh's float32 0.5): DyT's weight
    gradient sums g * t, where small |z| make small t, and (1 - e) / (1 + e) with e = exp(-2|z|) would cancel
    there (2.4 ulps at |z| = 0.3, more below).

    |z| < 1: z + z^3 q(z^2), q a least-squares fit (float64, Chebyshev nodes on [0, 1], relative error
    1e-9) of (tanh(z) - z) / z^3; beyond, 1 - 2e / (1 + e). 1 - t^2 from t while |t| < 0.5 (no cancellation),
    from e beyond: 4e / (1 + e)^2, which keeps its relative accuracy where 1 - t^2 is small."""
    a = tl.abs(z)
    z2 = z * z
    q = -3.3333297821e-01 + z2 * (1.3332380769e-01 + z2 * (-5.3881746925e-02 + z2 * (2.1491645647e-02 + z2 * (
        -7.9527460511e-03 + z2 * (2.3057942292e-03 + z2 * -3.5962396227e-04)))))
    e = tl.exp(-2.0 * a)  # never overflows
    one_plus_e = 1.0 + e
    large = 1.0 - 2.0 * e / one_plus_e
    t = tl.where(a < 1.0, z + z * z2 * q, tl.where(z < 0, -large, large))
    sech2 = tl.where(tl.abs(t) < 0.5, 1.0 - t * t, 4.0 * e / (one_plus_e * one_plus_e))
    return t, sech2


@triton.jit
def _act(x, ACTIVATION: tl.constexpr):
    """act(x) for fp32 x: ACTIVATION is "gelu" (erf), "gelu_tanh" or "silu" (x * sigmoid(x))."""
    if ACTIVATION == "silu":
        return x / (1.0 + tl.exp(-x))  # exp overflows to inf for x < -88: x / inf = -0, silu's limit
    elif ACTIVATION == "gelu_tanh":
        t, _ = tanh_sech2(0.7978845608028654 * (x + 0.044715 * x * x * x))
        return 0.5 * x * (1.0 + t)
    else:
        return 0.5 * x * (1.0 + _erf(x * 0.7071067811865476))


@triton.jit
def _act_grad(x, ACTIVATION: tl.constexpr):
    """d act(x) / dx for fp32 x (see _act)."""
    if ACTIVATION == "silu":
        sigmoid = 1.0 / (1.0 + tl.exp(-x))
        return sigmoid * (1.0 + x * (1.0 - sigmoid))
    elif ACTIVATION == "gelu_tanh":
        t, sech2 = tanh_sech2(0.7978845608028654 * (x + 0.044715 * x * x * x))
        dinner = 0.7978845608028654 * (1.0 + 0.134145 * x * x)
        return 0.5 * (1.0 + t) + 0.5 * x * sech2 * dinner
    else:
        cdf = 0.5 * (1.0 + _erf(x * 0.7071067811865476))
        return cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327


# --------------------------------------------------------------------------------------------
# Kernels: one program per (row, BLOCK columns). Rows may be strided (gate and up are halves of a
# packed gate_up, a column slab of a wider buffer); columns are contiguous (the launchers see to it).


@triton.jit
def _product_kernel(
    gate_ptr, up_ptr, out_ptr,  # [M, n_cols] each; up read only when GATED
    n_cols, stride_gate, stride_up, stride_out,  # row strides, in elements
    GATED: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: M * stride can pass 2**31 for long sequences
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    c = _act(tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32), ACTIVATION)
    if GATED:  # act(gate) * up formed in fp32 and rounded once
        c *= tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, c.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _product_backward_kernel(
    grad_ptr,  # [M, n_cols] dL/dc in; c out when WRITE_PRODUCT
    gate_ptr, up_ptr,  # [M, n_cols]; up read only when GATED
    grad_gate_ptr, grad_up_ptr,  # [M, n_cols] out; grad_up written only when GATED
    n_cols, stride_grad, stride_gate, stride_up, stride_grad_gate, stride_grad_up,
    GATED: tl.constexpr, WRITE_PRODUCT: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    grad = tl.load(grad_ptr + row * stride_grad + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    activated = _act(gate, ACTIVATION)
    grad_gate = grad * _act_grad(gate, ACTIVATION)
    if GATED:
        up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_up_ptr + row * stride_grad_up + cols, (grad * activated).to(grad_up_ptr.dtype.element_ty),
                 mask=mask)
        grad_gate *= up
        activated *= up
    tl.store(grad_gate_ptr + row * stride_grad_gate + cols, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    if WRITE_PRODUCT:  # each element is read above before it is overwritten here, by the same program
        tl.store(grad_ptr + row * stride_grad + cols, activated.to(grad_ptr.dtype.element_ty), mask=mask)


_MAX_BLOCK = 1024  # 8 elements a thread at 4 warps: 16-byte accesses in 16-bit dtypes


def _block(n_cols):
    return min(_MAX_BLOCK, max(16, next_power_of_2(n_cols)))


def _warps(block):
    return max(1, min(4, block // 256))


def _aot_variants():
    """Both kernels for each dtype, gated or not, with the exact-erf GeLU (the heaviest activation)
    and with SiLU, at the widest block, specialized as the JIT specializes a model's launch: pointers
    16-byte aligned and the width and row strides multiples of 16 (a model's I is)."""
    variants = {}
    for dtype in ("bf16", "fp16", "fp32"):
        for gated in (False, True):
            for activation in ("gelu", "silu"):
                common = dict(GATED=gated, ACTIVATION=activation, BLOCK=_MAX_BLOCK)
                label = f"{dtype} {'gated' if gated else 'plain'} {activation}"
                forward_pointers = ("gate_ptr", "up_ptr", "out_ptr")
                signature = {**{name: f"*{dtype}" for name in forward_pointers},
                             **{name: "i32" for name in ("n_cols", "stride_gate", "stride_up", "stride_out")}}
                variants.setdefault("act_linear_product", []).append(_variant(signature, common, f"fwd {label}"))
                backward_pointers = ("grad_ptr", "gate_ptr", "up_ptr", "grad_gate_ptr", "grad_up_ptr")
                signature = {**{name: f"*{dtype}" for name in backward_pointers},
                             **{name: "i32" for name in ("n_cols", "stride_grad", "stride_gate", "stride_up",
                                                         "stride_grad_gate", "stride_grad_up")}}
                variants.setdefault("act_linear_product_backward", []).append(
                    _variant(signature, dict(common, WRITE_PRODUCT=True), f"bwd {label}"))
    return variants


def _variant(signature, constexprs, label):
    return {"signature": {**signature, **{name: "constexpr" for name in constexprs}}, "constexprs": constexprs,
            "num_warps": _warps(_MAX_BLOCK), "num_stages": 1, "label": label,
            "aligned": [name for name, kind in signature.items() if kind != "constexpr"]}


for _name, _variants in _aot_variants().items():
    aot.register({"act_linear_product": _product_kernel, "act_linear_product_backward": _product_backward_kernel}[_name],
                 name=_name, variants=_variants)


# --------------------------------------------------------------------------------------------
# Launchers: the Triton twins of memkernels.fusions.common.act_linear_reference's passes (same contracts).


def _unit_columns(tensor):
    """``tensor`` if its columns are contiguous, else a contiguous copy (the kernels step rows only)."""
    return tensor if tensor.shape[1] <= 1 or tensor.stride(1) == 1 else tensor.contiguous()


def _grid(tensor):
    return (tensor.shape[0], cdiv(tensor.shape[1], _block(tensor.shape[1])))


@on_tensor_device
def _product_triton(gate, up, name):
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    if gate.numel() == 0:
        return out
    gate = _unit_columns(gate)
    up = gate if up is None else _unit_columns(up)  # never read when not gated
    block = _block(gate.shape[1])
    _product_kernel[_grid(gate)](gate, up, out, gate.shape[1], gate.stride(0), up.stride(0), out.stride(0),
                                 GATED=up is not gate, ACTIVATION=name, BLOCK=block, num_warps=_warps(block))
    return out


@on_tensor_device
def _product_backward_triton(grad, gate, up, name, grad_gate, grad_up, write_product):
    if gate.numel() == 0:
        return
    gated = up is not None
    gate = _unit_columns(gate)
    up = _unit_columns(up) if gated else gate
    grad_up = grad_up if gated else grad_gate
    block = _block(gate.shape[1])
    _product_backward_kernel[_grid(gate)](
        grad, gate, up, grad_gate, grad_up, gate.shape[1], grad.stride(0), gate.stride(0), up.stride(0),
        grad_gate.stride(0), grad_up.stride(0),
        GATED=gated, WRITE_PRODUCT=write_product, ACTIVATION=name, BLOCK=block, num_warps=_warps(block))


# backend -> the elementwise passes the algorithm calls
PASSES = {
    "triton": types.SimpleNamespace(product=_product_triton, product_backward=_product_backward_triton),
    "torch": reference,
}


# --------------------------------------------------------------------------------------------
# The algorithm (both backends). gate2d, up2d: [M, I] views (up2d None: no gate, gelu_linear);
# weight [N, I]; bias [N] or None; activation one of reference.ACTIVATIONS.

# A product c bigger than this is formed a chunk at a time (module constants: tests shrink them).
TRANSIENT_BYTES = 1 << 30
MIN_CHUNK_ROWS = 4096  # tokens per forward chunk, at least: the GEMM stays compute-bound
MIN_SLAB_COLS = 2048  # features per backward slab, at least


def _chunk(length, other, element_size, minimum):
    """How much of ``length`` to take at once so that a [chunk, other] buffer fits TRANSIENT_BYTES (at
    least ``minimum``); ``length`` itself when the whole buffer fits."""
    if length * other * element_size <= TRANSIENT_BYTES:
        return max(length, 1)
    return max(minimum, TRANSIENT_BYTES // max(1, other * element_size))


def forward(gate2d, up2d, weight, bias, activation, backend, lead=None):
    """y [*lead, N] (``lead`` default [M]) = (act(gate2d) * up2d) @ weight.T (+ bias), c formed in row chunks where
    it is large. The GEMMs write into y itself, not into a 2-D buffer viewed as y: an op that returns a view of its
    own buffer returns an output autograd forbids to modify in place (Llama-4's MoE adds into its shared expert's)."""
    return forward_with_adapter(gate2d, up2d, weight, bias, None, activation, backend, lead)[0]


def forward_with_adapter(gate2d, up2d, weight, bias, adapter, activation, backend, lead=None):
    """(y, t): y as :func:`forward`, and t [*lead, R] = c @ adapter.T in ``adapter``'s dtype from the same c (a LoRA
    A [R, I] on the down projection: c cast to its dtype, as peft casts its input; None: t is None)."""
    passes = PASSES[backend]
    rows, width = gate2d.shape
    lead = (rows,) if lead is None else lead
    out = gate2d.new_empty(*lead, weight.shape[0])
    out2d = out.view(rows, weight.shape[0])
    low = None if adapter is None else gate2d.new_empty(*lead, adapter.shape[0], dtype=adapter.dtype)
    step = _chunk(rows, width, gate2d.element_size(), MIN_CHUNK_ROWS)
    for start in range(0, rows, step):
        part = slice(start, start + step)
        product = passes.product(gate2d[part], None if up2d is None else up2d[part], activation)
        if bias is None:
            torch.mm(product, weight.t(), out=out2d[part])
        else:
            torch.addmm(bias, product, weight.t(), out=out2d[part])
        if adapter is not None:
            torch.mm(product.to(adapter.dtype), adapter.t(), out=low.view(rows, adapter.shape[0])[part])
        del product  # before the next chunk's is formed
    return out, low


def grad_input_buffers(gate2d, gated, packed):
    """(list returned, d_gate [M, I] view, d_up [M, I] view or None): one [M, 2*I] buffer when ``packed``."""
    rows, width = gate2d.shape
    if packed:
        grads = gate2d.new_empty(rows, 2 * width)
        return [grads], grads[:, :width], grads[:, width:]
    grad_gate = gate2d.new_empty(rows, width)
    if not gated:
        return [grad_gate], grad_gate, None
    grad_up = gate2d.new_empty(rows, width)
    return [grad_gate, grad_up], grad_gate, grad_up


def backward(grad_out2d, gate2d, up2d, weight, packed, needs_inputs, needs_weight, activation, backend, adapter=None,
             grad_low2d=None, needs_adapter=False):
    """The gradients of gate and up (when ``needs_inputs``: [one [M, 2*I] tensor] if ``packed``, else
    [d_gate, d_up], or [d_x] with no up) followed by dW [N, I] (when ``needs_weight``) and, with an ``adapter``
    (:func:`forward_with_adapter`'s, its output's gradient ``grad_low2d`` [M, R]), its gradient [R, I] (when
    ``needs_adapter``), as one list.

    Column slab by column slab where c is large: g = dy @ W[:, slab] (+ dt @ A[:, slab], rounded to g's dtype
    and added, as autograd sums the two uses of c), the pass turning g into c, and dW[:, slab] = dy.T @ c,
    dA[:, slab] = dt.T @ c in A's dtype, each slab's results final."""
    passes = PASSES[backend]
    rows, width = gate2d.shape
    grads, grad_gate, grad_up = grad_input_buffers(gate2d, up2d is not None, packed) if needs_inputs else ([], None,
                                                                                                           None)
    step = _chunk(width, rows, gate2d.element_size(), MIN_SLAB_COLS)
    whole = step >= width
    grad_weight = None if whole or not needs_weight else grad_out2d.new_empty(weight.shape[0], width)
    grad_adapter = None if not needs_adapter else grad_low2d.new_empty(adapter.shape)
    for start in range(0, max(width, 1), step):
        part = slice(start, start + step)
        gate = gate2d[:, part]
        up = None if up2d is None else up2d[:, part]
        if needs_inputs:
            product = grad_out2d @ weight[:, part]  # dL/dc, then c
            if adapter is not None:
                product += (grad_low2d @ adapter[:, part]).to(product.dtype)
            passes.product_backward(product, gate, up, activation, grad_gate[:, part],
                                    None if grad_up is None else grad_up[:, part], needs_weight or needs_adapter)
        else:
            product = passes.product(gate, up, activation)
        if needs_weight and whole:
            grad_weight = grad_out2d.t() @ product
        elif needs_weight:
            torch.mm(grad_out2d.t(), product, out=grad_weight[:, part])
        if needs_adapter:
            torch.mm(grad_low2d.t(), product.to(adapter.dtype), out=grad_adapter[:, part])
        del product
    return grads + ([grad_weight] if needs_weight else []) + ([grad_adapter] if needs_adapter else [])


def backward_keeping_product(grad_out2d, gate2d, up2d, weight, packed, activation, backend):
    """backward's input gradients followed by the product c [M, I] itself in place of dW, as one list: for a
    caller that sums dW over token chunks (gated_mlp_recompute's chunked backward: dW += dy.T @ c into a
    float32 buffer). c is formed over g in the pass that gives the gradients, as in backward; one slab,
    so the caller keeps [M, I] within TRANSIENT_BYTES."""
    grads, grad_gate, grad_up = grad_input_buffers(gate2d, up2d is not None, packed)
    product = grad_out2d @ weight  # dL/dc, then c
    PASSES[backend].product_backward(product, gate2d, up2d, activation, grad_gate, grad_up, True)
    return grads + [product]


def backward_keeping_product_fake(grad_out2d, gate2d, up2d, weight, packed, activation, backend):
    """backward_keeping_product's outputs, unfilled."""
    return grad_input_buffers(gate2d, up2d is not None, packed)[0] + [gate2d.new_empty(gate2d.shape)]


def backward_fake(grad_out2d, gate2d, up2d, weight, packed, needs_inputs, needs_weight, activation, backend,
                  adapter=None, grad_low2d=None, needs_adapter=False):
    """backward's outputs, unfilled (the custom op's fake implementation)."""
    grads = grad_input_buffers(gate2d, up2d is not None, packed)[0] if needs_inputs else []
    return (grads + ([grad_out2d.new_empty(weight.shape[0], gate2d.shape[1])] if needs_weight else [])
            + ([grad_low2d.new_empty(adapter.shape)] if needs_adapter else []))


def bias_grad(grad_out2d):
    """The bias gradient of a linear layer: grad_out2d [M, N] summed over its M tokens into [N], as eager's
    autograd does: one deterministic reduction (no atomics) that accumulates half dtypes in float32 and
    rounds once (float64 stays float64). A float32 sum cast back would be one launch and one copy more."""
    return grad_out2d.sum(0)


def on_dtensors(owner, operands, weight, bias, run_local):
    """An act-linear op on DTensors (tensor parallelism), each rank on its own shards, one mesh dim at a time:
    ``operands`` ([..., I] each: gate and up, or gelu_linear's x) sharded over I (a colwise projection's output)
    with ``weight`` [N, I] sharded over its I columns (a rowwise projection) give partial sums, as RowwiseParallel's
    own matmul does; operands sharded over tokens (or replicated) with a replicated weight give a result sharded (or
    replicated) as they are. ``run_local(local operands, local weight)`` is the op without bias; a replicated bias
    is added once, by DTensor (which sums partial results first). Returns a DTensor [..., N]."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    names = "the operands, weight (and bias)"
    if not all(is_dtensor(t) for t in (*operands, weight)) or (bias is not None and not is_dtensor(bias)):
        raise ValueError(f"{owner}: {names} must all be DTensors or all plain tensors; under parallelize_module pass "
                         "ColwiseParallel(use_local_output=False) outputs, or .to_local() everything")
    first = operands[0]
    mesh, placements = first.device_mesh, tuple(first.placements)
    if any(tuple(t.placements) != placements or t.device_mesh != mesh for t in operands) \
            or weight.device_mesh != mesh:
        raise ValueError(f"{owner}: {names} must share one mesh, and the operands one layout; got "
                         f"{[tuple(t.placements) for t in operands]}")
    last = first.dim() - 1
    out, out_grad, weight_grad = [], [], []
    for dim, (mine, theirs) in enumerate(zip(placements, weight.placements)):
        over_width = isinstance(mine, Shard) and mine.dim % first.dim() == last
        if over_width and theirs == Shard(1):
            out.append(Partial())  # each rank sums over its slice of I
            out_grad.append(Replicate())
            weight_grad.append(Shard(1))
        elif not over_width and not isinstance(mine, Partial) and isinstance(theirs, Replicate):
            out.append(mine)
            out_grad.append(mine)
            weight_grad.append(Partial() if isinstance(mine, Shard) else Replicate())
        else:
            raise ValueError(f"{owner}: on mesh dim {dim}, the operands are placed {mine} and weight {theirs}; "
                             "supported: operands Shard over I with weight Shard(1) (colwise then rowwise), or "
                             "operands Shard over a token dim or Replicate with weight Replicate")
    if bias is not None and not all(isinstance(p, Replicate) for p in bias.placements):
        raise ValueError(f"{owner}: bias must be replicated, got {tuple(bias.placements)}")
    local = run_local([t.to_local() for t in operands], weight.to_local(grad_placements=weight_grad))
    shape = (*first.shape[:-1], weight.shape[0])
    result = dtensor_class().from_local(local, mesh, out, shape=torch.Size(shape), stride=contiguous_stride(shape),
                                        grad_placements=out_grad)
    return result if bias is None else result + bias
