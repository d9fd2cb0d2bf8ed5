#!/usr/bin/env bash
# A/B of KernelPlans on the GPU machine: the same bench once per variant, each variant the
# default plan with some fields changed (ninfer.gpu.cuda.plan.parse_plan: "field=value; ...").
#   scripts/ab_bench.sh smol|8b "label:fields" ["label:fields" ...]
#   scripts/ab_bench.sh smol "folds:" "no-folds:folds=()"
#   scripts/ab_bench.sh 8b "default:" "plain-loads:evict_first=False"
# Extra bench arguments: AB_ARGS="--streams 1,4".
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
  python3 -c "import functools, sys, runpy
from ninfer.gpu.cuda import runner
from ninfer.gpu.cuda.plan import parse_plan
# every CudaRunner the bench builds takes this plan
runner.CudaRunner.__init__ = functools.partialmethod(runner.CudaRunner.__init__, plan=parse_plan(sys.argv[1]))
sys.argv = ['bench'] + sys.argv[2:]
runpy.run_module('ninfer.cli.bench', run_name='__main__')" "${V#*:}" $ARGS ${AB_ARGS:-} --backend cuda --activations q8 2>&1 \
    | grep -v "uploading weights"
done
