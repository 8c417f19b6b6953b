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


def test_extension_uses_no_iostreams():
    """On an H200 machine (Ubuntu 24.04, Python 3.12.3, torch 2.11.0+cu130 imported first) the pool's
    out-of-memory message, built with std::ostringstream, crashed in libstdc++'s numeric insertion:
    under torch the process's locale machinery is not the pool's to rely on. Messages are built with
    std::string / std::to_string / snprintf (csrc/common/check.hpp), so _C imports nothing of iostreams."""
    import memkernels._C as ext

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not available")
    out = subprocess.run([nm, "-D", "-C", "--undefined-only", ext.__file__], capture_output=True, text=True,
                         check=True).stdout
    used = [line.split()[-1] for line in out.splitlines()
            if re.search(r"std::(basic_ostream|ostream|basic_ios|ios_base|locale|basic_stringbuf|"
                         r"__cxx11::basic_ostringstream|basic_istream)", line)]
    assert not used, f"{os.path.basename(ext.__file__)} uses iostreams: {used}"


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


def test_headers_come_from_the_nvidia_wheel_when_no_toolkit_is_found(tmp_path, monkeypatch):
    """The fallback a machine without a CUDA toolkit takes (this one has a toolkit)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "_build"))
    import cuda_headers
    import mk_build_backend

    monkeypatch.setattr(cuda_headers, "toolkit_include_dirs", lambda: [])
    monkeypatch.setattr(mk_build_backend, "find_cuda_include", cuda_headers.find_cuda_include)
    include = tmp_path / "nvidia" / "cu13" / "include"
    include.mkdir(parents=True)
    fake_nvidia = type(sys)("nvidia")
    fake_nvidia.__path__ = [str(tmp_path / "nvidia")]
    monkeypatch.setitem(sys.modules, "nvidia", fake_nvidia)

    assert cuda_headers.find_cuda_include() is None, "an include dir without the headers must not count"
    assert mk_build_backend._extra() == ["nvidia-cuda-runtime"]
    for header in ("cuda.h", "cuda_runtime_api.h"):
        (include / header).write_text("")
    assert cuda_headers.find_cuda_include() == str(include)
    assert cuda_headers.find_cuda_include(include_wheels=False) is None
