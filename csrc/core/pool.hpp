// One device's caching pool: free lists, best fit, split/coalesce, stream-ordered
// reuse, OOM release-and-retry, memory cap, reserve, GC threshold, statistics,
// trace. RMM-style: it owns the blocks; where segments come from (Upstream) and
// when other streams are done with memory (EventSource) are asked of others.
//
// Stream-ordered reuse. A block freed on stream S goes back to S's free list at
// once (S's later work is ordered after the free). An event is recorded on S at
// free time; once it completes the block is free for every stream. (While the
// pool has seen a single stream no event is recorded: nobody else could use
// the block, and on a GPU that saves a cudaEventRecord per free.) A block used
// on other streams (record_stream) is not reusable by anyone until events
// recorded at free time on S and on each of those streams have completed.
// Without an EventSource blocks stay with their stream, as in PyTorch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/policy.hpp"
#include "core/stats.hpp"
#include "core/trace.hpp"
#include "core/upstream.hpp"

namespace mk::core {

struct PoolConfig {
  Policy policy;
  std::size_t memory_cap_bytes = 0;   // 0: no cap
  double memory_cap_fraction = 0.0;   // of Upstream::total_memory; 0: no cap
  double gc_threshold = 0.0;          // fraction of the cap (or device memory); 0: off
  std::size_t trace_capacity = 0;     // ring-buffer entries; 0: tracing off
  // Expandable segments (needs an upstream with virtual memory): one address
  // range per (stream, pool), physical pages mapped on demand; see pool.cpp.
  bool expandable_segments = false;
  std::size_t expandable_range_bytes = 0;  // address range per segment; 0: the device's memory

  void validate() const;
};

enum class BlockState : std::uint8_t {
  allocated,
  free_stream,  // free, reusable by its stream only (event pending or no event source)
  free_any,     // free, reusable by every stream
  waiting,      // freed by the caller, still in use on other streams (record_stream)
  unmapped,     // expandable segments: address space with no physical pages behind it
};

struct Segment;

struct Block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;
  Segment* segment = nullptr;
  Block* prev = nullptr;  // neighbours in the segment, by address
  Block* next = nullptr;
  StreamId stream = 0;     // allocation stream; for free_stream, the stream it may serve
  BlockState state = BlockState::free_any;
  std::uint32_t pending_events = 0;  // waiting: events still outstanding
  std::uint64_t event_seq = 0;       // free_stream: order of its event on its stream
  std::uint64_t generation = 0;      // bumps whenever an event entry for it goes stale
  std::vector<StreamId> uses;        // record_stream streams other than `stream`
};

struct Segment {
  // classic: one device allocation of `size` bytes. expandable: an address range
  // of `size` bytes of which `mapped` have physical pages (blocks tile the range;
  // the unmapped ones are BlockState::unmapped).
  enum class Kind : std::uint8_t { classic, expandable };
  std::uintptr_t base = 0;
  std::size_t size = 0;
  std::size_t mapped = 0;
  PoolKind pool = PoolKind::large;
  Kind kind = Kind::classic;
  StreamId stream = 0;
  bool kept = false;  // reserve(): survives empty_cache and GC
  std::uint64_t last_used = 0;
  Block* head = nullptr;
};

struct BlockInfo {
  std::uintptr_t address;
  std::size_t size;
  std::size_t requested;
  BlockState state;
};

struct SegmentInfo {
  std::uintptr_t address;
  std::size_t total_size;
  std::size_t allocated_size;
  std::size_t active_size;
  std::size_t requested_size;
  StreamId stream;
  PoolKind pool;
  bool kept;
  bool expandable;  // one contiguous mapped run of an expandable segment
  std::vector<BlockInfo> blocks;
};

class DevicePool {
 public:
  DevicePool(int device, PoolConfig config, Upstream* upstream, EventSource* events);
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  // 0 for a zero-byte request. Throws out_of_memory after release-and-retry fails.
  std::uintptr_t malloc(std::size_t bytes, StreamId stream);
  // False (and nothing changes) if `addr` is not a live allocation of this pool.
  bool free(std::uintptr_t addr);
  // `addr` is also used on `stream`: it is not reused until that stream's work
  // queued before the free has completed.
  void record_stream(std::uintptr_t addr, StreamId stream);

  void empty_cache();
  void reserve(std::size_t bytes, StreamId stream);
  void release_reserved();  // reserve()d segments become ordinary cache again
  void set_memory_cap(std::size_t bytes, double fraction);
  void set_trace_capacity(std::size_t entries);
  void reset_peak_stats();
  // The caller's loop ended a step (a training loop: the optimizer's step). While the next step's
  // requests repeat this one's, it runs as a repeating loop; see pool.cpp, "Repeating loops".
  void end_step();

  DeviceStats stats();
  std::vector<SegmentInfo> segments();
  std::vector<TraceEntry> trace();
  // Recounts everything from the blocks and throws logic_error on any mismatch.
  void check_invariants();

  int device() const { return device_; }

 private:
  struct BySizeAddr {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->addr < b->addr;
    }
  };
  using FreeSet = std::set<Block*, BySizeAddr>;
  struct PendingEvent {
    EventId event;
    Block* block;
    std::uint64_t generation;
  };
  struct StreamQueue {
    StreamId stream;
    std::deque<PendingEvent> events;  // recording order == completion order
  };
  struct ByAddr {
    bool operator()(const Block* a, const Block* b) const { return a->addr < b->addr; }
  };
  struct GrowthPlan {
    Segment* segment = nullptr;  // null: reserve a new range
    Block* gap = nullptr;        // the unmapped block the pages go into
    std::size_t bytes = 0;       // to map (whole pages)
    const Block* joins = nullptr;  // the free block the new pages extend
  };
  struct FreeLists {
    FreeSet any;
    std::vector<std::pair<StreamId, FreeSet>> by_stream;
  };

  FreeSet& stream_set(PoolKind pool, StreamId stream);
  FreeSet* set_of(Block* block);
  void insert_free(Block* block);
  void erase_free(Block* block);
  Block* find_free(PoolKind pool, StreamId stream, std::size_t rounded);
  Block* new_segment_block(PoolKind pool, StreamId stream, std::size_t rounded, std::size_t requested);
  Block* device_alloc(PoolKind pool, StreamId stream, std::size_t bytes);
  std::size_t cap_bytes() const;
  bool releasable(const Block* block) const;
  void release_segment(Block* block);
  std::size_t release_cached(std::size_t stop_below = 0, bool oldest_first = false);
  // Before growth past the high-water mark: whole free segments worth at least
  // `bytes`, as few as possible (policy.hpp, rule 2). Returns how many.
  std::size_t release_idle(std::size_t bytes);
  void free_block(Block* block);
  void retire(Block* block);  // no stream uses it any more: stats and trace
  Block* merge_and_insert(Block* block);  // returns the merged block
  static bool mergeable(const Block* a, const Block* b);
  void process_events(bool wait);
  void record_event(Block* block, StreamId stream);
  void note_stream(StreamId stream);
  void complete(Block* block);
  Block* new_block();
  // A new segment [base, base + bytes) of `kind`, owned by segments_, as one block in `state`.
  Segment* add_segment(std::uintptr_t base, std::size_t bytes, PoolKind pool, StreamId stream, Segment::Kind kind,
                       BlockState state);
  void recycle(Block* block);
  void add(PoolKind pool, Stat PoolStats::*field, std::int64_t n);
  void sub(PoolKind pool, Stat PoolStats::*field, std::int64_t n);
  std::string oom_message(std::size_t requested, std::size_t segment_bytes);
  [[noreturn]] void fail_oom(std::size_t requested, StreamId stream, std::size_t segment_bytes);
  // Expandable segments.
  Block* grow_block(PoolKind pool, StreamId stream, std::size_t rounded, std::size_t requested);
  GrowthPlan plan_growth(PoolKind pool, StreamId stream, std::size_t rounded);
  Block* map_growth(GrowthPlan plan, PoolKind pool, StreamId stream);
  Segment* new_range(PoolKind pool, StreamId stream, std::size_t min_bytes);
  void release_range(Segment* segment);
  bool unmappable(const Block* block) const;
  std::size_t whole_pages(const Block* block) const;
  std::size_t unmap_pages(Block* block);
  std::size_t unmap_free_pages(std::size_t target, const Block* keep);
  std::size_t release_expandable();
  DeviceStats stats_locked();

  const int device_;
  PoolConfig config_;
  Upstream* upstream_;
  EventSource* events_;  // may be null: no cross-stream reuse
  std::mutex mutex_;

  FreeLists free_[kNumPools];
  std::unordered_map<std::uintptr_t, Block*> allocated_;
  std::map<std::uintptr_t, std::unique_ptr<Segment>> segments_;
  std::vector<StreamQueue> queues_;
  std::vector<StreamId> streams_seen_;  // every stream that allocated or used a block
  std::vector<std::unique_ptr<Block>> block_storage_;  // blocks live as long as the pool
  std::vector<Block*> spare_blocks_;
  std::set<Block*, ByAddr> unmapped_;  // unmapped blocks of every expandable segment
  std::vector<Segment*> expandable_;
  std::size_t page_ = 0;  // expandable segments: the upstream's mapping granularity
  DeviceStats stats_;
  std::size_t idle_bytes_ = 0;   // bytes in whole free segments that may be released
  std::int64_t high_water_ = 0;  // reserved-bytes peak, unaffected by reset_peak_stats
  // Repeating loops (pool.cpp): the request sizes of the last step and of this one, in order.
  static constexpr std::size_t kStepRecordLimit = std::size_t(1) << 19;
  std::vector<std::size_t> last_step_requests_, this_step_requests_;
  std::size_t match_from_ = 0;  // this step's requests so far are a subsequence of last_step_requests_[0, match_from_)
  bool repeating_ = false;      // ... and this step runs under the repeating-loop rules
  std::uint64_t tick_ = 0;
  std::uint64_t event_seq_ = 0;
  TraceRing trace_;
};

}  // namespace mk::core
