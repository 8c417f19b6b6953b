// Python passes device pointers, streams and events as integers; these turn them back (bindings only).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace mk::bindings {

template <class T>
inline T* as_ptr(std::uintptr_t value) {
  return reinterpret_cast<T*>(value);
}
inline std::uintptr_t as_int(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
inline cudaStream_t as_stream(std::uintptr_t value) { return reinterpret_cast<cudaStream_t>(value); }
inline cudaEvent_t as_event(std::uintptr_t value) { return reinterpret_cast<cudaEvent_t>(value); }

}  // namespace mk::bindings
