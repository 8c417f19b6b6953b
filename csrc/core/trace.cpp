#include "core/trace.hpp"

#include <chrono>

namespace mk::core {

const char* trace_action_name(TraceAction action) {
  switch (action) {
    case TraceAction::alloc: return "alloc";
    case TraceAction::free_requested: return "free_requested";
    case TraceAction::free_completed: return "free_completed";
    case TraceAction::segment_alloc: return "segment_alloc";
    case TraceAction::segment_free: return "segment_free";
    case TraceAction::segment_map: return "segment_map";
    case TraceAction::segment_unmap: return "segment_unmap";
    case TraceAction::oom: return "oom";
  }
  return "unknown";
}

void TraceRing::set_capacity(std::size_t capacity) {
  entries_.assign(capacity, TraceEntry{});
  next_ = count_ = 0;
}

void TraceRing::record(TraceAction action, std::uintptr_t addr, std::size_t size, StreamId stream,
                       std::size_t device_free) {
  if (entries_.empty()) return;
  auto now = std::chrono::system_clock::now().time_since_epoch();
  std::int64_t time_us = std::chrono::duration_cast<std::chrono::microseconds>(now).count();
  entries_[next_] = TraceEntry{action, addr, size, stream, time_us, device_free};
  next_ = (next_ + 1) % entries_.size();
  if (count_ < entries_.size()) ++count_;
}

std::vector<TraceEntry> TraceRing::entries() const {
  std::vector<TraceEntry> out;
  out.reserve(count_);
  std::size_t start = (next_ + entries_.size() - count_) % (entries_.empty() ? 1 : entries_.size());
  for (std::size_t i = 0; i < count_; ++i) out.push_back(entries_[(start + i) % entries_.size()]);
  return out;
}

}  // namespace mk::core
