#include "cuda/device_pool.hpp"

#include <atomic>
#include <cstdio>
#include <exception>

#include "common/check.hpp"
#include "cuda/api.hpp"
#include "cuda/torch_error.hpp"

namespace mk::cuda {

namespace {

// Makes `device` current for the calling thread and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    const Api& cu = api();
    check(cu, cu.cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cu, cu.cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int current = previous_;
    const Api& cu = api();
    if (cu.cudaGetDevice(&current) == cudaSuccess && current != previous_) cu.cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

cudaEvent_t as_event(core::EventId event) { return reinterpret_cast<cudaEvent_t>(event); }

std::mutex g_install_mutex;
// Every pool ever installed, never destroyed: torch may call the C entry points
// until the process ends (static destructors included), and a replaced pool's
// pointer may still be in flight in another thread.
std::vector<std::shared_ptr<core::Allocator>>& installed_pools() {
  static auto* pools = new std::vector<std::shared_ptr<core::Allocator>>();
  return *pools;
}
std::atomic<core::Allocator*> g_pool_raw{nullptr};  // what the C entry points read
std::atomic<std::uint64_t> g_bad_frees{0};
std::atomic<std::uint64_t> g_failed_allocs{0};

}  // namespace

std::uintptr_t DeviceUpstream::allocate(int device, std::size_t bytes) {
  DeviceGuard guard(device);
  const Api& cu = api();
  void* ptr = nullptr;
  cudaError_t err = cu.cudaMalloc(&ptr, bytes);
  if (err == cudaErrorMemoryAllocation) return 0;  // the pool releases its cache and retries
  check(cu, err, "cudaMalloc");
  return reinterpret_cast<std::uintptr_t>(ptr);
}

void DeviceUpstream::deallocate(int device, std::uintptr_t address, std::size_t) {
  DeviceGuard guard(device);
  const Api& cu = api();
  check(cu, cu.cudaFree(reinterpret_cast<void*>(address)), "cudaFree");
}

std::size_t DeviceUpstream::total_memory(int device) {
  DeviceGuard guard(device);
  const Api& cu = api();
  std::size_t free_bytes = 0, total_bytes = 0;
  check(cu, cu.cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  return total_bytes;
}

std::string DeviceUpstream::name() const { return api().backend; }

std::size_t DeviceUpstream::page_size(int device) {
  DeviceGuard guard(device);
  const Api& cu = api();
  CUmemAllocationProp prop = pinned_on(device);
  std::size_t granularity = 0;
  check(cu, cu.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity");
  return granularity;
}

std::uintptr_t DeviceUpstream::reserve_range(int device, std::size_t bytes) {
  DeviceGuard guard(device);
  const Api& cu = api();
  CUdeviceptr base = 0;
  CUresult err = cu.cuMemAddressReserve(&base, bytes, 0, 0, 0);
  if (err == CUDA_ERROR_OUT_OF_MEMORY) return 0;
  check(cu, err, "cuMemAddressReserve");
  return static_cast<std::uintptr_t>(base);
}

void DeviceUpstream::release_range(int device, std::uintptr_t base, std::size_t bytes) {
  DeviceGuard guard(device);
  const Api& cu = api();
  check(cu, cu.cuMemAddressFree(static_cast<CUdeviceptr>(base), bytes), "cuMemAddressFree");
}

bool DeviceUpstream::map(int device, std::uintptr_t address, std::size_t bytes) {
  DeviceGuard guard(device);
  const Api& cu = api();
  CUmemAllocationProp prop = pinned_on(device);
  const std::size_t page = page_size(device);
  std::size_t done = 0;
  auto undo = [&] {
    for (std::size_t offset = 0; offset < done; offset += page)
      cu.cuMemUnmap(static_cast<CUdeviceptr>(address + offset), page);
  };
  for (; done < bytes; done += page) {
    CUmemGenericAllocationHandle handle = 0;
    CUresult err = cu.cuMemCreate(&handle, page, &prop, 0);
    if (err == CUDA_ERROR_OUT_OF_MEMORY) {
      undo();
      return false;  // the pool releases its cache and retries
    }
    check(cu, err, "cuMemCreate");
    err = cu.cuMemMap(static_cast<CUdeviceptr>(address + done), page, 0, handle, 0);
    cu.cuMemRelease(handle);  // mapped, the memory lives on until cuMemUnmap; unmapped, this frees it
    if (err != CUDA_SUCCESS) {
      undo();
      check(cu, err, "cuMemMap");
    }
  }
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult err = cu.cuMemSetAccess(static_cast<CUdeviceptr>(address), bytes, &access, 1);
  if (err != CUDA_SUCCESS) {
    undo();
    check(cu, err, "cuMemSetAccess");
  }
  return true;
}

void DeviceUpstream::unmap(int device, std::uintptr_t address, std::size_t bytes) {
  DeviceGuard guard(device);
  const Api& cu = api();
  const std::size_t page = page_size(device);
  for (std::size_t offset = 0; offset < bytes; offset += page)
    check(cu, cu.cuMemUnmap(static_cast<CUdeviceptr>(address + offset), page), "cuMemUnmap");
}

DeviceEvents::~DeviceEvents() {
  const Api& cu = api();
  for (auto& entry : spare_)
    for (core::EventId event : entry.second) cu.cudaEventDestroy(as_event(event));
  for (auto& entry : device_of_) cu.cudaEventDestroy(as_event(entry.first));
}

core::EventId DeviceEvents::record(int device, core::StreamId stream) {
  core::EventId event = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& spare = spare_[device];
    if (!spare.empty()) {
      event = spare.back();
      spare.pop_back();
    }
  }
  DeviceGuard guard(device);
  const Api& cu = api();
  if (event == 0) {
    cudaEvent_t created = nullptr;
    check(cu, cu.cudaEventCreateWithFlags(&created, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    event = reinterpret_cast<core::EventId>(created);
  }
  check(cu, cu.cudaEventRecord(as_event(event), reinterpret_cast<cudaStream_t>(stream)), "cudaEventRecord");
  std::lock_guard<std::mutex> lock(mutex_);
  device_of_[event] = device;
  return event;
}

bool DeviceEvents::query(core::EventId event) {
  const Api& cu = api();
  cudaError_t err = cu.cudaEventQuery(as_event(event));
  if (err == cudaErrorNotReady) return false;
  check(cu, err, "cudaEventQuery");
  return true;
}

void DeviceEvents::synchronize(core::EventId event) {
  const Api& cu = api();
  check(cu, cu.cudaEventSynchronize(as_event(event)), "cudaEventSynchronize");
}

void DeviceEvents::destroy(core::EventId event) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = device_of_.find(event);
  MK_ASSERT(it != device_of_.end(), "destroying an event this source did not record");
  spare_[it->second].push_back(event);
  device_of_.erase(it);
}

std::shared_ptr<core::Allocator> install_pool(const core::PoolConfig& config) {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  core::Allocator* current = g_pool_raw.load();
  if (current != nullptr) {
    for (int d = 0; d < core::Allocator::kMaxDevices; ++d) {
      core::DevicePool* pool = current->find(d);
      MK_EXPECTS(pool == nullptr || pool->stats().total.allocation_count.current == 0,
                 "install: the installed pool still has live allocations on device " + std::to_string(d) +
                     "; free them (and synchronize) before installing a new pool");
    }
  }
  auto next = std::make_shared<core::Allocator>(config, std::make_shared<DeviceUpstream>(),
                                                std::make_shared<DeviceEvents>());
  installed_pools().push_back(next);
  g_pool_raw.store(next.get(), std::memory_order_release);
  return next;
}

std::shared_ptr<core::Allocator> installed_pool() {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  return installed_pools().empty() ? nullptr : installed_pools().back();
}

std::uint64_t bad_free_count() { return g_bad_frees.load(); }
std::uint64_t failed_alloc_count() { return g_failed_allocs.load(); }

}  // namespace mk::cuda

extern "C" void* mk_pool_alloc(std::size_t size, int device, cudaStream_t stream) {
  mk::core::Allocator* pool = mk::cuda::g_pool_raw.load(std::memory_order_acquire);
  if (pool == nullptr) {
    ++mk::cuda::g_failed_allocs;
    throw std::runtime_error("memkernels: mk_pool_alloc called before memkernels.allocator.install()");
  }
  try {
    return reinterpret_cast<void*>(pool->pool(device).malloc(size, reinterpret_cast<mk::core::StreamId>(stream)));
  } catch (const mk::out_of_memory& e) {
    ++mk::cuda::g_failed_allocs;
    mk::cuda::throw_out_of_memory(e.what());  // torch.OutOfMemoryError once resolved (torch_error.hpp)
  } catch (...) {
    ++mk::cuda::g_failed_allocs;
    throw;  // a CUDA error or a bad device index: torch turns it into a RuntimeError
  }
}

extern "C" void mk_pool_free(void* ptr, std::size_t size, int device, cudaStream_t) {
  if (ptr == nullptr) return;
  mk::core::Allocator* pool = mk::cuda::g_pool_raw.load(std::memory_order_acquire);
  try {
    if (pool != nullptr && pool->pool(device).free(reinterpret_cast<std::uintptr_t>(ptr))) return;
    std::fprintf(stderr,
                 "memkernels: ignoring free of %p (%zu bytes, device %d): not a live allocation of the pool "
                 "(unknown pointer or freed twice)\n",
                 ptr, size, device);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memkernels: mk_pool_free: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "memkernels: mk_pool_free: unknown error\n");
  }
  ++mk::cuda::g_bad_frees;
}
