#!/usr/bin/env bash
# One device-tool call: tests/gpu (the native table's test included), then where a traced eager step's host time goes
# (bench/eager_fp_probe.py, with fp-old when bench/_old_fingerprint.py is present) and a cProfile
# of the traced variants (bench/overhead.py --breakdown).   run: bash bench/gpu_probe.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" probe-session.txt
date -u
if [ "${SKIPTESTS:-0}" != 1 ]; then
  # (from /tmp: in the repository, its tensor_trace/ folder would shadow the import path)
  echo "== tests/gpu"; timeout ${TEST_LIMIT:-240} python3 -m pytest -q -p no:cacheprovider "$REPO/tests/gpu" 2>&1 | tail -${TEST_TAIL:-3}
fi
[ "${STEPEND:-1}" = 1 ] && echo "== step-end pieces" && python3 "$REPO/bench/step_end_probe.py" 2>&1 | grep -v Warn
if [ "${PROBE:-1}" = 1 ]; then echo "== eager probe"
(cd "$REPO/bench" && timeout ${PROBE_LIMIT:-300} python3 eager_fp_probe.py --batch ${BATCHES:-8 64} --rounds ${ROUNDS:-8} \
    --variants ${VARIANTS:-plain nofp fp fp-old fp-holdonly fp-nokeep} --json "$OUT/probe.json" 2>&1 | grep -v Warn); fi
date -u
if [ "${NATIVE:-0}" = 1 ]; then
  echo "== fp_ab with the native table (tracer/native.py), step by step"
  (cd "$REPO/bench" && timeout ${NATIVE_LIMIT:-300} \
      python3 fp_ab.py --rounds ${AB_ROUNDS:-200} --json "$OUT/ab-native.json" 2>&1 | grep -v "Warn\|warn")
fi
if [ "${OVERHEAD:-0}" = 1 ]; then
  echo "== overhead, Llama-8B-shaped decode"
  timeout ${OVERHEAD_LIMIT:-330} python3 "$REPO/bench/overhead.py" --workload llama8b-decode --rounds ${OV_ROUNDS:-10} \
      --steps ${OV_STEPS:-15} --json "$OUT/bench-gpu.json" 2>&1 | grep -v '^USDT\|Warning\|return func\|^  \['
fi
if [ "${BREAKDOWN:-1}" = 1 ]; then
  echo "== cProfile of the traced variants, batch 8"
  timeout 200 python3 "$REPO/bench/overhead.py" --workload llama8b-decode --rounds 2 --batch 8 --breakdown \
      --json "$OUT/bench-breakdown.json" 2>&1 | grep -v '^USDT\|Warning\|return func'
fi
date -u
