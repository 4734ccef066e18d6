#!/usr/bin/env bash
# Installs ingot with its test extras on a fresh CPU machine, then runs the test suite.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
# NOTE: torch 2.13.0 is the CPU build on this machine kind's local disk; pinning it first keeps
# pip from pulling a multi-GB CUDA build for the `torch` requirement.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[test]"
# style first (fast): ruff for Python, clang-format for the C++ core
python3 -m ruff check . && python3 -m ruff format --check . > /dev/null
clang-format --dry-run --Werror runtime/csrc/*.cpp runtime/csrc/*.h
python3 -m pytest -q -m "not gpu" "$@"
