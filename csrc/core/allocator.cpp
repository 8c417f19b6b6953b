#include "core/allocator.hpp"

#include <chrono>
#include <string>

#include "common/check.hpp"

namespace mk::core {

Allocator::Allocator(PoolConfig config, std::shared_ptr<Upstream> upstream, std::shared_ptr<EventSource> events)
    : config_(config), upstream_(std::move(upstream)), events_(std::move(events)) {
  MK_EXPECTS(upstream_ != nullptr, "Allocator needs an upstream");
  config_.validate();
}

Allocator::~Allocator() {
  for (auto& slot : pools_) delete slot.load();
}

DevicePool& Allocator::pool(int device) {
  MK_EXPECTS(device >= 0 && device < kMaxDevices,
             "device must be in [0, " + std::to_string(kMaxDevices) + "), got " + std::to_string(device));
  DevicePool* existing = pools_[device].load(std::memory_order_acquire);
  if (existing != nullptr) return *existing;
  std::lock_guard<std::mutex> lock(create_mutex_);
  existing = pools_[device].load(std::memory_order_relaxed);
  if (existing == nullptr) {
    existing = new DevicePool(device, config_, upstream_.get(), events_.get());
    pools_[device].store(existing, std::memory_order_release);
  }
  return *existing;
}

DevicePool* Allocator::find(int device) const {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return pools_[device].load(std::memory_order_acquire);
}

ReplayResult replay(DevicePool& pool, const std::vector<ReplayOp>& ops, std::size_t num_slots) {
  std::vector<std::uintptr_t> slots(num_slots, 0);
  ReplayResult result;
  auto start = std::chrono::steady_clock::now();
  for (const ReplayOp& op : ops) {
    MK_EXPECTS(op.slot < num_slots, "replay: slot " + std::to_string(op.slot) + " out of range");
    if (op.is_alloc) {
      try {
        slots[op.slot] = pool.malloc(op.size, op.stream);
      } catch (const out_of_memory&) {
        slots[op.slot] = 0;
        if (result.failed_allocs++ == 0) result.first_failed_op = result.ops;
      }
    } else if (slots[op.slot] != 0) {
      pool.free(slots[op.slot]);
      slots[op.slot] = 0;
    }
    ++result.ops;
  }
  auto stop = std::chrono::steady_clock::now();
  result.elapsed_ns = double(std::chrono::duration_cast<std::chrono::nanoseconds>(stop - start).count());
  return result;
}

}  // namespace mk::core
