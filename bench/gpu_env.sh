# Sourced by the bench/gpu_*.sh device-tool scripts: makes the import name tensor_trace resolve
# without installing (the GPU machine has no registry), keeps NVLink multicast off (device
# README), and sends this script's output to $OUT/$1 as well. Leaves the shell in /tmp.
REPO=$PWD
OUT=${OUT:-/tmp/tt-out}
mkdir -p "$OUT" /tmp/ttpkg/tensor_trace
cp -r tensor_trace/* /tmp/ttpkg/tensor_trace/
ln -sfn "$REPO/tracer" /tmp/ttpkg/tensor_trace/tracer
ln -sfn "$REPO/exporters" /tmp/ttpkg/tensor_trace/exporters
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tt-ext} MAX_JOBS=${MAX_JOBS:-16}
export PYTHONPATH=/tmp/ttpkg PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if [ -n "${1:-}" ]; then exec > >(tee "$OUT/$1") 2>&1; fi
cd /tmp
