#!/usr/bin/env bash
# Run HERE (the CPU machine), from anywhere: prepares what a bare GPU machine lacks.
#   scripts/device_prepare.sh          for scripts/device_run.sh (the kernel lab):
#     .whl/    wheels for Python 3.12 that the GPU tests and the bench import and the device
#              image lacks (or has in a broken version: its numpy 2.5 breaks numba-cuda 0.30);
#              .whl/trace: CUPTI for device_run.sh's trace stage (no nsys on the H100 image)
#     .stage/  the SmolLM2 GGUF in two parts (part00, part01) + sha256
#   scripts/device_prepare.sh serve    for scripts/device_serve.sh (the served path):
#     .whl/serve/  the server's runtime wheels too (quart, hypercorn, llguidance, cattrs, ...; 27 MB)
#     .stage/      the GGUF in three parts: part00 (30 MB, travels with .whl), part01, part02 + sha256
# One device call carries at most 64 MiB: name these (git-ignored) paths in each call's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODE=${1:-run}
PLATFORMS=()
for v in 39 38 35 34 31 28 27 17; do PLATFORMS+=(--platform "manylinux_2_${v}_x86_64"); done
download() {  # download DIR PACKAGES...: cp312 manylinux wheels, with their dependencies
  local dir=$1; shift
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    --platform manylinux2014_x86_64 -d "$dir" "$@"
}
GGUF=${NINFER_TEST_GGUF:-$("$PY" -c 'from ninfer.models.registry import ensure_model; print(ensure_model("smollm2-135m-instruct"))')}
mkdir -p .stage
if [ "$MODE" = serve ]; then
  mkdir -p .whl/serve
  download .whl/serve numpy==2.4.6 trio==0.35.0 quart==0.22.0 quart-trio==0.12.0 hypercorn==0.18.0 gguf==0.19.0 \
    llguidance==1.9.1 attrs==26.1.0 cattrs==26.2.1 platformdirs==4.14.9 tqdm==4.70.1 rich==15.0.0 \
    prompt-toolkit==3.0.53 threadpoolctl==3.8.0 pytest-trio==0.8.0 safetensors==0.8.0
  # byte ranges with dd (a `tail | head` pipeline dies of SIGPIPE under pipefail)
  dd if="$GGUF" of=.stage/smollm2.part00 bs=1M iflag=count_bytes count=30000000 status=none
  dd if="$GGUF" of=.stage/smollm2.part01 bs=1M iflag=skip_bytes,count_bytes skip=30000000 count=34000000 status=none
  dd if="$GGUF" of=.stage/smollm2.part02 bs=1M iflag=skip_bytes skip=64000000 status=none
else
  mkdir -p .whl/trace
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    numpy==2.4.6 gguf==0.19.0 trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 pytest-trio==0.8.0 threadpoolctl==3.8.0
  # device_run.sh's `trace` stage: CUPTI's Python bindings and library, matched to the driver's CUDA 13.0
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_25_x86_64 --platform manylinux_2_17_x86_64 -d .whl/trace \
    cupti-python==13.0.1 nvidia-cuda-cupti==13.0.85
  # uneven parts: the first travels with the wheels (17 MB), the second alone
  head -c 40000000 "$GGUF" > .stage/smollm2.part00
  tail -c +40000001 "$GGUF" > .stage/smollm2.part01
fi
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")") | awk '{print $1}' > .stage/smollm2.sha256
ls -la .whl .stage
