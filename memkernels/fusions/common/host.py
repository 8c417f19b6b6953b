"""Launch arithmetic on the host, in plain Python, and the row blocks the PyTorch reference paths walk.

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


def row_blocks(rows, width, elements):
    """(start, stop) of consecutive blocks of ``rows`` rows of ``width`` elements, at most ``elements`` elements a
    block (one row at least): the reference paths' float32 temporaries are one block's, whatever the tensor's
    size. Each path passes its own bound (read at the call, so a test may shrink it)."""
    step = max(1, elements // max(width, 1))
    return ((start, min(start + step, rows)) for start in range(0, rows, step))
