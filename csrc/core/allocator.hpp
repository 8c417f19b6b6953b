// Per-device pools behind one configuration, an upstream and an event source.
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>

#include "core/pool.hpp"

namespace mk::core {

class Allocator {
 public:
  static constexpr int kMaxDevices = 64;

  Allocator(PoolConfig config, std::shared_ptr<Upstream> upstream, std::shared_ptr<EventSource> events);
  ~Allocator();

  // The pool of `device`, created on first use.
  DevicePool& pool(int device);
  // The pool if it exists, else null (stats of a device never used).
  DevicePool* find(int device) const;
  const PoolConfig& config() const { return config_; }

 private:
  PoolConfig config_;
  std::shared_ptr<Upstream> upstream_;
  std::shared_ptr<EventSource> events_;
  std::mutex create_mutex_;
  std::array<std::atomic<DevicePool*>, kMaxDevices> pools_{};
};

// One step of a recorded trace, with addresses already turned into slot numbers.
struct ReplayOp {
  std::uint32_t slot;
  bool is_alloc;
  std::size_t size;
  StreamId stream;
};

struct ReplayResult {
  std::int64_t ops = 0;
  std::int64_t failed_allocs = 0;
  std::int64_t first_failed_op = -1;  // index into ops of the first failed allocation; -1: none failed
  double elapsed_ns = 0.0;
};

// Runs `ops` through `pool`, timing only the pool calls' loop. An allocation the
// pool cannot satisfy is counted in failed_allocs and its later free skipped.
ReplayResult replay(DevicePool& pool, const std::vector<ReplayOp>& ops, std::size_t num_slots);

}  // namespace mk::core
