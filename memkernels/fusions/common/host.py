"""Launch arithmetic on the host, in plain Python.

Triton 3.9 wraps ``triton.cdiv`` and ``triton.next_power_of_2`` as ``ConstexprFunction`` objects so
kernels can call them too; called from a launcher, each call pays about 4 us of argument unwrapping
(measured on this project's CPU), several per launch where a norm step's whole host path is 150-200
us. Kernels keep calling Triton's own.
"""


def cdiv(numerator, denominator):
    """ceil(numerator / denominator) for positive ints."""
    return -(-numerator // denominator)


def next_power_of_2(n):
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1
