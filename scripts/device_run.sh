#!/usr/bin/env bash
# Run THERE (the GPU machine), in the repository root: install the carried wheels, stage the
# model, then run the GPU tests and the benchmark, writing logs and JSON under $OUT.
#   scripts/device_run.sh [STAGES] [pytest -k expression]
# STAGES: comma-separated among dmon, tune, attn, ncu, timeline, trace, profile, steps8b, checks, bench, bench8b, tests
#         (default: bench,bench8b,tests); ACTS (default q8, llama.cpp's scheme; "q8 f32" benches both), QTYPE8B (default Q8_0).
# Time limits (seconds) per stage: BENCH_S, BENCH8B_S, TESTS_S (one device call runs at most 600 s).
# The model arrives in two parts over two consecutive calls (each carries one of
# .stage/smollm2.part00 / part01, and one of them .stage/smollm2.sha256 too: the parts are only
# joined when the checksum is there); parts are kept in /tmp/ninfer-stage while the machine is warm.
# Without the joined file the real-GGUF tests fall back to the model cache, which is empty there.
set -uo pipefail
WHAT=,${1:-bench,bench8b,tests},
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
KEXPR=${2:-}
OUT=${OUT:-/tmp/ninfer-out}
mkdir -p "$OUT" /tmp/ninfer-stage
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.done || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD
cp -n .stage/smollm2.part* .stage/smollm2.sha256 /tmp/ninfer-stage/ 2>/dev/null || true
GGUF=/tmp/ninfer-stage/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GGUF" ] && [ -f /tmp/ninfer-stage/smollm2.part00 ] && [ -f /tmp/ninfer-stage/smollm2.part01 ]; then
  cat /tmp/ninfer-stage/smollm2.part00 /tmp/ninfer-stage/smollm2.part01 > "$GGUF"
  [ "$(sha256sum "$GGUF" | awk '{print $1}')" = "$(cat /tmp/ninfer-stage/smollm2.sha256)" ] || { echo "model checksum mismatch"; rm -f "$GGUF"; }
fi
[ -f "$GGUF" ] && export NINFER_TEST_GGUF=$GGUF
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import numpy, numba, numba_cuda; print('numpy', numpy.__version__, 'numba', numba.__version__)" | tee -a "$OUT/gpu.txt"

has() { [[ "$WHAT" == *",$1,"* ]]; }
if has dmon; then  # SM / memory clocks and power once a second while the rest runs
  nvidia-smi dmon -s pc -d 1 > "$OUT/dmon.txt" 2>&1 &
fi
if has tune; then  # single-kernel device times at model shapes (GEMV variants, RMSNorm, attention)
  timeout ${TUNE_S:-150} python3 -m tools.gemv_tune --json "$OUT/tune.json" 2>&1 | tail -n 80 > "$OUT/tune.txt"
fi
if has attn; then  # decode attention paths alone, us a layer
  timeout ${ATTN_S:-200} python3 -m tools.attn_tune --shapes llama3-8b,smollm2-135m --rows 1,4,16 \
    --contexts 128,192,256 --variants 8x4 --json "$OUT/attn.json" 2>&1 | grep '"speedup"' | tee "$OUT/attn.txt"
fi
if has ncu; then  # device time of every kernel of one captured decode step
  NCU="ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv"
  NACT=${ACTS%% *}; NACT=${NACT:-q8}  # the first of ACTS
  timeout ${NCU_S:-120} $NCU python3 -m tools.profile ${NINFER_TEST_GGUF:-} --ncu --streams 1,64 --activations $NACT > "$OUT/ncu_smollm2.csv" 2>&1
  [ "${NCU8B_S:-150}" != 0 ] && timeout ${NCU8B_S:-150} $NCU python3 -m tools.profile --random llama3-8b --ncu --streams 1 --activations $NACT > "$OUT/ncu_8b.csv" 2>&1
  tail -n 3 "$OUT"/ncu_*.csv
fi
if has timeline; then  # one 8B Q8_0 decode graph replay under Nsight Systems, kernel by kernel (if nsys is there)
  NSYS=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/bin/nsys 2>/dev/null | head -n 1)
  if [ -n "$NSYS" ]; then
    timeout ${TIMELINE_S:-200} "$NSYS" profile --cuda-graph-trace=node --capture-range=cudaProfilerApi -f true -o /tmp/step8b \
      python3 -m tools.profile --random llama3-8b --random-qtype Q8_0 --activations q8 --ncu --streams 1 \
      > "$OUT/timeline.log" 2>&1
    "$NSYS" stats --report cuda_gpu_trace --format csv --output /tmp/step8b /tmp/step8b.nsys-rep >> "$OUT/timeline.log" 2>&1
    cp /tmp/step8b_cuda_gpu_trace.csv "$OUT/" 2>/dev/null
    python3 scripts/timeline_summary.py /tmp/step8b_cuda_gpu_trace.csv 2>&1 | tee "$OUT/timeline.txt"
  else
    echo "timeline: no nsys on this machine" | tee "$OUT/timeline.txt"
  fi
fi
if has trace; then  # the 8B Q8_0 one-stream step kernel by kernel through CUPTI (.whl/trace: cupti-python + libcupti)
  if [ -d .whl/trace ] && [ ! -f /tmp/cupti/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/cupti .whl/trace/*.whl \
      && touch /tmp/cupti/.done
  fi
  PYTHONPATH=$PYTHONPATH:/tmp/cupti LD_LIBRARY_PATH=/tmp/cupti/nvidia/cu13/lib:${LD_LIBRARY_PATH:-} \
    timeout ${TRACE_S:-240} python3 -m tools.profile --random llama3-8b --random-qtype Q8_0 --activations q8 \
    --streams 1 --rounds 1 --steps 20 --trace ${TRACE_REPS:-10} --variant "default:" ${TRACE_VARIANTS:-} \
    --json "$OUT/trace.json" 2>&1 | grep -v "uploading weights" | tee "$OUT/trace.txt"
fi
if has profile; then
  MODEL_ARG=${NINFER_TEST_GGUF:-}
  timeout ${PROFILE_S:-90} python3 -m tools.profile $MODEL_ARG --streams 1,16,64 2>&1 | grep -v "uploading weights" | tee "$OUT/profile.txt"
  timeout ${PROFILE8B_S:-120} python3 -m tools.profile --random llama3-8b --streams 1,16 --steps 10 2>&1 | grep -v "uploading weights" | tee -a "$OUT/profile.txt"
fi
if has steps8b; then  # the 8B Q8_0 one-stream step: in-step cost of each launch kind, then A/B variants
  timeout ${STEPS8B_S:-540} python3 -m tools.profile --random llama3-8b --random-qtype Q8_0 --activations q8 \
    --streams 1 --rounds 2 --steps 20 --remove qkv,attention,combine,o,norm,gate_up,down,head,sampler \
    --variant "nosplit:one_row_split=False" \
    --variant "split12:wide_shape={'Q8_0': (1, 2)}" --variant "wide22:wide_shape={'Q8_0': (2, 2)}" \
    --variant "rope_u4:rope_unroll=4" --variant "swiglu_u4:swiglu_unroll=4" \
    --variant "stats1:split_stats=False" --variant "plain_loads:evict_first=False" --variant "no_pdl:pdl=False" \
    --json "$OUT/steps8b.json" 2>&1 | grep -v "uploading weights" | tee "$OUT/steps8b.txt"
fi
if has bench; then  # the staged real GGUF if there is one, else random weights of its shape
  for ACT in ${ACTS:-q8}; do
    timeout ${BENCH_S:-100} python3 -m ninfer.cli.bench ${NINFER_TEST_GGUF:---random smollm2-135m} --backend cuda \
      --anchors llamacpp-h200 --activations $ACT --prompt-lens 512,4096 --json "$OUT/bench_smollm2_$ACT.json" 2>&1 \
      | grep -v "loading " | tee -a "$OUT/bench_smollm2.txt"
  done
fi
if has bench8b; then
  for ACT in ${ACTS8B:-${ACTS:-q8}}; do
    timeout ${BENCH8B_S:-150} python3 -m ninfer.cli.bench --random llama3-8b --random-qtype ${QTYPE8B:-Q8_0} --backend cuda \
      --streams 1,4 --prompt-lens 128 --decode-tokens 64 --repeats 2 --activations $ACT 2>&1 \
      | grep -v "uploading weights" | tee -a "$OUT/bench_8b.txt"
  done
fi
if has checks; then  # tests/cuda/kernel_checks.py real, one process a check (CHECKS="..." to choose)
  for C in ${CHECKS:-lookahead runner sampler attn_decode gemv_epilogue rmsnorm qkv_post gemv_q8}; do
    timeout ${CHECK_S:-150} python3 tests/cuda/kernel_checks.py real $C 2>&1 | tail -c 3000 | tee -a "$OUT/checks.txt"
  done
fi
if has tests; then
  SEL=(-m gpu)
  [ -n "$KEXPR" ] && SEL+=(-k "$KEXPR")
  LOG="$OUT/pytest-$(echo "${KEXPR:-all}" | tr -c 'a-zA-Z0-9_\n' _).log"  # one log per selection: a second run keeps the first's
  timeout ${TESTS_S:-300} python3 -m pytest tests/test_gpu_runner.py tests/cuda "${SEL[@]}" -q -p no:cacheprovider --timeout 240 -rfE \
    2>&1 | tee "$LOG" | tail -60
fi
