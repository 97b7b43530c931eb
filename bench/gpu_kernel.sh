#!/usr/bin/env bash
# One device-tool call for the multi-tensor fingerprint kernel (tracer/multi_tensor.py):
#   run: bash bench/gpu_kernel.sh          (PART=eager: the eager overhead figures instead)
# 1. (in gpu_graphs.sh) tests/gpu (the kernel against torch, a captured kernel replayed with new
#    values, the example's graph replays against eager steps); 2. a traced eager run of the example whose steps 1..
#    run under torch.cuda.set_sync_debug_mode("error"); 3. bench/gpu_graphs.sh at TP=1 (graph
#    replays vs eager steps, then the replay benchmark, kernel and stacking side by side).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" kernel-session-${PART:-graphs}.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nproc; date -u
if [ "${PART:-graphs}" = eager ]; then
  echo "== hook cost (cuda)"; python3 "$REPO/bench/hook_cost.py" --device cuda --json "$OUT/hook-cuda.json"
  echo "== overhead, Llama-8B-shaped decode"
  python3 "$REPO/bench/overhead.py" --workload llama8b-decode --rounds ${ROUNDS:-5} --json "$OUT/bench-gpu.json" 2>&1 | grep -v '^USDT'
  date -u
  exit 0
fi
echo "== 2. traced eager example, steps 1.. under sync debug mode 'error'"
python3 -m tensor_trace record -o /tmp/sync-eager -- python3 "$REPO/examples/tp_llama.py" --device cuda \
    --dtype bfloat16 --steps 5 --forbid-sync-from 1 --out /tmp/sync-eager.json 2>&1 | grep -v Warn | tail -5
echo "== kernel probe"; python3 "$REPO/bench/fp_kernel_probe.py" 2>&1 | grep -v Warn
echo "== 3. graphs"
(cd "$REPO" && TPS=1 FIRST=1 ROUNDS=${ROUNDS:-5} bash bench/gpu_graphs.sh > /dev/null 2>&1)
cat "$OUT/graphs-session.txt"
date -u
