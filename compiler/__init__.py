"""HF -> ingot checkpoint conversion, the checkpoint format, and (later) the engine build."""

from __future__ import annotations
