#include "cuda/torch_error.hpp"

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cxxabi.h>
#include <exception>
#include <typeinfo>

#include "common/check.hpp"

namespace mk::cuda {

namespace {

// c10::SourceLocation (c10/util/Exception.h): passed by value to the constructor.
// The mangled name checks the constructor's parameter types, not this layout,
// which has been the same since c10 began.
struct SourceLocation {
  const char* function;
  const char* file;
  std::uint32_t line;
};

// c10::OutOfMemoryError::OutOfMemoryError(c10::SourceLocation, std::string), the
// complete-object constructor. The std::string is the C++11-ABI one, which the
// symbol name requires and this file checks at compile time.
constexpr const char* kConstructorSymbol =
    "_ZN3c1016OutOfMemoryErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE";
constexpr const char* kTypeinfoSymbol = "_ZTIN3c1016OutOfMemoryErrorE";
using Constructor = void (*)(void* self, SourceLocation location, std::string message);

struct TorchError {
  Constructor construct;
  std::type_info* type;
};
std::atomic<const TorchError*> g_torch_error{nullptr};

// c10::Error derives from std::exception alone, so the object starts with it and
// its virtual destructor (libc10's, through libc10's vtable) destroys the whole.
void destroy_exception(void* object) { static_cast<std::exception*>(object)->~exception(); }

}  // namespace

std::string use_torch_out_of_memory_error(const std::string& library_path) {
#if !defined(_GLIBCXX_USE_CXX11_ABI) || !_GLIBCXX_USE_CXX11_ABI
  return "memkernels was built with the pre-C++11 std::string ABI, which c10's constructor does not take";
#else
  // RTLD_NOLOAD: only the libc10 torch already loaded, never a second copy.
  void* library = dlopen(library_path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) return "libc10 is not loaded from " + library_path;
  auto construct = reinterpret_cast<Constructor>(dlsym(library, kConstructorSymbol));
  auto* type = static_cast<std::type_info*>(dlsym(library, kTypeinfoSymbol));
  if (construct == nullptr || type == nullptr) {
    dlclose(library);
    return "libc10 at " + library_path + " has no c10::OutOfMemoryError(SourceLocation, std::string) constructor";
  }
  // One libc10 per process: the first resolution is kept for good (the handle is never closed).
  static const TorchError resolved{construct, type};
  if (resolved.construct != construct || resolved.type != type)
    return "a different libc10 than the one first resolved: " + library_path;
  g_torch_error.store(&resolved, std::memory_order_release);
  return "";
#endif
}

void forget_torch_out_of_memory_error() { g_torch_error.store(nullptr, std::memory_order_release); }

bool torch_out_of_memory_error_resolved() { return g_torch_error.load(std::memory_order_acquire) != nullptr; }

void throw_out_of_memory(const std::string& message) {
  const TorchError* torch = g_torch_error.load(std::memory_order_acquire);
  if (torch == nullptr) throw out_of_memory(message);
  void* object = __cxxabiv1::__cxa_allocate_exception(kTorchErrorBytes);
  try {
    torch->construct(object, SourceLocation{"mk_pool_alloc", "memkernels/csrc/cuda/torch_error.cpp", __LINE__}, message);
  } catch (...) {
    __cxxabiv1::__cxa_free_exception(object);
    throw;
  }
  __cxxabiv1::__cxa_throw(object, torch->type, &destroy_exception);
}

}  // namespace mk::cuda
