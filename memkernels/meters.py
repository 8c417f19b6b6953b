"""``memkernels.meters`` is :mod:`memkernels.runtime.meters` (its home since the runtime got its folder): this module
makes ``import memkernels.meters`` give that very module object, so attributes set on either are one."""
import sys

from memkernels.runtime import meters

sys.modules[__name__] = meters
