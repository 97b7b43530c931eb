#!/usr/bin/env bash
# One device-tool call that runs every GPU measurement of bench/RESULTS.md:
#   run: bash bench/gpu_session.sh   (OUT is the tool's output folder)
# Makes the import name tensor_trace resolve without installing (the GPU machine has no
# registry), then runs the hook-cost and overhead measurements (CUDA graphs: bench/gpu_graphs.sh).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import tensor_trace.tracer.core, torch; print(torch.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
nproc; date -u
echo "== hook cost (cuda)"; python3 "$REPO/bench/hook_cost.py" --device cuda --json "$OUT/hook-cuda.json" | tee "$OUT/hook-cuda.txt"
echo "== overhead, Llama-8B-shaped decode"
python3 "$REPO/bench/overhead.py" --workload llama8b-decode --rounds ${ROUNDS:-5} --json "$OUT/bench-gpu.json" 2>&1 | grep -v '^USDT' | tee "$OUT/bench-gpu.txt"
