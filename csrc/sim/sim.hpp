// The simulated CUDA device: an in-process implementation of mk::cuda::Api.
//
// Code under test calls mk::cuda::api() exactly as on a GPU; with the sim
// selected (MEMKERNELS_DEVICE=sim, or mk::cuda::select_backend(Backend::sim)
// before first use) the calls land here. Tests steer the sim through the
// control functions below (bound to Python as memkernels.device.sim).
//
// Memory
//   backed   device and pinned-host allocations are real host memory; async
//            copies really copy. cudaMalloc/cudaHostAlloc use the C heap (so
//            ASan sees overruns); VMM maps a memfd per physical handle into a
//            PROT_NONE reservation, so unmapped VMM memory faults on access.
//            Host code (tests, pool invariant checks) may read and write
//            backed device memory directly through its pointer.
//   virtual  addresses only: every device and pinned-host allocation is a
//            range in one PROT_NONE reservation of `address_space` bytes;
//            nothing is ever touched (dereferencing faults) and copies are
//            bookkeeping. An 80 GB trace replays on a small machine.
// Copies are validated when enqueued (cudaErrorInvalidValue if a device-side
// range is not inside live, accessible device memory) and again when the
// stream executes them; a range freed in between is an asynchronous error:
// cudaErrorIllegalAddress / CUDA_ERROR_ILLEGAL_ADDRESS from every later
// call until reset(), as with a corrupted CUDA context.
// Host pointers the sim did not allocate are pageable memory and unchecked.
//
// Streams and events
//   Each stream has a worker thread that runs its copies, event records and
//   waits in order. Stream 0, cudaStreamLegacy and cudaStreamPerThread are
//   the current device's default stream, treated as an ordinary stream (the
//   legacy default stream's implicit synchronisation is not modelled).
//   Priorities are accepted and clamped to the reported range, not used.
//   cudaEventQuery/Synchronize and cudaStreamWaitEvent refer to the most
//   recent record at the time of the call; a never-recorded event is complete.
//   cudaFree/cudaFreeHost synchronise the device first, like CUDA's.
//   Blocking calls give up after `sync_timeout_s` with cudaErrorLaunchTimeout
//   (instead of hanging a test whose events are held with nobody to release).
//
// VMM (driver API)
//   Sizes and offsets must be multiples of `granularity`. The sim is stricter
//   than CUDA where misuse would be silent there: mapping over a mapped range
//   is CUDA_ERROR_ALREADY_MAPPED; unmapping an unmapped range is
//   CUDA_ERROR_NOT_MAPPED; an unmap must cover whole mappings
//   (CUDA_ERROR_INVALID_VALUE otherwise); freeing a reservation that still
//   has mappings is CUDA_ERROR_INVALID_VALUE. Physical memory counts against
//   capacity from cuMemCreate until it is both released and unmapped.
//
// Fault injection
//   capacity           per-device byte cap: cudaMalloc -> cudaErrorMemoryAllocation,
//                      cuMemCreate -> CUDA_ERROR_OUT_OF_MEMORY.
//   fail_allocations   the Nth device allocation request from now (cudaMalloc
//                      or cuMemCreate, counting from 1) and the `count`-1 after
//                      it fail with the out-of-memory code.
//   hold_events        while on, every event recorded stalls its stream at the
//                      record until release_events(): the event and everything
//                      after it on that stream stay incomplete.
//   random delays      before each stream operation the worker sleeps a
//                      uniformly random 0..max_delay_us drawn from a seeded
//                      generator, to shake out ordering assumptions.
//
// Modelled time
//   A virtual timeline, computed on the calling thread when work is enqueued
//   (never from the workers' real timing), so it is the same however loaded
//   the machine is and whatever the random delays. Clocks are in seconds and
//   start at 0. Each stream has a clock (when all work enqueued on it so far
//   completes), each event the time of its latest record, the host one clock
//   (the sim does not tell host threads apart).
//   - Work enqueued on a stream starts at max(stream clock, host clock): the
//     host issues it then.
//   - cudaMemcpyAsync takes bytes / link_bandwidth, except device-to-device
//     copies, which take 0; with link_bandwidth 0 (the default) every copy
//     takes 0. Pageable memory counts as host memory. Each stream is its own
//     timeline: copies on different streams do not share the link.
//   - run_kernel(seconds) occupies a stream for that long, enqueueing nothing
//     (a stand-in for a kernel on the compute stream).
//   - cudaEventRecord sets the event's time to the record's start;
//     cudaStreamWaitEvent moves the stream's clock up to the event's time.
//   - Blocking calls move the host clock up to what they waited for:
//     cudaStreamSynchronize (the stream), cudaEventSynchronize (the event),
//     cudaDeviceSynchronize (the current device's work, destroyed streams'
//     included), and cudaFree/cudaFreeHost (all devices' work). Queries move
//     no clock.
//
// All functions here are thread-safe. reset()/configure() invalidate every
// handle and pointer the sim gave out; do not race them with device calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cuda/api.hpp"

namespace mk {
namespace sim {

enum class Memory { backed, virtual_only };

struct Config {
  int device_count = 1;
  std::size_t capacity = std::size_t(16) << 30;          // per device, bytes
  std::size_t host_capacity = SIZE_MAX;                   // pinned host bytes
  std::size_t granularity = std::size_t(2) << 20;        // VMM granularity
  Memory memory = Memory::backed;
  std::size_t address_space = std::size_t(1) << 38;      // virtual / VMM reservation arena (256 GiB)
  double sync_timeout_s = 10.0;
};

struct DeviceStats {
  std::size_t bytes_in_use = 0;   // cudaMalloc + live cuMemCreate handles
  std::size_t peak_bytes = 0;     // since reset() / reset_peak()
  std::size_t allocations = 0;    // live cudaMalloc blocks + physical handles
};

struct Stats {
  std::vector<DeviceStats> devices;
  std::size_t host_bytes_in_use = 0;
  std::size_t host_peak_bytes = 0;
  std::size_t reserved_bytes = 0;   // live cuMemAddressReserve ranges
  std::size_t mapped_bytes = 0;     // live cuMemMap ranges
  std::size_t bytes_copied = 0;     // by executed cudaMemcpyAsync (virtual: counted, not moved)
  double modelled_link_seconds = 0; // sum of enqueued copies' modelled durations
  std::size_t injected_failures = 0;
  std::size_t async_errors = 0;
  std::size_t held_events = 0;      // records currently stalled by hold_events
  int live_streams = 0;             // created, not destroyed (default streams excluded)
  int live_events = 0;
};

// The sim's function table (what api() returns when the sim is selected).
const cuda::Api& table();

// Replace the configuration; implies reset(). Throws mk::user_error for
// invalid values, naming the field.
void configure(const Config& config);
Config config();

// Drop all state: stop stream workers (abandoning queued work), free all
// memory, clear counters, statistics, fault injection and sticky errors.
void reset();

void set_capacity(std::size_t bytes);  // may shrink below use: later allocations fail
void fail_allocations(std::uint64_t nth, std::uint64_t count = 1);
void hold_events(bool on);             // turning it off also releases what is held
std::size_t release_events();          // returns how many held records it released
void set_random_delays(std::uint64_t max_delay_us, std::uint64_t seed);  // 0 turns off

// Modelled time (see above); reset() zeroes every clock and the bandwidth.
// Throw mk::user_error for negative or non-finite values and for a stream
// handle that is not live; stream 0 is the current device's default stream.
void set_link_bandwidth(double bytes_per_second);  // 0: copies take no modelled time
void run_kernel(double seconds, std::uintptr_t stream = 0);
double clock(std::uintptr_t stream = 0);           // when the stream's enqueued work completes
double host_clock();

Stats stats();
void reset_peak();
std::map<std::string, std::uint64_t> counters();  // API name -> calls (zero entries omitted)

// Is [ptr, ptr + bytes) live, accessible device memory (cudaMalloc or mapped
// VMM with access set)? For tests and for checking pool invariants.
bool is_device_memory(std::uintptr_t ptr, std::size_t bytes);

}  // namespace sim
}  // namespace mk
