// A pool of pinned (page-locked) host memory for activation offload.
//
// Pinning memory is slow (cudaHostAlloc maps and locks pages, and takes the
// device lock: milliseconds for a few MiB) and cudaFreeHost synchronizes the
// device, so the pool pins a slab once and hands out its blocks again and
// again, step after step.
//
// Size classes: 512 bytes, then four classes per power of two (P, 1.25P,
// 1.5P, 1.75P for every P >= 512), so a block wastes less than a quarter of
// its request. Classes up to kSmallClassMax share slabs of about kSlabBytes
// carved into equal blocks; a larger class gets a slab of exactly one block.
// A slab serves one class for its whole life, so blocks never need
// splitting or coalescing.
//
// Cap: `max_pinned_bytes` bounds the pinned bytes held (in use or cached).
// When a new slab would cross it, allocate() returns an empty Block and the
// caller keeps its data where it is. The pool never frees cached slabs on its
// own: cudaFreeHost synchronizes the device, and allocate() runs in the middle
// of a forward pass. The owner calls trim() outside the step. A host that refuses to pin
// (cudaErrorMemoryAllocation) is handled the same way. Any other CUDA error
// throws mk::cuda_error.
//
// Not thread-safe: the owner (OffloadEngine) serializes calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

namespace mk {
namespace cuda {

struct PinnedPoolStats {
  std::size_t pinned_bytes = 0;        // held from cudaHostAlloc (in use + cached)
  std::size_t peak_pinned_bytes = 0;
  std::size_t bytes_in_use = 0;        // block (class) bytes handed out
  std::size_t slabs = 0;               // live slabs
  std::size_t slab_allocations = 0;    // cudaHostAlloc calls that succeeded, ever
  std::size_t slab_frees = 0;          // cudaFreeHost calls, ever
  std::size_t hits = 0;                // blocks served from the cache
  std::size_t misses = 0;              // blocks that needed a new slab
  std::size_t refusals = 0;            // requests refused (cap or host out of pinned memory)
};

class PinnedPool {
 public:
  static constexpr std::size_t kMinClass = 512;
  static constexpr std::size_t kSlabBytes = std::size_t(2) << 20;
  static constexpr std::size_t kSmallClassMax = std::size_t(256) << 10;

  struct Block {
    void* ptr = nullptr;
    std::size_t bytes = 0;  // the class size: usable bytes
    explicit operator bool() const { return ptr != nullptr; }
  };

  explicit PinnedPool(std::size_t max_pinned_bytes = SIZE_MAX);
  ~PinnedPool();  // frees every slab; errors are ignored (destructors never throw)
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // The class a request of `nbytes` (> 0) is served from.
  static std::size_t class_size(std::size_t nbytes);

  // A block of at least `nbytes`, or an empty Block when the cap or the host refuses.
  Block allocate(std::size_t nbytes);
  // Give a block back to the cache. The caller guarantees no copy still uses it.
  void free(Block block);
  // Free every slab none of whose blocks is in use; returns the bytes freed.
  std::size_t trim();
  // A block of this request's class is cached (allocate() would hit).
  bool has_cached(std::size_t nbytes) const;
  // Free everything; every block must be back (MK_ASSERT otherwise).
  void release_all();
  // Forget every slab without freeing it: the device was reset and took the
  // memory with it.
  void abandon();

  std::size_t max_pinned_bytes() const { return max_pinned_bytes_; }
  PinnedPoolStats stats() const { return stats_; }

 private:
  struct Slab {
    std::size_t bytes = 0;
    std::size_t block_bytes = 0;
    std::size_t blocks = 0;
    std::size_t in_use = 0;
  };

  bool add_slab(std::size_t block_bytes);  // false: refused
  std::map<std::uintptr_t, Slab>::iterator slab_of(const void* ptr);
  void free_slab(std::map<std::uintptr_t, Slab>::iterator it);

  std::size_t max_pinned_bytes_;
  std::map<std::uintptr_t, Slab> slabs_;                  // base address -> slab
  std::map<std::size_t, std::vector<void*>> free_blocks_;  // class size -> cached blocks (LIFO)
  PinnedPoolStats stats_;
};

}  // namespace cuda
}  // namespace mk
