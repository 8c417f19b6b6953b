"""Each subcommand run as a user runs it (issue 38): a subprocess, its exit status, its first and last lines.

tests/test_cli.py checks each fix in process; this file reads the commands' outputs as a newcomer does, over
the cases issue 38 found: figures that two commands print must agree, a verdict must not contradict its
lines, exit statuses must say what happened, a mistyped flag must be answered. No timeout and no time is
asserted (issue 32: a verdict must not depend on the machine's load); `memkernels report`, the slowest, runs
in tests/test_cli.py.
"""
import os
import re
import subprocess
import sys

from recorded_traces import write_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_3_8B = ["--model", "llama-3-8b", "--seq", "8192"]


def memkernels(*args, cwd=ROOT):
    """(exit status, stdout lines, stderr lines) of ``memkernels ARGS`` in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-m", "memkernels.cli", *args], cwd=cwd, capture_output=True,
                            text=True)
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, result.stdout.splitlines(), result.stderr.splitlines()


def _figure(lines, pattern):
    """The one size ``pattern`` (a regex with one group) finds in ``lines``."""
    found = [m.group(1) for m in map(re.compile(pattern).search, lines) if m]
    assert len(found) == 1, (pattern, found)
    return found[0]


def test_estimate_and_plan_print_the_same_activation_peak_and_margin_for_one_run():
    """Llama-3-8B / 8192 / 8 x 80 GB / ZeRO-3: estimate said 27.10 GiB of activations with no margin ("6.56 GiB to
    spare"), plan 38.90 GiB and a 5 GiB margin, and neither said why. Now plan names the activation peak it
    counts with every layer kept, without and with the kernels, and estimate prints the same two figures."""
    code, plan, _ = memkernels("plan", *LLAMA_3_8B, "--gpus", "8", "--gpu-mem", "80GB", "--zero-stage", "3",
                               "--host-mem", "0")  # "auto" would take a GPU machine's memory: not this test's matter
    assert code == 0
    assert plan[0] == "plan for llama-3-8b: 8 x 80.00 GiB, seq 8192, bf16, adamw"
    assert plan[-1].startswith("  FSDP2: fully_shard(layer)")
    eager_peak, fused_peak = re.search(r"every layer kept: (\S+ \w+) -> (\S+ \w+);", "\n".join(plan)).groups()
    plan_margin = _figure(plan, r"^  margin \(context, workspaces, fragmentation\)\s+(\S+ \w+)$")

    code, fused, _ = memkernels("estimate", *LLAMA_3_8B, "--gpus", "8", "--memkernels", "--gpu-mem", "80GB")
    assert code == 0
    assert fused[0].startswith("--gpu-mem: 80.00 GiB = 85,899,345,920 bytes")
    assert re.fullmatch(r"fits in 80\.00 GiB: \S+ GiB \+ 5\.00 GiB margin, \S+ GiB to spare", fused[-1]), fused[-1]
    assert _figure(fused, r"^activation peak of the step: (\S+ \w+) = ") == fused_peak
    assert _figure(fused, r"^margin kept free: (\S+ \w+) \(") == plan_margin == "5.00 GiB"

    code, eager, _ = memkernels("estimate", *LLAMA_3_8B, "--gpus", "8")
    assert code == 0 and eager[0].startswith("llama-3-8b: 8.03B parameters, batch 1 x seq 8192")
    assert _figure(eager, r"^activation peak of the step: (\S+ \w+) = ") == eager_peak


def test_estimate_that_does_not_fit_names_the_cheapest_option_that_does():
    code, out, _ = memkernels("estimate", *LLAMA_3_8B, "--gpus", "8", "--gpu-mem", "40GB")
    assert code == 0
    assert any(line.startswith("does not fit in 40.00 GiB (needs ") and "+ 3.00 GiB margin)" in line for line in out)
    assert out[-1] == "cheapest that fits: checkpointing"


def test_replay_under_a_capacity_exits_1_only_when_a_policy_ran_out(tmp_path):
    """replay --capacity printed "fits" per policy and then a footer saying the trace did not fit, and exited 0 when
    a trace truly did not fit."""
    trace = write_trace(tmp_path / "t.pickle", [512, 256, 512, 256], frees=[(2, 1)])  # 1.25 GiB live at its peak
    code, out, err = memkernels("replay", "--repeats", "1", "--capacity", "2GiB", str(trace))
    assert code == 0 and err == []
    assert out[0] == "--capacity: 2.00 GiB = 2,147,483,648 bytes (K, M, G, T are powers of 2: G = GB = GiB = 2^30)"
    for policy in ("PyTorch", "memkernels"):
        assert f"    {policy}: fits in 2.00 GiB (peak reserved 1.25 GiB)" in out
    assert not any("not fit" in line.lower() for line in out)
    assert out[-1].startswith("ratio column reads OOM for a policy that ran out of memory")

    code, out, err = memkernels("replay", "--repeats", "1", "--capacity", "1GiB", str(trace))
    assert code == 1
    assert err == ["memkernels replay: does not fit the 1.00 GiB capacity: t.pickle (device 0) under PyTorch's "
                   "policy, t.pickle (device 0) under memkernels (exit status 1)"]
    assert "    PyTorch: does NOT fit in 1.00 GiB: 1 of 4 requests failed; the first is request 3 (512.00 MiB on " \
           "stream 0, with 768.00 MiB live before it)" in out


def test_explain_and_replay_name_their_peaks_and_say_how_they_differ(tmp_path):
    """replay's "ideal peak" and explain's "peak of live allocations" are one figure on a trace recorded from its
    start, and each output says what its figure includes."""
    trace = write_trace(tmp_path / "t.pickle", [512, 256, 512, 256], frees=[(2, 1)])
    code, explain, _ = memkernels("explain", str(trace))
    assert code == 0
    assert explain[0] == f"memkernels explain: {trace}"
    assert explain[-1].startswith("  verdict: demand. Next step: ")
    assert _figure(explain, r"peak of live allocations (\S+ \w+)") == "1.25 GiB"
    code, replay, _ = memkernels("replay", "--repeats", "1", str(trace))
    assert code == 0
    row = next(line for line in replay if line.startswith("t.pickle"))
    assert row.split()[2:4] == ["1.25", "GiB"]
    assert any("explain's peak of live allocations includes them" in line for line in replay)


def test_a_mistyped_flag_gets_the_subcommands_usage_and_a_suggestion():
    code, out, err = memkernels("estimate", "--model", "llama-3-8b", "--seqlen", "4096")
    assert code == 2 and out == []
    assert err[0].startswith("usage: memkernels estimate ")
    assert err[-1] == ("memkernels estimate: error: unrecognized arguments: --seqlen 4096 "
                       "(--seqlen: did you mean --seq?)")


def test_errors_name_what_the_user_gave(tmp_path):
    code, out, err = memkernels("plan", "--model", str(tmp_path / "nowhere.json"), "--gpu-mem", "24GB")
    assert code == 2 and out == []
    assert err[-1].startswith("memkernels plan: error: ") and "nowhere.json" in err[-1]
    assert "load_config" not in err[-1]
    code, out, err = memkernels("explain", str(tmp_path / "missing.pickle"))
    assert code == 2 and err[-1].startswith("memkernels explain: error: ") and "missing.pickle" in err[-1]
