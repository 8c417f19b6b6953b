// The CUDA function table: every CUDA runtime and driver call memkernels makes
// goes through one `mk::cuda::Api` (a struct of function pointers), never
// through a linked symbol. Two implementations fill it:
//
//   "cuda"  the real libcudart + libcuda, found at first use by dlopen: first
//           the copies already loaded in the process (torch's), else the
//           system's (see api.cpp for the search order and symbol versions);
//   "sim"   the simulated device in csrc/sim/ (host memory or address-only
//           memory, streams run by worker threads, fault injection).
//
// Which one `api()` returns is chosen once per process: by
// `select_backend()` before first use, else by the environment variable
// MEMKERNELS_DEVICE=sim|cuda read at first use (unset means "cuda").
// Once `api()` has handed out a table the choice is fixed; asking to switch
// afterwards is a mk::user_error. A failed real load hands out nothing, so
// switching to the simulator after it is still allowed.
//
// Types come from the real CUDA headers (cuda.h, cuda_runtime_api.h), never
// from hand-written declarations: each member has the type of the header's
// prototype (`decltype(&::cudaMalloc)`), so a signature mismatch is a compile
// error rather than silent memory corruption.
//
// How to call (pool / offload code):
//
//   const mk::cuda::Api& cu = mk::cuda::api();
//   void* p = nullptr;
//   cudaError_t err = cu.cudaMalloc(&p, bytes);
//   if (err == cudaErrorMemoryAllocation) { ... release cache, retry ... }
//   MK_CUDA_CHECK(err, "cudaMalloc");          // anything else: throws
//
// The primitives later parts build on:
//   segments         cudaMalloc / cudaFree (cudaFree synchronizes the device),
//                    or VMM: cuMemGetAllocationGranularity, cuMemAddressReserve,
//                    cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap,
//                    cuMemRelease, cuMemAddressFree (expandable segments);
//   pinned host      cudaHostAlloc / cudaFreeHost;
//   stream order     cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
//                    cudaEventRecord(e, stream) when a block is freed on a
//                    stream, cudaEventQuery(e): cudaSuccess = reusable,
//                    cudaErrorNotReady = still in use; cudaStreamWaitEvent to
//                    order a side stream after a compute stream;
//   copies           cudaMemcpyAsync on a stream from
//                    cudaStreamCreateWithPriority.
// Out of memory is cudaErrorMemoryAllocation (runtime) or
// CUDA_ERROR_OUT_OF_MEMORY (driver), both 2: test the code, do not throw.
//
// Members carry the CUDA names, so `cu.cuMemMap(...)` reads like the CUDA
// documentation. All members are non-null in a table returned by api() or
// real_api(). Semantics are CUDA's; where the simulator differs (e.g. it is
// stricter about VMM misuse) csrc/sim/sim.hpp says so.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>

#include "common/check.hpp"

// Runtime API entry points (libcudart). The plain names: memkernels is not
// built with per-thread default streams, so the `_ptsz` variants are never
// wanted. Their ABI is unchanged between CUDA 12 and 13 for this set.
#define MK_CUDA_RUNTIME_FUNCTIONS(X) \
  X(cudaGetDeviceCount)              \
  X(cudaGetDevice)                   \
  X(cudaSetDevice)                   \
  X(cudaDeviceSynchronize)           \
  X(cudaMemGetInfo)                  \
  X(cudaMalloc)                      \
  X(cudaFree)                        \
  X(cudaHostAlloc)                   \
  X(cudaFreeHost)                    \
  X(cudaMemcpyAsync)                 \
  X(cudaStreamCreateWithPriority)    \
  X(cudaStreamDestroy)               \
  X(cudaStreamSynchronize)           \
  X(cudaStreamQuery)                 \
  X(cudaDeviceGetStreamPriorityRange) \
  X(cudaEventCreateWithFlags)        \
  X(cudaEventDestroy)                \
  X(cudaEventRecord)                 \
  X(cudaEventQuery)                  \
  X(cudaEventSynchronize)            \
  X(cudaStreamWaitEvent)             \
  X(cudaGetErrorName)                \
  X(cudaGetErrorString)              \
  X(cudaDriverGetVersion)

// Driver API entry points (libcuda). Resolved through cuGetProcAddress with
// the headers' CUDA_VERSION, which returns the ABI version of each symbol that
// matches the prototype we compiled against (see api.cpp).
#define MK_CUDA_DRIVER_FUNCTIONS(X) \
  X(cuInit)                         \
  X(cuDriverGetVersion)             \
  X(cuDeviceGet)                    \
  X(cuGetErrorName)                 \
  X(cuGetErrorString)               \
  X(cuMemAddressReserve)            \
  X(cuMemAddressFree)               \
  X(cuMemCreate)                    \
  X(cuMemRelease)                   \
  X(cuMemMap)                       \
  X(cuMemUnmap)                     \
  X(cuMemSetAccess)                 \
  X(cuMemGetAllocationGranularity)

#define MK_CUDA_ALL_FUNCTIONS(X) MK_CUDA_RUNTIME_FUNCTIONS(X) MK_CUDA_DRIVER_FUNCTIONS(X)

namespace mk {
namespace cuda {

struct Api {
  const char* backend = nullptr;  // "cuda" or "sim"
#define MK_CUDA_DECLARE_MEMBER(name) decltype(&::name) name = nullptr;
  MK_CUDA_ALL_FUNCTIONS(MK_CUDA_DECLARE_MEMBER)
#undef MK_CUDA_DECLARE_MEMBER
};

enum class Backend { cuda, sim };

// The selected table, loaded on first call (which fixes the selection).
// Throws mk::cuda_error if the real CUDA libraries or driver are missing.
const Api& api();

// Choose the backend before first use of api(). Throws mk::user_error when a
// different table has already been handed out.
void select_backend(Backend backend);

// The current choice: the explicit selection, else MEMKERNELS_DEVICE (read
// now; a value other than "sim"/"cuda" is a mk::user_error).
Backend selected_backend();

// True once api() has handed out a table.
bool backend_locked();

const char* backend_name(Backend backend);

// What the real loader found. Paths are as dlopen reported them.
struct RealInfo {
  std::string cudart_path;
  std::string libcuda_path;
  int runtime_driver_version = 0;  // cudaDriverGetVersion
  int device_count = 0;
};

// Load the real CUDA table regardless of the selection (does not fix it).
// Throws mk::cuda_error naming every library that was looked for and why it
// failed: "no CUDA driver/library: ...; install the NVIDIA driver or set
// MEMKERNELS_DEVICE=sim". The outcome (table or error) is cached.
const Api& real_api();
RealInfo real_info();  // loads like real_api()

// A failed call: mk::cuda_error carrying the numeric code and the API name, so
// the Python side can expose them as CudaError.code / CudaError.call.
struct call_error : cuda_error {
  call_error(const std::string& message, int code, std::string call)
      : cuda_error(message), code(code), call(std::move(call)) {}
  int code;
  std::string call;
};

// Throw call_error for a failed runtime/driver call, naming the call, the
// error's name and description (from the table that produced it).
[[noreturn]] void throw_call_error(const Api& table, cudaError_t err, const std::string& call);
[[noreturn]] void throw_call_error(const Api& table, CUresult err, const std::string& call);

inline void check(const Api& table, cudaError_t err, const std::string& call) {
  if (err != cudaSuccess) throw_call_error(table, err, call);
}
inline void check(const Api& table, CUresult err, const std::string& call) {
  if (err != CUDA_SUCCESS) throw_call_error(table, err, call);
}

// The allocation properties of physical device memory for the VMM calls
// (cuMemCreate, cuMemGetAllocationGranularity): pinned, on `device`.
inline CUmemAllocationProp pinned_on(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

}  // namespace cuda
}  // namespace mk

// Check the result of a call made through mk::cuda::api(); `call` describes it.
#define MK_CUDA_CHECK(err, call) ::mk::cuda::check(::mk::cuda::api(), (err), (call))
