"""The `memkernels` command: report and estimate."""
import argparse
import os
import subprocess
import sys

import pytest

from memkernels.cli import main, parse_bytes
from memkernels.estimate import estimate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_bytes_units():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80 GiB") == 80 * 2**30
    assert parse_bytes("24000MiB") == 24000 * 2**20
    assert parse_bytes("80") == 80 * 10**9  # a bare number is GB, as GPUs are sold
    for bad in ("eighty", "80XB", "-3GB", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


def test_estimate_command_prints_the_breakdown_and_that_it_fits(capsys):
    code = main(["estimate", "--model", "llama-3-8b", "--batch", "1", "--seq", "8192", "--shard", "8",
                 "--gpu-mem", "80GB"])
    out = capsys.readouterr().out
    assert code == 0
    expected = estimate("llama-3-8b", batch=1, seq=8192, shard_degree=8)
    for label in ("parameters", "gradients", "fp32 master weights", "optimizer state", "activations",
                  "logits / loss", "FSDP gather buffers", "total per GPU"):
        assert label in out
    assert "8.03B parameters" in out
    assert expected.total <= 80 * 10**9 and "fits in" in out


def test_estimate_command_lists_options_cheapest_first_when_it_does_not_fit(capsys):
    code = main(["estimate", "--model", "llama-3-8b", "--batch", "1", "--seq", "8192", "--shard", "8",
                 "--gpu-mem", "40GB"])
    out = capsys.readouterr().out
    assert code == 0
    assert "does not fit" in out
    lines = out.splitlines()
    order = [next(i for i, line in enumerate(lines) if line.startswith(name + " "))
             for name in ("memkernels", "checkpointing", "offload", "all three")]
    assert order == sorted(order)
    fitting = estimate("llama-3-8b", batch=1, seq=8192, shard_degree=8, checkpointing=True)
    assert fitting.total <= 40 * 10**9  # checkpointing alone fits, so a cheapest fitting option is named
    assert "cheapest that fits:" in out


@pytest.mark.parametrize("argv, message", [
    (["estimate", "--model", "llama-3-8b", "--batch", "0", "--seq", "8"], "must be positive"),
    (["estimate", "--model", "gpt-9", "--batch", "1", "--seq", "8"], "unknown model"),
    (["estimate", "--model", "gpt2", "--batch", "1", "--seq", "8", "--gpu-mem", "lots"], "not a size"),
    (["estimate", "--model", "gpt2", "--batch", "1", "--seq", "4096"], "learned positions"),
    (["report", "--model", "gpt-9"], "unknown model"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_report_runs_and_writes_a_png(tmp_path):
    """The README's main job end to end. Its run time is a benchmark figure, not asserted here (a timed
    test fails on a loaded machine); the timeout only stops a hang."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "report.png"
    result = subprocess.run([sys.executable, "-m", "memkernels.cli", "report", "--out", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    for expected in ("loss", "max rel err", "saved for backward", "norm", "mlp", "attention", "logits/loss", "tiny-gpt",
                     "tiny-llama", "MemkernelsGatedMLP",
                     "peak bytes", "llama-3-8b", "+ memkernels", f"wrote {out}"):
        assert expected in result.stdout, expected
    assert "[4/4]" in result.stderr  # progress
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
