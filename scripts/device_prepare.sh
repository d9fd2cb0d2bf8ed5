#!/usr/bin/env bash
# Run HERE (the CPU machine), from anywhere: prepares what a bare GPU machine lacks.
#   .whl/    wheels for Python 3.12 that the GPU tests and the bench import and the device
#            image lacks (or has in a broken version: its numpy 2.5 breaks numba-cuda 0.30);
#            .whl/trace: CUPTI for device_run.sh's trace stage (no nsys on the H100 image)
#   .stage/  the SmolLM2 GGUF in two parts (one device call carries at most 64 MiB) + sha256
# Both folders are git-ignored; name them in the device call's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl .stage
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  numpy==2.4.6 gguf==0.19.0 trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 pytest-trio==0.8.0 threadpoolctl==3.8.0
# device_run.sh's `trace` stage: CUPTI's Python bindings and library, matched to the driver's CUDA 13.0
mkdir -p .whl/trace
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_25_x86_64 --platform manylinux_2_17_x86_64 -d .whl/trace \
  cupti-python==13.0.1 nvidia-cuda-cupti==13.0.85
GGUF=${NINFER_TEST_GGUF:-$("$PY" -c 'from ninfer.models.registry import ensure_model; print(ensure_model("smollm2-135m-instruct"))')}
# uneven parts: the first travels with the wheels (17 MB), the second alone
head -c 40000000 "$GGUF" > .stage/smollm2.part00
tail -c +40000001 "$GGUF" > .stage/smollm2.part01
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")") | awk '{print $1}' > .stage/smollm2.sha256
ls -la .whl .stage
