"""memkernels.runtime.sizes: memory sizes as people write them, and the ones no GPU has."""
import pytest

from memkernels.runtime.sizes import (MAX_DEVICE_BYTES, MIN_DEVICE_BYTES, SizeError, format_size, parse_count,
                                      parse_device_size, parse_size)

GiB = 2**30


@pytest.mark.parametrize("text, nbytes", [
    ("80GB", 80 * GiB), ("80G", 80 * GiB), ("80GiB", 80 * GiB), ("80 gib", 80 * GiB), ("24000MiB", 24000 * 2**20),
    ("79.6GiB", round(79.6 * GiB)), ("1.5e2M", 150 * 2**20), ("2T", 2 * 2**40), ("+4K", 4096),
])
def test_units_are_jedec_powers_of_two(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text, says", [
    ("80", "is not a memory size with a unit"), ("4294967296", "is not a memory size with a unit"),
    ("eighty", "is not a memory size with a unit"), ("", "is not a memory size with a unit"),
    (None, "is not a memory size with a unit"), ("80XB", "is not a memory size with a unit"),
    ("0G", "must be positive"), ("-1G", "must be positive"),
    ("1e999G", "larger than any memory"),  # float inf: an OverflowError before
])
def test_bad_sizes_name_the_argument_and_the_accepted_forms(text, says):
    with pytest.raises(SizeError) as info:
        parse_size(text, what="--capacity")
    message = str(info.value)
    assert message.startswith("--capacity: ") and says in message and "80GB, 80GiB, 80G" in message
    assert info.value.what == "--capacity" and message == f"--capacity: {info.value.detail}"


def test_device_sizes_stay_within_what_one_gpu_has():
    assert parse_device_size("1GiB") == MIN_DEVICE_BYTES and parse_device_size("2TiB") == MAX_DEVICE_BYTES
    for text in ("1023MiB", "2049GiB"):
        with pytest.raises(SizeError, match="outside what one GPU has"):
            parse_device_size(text)


def test_counts_are_decimal_and_whole():
    assert parse_count("4M") == 4_000_000 and parse_count("2k") == 2000 and parse_count("4000000") == 4_000_000
    # binary counts say so (issue 38: "64K" read as 64,000 where a power of two was meant)
    assert parse_count("64Ki") == 65_536 and parse_count("1Mi") == 2**20 and parse_count("2gi") == 2 * 2**30
    for text, says in (("0.5", "positive whole number"), ("-4M", "positive whole number"),
                       ("1e999", "too large"), ("lots", "not a count")):
        with pytest.raises(SizeError, match=says):
            parse_count(text, what="--tokens")


def test_format_size():
    assert format_size(1536) == "1.50 KiB" and format_size(80 * GiB) == "80.00 GiB" and format_size(12) == "12 B"
