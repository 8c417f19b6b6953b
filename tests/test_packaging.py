"""The install contract: README commands, no torch/CUDA linkage, a wheel without torch."""
import glob
import os
import re
import shutil
import subprocess
import sys
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def test_ci_runs_the_readme_test_command_verbatim():
    ci_commands = [line for line in _read(".ci/run").splitlines() if line.startswith("pip install")]
    assert len(ci_commands) == 1, ".ci/run must run exactly one command: the README's test command"
    readme_blocks = re.findall(r"```bash\n(.*?)\n```", _read("README.md"), re.S)
    assert ci_commands[0] in readme_blocks, "README's test command and .ci/run differ"
    assert ci_commands[0].startswith("pip install torch==2.13.0 && "), "torch==2.13.0 must be installed first"


def test_extension_links_neither_torch_nor_cuda():
    import memkernels._C as ext

    ldd = shutil.which("ldd")
    if ldd is None:
        pytest.skip("ldd not available")
    out = subprocess.run([ldd, ext.__file__], capture_output=True, text=True, check=True).stdout
    for forbidden in ("libtorch", "libc10", "libcudart", "libcuda.so"):
        assert forbidden not in out, f"{os.path.basename(ext.__file__)} links {forbidden}:\n{out}"


@pytest.mark.slow
def test_wheel_builds_in_a_venv_without_torch(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    has_torch = subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0
    assert not has_torch, "the fresh venv must not have torch for this test to mean anything"
    result = subprocess.run(
        [python, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), ROOT],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert glob.glob(str(tmp_path / "dist" / "memkernels-*.whl"))
