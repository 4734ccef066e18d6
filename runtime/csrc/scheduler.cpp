#include "scheduler.h"

#include <algorithm>

namespace ingot {

namespace {
std::string str(int64_t v) { return std::to_string(v); }

void require_positive(int64_t v, const char* name) {
  if (v <= 0) throw std::invalid_argument(std::string(name) + " must be > 0, got " + str(v));
}
}  // namespace

Scheduler::Scheduler(const SchedulerConfig& cfg)
    : cfg_(cfg),
      bm_((require_positive(cfg.num_blocks, "num_blocks"),
           require_positive(cfg.tokens_per_block, "tokens_per_block"), cfg.num_blocks),
          cfg.tokens_per_block, cfg.enable_prefix_reuse, cfg.hash_bits) {
  require_positive(cfg.max_batch_size, "max_batch_size");
  require_positive(cfg.max_num_tokens, "max_num_tokens");
  require_positive(cfg.max_seq_len, "max_seq_len");
  if (cfg.policy != Policy::kGuaranteedNoEvict && cfg.policy != Policy::kMaxUtilization)
    throw std::invalid_argument("policy must be 0 (guaranteed_no_evict) or 1 (max_utilization)");
  max_blocks_ = (cfg.max_seq_len + cfg.tokens_per_block - 1) / cfg.tokens_per_block;
  const size_t B = cfg.max_batch_size, T = cfg.max_num_tokens;
  buf_.seq_ids.assign(B, 0);
  buf_.num_new_tokens.assign(B, 0);
  buf_.num_computed.assign(B, 0);
  buf_.context_lens.assign(B, 0);
  buf_.query_start_loc.assign(B + 1, 0);
  buf_.samples.reset(new bool[B]());
  buf_.input_ids.assign(T, 0);
  buf_.positions.assign(T, 0);
  buf_.slot_mapping.assign(T, 0);
  buf_.block_tables.assign(B * max_blocks_, 0);
  prefill_.reserve(B);
  decode_.reserve(B);
  plan_seqs_.reserve(B);
  running_.reserve(B);
  match_scratch_.reserve(max_blocks_);
  preempted_.reserve(B);
  finished_.reserve(B);
}

void Scheduler::add_request(int64_t id, const int32_t* prompt, int32_t len,
                            int32_t max_new_tokens) {
  if (seqs_.count(id)) throw std::invalid_argument("duplicate request id " + str(id));
  if (max_new_tokens <= 0)
    throw std::invalid_argument("request " + str(id) + ": max_new_tokens must be > 0, got " +
                                str(max_new_tokens));
  if (len <= 0) throw std::invalid_argument("request " + str(id) + ": prompt is empty");
  const int32_t tpb = cfg_.tokens_per_block;
  if (len >= cfg_.max_seq_len)
    throw RequestRefused("request " + str(id) + ": prompt length " + str(len) +
                         " must be < max_seq_len " + str(cfg_.max_seq_len));
  if (bm_.blocks_for(len) > cfg_.num_blocks)
    throw RequestRefused("request " + str(id) + ": prompt length " + str(len) + " needs " +
                         str(bm_.blocks_for(len)) + " KV blocks, more than the pool's " +
                         str(cfg_.num_blocks) + " (" + str(int64_t{cfg_.num_blocks} * tpb) +
                         " tokens)");
  auto s = std::make_unique<Seq>();
  s->id = id;
  s->prompt_len = len;
  s->max_new_tokens = max_new_tokens;
  const int64_t pool_tokens = int64_t{cfg_.num_blocks} * tpb;
  const int64_t want = std::min<int64_t>(int64_t{len} + max_new_tokens, cfg_.max_seq_len);
  // NOTE: a sequence also stops (LENGTH) once its KV would exceed the whole pool, so every
  // admitted sequence can always finish.
  s->max_len = static_cast<int32_t>(std::min<int64_t>(want, std::max<int64_t>(pool_tokens, len)));
  s->reserve_blocks = std::min(bm_.blocks_for(static_cast<int32_t>(want)), cfg_.num_blocks);
  s->tokens.reserve(std::max<int64_t>(want, len) + 1);
  s->tokens.assign(prompt, prompt + len);
  waiting_.push_back(s.get());
  seqs_.emplace(id, std::move(s));
}

bool Scheduler::cancel(int64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return false;
  Seq* s = it->second.get();
  if (s->running) {
    running_.erase(std::find(running_.begin(), running_.end(), s));
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), s));
  }
  if (plan_pending_)
    std::replace(plan_seqs_.begin(), plan_seqs_.end(), s, static_cast<Seq*>(nullptr));
  bm_.release(&s->table);
  s->running = false;
  done_.push_back(std::move(it->second));
  seqs_.erase(it);
  return true;
}

void Scheduler::preempt(Seq* s) {
  bm_.release(&s->table);
  s->num_computed = 0;
  s->prefilled = false;
  s->running = false;
  waiting_.push_front(s);  // recompute first, keeping the tokens generated so far
  preempted_.push_back(s->id);
  ++num_preemptions_;
}

int32_t Scheduler::outstanding_promises() const {
  int32_t n = 0;
  for (const Seq* s : running_)
    n += std::max(0, s->reserve_blocks - static_cast<int32_t>(s->table.blocks.size()));
  return n;
}

int32_t Scheduler::schedule() {
  if (plan_pending_ && num_seqs_ > 0)
    throw std::logic_error("schedule() called twice: call update() with the last plan's results");
  prefill_.clear();
  decode_.clear();
  preempted_.clear();
  int32_t budget = cfg_.max_num_tokens;
  const bool no_evict = cfg_.policy == Policy::kGuaranteedNoEvict;

  // 1. Running sequences, oldest first: continue prefill or decode one token.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Seq* s = running_[i];
    const int32_t len = static_cast<int32_t>(s->tokens.size());
    const int32_t n = std::min(len - s->num_computed, budget);
    const int32_t target = s->num_computed + n;
    bool self_preempted = false;
    while (!bm_.can_grow(s->table, target)) {
      if (no_evict) break;  // NOTE: unreachable while promises hold; skip this step if not
      Seq* victim = running_.back();  // most recently admitted
      running_.pop_back();
      preempt(victim);
      if (victim == s) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    if (!bm_.can_grow(s->table, target)) {
      ++i;
      continue;
    }
    bm_.grow(&s->table, target);
    (s->prefilled ? decode_ : prefill_).emplace_back(s, n);
    budget -= n;
    ++i;
  }

  // 2. Waiting requests, in order, while they fit (none while this step preempted).
  int32_t promised = no_evict && !waiting_.empty() ? outstanding_promises() : 0;
  while (preempted_.empty() && !waiting_.empty() && budget > 0 &&
         static_cast<int32_t>(running_.size()) < cfg_.max_batch_size) {
    Seq* s = waiting_.front();
    const int32_t len = static_cast<int32_t>(s->tokens.size());
    int32_t evictable = 0;
    const int32_t matched = bm_.match_prefix(s->tokens.data(), len, &match_scratch_, &evictable);
    const int32_t computed = matched * cfg_.tokens_per_block;
    const int32_t n = std::min(len - computed, budget);
    const int32_t avail = bm_.num_free() - evictable;
    const int32_t need_now = bm_.blocks_for(computed + n) - matched;
    if (no_evict ? avail < s->reserve_blocks - matched + promised : avail < need_now) break;
    waiting_.pop_front();
    bm_.record_match(matched, cfg_.enable_prefix_reuse ? (len - 1) / cfg_.tokens_per_block : 0);
    bm_.share(&s->table, match_scratch_);
    bm_.grow(&s->table, computed + n);
    s->num_computed = computed;
    s->running = true;
    running_.push_back(s);
    prefill_.emplace_back(s, n);
    budget -= n;
    if (no_evict) promised += s->reserve_blocks - static_cast<int32_t>(s->table.blocks.size());
  }
  fill_plan();
  return num_seqs_;
}

std::string Scheduler::check_integrity() const {
  std::vector<TableView> live;
  live.reserve(running_.size());
  const int32_t tpb = cfg_.tokens_per_block;
  if (static_cast<int32_t>(running_.size()) > cfg_.max_batch_size)
    return "more running sequences than max_batch_size";
  if (running_.size() + waiting_.size() != seqs_.size())
    return "running + waiting != live requests";
  for (const Seq* s : running_) {
    const int32_t len = static_cast<int32_t>(s->tokens.size());
    const int32_t nb = static_cast<int32_t>(s->table.blocks.size());
    if (!s->running) return "request " + str(s->id) + " in running list but not running";
    if (s->num_computed >= len) return "request " + str(s->id) + " has no token left to compute";
    if (nb < bm_.blocks_for(s->num_computed) || nb > bm_.blocks_for(len))
      return "request " + str(s->id) + ": block table (" + str(nb) + " blocks) does not cover " +
             str(s->num_computed) + " computed of " + str(len) + " tokens";
    live.push_back({&s->table, s->tokens.data(), len, s->num_computed});
  }
  for (const Seq* s : waiting_) {
    if (s->running || !s->table.blocks.empty() || s->num_computed != 0)
      return "waiting request " + str(s->id) + " holds blocks or computed tokens";
  }
  if (cfg_.policy == Policy::kGuaranteedNoEvict && bm_.num_free() < outstanding_promises())
    return "guaranteed_no_evict: promised blocks exceed free blocks";
  (void)tpb;
  return bm_.check(live);
}

int32_t Scheduler::set_last_tokens(const int64_t* ids, const int32_t* tokens, size_t n) {
  int32_t patched = 0;
  for (size_t k = 0; k < n; ++k) {
    auto* t = const_cast<std::vector<int32_t>*>(this->tokens(ids[k]));
    if (t == nullptr || t->empty()) continue;
    t->back() = tokens[k];
    ++patched;
  }
  return patched;
}

const std::vector<int32_t>* Scheduler::tokens(int64_t id) const {
  auto it = seqs_.find(id);
  if (it != seqs_.end()) return &it->second->tokens;
  for (const auto& s : done_)
    if (s->id == id) return &s->tokens;
  return nullptr;
}

}  // namespace ingot
