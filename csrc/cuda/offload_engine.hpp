// The activation-offload copy engine: device -> pinned host copies during
// forward, host -> device copies (prefetch) during backward, on two side
// streams, ordered by events. It knows nothing about tensors: it moves byte
// ranges and answers "has that copy completed?".
//
// Ordering (all on the device, no host synchronization):
//   offload(src, n, compute)   event on `compute` (src is written by then) ->
//                              the D2H stream waits for it -> copy into a
//                              pinned block -> `d2h_done` recorded.
//   prefetch(h, dst, compute)  event on `compute` (dst is allocated and free by
//                              then) and `d2h_done` -> the H2D stream waits for
//                              both -> copy into dst -> `h2d_done` recorded.
//   wait(h, stream)            `stream` waits for `h2d_done`.
//   synchronize(h)             the host waits for the handle's last copy.
//   release(h)                 the block goes back to the pool once the
//                              handle's last copy completed (a block whose
//                              copy is still running is handed out again only
//                              behind a stream wait on that copy).
//
// Source lifetime: the engine never extends the life of the source range.
// The caller keeps it alive (and unmodified) until offload_done(h) is true,
// e.g. by holding the tensor: no record_stream, whose deferred frees are the
// unbounded memory growth PyTorch's own passes warn about.
//
// Copies use cudaMemcpyDefault (unified addressing infers the direction), so
// the same call serves device sources on a GPU and, on the simulated device,
// ordinary host buffers standing in for device tensors.
//
// Thread-safe: one mutex serializes every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cuda/api.hpp"
#include "cuda/pinned_pool.hpp"

namespace mk {
namespace cuda {

struct OffloadEngineStats {
  std::size_t offloads = 0;          // offload() calls that got a pinned block
  std::size_t bytes_offloaded = 0;   // bytes copied device -> host
  std::size_t kept = 0;              // offload() calls refused by the pool (data stays on the device)
  std::size_t bytes_kept = 0;
  std::size_t prefetches = 0;        // prefetch() calls
  std::size_t bytes_prefetched = 0;  // bytes copied host -> device
  std::size_t live_handles = 0;      // offloaded, not yet released
  std::size_t retiring_blocks = 0;   // released, waiting for their last copy
  std::size_t reused_behind_wait = 0;  // blocks handed out again behind a stream wait
  PinnedPoolStats pool;
};

class OffloadEngine {
 public:
  struct Options {
    std::size_t max_pinned_bytes = SIZE_MAX;
    // Stream priorities (lower is more urgent); clamped to the device's range.
    // Defaults: prefetch is what backward waits on, so it gets the greatest
    // priority; offload runs behind compute at the least.
    bool has_d2h_priority = false;
    int d2h_priority = 0;
    bool has_h2d_priority = false;
    int h2d_priority = 0;
  };

  explicit OffloadEngine(const Options& options);
  ~OffloadEngine();  // close(), errors ignored
  OffloadEngine(const OffloadEngine&) = delete;
  OffloadEngine& operator=(const OffloadEngine&) = delete;

  // Start copying [src, src+nbytes) to pinned memory after the work queued on
  // `compute_stream` so far. Returns a handle (> 0), or 0 when the pool
  // refused (cap reached): the data stays where it is, counted as kept.
  std::uint64_t offload(const void* src, std::size_t nbytes, cudaStream_t compute_stream);
  bool offload_done(std::uint64_t handle);
  // Copy the handle's bytes to dst (nbytes of it) after `compute_stream`'s work so far.
  void prefetch(std::uint64_t handle, void* dst, cudaStream_t compute_stream);
  bool prefetch_done(std::uint64_t handle);
  void wait(std::uint64_t handle, cudaStream_t stream);
  void synchronize(std::uint64_t handle);
  void release(std::uint64_t handle);
  std::size_t nbytes(std::uint64_t handle);

  // Host-wait for both copy streams, then return every retired block to the pool.
  void synchronize_all();
  // Both copy streams have nothing pending.
  bool idle();
  // synchronize_all() and give back the slabs with no block in use.
  std::size_t trim();
  // Release every handle and all CUDA state (streams, events, slabs). Idempotent;
  // afterwards every other call is a mk::user_error.
  void close();
  bool closed();

  OffloadEngineStats stats();
  std::pair<int, int> priorities();  // (d2h, h2d) as created

 private:
  struct Entry {
    PinnedPool::Block block;
    std::size_t nbytes = 0;
    cudaEvent_t d2h_done = nullptr;
    cudaEvent_t h2d_done = nullptr;
    bool prefetched = false;
  };
  struct Retiring {
    PinnedPool::Block block;
    cudaEvent_t last_copy = nullptr;
  };

  Entry& entry(std::uint64_t handle);  // MK_EXPECTS a live handle
  void check_open() const;
  cudaEvent_t acquire_event();
  void recycle_event(cudaEvent_t event);
  void collect_retired();  // blocks whose last copy completed go back to the pool
  PinnedPool::Block take_block(std::size_t nbytes);
  bool query(cudaEvent_t event, const char* call);

  std::mutex mu_;
  bool closed_ = false;
  PinnedPool pool_;
  cudaStream_t d2h_ = nullptr;
  cudaStream_t h2d_ = nullptr;
  int d2h_priority_ = 0;
  int h2d_priority_ = 0;
  std::uint64_t next_handle_ = 1;
  std::unordered_map<std::uint64_t, Entry> entries_;
  std::vector<Retiring> retiring_;
  std::vector<cudaEvent_t> spare_events_;  // reusable once their last record completed
  std::vector<cudaEvent_t> all_events_;
  OffloadEngineStats stats_;
};

}  // namespace cuda
}  // namespace mk
