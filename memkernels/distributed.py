"""What memkernels needs of ``torch.distributed.tensor`` (tensor parallelism), in one place.

The ops take DTensors where a rank can compute on its own shards (memkernels/fusions: the norms, silu_mul /
gelu_mul, gated_linear, gelu_linear, cross_entropy on logits and linear_cross_entropy on an LM head sharded over
the classes); ``apply()`` fuses colwise-then-rowwise gated MLPs and the loss of such a head, and leaves modules
in other DTensor layouts alone (memkernels/fusions/).
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


def sharded_along(tensor, dim):
    """Whether ``tensor`` is a DTensor split along ``dim`` on a 1-D mesh (placements ``(Shard(dim),)``):
    ColwiseParallel's layout of a Linear's weight and bias (dim 0: an LM head's vocabulary split over the ranks),
    RowwiseParallel's of its weight (dim 1)."""
    if not is_dtensor(tensor) or tensor.device_mesh.ndim != 1:
        return False
    from torch.distributed.tensor import Shard
    return tuple(tensor.placements) == (Shard(dim),)


def layout_hooks_only(module):
    """Whether every forward hook of ``module`` is one ``parallelize_module`` registered (through
    ``distribute_module``): hooks that lay the module's inputs and outputs out over the mesh, nothing else."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return all(getattr(hook, "__module__", None) == "torch.distributed.tensor._api"
               and getattr(hook, "__qualname__", "").startswith("distribute_module.") for hook in hooks)


def shard_offset(tensor, dim, what):
    """This rank's first index along ``dim`` of a DTensor sharded over ``dim`` on a 1-D mesh. Shard splits as
    torch.chunk does (the first ranks hold ceil(size / ranks) each); ValueError naming ``what`` for another split."""
    mesh = tensor.device_mesh
    size, ranks, rank = tensor.shape[dim], mesh.size(), mesh.get_local_rank()
    step = -(-size // ranks)
    offset = min(rank * step, size)
    expected = min(step, size - offset)
    if tensor.to_local().shape[dim] != expected:
        raise ValueError(f"{what} holds {tensor.to_local().shape[dim]} of {size} along dim {dim} on this rank where "
                         f"Shard over {ranks} ranks gives {expected}; an uneven sharding is not supported: pass "
                         ".full_tensor()")
    return offset
