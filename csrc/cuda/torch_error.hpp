// The exception an allocation the installed pool cannot serve throws through
// PyTorch's CUDAPluggableAllocator, which neither checks the pointer it gets back
// nor catches: the exception reaches the Python binding that started the
// allocation, whose error translation picks the Python type from the C++ type.
//
// To get torch.OutOfMemoryError the thrown object must be a real
// c10::OutOfMemoryError (torch's catch clause matches its typeinfo). memkernels
// does not link libtorch, so the constructor and typeinfo come at run time from
// the libc10 torch already loaded (dlopen RTLD_NOLOAD + dlsym): libc10 builds the
// object, so its layout is libc10's own. Without them, mk::out_of_memory is
// thrown, which torch turns into a RuntimeError (torch.OutOfMemoryError derives
// from RuntimeError, so `except RuntimeError` catches both). Why this is safe
// and what it assumes: docs/allocator.md, "Out of memory under install()".
#pragma once

#include <cstddef>
#include <string>

namespace mk::cuda {

// Bytes allocated for the c10::OutOfMemoryError object (its size is not known
// here; 128 in torch 2.13, tests/test_allocator_install.py checks the bound).
constexpr std::size_t kTorchErrorBytes = 1024;

// Resolves c10::OutOfMemoryError from the already loaded libc10 at `library_path`.
// Returns "" on success, else why not (the RuntimeError fallback then stays on).
std::string use_torch_out_of_memory_error(const std::string& library_path);
// Back to the fallback (tests).
void forget_torch_out_of_memory_error();
bool torch_out_of_memory_error_resolved();

// Throws c10::OutOfMemoryError(message) if resolved, else mk::out_of_memory(message).
[[noreturn]] void throw_out_of_memory(const std::string& message);

}  // namespace mk::cuda
