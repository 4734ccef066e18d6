// Standalone block manager for tests: sequences keyed by id, check-then-commit calls.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <unordered_map>

#include "bindings.h"
#include "block_manager.h"

namespace ingot {

namespace {

struct PySeq {
  BlockTable table;
  std::vector<int32_t> tokens;
  int32_t num_computed = 0;
};

class PyBlockManager {
 public:
  PyBlockManager(int32_t num_blocks, int32_t tokens_per_block, bool prefix_reuse, int32_t bits)
      : bm(num_blocks, tokens_per_block, prefix_reuse, bits) {}
  PyBlockManager(const PyBlockManager&) = delete;
  PyBlockManager& operator=(const PyBlockManager&) = delete;

  PySeq& get(int64_t id) {
    auto it = seqs.find(id);
    if (it == seqs.end()) throw nb::key_error(("unknown sequence " + std::to_string(id)).c_str());
    return *it->second;
  }

  // Blocks the whole token list would need beyond its reusable prefix, and the prefix.
  int32_t need(const I32Array& tokens, int32_t* matched) {
    int32_t evictable = 0;
    const int32_t len = static_cast<int32_t>(tokens.shape(0));
    *matched = bm.match_prefix(tokens.data(), len, &scratch, &evictable);
    return bm.blocks_for(len) - *matched + evictable;
  }

  BlockManager bm;
  std::unordered_map<int64_t, std::unique_ptr<PySeq>> seqs;
  std::vector<int32_t> scratch;
};

}  // namespace

void bind_block_manager(nb::module_& m) {
  nb::class_<PyBlockManager>(m, "BlockManager")
      .def(nb::init<int32_t, int32_t, bool, int32_t>(), nb::arg("num_blocks"),
           nb::arg("tokens_per_block"), nb::arg("enable_prefix_reuse") = true,
           nb::arg("hash_bits") = 64)
      .def_prop_ro("num_blocks", [](PyBlockManager& s) { return s.bm.num_blocks(); })
      .def_prop_ro("tokens_per_block", [](PyBlockManager& s) { return s.bm.tokens_per_block(); })
      .def("num_free_blocks", [](PyBlockManager& s) { return s.bm.num_free(); })
      .def("num_cached_blocks", [](PyBlockManager& s) { return s.bm.num_evictable(); })
      .def("num_used_blocks", [](PyBlockManager& s) { return s.bm.num_used(); })
      .def("ref_count",
           [](PyBlockManager& s, int32_t b) {
             if (b < 0 || b >= s.bm.num_blocks()) throw nb::index_error("block id out of range");
             return s.bm.ref_count(b);
           })
      .def("can_allocate",
           [](PyBlockManager& s, int64_t id, const I32Array& tokens) {
             int32_t matched;
             return !s.seqs.count(id) && s.need(tokens, &matched) <= s.bm.num_free();
           })
      .def("allocate",
           [](PyBlockManager& s, int64_t id, const I32Array& tokens) {
             if (s.seqs.count(id)) throw nb::value_error("sequence already allocated");
             int32_t matched;
             if (s.need(tokens, &matched) > s.bm.num_free())
               throw std::runtime_error("not enough free blocks (call can_allocate first)");
             const int32_t len = static_cast<int32_t>(tokens.shape(0));
             auto seq = std::make_unique<PySeq>();
             seq->tokens.assign(tokens.data(), tokens.data() + len);
             s.bm.record_match(matched,
                               s.bm.prefix_reuse() ? (len - 1) / s.bm.tokens_per_block() : 0);
             s.bm.share(&seq->table, s.scratch);
             s.bm.grow(&seq->table, len);
             seq->num_computed = matched * s.bm.tokens_per_block();
             s.seqs.emplace(id, std::move(seq));
             return matched * s.bm.tokens_per_block();
           })
      .def("can_append",
           [](PyBlockManager& s, int64_t id, int32_t num_tokens) {
             return s.bm.can_grow(s.get(id).table, num_tokens);
           })
      .def("append",
           [](PyBlockManager& s, int64_t id, int32_t num_tokens) {
             PySeq& q = s.get(id);
             if (!s.bm.can_grow(q.table, num_tokens))
               throw std::runtime_error("not enough free blocks (call can_append first)");
             s.bm.grow(&q.table, num_tokens);
           })
      .def("mark_computed",
           [](PyBlockManager& s, int64_t id, const I32Array& tokens, int32_t num_computed) {
             PySeq& q = s.get(id);
             const int32_t len = static_cast<int32_t>(tokens.shape(0));
             if (num_computed > len ||
                 s.bm.blocks_for(num_computed) > static_cast<int32_t>(q.table.blocks.size()))
               throw nb::value_error("num_computed exceeds the tokens or the block table");
             q.tokens.assign(tokens.data(), tokens.data() + len);
             q.num_computed = num_computed;
             s.bm.mark_computed(&q.table, q.tokens.data(), num_computed);
           })
      .def("free",
           [](PyBlockManager& s, int64_t id) {
             auto it = s.seqs.find(id);
             if (it == s.seqs.end()) return false;
             s.bm.release(&it->second->table);
             s.seqs.erase(it);
             return true;
           })
      .def(
          "block_table",
          [](nb::handle self, int64_t id) {
            PySeq& q = nb::cast<PyBlockManager&>(self).get(id);
            return view1d<int32_t>(q.table.blocks.data(), q.table.blocks.size(), self);
          },
          "View of the sequence's block ids; valid until its next allocate/append/free.")
      .def("stats",
           [](PyBlockManager& s) {
             const PrefixStats& st = s.bm.stats();
             nb::dict d;
             d["prefix_hit_blocks"] = st.hit_blocks;
             d["prefix_miss_blocks"] = st.miss_blocks;
             d["prefix_hit_tokens"] = st.hit_tokens;
             return d;
           })
      .def("check_integrity", [](PyBlockManager& s) {
        std::vector<TableView> live;
        for (auto& kv : s.seqs) {
          PySeq& q = *kv.second;
          live.push_back(
              {&q.table, q.tokens.data(), static_cast<int32_t>(q.tokens.size()), q.num_computed});
        }
        return s.bm.check(live);
      });
}

}  // namespace ingot
