"""Versions written into every artifact."""

from __future__ import annotations

INGOT_VERSION = "0.1.0"
CHECKPOINT_FORMAT = "ingot-checkpoint"  # config.json "format" of convert-checkpoint's output
CHECKPOINT_FORMAT_VERSION = 1
ENGINE_FORMAT_VERSION = 1
