#!/usr/bin/env bash
# One device-tool call (kind nvidia-h200-x2 for the TP=2 check): the capture path's chunk-table
# kernel. 1. the kernel against its alternatives inside a graph (bench/fp_kernel_probe.py);
# 2. tests/gpu; 3. where a traced replay's extra time goes (bench/replay_profile.py); 4. the
# replay benchmark at batch 64 (variants replay, traced-replay); 5. graph replays against eager
# steps at TP=1 and TP=2 (bench/gpu_graphs.sh's check).      run: bash bench/gpu_chunks.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" chunks-session.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), torch.cuda.get_device_name())"
nproc; date -u
echo "== 1. kernel probe"; python3 "$REPO/bench/fp_kernel_probe.py" 2>&1 | grep -v Warn
echo "== 2. tests/gpu"; python3 -m pytest -q -p no:cacheprovider "$REPO/tests/gpu" 2>&1 | tail -5
echo "== 3. replay profile"; (cd "$REPO/bench" && python3 replay_profile.py --batch 64 2>&1 | grep -v Warn)
date -u
echo "== 4. replay benchmark, batch 64"
(cd "$REPO/bench" && python3 cuda_graph_replay.py --batch 64 --rounds ${ROUNDS:-5} \
    --variants replay traced-replay --json "$OUT/graph-bench-b64.json" 2>&1 | grep -v Warning)
date -u
if [ -n "${TPS:-}" ]; then
  echo "== 5. graph replays against eager steps"
  (cd "$REPO" && TPS="$TPS" NOBENCH=1 SKIPTESTS=1 bash bench/gpu_graphs.sh > /dev/null 2>&1)
  grep -v Warn "$OUT/graphs-session.txt" | tail -60
fi
date -u
