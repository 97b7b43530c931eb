#!/usr/bin/env bash
# Device-tool call: the GPU overhead benchmark with lineage on and off (Llama-8B-shaped decode),
# and the example's CUDA-graph run at TP=2 exiting cleanly.   run: bash bench/gpu_final.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" final-session.txt
date -u
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  echo "== example with --cuda-graph at TP=2: exits by itself (limit 90 s)"
  time timeout 90 python3 -m torch.distributed.run --nproc-per-node 2 "$REPO/examples/tp_llama.py" --device cuda \
      --dtype bfloat16 --steps 4 --cuda-graph --out /tmp/g2.json > /tmp/g2.log 2>&1
  echo "rc=$?"; grep -v Warn /tmp/g2.log | tail -3
fi
echo "== overhead with lineage on and off, Llama-8B-shaped decode"
timeout ${LIMIT:-330} python3 "$REPO/bench/overhead.py" --workload llama8b-decode --rounds ${ROUNDS:-3} \
    --batch ${BATCHES:-8 64} --json "$OUT/bench-gpu-lineage.json" 2>&1 | grep -v '^USDT\|Warning\|return func'
date -u
