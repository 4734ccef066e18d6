"""scripts/replay_scheduler.py: how a step's prompt rows fall into the FP8 pool's V windows."""

from __future__ import annotations

import numpy as np
from scripts_import import load_script


def test_a_chunk_mid_block_shifts_every_later_prompt_off_the_row_grid():
    mod = load_script("replay_scheduler")
    # a 37-token chunk from offset 11 of block 3, then a 64-token prompt from block 8's start:
    # no 32-row group from row 0 is one whole window in order, though the prompt's two
    # windows are whole (the chunk writes two in part)
    slots = np.concatenate([3 * 32 + 11 + np.arange(37), 8 * 32 + np.arange(64)])
    assert mod.count(slots) == {
        "row_grid_groups": 4,
        "row_grid_whole": 0,
        "windows_whole": 2,
        "windows_partial": 2,
    }
    # the same prompt alone, from row 0: its two groups are whole on the row grid too
    assert mod.count(8 * 32 + np.arange(64))["row_grid_whole"] == 2
