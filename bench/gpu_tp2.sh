#!/usr/bin/env bash
# One device-tool call (kind nvidia-h200-x2) with every two-GPU figure of bench/RESULTS.md:
#   run: bash bench/gpu_tp2.sh          ($OUT is the tool's output folder)
# 1. the example recorded at TP=2 over gloo on the CPU and over NCCL on the GPUs (same seed;
#    fp32, bf16, and bf16 with deferred reductions), verdicts compared point by point;
# 2. collective device time (CUDA events) next to host time;
# 3. no synchronisation inside traced steps (set_sync_debug_mode + profiler, bench/sync_check.py);
# 4. the overhead benchmark at TP=2 (Llama-8B-shaped decode, one H200 per rank).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" tp2-session.txt
SECTIONS=${SECTIONS:-"1 2 3 4"}
python3 -c "import tensor_trace.tracer.core, torch; print(torch.__version__, torch.cuda.device_count(), torch.cuda.get_device_name())"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
nproc; date -u
TT="python3 -m tensor_trace"
RUN="python3 -m torch.distributed.run --nproc-per-node 2"
EX="$REPO/examples/tp_llama.py"
case " $SECTIONS " in *" 1 "*)
echo "== 1. example at TP=2: CPU gloo and GPU NCCL"
for v in "fp32:--dtype float32" "bf16:--dtype bfloat16" "bf16-deferred:--dtype bfloat16 --deferred-reduction"; do
  name=${v%%:*}; flags=${v#*:}
  $TT record -o /tmp/cpu-$name -- $RUN $EX --steps 4 $flags > /tmp/rec-cpu-$name.txt 2>&1; echo "cpu-$name rc=$?"
  tail -4 /tmp/rec-cpu-$name.txt
  $TT record -o /tmp/gpu-$name -- $RUN $EX --steps 4 $flags --device cuda --forbid-sync-from 1 \
      > /tmp/rec-gpu-$name.txt 2>&1; rc=$?; echo "gpu-$name rc=$rc"
  tail -4 /tmp/rec-gpu-$name.txt
  python3 "$REPO/bench/compare_verdicts.py" /tmp/cpu-$name /tmp/gpu-$name
done
cat /tmp/rec-gpu-*.txt > "$OUT/rec-gpu.txt"
;; esac
case " $SECTIONS " in *" 2 "*)
echo "== 2. collective device time (bf16 GPU run)"
$TT query collectives --trace /tmp/gpu-bf16
$TT query sql "SELECT op, step > 0 AS after_step0, COUNT(*) AS n, COUNT(device_ns) AS timed, ROUND(AVG(dur)/1e3,1) AS host_us, ROUND(AVG(device_ns)/1e3,1) AS device_us FROM collectives GROUP BY op, step > 0" --trace /tmp/gpu-bf16
$TT query sql "SELECT rank, SUM(json_extract(identity,'$.device') IS NOT NULL) FROM processes GROUP BY rank" --trace /tmp/gpu-bf16
$TT export perfetto --trace /tmp/gpu-bf16 -o "$OUT/gpu-bf16.perfetto.json.gz"
;; esac
case " $SECTIONS " in *" 3 "*)
echo "== 3. synchronisation inside traced steps"
$RUN "$REPO/bench/sync_check.py" --json "$OUT/sync.json" 2>&1 | grep -v Warning
;; esac
case " $SECTIONS " in *" 4 "*)
echo "== 4. overhead at TP=2, Llama-8B-shaped decode"
$RUN "$REPO/bench/overhead.py" --workload llama8b-decode --rounds ${ROUNDS:-5} --json "$OUT/bench-tp2.json" 2>&1 \
    | grep -v '^USDT\|Warning\|return func' | tee "$OUT/bench-tp2.txt"
;; esac
date -u
