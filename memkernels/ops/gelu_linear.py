"""GeLU→Linear in one Triton GEMM: ``y = gelu(x) @ weight.T + bias`` without storing gelu(x).

Eager PyTorch keeps two F-wide tensors for backward (GELU saves x, Linear saves
gelu(x)). Here GeLU is applied to the A tiles as they are loaded, so gelu(x)
never reaches memory, and only x is saved. Backward recomputes it the same way:

- forward: y  = gelu(x) @ W.T (+ b)        GeLU on load of A, bias in the epilogue
- dx:      dx = (dy @ W) * gelu'(x)       gelu' multiplied in the epilogue from the x tile
- dW:      dW = dy.T @ gelu(x)            GeLU on load of B
- db:      db = dy.sum(0)                 a deterministic torch reduction

All three GEMMs are one kernel, ``_act_gemm_kernel``, specialized by constexpr
flags. Each computes C [M, N] = A [M, K] @ B [K, N] with strides, so transposed
operands (dy.T, W.T, a non-contiguous weight) are read in place. The same kernel
serves memkernels/ops/gated_linear.py (SwiGLU / GeGLU, flag GATED): the activated
operand is then act(gate) * up, and the dx epilogue writes both halves' gradients.

File order: jit helpers → kernel → launchers → custom ops → autograd → public
function.
"""

import functools

import torch
import triton
import triton.language as tl

from memkernels import aot
from memkernels.ops._device_guard import on_tensor_device
from memkernels._backend import resolve, triton_interpreted
from memkernels.ops import _autocast
from memkernels.ops._custom_op import apply_op, autograd_pair, custom_op
from memkernels.reference import gelu_linear as reference

APPROXIMATIONS = ("none", "tanh")
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Activation math in fp32 (GeLU, and SiLU for gated_linear). The interpreter's libdevice is a
# stub, so erf and tanh are built from tl.exp and polynomials.


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
def _tanh_sech2(x):
    """(tanh(x), 1 - tanh(x)**2) from e = exp(-2|x|), which never overflows.

    sech^2 = 4e / (1 + e)^2 keeps full relative accuracy where 1 - tanh^2 would cancel.
    """
    e = tl.exp(-2.0 * tl.abs(x))
    one_plus_e = 1.0 + e
    t = (1.0 - e) / one_plus_e
    return tl.where(x < 0, -t, t), 4.0 * e / (one_plus_e * one_plus_e)


@triton.jit
def _act(x, ACTIVATION: tl.constexpr):
    """act(x) for fp32 x: ACTIVATION is "gelu" (erf), "gelu_tanh" or "silu" (x * sigmoid(x))."""
    if ACTIVATION == "silu":
        return x / (1.0 + tl.exp(-x))  # exp overflows to inf for x < -88: x / inf = -0, silu's limit
    elif ACTIVATION == "gelu_tanh":
        t, _ = _tanh_sech2(0.7978845608028654 * (x + 0.044715 * x * x * x))
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
        t, sech2 = _tanh_sech2(0.7978845608028654 * (x + 0.044715 * x * x * x))
        dinner = 0.7978845608028654 * (1.0 + 0.134145 * x * x)
        return 0.5 * (1.0 + t) + 0.5 * x * sech2 * dinner
    else:
        cdf = 0.5 * (1.0 + _erf(x * 0.7071067811865476))
        return cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327


# --------------------------------------------------------------------------------------------
# Tuning. (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): tensor-core tiles whose pipelined A
# and B stages fit the shared memory of A100 (164 KiB) and H100 (228 KiB) in every dtype (at most
# 96 KiB, e.g. fp32 128x128x32 with 3 stages), and that compile without spills on sm_80 and sm_90 in
# all three GEMM roles when the JIT can specialize on 16-divisible pointers and strides (GeLU
# math on a tile costs registers: 128x128 tiles need 8 warps, BLOCK_K = 64 only fits the
# smaller tiles). The 32-row tiles serve decode-sized M.
_CONFIGS = (
    (128, 128, 32, 8, 3),
    (128, 64, 32, 4, 4),
    (64, 128, 32, 4, 4),
    (64, 64, 64, 4, 3),
    (64, 64, 32, 4, 4),
    (32, 64, 64, 2, 4),
    (32, 64, 32, 2, 5),
)
# fp32 with torch's default "highest" matmul precision runs tl.dot as FMAs ("ieee"), which needs
# far more registers: only these compile without spills (dW, whose A operand is dy.T, needs
# BLOCK_K = 16).
_IEEE_CONFIGS = {
    "fwd": ((128, 128, 32, 8, 3), (64, 64, 32, 4, 4), (32, 64, 32, 2, 5)),
    "dw": ((64, 64, 16, 8, 3), (64, 32, 16, 4, 3)),
}
_IEEE_CONFIGS["dx"] = _IEEE_CONFIGS["fwd"]
# Misaligned launches (see _jit_sees_aligned) load tiles one element at a time instead of in
# 16-byte pieces, and need more registers: per (role, operand kind) the tile shapes that still compile
# without spills on sm_80 and sm_90 when nothing is known to be 16-divisible, or only the pointers
# are not (measured with memkernels.aot; tests/test_aot_ops.py keeps them honest). No "ieee" forward/dx shape above
# survives that, so those borrow dW's BLOCK_K = 16 shapes.
_MISALIGNED_16BIT = {
    "fwd": ((128, 128, 32, 8, 3), (64, 64, 32, 4, 4)),
    "dx": ((64, 64, 32, 4, 4), (32, 64, 64, 2, 4), (32, 64, 32, 2, 5)),
    "dw": ((128, 128, 32, 8, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 4, 4), (32, 64, 32, 2, 5)),
}
MISALIGNED_CONFIGS = {
    **{(role, operand): configs for role, configs in _MISALIGNED_16BIT.items() for operand in ("bf16", "fp16")},
    ("fwd", "fp32"): ((64, 64, 32, 4, 4),),
    ("dx", "fp32"): ((64, 64, 32, 4, 4),),
    ("dw", "fp32"): _MISALIGNED_16BIT["dw"],
    **{(role, "fp32-ieee"): _IEEE_CONFIGS["dw"] for role in ("fwd", "dx", "dw")},
}

# gated_linear's launches (GATED=True) load an up tile beside each activated one, and the dx epilogue
# reads gate and up and writes two outputs: more registers than GeLU alone. (role, operand kind,
# aligned) -> the tile shapes that compile without spills on sm_80 and sm_90 (measured with
# memkernels.aot; tests/test_aot_ops.py keeps them honest). No 128-wide dx tile survives the epilogue;
# misaligned launches need 8 warps for 64x64 tiles, or narrower ones.
_GATED_DX_ALIGNED = ((64, 64, 64, 4, 3), (64, 64, 32, 4, 4), (32, 64, 64, 2, 4), (32, 64, 32, 2, 5))
_GATED_MISALIGNED = ((64, 64, 32, 8, 3), (64, 32, 32, 4, 4), (32, 32, 16, 2, 4))
_GATED_MISALIGNED_IEEE = ((64, 64, 16, 8, 3), (64, 32, 16, 4, 3), (32, 32, 16, 2, 4))
GATED_CONFIGS = {
    ("fwd", "bf16", True): _CONFIGS, ("fwd", "fp16", True): _CONFIGS[1:], ("fwd", "fp32", True): _CONFIGS,
    ("fwd", "fp32-ieee", True): _IEEE_CONFIGS["fwd"],
    **{("dx", operand, True): _GATED_DX_ALIGNED for operand in ("bf16", "fp16", "fp32")},
    ("dx", "fp32-ieee", True): ((64, 64, 32, 4, 4), (32, 64, 32, 2, 5)),
    ("dw", "bf16", True): _CONFIGS, ("dw", "fp16", True): _CONFIGS[:-1],
    ("dw", "fp32", True): _CONFIGS[:5] + _CONFIGS[6:], ("dw", "fp32-ieee", True): _IEEE_CONFIGS["dw"],
    # 64x64 with 8 warps spills in a sliced 16-bit forward on sm_80 (capped at 128 registers)
    **{("fwd", operand, False): _GATED_MISALIGNED[1:] for operand in ("bf16", "fp16")},
    ("fwd", "fp32", False): _GATED_MISALIGNED,
    **{("dx", operand, False): _GATED_MISALIGNED for operand in ("bf16", "fp16", "fp32")},
    **{("dw", operand, False): ((128, 128, 32, 8, 3), (128, 64, 32, 4, 4), (64, 64, 32, 4, 4), (32, 32, 16, 2, 4))
       for operand in ("bf16", "fp16")},
    ("dw", "fp32", False): _GATED_MISALIGNED,
    **{(role, "fp32-ieee", False): _GATED_MISALIGNED_IEEE for role in ("fwd", "dx", "dw")},
}

# Hopper (sm_90) launches of aligned 16-bit operands also try BLOCK_K = 64 tiles for its warpgroup
# MMAs. On the H200 the act-GEMM's best tile of _CONFIGS ran fc2 [4096, 4096] -> 1024 at 0.34x
# cuBLAS and the SwiGLU MLP at 0.65x (docs/gpu-runs.md), without these among its candidates. They compile
# without spills on sm_90 only (128x128x64 forwards spill 152 bytes on sm_80), so only Hopper
# launches offer them to the autotuner, which keeps them only where they are faster; gated dx
# tiles stop at 128x64 (128x128x64 spills 536 bytes there). Not yet timed on a GPU.
_HOPPER_TILES = ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4))
_HOPPER_DW = _HOPPER_TILES + ((256, 128, 64, 8, 3),)
HOPPER_CONFIGS = {
    **{(role, operand, gated): _HOPPER_TILES for role in ("fwd", "dx") for operand in ("bf16", "fp16")
       for gated in (False, True)},
    **{("dx", operand, True): ((128, 64, 64, 8, 3), (64, 128, 64, 8, 3)) for operand in ("bf16", "fp16")},
    **{("dw", operand, gated): _HOPPER_DW for operand in ("bf16", "fp16") for gated in (False, True)},
}
HOPPER_ARCH = 90


def _role(act_on_b, act_grad_epilogue):
    return "dw" if act_on_b else "dx" if act_grad_epilogue else "fwd"


# The number of tokens: M of the forward and dx GEMMs, K of dW. It changes from batch to batch
# and never runs along a contiguous axis, so the alignment rule and the "aligned" AOT variants
# leave it unspecialized; the feature sizes decide whether loads vectorize.
_TOKEN_SIZE = {"fwd": "M", "dx": "M", "dw": "K"}
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _tuning_sizes(role, M, K):
    """(TUNE_M, TUNE_K): the autotune key's M and K, the token count rounded up to a power of two
    (at least 64). The best tile shape depends on the feature sizes, the dtype, the alignment and
    the flags, and on the token count only through its magnitude: a run with dynamic padding then
    tunes once per power of two instead of once per sequence length."""
    bucket = lambda tokens: max(64, triton.next_power_of_2(tokens))  # noqa: E731
    return (bucket(M), K) if _TOKEN_SIZE[role] == "M" else (M, bucket(K))


def _operand_name(dtype_name, input_precision):
    """"bf16", "fp16", "fp32" (TF32 dots) or "fp32-ieee": what decides the register budget."""
    return "fp32-ieee" if input_precision == "ieee" else dtype_name


def _configs_for(role, operand, aligned=True, gated=False, hopper=False):
    """Tile shapes for one GEMM role ("fwd", "dx", "dw") and operand kind (see _operand_name).

    ``aligned=False``: those that compile without spills when the JIT cannot assume 16-divisible
    pointers, strides and sizes (see _jit_sees_aligned). ``gated``: the gated_linear launches,
    which load a second (up) tile with each activated one (GATED_CONFIGS). ``hopper``: a launch on
    an sm_90 GPU, which adds HOPPER_CONFIGS to aligned 16-bit launches."""
    if gated:
        shapes = GATED_CONFIGS[role, operand, aligned]
    elif not aligned:
        shapes = MISALIGNED_CONFIGS[role, operand]
    else:
        shapes = _IEEE_CONFIGS[role] if operand == "fp32-ieee" else _CONFIGS
    if hopper and aligned:
        shapes = shapes + HOPPER_CONFIGS.get((role, operand, gated), ())
    return shapes


# Under the interpreter, one config: autotuning would run every config through slow Python.
# BLOCK_K = 16 is the k-depth of a 16-bit tensor-core MMA. The interpreter runs each tl.dot as
# one sequential numpy matmul, so this makes it accumulate in two levels as the hardware does
# (within an MMA, then across k-steps into the fp32 accumulator); one 64-long sequential sum is
# ~1.5x less accurate than eager's blocked CPU GEMM and made small fp32 checks fail by chance.
_INTERPRETER_CONFIG = (64, 64, 16, 4, 1)
_GROUP_M = 8


def _autotune_configs():
    """Every tile shape any role may use; a single one when TRITON_INTERPRET=1."""
    if triton_interpreted():
        shapes = [_INTERPRETER_CONFIG]
    else:
        shapes = dict.fromkeys(_CONFIGS + sum(_IEEE_CONFIGS.values(), ()) + sum(MISALIGNED_CONFIGS.values(), ())
                               + sum(GATED_CONFIGS.values(), ()) + sum(HOPPER_CONFIGS.values(), ()))
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": _GROUP_M},
                      num_warps=warps, num_stages=stages)
        for bm, bn, bk, warps, stages in shapes
    ]


@functools.lru_cache(maxsize=None)
def _compute_capability(index):
    """(major, minor) of CUDA device ``index`` (asked once per device)."""
    return torch.cuda.get_device_capability(index)


def _on_hopper(tensor):
    """Whether ``tensor`` lives on an sm_90 GPU (not under the interpreter, not on later archs,
    for which HOPPER_CONFIGS were never compiled)."""
    if tensor.device.type != "cuda":
        return False
    major, minor = _compute_capability(tensor.device.index)
    return major * 10 + minor == HOPPER_ARCH


def _prune_configs(configs, named_args, *, aligned, **kwargs):
    """Keep the tile shapes of this launch's role, operands, alignment and GPU (see _configs_for)."""
    role = _role(kwargs["ACT_ON_B"], kwargs["ACT_GRAD_EPILOGUE"])
    a = named_args["a_ptr"]
    operand = _operand_name(_DTYPE_NAMES[a.dtype], kwargs["INPUT_PRECISION"])
    wanted = set(_configs_for(role, operand, aligned, kwargs["GATED"], _on_hopper(a)))
    return [c for c in configs
            if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) in wanted]


# --------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _act_gemm_kernel(
    a_ptr,  # [M, K] operand A (x or gate in the forward, dy for dx, dy.T for dW)
    b_ptr,  # [K, N] operand B (W.T in the forward, W for dx, x or gate for dW)
    c_ptr,  # [M, N] output (y, dx or d_gate, dW), contiguous or strided
    bias_ptr,  # [N] bias, read only when HAS_BIAS
    x_ptr,  # [M, N] pre-activation x (or gate), read only when ACT_GRAD_EPILOGUE (the dx GEMM)
    up_ptr,  # up, read only when GATED: strides of A (ACT_ON_A), of B (ACT_ON_B) or of x (epilogue)
    c_up_ptr,  # [M, N] d_up, strides of c, written only when GATED and ACT_GRAD_EPILOGUE
    M, N, K,
    stride_am, stride_ak,
    stride_bk, stride_bn,
    stride_cm, stride_cn,
    stride_xm, stride_xn,
    TUNE_M, TUNE_K,  # M and K with the token count bucketed (see _tuning_sizes): autotune key only
    ACT_ON_A: tl.constexpr,  # apply act to A tiles on load (forward)
    ACT_ON_B: tl.constexpr,  # apply act to B tiles on load (dW)
    ACT_GRAD_EPILOGUE: tl.constexpr,  # multiply C by act'(x) (dx)
    GATED: tl.constexpr,  # the activated operand is act(x) * up (gated_linear)
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # "gelu", "gelu_tanh" or "silu" (see _act)
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" for fp32 operands, as torch's matmul
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Grouped ordering: GROUP_M row-blocks share each B column-block while it is in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # int64 row offsets: M * stride can pass 2**31 for long sequences.
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n.to(tl.int64)[None, :] * stride_bn
    if GATED:  # the up tile sits where the activated operand's tile does, in up's memory
        if ACT_ON_A:
            up_ptrs = up_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
        if ACT_ON_B:
            up_ptrs = up_ptr + offs_k[:, None] * stride_bk + offs_n.to(tl.int64)[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k_start
        mask_a = mask_m[:, None] & mask_k[None, :]
        mask_b = mask_k[:, None] & mask_n[None, :]
        # masked elements load as 0 and act(0) = 0, so the padding adds nothing
        a = tl.load(a_ptrs, mask=mask_a, other=0.0)
        b = tl.load(b_ptrs, mask=mask_b, other=0.0)
        if ACT_ON_A:
            activated = _act(a.to(tl.float32), ACTIVATION)
            if GATED:  # the gated product act(gate) * up is formed in fp32, cast once like eager's
                activated *= tl.load(up_ptrs, mask=mask_a, other=0.0).to(tl.float32)
                up_ptrs += BLOCK_K * stride_ak
            a = activated.to(a_ptr.dtype.element_ty)
        if ACT_ON_B:
            activated = _act(b.to(tl.float32), ACTIVATION)
            if GATED:
                activated *= tl.load(up_ptrs, mask=mask_b, other=0.0).to(tl.float32)
                up_ptrs += BLOCK_K * stride_bk
            b = activated.to(b_ptr.dtype.element_ty)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    mask_c = mask_m[:, None] & mask_n[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_offsets = offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if ACT_GRAD_EPILOGUE:
        x_offsets = offs_m.to(tl.int64)[:, None] * stride_xm + offs_n[None, :] * stride_xn
        x = tl.load(x_ptr + x_offsets, mask=mask_c, other=0.0).to(tl.float32)
        if GATED:  # acc is d(product): d_up = acc * act(gate), d_gate = acc * up * act'(gate)
            tl.store(c_up_ptr + c_offsets, (acc * _act(x, ACTIVATION)).to(c_up_ptr.dtype.element_ty), mask=mask_c)
            acc *= tl.load(up_ptr + x_offsets, mask=mask_c, other=0.0).to(tl.float32)
        acc *= _act_grad(x, ACTIVATION)
    tl.store(c_ptr + c_offsets, acc.to(c_ptr.dtype.element_ty), mask=mask_c)


def _autotuned(aligned):
    """The kernel behind an autotuner limited to the tile shapes that compile without spills at
    this alignment. One kernel body; each entry keeps its own tuning cache, so a misaligned launch
    never reuses a config chosen for an aligned one of the same sizes."""
    return triton.autotune(
        configs=_autotune_configs(),
        key=["TUNE_M", "N", "TUNE_K", "ACT_ON_A", "ACT_ON_B", "ACT_GRAD_EPILOGUE", "GATED", "HAS_BIAS", "ACTIVATION",
             "INPUT_PRECISION"],
        prune_configs_by={"early_config_prune": functools.partial(_prune_configs, aligned=aligned)},
    )(_act_gemm_kernel)


_AUTOTUNED = {True: _autotuned(aligned=True), False: _autotuned(aligned=False)}


def chosen_tiles():
    """What the autotuners chose so far in this process, for the benchmarks' GPU sections: a line per
    tuned launch shape, "role [gated] M<=.. N=.. K=.. (aligned|misaligned): BMxBNxBK wW sS", with
    "(Hopper tile)" where the choice is one of HOPPER_CONFIGS. Empty under the interpreter (one
    config, nothing tuned)."""
    hopper = {shape for shapes in HOPPER_CONFIGS.values() for shape in shapes}
    lines = []
    for aligned, tuner in _AUTOTUNED.items():
        for key, config in tuner.cache.items():
            # the autotuner's key: its key arguments in order (tuner.keys), then the tensors' dtypes
            args = dict(zip(tuner.keys, key))
            shape = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"], config.num_warps,
                     config.num_stages)
            lines.append(f"{_role(args['ACT_ON_B'], args['ACT_GRAD_EPILOGUE'])}{' gated' if args['GATED'] else ''} "
                         f"M<={args['TUNE_M']} N={args['N']} K<={args['TUNE_K']} "
                         f"({'aligned' if aligned else 'misaligned'}): {shape[0]}x{shape[1]}x{shape[2]} "
                         f"w{shape[3]} s{shape[4]}{' (Hopper tile)' if shape in hopper else ''}")
    return lines


# --------------------------------------------------------------------------------------------
# Ahead-of-time compile check (memkernels.aot): every tile shape of each GEMM role, for each
# operand dtype (fp32 at both dot precisions), with the exact-erf GeLU (the heaviest activation), in
# the specializations the JIT makes of a contiguous launch (unit inner strides become the constant
# 1): "aligned", what _jit_sees_aligned launches run with every config, and "sliced" and
# "misaligned", what the others run with the MISALIGNED_CONFIGS only. gated_linear registers the
# same kernel with GATED=True (aot_variants(gated=True)).
_AOT_ROLES = {
    # role: (flags, unit-stride arguments of contiguous x, W and outputs)
    "fwd": (dict(ACT_ON_A=True, ACT_ON_B=False, ACT_GRAD_EPILOGUE=False, HAS_BIAS=True),
            ("stride_ak", "stride_bk", "stride_cn")),
    "dx": (dict(ACT_ON_A=False, ACT_ON_B=False, ACT_GRAD_EPILOGUE=True, HAS_BIAS=False),
           ("stride_ak", "stride_bn", "stride_cn", "stride_xn")),
    "dw": (dict(ACT_ON_A=False, ACT_ON_B=True, ACT_GRAD_EPILOGUE=False, HAS_BIAS=False),
           ("stride_am", "stride_bn", "stride_cn")),
}
_AOT_DTYPES = (("bf16", "tf32"), ("fp16", "tf32"), ("fp32", "tf32"), ("fp32", "ieee"))


def aot_variants(gated=False):
    """Variant dicts for memkernels.aot.register: roles x dtypes x alignments x the tile shapes."""
    pointers = ("a_ptr", "b_ptr", "c_ptr", "bias_ptr", "x_ptr", "up_ptr", "c_up_ptr")
    integers = ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn",
                "stride_cm", "stride_cn", "stride_xm", "stride_xn", "TUNE_M", "TUNE_K")
    variants = []
    for dtype, precision in _AOT_DTYPES:
        operand = _operand_name(dtype, precision)
        for role, (flags, unit_strides) in _AOT_ROLES.items():
            signature = {name: f"*{dtype}" for name in pointers}
            signature.update({name: "i32" for name in integers if name not in unit_strides})
            # What the JIT may assume to be 16-divisible. "aligned": the pointers, the remaining
            # strides (the unused x strides are 0) and the feature sizes. "sliced": a view whose
            # data_ptr is a few elements off, sizes and strides still 16-divisible. "misaligned": an
            # odd hidden size, nothing (only the pointers aligned measured the same registers).
            divisible = [name for name in signature if name != _TOKEN_SIZE[role]]
            specializations = {"aligned": divisible, "sliced": [name for name in divisible if name not in pointers],
                               "misaligned": []}
            for alignment, assumed in specializations.items():
                tiles = _configs_for(role, operand, aligned=alignment == "aligned", gated=gated)
                on_hopper = _configs_for(role, operand, alignment == "aligned", gated, hopper=True)
                hopper_only = [shape for shape in on_hopper if shape not in tiles]
                for block_m, block_n, block_k, warps, stages in (*tiles, *hopper_only):
                    constexprs = dict(flags, GATED=gated, ACTIVATION="gelu", INPUT_PRECISION=precision,
                                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=_GROUP_M)
                    constexprs.update({name: 1 for name in unit_strides})
                    variants.append({
                        "signature": {**signature, **{name: "constexpr" for name in constexprs}},
                        "constexprs": constexprs, "num_warps": warps, "num_stages": stages,
                        "aligned": assumed,
                        "label": f"{role} {operand} {block_m}x{block_n}x{block_k} w{warps} s{stages} {alignment}",
                        **({"archs": (HOPPER_ARCH,)} if (block_m, block_n, block_k, warps, stages) in hopper_only
                           else {}),
                    })
    return variants


aot.register(_act_gemm_kernel, name="gelu_linear", variants=aot_variants())


# --------------------------------------------------------------------------------------------
# Launchers: 2-D operands in, output allocated here.


def _input_precision(dtype):
    """Match torch's fp32 matmul: TF32 only when torch allows it."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _jit_sees_aligned(pointers, strides, feature_sizes):
    """Whether triton's JIT specializes this launch as the registered "aligned" variants.

    The JIT marks a pointer as divisible by 16 when its data_ptr() is 16-byte aligned, and an
    integer when it is a multiple of 16 (a 1 becomes the constant 1 instead); only then do the tile
    loads vectorize. Sliced views, odd hidden sizes or padded rows lose that, and the kernel then
    needs more registers: only MISALIGNED_CONFIGS compile without spills. Host arithmetic only.
    """
    return (all(t.data_ptr() % 16 == 0 for t in pointers)
            and all(stride % 16 == 0 for stride in strides if stride != 1)
            and all(size % 16 == 0 for size in feature_sizes))


@on_tensor_device
def act_gemm(a, b, out, *, bias=None, x=None, up=None, out_up=None, act_on_a=False, act_on_b=False,
         activation="gelu"):
    """out [M, N] = act(a) [M, K] @ act(b) [K, N] (+ bias) (* act'(x)); all views, any strides.

    With ``up`` (gated_linear): the activated operand is act(.) * up, where up has the strides of
    a (act_on_a), of b (act_on_b) or of x; with x, out gets d_gate and ``out_up`` (strides of out)
    d_up.
    """
    M, K = a.shape
    N = b.shape[1]
    pointers = (a, b, out,
                bias if bias is not None else out,  # never read without HAS_BIAS
                x if x is not None else out,  # never read without ACT_GRAD_EPILOGUE
                up if up is not None else out,  # never read without GATED
                out_up if out_up is not None else out)  # never written without GATED and x
    strides = (*a.stride(), *b.stride(), *out.stride(), *(x.stride() if x is not None else (0, 0)))
    role = _role(act_on_b, x is not None)
    token_size = _TOKEN_SIZE[role]
    feature_sizes = [size for name, size in (("M", M), ("N", N), ("K", K)) if name != token_size]
    kernel = _AUTOTUNED[_jit_sees_aligned(pointers, strides, feature_sizes)]
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    kernel[grid](
        *pointers, M, N, K, *strides, *_tuning_sizes(role, M, K),
        ACT_ON_A=act_on_a, ACT_ON_B=act_on_b, ACT_GRAD_EPILOGUE=x is not None, GATED=up is not None,
        HAS_BIAS=bias is not None, ACTIVATION=activation, INPUT_PRECISION=_input_precision(a.dtype),
    )
    return out


# gelu_linear's approximate -> the kernel's ACTIVATION
_GELU_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_tanh"}


def _empty_problem(*tensors):
    """Nothing to launch (a zero-sized dimension): the reference handles these exactly."""
    return any(t.numel() == 0 for t in tensors)


def _forward_triton(x2d, weight, bias, approximate):
    if _empty_problem(x2d, weight):
        return reference.forward(x2d, weight, bias, approximate)
    out = x2d.new_empty(x2d.shape[0], weight.shape[0])
    return act_gemm(x2d, weight.t(), out, bias=bias, act_on_a=True, activation=_GELU_ACTIVATIONS[approximate])


def _grad_input_triton(grad_out2d, x2d, weight, approximate):
    if _empty_problem(grad_out2d, x2d, weight):
        return reference.grad_input(grad_out2d, x2d, weight, approximate)
    grad_x = torch.empty_like(x2d, memory_format=torch.contiguous_format)
    return act_gemm(grad_out2d, weight, grad_x, x=x2d, activation=_GELU_ACTIVATIONS[approximate])


def _grad_weight_triton(grad_out2d, x2d, approximate):
    if _empty_problem(grad_out2d, x2d):
        return reference.grad_weight(grad_out2d, x2d, approximate)
    grad_w = grad_out2d.new_empty(grad_out2d.shape[1], x2d.shape[1])
    return act_gemm(grad_out2d.t(), x2d, grad_w, act_on_b=True, activation=_GELU_ACTIVATIONS[approximate])


# --------------------------------------------------------------------------------------------
# Custom ops (memkernels/ops/_custom_op.py): the whole op as a custom op with its autograd, opaque to
# torch.compile, whose backward calls the backward GEMMs as custom ops; in eager mode an
# autograd.Function twin runs the same implementations directly. Each takes ``backend`` last, "triton"
# (the launcher) or "torch" (the PyTorch reference), resolved by the caller.


class _Step:
    """One step of the op (a GEMM, or the whole forward) as a custom op, with the reference it falls
    back to; :meth:`implementation` is what the custom op runs, for the eager twin to call directly."""

    def __init__(self, name, schema, triton_impl, reference_impl, fake_impl):
        self.triton_impl, self.reference_impl = triton_impl, reference_impl
        self.custom_op = custom_op(f"memkernels::{name}", self.implementation,
                                   lambda *args: fake_impl(*args[:-1]), schema=schema)
        self.name = self.custom_op._qualname

    def implementation(self, *args):
        *operands, backend = args
        return (self.triton_impl if backend == "triton" else self.reference_impl)(*operands)


def _on_last_dim(forward):
    """``forward`` of 2-D [M, K] operands applied to [..., K] ones: [..., N] out (a view of [M, N])."""
    def flattened(x, *rest):
        out = forward(x.reshape(-1, x.shape[-1]), *rest)
        return out.view(*x.shape[:-1], out.shape[-1])
    return flattened


_STEPS = {
    "forward": _Step(
        "gelu_linear", "(Tensor x, Tensor weight, Tensor? bias, str approximate, str backend) -> Tensor",
        _on_last_dim(_forward_triton), _on_last_dim(reference.forward),
        lambda x, weight, bias, approximate: x.new_empty(*x.shape[:-1], weight.shape[0])),
    "grad_input": _Step(
        "gelu_linear_grad_input",
        "(Tensor grad_out2d, Tensor x2d, Tensor weight, str approximate, str backend) -> Tensor",
        _grad_input_triton, reference.grad_input,
        lambda grad_out2d, x2d, weight, approximate: torch.empty_like(x2d, memory_format=torch.contiguous_format)),
    "grad_weight": _Step(
        "gelu_linear_grad_weight", "(Tensor grad_out2d, Tensor x2d, str approximate, str backend) -> Tensor",
        _grad_weight_triton, reference.grad_weight,
        lambda grad_out2d, x2d, approximate: grad_out2d.new_empty(grad_out2d.shape[1], x2d.shape[1])),
}
# A GEMM: under autocast x, weight and bias are cast to the region's dtype, as F.linear's are.
_autocast.register(_STEPS["forward"].name, {"cpu": "lower_precision_fp", "cuda": "lower_precision_fp"},
                   positions=(0, 1, 2))


# --------------------------------------------------------------------------------------------
# Autograd


def _setup_context(ctx, inputs, output):
    """Saves only x (and the weight parameter)."""
    x, weight, bias, approximate, backend = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    ctx.approximate = approximate
    ctx.backend = backend


def _bias_grad(grad_out2d):
    """The bias gradient of a linear layer: grad_out2d [M, N] summed over its M tokens into [N], in one
    float32 reduction (float64 stays float64) cast once: deterministic, no atomics."""
    return grad_out2d.sum(0, dtype=torch.promote_types(grad_out2d.dtype, torch.float32)).to(grad_out2d.dtype)


def _backward_with(grad_input, grad_weight):
    """gelu_linear's backward over the two backward GEMMs: the custom ops under torch.compile, their
    implementations in eager mode."""

    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        x2d = x.reshape(-1, x.shape[-1])
        grad_out2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_input(grad_out2d, x2d, weight, ctx.approximate, ctx.backend).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = grad_weight(grad_out2d, x2d, ctx.approximate, ctx.backend)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = _bias_grad(grad_out2d)
        return grad_x, grad_w, grad_bias, None, None

    return backward


_GeLULinearFunction = autograd_pair(
    _STEPS["forward"].custom_op, _STEPS["forward"].implementation, _setup_context,
    _backward_with(_STEPS["grad_input"].custom_op, _STEPS["grad_weight"].custom_op),
    _backward_with(_STEPS["grad_input"].implementation, _STEPS["grad_weight"].implementation))


# --------------------------------------------------------------------------------------------
# Public function


def _check_inputs(x, weight, bias, approximate, backend):
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"gelu_linear: approximate={approximate!r} is not supported; use 'none' or 'tanh'")
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"gelu_linear: backend={backend!r} is not supported; use None (auto), 'triton' or 'torch'")
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("gelu_linear: x must be a tensor of shape [..., in_features]")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("gelu_linear: weight must be a 2-D tensor of shape [out_features, in_features]")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"gelu_linear: in_features mismatch: x has {x.shape[-1]} features (last dim) but weight "
            f"{tuple(weight.shape)} expects {weight.shape[1]}; weight must be [out_features, in_features]")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"gelu_linear: bias has shape {tuple(bias.shape)}; expected ({weight.shape[0]},) "
                         "(out_features)")
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if tensor.device != x.device:
            raise ValueError(f"gelu_linear: {name} is on {tensor.device} but x is on {x.device}; "
                             f"move them to the same device")
        if tensor.dtype != x.dtype:
            raise ValueError(f"gelu_linear: {name} is {tensor.dtype} but x is {x.dtype}; cast them to one dtype")


def gelu_linear(x, weight, bias=None, *, approximate="none", backend=None):
    """``F.linear(F.gelu(x, approximate=approximate), weight, bias)`` without storing gelu(x).

    Args:
        x: [..., in_features], float32 / float16 / bfloat16 (the torch backend takes any
            floating dtype).
        weight: [out_features, in_features], same dtype and device as x; any strides.
        bias: optional [out_features].
        approximate: "none" (exact, erf) or "tanh", as in ``F.gelu``.
        backend: None picks by device (Triton on CUDA, the PyTorch reference elsewhere, see
            memkernels.set_backend); "torch" forces the reference, "triton" the kernels.

    Returns:
        [..., out_features] in x's dtype. Only x (and weight) is saved for backward.
        Under ``torch.autocast`` x, weight and bias are cast to the region's dtype first, as
        ``F.linear`` casts them, and the result is in that dtype.
    """
    return _autocast.call(_STEPS["forward"].name, functools.partial(_gelu_linear, approximate=approximate,
                                                                    backend=backend), x, weight, bias)


def _gelu_linear(x, weight, bias, *, approximate, backend):
    _check_inputs(x, weight, bias, approximate, backend)
    if backend is None:
        backend = resolve(x, "gelu_linear")
    if backend == "triton" and not (x.is_cuda or (x.device.type == "cpu" and triton_interpreted())):
        raise ValueError(f"gelu_linear: backend='triton' cannot run on {x.device} tensors; Triton needs CUDA "
                         "(or CPU tensors with TRITON_INTERPRET=1 set before triton is imported); "
                         "use backend='torch' or None")
    if backend == "triton" and x.dtype not in _TRITON_DTYPES:
        raise ValueError(f"gelu_linear: x is {x.dtype}; the Triton backend takes float32, float16 or "
                         "bfloat16 (use backend='torch' for other dtypes)")
    return apply_op(_STEPS["forward"].custom_op, _GeLULinearFunction, x, weight, bias, approximate, backend)
