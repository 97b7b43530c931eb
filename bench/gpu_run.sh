#!/usr/bin/env bash
# The GPU benchmarks and tests/gpu on a lent H200, from the repository root of a fresh machine with
# torch (CUDA), Triton, pytest, click and msgpack installed (the lent machines have no registry):
#
#   bash bench/gpu_run.sh                          # device tool `run`; its $OUT gets every output
#   PARTS="tests ab" AB_ROUNDS=250 bash bench/gpu_run.sh
#   BENCH_COMMIT=abc1234 bash bench/gpu_run.sh     # a copy of the tree without .git: name its commit
#
# PARTS (default "tests ab replay chain overhead"), each under its own time limit:
#   tests     python -m pytest tests/gpu                        (~3 min on one H200)
#   ab        bench/fp_ab.py --batch 8 64 --rounds $AB_ROUNDS  overhead ratios, the method of record
#   replay    bench/cuda_graph_replay.py, replay and traced-replay (defaults, every step, no fp),
#             $ROUNDS rounds (default 3)
#   chain     bench/overhead.py --workload linear-chain --device cuda   (us per module call)
#   overhead  bench/overhead.py --workload llama8b-decode        (pooled ratios, bytes per span,
#             torch.profiler); at TP=2 under torchrun as well where two GPUs are present
#   bytes     bench/trace_bytes.py --workload llama-gpu           (not in the default: bytes per
#             span with new token ids at every step, by record kind; about 1 min)
# Output: $OUT (default bench/results/gpu-DATE, git-ignored): gpu-run.txt and one JSON per part.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/bench/results/gpu-$(date -u +%Y%m%d-%H%M)}
PARTS=${PARTS:-"tests ab replay chain overhead"}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-run.txt") 2>&1

# The import name tensor_trace without installing: setuptools maps tracer/ and exporters/ into
# the package (pyproject.toml package-dir), so build that layout out of links.
PKG=$(mktemp -d /tmp/tt-pkg.XXXX)
cp -r "$REPO/tensor_trace" "$PKG/tensor_trace"
ln -sfn "$REPO/tracer" "$PKG/tensor_trace/tracer"
ln -sfn "$REPO/exporters" "$PKG/tensor_trace/exporters"
export PYTHONPATH=$PKG PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# NVLink multicast off (the device tool's KINDS.md); tracer/native.py's build cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tt-ext} MAX_JOBS=${MAX_JOBS:-16}
# Run from outside the repository: there its tensor_trace/ folder (without tracer/ and
# exporters/) would shadow the package built above.
cd "$PKG"

GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
# the commit in every header: the one the caller names, else git's. The device tool's copy of the
# working tree can carry a .git whose HEAD is not the tree that travelled: name the commit there.
export BENCH_COMMIT=${BENCH_COMMIT:-$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo "?")}
echo "# gpu_run | $(date -u +%FT%TZ) | host $(hostname) | commit $BENCH_COMMIT | $(nproc) cpus | parts: $PARTS"
python3 -c "import torch, triton, tensor_trace.tracer.core; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
quiet() { grep -v '^USDT\|Warning\|warn(\|return func'; }
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
rc=0

if has tests; then
  echo "== tests/gpu ($GPUS GPUs)"
  timeout "${TEST_LIMIT:-420}" python3 -m pytest -q -p no:cacheprovider -rs "$REPO/tests/gpu" 2>&1 | tail -"${TEST_TAIL:-15}"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if has ab; then
  echo "== fp_ab.py: step-paired overhead, Llama-8B-shaped decode"
  timeout "${AB_LIMIT:-300}" python3 "$REPO/bench/fp_ab.py" --batch 8 64 --rounds "${AB_ROUNDS:-150}" \
      --json "$OUT/fp_ab.json" 2>&1 | quiet
fi
if has replay; then
  echo "== cuda_graph_replay.py"
  timeout "${REPLAY_LIMIT:-300}" python3 "$REPO/bench/cuda_graph_replay.py" --rounds "$ROUNDS" \
      --variants replay traced-replay traced-replay-fp1 traced-replay-nofp --json "$OUT/replay.json" 2>&1 | quiet
fi
if has chain; then
  echo "== overhead.py --workload linear-chain --device cuda: us per module call"
  timeout 200 python3 "$REPO/bench/overhead.py" --workload linear-chain --device cuda --rounds 7 \
      --json "$OUT/chain.json" 2>&1 | quiet | grep -v '^  \['
fi
if has overhead; then
  echo "== overhead.py --workload llama8b-decode (pooled; bytes per span; torch.profiler)"
  timeout "${OVERHEAD_LIMIT:-300}" python3 "$REPO/bench/overhead.py" --workload llama8b-decode --rounds "$ROUNDS" \
      --json "$OUT/overhead.json" 2>&1 | quiet | grep -v '^  \['
  if [ "$GPUS" -ge 2 ]; then
    echo "== overhead.py at TP=2 (torchrun, one GPU per rank)"
    timeout "${OVERHEAD_LIMIT:-300}" python3 -m torch.distributed.run --nproc-per-node 2 "$REPO/bench/overhead.py" \
        --workload llama8b-decode --rounds "$ROUNDS" --json "$OUT/overhead-tp2.json" 2>&1 | quiet | grep -v '^  \['
  fi
fi
if has bytes; then
  echo "== trace_bytes.py --workload llama-gpu (bytes per module span by record kind)"
  timeout "${BYTES_LIMIT:-240}" python3 "$REPO/bench/trace_bytes.py" --workload llama-gpu 2>&1 | quiet
fi
date -u
rm -rf "$PKG"
exit $rc
