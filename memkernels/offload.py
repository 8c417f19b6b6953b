"""``memkernels.offload`` is :mod:`memkernels.runtime.offload` (its home since the runtime got its folder): this module
makes ``import memkernels.offload`` give that very module object, so attributes set on either are one."""
import sys

from memkernels.runtime import offload

sys.modules[__name__] = offload
