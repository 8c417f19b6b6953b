"""Backend selection and the real CUDA loader, each case in a fresh interpreter.

The backend is fixed for a process at first use, so every case runs in a
subprocess with its own MEMKERNELS_DEVICE. On this project's machines there is
no NVIDIA driver: the real path must end in a clear CudaError, never a crash.
"""
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import memkernels

pytestmark = pytest.mark.cpp

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(memkernels.__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def driver_present():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def run_python(code, device=None, extra_env=None):
    """Run `code` in a fresh interpreter importing this checkout's memkernels; return its JSON output."""
    env = dict(os.environ)
    env.pop("MEMKERNELS_DEVICE", None)
    if device is not None:
        env["MEMKERNELS_DEVICE"] = device
    env.update(extra_env or {})
    env["PYTHONPATH"] = PACKAGE_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=PACKAGE_PARENT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


CATCH_LOAD = """
    import json
    from memkernels import device
    out = {"backend": device.backend()}
    try:
        device.load()
        out["error"] = None
    except device.CudaError as exc:
        out["error"] = str(exc)
        out["error_type"] = type(exc).__module__ + "." + type(exc).__name__
    out["locked"] = device.is_locked()
    try:
        device.load_cuda()
        out["load_cuda_error"] = None
    except device.CudaError as exc:
        out["load_cuda_error"] = str(exc)
    device.use_sim()          # a failed real load does not fix the backend
    out["after_use_sim"] = device.load()
    print(json.dumps(out))
"""


@pytest.mark.skipif(driver_present(), reason="an NVIDIA driver is installed: the no-driver message cannot be produced")
def test_real_path_without_driver_raises_clear_cuda_error():
    out = run_python(CATCH_LOAD)
    assert out["backend"] == "cuda"
    assert out["error_type"] == "memkernels._C.CudaError"
    message = out["error"]
    assert message.startswith("no CUDA driver/library: ")
    assert "libcuda.so.1" in message  # names what was looked for
    assert message.endswith("install the NVIDIA driver or set MEMKERNELS_DEVICE=sim")
    assert out["load_cuda_error"] == message
    assert out["locked"] is False
    assert out["after_use_sim"] == "sim"


@pytest.mark.skipif(driver_present(), reason="an NVIDIA driver is installed")
def test_installed_cudart_resolves_and_reports_the_missing_driver():
    """Where a libcudart is installed (this machine: CUDA 13 without a driver) the
    loader must resolve every runtime entry point of the table from it and report
    cudaGetDeviceCount's verdict."""
    try:
        ctypes.CDLL("libcudart.so.13")
    except OSError:
        try:
            ctypes.CDLL("libcudart.so.12")
        except OSError:
            pytest.skip("no libcudart.so.13/.12 on the library path")
    message = run_python(CATCH_LOAD)["error"]
    assert "found libcudart: " in message
    assert "lacks" not in message, message  # every runtime symbol of the table resolved
    assert "cudaGetDeviceCount returned cudaErrorInsufficientDriver" in message


def driver_table_names():
    """The driver entry points of the table, read from MK_CUDA_DRIVER_FUNCTIONS in csrc/cuda/api.hpp."""
    with open(os.path.join(ROOT, "csrc", "cuda", "api.hpp")) as f:
        header = f.read()
    block = re.search(r"#define MK_CUDA_DRIVER_FUNCTIONS\(X\)(.*?)\n\n", header, re.S).group(1)
    return re.findall(r"X\((\w+)\)", block)


@pytest.mark.skipif(driver_present(), reason="an NVIDIA driver is installed: the fake one would not be picked")
def test_driver_symbols_resolve_through_cuGetProcAddress_with_the_headers_version(tmp_path):
    """Run the loader's driver path against tests/fake_libcuda.c: every driver entry of
    the table must be asked for through cuGetProcAddress_v2 with the CUDA_VERSION of
    the headers the extension was built with, and a failing cuInit must be reported."""
    sys.path.insert(0, os.path.join(ROOT, "_build"))
    try:
        from cuda_headers import find_cuda_include
    finally:
        sys.path.pop(0)
    include = find_cuda_include()
    if include is None or shutil.which("gcc") is None:
        pytest.skip("needs gcc and the CUDA headers")
    with open(os.path.join(include, "cuda.h")) as f:
        cuda_version = int(re.search(r"#define CUDA_VERSION (\d+)", f.read()).group(1))
    subprocess.run(["gcc", "-shared", "-fPIC", f"-I{include}", os.path.join(ROOT, "tests", "fake_libcuda.c"),
                    "-o", str(tmp_path / "libcuda.so.1")], check=True)
    log = tmp_path / "requests.log"
    env = {"LD_LIBRARY_PATH": str(tmp_path) + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""),
           "FAKE_LIBCUDA_LOG": str(log)}
    message = run_python(CATCH_LOAD, extra_env=env)["error"]
    assert message.startswith("no CUDA driver/library: cuInit(0) returned CUDA_ERROR_NO_DEVICE (100)"), message
    assert f"found libcuda: {tmp_path / 'libcuda.so.1'}" in message
    legacy_stream = "1"  # CU_GET_PROC_ADDRESS_LEGACY_STREAM
    ours = [line.split() for line in log.read_text().splitlines() if line.split()[2:] == [legacy_stream]]
    assert sorted(name for name, _, _ in ours) == sorted(driver_table_names())
    assert {int(version) for _, version, _ in ours} == {cuda_version}


def test_environment_selects_the_simulator():
    out = run_python("""
        import json
        from memkernels import device
        out = {"before": device.backend(), "locked_before": device.is_locked(), "loaded": device.load()}
        ptr = device.malloc(1024)
        out["counters"] = device.sim.counters()
        try:
            device.use_cuda()
            out["switch"] = None
        except ValueError as exc:
            out["switch"] = str(exc)
        print(json.dumps(out))
    """, device="sim")
    assert (out["before"], out["locked_before"], out["loaded"]) == ("sim", False, "sim")
    assert out["counters"] == {"cudaMalloc": 1}
    assert "fixed at first use" in out["switch"] and "MEMKERNELS_DEVICE=cuda" in out["switch"]


def test_python_call_selects_the_simulator_before_first_use():
    out = run_python("""
        import json
        from memkernels import device
        device.use_sim(capacity=1 << 20, memory="virtual")
        print(json.dumps({"loaded": device.load(), "config": device.sim.config(),
                          "info": device.mem_get_info()}))
    """)
    assert out["loaded"] == "sim"
    assert out["config"]["memory"] == "virtual"
    assert out["info"] == [1 << 20, 1 << 20]


def test_unknown_device_value_names_the_variable():
    out = run_python("""
        import json
        from memkernels import device
        try:
            device.load()
            print(json.dumps(None))
        except ValueError as exc:
            print(json.dumps(str(exc)))
    """, device="tpu")
    assert "MEMKERNELS_DEVICE='tpu'" in out and "'sim' or 'cuda'" in out
