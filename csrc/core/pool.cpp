#include "core/pool.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/check.hpp"

namespace mk::core {

namespace {

std::string format_bytes(std::int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = double(bytes);
  int unit = 0;
  while (std::fabs(value) >= 1024.0 && unit < 4) value /= 1024.0, ++unit;
  char text[48];
  std::snprintf(text, sizeof text, "%.*f %s", unit == 0 ? 0 : 2, value, units[unit]);
  return text;
}

std::size_t round_up(std::size_t n, std::size_t unit) { return (n + unit - 1) / unit * unit; }

int histogram_bucket(std::size_t size) {
  int bucket = 0;
  while (size > 1 && bucket < kHistogramBuckets - 1) size >>= 1, ++bucket;
  return bucket;
}

}  // namespace

void PoolConfig::validate() const {
  policy.validate();
  MK_EXPECTS(memory_cap_fraction >= 0.0 && memory_cap_fraction <= 1.0,
             "memory_cap_fraction must be in [0, 1] (0 disables the cap), got " +
                 std::to_string(memory_cap_fraction));
  MK_EXPECTS(gc_threshold >= 0.0 && gc_threshold <= 1.0,
             "gc_threshold must be in [0, 1] (0 disables garbage collection), got " + std::to_string(gc_threshold));
}

DevicePool::DevicePool(int device, PoolConfig config, Upstream* upstream, EventSource* events)
    : device_(device), config_(config), upstream_(upstream), events_(events) {
  MK_EXPECTS(upstream != nullptr, "DevicePool needs an upstream");
  config_.validate();
  trace_.set_capacity(config_.trace_capacity);
  allocated_.reserve(1024);
  if (config_.expandable_segments) {
    page_ = upstream_->page_size(device_);
    MK_EXPECTS(page_ != 0, "expandable_segments=True needs virtual memory, which upstream '" + upstream_->name() +
                               "' does not have; use expandable_segments=False");
    MK_EXPECTS(config_.expandable_range_bytes % page_ == 0,
               "expandable_range_bytes must be a multiple of the device's page size (" + std::to_string(page_) +
                   " bytes), got " + std::to_string(config_.expandable_range_bytes));
  }
}

DevicePool::~DevicePool() {
  // Events still queued belong to us; segments go back to the upstream. A
  // destructor must not throw: a failure here (e.g. the device was reset under
  // us) is reported and the rest is still returned.
  for (auto& queue : queues_)
    for (auto& pending : queue.events) {
      try {
        events_->destroy(pending.event);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "memkernels: pool on device %d: destroying an event: %s\n", device_, e.what());
      }
    }
  for (auto& entry : segments_) {
    try {
      Segment& segment = *entry.second;
      if (segment.kind == Segment::Kind::classic) {
        upstream_->deallocate(device_, segment.base, segment.size);
        continue;
      }
      // Unmap every mapped run, then give the address range back.
      for (Block* b = segment.head; b != nullptr;) {
        if (b->state == BlockState::unmapped) {
          b = b->next;
          continue;
        }
        std::uintptr_t start = b->addr;
        while (b != nullptr && b->state != BlockState::unmapped) b = b->next;
        std::uintptr_t end = b != nullptr ? b->addr : segment.base + segment.size;
        upstream_->unmap(device_, start, end - start);
      }
      upstream_->release_range(device_, segment.base, segment.size);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "memkernels: pool on device %d: releasing a segment: %s\n", device_, e.what());
    }
  }
}

// ---------------------------------------------------------------- block storage

Block* DevicePool::new_block() {
  if (spare_blocks_.empty()) {
    block_storage_.push_back(std::make_unique<Block>());
    return block_storage_.back().get();
  }
  Block* block = spare_blocks_.back();
  spare_blocks_.pop_back();
  return block;
}

void DevicePool::recycle(Block* block) {
  // Keep the generation rising across reuse: queued events may still point here.
  std::uint64_t generation = block->generation + 1;
  *block = Block{};
  block->generation = generation;
  spare_blocks_.push_back(block);
}

// ---------------------------------------------------------------- statistics

void DevicePool::add(PoolKind pool, Stat PoolStats::*field, std::int64_t n) {
  (stats_.pools[int(pool)].*field).add(n);
  (stats_.total.*field).add(n);
}

void DevicePool::sub(PoolKind pool, Stat PoolStats::*field, std::int64_t n) {
  (stats_.pools[int(pool)].*field).sub(n);
  (stats_.total.*field).sub(n);
}

// ---------------------------------------------------------------- free lists

DevicePool::FreeSet& DevicePool::stream_set(PoolKind pool, StreamId stream) {
  auto& lists = free_[int(pool)].by_stream;
  for (auto& entry : lists)
    if (entry.first == stream) return entry.second;
  lists.emplace_back(stream, FreeSet{});
  return lists.back().second;
}

DevicePool::FreeSet* DevicePool::set_of(Block* block) {
  PoolKind pool = block->segment->pool;
  if (block->state == BlockState::free_any) return &free_[int(pool)].any;
  if (block->state == BlockState::free_stream) return &stream_set(pool, block->stream);
  return nullptr;
}

void DevicePool::insert_free(Block* block) {
  FreeSet* set = set_of(block);
  MK_ASSERT(set != nullptr, "inserting a block that is not free");
  set->insert(block);
  if (releasable(block)) idle_bytes_ += block->size;
}

void DevicePool::erase_free(Block* block) {
  FreeSet* set = set_of(block);
  MK_ASSERT(set != nullptr && set->erase(block) == 1, "free block missing from its free list");
  if (releasable(block)) idle_bytes_ -= block->size;
}

Block* DevicePool::find_free(PoolKind pool, StreamId stream, std::size_t rounded) {
  // Best fit over this stream's blocks and the blocks every stream may use:
  // smallest size, then lowest address.
  Block key;
  key.size = rounded;
  key.addr = 0;
  Block* best = nullptr;
  // The oversize rule guards classic segments' tails; an expandable block's tail is unmapped instead.
  std::size_t largest = pool == PoolKind::large && !config_.expandable_segments
                            ? config_.policy.largest_block_for(rounded)
                            : SIZE_MAX;
  // Expandable: as PyTorch's get_free_block, a block counts as the size it can grow to (itself
  // and the unmapped space after it); from the smallest that fits, move on while the next one
  // can grow to less. Blocks at the mapped frontier stay free to extend.
  auto growable = [](const Block* b) {
    return b->size + (b->next != nullptr && b->next->state == BlockState::unmapped ? b->next->size : 0);
  };
  auto consider = [&](FreeSet& set) {
    auto it = set.lower_bound(&key);
    if (it != set.end() && config_.expandable_segments)
      for (auto next = std::next(it); next != set.end() && growable(*next) < growable(*it); ++next) it = next;
    if (it != set.end() && (*it)->size <= largest && (best == nullptr || BySizeAddr{}(*it, best))) best = *it;
  };
  auto consider_all = [&] {
    for (auto& entry : free_[int(pool)].by_stream)
      if (entry.first == stream) consider(entry.second);
    if (events_ != nullptr) consider(free_[int(pool)].any);
  };
  consider_all();
  // In a repeating loop the oversize rule yields rather than ask for a new segment: the request
  // then carves the large block the same way every step, where a new segment would be released
  // and allocated again (see "Repeating loops").
  if (best == nullptr && repeating_ && largest != SIZE_MAX) {
    largest = SIZE_MAX;
    consider_all();
  }
  return best;
}

// ---------------------------------------------------------------- segments

std::size_t DevicePool::cap_bytes() const {
  std::size_t cap = config_.memory_cap_bytes;
  if (config_.memory_cap_fraction > 0.0) {
    auto by_fraction = std::size_t(config_.memory_cap_fraction * double(upstream_->total_memory(device_)));
    cap = cap == 0 ? by_fraction : std::min(cap, by_fraction);
  }
  return cap;
}

Segment* DevicePool::add_segment(std::uintptr_t base, std::size_t bytes, PoolKind pool, StreamId stream,
                                 Segment::Kind kind, BlockState state) {
  auto segment = std::make_unique<Segment>();
  segment->base = base;
  segment->size = bytes;
  segment->pool = pool;
  segment->kind = kind;
  segment->stream = stream;
  segment->last_used = tick_;
  Block* block = new_block();
  block->addr = base;
  block->size = bytes;
  block->segment = segment.get();
  block->stream = stream;
  block->state = state;
  segment->head = block;
  Segment* raw = segment.get();
  segments_.emplace(base, std::move(segment));
  return raw;
}

Block* DevicePool::device_alloc(PoolKind pool, StreamId stream, std::size_t bytes) {
  std::size_t cap = cap_bytes();
  if (cap != 0 && std::size_t(stats_.total.reserved_bytes.current) + bytes > cap) return nullptr;
  std::uintptr_t base = upstream_->allocate(device_, bytes);
  if (base == 0) return nullptr;
  Block* block = add_segment(base, bytes, pool, stream, Segment::Kind::classic,
                             events_ != nullptr ? BlockState::free_any : BlockState::free_stream)->head;
  ++stats_.num_device_alloc;
  add(pool, &PoolStats::reserved_bytes, std::int64_t(bytes));
  add(pool, &PoolStats::segment_count, 1);
  high_water_ = std::max(high_water_, stats_.total.reserved_bytes.current);
  trace_.record(TraceAction::segment_alloc, base, bytes, stream);
  return block;
}

bool DevicePool::releasable(const Block* block) const {
  return block->segment->kind == Segment::Kind::classic && block->prev == nullptr && block->next == nullptr && !block->segment->kept &&
         (block->state == BlockState::free_any || block->state == BlockState::free_stream);
}

void DevicePool::release_segment(Block* block) {
  Segment* segment = block->segment;
  erase_free(block);
  // A classic segment's device free waits for the device (cudaFree synchronizes),
  // so work still queued on the block's stream is done before the memory goes.
  upstream_->deallocate(device_, segment->base, segment->size);
  ++stats_.num_device_free;
  sub(segment->pool, &PoolStats::reserved_bytes, std::int64_t(segment->size));
  sub(segment->pool, &PoolStats::segment_count, 1);
  trace_.record(TraceAction::segment_free, segment->base, segment->size, segment->stream);
  recycle(block);
  segments_.erase(segment->base);
}

std::size_t DevicePool::release_cached(std::size_t stop_below, bool oldest_first) {
  std::vector<Segment*> candidates;
  for (auto& entry : segments_)
    if (releasable(entry.second->head)) candidates.push_back(entry.second.get());
  if (oldest_first)
    std::stable_sort(candidates.begin(), candidates.end(),
                     [](const Segment* a, const Segment* b) { return a->last_used < b->last_used; });
  std::size_t released = 0;
  for (Segment* segment : candidates) {
    if (stop_below != 0 && std::size_t(stats_.total.reserved_bytes.current) <= stop_below) break;
    ++released;
    release_segment(segment->head);
  }
  if (stop_below == 0 && !expandable_.empty()) released += release_expandable();
  return released;
}

std::size_t DevicePool::release_idle(std::size_t bytes) {
  std::vector<Segment*> candidates;
  for (auto& entry : segments_)
    if (releasable(entry.second->head)) candidates.push_back(entry.second.get());
  // One segment if one is large enough: the least recently used of those.
  Segment* single = nullptr;
  for (Segment* segment : candidates)
    if (segment->size >= bytes && (single == nullptr || segment->last_used < single->last_used)) single = segment;
  if (single != nullptr) {
    release_segment(single->head);
    return 1;
  }
  // Else the largest first, until enough are gone: the fewest segments for the bytes.
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Segment* a, const Segment* b) { return a->size > b->size; });
  std::size_t released = 0, freed = 0;
  for (Segment* segment : candidates) {
    if (freed >= bytes) break;
    freed += segment->size;
    ++released;
    release_segment(segment->head);
  }
  return released;
}

Block* DevicePool::new_segment_block(PoolKind pool, StreamId stream, std::size_t rounded, std::size_t requested) {
  if (config_.expandable_segments) return grow_block(pool, stream, rounded, requested);
  const Policy& policy = config_.policy;
  std::size_t preferred = policy.segment_size(rounded);
  std::size_t minimal = pool == PoolKind::small
                            ? policy.small_segment
                            : (rounded + policy.segment_granularity - 1) / policy.segment_granularity *
                                  policy.segment_granularity;
  std::int64_t reserved = stats_.total.reserved_bytes.current;

  // Release idle whole segments rather than raise the reserved high-water mark (not in a
  // repeating loop: the loop needs them again within the step).
  if (policy.release_before_growth >= 0.0 && !repeating_ && reserved + std::int64_t(preferred) > high_water_) {
    std::size_t idle = idle_bytes_;
    if (idle > 0 && double(idle) >= policy.release_before_growth * double(reserved + std::int64_t(preferred))) {
      double excess = double(reserved + std::int64_t(preferred) - high_water_) * kReleaseHeadroom;
      stats_.num_early_releases += std::int64_t(release_idle(std::size_t(excess)));
    }
  }
  // Garbage collection: past the threshold, release the least recently used idle segments.
  if (config_.gc_threshold > 0.0) {
    std::size_t cap = cap_bytes();
    std::size_t limit = std::size_t(config_.gc_threshold * double(cap != 0 ? cap : upstream_->total_memory(device_)));
    if (std::size_t(stats_.total.reserved_bytes.current) + preferred > limit)
      stats_.num_gc_releases += std::int64_t(release_cached(limit > preferred ? limit - preferred : 1, true));
  }

  auto attempt = [&]() -> Block* {
    Block* block = device_alloc(pool, stream, preferred);
    if (block == nullptr && minimal < preferred) block = device_alloc(pool, stream, minimal);
    return block;
  };
  Block* block = attempt();
  if (block == nullptr) {
    ++stats_.num_alloc_retries;
    process_events(true);
    release_cached();
    block = attempt();
  }
  if (block == nullptr) fail_oom(requested, stream, minimal);
  return block;
}

void DevicePool::fail_oom(std::size_t requested, StreamId stream, std::size_t segment_bytes) {
  ++stats_.num_ooms;
  std::size_t limit = cap_bytes() != 0 ? cap_bytes() : upstream_->total_memory(device_);
  std::size_t reserved_now = std::size_t(stats_.total.reserved_bytes.current);
  trace_.record(TraceAction::oom, 0, requested, stream, limit > reserved_now ? limit - reserved_now : 0);
  throw out_of_memory(oom_message(requested, segment_bytes));
}

// ---------------------------------------------------------------- expandable segments
//
// Each (stream, pool) grows one address range (a new one only when it is full).
// A request no free block can serve maps the fewest whole pages that make room:
// into the unmapped gap after a free block it extends, or a gap of its own,
// lowest address on ties. Free pages are unmapped only once no stream can
// still be using them (their free-time event completed; cuMemUnmap does not
// wait for the device): before growth would raise the reserved high-water mark
// (just enough of them, largest first), past the GC threshold, and all of them
// on empty_cache() and before an out-of-memory retry.

Block* DevicePool::grow_block(PoolKind pool, StreamId stream, std::size_t rounded, std::size_t requested) {
  auto reserved = [&] { return std::size_t(stats_.total.reserved_bytes.current); };
  GrowthPlan plan = plan_growth(pool, stream, rounded);
  if (config_.policy.release_before_growth >= 0.0 && !repeating_ && reserved() + plan.bytes > std::size_t(high_water_) &&
      unmap_free_pages(reserved() + plan.bytes - std::size_t(high_water_), plan.joins) > 0) {
    ++stats_.num_early_releases;
    plan = plan_growth(pool, stream, rounded);
  }
  if (config_.gc_threshold > 0.0) {
    std::size_t cap = cap_bytes();
    std::size_t limit = std::size_t(config_.gc_threshold * double(cap != 0 ? cap : upstream_->total_memory(device_)));
    if (reserved() + plan.bytes > limit && unmap_free_pages(reserved() + plan.bytes - limit, plan.joins) > 0) {
      ++stats_.num_gc_releases;
      plan = plan_growth(pool, stream, rounded);
    }
  }
  Block* block = map_growth(plan, pool, stream);
  if (block == nullptr) {
    ++stats_.num_alloc_retries;
    process_events(true);
    release_cached();
    plan = plan_growth(pool, stream, rounded);
    block = map_growth(plan, pool, stream);
  }
  if (block == nullptr) fail_oom(requested, stream, plan.bytes);
  return block;
}

DevicePool::GrowthPlan DevicePool::plan_growth(PoolKind pool, StreamId stream, std::size_t rounded) {
  GrowthPlan best;
  Block key;
  for (Segment* segment : expandable_) {
    if (segment->pool != pool || segment->stream != stream) continue;
    key.addr = segment->base;
    for (auto it = unmapped_.lower_bound(&key); it != unmapped_.end() && (*it)->addr < segment->base + segment->size;
         ++it) {
      Block* gap = *it;
      const Block* prev = gap->prev;
      // The new pages (free for `stream`) merge with a free block before the gap if it serves `stream` too.
      bool joins = prev != nullptr && (prev->state == BlockState::free_any ||
                                       (prev->state == BlockState::free_stream && prev->stream == stream));
      std::size_t have = joins ? prev->size : 0;
      std::size_t bytes = round_up(rounded > have ? rounded - have : 1, page_);
      if (bytes > gap->size) continue;
      if (best.gap == nullptr || bytes < best.bytes || (bytes == best.bytes && gap->addr < best.gap->addr))
        best = GrowthPlan{segment, gap, bytes, joins ? prev : nullptr};
    }
  }
  if (best.gap == nullptr) best.bytes = round_up(rounded, page_);
  return best;
}

Block* DevicePool::map_growth(GrowthPlan plan, PoolKind pool, StreamId stream) {
  std::size_t cap = cap_bytes();
  if (cap != 0 && std::size_t(stats_.total.reserved_bytes.current) + plan.bytes > cap) return nullptr;
  if (plan.segment == nullptr) {
    plan.segment = new_range(pool, stream, plan.bytes);
    if (plan.segment == nullptr) return nullptr;
    plan.gap = plan.segment->head;
  }
  Segment* segment = plan.segment;
  Block* gap = plan.gap;
  if (!upstream_->map(device_, gap->addr, plan.bytes)) return nullptr;
  segment->mapped += plan.bytes;
  segment->last_used = tick_;
  ++stats_.num_device_alloc;
  add(pool, &PoolStats::reserved_bytes, std::int64_t(plan.bytes));
  high_water_ = std::max(high_water_, stats_.total.reserved_bytes.current);
  trace_.record(TraceAction::segment_map, gap->addr, plan.bytes, stream);

  Block* fresh = gap;
  unmapped_.erase(gap);
  if (plan.bytes < gap->size) {
    fresh = new_block();
    fresh->addr = gap->addr;
    fresh->size = plan.bytes;
    fresh->segment = segment;
    fresh->prev = gap->prev;
    fresh->next = gap;
    if (gap->prev != nullptr) gap->prev->next = fresh;
    if (segment->head == gap) segment->head = fresh;
    gap->prev = fresh;
    gap->addr += plan.bytes;
    gap->size -= plan.bytes;
    unmapped_.insert(gap);
  }
  // Fresh pages: no stream has used them, so no event guards them (event_seq 0).
  fresh->state = BlockState::free_stream;
  fresh->stream = stream;
  fresh->event_seq = 0;
  ++fresh->generation;
  Block* block = merge_and_insert(fresh);
  erase_free(block);
  return block;
}

Segment* DevicePool::new_range(PoolKind pool, StreamId stream, std::size_t min_bytes) {
  // As much address space as the device has memory (as PyTorch): a range never
  // fills up, so blocks never stop at its end.
  std::size_t bytes = config_.expandable_range_bytes != 0 ? config_.expandable_range_bytes
                                                          : std::min(upstream_->total_memory(device_), kMaxRequest);
  // Room beyond the first request: the range then ends in unmapped space, which
  // is what lets release-before-growth find its free tail pages.
  bytes = round_up(bytes + min_bytes, page_);
  std::uintptr_t base = upstream_->reserve_range(device_, bytes);
  if (base == 0 && bytes > min_bytes) base = upstream_->reserve_range(device_, bytes = min_bytes);
  if (base == 0) return nullptr;
  MK_ASSERT(base % page_ == 0, "the upstream reserved a range that is not page-aligned");
  Segment* raw = add_segment(base, bytes, pool, stream, Segment::Kind::expandable, BlockState::unmapped);
  unmapped_.insert(raw->head);
  expandable_.push_back(raw);
  add(pool, &PoolStats::segment_count, 1);
  return raw;
}

void DevicePool::release_range(Segment* segment) {
  Block* gap = segment->head;
  MK_ASSERT(segment->mapped == 0 && gap->state == BlockState::unmapped && gap->next == nullptr,
            "releasing an expandable segment that still has pages mapped");
  unmapped_.erase(gap);
  upstream_->release_range(device_, segment->base, segment->size);
  sub(segment->pool, &PoolStats::segment_count, 1);
  recycle(gap);
  expandable_.erase(std::find(expandable_.begin(), expandable_.end(), segment));
  segments_.erase(segment->base);
}

bool DevicePool::unmappable(const Block* block) const {
  if (block->segment->kind != Segment::Kind::expandable) return false;
  if (block->state == BlockState::free_any) return true;
  // free_stream: safe once no event is pending for it (fresh pages), or when
  // there are no events at all (an upstream on which nothing runs: replay).
  return block->state == BlockState::free_stream && (events_ == nullptr || block->event_seq == 0);
}

std::size_t DevicePool::whole_pages(const Block* block) const {
  std::uintptr_t lo = round_up(block->addr, page_);
  std::uintptr_t hi = (block->addr + block->size) / page_ * page_;
  return hi > lo ? hi - lo : 0;
}

std::size_t DevicePool::unmap_pages(Block* block) {
  std::size_t bytes = whole_pages(block);
  if (bytes == 0) return 0;
  Segment* segment = block->segment;
  const std::uintptr_t lo = round_up(block->addr, page_), hi = lo + bytes, end = block->addr + block->size;
  erase_free(block);
  upstream_->unmap(device_, lo, bytes);
  segment->mapped -= bytes;
  ++stats_.num_device_free;
  sub(segment->pool, &PoolStats::reserved_bytes, std::int64_t(bytes));
  trace_.record(TraceAction::segment_unmap, lo, bytes, segment->stream);

  // The partial pages at either end stay mapped and free, with the block's state.
  auto carve = [&](std::uintptr_t addr, std::size_t size, bool before) {
    Block* piece = new_block();
    piece->addr = addr;
    piece->size = size;
    piece->segment = segment;
    piece->stream = block->stream;
    piece->state = block->state;
    piece->event_seq = block->event_seq;
    if (before) {
      piece->prev = block->prev;
      piece->next = block;
      if (block->prev != nullptr) block->prev->next = piece;
      if (segment->head == block) segment->head = piece;
      block->prev = piece;
    } else {
      piece->prev = block;
      piece->next = block->next;
      if (block->next != nullptr) block->next->prev = piece;
      block->next = piece;
    }
    insert_free(piece);
  };
  if (lo > block->addr) carve(block->addr, lo - block->addr, true);
  if (hi < end) carve(hi, end - hi, false);
  block->addr = lo;
  block->size = bytes;
  block->state = BlockState::unmapped;
  ++block->generation;
  // Coalesce with unmapped neighbours.
  if (Block* prev = block->prev; prev != nullptr && prev->state == BlockState::unmapped) {
    unmapped_.erase(prev);
    block->addr = prev->addr;
    block->size += prev->size;
    block->prev = prev->prev;
    if (prev->prev != nullptr) prev->prev->next = block;
    if (segment->head == prev) segment->head = block;
    recycle(prev);
  }
  if (Block* next = block->next; next != nullptr && next->state == BlockState::unmapped) {
    unmapped_.erase(next);
    block->size += next->size;
    block->next = next->next;
    if (next->next != nullptr) next->next->prev = block;
    recycle(next);
  }
  unmapped_.insert(block);
  return bytes;
}

std::size_t DevicePool::unmap_free_pages(std::size_t target, const Block* keep) {
  std::vector<std::pair<std::size_t, Block*>> candidates;
  auto consider = [&](Block* b) {
    if (b != nullptr && b != keep && unmappable(b))
      if (std::size_t bytes = whole_pages(b)) candidates.emplace_back(bytes, b);
  };
  if (target == 0) {
    for (Segment* segment : expandable_)
      for (Block* b = segment->head; b != nullptr; b = b->next) consider(b);
  } else {
    // Only free blocks that border a gap: unmapping their pages widens the gap
    // instead of opening a new one, whose partial pages at both ends would stay
    // mapped and unusable. A free block between two gaps is listed once.
    for (Block* gap : unmapped_) {
      consider(gap->prev);
      if (gap->next == nullptr || gap->next->next == nullptr || gap->next->next->state != BlockState::unmapped)
        consider(gap->next);
    }
  }
  // Largest first: the fewest unmap calls reach the target. Ties by address keep runs deterministic.
  if (target != 0)
    std::sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first > b.first : a.second->addr < b.second->addr;
    });
  std::size_t released = 0;
  for (auto& candidate : candidates) {
    if (target != 0 && released >= target) break;
    released += unmap_pages(candidate.second);
  }
  return released;
}

std::size_t DevicePool::release_expandable() {
  std::size_t released = unmap_free_pages(0, nullptr) > 0 ? 1 : 0;
  std::vector<Segment*> empty;
  for (Segment* segment : expandable_)
    if (segment->mapped == 0) empty.push_back(segment);
  for (Segment* segment : empty) release_range(segment);
  return released + empty.size();
}

std::string DevicePool::oom_message(std::size_t requested, std::size_t segment_bytes) {
  DeviceStats s = stats_locked();
  std::string text = "memkernels: out of memory on device " + std::to_string(device_) + ": tried to allocate " +
                     format_bytes(requested) + " (a segment of " + format_bytes(segment_bytes) + "). Device total " +
                     format_bytes(std::int64_t(upstream_->total_memory(device_)));
  if (s.memory_cap) text += ", memory cap " + format_bytes(s.memory_cap);
  text += "; reserved " + format_bytes(s.total.reserved_bytes.current) + " in " +
          std::to_string(s.total.segment_count.current) + " segments, allocated " +
          format_bytes(s.total.allocated_bytes.current) + " (requested " +
          format_bytes(s.total.requested_bytes.current) + "), cached free " + format_bytes(s.free_bytes) +
          " (largest free block " + format_bytes(s.largest_free_block) + ", fragmentation " +
          std::to_string(int(100.0 * s.fragmentation() + 0.5)) +
          "%). Cached segments were released and the allocation retried (" + std::to_string(s.num_alloc_retries) +
          " retries, " + std::to_string(s.num_ooms) + " OOMs so far).";
  return text;
}

// ---------------------------------------------------------------- repeating loops
//
// Rules 2 and 3 (policy.hpp) lower the peak while a run's peak is still being found. In a loop
// whose steps repeat, they only trade device allocations for nothing: rule 3 sends a request to
// a new segment while a larger free block idles, rule 2 releases idle segments at the high-water
// mark, and the next step allocates them again (docs/allocator.md, "Periodic loops"). So the pool
// is told where steps end (end_step: the optimizer's step, or the caller), and while a step
// repeats the one before it, it runs as a repeating loop: rule 2 releases nothing and rule 3
// yields to any free block that fits rather than grow. "Repeats" is checked as the step goes:
// its request sizes so far must appear in the last step's, in order (a subsequence: step 1 also
// allocated the parameters). The first request that does not (another batch shape) switches the
// rules back on until the step ends, so loops whose shapes change run as without end_step. A
// step longer than kStepRecordLimit requests is compared up to that many. Out of memory, the
// memory cap and the GC threshold still release as always.

void DevicePool::end_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (this_step_requests_.empty()) return;  // nothing allocated since the last call (a second optimizer)
  stats_.num_repeated_steps += repeating_;
  ++stats_.num_steps;
  last_step_requests_.swap(this_step_requests_);
  this_step_requests_.clear();
  match_from_ = 0;
  repeating_ = true;  // until a request shows otherwise
}

// ---------------------------------------------------------------- malloc / free

std::uintptr_t DevicePool::malloc(std::size_t bytes, StreamId stream) {
  if (bytes == 0) return 0;
  std::lock_guard<std::mutex> lock(mutex_);
  if (bytes > kMaxRequest) {
    ++stats_.num_ooms;
    trace_.record(TraceAction::oom, 0, bytes, stream);
    throw out_of_memory(oom_message(bytes, bytes) + " (no device has that much memory)");
  }
  if (!queues_.empty()) process_events(false);
  note_stream(stream);
  if (this_step_requests_.size() < kStepRecordLimit) this_step_requests_.push_back(bytes);
  if (repeating_) {
    auto begin = last_step_requests_.begin() + std::ptrdiff_t(match_from_);
    auto found = std::find(begin, last_step_requests_.end(), bytes);
    repeating_ = found != last_step_requests_.end();
    match_from_ = std::size_t(found - last_step_requests_.begin()) + 1;
  }
  const Policy& policy = config_.policy;
  std::size_t rounded = policy.round_size(bytes);
  PoolKind pool = policy.pool_for(rounded);
  Block* block = find_free(pool, stream, rounded);
  if (block != nullptr)
    erase_free(block);
  else
    block = new_segment_block(pool, stream, rounded, bytes);

  // In an expandable segment every remainder is split off: attached to the
  // block it would be lost until the block is freed; free, it is reused or its
  // pages unmapped.
  bool split = config_.expandable_segments && block->segment->kind == Segment::Kind::expandable
                   ? block->size - rounded >= policy.min_block
                   : policy.should_split(pool, block->size, rounded);
  if (split) {
    // The free remainder keeps the original block (and any event queued for it);
    // the allocation is a new block at the front.
    Block* front = new_block();
    front->addr = block->addr;
    front->size = rounded;
    front->segment = block->segment;
    front->prev = block->prev;
    front->next = block;
    if (block->prev != nullptr) block->prev->next = front;
    if (block->segment->head == block) block->segment->head = front;
    block->prev = front;
    block->addr += rounded;
    block->size -= rounded;
    insert_free(block);
    block = front;
  } else {
    ++block->generation;  // any event queued for it is stale now
  }
  block->state = BlockState::allocated;
  block->stream = stream;
  block->requested = bytes;
  block->uses.clear();
  block->segment->last_used = ++tick_;
  allocated_.emplace(block->addr, block);

  add(pool, &PoolStats::allocated_bytes, std::int64_t(block->size));
  add(pool, &PoolStats::requested_bytes, std::int64_t(bytes));
  add(pool, &PoolStats::active_bytes, std::int64_t(block->size));
  add(pool, &PoolStats::allocation_count, 1);
  add(pool, &PoolStats::active_count, 1);
  trace_.record(TraceAction::alloc, block->addr, bytes, stream);
  return block->addr;
}

bool DevicePool::free(std::uintptr_t addr) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = allocated_.find(addr);
  if (it == allocated_.end()) return false;
  Block* block = it->second;
  allocated_.erase(it);
  PoolKind pool = block->segment->pool;
  sub(pool, &PoolStats::allocated_bytes, std::int64_t(block->size));
  sub(pool, &PoolStats::requested_bytes, std::int64_t(block->requested));
  sub(pool, &PoolStats::allocation_count, 1);
  block->segment->last_used = ++tick_;
  trace_.record(TraceAction::free_requested, block->addr, block->requested, block->stream);

  if (!block->uses.empty()) {
    block->state = BlockState::waiting;
    ++block->generation;
    record_event(block, block->stream);
    for (StreamId use : block->uses) record_event(block, use);
    block->pending_events = std::uint32_t(block->uses.size() + 1);
    return true;
  }
  free_block(block);
  return true;
}

void DevicePool::retire(Block* block) {
  PoolKind pool = block->segment->pool;
  sub(pool, &PoolStats::active_bytes, std::int64_t(block->size));
  sub(pool, &PoolStats::active_count, 1);
  trace_.record(TraceAction::free_completed, block->addr, block->requested, block->stream);
  block->requested = 0;
  block->uses.clear();
}

void DevicePool::free_block(Block* block) {
  retire(block);
  block->state = BlockState::free_stream;
  // Only another stream could use the event; while the pool has seen a single
  // stream none is recorded (on a GPU that saves a cudaEventRecord per free).
  // Such a block stays with its stream, which is always safe. Expandable
  // segments always record one: it tells when the pages may be unmapped.
  if (events_ != nullptr && (streams_seen_.size() > 1 || config_.expandable_segments)) {
    ++block->generation;
    block->event_seq = ++event_seq_;
    record_event(block, block->stream);
  }
  merge_and_insert(block);
}

void DevicePool::record_stream(std::uintptr_t addr, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = allocated_.find(addr);
  MK_EXPECTS(it != allocated_.end(), "record_stream: address " + std::to_string(addr) +
                                         " is not a live allocation of device " + std::to_string(device_));
  MK_EXPECTS(events_ != nullptr, "record_stream needs an event source: this pool was built without one");
  Block* block = it->second;
  note_stream(stream);
  if (stream == block->stream) return;
  if (std::find(block->uses.begin(), block->uses.end(), stream) == block->uses.end()) block->uses.push_back(stream);
}

void DevicePool::note_stream(StreamId stream) {
  if (std::find(streams_seen_.begin(), streams_seen_.end(), stream) == streams_seen_.end())
    streams_seen_.push_back(stream);
}

// ---------------------------------------------------------------- coalescing

bool DevicePool::mergeable(const Block* a, const Block* b) {
  auto is_free = [](const Block* x) {
    return x->state == BlockState::free_any || x->state == BlockState::free_stream;
  };
  if (!is_free(a) || !is_free(b)) return false;
  if (a->state == BlockState::free_stream && b->state == BlockState::free_stream) return a->stream == b->stream;
  return true;
}

Block* DevicePool::merge_and_insert(Block* block) {
  Block* neighbours[2] = {block->prev, block->next};
  for (Block* neighbour : neighbours) {
    if (neighbour == nullptr || !mergeable(block, neighbour)) continue;
    erase_free(neighbour);
    // The surviving object is the one whose queued event guards the merged
    // range: the later event on a shared stream, or the only one. Queued events
    // name their block by address and generation, so the survivor keeps both.
    bool keep_neighbour =
        neighbour->state == BlockState::free_stream &&
        (block->state == BlockState::free_any || neighbour->event_seq > block->event_seq);
    Block* keep = keep_neighbour ? neighbour : block;
    Block* gone = keep_neighbour ? block : neighbour;
    Block* lower = neighbour == block->prev ? neighbour : block;
    Block* upper = lower == neighbour ? block : neighbour;
    Segment* segment = block->segment;
    Block* before = lower->prev;
    Block* after = upper->next;
    keep->addr = lower->addr;
    keep->size = lower->size + upper->size;
    keep->prev = before;
    keep->next = after;
    if (before != nullptr) before->next = keep;
    if (after != nullptr) after->prev = keep;
    if (segment->head == lower) segment->head = keep;
    recycle(gone);
    block = keep;
  }
  insert_free(block);
  return block;
}

// ---------------------------------------------------------------- events

void DevicePool::record_event(Block* block, StreamId stream) {
  EventId event = events_->record(device_, stream);
  for (auto& queue : queues_)
    if (queue.stream == stream) {
      queue.events.push_back({event, block, block->generation});
      return;
    }
  queues_.push_back(StreamQueue{stream, {}});
  queues_.back().events.push_back({event, block, block->generation});
}

void DevicePool::process_events(bool wait) {
  for (auto& queue : queues_) {
    while (!queue.events.empty()) {
      PendingEvent pending = queue.events.front();
      bool stale = pending.block->generation != pending.generation;
      if (!stale) {
        if (wait)
          events_->synchronize(pending.event);
        else if (!events_->query(pending.event))
          break;
      }
      queue.events.pop_front();
      events_->destroy(pending.event);
      if (!stale) complete(pending.block);
    }
  }
}

void DevicePool::complete(Block* block) {
  if (block->state == BlockState::waiting) {
    if (--block->pending_events > 0) return;
    // Every stream that touched it has passed the free: any stream may reuse it.
    retire(block);
  } else {
    MK_ASSERT(block->state == BlockState::free_stream, "event completed for a block that is not pending");
    erase_free(block);
  }
  block->state = BlockState::free_any;
  ++block->generation;
  merge_and_insert(block);
}

// ---------------------------------------------------------------- cache control

void DevicePool::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (events_ != nullptr) process_events(true);
  release_cached();
}

void DevicePool::reserve(std::size_t bytes, StreamId stream) {
  MK_EXPECTS(bytes > 0 && bytes <= kMaxRequest, "reserve: bytes must be positive and at most 2^62");
  std::lock_guard<std::mutex> lock(mutex_);
  const Policy& policy = config_.policy;
  std::size_t size = (bytes + policy.segment_granularity - 1) / policy.segment_granularity * policy.segment_granularity;
  Block* block = device_alloc(PoolKind::large, stream, size);
  if (block == nullptr) {
    ++stats_.num_ooms;
    throw out_of_memory(oom_message(bytes, size) + " (while reserving)");
  }
  block->segment->kept = true;
  insert_free(block);  // kept: never counted as idle
}

void DevicePool::release_reserved() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& entry : segments_) {
    Segment& segment = *entry.second;
    if (!segment.kept) continue;
    segment.kept = false;
    if (releasable(segment.head)) idle_bytes_ += segment.size;
  }
}

void DevicePool::set_memory_cap(std::size_t bytes, double fraction) {
  std::lock_guard<std::mutex> lock(mutex_);
  PoolConfig next = config_;
  next.memory_cap_bytes = bytes;
  next.memory_cap_fraction = fraction;
  next.validate();
  config_ = next;
}

void DevicePool::set_trace_capacity(std::size_t entries) {
  std::lock_guard<std::mutex> lock(mutex_);
  trace_.set_capacity(entries);
}

void DevicePool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (PoolStats* s : {&stats_.pools[0], &stats_.pools[1], &stats_.total})
    for (Stat PoolStats::*field : {&PoolStats::allocated_bytes, &PoolStats::requested_bytes, &PoolStats::active_bytes,
                                   &PoolStats::reserved_bytes, &PoolStats::allocation_count,
                                   &PoolStats::segment_count, &PoolStats::active_count})
      (s->*field).reset_peak();
}

// ---------------------------------------------------------------- introspection

DeviceStats DevicePool::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_locked();
}

DeviceStats DevicePool::stats_locked() {
  DeviceStats s = stats_;
  s.repeating_loop = repeating_;
  s.memory_cap = std::int64_t(cap_bytes());
  s.free_bytes = s.largest_free_block = 0;
  s.free_histogram.fill(0);
  for (auto& entry : segments_)
    for (Block* b = entry.second->head; b != nullptr; b = b->next) {
      if (b->state != BlockState::free_any && b->state != BlockState::free_stream) continue;
      s.free_bytes += std::int64_t(b->size);
      s.largest_free_block = std::max(s.largest_free_block, std::int64_t(b->size));
      ++s.free_histogram[histogram_bucket(b->size)];
    }
  return s;
}

std::vector<SegmentInfo> DevicePool::segments() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<SegmentInfo> out;
  out.reserve(segments_.size());
  // An expandable segment appears as one segment per contiguous mapped run, as in PyTorch's snapshots.
  for (auto& entry : segments_) {
    const Segment& seg = *entry.second;
    bool expandable = seg.kind == Segment::Kind::expandable;
    bool open = false;
    for (Block* b = seg.head; b != nullptr; b = b->next) {
      if (b->state == BlockState::unmapped) {
        open = false;
        continue;
      }
      if (!open) {
        out.push_back(SegmentInfo{b->addr, 0, 0, 0, 0, seg.stream, seg.pool, seg.kept, expandable, {}});
        open = true;
      }
      SegmentInfo& info = out.back();
      info.total_size += b->size;
      info.blocks.push_back({b->addr, b->size, b->requested, b->state});
      if (b->state == BlockState::allocated) info.allocated_size += b->size;
      if (b->state == BlockState::allocated || b->state == BlockState::waiting) {
        info.active_size += b->size;
        info.requested_size += b->requested;
      }
    }
  }
  return out;
}

std::vector<TraceEntry> DevicePool::trace() {
  std::lock_guard<std::mutex> lock(mutex_);
  return trace_.entries();
}

void DevicePool::check_invariants() {
  std::lock_guard<std::mutex> lock(mutex_);
  PoolStats recount[kNumPools];
  std::size_t free_blocks = 0, allocated_blocks = 0, unmapped_blocks = 0;
  std::uintptr_t previous_end = 0;
  for (auto& entry : segments_) {
    const Segment& seg = *entry.second;
    MK_ASSERT(entry.first == seg.base, "segment map key differs from its base");
    MK_ASSERT(seg.base >= previous_end, "segments overlap");
    previous_end = seg.base + seg.size;
    PoolStats& r = recount[int(seg.pool)];
    bool expandable = seg.kind == Segment::Kind::expandable;
    r.reserved_bytes.current += std::int64_t(expandable ? seg.mapped : seg.size);
    r.segment_count.current += 1;
    std::size_t mapped = 0;
    std::uintptr_t cursor = seg.base;
    const Block* prev = nullptr;
    for (Block* b = seg.head; b != nullptr; prev = b, b = b->next) {
      MK_ASSERT(b->segment == &seg, "block points at the wrong segment");
      MK_ASSERT(b->prev == prev, "broken prev link");
      MK_ASSERT(b->addr == cursor && b->size > 0, "blocks do not tile their segment (overlap or gap)");
      MK_ASSERT(b->size % config_.policy.min_block == 0, "block size is not a multiple of min_block");
      cursor += b->size;
      if (prev != nullptr) MK_ASSERT(!mergeable(prev, b), "two adjacent free blocks were not coalesced");
      if (b->state != BlockState::unmapped) mapped += b->size;
      switch (b->state) {
        case BlockState::unmapped:
          ++unmapped_blocks;
          MK_ASSERT(expandable, "an unmapped block in a classic segment");
          MK_ASSERT(b->addr % page_ == 0 && b->size % page_ == 0, "an unmapped block is not whole pages");
          MK_ASSERT(prev == nullptr || prev->state != BlockState::unmapped, "two adjacent unmapped blocks");
          MK_ASSERT(unmapped_.count(b) == 1, "unmapped block missing from the unmapped set");
          break;
        case BlockState::allocated: {
          ++allocated_blocks;
          auto it = allocated_.find(b->addr);
          MK_ASSERT(it != allocated_.end() && it->second == b, "allocated block missing from the address map");
          r.allocated_bytes.current += std::int64_t(b->size);
          r.requested_bytes.current += std::int64_t(b->requested);
          r.allocation_count.current += 1;
          r.active_bytes.current += std::int64_t(b->size);
          r.active_count.current += 1;
          MK_ASSERT(b->requested <= b->size, "requested bytes exceed the block");
          break;
        }
        case BlockState::waiting:
          MK_ASSERT(b->pending_events > 0, "waiting block with no pending events");
          r.active_bytes.current += std::int64_t(b->size);
          r.active_count.current += 1;
          break;
        case BlockState::free_any:
        case BlockState::free_stream: {
          ++free_blocks;
          FreeSet* set = set_of(b);
          MK_ASSERT(set->count(b) == 1, "free block missing from its free list");
          break;
        }
      }
    }
    MK_ASSERT(cursor == seg.base + seg.size, "blocks do not cover their segment");
    MK_ASSERT(mapped == (expandable ? seg.mapped : seg.size), "mapped bytes differ from their recount");
    if (expandable)
      MK_ASSERT(std::find(expandable_.begin(), expandable_.end(), &seg) != expandable_.end(),
                "expandable segment missing from its list");
  }
  MK_ASSERT(unmapped_blocks == unmapped_.size(), "the unmapped set holds blocks that are not unmapped");
  MK_ASSERT(allocated_blocks == allocated_.size(), "address map holds blocks that are not allocated");
  std::size_t idle = 0;
  for (auto& entry : segments_)
    if (releasable(entry.second->head)) idle += entry.second->size;
  MK_ASSERT(idle == idle_bytes_, "idle-segment byte count differs from its recount");
  std::size_t listed = 0;
  for (auto& lists : free_) {
    listed += lists.any.size();
    for (auto& entry : lists.by_stream) listed += entry.second.size();
  }
  MK_ASSERT(listed == free_blocks, "free lists hold blocks that are not free");
  for (int p = 0; p < kNumPools; ++p) {
    const PoolStats& kept = stats_.pools[p];
    const PoolStats& r = recount[p];
    for (Stat PoolStats::*field : {&PoolStats::allocated_bytes, &PoolStats::requested_bytes, &PoolStats::active_bytes,
                                   &PoolStats::reserved_bytes, &PoolStats::allocation_count,
                                   &PoolStats::segment_count, &PoolStats::active_count}) {
      MK_ASSERT((kept.*field).current == (r.*field).current, "a statistic differs from its recount");
      MK_ASSERT((kept.*field).peak >= (kept.*field).current, "a peak is below its current value");
    }
  }
  for (Stat PoolStats::*field : {&PoolStats::allocated_bytes, &PoolStats::reserved_bytes, &PoolStats::active_bytes})
    MK_ASSERT((stats_.total.*field).current == (stats_.pools[0].*field).current + (stats_.pools[1].*field).current,
              "device total differs from the sum of its pools");
}

}  // namespace mk::core
