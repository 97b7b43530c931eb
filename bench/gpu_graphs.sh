#!/usr/bin/env bash
# One device-tool call with the CUDA-graph figures of bench/RESULTS.md (kind nvidia-h200-x2 for
# the TP=2 part; on one GPU set TPS="1"):   run: bash bench/gpu_graphs.sh
# 1. the example captured in a graph and replayed with new inputs, against eager steps of the
#    same inputs (fingerprints, bitwise outputs, verdicts; bench/graph_check.py) at TP=1 and TP=2;
# 2. tests/gpu (the same at TP=1, fp32 and bf16, as pytest);
# 3. the replay benchmark (bench/cuda_graph_replay.py).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" graphs-session.txt
python3 -c "import tensor_trace.tracer.core, torch; print(torch.__version__, torch.cuda.device_count(), torch.cuda.get_device_name())"
date -u
TT="python3 -m tensor_trace"
EX="$REPO/examples/tp_llama.py"
ARGS="--device cuda --dtype bfloat16 --steps 6 --batch 4 --seq 8"
if [ -n "${FIRST:-}" ]; then
  echo "== 2. tests/gpu"
  python3 -m pytest -q -p no:cacheprovider "$REPO/tests/gpu" 2>&1 | tail -5
  echo "== 3. replay benchmark"
  python3 "$REPO/bench/cuda_graph_replay.py" --rounds ${ROUNDS:-5} --json "$OUT/graph-bench.json" 2>&1 | grep -v Warning
fi
for tp in ${TPS:-1 2}; do
  if [ "$tp" = 1 ]; then RUN="python3"; else RUN="python3 -m torch.distributed.run --nproc-per-node $tp"; fi
  D=/tmp/graph-tp$tp; rm -rf $D; mkdir -p $D
  echo "== 1. example, TP=$tp, bf16: graph replays against eager steps"
  timeout ${LIMIT:-240} $RUN $EX $ARGS --cuda-graph --out $D/plain.json > $D/plain.log 2>&1 || { echo "plain graph run failed"; grep -v Warn $D/plain.log | tail -20; }
  timeout ${LIMIT:-240} $TT record -o $D/graph -- $RUN $EX $ARGS --cuda-graph --out $D/traced.json > $D/graph.log 2>&1 || { echo "traced graph run failed"; grep -v Warn $D/graph.log | tail -30; }
  tail -5 $D/graph.log
  timeout ${LIMIT:-240} $TT record -o $D/eager -- $RUN $EX $ARGS --out $D/eager.json > $D/eager.log 2>&1 || tail -20 $D/eager.log
  python3 "$REPO/bench/graph_check.py" --eager $D/eager --graph $D/graph --plain-out $D/plain.json \
      --traced-out $D/traced.json --json "$OUT/graph-check-tp$tp.json"
  $TT query placement 'model.layers.0.*' --trace $D/graph --step 3 | head -12
done
if [ -z "${FIRST:-}" ] && [ -z "${SKIPTESTS:-}" ]; then
  echo "== 2. tests/gpu"
  python3 -m pytest -q -p no:cacheprovider "$REPO/tests/gpu" 2>&1 | tail -5
fi
if [ -z "${FIRST:-}" ] && [ -z "${NOBENCH:-}" ]; then
  echo "== 3. replay benchmark"
  python3 "$REPO/bench/cuda_graph_replay.py" --rounds ${ROUNDS:-5} --json "$OUT/graph-bench.json" 2>&1 | grep -v Warning
fi
date -u
