#include "block_manager.h"

#include <cstring>
#include <stdexcept>

namespace ingot {

namespace {
constexpr uint64_t kChainSeed = 0x6a09e667f3bcc909ULL;

std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

BlockManager::BlockManager(int32_t num_blocks, int32_t tokens_per_block, bool prefix_reuse,
                           int32_t hash_bits)
    : num_blocks_(num_blocks),
      tpb_(tokens_per_block),
      prefix_reuse_(prefix_reuse),
      hash_mask_(hash_bits >= 64 ? ~0ULL : ((1ULL << hash_bits) - 1)),
      map_(num_blocks > 0 ? num_blocks : 1) {
  if (num_blocks <= 0)
    throw std::invalid_argument("num_blocks must be > 0, got " + str(num_blocks));
  if (tokens_per_block <= 0)
    throw std::invalid_argument("tokens_per_block must be > 0, got " + str(tokens_per_block));
  if (hash_bits <= 0) throw std::invalid_argument("hash_bits must be > 0, got " + str(hash_bits));
  ref_.assign(num_blocks, 0);
  hashed_.assign(num_blocks, 0);
  hash_.assign(num_blocks, 0);
  parent_.assign(num_blocks, -1);
  parent_gen_.assign(num_blocks, 0);
  gen_.assign(num_blocks, 0);
  block_tokens_.assign(static_cast<size_t>(num_blocks) * tpb_, 0);
  lru_prev_.assign(num_blocks, -1);
  lru_next_.assign(num_blocks, -1);
  free_.reserve(num_blocks);
  // NOTE: popped from the back, so blocks are handed out as 0, 1, 2, ...
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

uint64_t BlockManager::hash_block(uint64_t prev, const int32_t* tokens) const {
  uint64_t h = mix64(prev + 0x9e3779b97f4a7c15ULL);
  for (int32_t i = 0; i < tpb_; ++i) h = (h ^ static_cast<uint32_t>(tokens[i])) * 0x100000001b3ULL;
  return mix64(h) & hash_mask_;
}

int32_t BlockManager::match_prefix(const int32_t* tokens, int32_t len, std::vector<int32_t>* out,
                                   int32_t* evictable) const {
  out->clear();
  *evictable = 0;
  if (!prefix_reuse_ || len <= 1) return 0;
  // NOTE: at most len - 1 tokens are reused so the last prompt token is computed (logits).
  const int32_t cap = (len - 1) / tpb_;
  uint64_t h = kChainSeed;
  int32_t parent = -1;
  for (int32_t i = 0; i < cap; ++i) {
    const int32_t* blk = tokens + static_cast<size_t>(i) * tpb_;
    h = hash_block(h, blk);
    const int32_t b = map_.find(h);
    if (b < 0) break;
    // A hash match alone is not trusted: tokens and the parent chain must be identical.
    if (std::memcmp(&block_tokens_[static_cast<size_t>(b) * tpb_], blk, sizeof(int32_t) * tpb_))
      break;
    if (parent_[b] != parent || (parent >= 0 && parent_gen_[b] != gen_[parent])) break;
    out->push_back(b);
    if (ref_[b] == 0) ++*evictable;
    parent = b;
  }
  return static_cast<int32_t>(out->size());
}

void BlockManager::record_match(int32_t hits, int32_t eligible) {
  stats_.hit_blocks += hits;
  stats_.miss_blocks += eligible - hits;
  stats_.hit_tokens += static_cast<int64_t>(hits) * tpb_;
}

int32_t BlockManager::alloc_block() {
  int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (lru_head_ >= 0) {
    b = lru_head_;
    lru_remove(b);
    map_.erase(hash_[b]);
    hashed_[b] = 0;
  } else {
    throw std::logic_error("block pool exhausted (grow called without can_grow)");
  }
  ++gen_[b];
  parent_[b] = -1;
  ref_[b] = 1;
  return b;
}

void BlockManager::grow(BlockTable* table, int32_t num_tokens) {
  const int32_t need = blocks_for(num_tokens) - static_cast<int32_t>(table->blocks.size());
  if (need > num_free()) throw std::logic_error("block pool exhausted (grow without can_grow)");
  for (int32_t i = 0; i < need; ++i) table->blocks.push_back(alloc_block());
}

void BlockManager::share(BlockTable* table, const std::vector<int32_t>& matched) {
  if (!table->blocks.empty()) throw std::logic_error("share() needs an empty block table");
  for (int32_t b : matched) {
    if (ref_[b] == 0) lru_remove(b);
    ++ref_[b];
    table->blocks.push_back(b);
  }
  table->num_hashed = static_cast<int32_t>(matched.size());
  table->last_hash = matched.empty() ? kChainSeed : hash_[matched.back()];
}

void BlockManager::mark_computed(BlockTable* table, const int32_t* tokens, int32_t num_computed) {
  if (!prefix_reuse_) return;
  if (table->num_hashed == 0) table->last_hash = kChainSeed;
  const int32_t full = num_computed / tpb_;
  for (int32_t i = table->num_hashed; i < full; ++i) {
    const int32_t* blk = tokens + static_cast<size_t>(i) * tpb_;
    const uint64_t h = hash_block(table->last_hash, blk);
    const int32_t b = table->blocks[i];
    // NOTE: a block already cached under h (same content computed twice, or a collision)
    // keeps the entry; this copy stays unhashed and is freed on release.
    if (!hashed_[b] && map_.insert(h, b)) {
      hashed_[b] = 1;
      hash_[b] = h;
      std::memcpy(&block_tokens_[static_cast<size_t>(b) * tpb_], blk, sizeof(int32_t) * tpb_);
      const int32_t p = i > 0 ? table->blocks[i - 1] : -1;
      parent_[b] = p;
      parent_gen_[b] = p >= 0 ? gen_[p] : 0;
    }
    table->last_hash = h;
    table->num_hashed = i + 1;
  }
}

void BlockManager::release(BlockTable* table) {
  // Reverse order: a prefix's first blocks become the most recently used, so they are evicted
  // after the blocks that follow them.
  for (auto it = table->blocks.rbegin(); it != table->blocks.rend(); ++it) {
    const int32_t b = *it;
    if (--ref_[b] == 0) {
      if (hashed_[b]) {
        lru_push_back(b);
      } else {
        free_.push_back(b);
      }
    }
  }
  table->blocks.clear();
  table->num_hashed = 0;
  table->last_hash = kChainSeed;
}

void BlockManager::lru_push_back(int32_t b) {
  lru_prev_[b] = lru_tail_;
  lru_next_[b] = -1;
  if (lru_tail_ >= 0) {
    lru_next_[lru_tail_] = b;
  } else {
    lru_head_ = b;
  }
  lru_tail_ = b;
  ++num_evictable_;
}

void BlockManager::lru_remove(int32_t b) {
  const int32_t p = lru_prev_[b], n = lru_next_[b];
  if (p >= 0) {
    lru_next_[p] = n;
  } else {
    lru_head_ = n;
  }
  if (n >= 0) {
    lru_prev_[n] = p;
  } else {
    lru_tail_ = p;
  }
  lru_prev_[b] = lru_next_[b] = -1;
  --num_evictable_;
}

std::string BlockManager::check(const std::vector<TableView>& live) const {
  std::vector<int32_t> owners(num_blocks_, 0);
  for (const TableView& v : live) {
    const auto& blocks = v.table->blocks;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const int32_t b = blocks[i];
      if (b < 0 || b >= num_blocks_) return "block table holds invalid block id " + str(b);
      for (size_t j = 0; j < i; ++j)
        if (blocks[j] == b) return "block " + str(b) + " appears twice in one table";
      ++owners[b];
      if (hashed_[b] && static_cast<int32_t>(i) < v.num_computed / tpb_) {
        // A cached block must hold exactly the tokens of every table it appears in.
        const int32_t* want = v.tokens + i * tpb_;
        if (std::memcmp(&block_tokens_[static_cast<size_t>(b) * tpb_], want, 4 * tpb_))
          return "cached block " + str(b) + " holds other tokens than its sequence";
      }
    }
    if (v.table->num_hashed > v.num_computed / tpb_ && prefix_reuse_)
      return "table hashed blocks beyond its computed tokens";
  }
  std::vector<uint8_t> seen(num_blocks_, 0);
  for (int32_t b : free_) {
    if (seen[b]++) return "block " + str(b) + " is twice in the free list";
    if (ref_[b] != 0 || hashed_[b]) return "free block " + str(b) + " is owned or cached";
  }
  int32_t n = 0;
  for (int32_t b = lru_head_; b >= 0; b = lru_next_[b]) {
    if (++n > num_blocks_) return "LRU list has a cycle";
    if (seen[b]++) return "block " + str(b) + " is both free and evictable (or twice in LRU)";
    if (ref_[b] != 0 || !hashed_[b]) return "evictable block " + str(b) + " is owned or unhashed";
  }
  if (n != num_evictable_) return "evictable count " + str(num_evictable_) + " != " + str(n);
  int32_t num_hashed = 0;
  for (int32_t b = 0; b < num_blocks_; ++b) {
    if (ref_[b] != owners[b])
      return "block " + str(b) + " refcount " + str(ref_[b]) + " != owners " + str(owners[b]);
    if (ref_[b] == 0 && !seen[b]) return "block " + str(b) + " leaked (unowned, not free)";
    if (ref_[b] > 0 && seen[b]) return "block " + str(b) + " owned and free";
    if (ref_[b] > 1 && !hashed_[b]) return "shared block " + str(b) + " is not a cached block";
    if (hashed_[b]) {
      ++num_hashed;
      if (map_.find(hash_[b]) != b) return "hashed block " + str(b) + " missing from hash map";
    }
  }
  if (static_cast<int32_t>(map_.size()) != num_hashed)
    return "hash map has " + str(map_.size()) + " entries for " + str(num_hashed) + " blocks";
  return "";
}

}  // namespace ingot
