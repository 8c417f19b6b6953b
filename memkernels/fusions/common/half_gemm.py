"""GEMMs on half-precision operands accumulating into a float32 tensor (``out_dtype=torch.float32``).

On CUDA, ``torch.addmm`` with ``out_dtype`` runs cuBLAS on the tensor cores and accumulates in
float32, where upcasting the operands first would run the GEMM at float32 speed (TF32 is off by
default). PyTorch implements that overload for CUDA only; elsewhere the GEMM is the custom op
``memkernels::addmm_float32_``, which widens the operands first (a product of two bf16/fp16 numbers
is exact in float32, so only the order of the float32 sums can differ). On ``meta`` (the planner's
profiles) the op is its fake, and memory meters see what a GPU allocates: the widened copies stay
inside the op, as a kernel's workspace would (memkernels.runtime.meters.ONE_KERNEL_OPS). memkernels
registers nothing into PyTorch's own ``aten`` namespace: the GPU audit, which counts the overload as a
GPU runs it, gives the CPU aten's kernel inside its own count only (memkernels.audit.gpu_audit.count),
where the op's body then takes it. The op has no autograd: it runs inside backward passes and forward
steps that compute their own gradients.
"""
import torch

_OVERLOAD = "aten::addmm.dtype_out"


def runs_float32_out(device):
    """Whether aten's ``addmm.dtype_out`` (half operands into a float32 result) has a kernel for ``device``."""
    if device.type == "cuda":
        return True
    return torch._C._dispatch_has_kernel_for_dispatch_key(_OVERLOAD, torch._C._dispatch_key_for_device(device.type))


def _float32_result_gemm(accumulator, a, b):
    """aten's GEMM of half operands into the float32 accumulator (cuBLAS on CUDA)."""
    torch.addmm(accumulator, a, b, out_dtype=torch.float32, out=accumulator)


@torch.library.custom_op("memkernels::addmm_float32_", mutates_args=("accumulator",))
def _addmm_float32(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if runs_float32_out(accumulator.device):  # inside the GPU audit's count on the CPU
        _float32_result_gemm(accumulator, a, b)
    else:
        accumulator.addmm_(a.to(accumulator.dtype), b.to(accumulator.dtype))


@_addmm_float32.register_fake
def _(accumulator, a, b):
    return None


def addmm_float32_(accumulator, a, b):
    """accumulator += a @ b: half operands into a float32 accumulator (accumulated in float32), or operands of
    the accumulator's own dtype. Returns the accumulator. On CUDA, aten's overload directly: the custom op's
    dispatch (~20 us of host time a call here) would sit on a GPU step's host path for nothing."""
    if a.dtype == accumulator.dtype:
        return accumulator.addmm_(a, b)
    if accumulator.is_cuda:
        _float32_result_gemm(accumulator, a, b)
    else:
        _addmm_float32(accumulator, a, b)
    return accumulator
