"""Shared by the loss test files (test_cross_entropy.py, test_linear_cross_entropy.py)."""


def case_id(value):
    """Readable test ids for a parametrized case's values: float32, 24x8x300."""
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return str(value).replace("torch.", "")
