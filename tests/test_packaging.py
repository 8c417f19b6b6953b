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


# The standard names the C++ core uses, and the header that declares each. libstdc++ 13 (GCC 13)
# no longer includes <system_error> through <thread>/<mutex>: sim.cpp's catch of std::system_error
# built with GCC 12 here and stopped the build on the H200 machine's GCC 13.3 (docs/gpu-runs.md).
_STD_HEADERS = {
    r"\bstd::(system_error|error_code|errc|generic_category|system_category)\b": "system_error",
    r"\bstd::u?int(8|16|32|64)_t\b|\bstd::u?intptr_t\b": "cstdint",
    r"\bstd::(snprintf|fprintf|fputs|fflush|fopen|fclose)\b": "cstdio",
    r"\bstd::(string|to_string|stoull|stoll)\b": "string",
    r"\bstd::(runtime_error|invalid_argument|logic_error|out_of_range|overflow_error)\b": "stdexcept",
    r"\bstd::(bad_alloc|nothrow)\b": "new",
    r"\bstd::vector\b": "vector", r"\bstd::unordered_map\b": "unordered_map",
    r"\bstd::unordered_set\b": "unordered_set",
    r"\bstd::(map|multimap)\b": "map", r"\bstd::(set|multiset)\b": "set", r"\bstd::deque\b": "deque",
    r"\bstd::(mutex|lock_guard|unique_lock|scoped_lock|once_flag|call_once|recursive_mutex)\b": "mutex",
    r"\bstd::condition_variable\b": "condition_variable", r"\bstd::thread\b": "thread",
    r"\bstd::atomic\b": "atomic", r"\bstd::function\b": "functional",
    r"\bstd::(unique_ptr|shared_ptr|make_unique|make_shared|weak_ptr)\b": "memory",
    r"\bstd::(sort|stable_sort|min_element|max_element|find_if|lower_bound|upper_bound|clamp|remove_if)\b": "algorithm",
    r"\bstd::(optional|nullopt)\b": "optional", r"\bstd::(memcpy|memset|strlen|strcmp|strerror|memcmp)\b": "cstring",
    r"\bstd::numeric_limits\b": "limits", r"\bstd::chrono\b": "chrono", r"\bstd::array\b": "array",
    r"\bstd::(tuple|tie|make_tuple)\b": "tuple", r"\bstd::(fabs|sqrt|log2|ceil|floor|pow|isfinite|lround)\b": "cmath",
    r"\bstd::(getenv|strtoull|strtol|abort)\b": "cstdlib", r"\bstd::(accumulate|iota)\b": "numeric",
    r"\bstd::string_view\b": "string_view",
    r"\bstd::(mt19937|mt19937_64|uniform_int_distribution|random_device)\b": "random",
}


def test_cpp_sources_include_the_header_of_every_standard_name_they_use():
    """Each C++ file includes (itself or through the project headers it includes) the standard
    header of every std:: name it uses: a name reached only through another standard header builds
    with one libstdc++ and not with the next."""
    files = glob.glob(os.path.join(ROOT, "csrc", "**", "*.[ch]pp"), recursive=True)
    parsed = {}
    for path in files:
        text = _read(path)
        code = re.sub(r"//[^\n]*|/\*.*?\*/|\"(\\.|[^\"\\])*\"", "", text, flags=re.S)
        parsed[path] = (set(re.findall(r"#include\s+<([^>]+)>", text)), re.findall(r'#include\s+"([^"]+)"', text), code)

    def standard_headers(path, seen):
        if path in seen:
            return set()
        seen.add(path)
        headers = set(parsed[path][0])
        for name in parsed[path][1]:
            for candidate in (os.path.join(os.path.dirname(path), name), os.path.join(ROOT, "csrc", name)):
                if candidate in parsed:
                    headers |= standard_headers(candidate, seen)
                    break
        return headers

    missing = {}
    for path in sorted(parsed):
        have = standard_headers(path, set())
        lacking = sorted({header for pattern, header in _STD_HEADERS.items()
                          if header not in have and re.search(pattern, parsed[path][2])})
        if lacking:
            missing[os.path.relpath(path, ROOT)] = lacking
    assert not missing, f"C++ files use standard names whose header they do not include: {missing}"


@pytest.mark.slow
def test_wheel_builds_from_the_sdist_in_a_venv_without_torch(tmp_path):
    """The sdist through the in-tree backend, then a wheel from that sdist alone: an sdist once lacked the C++
    headers, the binding files module.cpp includes and the backend itself (MANIFEST.in). Built from a copy
    without the checkout's egg-info: setuptools adds the files an old SOURCES.txt lists to the sdist."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "*.so"))
    sdist = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, '_build'); import mk_build_backend as backend; "
         f"print(backend.build_sdist({str(tmp_path / 'sdist')!r}))"],
        cwd=source, capture_output=True, text=True)
    assert sdist.returncode == 0, sdist.stdout + sdist.stderr
    archive = tmp_path / "sdist" / sdist.stdout.split()[-1]
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    has_torch = subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0
    assert not has_torch, "the fresh venv must not have torch for this test to mean anything"
    result = subprocess.run(
        [python, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(archive)],
        capture_output=True, text=True,
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
