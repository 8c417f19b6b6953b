#include "cuda/pinned_pool.hpp"

#include <algorithm>
#include <string>

#include "common/check.hpp"
#include "cuda/api.hpp"

namespace mk {
namespace cuda {

PinnedPool::PinnedPool(std::size_t max_pinned_bytes) : max_pinned_bytes_(max_pinned_bytes) {}

PinnedPool::~PinnedPool() {
  const Api& cu = api();
  for (const auto& [base, slab] : slabs_) cu.cudaFreeHost(reinterpret_cast<void*>(base));
}

std::size_t PinnedPool::class_size(std::size_t nbytes) {
  MK_EXPECTS(nbytes > 0, "pinned pool: a request must be at least one byte");
  if (nbytes <= kMinClass) return kMinClass;
  // The power of two P with P < nbytes <= 2P, then the first quarter-step of P that fits.
  std::size_t power = kMinClass;
  while (power <= (nbytes - 1) / 2) power *= 2;
  const std::size_t quarter = power / 4;
  const std::size_t steps = (nbytes - power + quarter - 1) / quarter;  // 1..4
  MK_EXPECTS(power <= SIZE_MAX - steps * quarter, "pinned pool: request of " + std::to_string(nbytes) +
                                                      " bytes is too large");
  return power + steps * quarter;
}

PinnedPool::Block PinnedPool::allocate(std::size_t nbytes) {
  const std::size_t block_bytes = class_size(nbytes);
  auto cached = free_blocks_.find(block_bytes);
  if (cached == free_blocks_.end() || cached->second.empty()) {
    if (!add_slab(block_bytes)) {
      ++stats_.refusals;
      return {};
    }
    ++stats_.misses;
    cached = free_blocks_.find(block_bytes);
  } else {
    ++stats_.hits;
  }
  void* ptr = cached->second.back();
  cached->second.pop_back();
  slab_of(ptr)->second.in_use += 1;
  stats_.bytes_in_use += block_bytes;
  return {ptr, block_bytes};
}

void PinnedPool::free(Block block) {
  MK_ASSERT(block.ptr != nullptr, "freeing an empty pinned block");
  auto it = slab_of(block.ptr);
  MK_ASSERT(it != slabs_.end() && it->second.block_bytes == block.bytes && it->second.in_use > 0,
            "pinned block does not belong to this pool");
  it->second.in_use -= 1;
  stats_.bytes_in_use -= block.bytes;
  free_blocks_[block.bytes].push_back(block.ptr);
}

bool PinnedPool::add_slab(std::size_t block_bytes) {
  const auto room = [&] { return max_pinned_bytes_ - std::min(max_pinned_bytes_, stats_.pinned_bytes); };
  // No trim() here: cudaFreeHost synchronizes the device, and this runs inside the step.
  // The owner trims outside it (OffloadActivations: at the next block's start, empty_cache()).
  if (block_bytes > room()) return false;
  // Small classes share a slab, shrunk to what the cap leaves (at least one block).
  std::size_t slab_bytes = block_bytes;
  if (block_bytes <= kSmallClassMax) {
    const std::size_t wanted = std::max<std::size_t>(1, kSlabBytes / block_bytes);
    slab_bytes = std::min(wanted, room() / block_bytes) * block_bytes;
  }
  const Api& cu = api();
  void* base = nullptr;
  cudaError_t err = cu.cudaHostAlloc(&base, slab_bytes, cudaHostAllocDefault);
  if (err == cudaErrorMemoryAllocation && trim() > 0) err = cu.cudaHostAlloc(&base, slab_bytes, cudaHostAllocDefault);
  if (err == cudaErrorMemoryAllocation) return false;
  MK_CUDA_CHECK(err, "cudaHostAlloc");
  Slab slab;
  slab.bytes = slab_bytes;
  slab.block_bytes = block_bytes;
  slab.blocks = slab_bytes / block_bytes;
  slabs_.emplace(reinterpret_cast<std::uintptr_t>(base), slab);
  auto& cache = free_blocks_[block_bytes];
  // Highest address first, so that LIFO hands out the slab from its start.
  for (std::size_t i = slab.blocks; i-- > 0;) cache.push_back(static_cast<char*>(base) + i * block_bytes);
  stats_.pinned_bytes += slab_bytes;
  stats_.peak_pinned_bytes = std::max(stats_.peak_pinned_bytes, stats_.pinned_bytes);
  stats_.slabs += 1;
  stats_.slab_allocations += 1;
  return true;
}

std::map<std::uintptr_t, PinnedPool::Slab>::iterator PinnedPool::slab_of(const void* ptr) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = slabs_.upper_bound(addr);
  if (it == slabs_.begin()) return slabs_.end();
  --it;
  return addr < it->first + it->second.bytes ? it : slabs_.end();
}

void PinnedPool::free_slab(std::map<std::uintptr_t, Slab>::iterator it) {
  const std::uintptr_t base = it->first;
  const Slab slab = it->second;
  auto& cache = free_blocks_[slab.block_bytes];
  cache.erase(std::remove_if(cache.begin(), cache.end(),
                             [&](void* p) {
                               const auto a = reinterpret_cast<std::uintptr_t>(p);
                               return a >= base && a < base + slab.bytes;
                             }),
              cache.end());
  slabs_.erase(it);
  stats_.pinned_bytes -= slab.bytes;
  stats_.slabs -= 1;
  stats_.slab_frees += 1;
  MK_CUDA_CHECK(api().cudaFreeHost(reinterpret_cast<void*>(base)), "cudaFreeHost");
}

std::size_t PinnedPool::trim() {
  std::size_t freed = 0;
  for (auto it = slabs_.begin(); it != slabs_.end();) {
    auto next = std::next(it);
    if (it->second.in_use == 0) {
      freed += it->second.bytes;
      free_slab(it);
    }
    it = next;
  }
  return freed;
}

bool PinnedPool::has_cached(std::size_t nbytes) const {
  auto it = free_blocks_.find(class_size(nbytes));
  return it != free_blocks_.end() && !it->second.empty();
}

void PinnedPool::abandon() {
  slabs_.clear();
  free_blocks_.clear();
  stats_.pinned_bytes = stats_.bytes_in_use = stats_.slabs = 0;
}

void PinnedPool::release_all() {
  MK_ASSERT(stats_.bytes_in_use == 0, "releasing the pinned pool while blocks are in use");
  trim();
}

}  // namespace cuda
}  // namespace mk
