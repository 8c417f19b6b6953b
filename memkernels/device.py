"""``memkernels.device`` is :mod:`memkernels.runtime.device` (its home since the runtime got its folder): this module
makes ``import memkernels.device`` give that very module object, so attributes set on either are one."""
import sys

from memkernels.runtime import device

sys.modules[__name__] = device
