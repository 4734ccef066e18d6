// Module entry point for ingot.runtime._core.
#include "bindings.h"

NB_MODULE(_core, m) {
  m.doc() = "ingot runtime core: paged KV block manager and inflight-batching scheduler";
  ingot::bind_block_manager(m);
  ingot::bind_scheduler(m);
}
