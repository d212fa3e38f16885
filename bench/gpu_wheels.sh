#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (its image has torch, numpy, uvloop, cython, yaml,
# prometheus-client, psutil; no registry), for bench/bench_gpu_session.sh's `setup` step:
# downloaded here into .whl/ (git-ignored) at the versions of constraints.txt, for the
# machine's CPython 3.12 on x86-64; carry `.whl` with the call.
# usage: bash bench/gpu_wheels.sh [PYTHON]   (PYTHON: the pip to use, default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
NAMES="annotated-doc annotated-types anyio h11 fastapi httptools orjson PuLP pydantic
pydantic_core pysimdjson starlette typing-inspection typing_extensions uvicorn opentelemetry-api
py-spy"
pins=()
for n in $NAMES; do
  pin=$(grep -i -E "^${n//[-_]/[-_]}==" constraints.txt) || { echo "no pin for $n in constraints.txt" >&2; exit 2; }
  pins+=("$pin")
done
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls .whl
