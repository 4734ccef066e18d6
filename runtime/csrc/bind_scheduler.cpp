// Scheduler bindings: plan buffers are numpy views over C++-owned memory (no per-step copies).
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "bindings.h"
#include "scheduler.h"

namespace ingot {

namespace {

// Full-capacity views of every plan buffer; Python slices them to the plan's sizes.
nb::dict plan_buffers(nb::handle self) {
  Scheduler& s = nb::cast<Scheduler&>(self);
  PlanBuffers& b = s.buffers();
  const size_t B = s.config().max_batch_size, T = s.config().max_num_tokens;
  nb::dict d;
  d["seq_ids"] = view1d<int64_t>(b.seq_ids.data(), B, self);
  d["num_new_tokens"] = view1d<int32_t>(b.num_new_tokens.data(), B, self);
  d["num_computed"] = view1d<int32_t>(b.num_computed.data(), B, self);
  d["context_lens"] = view1d<int32_t>(b.context_lens.data(), B, self);
  d["query_start_loc"] = view1d<int32_t>(b.query_start_loc.data(), B + 1, self);
  d["samples"] = view1d<bool>(b.samples.get(), B, self);
  d["input_ids"] = view1d<int32_t>(b.input_ids.data(), T, self);
  d["positions"] = view1d<int32_t>(b.positions.data(), T, self);
  d["slot_mapping"] = view1d<int32_t>(b.slot_mapping.data(), T, self);
  size_t shape[2] = {B, static_cast<size_t>(s.max_blocks_per_seq())};
  d["block_tables"] = nb::ndarray<nb::numpy, int32_t>(b.block_tables.data(), 2, shape, self);
  return d;
}

nb::dict stats(const Scheduler& s) {
  const BlockManager& bm = s.block_manager();
  const PrefixStats& st = bm.stats();
  nb::dict d;
  d["prefix_hit_blocks"] = st.hit_blocks;
  d["prefix_miss_blocks"] = st.miss_blocks;
  d["prefix_hit_tokens"] = st.hit_tokens;
  d["num_preemptions"] = s.num_preemptions();
  d["num_running"] = s.num_running();
  d["num_waiting"] = s.num_waiting();
  d["used_blocks"] = bm.num_used();
  d["cached_blocks"] = bm.num_evictable();
  d["free_blocks"] = bm.num_free() - bm.num_evictable();
  d["kv_utilization"] = static_cast<double>(bm.num_used()) / bm.num_blocks();
  return d;
}

}  // namespace

void bind_scheduler(nb::module_& m) {
  nb::exception<RequestRefused>(m, "RequestRefused", PyExc_ValueError);
  nb::class_<Scheduler>(m, "Scheduler")
      .def("__init__",
           [](Scheduler* self, int32_t nb_, int32_t tpb, int32_t bs, int32_t nt, int32_t sl,
              int32_t policy, bool reuse, int32_t bits) {
             SchedulerConfig c{nb_, tpb, bs, nt, sl, static_cast<Policy>(policy), reuse, bits};
             new (self) Scheduler(c);
           })
      .def("add_request",
           [](Scheduler& s, int64_t id, const I32Array& prompt, int32_t max_new_tokens) {
             s.add_request(id, prompt.data(), static_cast<int32_t>(prompt.shape(0)),
                           max_new_tokens);
           })
      .def("schedule",
           [](Scheduler& s) {
             s.schedule();
             return std::make_tuple(s.plan_num_seqs(), s.plan_num_tokens(), s.plan_num_prefill(),
                                    s.preempted());
           })
      .def("update",
           [](Scheduler& s, const I32Array& new_tokens, const I8Array& finish) {
             if (new_tokens.shape(0) != finish.shape(0))
               throw nb::value_error("new_tokens and finish must have the same length");
             return s.update(new_tokens.data(), finish.data(), new_tokens.shape(0));
           })
      .def("cancel", &Scheduler::cancel)
      .def("set_last_tokens",
           [](Scheduler& s, const I64Array& ids, const I32Array& tokens) {
             if (ids.shape(0) != tokens.shape(0))
               throw nb::value_error("ids and tokens must have the same length");
             return s.set_last_tokens(ids.data(), tokens.data(), ids.shape(0));
           })
      .def("has_unfinished", &Scheduler::has_unfinished)
      .def("num_free_blocks", &Scheduler::num_free_blocks)
      .def("check_integrity", &Scheduler::check_integrity)
      .def("stats", &stats)
      .def("plan_buffers", &plan_buffers)
      .def_prop_ro("max_blocks_per_seq", &Scheduler::max_blocks_per_seq)
      .def("ref_count",
           [](const Scheduler& s, int32_t b) {
             if (b < 0 || b >= s.block_manager().num_blocks())
               throw nb::index_error("block id out of range");
             return s.block_manager().ref_count(b);
           })
      .def("tokens", [](const Scheduler& s, int64_t id) {
        const std::vector<int32_t>* t = s.tokens(id);
        if (t == nullptr) throw nb::key_error(("unknown request " + std::to_string(id)).c_str());
        // A copy: the request may finish and be freed later.
        auto* copy = new std::vector<int32_t>(*t);
        nb::capsule owner(copy,
                          [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
        return view1d<int32_t>(copy->data(), copy->size(), owner);
      });
}

}  // namespace ingot
