// The two things the pool asks of the outside world: segments of device memory
// (an Upstream) and stream-ordered completion (an EventSource). The pool never
// names CUDA; csrc/cuda/ implements these over the CUDA function table (real
// or simulated), and virtual_upstream.hpp implements them over plain numbers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/check.hpp"

namespace mk::core {

// A stream as the pool sees it: an opaque handle (cudaStream_t cast to an integer).
using StreamId = std::uint64_t;
// An event handle owned by an EventSource.
using EventId = std::uint64_t;

// Hands out and takes back whole segments (classic) and, if it has virtual
// memory (page_size() != 0), address ranges with physical pages mapped into
// them on demand (expandable segments, Segment::Kind::expandable).
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

  // Virtual memory. The mapping granularity of `device` in bytes; 0: no
  // virtual-memory support (the calls below then throw).
  virtual std::size_t page_size(int /*device*/) { return 0; }
  // An address range of `bytes` (a multiple of page_size) with nothing mapped,
  // or 0 if the device has no address space left.
  virtual std::uintptr_t reserve_range(int /*device*/, std::size_t /*bytes*/) { no_vmm(); }
  // Gives back a range reserve_range returned; nothing in it may be mapped.
  virtual void release_range(int /*device*/, std::uintptr_t /*base*/, std::size_t /*bytes*/) { no_vmm(); }
  // Maps fresh physical pages over [address, address + bytes) inside a reserved
  // range (page-aligned). False, with nothing mapped, if the device is out of memory.
  virtual bool map(int /*device*/, std::uintptr_t /*address*/, std::size_t /*bytes*/) { no_vmm(); }
  // Unmaps pages mapped by map(); the range may span several map() calls or part
  // of one. Does not wait for the device: the caller makes sure no queued work
  // still uses the pages.
  virtual void unmap(int /*device*/, std::uintptr_t /*address*/, std::size_t /*bytes*/) { no_vmm(); }

 private:
  [[noreturn]] void no_vmm() const {
    throw user_error("upstream '" + name() + "' has no virtual-memory support: expandable segments need one");
  }
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
