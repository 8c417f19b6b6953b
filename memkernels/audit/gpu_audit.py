"""GPU cost audit without a GPU: what each op moves, computes and waits for, and a time model.

``python -m memkernels.audit.gpu_audit`` prints, for every public op, forward and backward, at
shapes of real models, in bf16 and fp32:

- **HBM bytes.** Triton kernels: every ``tl.load`` / ``tl.store`` is counted through the Triton
  interpreter with its mask honoured (lanes that are off move nothing). The *requested* bytes
  count every lane; the *HBM* figure counts a re-read of a tensor once when a GPU keeps it in
  L2: a tensor whose touched footprint in the launch is at most :data:`L2_REUSE_BYTES` (a
  norm's weight, read by every row), and the operand tiles of a ``tl.dot`` kernel (grouped
  tile order, as cuBLAS is assumed to reach). A store is a write-back: bytes the launch loaded
  and then stores (an in-place update) move twice, a program's re-store within its reuse window
  once. PyTorch-side code: every aten op's tensor inputs
  and outputs, through a ``TorchDispatchMode`` (views and ``empty`` move nothing; ``copy_``,
  ``fill_`` and ``zero_`` do not read their destination). Both against the op's minimum:
  every input of the pass read once, every output written once.
- **FLOPs**: aten by ``torch.utils.flop_counter``'s formulas (the ones ``FlopCounterMode``
  uses); Triton as 2*M*N*K per ``tl.dot``. Float64 work in kernels (each element widened to
  float64, each float64 arithmetic op) is counted apart as "fp64" FLOPs.
- **CUDA-core work in Triton kernels**: every floating-point elementwise instruction a kernel
  executes, counted per element as the interpreter runs it (so work repeated inside a tile loop
  counts once per time it runs): ``alu`` (add, multiply, compare, select, fma, casts) and ``sfu``
  (exp, log, sqrt, rsqrt, erf, sin, cos: the special-function units). An activation applied to
  operand tiles inside a GEMM's k-loop is counted N / BLOCK_N times over; a separate elementwise
  pass once (``tests/test_gpu_audit.py::test_work_repeated_inside_a_tile_loop_is_counted``).
- **Tensor-core eligibility**: each matmul's operand dtypes (aten and ``tl.dot``); a float32
  operand on half inputs is flagged.
- **Host syncs**: aten ops that read device memory back to the host (:data:`SYNC_OPS`).
- **Step**: for an op that moves backward's work into its forward (linear-CE's ``"chunked"``),
  a "step" row adds forward and backward up, so that strategies and eager compare as a whole.
- **Occupancy** (``--occupancy``): blocks per SM on sm_80 / sm_90 from the registers and
  shared memory that :mod:`memkernels.aot` compiles (ptxas), see :func:`blocks_per_sm`.
- **Predicted time, a model**: the sum over launches of max(bytes / HBM bandwidth,
  FLOPs / peak at the operands' precision + alu / ALU rate + sfu / SFU rate: the elementwise
  work of a kernel that also runs ``tl.dot`` holds its tensor cores up, so it adds) plus
  :data:`LAUNCH_OVERHEAD_S` per launch, on the
  figures of :data:`GPUS`; the same model is applied to eager PyTorch's op sequence for the
  same computation. It is not a measurement: caches beyond the rule above, achieved (not
  peak) bandwidth, tile quantization on the real autotuned configs, overlap between
  launches and clocks are all outside it.

How real shapes are reached on a CPU. The PyTorch side is counted *at the full shape* on fake
tensors (``FakeTensorMode``: shapes and dtypes, no data), which also gives the exact sequence
of Triton launches. Triton kernels cannot run on fake tensors, so their counts are measured
through the interpreter at small shapes and fitted *exactly* (integer least squares, zero
residual required) to a polynomial in the shape variables (e.g. tokens x hidden), checked at
shapes held out of the fit, then evaluated at the full shape. A fit that does not reproduce a
held-out count is an error, never a silent estimate.
"""
import argparse
import contextlib
import functools
import importlib
import importlib.util
import itertools
import math
import os
import pkgutil
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np

from memkernels.fusions.audit_case import TOKENS, Case, Problem  # noqa: F401  (Case, Problem: the audit's own names too)

__all__ = ["GpuSpec", "GPUS", "Launch", "Counts", "count", "audit", "blocks_per_sm", "format_table", "case_at",
           "predict", "model_gpu", "prediction_line", "main"]


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one GPU (dense, no sparsity)."""

    name: str
    hbm_bytes_per_s: float
    peak_flops: dict  # operand precision -> FLOP/s: "bf16"/"fp16" tensor cores, "fp32" without TF32, "fp64"
    l2_bytes: int
    # Elementwise instructions a second over all SMs: "alu", the FP32 lanes (an fma is one; half the fp32
    # FLOP/s); "sfu", the special-function units (16 lanes an SM a clock on sm_80 and sm_90).
    ops_per_s: dict = field(default_factory=dict)


# NVIDIA A100 datasheet (80GB SXM): 2039 GB/s; 312 TFLOPS bf16/fp16 tensor; 19.5 TFLOPS fp32;
# 9.7 TFLOPS fp64 (non-tensor). NVIDIA H100 datasheet (SXM5): 3.35 TB/s; 989 TFLOPS bf16/fp16
# tensor (dense); 67 TFLOPS fp32; 34 TFLOPS fp64 (non-tensor). Elementwise rates from the same
# boost clocks and SM counts: A100 108 SMs x 1.41 GHz (64 FP32 lanes, 16 SFU an SM), H100 132 SMs x
# 1.98 GHz (128 FP32 lanes, 16 SFU an SM).
_A100_OPS = {"alu": 108 * 64 * 1.41e9, "sfu": 108 * 16 * 1.41e9}
_H100_OPS = {"alu": 132 * 128 * 1.98e9, "sfu": 132 * 16 * 1.98e9}
GPUS = {
    "A100-80GB": GpuSpec("A100-80GB", 2.039e12, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12, "fp64": 9.7e12},
                         40 * 2**20, _A100_OPS),
    "H100-SXM": GpuSpec("H100-SXM", 3.35e12, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "fp64": 34e12},
                        50 * 2**20, _H100_OPS),
    # The H100's chip with HBM3e: the same peaks, 4.8 TB/s.
    "H200-SXM": GpuSpec("H200-SXM", 4.8e12, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "fp64": 34e12},
                        50 * 2**20, _H100_OPS),
}
# Host-side cost of one kernel launch on an idle stream (typical CUDA figure, a model constant).
LAUNCH_OVERHEAD_S = 4e-6
# A tensor touched by a launch over no more than this many bytes counts once however often it is
# read (it stays in L2, a quarter of the smaller L2 above).
L2_REUSE_BYTES = 10 * 2**20
# A program's re-read of bytes it touched at most this many bytes of its own traffic ago counts
# once: its share of L2, 40 MiB over the ~264 programs resident at once (two per SM on an H100).
# A norm row read in two passes hits; a cross-entropy row at V = 128256 (250 KiB in bf16) misses.
PROGRAM_REUSE_BYTES = 40 * 2**20 // 264

# aten ops that make the host wait for the device.
SYNC_OPS = frozenset({
    "_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "equal", "is_nonzero", "item",
    "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave", "allclose",
    "masked_scatter", "bincount", "histc", "argwhere", "_assert_async", "cpu",
})
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "addbmm", "mv", "addmv", "dot", "_scaled_mm",
                        "addmm_", "baddbmm_", "addbmm_", "addmv_"})
# aten ops that allocate or relabel memory without moving data.
FREE_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
                      "lift_fresh", "set_", "resize_", "_reshape_alias", "alias", "_unsafe_view"})
# In-place aten ops whose destination is written without being read.
WRITE_ONLY_DESTINATION = frozenset({"copy_", "fill_", "zero_", "zeros", "ones", "full", "new_zeros",
                                    "new_ones", "new_full", "zeros_like", "ones_like", "full_like"})

_PRECISION = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.float64": "fp64"}


@dataclass
class Launch:
    """One kernel launch (a Triton grid or one aten op)."""

    kind: str  # "triton" or "aten"
    name: str
    hbm_bytes: int = 0  # the model's HBM traffic (see the module docstring)
    requested_bytes: int = 0  # every lane of every load and store (aten: equal to hbm_bytes)
    flops: dict = field(default_factory=dict)  # precision -> FLOPs (matmuls; fp64 elementwise)
    matmul_dtypes: tuple = ()  # ((a dtype, b dtype), ...) for each matmul
    sync: bool = False
    arguments: tuple = ()  # Triton, per tensor touched: (argument position, requested bytes, distinct bytes,
    #                        bytes missed in the programs' own recent accesses, transfers: see _hbm_bytes)
    dot: bool = False  # Triton: the kernel runs tl.dot
    programs: int = 0  # Triton: programs in the grid
    ops: dict = field(default_factory=dict)  # Triton: "alu" / "sfu" -> elementwise instructions, per element

    def compute_seconds(self, gpu):
        """Tensor-core (or fp32/fp64) FLOPs at their peak plus the CUDA-core elementwise work at its rate."""
        return (sum(f / gpu.peak_flops[p] for p, f in self.flops.items())
                + sum(n / gpu.ops_per_s[unit] for unit, n in self.ops.items()))

    def seconds(self, gpu):
        return max(self.hbm_bytes / gpu.hbm_bytes_per_s, self.compute_seconds(gpu)) + LAUNCH_OVERHEAD_S


@dataclass
class Counts:
    """What one pass (forward or backward) launched."""

    launches: list = field(default_factory=list)

    @property
    def hbm_bytes(self):
        return sum(x.hbm_bytes for x in self.launches)

    @property
    def requested_bytes(self):
        return sum(x.requested_bytes for x in self.launches)

    def flops(self, precision=None):
        return sum(f for x in self.launches for p, f in x.flops.items() if precision in (None, p))

    @property
    def matmul_dtypes(self):
        return [(x.name, dtypes) for x in self.launches for dtypes in x.matmul_dtypes]

    @property
    def syncs(self):
        return [x.name for x in self.launches if x.sync]

    def seconds(self, gpu):
        return sum(x.seconds(gpu) for x in self.launches)

    def by_kernel(self):
        """{(kind, name): [launches, hbm bytes, requested bytes, {precision: flops}]}."""
        table = {}
        for x in self.launches:
            row = table.setdefault((x.kind, x.name), [0, 0, 0, {}])
            row[0] += 1
            row[1] += x.hbm_bytes
            row[2] += x.requested_bytes
            for p, f in x.flops.items():
                row[3][p] = row[3].get(p, 0) + f
        return table


# ----------------------------------------------------------------------------------------------
# Triton: the interpreter's memory and dot builtins, wrapped


def _distinct(values):
    """The distinct values of a 1-d array (lanes usually are distinct and increasing already)."""
    if values.size < 2 or np.all(values[1:] > values[:-1]):
        return values
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]


class _TritonLaunch:
    """Per-argument byte counts of one interpreted launch."""

    def __init__(self, name, host_args):
        self.name = name
        self.dot = False
        self.dot_dtypes = []
        self.dot_flops = {}
        self.fp64_ops = 0
        self.ops = {"alu": 0, "sfu": 0}
        self.in_special = False  # inside a special function, whose inner unary_op is not counted again
        tensors = {}  # storage start -> (bytes, position of the first argument on it)
        for position, arg in enumerate(host_args):
            if hasattr(arg, "untyped_storage"):
                storage = arg.untyped_storage()
                tensors.setdefault(storage.data_ptr(), (storage.nbytes(), position))
        self.starts = np.array(sorted(tensors), dtype=np.int64)
        self.sizes = np.array([tensors[s][0] for s in sorted(tensors)], dtype=np.int64)
        self.positions = [tensors[s][1] for s in sorted(tensors)]
        self.requested = np.zeros(len(self.starts), dtype=np.int64)
        self.touched = [None] * len(self.starts)  # byte bitmaps over the launch, made on first touch
        self.loaded_first = [None] * len(self.starts)  # bytes whose first access was a load
        self.stored = [None] * len(self.starts)  # bytes stored
        self.last_touch = [None] * len(self.starts)  # per byte: (program, program clock) of its last access
        self.last_store = [None] * len(self.starts)  # per byte: (program, program clock) of its last store
        self.misses = np.zeros(len(self.starts), dtype=np.int64)
        self.program = None
        self.programs = 0
        self.clock = 0  # bytes the current program has accessed so far

    def access(self, addresses, element_bytes, program, store=False):
        """A load's (or ``store``'s) active lanes. A load misses unless its program accessed the byte at
        most PROGRAM_REUSE_BYTES ago; a store misses unless its program stored it that recently (a
        line read and then written goes back to HBM: a write-back)."""
        addresses = addresses.astype(np.int64).ravel()
        if program != self.program:
            self.program = program
            self.programs += 1
            self.clock = 0
        if addresses.size == 0:
            return
        index = np.searchsorted(self.starts, addresses, side="right") - 1
        if np.any(index < 0) or np.any(addresses - self.starts[index] >= self.sizes[index]):
            raise RuntimeError(f"memkernels.gpu_audit: kernel {self.name} touches memory outside its tensor "
                               "arguments; its bytes cannot be attributed")
        for arg in ((index[0],) if index[0] == index[-1] and np.all(index == index[0]) else _distinct(index)):
            offsets = addresses[index == arg] - self.starts[arg]
            self.requested[arg] += offsets.size * element_bytes
            if self.touched[arg] is None:
                size = int(self.sizes[arg])
                self.touched[arg], self.loaded_first[arg], self.stored[arg] = (np.zeros(size, dtype=bool)
                                                                               for _ in range(3))
                self.last_touch[arg], self.last_store[arg] = ((np.full(size, -1, dtype=np.int64),
                                                               np.zeros(size, dtype=np.int64)) for _ in range(2))
            byte_offsets = _distinct((offsets[:, None] + np.arange(element_bytes)).ravel())
            if store:
                self.stored[arg][byte_offsets] = True
            else:
                self.loaded_first[arg][byte_offsets[~self.touched[arg][byte_offsets]]] = True
            self.touched[arg][byte_offsets] = True
            last_program, last_clock = self.last_store[arg] if store else self.last_touch[arg]
            hit = (last_program[byte_offsets] == self.programs) & (
                self.clock - last_clock[byte_offsets] <= PROGRAM_REUSE_BYTES)
            self.misses[arg] += int(np.count_nonzero(~hit))
            for last_program, last_clock in (self.last_touch[arg],) + ((self.last_store[arg],) if store else ()):
                last_program[byte_offsets] = self.programs
                last_clock[byte_offsets] = self.clock
        self.clock += addresses.size * element_bytes

    def finish(self):
        per_argument = tuple((self.positions[arg], int(self.requested[arg]), int(np.count_nonzero(self.touched[arg])),
                              int(self.misses[arg]),
                              int(np.count_nonzero(self.loaded_first[arg]) + np.count_nonzero(self.stored[arg])))
                             for arg in range(len(self.starts)) if self.touched[arg] is not None)
        flops = dict(self.dot_flops)
        if self.fp64_ops:
            flops["fp64"] = flops.get("fp64", 0) + self.fp64_ops
        return Launch("triton", self.name, hbm_bytes=_hbm_bytes(per_argument, self.dot, 1),
                      requested_bytes=int(self.requested.sum()), flops=flops,
                      matmul_dtypes=tuple(dict.fromkeys(self.dot_dtypes)), arguments=per_argument, dot=self.dot,
                      programs=self.programs, ops={unit: n for unit, n in self.ops.items() if n})


def _hbm_bytes(per_argument, dot, launches):
    """The model's HBM bytes of ``launches`` launches from, per tensor argument, (position, requested
    bytes, distinct bytes in the launch, bytes its programs missed in their own recent accesses,
    transfers: distinct bytes first loaded plus distinct bytes stored).

    A tensor's bytes move once each way (its transfers: read once unless the launch wrote them first,
    written back once if stored, so an in-place update counts twice) if it feeds a tl.dot (tiles reused
    through L2 in grouped order) or if what one launch touches of it fits :data:`L2_REUSE_BYTES` (a weight
    every row reads); otherwise a program's re-read counts once if it comes within
    :data:`PROGRAM_REUSE_BYTES` of that program's own traffic (a row read in two passes), a re-write
    likewise, and every other access counts.
    """
    return sum(transfers if (dot or distinct <= L2_REUSE_BYTES * launches) else misses
               for _, requested, distinct, misses, transfers in per_argument)


def _layer_norm_backward_kernels(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask, out):
    """The kernels of PyTorch's CUDA ``native_layer_norm_backward``: [(name, bytes)].

    pytorch/pytorch aten/src/ATen/native/cuda/layer_norm_kernel.cu, LayerNormBackwardKernelImplInternal:
    dX is ``layer_norm_grad_input_kernel`` (``_vectorized`` when aligned), one block per row, which
    reads dY, X, mean, rstd and gamma and writes dX (its second read of the row is the block's own,
    counted once as for Triton programs); dgamma and dbeta are a second kernel,
    ``GammaBetaBackwardCUDAKernel_32x32`` (M and N multiples of 32; ``GammaBetaBackwardCUDAKernel``
    or, for M < 128, ``GammaBetaBackwardSimpleCUDAKernel`` otherwise), one block per 32 columns over
    all rows, which reads dY, X, mean and rstd again and writes dgamma and dbeta.
    """
    # mean and rstd are float32 on CUDA for half inputs (acc_type); the CPU fake tensors may hold them in x's dtype.
    stats = (mean.numel() + rstd.numel()) * max(mean.element_size(), 4)
    grad_input, grad_weight, grad_bias = out
    kernels = []
    if output_mask[0]:
        kernels.append(("layer_norm_grad_input_kernel", _footprint(grad_out) + _footprint(input) + stats
                        + (_footprint(weight) if weight is not None else 0) + _footprint(grad_input)))
    if output_mask[1] or output_mask[2]:
        kernels.append(("GammaBetaBackwardCUDAKernel", _footprint(grad_out) + _footprint(input) + stats
                        + sum(_footprint(t) for t, wanted in ((grad_weight, output_mask[1]),
                                                              (grad_bias, output_mask[2])) if wanted)))
    return kernels


# aten ops whose CUDA implementation is several kernels, each reading its own inputs:
# name -> f(*args, out) -> [(kernel, bytes)]. Every other aten op counts as one kernel at its
# inputs and outputs. For the eager norms: Hugging Face's RMSNorm is elementwise and reduction
# aten ops (and their autograd formulas), each counted as one kernel. PyTorch's reduce kernel
# (aten/src/ATen/native/cuda/Reduce.cuh) adds a semaphore memset and a staging buffer when its
# config splits one reduction across blocks (``should_global_reduce``); that is not modelled (it
# can only make eager slower). native_layer_norm (forward) is one kernel at these shapes
# (``vectorized_layer_norm_kernel``: N a multiple of 4, aligned buffers); its backward is two (above).
EAGER_KERNELS = {"native_layer_norm_backward": _layer_norm_backward_kernels}


class _Recorder:
    """The active counting session: Triton launches and aten ops, in order."""

    def __init__(self, run_triton=True):
        self.counts = Counts()
        self.run_triton = run_triton  # False: record the launch only (fake tensors)
        self.kernel = None  # the _TritonLaunch being interpreted
        self.in_kernel = 0


_ACTIVE = None


def _element_bytes(triton_type):
    return max(1, triton_type.primitive_bitwidth // 8)


def _tl_precision(tl, dtype):
    return {tl.bfloat16: "bf16", tl.float16: "fp16", tl.float32: "fp32", tl.float64: "fp64"}.get(dtype, str(dtype))


# The interpreter's builtins that run on the special-function units.
_SPECIAL_FUNCTIONS = ("create_exp", "create_exp2", "create_log", "create_log2", "create_sqrt", "create_precise_sqrt",
                      "create_rsqrt", "create_erf", "create_sin", "create_cos")


@contextlib.contextmanager
def _patched_interpreter():
    """Wrap the interpreter's load/store/dot builtins and its grid executor while counting."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    executor = interpreter.GridExecutor
    originals = {name: getattr(builder, name) for name in ("create_masked_load", "create_masked_store",
                                                          "create_dot", "binary_op", "cast_impl", "unary_op",
                                                          "ternary_op", "create_fma")
                 + tuple(name for name in _SPECIAL_FUNCTIONS if hasattr(builder, name))}
    original_call, original_init_args = executor.__call__, executor._init_args_hst

    # The builder's methods take more parameters in some Triton releases (3.6's create_masked_load has
    # one more than 3.9's): the wrappers read the leading ones and pass the rest through.
    def masked_load(self, ptrs, mask, *rest):
        kernel = _ACTIVE.kernel if _ACTIVE else None
        if kernel is not None:
            active = np.broadcast_to(mask.data, ptrs.data.shape)
            kernel.access(ptrs.data[active], _element_bytes(ptrs.get_element_ty()), self.grid_idx)
        return originals["create_masked_load"](self, ptrs, mask, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        kernel = _ACTIVE.kernel if _ACTIVE else None
        if kernel is not None:
            active = np.broadcast_to(mask.data, ptrs.data.shape)
            kernel.access(ptrs.data[active], _element_bytes(ptrs.get_element_ty()), self.grid_idx, store=True)
        return originals["create_masked_store"](self, ptrs, value, mask, *rest)

    def dot(self, a, b, d, *rest):
        kernel = _ACTIVE.kernel if _ACTIVE else None
        if kernel is not None:
            m, k = a.data.shape[-2:]
            n = b.data.shape[-1]
            batch = math.prod(a.data.shape[:-2])
            pa, pb = _tl_precision(tl, a.dtype.scalar), _tl_precision(tl, b.dtype.scalar)
            kernel.dot = True
            kernel.dot_dtypes.append((pa, pb))
            precision = pa if pa == pb else "fp32"
            kernel.dot_flops[precision] = kernel.dot_flops.get(precision, 0) + 2 * batch * m * n * k
        return originals["create_dot"](self, a, b, d, *rest)

    def binary_op(self, lhs, rhs, op):
        kernel = _ACTIVE.kernel if _ACTIVE else None
        if kernel is not None and lhs.dtype.scalar == tl.float64:
            kernel.fp64_ops += int(np.broadcast(lhs.data, rhs.data).size)
        elif kernel is not None and lhs.dtype.scalar.is_floating():
            kernel.ops["alu"] += int(np.broadcast(lhs.data, rhs.data).size)
        return originals["binary_op"](self, lhs, rhs, op)

    def cast_impl(self, src, dst_type):
        kernel = _ACTIVE.kernel if _ACTIVE else None
        if kernel is not None and dst_type.scalar == tl.float64 and src.dtype.scalar != tl.float64:
            kernel.fp64_ops += int(np.size(src.data))  # each widened element feeds an fp64 sum or product
        elif kernel is not None and dst_type.scalar.is_floating() and src.dtype.scalar.is_floating():
            kernel.ops["alu"] += int(np.size(src.data))
        return originals["cast_impl"](self, src, dst_type)

    def unary_op(self, arg, op):
        kernel = _ACTIVE.kernel if _ACTIVE else None
        if kernel is not None and not kernel.in_special and arg.dtype.scalar.is_floating():
            kernel.ops["alu"] += int(np.size(arg.data))
        return originals["unary_op"](self, arg, op)

    def ternary_op(self, lhs, rhs, other, op):
        kernel = _ACTIVE.kernel if _ACTIVE else None
        if kernel is not None and other.dtype.scalar.is_floating():
            kernel.ops["alu"] += int(np.broadcast(lhs.data, rhs.data, other.data).size)
        return originals["ternary_op"](self, lhs, rhs, other, op)

    def fma(self, x, y, z):
        kernel = _ACTIVE.kernel if _ACTIVE else None
        if kernel is not None:
            kernel.ops["alu"] += int(np.broadcast(x.data, y.data, z.data).size)  # one instruction
        return originals["create_fma"](self, x, y, z)

    def special(name):
        def wrapped(self, arg, *rest):
            kernel = _ACTIVE.kernel if _ACTIVE else None
            if kernel is None:
                return originals[name](self, arg, *rest)
            kernel.ops["sfu"] += int(np.size(arg.data))
            kernel.in_special = True
            try:
                return originals[name](self, arg, *rest)
            finally:
                kernel.in_special = False
        return wrapped

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = original_init_args(self, args_dev, kwargs)
        if _ACTIVE is not None and _ACTIVE.in_kernel:
            _ACTIVE.kernel = _TritonLaunch(self.fn.__name__, list(args_hst) + list(kwargs_hst.values()))
        return args_hst, kwargs_hst

    def call(self, *args_dev, **kwargs):
        recorder = _ACTIVE
        if recorder is None:
            return original_call(self, *args_dev, **kwargs)
        recorder.in_kernel += 1
        try:
            if not recorder.run_triton:
                recorder.counts.launches.append(Launch("triton", self.fn.__name__))
                return None
            original_call(self, *args_dev, **kwargs)
            recorder.counts.launches.append(recorder.kernel.finish())
        finally:
            recorder.in_kernel -= 1
            recorder.kernel = None

    setattr(builder, "create_masked_load", masked_load)
    setattr(builder, "create_masked_store", masked_store)
    setattr(builder, "create_dot", dot)
    setattr(builder, "binary_op", binary_op)
    setattr(builder, "cast_impl", cast_impl)
    setattr(builder, "unary_op", unary_op)
    setattr(builder, "ternary_op", ternary_op)
    setattr(builder, "create_fma", fma)
    for name in _SPECIAL_FUNCTIONS:
        if name in originals:
            setattr(builder, name, special(name))
    executor.__call__, executor._init_args_hst = call, init_args
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(builder, name, original)
        executor.__call__, executor._init_args_hst = original_call, original_init_args


# ----------------------------------------------------------------------------------------------
# aten: a dispatch mode


def _footprint(tensor):
    """Bytes of the distinct elements a view covers (broadcast dims, stride 0, count once)."""
    elements = math.prod(size for size, stride in zip(tensor.shape, tensor.stride()) if stride != 0)
    return elements * tensor.element_size() if tensor.numel() else 0


def _without_out_dtype(schema, args):
    """Positional args without ``out_dtype`` (mm.dtype_out, addmm.dtype_out): flop formulas take shapes only."""
    names = [a.name for a in schema.arguments]
    if "out_dtype" not in names or names.index("out_dtype") >= len(args):
        return args
    position = names.index("out_dtype")
    return args[:position] + args[position + 1:]


def _make_dispatch_mode():
    import torch
    from torch._library.custom_ops import OPDEFS
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    class _AtenCounter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace != "aten":
                definition = OPDEFS.get(f"{func.namespace}::{func._opname}")
                if definition is not None:  # a Python custom op: count what its body runs
                    with self:
                        return definition._init_fn(*args, **kwargs)
                return func(*args, **kwargs)
            out = func(*args, **kwargs)
            recorder = _ACTIVE
            if recorder is None or recorder.in_kernel:
                return out
            name = func._overloadpacket.__name__
            schema = func._schema
            if name in FREE_OPS or (not schema.is_mutable and any(
                    r.alias_info is not None for r in schema.returns)):
                return out  # a view or an allocation
            destinations = [value for argument, value in zip(
                schema.arguments, list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]])
                if argument.alias_info is not None and argument.alias_info.is_write
                and isinstance(value, torch.Tensor)]
            written = {id(t) for t in destinations}
            read_tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            # "out" overloads (out, dtype_out, ...) write their destination without reading it; a tensor that is
            # also an input (addmm's accumulator passed as self and out) is still read once as that input
            skip_destination = name in WRITE_ONLY_DESTINATION or schema.overload_name.endswith("out")
            read_once = list(read_tensors)
            if skip_destination:
                for destination in destinations:
                    last = max(i for i, t in enumerate(read_once) if t is destination)
                    del read_once[last]
            read = sum(_footprint(t) for t in read_once)
            outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if name in EAGER_KERNELS:  # an aten op that CUDA runs as several kernels
                recorder.counts.launches.extend(Launch("aten", kernel, hbm_bytes=moved, requested_bytes=moved)
                                                for kernel, moved in EAGER_KERNELS[name](*args, out))
                return out
            bytes_moved = read + sum(_footprint(t) for t in outputs)
            flops = {}
            matmul_dtypes = ()
            base = name[:-1] if name.endswith("_") else name  # an in-place matmul (addmm_) is the matmul
            if base in MATMUL_OPS:
                operands = [t for t in read_tensors if t.dim() >= 1 and id(t) not in written]
                operands = operands[-2:] if name.startswith(("add", "badd")) else operands[:2]
                matmul_dtypes = ((tuple(_PRECISION.get(str(t.dtype), str(t.dtype)) for t in operands)),)
            formula = flop_registry.get(func._overloadpacket)
            if formula is None and base != name and base in MATMUL_OPS:
                formula = flop_registry.get(getattr(torch.ops.aten, base))
            if formula is not None:
                precision = _PRECISION.get(str(read_tensors[0].dtype), "fp32") if read_tensors else "fp32"
                if matmul_dtypes:  # the operands' precision, not an accumulator's
                    precision = matmul_dtypes[0][0] if len(set(matmul_dtypes[0])) == 1 else "fp32"
                flops[precision] = int(formula(*_without_out_dtype(schema, args), **{
                    k: v for k, v in kwargs.items() if k != "out_dtype"}, out_val=out))
            recorder.counts.launches.append(Launch("aten", name, hbm_bytes=bytes_moved, requested_bytes=bytes_moved,
                                                   flops=flops, matmul_dtypes=matmul_dtypes,
                                                   sync=name in SYNC_OPS))
            return out

    return _AtenCounter()


def _addmm_dtype_out(accumulator, a, b, out_dtype, *, beta=1, alpha=1, out):
    return _torch().addmm(accumulator, a.to(out_dtype), b.to(out_dtype), beta=beta, alpha=alpha, out=out)


@contextlib.contextmanager
def _half_gemm_on_cpu():
    """aten's ``addmm.dtype_out`` on the CPU inside the block (PyTorch implements it for CUDA only), so that
    memkernels' half GEMMs (memkernels::addmm_float32_, memkernels/fusions/common/half_gemm.py) take the overload
    they take on a GPU and are counted with the half operands a GPU reads. Nothing of aten's changes outside."""
    torch = _torch()
    if torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype_out", "CPU"):
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("addmm.dtype_out", _addmm_dtype_out, "CPU")
    try:
        yield
    finally:
        library._destroy()


@contextlib.contextmanager
def count(run_triton=True):
    """Count every Triton launch and aten op run inside the block; yields a :class:`Counts`.

    ``run_triton=False`` records Triton launches without running them (for fake tensors).
    Needs ``TRITON_INTERPRET=1`` for the Triton counts.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("memkernels.gpu_audit.count() does not nest")
    recorder = _Recorder(run_triton)
    with _patched_interpreter(), _half_gemm_on_cpu(), _make_dispatch_mode():
        _ACTIVE = recorder
        try:
            yield recorder.counts
        finally:
            _ACTIVE = None


# ----------------------------------------------------------------------------------------------
# Occupancy


@dataclass(frozen=True)
class SmLimits:
    registers: int = 65536
    threads: int = 2048
    blocks: int = 32
    shared_bytes: int = 0
    shared_reserved_per_block: int = 1024
    register_unit: int = 256  # registers are allocated per warp in units of this many


# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability".
SM_LIMITS = {80: SmLimits(shared_bytes=164 * 1024), 90: SmLimits(shared_bytes=228 * 1024)}


def blocks_per_sm(arch, registers, num_warps, shared_bytes):
    """Resident blocks per SM of a kernel: the least of the thread, register, shared-memory and block limits."""
    limits = SM_LIMITS[arch]
    threads = 32 * num_warps
    by_threads = limits.threads // threads
    regs_per_warp = -(-registers * 32 // limits.register_unit) * limits.register_unit
    by_registers = limits.registers // (regs_per_warp * num_warps) if registers > 0 else limits.blocks
    by_shared = (limits.shared_bytes // (shared_bytes + limits.shared_reserved_per_block)
                 if shared_bytes > 0 else limits.blocks)
    return min(by_threads, by_registers, by_shared, limits.blocks)


# ----------------------------------------------------------------------------------------------
# Ops at real shapes: each fusion's audit.py (memkernels/fusions/<family>/audit.py, the contract in
# memkernels/fusions/audit_case.py)


@functools.cache
def fusion_audits():
    """Every fusion's audit module (``memkernels.fusions.<family>.audit``), by the fusion's name."""
    import memkernels.fusions
    return tuple(importlib.import_module(f"memkernels.fusions.{info.name}.audit")
                 for info in pkgutil.iter_modules(memkernels.fusions.__path__)
                 if info.ispkg and importlib.util.find_spec(f"memkernels.fusions.{info.name}.audit") is not None)


def cases():
    """Every audited (op, real shape): each fusion's ``cases()``, the fusions in name order."""
    return [case for module in fusion_audits() for case in module.cases()]


def _torch():
    import torch
    return torch


# ----------------------------------------------------------------------------------------------
# Measuring and fitting




@contextlib.contextmanager
def _liger_interpreter_shim():
    """Liger's kernels under triton 3.9's interpreter, which has two gaps they hit:

    - a Python float kernel argument (an ``eps``) arrives as a bare float, where a compiled kernel sees an
      fp32 scalar, so Liger's ``eps.to(...)`` raises "'float' object has no attribute 'to'": floats are
      wrapped as fp32 scalars, as the compiler does;
    - ``triton.language.extra.libdevice`` functions are empty stubs (they return None): the ``rsqrt`` and
      ``tanh`` that Liger's op modules import from it are replaced by ``tl.rsqrt`` and 2*sigmoid(2x) - 1,
      which load and store nothing, so the byte counts stay Liger's own.

    Only around Liger's runs: memkernels' own kernels are counted under the unpatched interpreter."""
    import triton.language as tl
    from triton.runtime import interpreter
    import liger_kernel.ops  # noqa: F401 - its op modules are imported below, by name

    # looked up at call time: the interpreter patches triton.language's builtins while a kernel runs
    def rsqrt(x):
        return tl.rsqrt(x)

    def tanh(x):
        return 2 * tl.sigmoid(2 * x) - 1
    replacements = {"rsqrt": rsqrt, "tanh": tanh}
    patched = []  # (module, name, original)
    for name, module in list(sys.modules.items()):
        if name.startswith("liger_kernel.ops.") and module is not None:
            for function, replacement in replacements.items():
                original = getattr(module, function, None)
                if "libdevice" in str(getattr(original, "__module__", "")):
                    patched.append((module, function, original))
                    setattr(module, function, replacement)
    original_cvt = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return original_cvt(arg)
    interpreter._implicit_cvt = implicit_cvt
    try:
        yield
    finally:
        interpreter._implicit_cvt = original_cvt
        for module, function, original in patched:
            setattr(module, function, original)






def measure(case, shape, dtype, impl="memkernels"):
    """Run the op once at ``shape`` (real tensors, Triton under the interpreter): {"forward", "backward"} Counts."""
    import memkernels
    torch = _torch()
    torch.manual_seed(0)
    memkernels.set_backend("triton" if impl == "memkernels" else "auto")
    try:
        problem = case.build(shape, dtype, impl)
        liger = impl == "liger"
        with case.setup(shape) if case.setup else contextlib.nullcontext(), \
                _liger_interpreter_shim() if liger else contextlib.nullcontext(), \
                case.liger_setup(shape) if liger and case.liger_setup else contextlib.nullcontext():
            with count() as forward:
                outputs = problem.forward()
            with count() as backward:
                problem.backward(outputs)
    finally:
        memkernels.set_backend("auto")
    return {"forward": forward, "backward": backward}


def _pass_result(counts):
    ops = {}  # (kind, name) -> {unit: elementwise instructions}, summed over the kernel's launches
    for launch in counts.launches:
        entry = ops.setdefault((launch.kind, launch.name), {})
        for unit, n in launch.ops.items():
            entry[unit] = entry.get(unit, 0) + n
    kernels = {}
    for (kind, name), (launches, hbm, requested, flops) in counts.by_kernel().items():
        kernels[(kind, name)] = {"launches": launches, "hbm": hbm, "requested": requested, "flops": flops,
                                 "ops": ops[(kind, name)]}
    return PassResult(kernels, sorted(set(counts.matmul_dtypes)), counts.syncs)


def exact(case, dtype, impl="eager"):
    """Counts of a PyTorch-only implementation at the real shape, on fake tensors (no data, no time)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        run = measure(case, case.shape, dtype, impl)
    for phase, counts in run.items():
        if any(x.kind == "triton" for x in counts.launches):
            raise RuntimeError(f"memkernels.gpu_audit.exact: {impl} {case.op} launches Triton kernels, which "
                               "fake tensors cannot run; use fit()")
    return {phase: _pass_result(counts) for phase, counts in run.items()}


def _monomials(variables):
    return [combo for r in range(len(variables) + 1) for combo in itertools.combinations(variables, r)]


def _design(shapes, variables):
    return np.array([[math.prod(shape[v] for v in combo) for combo in _monomials(variables)] for shape in shapes],
                    dtype=np.float64)


def _summaries(counts):
    """{(kind, name, metric): number} for one pass: launches, bytes, FLOPs, syncs."""
    out = {}
    for (kind, name), (launches, hbm, requested, flops) in counts.by_kernel().items():
        out[(kind, name, "launches")] = launches
        if kind == "aten":  # a Triton kernel's HBM bytes follow from its per-argument counts at the real shape
            out[(kind, name, "hbm")] = hbm
        out[(kind, name, "requested")] = requested
        for precision, f in flops.items():
            out[(kind, name, "flops:" + precision)] = f
    for launch in counts.launches:
        if launch.dot:
            out[(launch.kind, launch.name, "dot")] = 1
        for unit, n in launch.ops.items():
            key = (launch.kind, launch.name, "ops:" + unit)
            out[key] = out.get(key, 0) + n
        if launch.kind == "triton":
            key = (launch.kind, launch.name, "programs")
            out[key] = out.get(key, 0) + launch.programs
        for position, requested, distinct, misses, transfers in launch.arguments:
            for metric, value in (("requested", requested), ("distinct", distinct), ("misses", misses),
                                  ("transfers", transfers)):
                key = (launch.kind, launch.name, f"arg{position}:{metric}")
                out[key] = out.get(key, 0) + value
    return out


@dataclass
class PassResult:
    """One pass of one op at the real shape (fitted), with what the model predicts."""

    kernels: dict  # (kind, name) -> {"launches", "hbm", "requested", "flops": {precision: n}, "ops": {unit: n}}
    matmul_dtypes: list
    syncs: list
    ops_scaled: list = field(default_factory=list)  # kernels whose elementwise ops are scaled, not fitted (fit())

    @property
    def hbm_bytes(self):
        return sum(k["hbm"] for k in self.kernels.values())

    def flops(self, precision=None):
        return sum(f for k in self.kernels.values() for p, f in k["flops"].items() if precision in (None, p))

    @property
    def launches(self):
        return sum(k["launches"] for k in self.kernels.values())

    def seconds(self, gpu):
        total = 0.0
        for k in self.kernels.values():
            if not k["launches"]:
                continue
            per = Launch("", "", hbm_bytes=k["hbm"] / k["launches"],
                         flops={p: f / k["launches"] for p, f in k["flops"].items()},
                         ops={u: n / k["launches"] for u, n in k.get("ops", {}).items()})
            total += k["launches"] * per.seconds(gpu)
        return total


def fit(case, dtype, impl="memkernels", measure_fn=None):
    """The op's counts at ``case.shape``, fitted exactly from small shapes; raises if a held-out shape disagrees."""
    measure_fn = measure_fn or measure
    variables = case.variables
    shapes = [dict(case.shape, **dict(zip(variables, values)))
              for values in itertools.product(*(case.fit_values[v] for v in variables))]
    checks = [dict(case.shape, **c) for c in case.check_values]
    runs = [measure_fn(case, s, dtype, impl) for s in shapes + checks]
    design = _design(shapes, variables)
    results = {}
    for phase in ("forward", "backward"):
        if impl == "liger" and case.liger_real_shape:
            real = case.liger_real_shape(case.shape)
        else:
            real = case.real_shape(case.shape, dtype, phase) if case.real_shape else case.shape
        summaries = [_summaries(run[phase]) for run in runs]
        keys = sorted(set().union(*summaries))
        targets = np.array([[s.get(k, 0) for k in keys] for s in summaries[:len(shapes)]], dtype=np.float64)
        coefficients = np.linalg.solve(design, targets) if design.shape[0] == design.shape[1] else \
            np.linalg.lstsq(design, targets, rcond=None)[0]
        predicted_checks = _design(checks, variables) @ coefficients
        scaled = set()  # elementwise-op counts of kernels whose lanes past a row's end still compute
        for check, prediction, summary in zip(checks, predicted_checks, summaries[len(shapes):]):
            actual = np.array([summary.get(k, 0) for k in keys], dtype=np.float64)
            wrong = [(k, int(round(p)), int(a)) for k, p, a in zip(keys, prediction, actual) if abs(p - a) > 0.5]
            scaled.update(k for k, _, _ in wrong if k[2].startswith("ops:"))
            wrong = [w for w in wrong if not w[0][2].startswith("ops:")]
            if wrong:
                raise RuntimeError(f"memkernels.gpu_audit: {case.op} {phase} counts are not the polynomial the fit "
                                   f"assumes at {check}: (count, predicted, measured) {wrong[:4]}")
        values = _design([real], variables) @ coefficients
        # A kernel that pads its rows to a block runs its elementwise instructions on the padding too (a
        # GPU's masked lanes still execute): not a polynomial in the shape. Its ops are scaled from the
        # largest measured shape by the kernel's requested bytes (exact), where padding is the smallest
        # share it is measured at; the result says which kernels (ops_scaled), never silently.
        if scaled:
            largest = max(range(len(runs)),
                          key=lambda i: sum(summaries[i].get(k, 0) for k in keys if k[2] == "requested"))
        for index, key in enumerate(keys):
            if key in scaled:
                requested = (key[0], key[1], "requested")
                real_requested = values[0][keys.index(requested)]
                values[0][index] = summaries[largest][key] * real_requested / summaries[largest][requested]
        kernels = {}
        for key, value in zip(keys, values[0]):
            kind, name, metric = key
            entry = kernels.setdefault((kind, name), {"launches": 0, "hbm": 0, "requested": 0, "flops": {}, "ops": {}})
            value = int(round(value))
            if metric.startswith("flops:"):
                entry["flops"][metric[6:]] = value
            elif metric.startswith("ops:"):
                entry["ops"][metric[4:]] = value
            elif metric.startswith("arg"):
                position, what = metric[3:].split(":")
                entry.setdefault("arguments", {}).setdefault(int(position), {})[what] = value
            else:
                entry[metric] = value
        for (kind, name), entry in kernels.items():
            if "arguments" in entry:  # the L2 rule applies at the real shape, not the small ones
                per_argument = [(p, a["requested"], a["distinct"], a["misses"], a["transfers"])
                                for p, a in entry.pop("arguments").items()]
                entry.pop("programs", None)
                entry["hbm"] = _hbm_bytes(per_argument, entry.pop("dot", 0) > 0, max(entry["launches"], 1))
        last = runs[-1][phase]
        results[phase] = PassResult(kernels, sorted(set(last.matmul_dtypes)), last.syncs,
                                    sorted({name for _, name, _ in scaled}))
    return results


# ----------------------------------------------------------------------------------------------
# The audit


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class Row:
    """One (op, shape, dtype, pass) of the audit table."""

    op: str
    label: str
    dtype: str
    phase: str
    result: PassResult
    minimum_bytes: int
    minimum_flops: int
    eager: PassResult = None
    liger: PassResult = None

    @property
    def byte_ratio(self):
        return self.result.hbm_bytes / self.minimum_bytes if self.minimum_bytes else float("nan")

    def float32_matmuls(self):
        """Matmuls with a float32 operand although the op's inputs are half precision."""
        if self.dtype == "fp32":
            return []
        return [(name, dtypes) for name, dtypes in self.result.matmul_dtypes if "fp32" in dtypes]


def audit(ops=None, dtypes=("bf16", "fp32"), eager=True, liger=False, progress=None, on_rows=None):
    """Count every op in ``ops`` (default: all of :func:`cases`) at its real shapes; a list of :class:`Row`.

    Needs ``TRITON_INTERPRET=1`` (the CLI re-runs itself with it).
    """
    torch = _torch()
    rows = []
    for case in cases():
        if ops and case.op not in ops:
            continue
        for dtype_name in dtypes:
            dtype = getattr(torch, _DTYPES[dtype_name])
            if progress:
                progress(f"{case.op} {case.label} {dtype_name}")
            ours = fit(case, dtype)
            theirs = exact(case, dtype, "eager") if eager else None
            liger_result = None
            if liger and case.liger and _liger_available():
                try:
                    liger_result = fit(case, dtype, "liger")
                except Exception as error:  # noqa: BLE001 - a Liger kernel the interpreter cannot run
                    if progress:
                        progress(f"  Liger's {case.op} not counted: {type(error).__name__}: {str(error)[:200]}")
            minimum = case.minimum(case.shape, torch.finfo(dtype).bits // 8)
            new_rows = [Row(case.op, case.label, dtype_name, phase, ours[phase], *minimum[phase],
                            theirs[phase] if theirs else None, liger_result[phase] if liger_result else None)
                        for phase in ("forward", "backward")]
            if case.step_row:
                new_rows.append(step_row(*new_rows))
            rows += new_rows
            if on_rows:
                on_rows(new_rows)
    return rows


def _step(forward, backward):
    """forward + backward as one PassResult (kernels keyed by pass, so each keeps its own launch size)."""
    if forward is None or backward is None:
        return None
    kernels = {(phase,) + key: value for phase, result in (("forward", forward), ("backward", backward))
               for key, value in result.kernels.items()}
    return PassResult(kernels, sorted(set(forward.matmul_dtypes) | set(backward.matmul_dtypes)),
                      forward.syncs + backward.syncs)


def step_row(forward, backward):
    """The 'step' row: a forward Row and its backward Row added up (bytes, FLOPs, launches, model times)."""
    return Row(forward.op, forward.label, forward.dtype, "step", _step(forward.result, backward.result),
               forward.minimum_bytes + backward.minimum_bytes, forward.minimum_flops + backward.minimum_flops,
               _step(forward.eager, backward.eager), _step(forward.liger, backward.liger))


def _liger_available():
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def _mib(n):
    return f"{n / 2**20:,.1f}"


def format_table(rows, header=True, footer=True):
    """The audit as a fixed-width table; times are the model's, labelled so."""
    h100, a100 = GPUS["H100-SXM"], GPUS["A100-80GB"]
    head = (f"{'op':<22}{'shape':<34}{'dtype':<6}{'pass':<9}{'HBM MiB':>10}{'min MiB':>10}{'x min':>7}"
            f"{'GFLOP':>9}{'fp32 mm':>8}{'syncs':>6}{'launch':>7}{'model H100 us':>14}{'eager':>9}"
            f"{'liger':>9}{'model A100 us':>14}{'eager':>9}")
    lines = [head] if header else []
    for r in rows:
        eager_h = f"{r.eager.seconds(h100) * 1e6:9.0f}" if r.eager else f"{'-':>9}"
        eager_a = f"{r.eager.seconds(a100) * 1e6:9.0f}" if r.eager else f"{'-':>9}"
        liger_h = f"{r.liger.seconds(h100) * 1e6:9.0f}" if r.liger else f"{'-':>9}"
        lines.append(
            f"{r.op:<22}{r.label:<34}{r.dtype:<6}{r.phase:<9}{_mib(r.result.hbm_bytes):>10}{_mib(r.minimum_bytes):>10}"
            f"{r.byte_ratio:7.2f}{r.result.flops() / 1e9:9.1f}{len(r.float32_matmuls()):>8}{len(r.result.syncs):>6}"
            f"{r.result.launches:>7}{r.result.seconds(h100) * 1e6:14.0f}{eager_h}{liger_h}"
            f"{r.result.seconds(a100) * 1e6:14.0f}{eager_a}")
    if not footer:
        return "\n".join(lines)
    lines.append("")
    lines.append(f"Times are a MODEL, not measurements: per launch max(bytes / HBM bandwidth, FLOPs / peak) + "
                 f"{LAUNCH_OVERHEAD_S * 1e6:.0f} us;")
    for gpu in (h100, a100):
        peaks = ", ".join(f"{p} {f / 1e12:g} TFLOP/s" for p, f in gpu.peak_flops.items())
        lines.append(f"  {gpu.name}: HBM {gpu.hbm_bytes_per_s / 1e12:g} TB/s, {peaks} (datasheet, dense).")
    lines.append(f"Shapes: {TOKENS} tokens. 'x min': HBM bytes over the pass's minimum (inputs read once, outputs "
                 "written once). 'fp32 mm': matmuls with a float32 operand on half inputs. 'eager': the same model "
                 "on eager PyTorch's ops for the same computation.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Predictions at a benchmark's own shape


def case_at(op, shape, dtype="bf16"):
    """The op's audited case at ``shape``, a dict of some of its shape variables (the others keep the case's
    values): gated_linear's SwiGLU; for linear_cross_entropy the strategy its "auto" rule picks at that shape
    and ``dtype``."""
    import dataclasses
    matches = [c for c in cases() if c.op == op]
    if not matches:
        raise ValueError(f"memkernels.gpu_audit: op {op!r} is not audited; choose from "
                         f"{', '.join(sorted({c.op for c in cases()}))}")
    case = matches[0]
    unknown = sorted(set(shape) - set(case.shape))
    if unknown:
        raise ValueError(f"memkernels.gpu_audit: {op}'s shape has variables {', '.join(sorted(case.shape))}, not "
                         f"{', '.join(unknown)}")
    if op == "linear_cross_entropy":
        from memkernels.fusions.loss.linear_cross_entropy import pick_strategy
        full = dict(case.shape, **shape)
        strategy = pick_strategy("auto", full["N"], full["H"], full["V"], getattr(_torch(), _DTYPES[dtype]),
                                 True, "mean")
        case = next(c for c in matches if c.label.endswith(strategy))
    return dataclasses.replace(case, label=",".join(f"{k}={v}" for k, v in shape.items()),
                               shape=dict(case.shape, **shape))


def predict(op, shape, dtype="bf16", impls=("memkernels", "eager")):
    """{impl: {GPU name: {"forward": s, "backward": s}}}: the model's time of ``op`` at ``shape`` (see
    :func:`case_at`) for each of ``impls`` ("memkernels", "eager", "liger"). Needs ``TRITON_INTERPRET=1``
    (:func:`prediction_line` runs it in a child process)."""
    torch = _torch()
    case = case_at(op, shape, dtype)
    torch_dtype = getattr(torch, _DTYPES[dtype])
    out = {}
    for impl in impls:
        result = exact(case, torch_dtype) if impl == "eager" else fit(case, torch_dtype, impl)
        out[impl] = {gpu.name: {phase: result[phase].seconds(gpu) for phase in ("forward", "backward")}
                     for gpu in GPUS.values()}
    return out


def model_gpu(device_name):
    """The :data:`GPUS` entry that models a CUDA device name, or None: only the boards whose datasheet figures
    :data:`GPUS` holds ("NVIDIA H100 80GB HBM3" is the SXM board; H100 PCIe / NVL and A100 40GB / PCIe have
    other bandwidths and peaks; "NVIDIA H200" is the SXM board, "NVIDIA H200 NVL" is not)."""
    if device_name == "NVIDIA H200":
        return "H200-SXM"
    if "H100" in device_name and "HBM3" in device_name and not any(m in device_name for m in ("PCIe", "NVL")):
        return "H100-SXM"
    if "A100-SXM4-80GB" in device_name:
        return "A100-80GB"
    return None


def _interpreted_child_env():
    """Environment of a child process that counts on the CPU: Triton's interpreter, no CUDA, this package."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)


def _triton_version():
    import triton
    return triton.__version__


def prediction_line(op, shape, dtype, device_name, impls=("memkernels", "eager")):
    """One line for a benchmark's GPU section: the audit's predicted milliseconds of ``op`` at ``shape``
    on the GPU that models ``device_name``, forward and backward per impl, labelled as a model.
    ``dtype``: "bf16" / "fp16" / "fp32" or the torch dtype.

    The counts need the Triton interpreter, which a process running compiled kernels cannot switch on:
    unless this process is interpreted, they are made in a child process (CPU only).
    """
    if not isinstance(dtype, str):  # a torch.dtype
        dtype = _PRECISION[str(dtype)]
    gpu = model_gpu(device_name)
    if gpu is None:
        return (f"audit model: no figures for {device_name} (modelled: {', '.join(GPUS)}); "
                "no prediction printed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        seconds = predict(op, shape, dtype, impls)
    else:
        import json
        argv = ["--predict", op, "--shape", ",".join(f"{k}={v}" for k, v in shape.items()), "--dtype", dtype]
        for impl in impls:
            argv += ["--impl", impl]
        run = subprocess.run([sys.executable, "-m", "memkernels.audit.gpu_audit", *argv],
                             env=_interpreted_child_env(), capture_output=True, text=True)
        if run.returncode:
            # A benchmark's measured times stand without the model: say why it is missing, do not abort.
            last = (run.stderr.strip().splitlines() or ["no output"])[-1]
            return (f"audit model: counting {op} at {shape} failed in the interpreted child (triton "
                    f"{_triton_version()}): {last[-300:]}; no prediction printed")
        seconds = json.loads(run.stdout)
    parts = []
    for impl in impls:
        forward, backward = (seconds[impl][gpu][phase] * 1e3 for phase in ("forward", "backward"))
        parts.append(f"{impl} fwd {forward:.3f} + bwd {backward:.3f} = {forward + backward:.3f} ms")
    return f"audit MODEL for {gpu} (not a measurement; {dtype}): " + ", ".join(parts)


def occupancy(names=None, archs=(80, 90)):
    """[(kernel, variant, arch, registers, shared bytes, warps, blocks per SM)] from the AOT compile."""
    from memkernels import aot
    for module in aot.ops_modules():
        __import__(module)
    warps = aot.variant_warps()
    rows = []
    for report in aot.check(names, archs):
        n_warps = warps[(report.kernel, report.variant)]
        blocks = blocks_per_sm(report.arch, report.registers, n_warps, report.shared_bytes) if report.ok else 0
        rows.append((report.kernel, report.variant, report.arch, report.registers, report.shared_bytes, n_warps,
                     blocks))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m memkernels.audit.gpu_audit", description=__doc__.split("\n")[0])
    parser.add_argument("--op", action="append", help="op to audit (repeatable; default every op)")
    parser.add_argument("--dtype", action="append", choices=sorted(_DTYPES), help="default bf16 and fp32")
    parser.add_argument("--liger", action="store_true", help="also count Liger's kernels (liger-kernel installed)")
    parser.add_argument("--occupancy", action="store_true",
                        help="also compile the kernels of the audited ops (every kernel without --op) for "
                             "sm_80/sm_90 (memkernels.aot) and print blocks per SM")
    parser.add_argument("--predict", metavar="OP",
                        help="print the model's seconds of OP at --shape as JSON {impl: {gpu: {pass: s}}}")
    parser.add_argument("--shape", default="", help="with --predict: VAR=VALUE,... (e.g. N=4096,H=4096)")
    parser.add_argument("--impl", action="append", choices=("memkernels", "eager", "liger"),
                        help="with --predict (repeatable; default memkernels and eager)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads the variable at import: count in a child that runs the kernels on the CPU.
        argv = argv if argv is not None else sys.argv[1:]
        return subprocess.run([sys.executable, "-m", "memkernels.audit.gpu_audit", *argv],
                              env=_interpreted_child_env()).returncode
    if args.predict:
        import json
        try:
            shape = {k: int(v) for k, v in (item.split("=") for item in args.shape.split(",") if item)}
        except ValueError:
            parser.error(f"--shape {args.shape!r}: expected VAR=INTEGER,... (e.g. N=4096,H=4096)")
        try:
            seconds = predict(args.predict, shape, (args.dtype or ["bf16"])[0],
                              tuple(args.impl or ("memkernels", "eager")))
        except ValueError as error:
            parser.error(str(error))
        print(json.dumps(seconds))
        return 0
    known = {c.op for c in cases()}
    unknown = sorted(set(args.op or ()) - known)
    if unknown:
        parser.error(f"--op {unknown[0]!r} is not audited; choose from {', '.join(sorted(known))}")
    print(format_table([], footer=False), flush=True)
    audit(args.op, tuple(args.dtype or ("bf16", "fp32")), liger=args.liger,
          progress=lambda what: print(f"counting {what} ...", file=sys.stderr, flush=True),
          on_rows=lambda rows: print(format_table(rows, header=False, footer=False), flush=True))
    print(format_table([], header=False))
    if args.occupancy:
        print()
        print(f"{'kernel':<30}{'variant':<34}{'arch':<7}{'regs':>6}{'smem B':>9}{'warps':>6}{'blocks/SM':>10}")
        names = sorted({k for case in cases() if case.op in args.op for k in case.aot_kernels}) if args.op else None
        for kernel, variant, arch, regs, smem, n_warps, blocks in occupancy(names):
            print(f"{kernel:<30}{variant:<34}{'sm_' + str(arch):<7}{regs:>6}{smem:>9}{n_warps:>6}{blocks:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
