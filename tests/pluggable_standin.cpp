// A stand-in for PyTorch's call path into a pluggable allocator, built by the tests
// (tests/pluggable_standin.py), because no GPU here runs the real one.
//
// torch/csrc/cuda/CUDAPluggableAllocator.cpp: the library is dlopen'ed, the alloc
// symbol kept in a std::function<void*(size_t, int, cudaStream_t)>, and malloc()
// is `void* r = alloc_fn_(size, device, stream);` then the pointer's metadata is
// recorded under a mutex; neither the pointer is checked nor the call guarded.
// An exception thrown by alloc_fn_ climbs through allocate() to the Python binding
// that asked for the tensor, whose CATCH_TH_ERRORS picks the Python type.
#include <dlfcn.h>

#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <unordered_map>

using AllocFn = void*(std::size_t, int, void*);
using FreeFn = void(void*, std::size_t, int, void*);

static std::function<AllocFn> alloc_fn;
static std::function<FreeFn> free_fn;
static std::mutex metadata_mutex;
static std::unordered_map<void*, std::size_t> metadata;

extern "C" int standin_load(const char* path, const char* alloc_name, const char* free_name) {
  void* library = dlopen(path, RTLD_LAZY);
  if (library == nullptr) return 0;
  auto* alloc = reinterpret_cast<AllocFn*>(dlsym(library, alloc_name));
  auto* free = reinterpret_cast<FreeFn*>(dlsym(library, free_name));
  if (alloc == nullptr || free == nullptr) return 0;
  alloc_fn = alloc;
  free_fn = free;
  return 1;
}

// CUDAPluggableAllocator::malloc, line for line.
static void* pluggable_malloc(std::size_t size, int device, void* stream) {
  void* r = alloc_fn(size, device, stream);
  {
    const std::lock_guard<std::mutex> lock(metadata_mutex);
    metadata.emplace(r, size);
  }
  return r;
}

extern "C" void standin_free(void* ptr, std::size_t size, int device, void* stream) {
  {
    const std::lock_guard<std::mutex> lock(metadata_mutex);
    metadata.erase(ptr);
  }
  free_fn(ptr, size, device, stream);
}

// A binding without torch: catches what crossed as a std::exception (torch's last
// catch clause, which makes a RuntimeError of it) and hands back its message.
extern "C" void* standin_allocate(std::size_t size, int device, void* stream, char* error, std::size_t error_len) {
  error[0] = '\0';
  try {
    return pluggable_malloc(size, device, stream);
  } catch (const std::exception& e) {
    std::snprintf(error, error_len, "%s", e.what());
  } catch (...) {
    std::snprintf(error, error_len, "an exception that is not a std::exception");
  }
  return nullptr;
}

#ifdef STANDIN_WITH_TORCH
#include <c10/util/Exception.h>

namespace torch {
// torch/csrc/Exceptions.cpp: rethrows and runs CATCH_ALL_ERRORS, the clauses every
// Python binding of torch uses, setting the Python error.
void translate_exception_to_python(const std::exception_ptr&);
}  // namespace torch

// Called through ctypes.PyDLL (GIL held, Python error checked after the call).
extern "C" void* standin_allocate_torch(std::size_t size, int device, void* stream) {
  try {
    return pluggable_malloc(size, device, stream);
  } catch (...) {
    torch::translate_exception_to_python(std::current_exception());
  }
  return nullptr;
}

// 1 if the exception crossing is caught as c10::OutOfMemoryError, 2 as another
// std::exception, 0 if nothing was thrown.
extern "C" int standin_caught_as(std::size_t size, int device, void* stream) {
  try {
    void* r = pluggable_malloc(size, device, stream);
    standin_free(r, size, device, stream);
  } catch (const c10::OutOfMemoryError&) {
    return 1;
  } catch (const std::exception&) {
    return 2;
  }
  return 0;
}

extern "C" std::size_t standin_torch_error_size() { return sizeof(c10::OutOfMemoryError); }
#endif
