#!/usr/bin/env bash
# Downloads (here, where PyPI is reachable) the wheels the GPU machine lacks for quantization:
# nvidia-modelopt and the dependencies its image lacks or has too old (modelopt needs pulp<4;
# pydantic pins its pydantic-core), for Python 3.12 on x86-64.
# The device call then names `.whl` in `carry` and starts with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# (`.whl/` is git-ignored.)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  nvidia-modelopt omegaconf antlr4-python3-runtime "pulp<4" pydantic pydantic-core \
  annotated-types typing-inspection typing-extensions
ls -1 .whl
