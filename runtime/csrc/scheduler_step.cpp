// Plan materialization and the post-step update (the per-step hot path).
#include <algorithm>
#include <cstring>

#include "scheduler.h"

namespace ingot {

void Scheduler::fill_plan() {
  plan_seqs_.clear();
  num_prefill_ = static_cast<int32_t>(prefill_.size());
  num_seqs_ = num_prefill_ + static_cast<int32_t>(decode_.size());
  const int32_t tpb = cfg_.tokens_per_block;
  const size_t row = max_blocks_;
  int32_t t = 0;
  buf_.query_start_loc[0] = 0;
  for (int32_t k = 0; k < num_seqs_; ++k) {
    const auto& e = k < num_prefill_ ? prefill_[k] : decode_[k - num_prefill_];
    Seq* s = e.first;
    const int32_t n = e.second, nc = s->num_computed;
    plan_seqs_.push_back(s);
    buf_.seq_ids[k] = s->id;
    buf_.num_new_tokens[k] = n;
    buf_.num_computed[k] = nc;
    buf_.context_lens[k] = nc + n;
    buf_.query_start_loc[k + 1] = t + n;
    buf_.samples[k] = nc + n == static_cast<int32_t>(s->tokens.size());
    const int32_t* blocks = s->table.blocks.data();
    std::memcpy(&buf_.input_ids[t], s->tokens.data() + nc, sizeof(int32_t) * n);
    for (int32_t j = 0; j < n; ++j) {
      const int32_t pos = nc + j;
      buf_.positions[t + j] = pos;
      buf_.slot_mapping[t + j] = blocks[pos / tpb] * tpb + pos % tpb;
    }
    t += n;
    int32_t* dst = &buf_.block_tables[k * row];
    const size_t nb = s->table.blocks.size();
    std::memcpy(dst, blocks, sizeof(int32_t) * nb);
    std::memset(dst + nb, 0, sizeof(int32_t) * (row - nb));
  }
  num_tokens_ = t;
  plan_pending_ = num_seqs_ > 0;
}

void Scheduler::finish(Seq* s, int32_t reason) {
  bm_.release(&s->table);
  s->running = false;
  finished_.emplace_back(s->id, reason);
}

const std::vector<std::pair<int64_t, int32_t>>& Scheduler::update(const int32_t* new_tokens,
                                                                  const int8_t* finish_reasons,
                                                                  size_t n) {
  if (!plan_pending_) {
    if (n != 0) throw std::logic_error("update() without a pending plan: call schedule() first");
  } else if (n != static_cast<size_t>(num_seqs_)) {
    throw std::invalid_argument("update() got " + std::to_string(n) + " entries, the plan has " +
                                std::to_string(num_seqs_));
  }
  for (size_t k = 0; k < n; ++k)
    if (buf_.samples[k] && (finish_reasons[k] < kNone || finish_reasons[k] > kCancelled))
      throw std::invalid_argument("update(): invalid finish reason " +
                                  std::to_string(finish_reasons[k]) + " at entry " +
                                  std::to_string(k));
  finished_.clear();
  done_.clear();
  bool any_finished = false;
  for (size_t k = 0; k < n; ++k) {
    Seq* s = plan_seqs_[k];
    if (s == nullptr) continue;  // cancelled after schedule()
    s->num_computed += buf_.num_new_tokens[k];
    bm_.mark_computed(&s->table, s->tokens.data(), s->num_computed);
    if (!buf_.samples[k]) continue;
    s->tokens.push_back(new_tokens[k]);
    s->prefilled = true;
    int32_t reason = finish_reasons[k];
    const int32_t len = static_cast<int32_t>(s->tokens.size());
    if (reason == kNone && (len - s->prompt_len >= s->max_new_tokens || len >= s->max_len))
      reason = kLength;
    if (reason != kNone) {
      finish(s, reason);
      any_finished = true;
    }
  }
  if (any_finished) {
    running_.erase(
        std::remove_if(running_.begin(), running_.end(), [](const Seq* s) { return !s->running; }),
        running_.end());
    for (const auto& f : finished_) {
      auto it = seqs_.find(f.first);
      done_.push_back(std::move(it->second));
      seqs_.erase(it);
    }
  }
  plan_pending_ = false;
  plan_seqs_.clear();
  num_seqs_ = num_tokens_ = num_prefill_ = 0;
  return finished_;
}

}  // namespace ingot
