#!/usr/bin/env bash
# The cpu backend against llama.cpp's CPU build and the reference backend, interleaved, on one
# machine and one GGUF file (a shared machine's speed drifts by tens of percent over minutes,
# so only figures taken side by side in one round compare).
#   LLAMA_BENCH=/path/to/llama-bench scripts/cpu_vs_llama.sh [MODEL.gguf] [ROUNDS]
# llama-bench (and llama-batched-bench, beside it, for 8 sequences at once): build them once
# outside the repository from the llama-cpp-python sdist
#   pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
#   cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
#     -DCMAKE_BUILD_TYPE=Release && cmake --build build --target llama-bench llama-batched-bench -j
# Each round, for 1 and 2 threads: `ninfer bench --backend cpu` (NINFER_CPU_THREADS), then
# `llama-bench -t` with llama-bench's own test shapes (tg64: 64 tokens from an empty context;
# pp64) and `llama-batched-bench` (one prompt token, 64 generated, 1 and 8 sequences; its S_TG),
# then (1 thread only) the reference backend. ninfer's decode uses the same shape:
# --decode-prompt 1 --decode-tokens 64.
set -uo pipefail
MODEL=${1:-$HOME/.cache/ninfer/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
ROUNDS=${2:-3}
NINFER=${NINFER:-.venv/bin/ninfer}
ARGS=(--streams 1,8 --prompt-lens 64 --decode-prompt 1 --decode-tokens 64 --repeats 3)
pick() {  # the decode tok/s at 1 and 8 streams and the prefill tok/s from ninfer bench's table
  awk '/^decode/{d=1;next} /^prefill/{d=0;p=1;next} d&&$1==1{a=$2} d&&$1==8{b=$2} p&&$1==64{c=$2} END{print "1 stream "a", 8 streams "b", prefill64 "c}'
}
for round in $(seq "$ROUNDS"); do
  for threads in 1 2; do
    cpu=$(NINFER_CPU_THREADS=$threads "$NINFER" bench "$MODEL" --backend cpu "${ARGS[@]}" 2>/dev/null | pick)
    echo "round $round threads $threads  ninfer cpu:  $cpu"
    if [ -n "${LLAMA_BENCH:-}" ]; then
      "$LLAMA_BENCH" -m "$MODEL" -t "$threads" -n 64 -p 64 -r 3 2>/dev/null \
        | awk -F'|' '/Q[0-9]/{gsub(/ /,"",$7); gsub(/ +/," ",$8); printf "%s %s  ", $7, $8} END{print ""}' \
        | sed "s/^/round $round threads $threads  llama.cpp:   /"
    fi
    BATCHED=${LLAMA_BENCH:+$(dirname "$LLAMA_BENCH")/llama-batched-bench}
    if [ -n "$BATCHED" ] && [ -x "$BATCHED" ]; then
      "$BATCHED" -m "$MODEL" -t "$threads" -tb "$threads" -c 2048 -npp 1 -ntg 64 -npl 1,8 2>/dev/null \
        | awk -F'|' '$4+0==1{a=$9} $4+0==8{b=$9} END{gsub(/ /,"",a); gsub(/ /,"",b); print "1 stream "a", 8 streams "b}' \
        | sed "s/^/round $round threads $threads  llama.cpp batched: /"
    fi
    if [ "$threads" = 1 ]; then
      ref=$(OPENBLAS_NUM_THREADS=1 "$NINFER" bench "$MODEL" --backend reference "${ARGS[@]}" 2>/dev/null | pick)
      echo "round $round threads 1  reference:   $ref"
    fi
  done
done
