"""``memkernels.allocator`` is :mod:`memkernels.runtime.allocator` (its home since the runtime got its folder): this
module makes ``import memkernels.allocator`` give that very module object, so attributes set on either are one."""
import sys

from memkernels.runtime import allocator

sys.modules[__name__] = allocator
