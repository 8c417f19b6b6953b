// Named checks. User errors (bad arguments from Python or from a caller of the
// C API) are separate from internal invariants: the first becomes a ValueError
// that names the argument and the fix, the second a RuntimeError that says it
// is a memkernels bug.
#pragma once

#include <sstream>
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
  std::ostringstream os;
  os << " [" << file << ":" << line << "]";
  return os.str();
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
