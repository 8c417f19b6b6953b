"""Sizes as people write them (``80GB``, ``79.6GiB``, ``80G``, ``24000MiB``, ``4M`` tokens), and tables as people
read them (:func:`text_table`).

Memory sizes follow the JEDEC convention that GPU and DRAM capacities are sold
in: ``K``/``KB``/``KiB`` = 2¹⁰, ``M``/``MB``/``MiB`` = 2²⁰, ``G``/``GB``/``GiB`` =
2³⁰, ``T``/``TB``/``TiB`` = 2⁴⁰. So an "80GB" H100 is ``80GB`` = 80 GiB, and
``24000MiB`` is what ``nvidia-smi --format=csv`` prints. A bare number is
refused: 24000 could be bytes, MiB or GB, and each reading is off by 10³ or more.

Counts (tokens, samples) are decimal: ``4M`` = 4·10⁶, ``2k`` = 2000.
"""
import re

_MEMORY_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
# Counts are decimal (4M tokens = 4,000,000), as people quote them; "Ki", "Mi", ... are the binary ones
# (64Ki = 65,536, a power-of-two batch), spelled so that neither reads as the other.
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12,
                "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
# The sign is matched so that "-1G" is told it must be positive, not that it lacks a unit.
_MEMORY_RE = re.compile(r"\s*([-+]?[0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt])(?:i?b)?\s*", re.I)
_COUNT_RE = re.compile(r"\s*([-+]?[0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i|[kmgbt]|)\s*", re.I)
# Far above any memory or count anyone means; keeps "1e999G" (float inf) out of int().
_LARGEST = 2.0**80

MEMORY_FORMS = "80GB, 80GiB, 80G (all 80·2³⁰ bytes), 79.6GiB or 24000MiB"

#: What any single GPU has: refuse figures outside it as a unit mistake.
MIN_DEVICE_BYTES = 2**30
MAX_DEVICE_BYTES = 2 * 2**40


class SizeError(ValueError):
    """A size that cannot be read; the message names the argument and the accepted forms.

    ``what`` is the argument's name and ``detail`` the message without it (argparse adds its own).
    """

    def __init__(self, what, detail):
        super().__init__(f"{what}: {detail}")
        self.what, self.detail = what, detail


def parse_size(text, *, what="size"):
    """``'80GB'`` → ``85899345920`` (80·2³⁰). Raises :class:`SizeError` for a bare number.

    ``what`` names the argument in the error message (e.g. ``"--gpu-mem"``).
    """
    match = _MEMORY_RE.fullmatch(str(text))
    if not match:
        raise SizeError(what, f"{text!r} is not a memory size with a unit; write e.g. {MEMORY_FORMS}")
    value = float(match.group(1)) * _MEMORY_UNITS[match.group(2).lower()]
    if value > _LARGEST:
        raise SizeError(what, f"{text!r} is larger than any memory; write e.g. {MEMORY_FORMS}")
    nbytes = int(round(value))
    if nbytes <= 0:
        raise SizeError(what, f"{text!r} must be positive; write e.g. {MEMORY_FORMS}")
    return nbytes


def parse_device_size(text, *, what="--gpu-mem"):
    """:func:`parse_size`, refusing figures no single GPU has (below 1 GiB or above 2 TiB)."""
    nbytes = parse_size(text, what=what)
    if not MIN_DEVICE_BYTES <= nbytes <= MAX_DEVICE_BYTES:
        raise SizeError(what, f"{text!r} is {format_size(nbytes)}, outside what one GPU has "
                              f"(1 GiB to 2 TiB); write e.g. {MEMORY_FORMS}")
    return nbytes


def parse_count(text, *, what="count"):
    """``'4M'`` → ``4000000``; ``'2k'`` → ``2000``; ``'64Ki'`` → ``65536``; a plain integer is taken as it is."""
    match = _COUNT_RE.fullmatch(str(text))
    if not match:
        raise SizeError(what, f"{text!r} is not a count; write e.g. 4M, 500k, 64Ki or 4000000")
    value = float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()]
    if value > _LARGEST:
        raise SizeError(what, f"{text!r} is too large a count; write e.g. 4M, 500k or 4000000")
    if value <= 0 or value != int(value):
        raise SizeError(what, f"{text!r} must be a positive whole number")
    return int(value)


def format_size(nbytes):
    """``1536`` → ``'1.50 KiB'`` (binary units)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def text_table(header, rows):
    """``header`` and ``rows`` (sequences of cells) as aligned text: the first column left, the others right."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])
