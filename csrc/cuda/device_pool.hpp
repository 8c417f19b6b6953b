// The pool's view of a CUDA device (real or simulated, through the function
// table): segments from cudaMalloc/cudaFree, stream-ordered completion from
// cudaEvent*. Plus the process-wide pool behind the extern "C" entry points
// that torch.cuda.memory.CUDAPluggableAllocator calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/allocator.hpp"
#include "core/upstream.hpp"

namespace mk::cuda {

// Segments from cudaMalloc on the requested device (made current for the call),
// and for expandable segments the driver's virtual memory: ranges from
// cuMemAddressReserve, one cuMemCreate handle per page (so that any page can be
// unmapped alone, as cuMemUnmap must cover whole mappings), released right
// after cuMemMap (the memory lives until unmapped), read-write access for the
// device via cuMemSetAccess.
class DeviceUpstream : public core::Upstream {
 public:
  std::uintptr_t allocate(int device, std::size_t bytes) override;
  void deallocate(int device, std::uintptr_t address, std::size_t bytes) override;
  std::size_t total_memory(int device) override;
  std::string name() const override;
  std::size_t page_size(int device) override;
  std::uintptr_t reserve_range(int device, std::size_t bytes) override;
  void release_range(int device, std::uintptr_t base, std::size_t bytes) override;
  bool map(int device, std::uintptr_t address, std::size_t bytes) override;
  void unmap(int device, std::uintptr_t address, std::size_t bytes) override;
};

// cudaEvent-backed completion. Events are created without timing and recycled:
// creating one per free would cost more than the free itself.
class DeviceEvents : public core::EventSource {
 public:
  ~DeviceEvents() override;
  core::EventId record(int device, core::StreamId stream) override;
  bool query(core::EventId event) override;
  void synchronize(core::EventId event) override;
  void destroy(core::EventId event) override;

 private:
  std::mutex mutex_;
  std::unordered_map<core::EventId, int> device_of_;       // live events
  std::unordered_map<int, std::vector<core::EventId>> spare_;  // per device
};

// The process-wide pool the extern "C" entry points use. install_pool replaces
// it only while the previous one has nothing allocated (MK_EXPECTS otherwise).
std::shared_ptr<core::Allocator> install_pool(const core::PoolConfig& config);
std::shared_ptr<core::Allocator> installed_pool();  // null before install_pool

// Frees of pointers the pool does not own (unknown or already freed): counted
// and logged by mk_pool_free, never acted on.
std::uint64_t bad_free_count();
// Allocations mk_pool_alloc could not satisfy (it threw).
std::uint64_t failed_alloc_count();

}  // namespace mk::cuda

// CUDAPluggableAllocator entry points. torch neither checks the pointer alloc
// returns nor catches around the call, so alloc never returns null: a request the
// pool cannot serve (after release and retry) throws c10::OutOfMemoryError
// (torch.OutOfMemoryError in Python) or, before that type is resolved,
// mk::out_of_memory (a RuntimeError), see cuda/torch_error.hpp; other failures
// throw as they are. free never throws: what it cannot free is counted, logged
// to stderr and ignored.
extern "C" {
__attribute__((visibility("default"))) void* mk_pool_alloc(std::size_t size, int device, cudaStream_t stream);
__attribute__((visibility("default"))) void mk_pool_free(void* ptr, std::size_t size, int device, cudaStream_t stream);
}
