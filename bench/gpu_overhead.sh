#!/usr/bin/env bash
# One device-tool call for the overhead figures of bench/RESULTS.md:  run: bash bench/gpu_overhead.sh
# hook cost per module call (cuda), the eager overhead benchmark with its breakdown (cProfile and
# kernels per step), where a traced replay's extra device time goes, and the replay benchmark.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" overhead-session.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nproc; date -u
if [ "${PROFILE:-1}" = 1 ]; then
  echo "== replay profile"; (cd "$REPO/bench" && python3 replay_profile.py --batch 64 2>&1 | grep -v Warn)
fi
echo "== hook cost (cuda)"; python3 "$REPO/bench/hook_cost.py" --device cuda --json "$OUT/hook-cuda.json"
echo "== overhead, Llama-8B-shaped decode"
python3 "$REPO/bench/overhead.py" --workload llama8b-decode --rounds ${ROUNDS:-5} ${STEPS:+--steps $STEPS} ${BREAKDOWN:-} \
    --json "$OUT/bench-gpu.json" 2>&1 | grep -v '^USDT\|^  \['
date -u
if [ "${GRAPHS:-1}" = 1 ]; then
  echo "== replay benchmark"
  (cd "$REPO/bench" && python3 cuda_graph_replay.py --rounds ${ROUNDS:-5} --json "$OUT/graph-bench.json" 2>&1 | grep -v Warning)
fi
date -u
