"""Find CUDA headers at build time without torch, nvcc or a GPU.

Shared by the build backend (to decide whether the ``nvidia-cuda-runtime``
wheel is a build requirement) and by ``setup.py`` (to set the include path).
Only headers are used: the extension never links libcudart or libcuda.
"""
import os
import shutil

_REQUIRED = ("cuda.h", "cuda_runtime_api.h")
# Header locations inside the NVIDIA runtime wheels (CUDA 13 and CUDA 12 layouts).
_WHEEL_SUBDIRS = (os.path.join("cu13", "include"), os.path.join("cuda_runtime", "include"))


def _has_headers(include_dir):
    return all(os.path.isfile(os.path.join(include_dir, h)) for h in _REQUIRED)


def toolkit_include_dirs():
    """Candidate include dirs of an installed CUDA toolkit, most specific first."""
    candidates = []
    for var in ("MEMKERNELS_CUDA_INCLUDE", "CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            candidates.append(value if var == "MEMKERNELS_CUDA_INCLUDE" else os.path.join(value, "include"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"))
    candidates.append("/usr/local/cuda/include")
    return candidates


def wheel_include_dirs():
    try:
        import nvidia  # namespace package installed by nvidia-cuda-runtime
    except ImportError:
        return []
    return [os.path.join(root, sub) for root in nvidia.__path__ for sub in _WHEEL_SUBDIRS]


def find_cuda_include(include_wheels=True):
    """Return the first directory holding cuda.h and cuda_runtime_api.h, or None."""
    candidates = toolkit_include_dirs() + (wheel_include_dirs() if include_wheels else [])
    for candidate in candidates:
        if _has_headers(candidate):
            return candidate
    return None
