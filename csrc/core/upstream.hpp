// The two things the pool asks of the outside world: segments of device memory
// (an Upstream) and stream-ordered completion (an EventSource). The pool never
// names CUDA; csrc/cuda/ implements these over the CUDA function table (real
// or simulated), and virtual_upstream.hpp implements them over plain numbers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mk::core {

// A stream as the pool sees it: an opaque handle (cudaStream_t cast to an integer).
using StreamId = std::uint64_t;
// An event handle owned by an EventSource.
using EventId = std::uint64_t;

// Hands out and takes back whole segments. Classic segments only for now; a VMM
// upstream (expandable segments, issue 8) adds reserve/map/unmap next to these
// and a Segment::Kind::expandable that the pool grows in place.
class Upstream {
 public:
  virtual ~Upstream() = default;
  // A segment of exactly `bytes` on `device`, or 0 if the device refuses (out of
  // memory). Other failures throw.
  virtual std::uintptr_t allocate(int device, std::size_t bytes) = 0;
  virtual void deallocate(int device, std::uintptr_t address, std::size_t bytes) = 0;
  // Total memory of `device` in bytes (what a fractional memory cap is a fraction of).
  virtual std::size_t total_memory(int device) = 0;
  virtual std::string name() const = 0;
};

// Events recorded on a stream; complete when the work queued before them has run.
class EventSource {
 public:
  virtual ~EventSource() = default;
  virtual EventId record(int device, StreamId stream) = 0;
  // True once complete. Never blocks.
  virtual bool query(EventId event) = 0;
  // Blocks until complete.
  virtual void synchronize(EventId event) = 0;
  virtual void destroy(EventId event) = 0;
};

}  // namespace mk::core
