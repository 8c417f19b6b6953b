"""What memkernels needs of ``torch.distributed.tensor`` (tensor parallelism), in one place.

The ops take DTensors where a rank can compute on its own shards (memkernels/ops: the norms, silu_mul /
gelu_mul, gated_linear); ``apply()`` leaves modules whose weights are DTensors alone (memkernels/patch.py).
"""
import functools


@functools.cache
def dtensor_class():
    """``torch.distributed.tensor.DTensor``, or None for a torch built without distributed."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def is_dtensor(value):
    """Whether ``value`` is a DTensor (False wherever torch has no distributed)."""
    dtensor = dtensor_class()
    return dtensor is not None and isinstance(value, dtensor)


def contiguous_stride(shape):
    """The strides of a contiguous tensor of ``shape``: a DTensor made from local shards is laid out so."""
    stride, step = [], 1
    for size in reversed(tuple(shape)):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))
