// Named checks. User errors (bad arguments from Python or from a caller of the
// C API) are separate from internal invariants: the first becomes a ValueError
// that names the argument and the fix, the second a RuntimeError that says it
// is a memkernels bug.
//
// No iostreams anywhere in the C++ core: messages are built with std::string and
// std::to_string. On an H200 machine (Ubuntu 24.04, Python 3.12.3, torch
// 2.11.0+cu130 imported first) every message formatted through std::ostringstream's
// numeric insertion crashed inside libstdc++'s locale machinery (the signature of
// pytorch/pytorch#109923); tests/test_packaging.py keeps iostreams out of _C.
#pragma once

#include <stdexcept>
#include <string>

namespace mk {

// A caller passed something invalid. Message: what was wrong and how to fix it.
struct user_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// An internal invariant broke: a memkernels bug, never the caller's fault.
struct logic_error : std::logic_error {
  using std::logic_error::logic_error;
};

// A CUDA (or simulated CUDA) call failed, or the CUDA libraries could not be loaded.
struct cuda_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The device refused memory even after the pool released its cache and retried.
struct out_of_memory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
inline std::string where(const char* file, int line) {
  return std::string(" [") + file + ":" + std::to_string(line) + "]";
}
}  // namespace detail

}  // namespace mk

// Check a caller-supplied condition; `msg` may be any expression convertible to std::string.
#define MK_EXPECTS(cond, msg)                       \
  do {                                              \
    if (!(cond)) throw ::mk::user_error(std::string(msg)); \
  } while (0)

// Check an internal invariant; failing it is a bug in memkernels.
#define MK_ASSERT(cond, msg)                                                                  \
  do {                                                                                        \
    if (!(cond))                                                                              \
      throw ::mk::logic_error(std::string("memkernels internal error: ") + (msg) + " (" #cond \
                              ")" + ::mk::detail::where(__FILE__, __LINE__));                 \
  } while (0)
