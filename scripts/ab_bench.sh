#!/usr/bin/env bash
# A/B of engine switches on the GPU machine: the same bench once per variant, each variant a
# line of Python run after importing the modules below (so a module flag can be flipped).
#   scripts/ab_bench.sh smol|8b "label:python" ["label:python" ...]
#   scripts/ab_bench.sh smol "folds:" "no-folds:forward.FUSE_ONE_ROW = False"
#   scripts/ab_bench.sh 8b "default:" "post:forward.POST_IN_ATTENTION = True"
# Names in scope: forward (ninfer.gpu.cuda.forward), gemv (ninfer.gpu.cuda.gemv). Extra bench
# arguments: AB_ARGS="--streams 1,4".
set -uo pipefail
MODEL=${1:?smol or 8b}
shift
if [ "$MODEL" = 8b ]; then
  ARGS="--random llama3-8b --random-qtype Q4_1 --streams 1 --prompt-lens 128 --repeats 2 --decode-tokens 64"
else
  ARGS="--random smollm2-135m --anchors llamacpp-h200 --streams 1 --prompt-lens 512 --repeats 3 --decode-tokens 64"
fi
for V in "$@"; do
  echo "== ${V%%:*}"
  python3 -c "import sys, runpy
import ninfer.gpu.cuda.forward as forward, ninfer.gpu.cuda.gemv as gemv
${V#*:}
sys.argv = ['bench'] + sys.argv[1:]
runpy.run_module('ninfer.cli.bench', run_name='__main__')" $ARGS ${AB_ARGS:-} --backend cuda --activations q8 2>&1 \
    | grep -v "uploading weights"
done
