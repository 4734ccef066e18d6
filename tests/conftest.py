"""Shared fixtures: tiny random HF models (made offline, cached per test session)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ingot.compiler.examples import make_tiny_hf_model

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `tiny_hf_dir(family, **kw)` -> a tiny HF model dir, made once per session.

    kw go to `make_tiny_hf_model` (dtype, seed, tie_word_embeddings, sharded,
    rope_scaling_llama3, config overrides). Treat the dir as read-only; copy it to corrupt it.
    """
    cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}

    def make(family: str, **kw: Any) -> Path:
        key = (family, tuple(sorted(kw.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"hf-{family}")
            cache[key] = make_tiny_hf_model(family, out / "model", **kw)
        return cache[key]

    return make


@pytest.fixture
def hf_copy(tmp_path: Path, tiny_hf_dir: Callable[..., Path]) -> Callable[..., Path]:
    """Factory: a writable copy of a tiny HF model dir, for tests that break it."""

    def copy(family: str = "llama", **kw: Any) -> Path:
        dst = tmp_path / f"hf-copy-{family}"
        shutil.copytree(tiny_hf_dir(family, **kw), dst)
        return dst

    return copy


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """INGOT_TEST_SHARD="i/n": keep every n-th collected test from the i-th (interp_rerun's
    shards of a long interpreter module; round robin spreads a slow function's cases)."""
    shard = os.environ.get("INGOT_TEST_SHARD")
    if not shard:
        return
    i, n = (int(v) for v in shard.split("/"))
    config.hook.pytest_deselected(items=[t for k, t in enumerate(items) if k % n != i])
    items[:] = items[i::n]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """INGOT_FAILURE_LOG=FILE: append each failure's report as it happens (with xdist, in the
    controller). The GPU round runs under a time limit that can cut pytest off before its
    summary; this keeps the reasons of the failures that came before."""
    path = os.environ.get("INGOT_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
