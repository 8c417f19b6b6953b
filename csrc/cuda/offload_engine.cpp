#include "cuda/offload_engine.hpp"

#include <algorithm>
#include <string>

#include "common/check.hpp"

namespace mk {
namespace cuda {

namespace {

int clamp_priority(int priority, int least, int greatest) { return std::min(least, std::max(greatest, priority)); }

}  // namespace

OffloadEngine::OffloadEngine(const Options& options) : pool_(options.max_pinned_bytes) {
  const Api& cu = api();
  int least = 0, greatest = 0;
  MK_CUDA_CHECK(cu.cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  d2h_priority_ = clamp_priority(options.has_d2h_priority ? options.d2h_priority : least, least, greatest);
  h2d_priority_ = clamp_priority(options.has_h2d_priority ? options.h2d_priority : greatest, least, greatest);
  MK_CUDA_CHECK(cu.cudaStreamCreateWithPriority(&d2h_, cudaStreamNonBlocking, d2h_priority_),
                "cudaStreamCreateWithPriority (offload D2H stream)");
  const cudaError_t err = cu.cudaStreamCreateWithPriority(&h2d_, cudaStreamNonBlocking, h2d_priority_);
  if (err != cudaSuccess) {
    cu.cudaStreamDestroy(d2h_);
    MK_CUDA_CHECK(err, "cudaStreamCreateWithPriority (offload H2D stream)");
  }
}

OffloadEngine::~OffloadEngine() {
  try {
    close();
  } catch (...) {
    // A destructor must not throw; close() already dropped what it could.
  }
}

void OffloadEngine::check_open() const {
  MK_EXPECTS(!closed_, "the offload engine is closed; create a new one");
}

OffloadEngine::Entry& OffloadEngine::entry(std::uint64_t handle) {
  check_open();
  auto it = entries_.find(handle);
  MK_EXPECTS(it != entries_.end(), "offload handle " + std::to_string(handle) +
                                       " is unknown or already released (handles are the non-zero "
                                       "values offload() returned)");
  return it->second;
}

bool OffloadEngine::query(cudaEvent_t event, const char* call) {
  const cudaError_t err = api().cudaEventQuery(event);
  if (err == cudaErrorNotReady) return false;
  MK_CUDA_CHECK(err, call);
  return true;
}

cudaEvent_t OffloadEngine::acquire_event() {
  // Reuse only events whose last record completed: a stream wait issued on an
  // earlier record must not be satisfied by a later one.
  for (auto it = spare_events_.rbegin(); it != spare_events_.rend(); ++it) {
    if (query(*it, "cudaEventQuery (offload event pool)")) {
      cudaEvent_t event = *it;
      spare_events_.erase(std::next(it).base());
      return event;
    }
  }
  cudaEvent_t event = nullptr;
  MK_CUDA_CHECK(api().cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  all_events_.push_back(event);
  return event;
}

void OffloadEngine::recycle_event(cudaEvent_t event) {
  if (event != nullptr) spare_events_.push_back(event);
}

void OffloadEngine::collect_retired() {
  auto done = std::stable_partition(retiring_.begin(), retiring_.end(), [&](const Retiring& r) {
    return !query(r.last_copy, "cudaEventQuery (retiring pinned block)");
  });
  for (auto it = done; it != retiring_.end(); ++it) {
    pool_.free(it->block);
    recycle_event(it->last_copy);
  }
  retiring_.erase(done, retiring_.end());
}

PinnedPool::Block OffloadEngine::take_block(std::size_t nbytes) {
  collect_retired();
  if (!pool_.has_cached(nbytes)) {
    // A retired block of this class whose H2D copy still runs: reuse it behind
    // a stream wait rather than pin more memory.
    const std::size_t block_bytes = PinnedPool::class_size(nbytes);
    auto busy = std::find_if(retiring_.begin(), retiring_.end(),
                             [&](const Retiring& r) { return r.block.bytes == block_bytes; });
    if (busy != retiring_.end()) {
      MK_CUDA_CHECK(api().cudaStreamWaitEvent(d2h_, busy->last_copy, 0), "cudaStreamWaitEvent (reuse pinned block)");
      pool_.free(busy->block);  // allocate() below hands this very block out (LIFO)
      recycle_event(busy->last_copy);
      retiring_.erase(busy);
      ++stats_.reused_behind_wait;
    }
  }
  return pool_.allocate(nbytes);
}

std::uint64_t OffloadEngine::offload(const void* src, std::size_t nbytes, cudaStream_t compute_stream) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  MK_EXPECTS(src != nullptr, "offload: src must be a non-null address");
  MK_EXPECTS(nbytes > 0, "offload: nbytes must be positive (there is nothing to offload in an empty tensor)");
  PinnedPool::Block block = take_block(nbytes);
  if (!block) {
    ++stats_.kept;
    stats_.bytes_kept += nbytes;
    return 0;
  }
  const Api& cu = api();
  Entry e;
  e.block = block;
  e.nbytes = nbytes;
  cudaEvent_t ready = nullptr;
  try {
    ready = acquire_event();
    e.d2h_done = acquire_event();
    MK_CUDA_CHECK(cu.cudaEventRecord(ready, compute_stream), "cudaEventRecord (offload: source ready)");
    MK_CUDA_CHECK(cu.cudaStreamWaitEvent(d2h_, ready, 0), "cudaStreamWaitEvent (offload)");
    MK_CUDA_CHECK(cu.cudaMemcpyAsync(block.ptr, src, nbytes, cudaMemcpyDefault, d2h_), "cudaMemcpyAsync (offload)");
    MK_CUDA_CHECK(cu.cudaEventRecord(e.d2h_done, d2h_), "cudaEventRecord (offload done)");
  } catch (...) {
    // Nothing was queued that still needs the block, or the context is broken:
    // either way the block is not handed to the caller.
    recycle_event(ready);
    recycle_event(e.d2h_done);
    pool_.free(block);
    throw;
  }
  recycle_event(ready);
  const std::uint64_t handle = next_handle_++;
  entries_.emplace(handle, e);
  ++stats_.offloads;
  stats_.bytes_offloaded += nbytes;
  return handle;
}

bool OffloadEngine::offload_done(std::uint64_t handle) {
  std::lock_guard<std::mutex> lk(mu_);
  return query(entry(handle).d2h_done, "cudaEventQuery (offload done)");
}

void OffloadEngine::prefetch(std::uint64_t handle, void* dst, cudaStream_t compute_stream) {
  std::lock_guard<std::mutex> lk(mu_);
  Entry& e = entry(handle);
  MK_EXPECTS(dst != nullptr, "prefetch: dst must be a non-null address");
  const Api& cu = api();
  cudaEvent_t ready = acquire_event();
  try {
    if (e.h2d_done == nullptr) e.h2d_done = acquire_event();
    MK_CUDA_CHECK(cu.cudaEventRecord(ready, compute_stream), "cudaEventRecord (prefetch: destination ready)");
    MK_CUDA_CHECK(cu.cudaStreamWaitEvent(h2d_, ready, 0), "cudaStreamWaitEvent (prefetch)");
    MK_CUDA_CHECK(cu.cudaStreamWaitEvent(h2d_, e.d2h_done, 0), "cudaStreamWaitEvent (prefetch after offload)");
    MK_CUDA_CHECK(cu.cudaMemcpyAsync(dst, e.block.ptr, e.nbytes, cudaMemcpyDefault, h2d_), "cudaMemcpyAsync (prefetch)");
    MK_CUDA_CHECK(cu.cudaEventRecord(e.h2d_done, h2d_), "cudaEventRecord (prefetch done)");
  } catch (...) {
    recycle_event(ready);
    throw;
  }
  recycle_event(ready);
  e.prefetched = true;
  ++stats_.prefetches;
  stats_.bytes_prefetched += e.nbytes;
}

bool OffloadEngine::prefetch_done(std::uint64_t handle) {
  std::lock_guard<std::mutex> lk(mu_);
  Entry& e = entry(handle);
  MK_EXPECTS(e.prefetched, "prefetch_done: handle " + std::to_string(handle) + " was never prefetched");
  return query(e.h2d_done, "cudaEventQuery (prefetch done)");
}

void OffloadEngine::wait(std::uint64_t handle, cudaStream_t stream) {
  std::lock_guard<std::mutex> lk(mu_);
  Entry& e = entry(handle);
  MK_EXPECTS(e.prefetched, "wait: handle " + std::to_string(handle) + " was never prefetched; prefetch() it first");
  MK_CUDA_CHECK(api().cudaStreamWaitEvent(stream, e.h2d_done, 0), "cudaStreamWaitEvent (wait for prefetch)");
}

void OffloadEngine::synchronize(std::uint64_t handle) {
  std::lock_guard<std::mutex> lk(mu_);
  Entry& e = entry(handle);
  MK_CUDA_CHECK(api().cudaEventSynchronize(e.prefetched ? e.h2d_done : e.d2h_done), "cudaEventSynchronize (offload)");
}

void OffloadEngine::release(std::uint64_t handle) {
  std::lock_guard<std::mutex> lk(mu_);
  Entry& e = entry(handle);
  // The H2D stream waited for the D2H copy, so the last prefetch completes last.
  cudaEvent_t last = e.prefetched ? e.h2d_done : e.d2h_done;
  recycle_event(e.prefetched ? e.d2h_done : e.h2d_done);
  retiring_.push_back({e.block, last});
  entries_.erase(handle);
  collect_retired();
}

std::size_t OffloadEngine::nbytes(std::uint64_t handle) {
  std::lock_guard<std::mutex> lk(mu_);
  return entry(handle).nbytes;
}

void OffloadEngine::synchronize_all() {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  const Api& cu = api();
  MK_CUDA_CHECK(cu.cudaStreamSynchronize(d2h_), "cudaStreamSynchronize (offload D2H stream)");
  MK_CUDA_CHECK(cu.cudaStreamSynchronize(h2d_), "cudaStreamSynchronize (offload H2D stream)");
  collect_retired();
}

bool OffloadEngine::idle() {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  const Api& cu = api();
  for (cudaStream_t stream : {d2h_, h2d_}) {
    const cudaError_t err = cu.cudaStreamQuery(stream);
    if (err == cudaErrorNotReady) return false;
    MK_CUDA_CHECK(err, "cudaStreamQuery (offload stream)");
  }
  return true;
}

std::size_t OffloadEngine::trim() {
  synchronize_all();
  std::lock_guard<std::mutex> lk(mu_);
  return pool_.trim();
}

void OffloadEngine::close() {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return;
  closed_ = true;
  const Api& cu = api();
  // Every copy must finish before its pinned block is freed; cudaFreeHost
  // would wait too, but an error is better seen here.
  const cudaError_t d2h_err = cu.cudaStreamSynchronize(d2h_);
  const cudaError_t h2d_err = cu.cudaStreamSynchronize(h2d_);
  for (auto& [handle, e] : entries_) pool_.free(e.block);
  for (auto& r : retiring_) pool_.free(r.block);
  entries_.clear();
  retiring_.clear();
  spare_events_.clear();
  stats_.live_handles = 0;
  for (cudaEvent_t event : all_events_) cu.cudaEventDestroy(event);
  all_events_.clear();
  cu.cudaStreamDestroy(d2h_);
  cu.cudaStreamDestroy(h2d_);
  if (d2h_err == cudaErrorInvalidResourceHandle) {
    // The device was reset under us (its streams are gone, and so is the
    // pinned memory): freeing the old addresses could hit new allocations.
    pool_.abandon();
    return;
  }
  pool_.release_all();
  MK_CUDA_CHECK(d2h_err, "cudaStreamSynchronize (closing offload D2H stream)");
  MK_CUDA_CHECK(h2d_err, "cudaStreamSynchronize (closing offload H2D stream)");
}

bool OffloadEngine::closed() {
  std::lock_guard<std::mutex> lk(mu_);
  return closed_;
}

OffloadEngineStats OffloadEngine::stats() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!closed_) collect_retired();
  OffloadEngineStats out = stats_;
  out.live_handles = entries_.size();
  out.retiring_blocks = retiring_.size();
  out.pool = pool_.stats();
  return out;
}

std::pair<int, int> OffloadEngine::priorities() {
  std::lock_guard<std::mutex> lk(mu_);
  return {d2h_priority_, h2d_priority_};
}

}  // namespace cuda
}  // namespace mk
