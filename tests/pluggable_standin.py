"""Build and load tests/pluggable_standin.cpp: PyTorch's call path into a pluggable allocator.

``load(tmp_dir)`` builds the torch-free stand-in (a C++ caller of ``mk_pool_alloc`` that
catches as torch's last clause does); ``load(tmp_dir, torch=True)`` also links torch's own
error translation (``torch::translate_exception_to_python`` from libtorch_python) and c10's
headers, so a Python exception comes out exactly as torch's bindings raise it. Only the
tests link torch: memkernels itself never does.
"""
import ctypes
import os
import subprocess

from memkernels import _C

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pluggable_standin.cpp")


class Standin:
    def __init__(self, library, with_torch):
        self.library = library
        if not library.standin_load(_C.__file__.encode(), _C.DEVICE_POOL_ALLOC_SYMBOL.encode(),
                                    _C.DEVICE_POOL_FREE_SYMBOL.encode()):
            raise RuntimeError("the stand-in could not load memkernels' entry points")
        library.standin_allocate.restype = ctypes.c_void_p
        library.standin_allocate.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p,
                                             ctypes.c_size_t]
        library.standin_free.restype = None
        library.standin_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        if with_torch:
            library.standin_allocate_torch.restype = ctypes.c_void_p
            library.standin_allocate_torch.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            library.standin_caught_as.restype = ctypes.c_int
            library.standin_caught_as.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            library.standin_torch_error_size.restype = ctypes.c_size_t

    def alloc(self, size, device, stream):
        """(pointer or None, message of what was thrown or '')."""
        error = ctypes.create_string_buffer(4096)
        pointer = self.library.standin_allocate(size, device, stream, error, len(error))
        return pointer, error.value.decode()

    def alloc_torch(self, size, device, stream):
        """The pointer, or the Python exception torch's translation raises."""
        return self.library.standin_allocate_torch(size, device, stream)

    def free(self, pointer, size, device, stream):
        self.library.standin_free(pointer, size, device, stream)


def load(tmp_dir, torch=False):
    output = os.path.join(tmp_dir, "pluggable_standin_torch.so" if torch else "pluggable_standin.so")
    command = ["g++", "-std=c++17", "-shared", "-fPIC", SOURCE, "-o", output, "-ldl"]
    if torch:
        import torch as torch_module

        root = os.path.dirname(torch_module.__file__)
        lib = os.path.join(root, "lib")
        command += ["-DSTANDIN_WITH_TORCH", f"-I{os.path.join(root, 'include')}", f"-L{lib}", "-ltorch_python",
                    "-lc10", f"-Wl,-rpath,{lib}"]
    subprocess.run(command, check=True, capture_output=True, text=True)
    library = (ctypes.PyDLL if torch else ctypes.CDLL)(output)
    return Standin(library, torch)
