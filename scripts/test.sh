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
# NOTE: one worker a core (TEST_WORKERS=0: in this process); the interpreter reruns and the
# engine tests are long, so two workers take about half the time; one torch thread each, as
# two workers' default threads a core each would make four on this machine kind's two cores
workers=${TEST_WORKERS:-auto}
[[ "$workers" == 0 ]] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python3 -m pytest -q -m "not gpu" -n "$workers" "$@"
