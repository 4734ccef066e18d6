// Inflight-batching scheduler: admission, chunked prefill, decode, preemption, cancellation.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "block_manager.h"

namespace ingot {

enum class Policy : int32_t { kGuaranteedNoEvict = 0, kMaxUtilization = 1 };

// Values shared with ingot.runtime.types.FinishReason.
enum FinishReason : int8_t { kNone = 0, kEos = 1, kStop = 2, kLength = 3, kCancelled = 4 };

struct SchedulerConfig {
  int32_t num_blocks, tokens_per_block, max_batch_size, max_num_tokens, max_seq_len;
  Policy policy;
  bool enable_prefix_reuse;
  int32_t hash_bits = 64;
};

// A refused request (prompt too long for the pool or max_seq_len); state is unchanged.
struct RequestRefused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Seq {
  int64_t id;
  std::vector<int32_t> tokens;  // prompt + generated
  int32_t prompt_len;
  int32_t max_new_tokens;
  int32_t max_len;         // finishes with LENGTH on reaching this many tokens
  int32_t reserve_blocks;  // whole-KV blocks promised under guaranteed_no_evict
  int32_t num_computed = 0;
  bool prefilled = false;  // sampled at least once since (re)admission
  bool running = false;
  BlockTable table;
};

// The last plan, in buffers sized once for max_batch_size / max_num_tokens.
struct PlanBuffers {
  std::vector<int64_t> seq_ids;
  std::vector<int32_t> num_new_tokens, num_computed, context_lens, query_start_loc;
  std::unique_ptr<bool[]> samples;
  std::vector<int32_t> input_ids, positions, slot_mapping, block_tables;
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& cfg);
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request. Throws std::invalid_argument (bad args / duplicate id) or RequestRefused.
  void add_request(int64_t id, const int32_t* prompt, int32_t len, int32_t max_new_tokens);
  // Builds the next plan into the plan buffers; returns its number of entries.
  int32_t schedule();
  // Applies the model step's results to the last plan. Returns finished (id, reason) pairs.
  const std::vector<std::pair<int64_t, int32_t>>& update(const int32_t* new_tokens,
                                                         const int8_t* finish, size_t n);
  bool cancel(int64_t id);
  // Replaces the last token of each request in `ids` (live, or finished since the last
  // update()); unknown ids are skipped. For a pipelined step: update() took placeholder tokens
  // while the GPU was still sampling them; the last token is not computed yet, so no block
  // hash has read it. Returns how many requests were patched.
  int32_t set_last_tokens(const int64_t* ids, const int32_t* tokens, size_t n);

  bool has_unfinished() const { return !running_.empty() || !waiting_.empty(); }
  int32_t num_free_blocks() const { return bm_.num_free(); }
  std::string check_integrity() const;
  // Tokens of a live request, or one that finished/was cancelled since the last update().
  const std::vector<int32_t>* tokens(int64_t id) const;

  const SchedulerConfig& config() const { return cfg_; }
  const BlockManager& block_manager() const { return bm_; }
  int32_t max_blocks_per_seq() const { return max_blocks_; }
  int32_t plan_num_seqs() const { return num_seqs_; }
  int32_t plan_num_tokens() const { return num_tokens_; }
  int32_t plan_num_prefill() const { return num_prefill_; }
  const std::vector<int64_t>& preempted() const { return preempted_; }
  PlanBuffers& buffers() { return buf_; }
  int64_t num_preemptions() const { return num_preemptions_; }
  size_t num_running() const { return running_.size(); }
  size_t num_waiting() const { return waiting_.size(); }

 private:
  void preempt(Seq* s);
  void finish(Seq* s, int32_t reason);
  void fill_plan();
  int32_t outstanding_promises() const;

  SchedulerConfig cfg_;
  BlockManager bm_;
  int32_t max_blocks_;
  std::unordered_map<int64_t, std::unique_ptr<Seq>> seqs_;
  std::deque<Seq*> waiting_;
  std::vector<Seq*> running_;               // admission order, most recent last
  std::vector<std::unique_ptr<Seq>> done_;  // finished or cancelled since the last update()

  // Plan under construction / last plan.
  std::vector<std::pair<Seq*, int32_t>> prefill_, decode_;
  std::vector<Seq*> plan_seqs_;
  std::vector<int32_t> match_scratch_;
  std::vector<int64_t> preempted_;
  std::vector<std::pair<int64_t, int32_t>> finished_;
  PlanBuffers buf_;
  int32_t num_seqs_ = 0, num_tokens_ = 0, num_prefill_ = 0;
  bool plan_pending_ = false;
  int64_t num_preemptions_ = 0;
};

}  // namespace ingot
