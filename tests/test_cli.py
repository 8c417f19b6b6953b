"""The `memkernels` command: report, estimate and replay (the CLI's argument handling and its output)."""
import os
import pickle
import re
import subprocess
import sys

import pytest

from memkernels.cli import main
from memkernels.planning.estimate import estimate
from memkernels.runtime.sizes import format_size
from moe_cases import qwen3_moe_config
from recorded_traces import write_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


def test_estimate_command_prints_the_breakdown_and_that_it_fits(capsys):
    """Issue 38: the verdict keeps plan's margin free, and the activation peak is printed under plan's name."""
    code = main(["estimate", "--model", "llama-3-8b", "--batch", "1", "--seq", "8192", "--shard", "8",
                 "--gpu-mem", "80GB", "--memkernels"])
    out = capsys.readouterr().out
    assert code == 0
    expected = estimate("llama-3-8b", batch=1, seq=8192, shard_degree=8, use_memkernels=True)
    for label in ("parameters", "gradients", "fp32 master weights", "optimizer state", "activations",
                  "logits / loss", "backward transient", "FSDP gather buffers", "total per GPU"):
        assert label in out
    assert "8.03B parameters" in out
    assert (f"activation peak of the step: {format_size(expected.activation_peak)} = activations + logits / loss + "
            "backward transient (plan's \"activations (peak)\")") in out
    assert "margin kept free: 5.00 GiB (1 GiB for the CUDA context" in out
    assert expected.total + 5 * GiB <= 80 * GiB
    assert (f"fits in 80.00 GiB: {format_size(expected.total)} + 5.00 GiB margin, "
            f"{format_size(75 * GiB - expected.total)} to spare") in out


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
    # checkpointing alone fits with the margin (1 GiB + 5%), so a cheapest fitting option is named
    assert fitting.total + GiB + 2 * GiB <= 40 * GiB
    assert "cheapest that fits:" in out


@pytest.mark.parametrize("argv, message", [
    (["estimate", "--model", "llama-3-8b", "--batch", "0", "--seq", "8"], "must be positive"),
    (["estimate", "--model", "gpt-9", "--batch", "1", "--seq", "8"], "unknown model"),
    (["estimate", "--model", "gpt2", "--batch", "1", "--seq", "8", "--gpu-mem", "lots"], "not a memory size"),
    (["estimate", "--model", "gpt2", "--batch", "1", "--seq", "4096"], "learned positions"),
    (["report", "--model", "gpt-9"], "unknown model"),
    (["report", "--out", os.path.dirname(__file__)], "is a directory; name the PNG file"),
    (["report", "--out", "/no/such/dir/report.png"], "its directory '/no/such/dir' does not exist"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_report_runs_and_writes_a_png(tmp_path):
    """The README's main job end to end. Its run time is a benchmark figure, neither asserted nor bounded
    here: a timed test, or a subprocess timeout, fails on a loaded machine (issue 32)."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "report.png"
    result = subprocess.run([sys.executable, "-m", "memkernels.cli", "report", "--out", str(out), "--timed-steps", "1"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    for expected in ("loss", "max rel err", "saved for backward", "norm", "mlp", "attention", "logits/loss", "tiny-gpt",
                     "tiny-llama", "MemkernelsGatedMLP",
                     "peak bytes", "llama-3-8b", "+ memkernels", f"wrote {out}"):
        assert expected in result.stdout, expected
    assert "[4/4]" in result.stderr  # progress
    # The time row is of unmetered steps (a metered one read as "memkernels is 5x slower": the meters' dispatch mode
    # cost the reference path's many small ops up to 15x), and says what it is on a CPU.
    assert "fwd+bwd time (median of 1, cpu)" in result.stdout
    assert not any(line.startswith("step time") for line in result.stdout.splitlines())
    assert "not indicative of GPU step time" in result.stdout
    # One figure for the saved bytes, saying what it measures: apply()'s own per-token figure (a meta forward
    # of another token count, -47%) printed beside this step's total (-36%) read as a contradiction.
    assert "saved for backward per token" not in result.stdout
    assert "bytes saved for backward by this training step (4 x 256 tokens), by category:" in result.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    # Issue 38: the estimate's rows are estimate's figures (activation peak in backward included), and the margin
    # that estimate --gpu-mem and plan keep free is named.
    fused = estimate("llama-3-8b", batch=1, seq=8192, shard_degree=8, use_memkernels=True)
    row = next(line for line in result.stdout.splitlines() if line.startswith("bf16 + memkernels (no ckpt/offload)"))
    cells = re.split(r"\s{2,}", row.strip())  # configuration, params, grads, master, optimizer, activations, ...
    assert cells[5:8] == [format_size(getattr(fused, part)) for part in ("activations", "logits_loss",
                                                                           "backward_transient")]
    assert cells[-1] == format_size(fused.total)
    assert ("(a run also needs a margin kept free: 1 GiB for the CUDA context and library workspaces + 5% of the "
            "GPU's memory for fragmentation, as estimate --gpu-mem and plan keep)") in result.stdout


# ----------------------------------------------------------------------------- --version, sizes, defaults

def test_version_prints_the_package_version(capsys):
    import memkernels

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"memkernels {memkernels.__version__}"


@pytest.mark.parametrize("text", ["80GB", "80G", "80GiB", "81920MiB", "80 gb"])
def test_gpu_mem_units_are_powers_of_two_and_the_figure_used_is_printed(text, capsys):
    """An "80GB" H100 is 80 GiB: GB, G and GiB mean the same, and the command says which figure it used."""
    assert main(["estimate", "--model", "llama-3-8b", "--shard", "8", "--gpu-mem", text]) == 0
    out = capsys.readouterr().out
    assert "--gpu-mem: 80.00 GiB = 85,899,345,920 bytes" in out and "G = GB = GiB = 2^30" in out
    assert "fit in 80.00 GiB" in out  # "does not fit in": eager Llama-3-8B at 8k peaks at 65 GiB of activations


@pytest.mark.parametrize("argv", [
    ["estimate", "--model", "llama-3-8b", "--gpu-mem", "0"],
    ["estimate", "--model", "llama-3-8b", "--gpu-mem", "24000"],        # nvidia-smi's nounits MiB figure
    ["estimate", "--model", "llama-3-8b", "--gpu-mem", "4294967296"],   # a byte count
    ["estimate", "--model", "llama-3-8b", "--gpu-mem", "512MiB"],       # below any GPU
    ["estimate", "--model", "llama-3-8b", "--gpu-mem", "3TiB"],         # above any GPU
    ["estimate", "--model", "llama-3-8b", "--gpu-mem=-80GB"],
    ["report", "--gpu-mem", "80"],
    ["replay", "--capacity", "4294967296", "no-such-trace.pickle"],
    ["replay", "--capacity", "80", "no-such-trace.pickle"],
])
def test_sizes_without_a_unit_or_outside_any_gpu_are_refused_before_any_work(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2
    assert captured.out == ""  # nothing computed or printed before the refusal
    option = "--capacity" if argv[0] == "replay" else "--gpu-mem"
    assert f"argument {option}: " in captured.err and "80GB, 80GiB, 80G" in captured.err


def test_estimate_defaults_batch_and_seq_like_report_and_takes_model_names_in_any_case(capsys):
    from memkernels.cli import ESTIMATE_BATCH, ESTIMATE_SEQ

    assert main(["estimate", "--model", "Llama-3-8B"]) == 0
    out = capsys.readouterr().out
    assert (ESTIMATE_BATCH, ESTIMATE_SEQ) == (1, 8192)
    assert "llama-3-8b: 8.03B parameters, batch 1 x seq 8192" in out
    with pytest.raises(SystemExit):
        main(["report", "--model", "GPT-9"])
    assert "unknown model 'GPT-9'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- estimate: bad --model files

@pytest.mark.parametrize("content, says", [
    (pickle.dumps({"model_type": "llama"}), "a binary file (byte 0x80 at offset 0"),
    (b"{not json", "text that is not valid JSON"),
    (b"[1, 2]", "holds a JSON list"),
    (b'{"model_type": "llama", "hidden_size": 64}', "lacks num_attention_heads"),
])
def test_estimate_names_a_model_file_that_is_not_a_config_json(tmp_path, content, says, capsys):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--model", str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert str(path) in err and says in err and "Traceback" not in err
    assert "Hugging Face config.json" in err


def test_estimate_takes_a_model_directory_holding_a_config_json(tmp_path, capsys):
    config = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    assert main(["estimate", "--model", str(tmp_path), "--seq", "256"]) == 0
    assert "batch 1 x seq 256" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a directory without one is named
        main(["estimate", "--model", str(tmp_path / "sub" / "")])
    assert "no such file" in capsys.readouterr().err


# ----------------------------------------------------------------------------- replay

def test_replay_names_unreadable_traces_replays_the_others_and_exits_1(tmp_path):
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    corrupt = tmp_path / "corrupt.pickle"
    corrupt.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc"}] * 3]})[:-9])
    not_a_snapshot = tmp_path / "list.pickle"
    not_a_snapshot.write_bytes(pickle.dumps([1, 2, 3]))
    good = write_trace(tmp_path / "good.pickle", [3, 30])
    result = subprocess.run([sys.executable, "-m", "memkernels.cli", "replay", "--repeats", "1", str(empty),
                             str(corrupt), str(good), str(not_a_snapshot)],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("memkernels replay: error: ")]
    assert len(errors) == 3
    assert f"{str(empty)!r}" in errors[0] and "the file is empty" in errors[0]
    assert f"{str(corrupt)!r}" in errors[1] and "torch.cuda.memory._dump_snapshot pickle" in errors[1]
    assert f"{str(not_a_snapshot)!r}" in errors[2] and "'device_traces' list" in errors[2]
    assert "good.pickle" in result.stdout  # the readable trace was still replayed
    assert "3 trace(s) could not be read" in result.stderr


def test_replay_of_a_device_one_trace_lacks_skips_that_trace_only(tmp_path, capsys):
    one_device = write_trace(tmp_path / "one.pickle", [3])
    two_devices = tmp_path / "two.pickle"
    events = pickle.loads(one_device.read_bytes())["device_traces"][0]
    two_devices.write_bytes(pickle.dumps({"segments": [], "device_traces": [[], events]}))
    assert main(["replay", "--repeats", "1", "--device", "1", str(one_device), str(two_devices)]) == 1
    captured = capsys.readouterr()
    assert "memkernels replay: error: trace 'one.pickle' records 1 device(s) (device_traces); device 1 is not one" \
        in captured.err
    assert "two.pickle" in captured.out


def test_replay_takes_a_directory(tmp_path, capsys):
    write_trace(tmp_path / "a.pickle", [3, 30])
    write_trace(tmp_path / "b.pickle", [5])
    (tmp_path / "notes.txt").write_text("not a trace")
    assert main(["replay", "--repeats", "1", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "a.pickle" in out and "b.pickle" in out and "notes.txt" not in out
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", str(tmp_path / "missing")])
    assert exit_info.value.code == 2 and "no such file or directory" in capsys.readouterr().err


def test_replay_under_a_capacity_says_per_policy_whether_it_fit(tmp_path, capsys):
    """Live bytes reach 768 MiB, then a 512 MiB request cannot fit 1 GiB under either policy; the
    later 256 MiB request fits again. Ratios are printed only for runs that fit."""
    path = write_trace(tmp_path / "t.pickle", [512, 256, 512, 256], frees=[(2, 1)])
    assert main(["replay", "--repeats", "1", "--capacity", "1GiB", str(path)]) == 1  # did not fit: status 1
    captured = capsys.readouterr()
    out = captured.out
    assert captured.err.strip() == ("memkernels replay: does not fit the 1.00 GiB capacity: t.pickle (device 0) under "
                                    "PyTorch's policy, t.pickle (device 0) under memkernels (exit status 1)")
    assert "--capacity: 1.00 GiB = 1,073,741,824 bytes" in out
    row = next(line for line in out.splitlines() if line.startswith("t.pickle"))
    assert row.split("|")[1].split()[0] == "OOM" and row.split("|")[2].split()[0] == "OOM"
    for policy in ("PyTorch", "memkernels"):
        assert (f"    {policy}: does NOT fit in 1.00 GiB: 1 of 4 requests failed; the first is request 3 "
                f"(512.00 MiB on stream 0, with 768.00 MiB live before it)") in out, out

    assert main(["replay", "--repeats", "1", "--capacity", "2GiB", str(path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("t.pickle"))
    assert float(row.split("|")[1].split()[0]) >= 1.0 and float(row.split("|")[2].split()[0]) >= 1.0
    assert "    PyTorch: fits in 2.00 GiB" in out and "    memkernels: fits in 2.00 GiB" in out
    assert "not fit" not in out.lower(), "when every policy fits, nothing may say that the trace did not"


@pytest.mark.parametrize("argv, says", [
    (["replay", "--repeats", "0", "t.pickle"], "argument --repeats: 0 must be positive"),
    (["replay", "--repeats", "-3", "t.pickle"], "argument --repeats: -3 must be positive"),
    (["replay", "--device", "-1", "t.pickle"], "argument --device: -1 must be 0 or more"),
    (["estimate", "--model", "gpt2", "--gpus", "0"], "argument --gpus/--shard: 0 must be positive"),
])
def test_counts_below_their_range_are_refused_with_the_argument_named(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_the_chart_labels_the_capacity_line_with_the_figure_used(tmp_path, monkeypatch):
    """An 80GB (= 80 GiB) capacity line was labelled "GPU: 86 GB = 80.0 GiB", as if GB were 10^9."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from memkernels.planning.estimate import breakdown_chart

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    breakdown_chart([("bf16", estimate("gpt2", batch=1, seq=128))], str(tmp_path / "chart.png"), gpu_bytes=80 * GiB)
    labels = [text.get_text() for text in figures[0].axes[0].texts]
    assert "GPU: 80.0 GiB " in labels and not any(" GB" in label for label in labels)


def test_a_mistyped_flag_gets_the_subcommands_usage_and_the_nearest_flag(capsys):
    """`estimate ... --seqlen 4096` printed the top-level usage and no hint (issue 38)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--model", "llama-3-8b", "--seqlen", "4096"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("usage: memkernels estimate ")
    assert err.strip().endswith("memkernels estimate: error: unrecognized arguments: --seqlen 4096 "
                                "(--seqlen: did you mean --seq?)")
    with pytest.raises(SystemExit):
        main(["replay", "--capacty", "1GiB", "t.pickle"])
    assert "(--capacty: did you mean --capacity?)" in capsys.readouterr().err


def test_every_option_of_every_subcommand_says_what_it_does():
    """--dtype, --optimizer, --shard, --lora-rank had no help text (issue 38)."""
    import argparse

    from memkernels import cli
    parser = argparse.ArgumentParser(prog="memkernels")
    subparsers = parser.add_subparsers(dest="command")
    for add in cli._SUBCOMMANDS:
        add(subparsers)
    silent = [f"{name} {action.option_strings[0]}" for name, sub in subparsers.choices.items()
              for action in sub._actions if action.option_strings and not action.help]
    assert not silent, silent


@pytest.mark.parametrize("argv, says", [
    (["estimate", "--model", "nosuch.json"], "model 'nosuch.json': no such file"),
    (["plan", "--model", "nosuch.json", "--gpu-mem", "80GB", "--seq", "16"], "model 'nosuch.json': no such file"),
    (["replay", "nosuch.pickle"], "no such file or directory 'nosuch.pickle' (a memory snapshot pickle"),
    (["explain", "nosuch.pickle"], "no such file or directory 'nosuch.pickle' (a memory snapshot pickle"),
])
def test_errors_name_what_the_user_gave_not_internal_functions(argv, says, capsys):
    """They read "load_config: ..." and "trace: no such file" (issue 38)."""
    try:
        status = main(argv)
    except SystemExit as exit_info:
        status = exit_info.code
    err = capsys.readouterr().err
    assert status != 0 and says in err, err
    assert "load_config" not in err and "trace:" not in err


def test_plan_and_estimate_share_the_model_and_seq_conventions(tmp_path, capsys):
    """plan required --seq where estimate defaults it to 8192, and its --model help named only a
    config.json path where both take the directory holding one (issue 38)."""
    config = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    assert main(["plan", "--model", str(tmp_path), "--gpu-mem", "24GB", "--host-mem", "0", "--json"]) == 0
    assert __import__("json").loads(capsys.readouterr().out)["seq"] == 8192


def test_estimate_takes_plans_gpus_and_zero_stage_and_shard_stays_their_older_name(capsys):
    """estimate and report said --shard N where plan says --gpus N --zero-stage S (issue 38)."""
    outputs = {}
    for flags in (["--gpus", "8"], ["--shard", "8"], ["--gpus", "8", "--zero-stage", "3"],
                  ["--gpus", "8", "--zero-stage", "1"]):
        assert main(["estimate", "--model", "llama-2-7b", "--seq", "1024", *flags]) == 0
        outputs[" ".join(flags)] = capsys.readouterr().out
    assert outputs["--gpus 8"] == outputs["--shard 8"] == outputs["--gpus 8 --zero-stage 3"]
    assert ", ZeRO-3 x 8" in outputs["--gpus 8"].splitlines()[0]
    assert ", ZeRO-1 x 8" in outputs["--gpus 8 --zero-stage 1"].splitlines()[0]
    stage_1 = estimate("llama-2-7b", batch=1, seq=1024, shard_degree=8, zero_stage=1)
    total = next(line for line in outputs["--gpus 8 --zero-stage 1"].splitlines() if line.startswith("total per GPU"))
    assert total.split()[-2:] == format_size(stage_1.total).split()


def test_replay_table_fits_a_100_column_terminal():
    """`memkernels replay` on the shared traces: every line under 100 columns (it was 173: the model-vs-recorded
    check was a column of its own, the notes one line each)."""
    traces = os.path.join(os.path.dirname(ROOT), "shared", "traces")
    if not os.path.isdir(traces):
        pytest.skip(f"no recorded traces at {traces}")
    result = subprocess.run([sys.executable, "-m", "memkernels.cli", "replay", "--repeats", "1", "--capacity", "12GB",
                             traces], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("tinyllama_lora_step.pickle") for line in lines)
    assert max(len(line) for line in lines) < 100, max(lines, key=len)


def test_the_chart_says_its_bars_are_estimates_and_shows_what_was_measured(tmp_path, monkeypatch):
    """report's PNG: the title says the bars are estimated on the meta device, and the measured training steps'
    lines are printed under the chart (issue 38: nothing in the PNG said which was which)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from memkernels.planning.estimate import breakdown_chart

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    measured = ["tiny-gpt: one training step of 4 x 256 tokens, fp32 on cpu: peak 339.24 MiB eager -> 156.77 MiB "
                "memkernels (-54%)"]
    breakdown_chart([("bf16", estimate("gpt2", batch=1, seq=128))], str(tmp_path / "chart.png"), title="gpt2",
                    measured=measured)
    figure = figures[0]
    assert figure.axes[0].get_title() == "gpt2\nbars: estimated on the meta device, not measured"
    assert [text.get_text() for text in figure.texts] == ["measured on this machine:\n" + measured[0]]


def test_estimate_and_plan_take_a_mixture_of_experts_config_json(tmp_path, capsys):
    """Issue 37 point 4: a Qwen3-MoE config.json (a family transformers builds, not memkernels' own model) was refused
    ("model_type='qwen3_moe' is not supported")."""
    pytest.importorskip("transformers")
    model_dir = tmp_path / "tiny-qwen3-moe"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(__import__("json").dumps(qwen3_moe_config(layers=2)))
    assert main(["estimate", "--model", str(model_dir), "--seq", "64"]) == 0
    assert capsys.readouterr().out.startswith("tiny-qwen3-moe: 0.00B parameters, batch 1 x seq 64, bf16 mixed")
    assert main(["plan", "--model", str(model_dir), "--seq", "64", "--gpu-mem", "24GB", "--host-mem", "0",
                 "--json"]) == 0
    result = __import__("json").loads(capsys.readouterr().out)
    assert result["fits"] and result["seq"] == 64
