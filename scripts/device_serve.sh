#!/usr/bin/env bash
# Run THERE (the GPU machine), in the repository root: the served path, end to end.
#   scripts/device_serve.sh STAGES
# STAGES (comma-separated):
#   setup   install the carried wheels (.whl/serve, made here by `scripts/device_prepare.sh serve`)
#           and join the model parts (.stage/smollm2.part00..02 + .stage/smollm2.sha256, carried
#           over consecutive calls: one call carries at most 64 MiB)
#   serve   `ninfer serve` (this tree, default flags; SERVE_FLAGS adds some) driven by
#           `ninfer bench serve` at 1,4,16,64 streams, 256 tokens each, two passes (cold, steady)
#   restart `ninfer serve` again on the kernel cache the serve stage filled (the warm restart's ready
#           time goes to ready.txt beside the cold one), one pass
#   ready   start-up only: `ninfer serve` of this tree and of the base tree, each started READY_STARTS
#           times (default 2: the first fills the tree's kernel cache), ready times to ready.txt
#   base    the same against the tree in .stage/base.tar.gz (an earlier commit; BASE_FLAGS)
#   prefix  the shared-prefix load: a ~2,000-token system prompt, ~150 new tokens, 64 out
#   baseprefix  the same against the tree in .stage/base.tar.gz
#   gaps    `ninfer serve --frame-gap-us G` for each G in GAPS (default 250 500 1000), GAP_STREAMS streams
#   host    the host path alone: scripts/serve_host_path.py (no model compute, STEP_MS a step)
#   rerank  scripts/bench_rerank.py (RERANK_DOCS documents, default 256) against `ninfer serve` of this tree
#   score   `ninfer score` of the held-out text: f32 vs q8 (decode path) and vs the CPU reference backend
#   warmtime  scripts/warm_time.py (random WARM_SHAPE, no model file): cold, then warm kernel cache with
#           KernelPlan.capture_once off and on (the graph recording's A/B)
#   warmprof  tools/warmup_profile.py twice (cold, then warm kernel cache): cProfile of the warm-up
#           (WARM_MODEL: default the staged GGUF; "--random smollm2-135m" needs no model file)
#   tests   the GPU tests (TESTS: pytest arguments)
#   hybench `ninfer bench --random qwen35-27b` (HY_SHAPE, HY_QTYPE, HY_STREAMS, HY_PROMPTS): the hybrid at scale
#   bench   `ninfer bench` decode / prefill of this tree and of the base tree when one is staged
#           (BENCH_MODEL: default the staged GGUF; `--random smollm2-135m` needs no model file;
#           BENCH_STREAMS, default 1,16,64)
#   peerbuild  build llama-server (and llama-batched-bench) once, with CUDA for sm_90, from the
#           llama.cpp source tarball LLAMA_SRC (default .stage/llama_src.tar.gz: llama.cpp without
#           models/ docs/ tests/ examples/, ~9 MB) into /tmp/llama-build; skipped when the binary is
#           there (the machine keeps /tmp while it stays warm); log to peer_build.log
#   peer    llama-server on the staged file (`-np 64 -c PEER_CTX -fa on -ngl 99`, PEER_CTX default
#           64 x 512; PEER_FLAGS adds some) driven by the serve stage's load (`ninfer bench serve`,
#           STREAMS, 256 tokens, two passes); builds it first when needed; peer.txt, peer.json
#   peerprefix  the prefix stage's load against llama-server (`-c PEERPREFIX_CTX`, default
#           64 x 2560); peerprefix.txt, peerprefix.json
# After the stages, every pass of every load run in this invocation is printed as one table.
# Logs and JSON go under $OUT.
set -uo pipefail
WHAT=,${1:-setup},
REPO=$PWD
OUT=${OUT:-/tmp/ninfer-out}
mkdir -p "$OUT" /tmp/ninfer-stage
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 NINFER_CACHE_DIR=${NINFER_CACHE_DIR:-/tmp/ninfer-cache}
has() { [[ "$WHAT" == *",$1,"* ]]; }
ROOT=$PWD
if [ -d .whl/serve ] && [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/serve/*.whl \
    && touch /tmp/site/.done || { echo "wheel install failed"; exit 1; }
fi
cp -n .stage/smollm2.* /tmp/ninfer-stage/ 2>/dev/null || true
GGUF=/tmp/ninfer-stage/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GGUF" ] && ls /tmp/ninfer-stage/smollm2.part02 /tmp/ninfer-stage/smollm2.sha256 >/dev/null 2>&1; then
  cat /tmp/ninfer-stage/smollm2.part0[0-2] > "$GGUF"
  [ "$(sha256sum "$GGUF" | awk '{print $1}')" = "$(cat /tmp/ninfer-stage/smollm2.sha256)" ] || { echo "model checksum mismatch"; rm -f "$GGUF"; }
fi
[ -f "$GGUF" ] && export NINFER_TEST_GGUF=$GGUF
if [ -f .stage/base.tar.gz ] && [ ! -d /tmp/base ]; then mkdir -p /tmp/base && tar xzf .stage/base.tar.gz -C /tmp/base; fi
# .stage/new.tar.gz (optional): the tree to measure, when the carried work tree holds unfinished edits
if [ -f .stage/new.tar.gz ]; then
  rm -rf /tmp/new && mkdir -p /tmp/new && tar xzf .stage/new.tar.gz -C /tmp/new && ROOT=/tmp/new && cd /tmp/new
fi
ninfer() { local tree=$1; shift; PYTHONPATH=/tmp/site:$tree python3 -m ninfer.cli.main "$@"; }

# wait_ready: poll /health on PORT until it answers 200 (or the server PID exits, or READY_S pass)
wait_ready() {
  for _ in $(seq ${READY_S:-300}0); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:$PORT/health)" = 200 ] && return 0
    kill -0 $PID 2>/dev/null || return 1
    sleep 0.1
  done
}

# start_server LABEL TREE "SERVE FLAGS": start `ninfer serve`, wait for /health; sets PORT and PID
start_server() {
  local label=$1 tree=$2 flags=$3 t0=$(date +%s%N)
  PORT=$((8100 + RANDOM % 800))
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree exec python3 -m ninfer.cli.main serve "$GGUF" --port $PORT \
     --max-concurrency 64 $flags > "$OUT/serve_$label.log" 2>&1) &
  PID=$!
  wait_ready
  echo "$label: ready after $(( ($(date +%s%N) - t0) / 1000000 )) ms; $(grep -o 'warmed up.*' "$OUT/serve_$label.log" | tail -1)" \
    | tee -a "$OUT/ready.txt"
}
stop_server() { kill -INT $PID 2>/dev/null; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }

# drive LABEL TEXT BENCH ARGS...: `ninfer bench serve` of this tree against the server on PORT; the
# table goes to TEXT (lines prefixed with LABEL), the JSON to bench_LABEL.json (JSONS: this call's)
JSONS=()
drive() {
  local label=$1 text=$2; shift 2
  PYTHONPATH=/tmp/site:$ROOT timeout ${BENCH_SERVE_S:-240} python3 -m ninfer.cli.main bench serve \
    --url http://127.0.0.1:$PORT --json "$OUT/bench_$label.json" "$@" 2>/dev/null \
    | sed "s/^/$label /" | tee -a "$text"
  JSONS+=("$OUT/bench_$label.json")
}

# serve_and_bench LABEL TREE "SERVE FLAGS" BENCH ARGS...: start, wait for /health, bench, stop
serve_and_bench() {
  local label=$1 tree=$2 flags=$3; shift 3
  start_server "$label" "$tree" "$flags"
  drive "$label" "$OUT/served.txt" "$@"
  curl -s localhost:$PORT/admin/stats > "$OUT/stats_$label.json"; curl -s localhost:$PORT/metrics > "$OUT/metrics_$label.txt"
  stop_server
}

# The peer: llama-server of the llama.cpp sources in LLAMA_SRC, built once into /tmp/llama-build.
LLAMA_SERVER=/tmp/llama-build/bin/llama-server
build_peer() {
  [ -x "$LLAMA_SERVER" ] && return 0
  local src=${LLAMA_SRC:-$REPO/.stage/llama_src.tar.gz} t0=$(date +%s) gen=Ninja
  [ -f "$src" ] || { echo "peer: no llama.cpp sources at $src"; return 1; }
  export PATH=$PATH:/usr/local/cuda/bin
  command -v ninja >/dev/null || gen="Unix Makefiles"
  echo "peer: cmake $(command -v cmake || echo missing), ninja $(command -v ninja || echo missing), nvcc $(command -v nvcc || echo missing)"
  rm -rf /tmp/llama-src && mkdir -p /tmp/llama-src && tar xzf "$src" -C /tmp/llama-src || return 1
  local dir=$(ls -d /tmp/llama-src/*/ | head -1)
  { cmake -S "$dir" -B /tmp/llama-build -G "$gen" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_OPENSSL=OFF -DGGML_CUDA_NCCL=OFF \
    && timeout ${PEER_BUILD_S:-540} cmake --build /tmp/llama-build --target llama-server llama-batched-bench -j${PEER_JOBS:-16}
  } > "$OUT/peer_build.log" 2>&1
  local rc=$?
  tail -n 5 "$OUT/peer_build.log"
  echo "peer: build rc $rc after $(( $(date +%s) - t0 )) s"
  [ -x "$LLAMA_SERVER" ]
}

# start_peer LABEL CTX: llama-server on the staged file, wait for /health; sets PORT and PID
start_peer() {
  local label=$1 ctx=$2 t0=$(date +%s%N)
  PORT=$((8100 + RANDOM % 800))
  "$LLAMA_SERVER" -m "$GGUF" -np ${PEER_NP:-64} -c $ctx -fa on -ngl 99 --host 127.0.0.1 --port $PORT ${PEER_FLAGS:-} \
    > "$OUT/peer_server_$label.log" 2>&1 &
  PID=$!
  wait_ready
  echo "$label: llama-server ready after $(( ($(date +%s%N) - t0) / 1000000 )) ms ($LLAMA_SERVER -np ${PEER_NP:-64} -c $ctx -fa on -ngl 99 ${PEER_FLAGS:-})" \
    | tee -a "$OUT/ready.txt"
}

# peer_and_bench LABEL CTX BENCH ARGS...: llama-server, the same load as ninfer's, stop
peer_and_bench() {
  local label=$1 ctx=$2; shift 2
  build_peer || { echo "$label: no llama-server"; return 1; }
  start_peer "$label" "$ctx"
  drive "$label" "$OUT/$label.txt" "$@"
  mv "$OUT/bench_$label.json" "$OUT/$label.json" 2>/dev/null; JSONS[-1]="$OUT/$label.json"
  "$LLAMA_SERVER" --version > "$OUT/peer_version.txt" 2>&1
  stop_server
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
STREAMS=${STREAMS:-1,4,16,64}
if has peerbuild; then build_peer; fi
if has peer; then  # llama-server under the serve stage's load (64 slots of 512 tokens: ~170 in, 256 out)
  peer_and_bench peer ${PEER_CTX:-32768} --concurrency $STREAMS --output-tokens 256 --passes 2
fi
if has serve; then
  serve_and_bench new "$ROOT" "${SERVE_FLAGS:-}" --concurrency $STREAMS --output-tokens 256 --passes 2
fi
if has restart; then
  serve_and_bench restart "$ROOT" "${SERVE_FLAGS:-}" --concurrency $STREAMS --output-tokens 256 --passes 1
fi
if has base; then
  serve_and_bench base /tmp/base "${BASE_FLAGS:---activations q8}" --concurrency $STREAMS --output-tokens 256 --passes 2
fi
if has ready; then  # start-up alone, both trees (their kernel caches differ: the code version is in the key)
  for tree in "$ROOT" /tmp/base; do
    label=$([ "$tree" = /tmp/base ] && echo base || echo new)
    for i in $(seq ${READY_STARTS:-2}); do start_server "ready_${label}_$i" "$tree" "${SERVE_FLAGS:-}"; stop_server; done
  done
fi
if has peerprefix; then  # llama-server under the prefix stage's load (64 slots of 2,560 tokens: ~2,164 in, 64 out)
  peer_and_bench peerprefix ${PEERPREFIX_CTX:-163840} --concurrency ${PREFIX_STREAMS:-16,64} --shared-prefix-tokens 2000 \
    --prompt-tokens 150 --output-tokens 64 --passes 3
fi
if has prefix; then
  serve_and_bench prefix "$ROOT" "${SERVE_FLAGS:-}" --concurrency ${PREFIX_STREAMS:-16,64} --shared-prefix-tokens 2000 \
    --prompt-tokens 150 --output-tokens 64 --passes 3
fi
if has baseprefix; then  # the shared-prefix load against the base tree, same card
  serve_and_bench baseprefix /tmp/base "${BASE_FLAGS:---activations q8}" --concurrency ${PREFIX_STREAMS:-16,64} \
    --shared-prefix-tokens 2000 --prompt-tokens 150 --output-tokens 64 --passes 3
fi
if has gaps; then  # the frame pacing's A/B on the warm kernel cache: one server per --frame-gap-us value
  for gap in ${GAPS:-250 500 1000}; do
    serve_and_bench gap$gap "$ROOT" "--frame-gap-us $gap ${SERVE_FLAGS:-}" --concurrency ${GAP_STREAMS:-16,64} \
      --output-tokens 256 --passes 1
  done
fi
if has host; then
  for tree in "$ROOT" /tmp/base; do
    port=$((8100 + RANDOM % 800))
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree exec python3 "$ROOT/scripts/serve_host_path.py" --port $port --step-ms ${STEP_MS:-2}) > "$OUT/host_$(basename $tree).log" 2>&1 &
    pid=$!
    for _ in $(seq 120); do curl -s localhost:$port/health >/dev/null && break; sleep 0.5; done
    ninfer "$ROOT" bench serve --url http://127.0.0.1:$port --concurrency 1,16,64 --output-tokens 256 --passes 1 \
      --no-ignore-eos 2>/dev/null | sed "s/^/host-$(basename $tree) /" | tee -a "$OUT/host.txt"
    kill -9 $pid; wait $pid 2>/dev/null
  done
fi
if has rerank; then  # one query against RERANK_DOCS documents of ~200 tokens, through /v1/rerank
  start_server rerank "$ROOT" "${SERVE_FLAGS:-}"
  PYTHONPATH=/tmp/site:$ROOT timeout ${RERANK_S:-300} python3 "$ROOT/scripts/bench_rerank.py" --url http://127.0.0.1:$PORT \
    --documents ${RERANK_DOCS:-256} --json "$OUT/rerank.json" 2>&1 | tee "$OUT/rerank.txt"
  stop_server
fi
if has score; then  # ninfer score: f32 vs q8 through the decode path (KL, top-1, perplexities)
  python3 -c "import sys; sys.path.insert(0, 'tests'); from heldout import HELDOUT_TEXT; print(HELDOUT_TEXT)" > /tmp/heldout.txt
  ninfer "$ROOT" score /tmp/heldout.txt "$GGUF" --activations f32 --decode-path --save-logits /tmp/f32.safetensors \
    --no-progress 2>&1 | tail -n 8 | tee "$OUT/score.txt"
  ninfer "$ROOT" score /tmp/heldout.txt "$GGUF" --activations q8 --decode-path --reference-logits /tmp/f32.safetensors \
    --no-progress 2>&1 | tail -n 12 | tee -a "$OUT/score.txt"
  ninfer "$ROOT" score /tmp/heldout.txt "$GGUF" --backend reference --reference-logits /tmp/f32.safetensors \
    --no-progress 2>&1 | tail -n 12 | tee -a "$OUT/score.txt"
fi
if has warmtime; then  # start-up without a model file (scripts/warm_time.py): a cold run fills the kernel
  # cache, then warm runs alternate KernelPlan.capture_once off / on (WARM_REPEATS pairs)
  wt() { (cd "$ROOT" && NINFER_CACHE_DIR=/tmp/ninfer-cache-wt PYTHONPATH=/tmp/site:$ROOT timeout 300 \
           python3 scripts/warm_time.py --shape ${WARM_SHAPE:-smollm2-135m} "$@" 2>&1 | tail -n 3) | tee -a "$OUT/warmtime.txt"; }
  wt --capture-once off
  for _ in $(seq ${WARM_REPEATS:-2}); do wt --capture-once off; wt --capture-once on; done
fi
if has warmprof; then  # where warm-up goes: twice (an empty kernel cache, then the filled one)
  for run in cold warm; do
    (cd "$ROOT" && NINFER_CACHE_DIR=/tmp/ninfer-cache-prof PYTHONPATH=/tmp/site:$ROOT timeout 300 python3 -m tools.warmup_profile ${WARM_MODEL:-$GGUF} --out "$OUT/warm_$run.prof" \
      2>&1 | head -n 90) > "$OUT/warmprof_$run.txt"
    head -n 1 "$OUT/warmprof_$run.txt"
  done
fi
if has tests; then
  PYTHONPATH=/tmp/site:$ROOT timeout ${TESTS_S:-400} python3 -m pytest -q -p no:cacheprovider -s ${TESTS:-tests/test_gpu_quality.py} 2>&1 \
    | tail -n 60 | tee "$OUT/tests.txt"
fi
if has hybench; then  # the Qwen3.5-27B-sized random hybrid (#31): decode against the floor, prefill 512 / 4096
  (cd "$ROOT" && PYTHONPATH=/tmp/site:$ROOT timeout ${BENCH_S:-400} python3 -m ninfer.cli.main bench \
     --random ${HY_SHAPE:-qwen35-27b} --random-qtype ${HY_QTYPE:-Q4_K} --streams ${HY_STREAMS:-1,4,16} \
     --prompt-lens ${HY_PROMPTS:-512,4096} --decode-tokens ${HY_DECODE:-64} --repeats 2 --json "$OUT/hybench.json" 2>&1 \
     | tail -n 14) | tee -a "$OUT/hybench.txt"
fi
if has bench; then
  for tree in /tmp/base "$ROOT"; do
    [ -d "$tree" ] || continue
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout ${BENCH_S:-150} python3 -m ninfer.cli.main bench ${BENCH_MODEL:-$GGUF} \
       --activations q8 --streams ${BENCH_STREAMS:-1,16,64} --prompt-lens 512 --repeats ${BENCH_REPEATS:-3} 2>&1 | tail -n 12) \
      | sed "s/^/$(basename $tree) /" | tee -a "$OUT/bench.txt"
  done
fi

# this call's load runs, every pass: aggregate tok/s, TTFT p50, ITL p50, tokens a frame, prompt / cached tokens
if [ ${#JSONS[@]} -gt 0 ]; then
  python3 - "${JSONS[@]}" <<'PY'
import json, os, sys
print(f"{'run':<12}{'level':>6}{'pass':>9}{'err':>4}{'tok/s':>9}{'TTFT p50':>10}{'ITL p50':>9}{'tok/fr':>7}{'prompt':>8}{'cached':>8}")
for path in sys.argv[1:]:
    if not os.path.exists(path):
        print(f"{path}: missing"); continue
    label = os.path.basename(path)[:-5].removeprefix("bench_")
    for row in json.load(open(path))["results"]:
        s = row["summary"]
        print(f"{label:<12}{row['level']:>6}{row['pass']:>9}{s['errors']:>4}{s['tok_s']:>9,.0f}{s['ttft_ms']['p50'] or 0:>10.1f}"
              f"{s['itl_ms']['p50'] or 0:>9.2f}{s['tokens_per_frame']:>7}{str(s['prompt_tokens_mean']):>8}{str(s['cached_tokens_mean']):>8}")
PY
fi
