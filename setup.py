"""Build memkernels._C: C++17 + pybind11, no torch, no libcudart/libcuda linkage.

CUDA is reached at run time through a table of function pointers filled by
dlopen (csrc/cuda/), so only CUDA *headers* are needed here. Compilation runs
through ninja when it is available (parallel, incremental), else through
setuptools' compiler one file at a time.

Environment:
  MEMKERNELS_SANITIZE=address,undefined | thread   build with sanitizers (-O1 -g1)
  MEMKERNELS_DEBUG=1                               -O0 -g, assertions kept
"""
import glob
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

import pybind11
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build"))
from cuda_headers import find_cuda_include  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
SANITIZERS = {"address", "undefined", "thread"}


def _sanitize_flags():
    value = os.environ.get("MEMKERNELS_SANITIZE", "").strip()
    if not value:
        return []
    kinds = [k.strip() for k in value.split(",") if k.strip()]
    unknown = sorted(set(kinds) - SANITIZERS)
    if unknown:
        raise SystemExit(f"MEMKERNELS_SANITIZE: unknown sanitizer(s) {unknown}; use 'address,undefined' or 'thread'")
    if "thread" in kinds and len(kinds) > 1:
        raise SystemExit("MEMKERNELS_SANITIZE: 'thread' cannot be combined with other sanitizers")
    return [f"-fsanitize={','.join(kinds)}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]


def _compile_args():
    debug = os.environ.get("MEMKERNELS_DEBUG") == "1"
    sanitize = _sanitize_flags()
    args = ["-std=c++17", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    # Sanitized builds keep -g1, the line tables their reports need (-g's full debug info only slows the
    # build), at -O1, the level both sanitizers' documentation recommends: it builds as fast as -O0 here, and
    # the sanitized tests run at -O0 up to 8x slower (tests/test_sanitizers.py has the times).
    if debug:
        args += ["-O0", "-g"]
    elif sanitize:
        args += ["-O1", "-g1"]
    else:
        args += ["-O3", "-DNDEBUG"]
    return args + sanitize, sanitize


def _sources():
    """Every .cpp of csrc/ but tests, and of bindings/ only module.cpp: it includes the other binding files, so
    pybind11's headers are compiled once, not once a file (csrc/bindings/module.cpp says what that saves)."""
    bindings = os.path.join(ROOT, "csrc", "bindings")
    return sorted(
        os.path.relpath(p, ROOT)
        for p in glob.glob(os.path.join(ROOT, "csrc", "**", "*.cpp"), recursive=True)
        if os.sep + "tests" + os.sep not in p
        and (os.path.dirname(p) != bindings or os.path.basename(p) == "module.cpp")
    )


def _include_dirs():
    cuda_include = find_cuda_include()
    if cuda_include is None:
        raise SystemExit(
            "memkernels: CUDA headers (cuda.h, cuda_runtime_api.h) not found. Install the CUDA toolkit "
            "(or set CUDA_HOME / MEMKERNELS_CUDA_INCLUDE), or `pip install nvidia-cuda-runtime`. "
            "Only headers are needed: nothing links against CUDA."
        )
    return [os.path.join(ROOT, "csrc"), pybind11.get_include(), cuda_include]


def _ninja_executable():
    try:
        import ninja

        path = os.path.join(ninja.BIN_DIR, "ninja")
        if os.path.isfile(path):
            return path
    except ImportError:
        pass
    return shutil.which("ninja")


class NinjaBuildExt(build_ext):
    """Compile with ninja when present; link with setuptools' compiler either way."""

    def build_extension(self, ext):
        ninja = _ninja_executable()
        if ninja is None:
            return super().build_extension(ext)
        os.makedirs(self.build_temp, exist_ok=True)
        cxx = shlex.split(os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++")
        cflags = ["-fPIC"] + [f"-I{d}" for d in ext.include_dirs]
        cflags += [f"-I{sysconfig.get_paths()['include']}"] + ext.extra_compile_args
        lines = [
            f"cxx = {' '.join(shlex.quote(c) for c in cxx)}",
            f"cflags = {' '.join(shlex.quote(f) for f in cflags)}",
            "rule compile",
            "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = CXX $in",
        ]
        objects = []
        for source in ext.sources:
            obj = os.path.join(os.path.abspath(self.build_temp), source.replace(os.sep, "_") + ".o")
            objects.append(obj)
            lines.append(f"build {obj}: compile {os.path.join(ROOT, source)}")
        with open(os.path.join(self.build_temp, "build.ninja"), "w") as f:
            f.write("\n".join(lines) + "\n")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call([ninja, "-C", self.build_temp, "-j", jobs])
        ext_path = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(ext_path), exist_ok=True)
        self.compiler.link_shared_object(
            objects,
            ext_path,
            libraries=self.get_libraries(ext),
            extra_postargs=ext.extra_link_args,
            target_lang="c++",
        )


compile_args, sanitize_flags = _compile_args()
setup(
    ext_modules=[
        Extension(
            "memkernels._C",
            sources=_sources(),
            include_dirs=_include_dirs(),
            language="c++",
            extra_compile_args=compile_args,
            # dl: the CUDA table is filled by dlopen at run time; pthread: simulated streams.
            extra_link_args=sanitize_flags + ["-ldl", "-pthread"],
        )
    ],
    cmdclass={"build_ext": NinjaBuildExt},
)
