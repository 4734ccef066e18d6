// Paged KV block pool: reference-counted blocks, per-sequence block tables, prefix reuse.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hash_table.h"

namespace ingot {

// One sequence's blocks. blocks[i] holds the KV of tokens [i * tpb, (i + 1) * tpb).
struct BlockTable {
  std::vector<int32_t> blocks;
  int32_t num_hashed = 0;  // leading full, computed blocks already hashed
  uint64_t last_hash = 0;  // hash of block num_hashed - 1 (chain seed when 0 blocks)
};

// What the integrity check needs to know about one live sequence.
struct TableView {
  const BlockTable* table;
  const int32_t* tokens;
  int32_t num_tokens;
  int32_t num_computed;
};

struct PrefixStats {
  int64_t hit_blocks = 0;
  int64_t miss_blocks = 0;
  int64_t hit_tokens = 0;
};

class BlockManager {
 public:
  // hash_bits < 64 truncates block hashes (tests use it to force collisions).
  BlockManager(int32_t num_blocks, int32_t tokens_per_block, bool prefix_reuse,
               int32_t hash_bits = 64);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t tokens_per_block() const { return tpb_; }
  bool prefix_reuse() const { return prefix_reuse_; }
  // Blocks that can be handed out now: free plus evictable cached ones.
  int32_t num_free() const { return static_cast<int32_t>(free_.size()) + num_evictable_; }
  int32_t num_evictable() const { return num_evictable_; }
  int32_t num_used() const { return num_blocks_ - num_free(); }
  int32_t blocks_for(int32_t num_tokens) const { return (num_tokens + tpb_ - 1) / tpb_; }
  int32_t ref_count(int32_t block) const { return ref_[block]; }
  const PrefixStats& stats() const { return stats_; }

  // Longest cached prefix of whole blocks of tokens[0, len - 1) whose stored tokens and parent
  // chain verify. Writes the block ids to *out and how many of them are evictable (refcount 0)
  // to *evictable. Returns the number of matched blocks. Changes nothing.
  int32_t match_prefix(const int32_t* tokens, int32_t len, std::vector<int32_t>* out,
                       int32_t* evictable) const;
  // Counts a lookup of `eligible` whole blocks of which `hits` were reused.
  void record_match(int32_t hits, int32_t eligible);

  // Check, then commit: blocks that `table` lacks to cover num_tokens tokens fit in the pool.
  bool can_grow(const BlockTable& table, int32_t num_tokens) const {
    return blocks_for(num_tokens) - static_cast<int32_t>(table.blocks.size()) <= num_free();
  }
  // Appends fresh blocks (free first, then evicting least-recently-used cached ones) until the
  // table covers num_tokens tokens. Throws std::logic_error if the pool runs dry.
  void grow(BlockTable* table, int32_t num_tokens);
  // Starts an empty table with the matched prefix blocks (refcount + 1 each).
  void share(BlockTable* table, const std::vector<int32_t>& matched);
  // Hashes and caches the table's full blocks within tokens[0, num_computed).
  void mark_computed(BlockTable* table, const int32_t* tokens, int32_t num_computed);
  // Drops the table's references; full hashed blocks stay cached (evictable), others go free.
  void release(BlockTable* table);

  // Empty string when every invariant holds, else a description of the first violation.
  std::string check(const std::vector<TableView>& live) const;

 private:
  uint64_t hash_block(uint64_t prev, const int32_t* tokens) const;
  int32_t alloc_block();
  void lru_push_back(int32_t b);
  void lru_remove(int32_t b);

  int32_t num_blocks_;
  int32_t tpb_;
  bool prefix_reuse_;
  uint64_t hash_mask_;
  std::vector<int32_t> ref_;
  std::vector<uint8_t> hashed_;
  std::vector<uint64_t> hash_;
  std::vector<int32_t> parent_;        // block before this one when it was hashed (-1: first)
  std::vector<uint32_t> parent_gen_;   // parent's generation at that time
  std::vector<uint32_t> gen_;          // bumped whenever a block is handed out fresh
  std::vector<int32_t> block_tokens_;  // [num_blocks, tpb] token ids of hashed blocks
  std::vector<int32_t> free_;          // stack of free, unhashed blocks
  std::vector<int32_t> lru_prev_, lru_next_;
  int32_t lru_head_ = -1, lru_tail_ = -1, num_evictable_ = 0;
  BlockHashMap map_;
  PrefixStats stats_;
};

}  // namespace ingot
