"""The host cost of the tracer on a GPU step's Python path, with and without tracer/native.py,
on a CPU: bench/call_patterns.py's Llama structure (389 module calls per step) traced with
fingerprint_mode="deferred" (the GPU's path), the kernel launches stubbed out, variants switched
step by step as in bench/fp_ab.py: ``plain``; ``nofp-py`` / ``fp-py`` (the Python layout keys and
fingerprint table, as with TENSOR_TRACE_NATIVE=0); ``nofp`` / ``fp`` (native keys and table, the
default where CUDA is).

    OMP_NUM_THREADS=1 python bench/native_proxy.py [--rounds 1500]

What it leaves out, measured only on a GPU: the launch itself, the copies, and reading the held
tensors again at the step's end after the rest of the step has evicted them from the CPU's
caches."""
import argparse
import os
import statistics
import tempfile
import time

import torch

import call_patterns as cp  # bench/ is this script's folder, first on sys.path
from _paired import paired_median, shuffled_rounds
from tensor_trace import tracer
from tensor_trace.tracer import multi_tensor, native, spans
from tensor_trace.tracer.fingerprint import StepFingerprints


def main() -> None:
    multi_tensor.usable = lambda t: True
    multi_tensor.sum_sumsq_table = lambda table, count, most, dtype, device: torch.zeros(count, 2)
    multi_tensor.sum_sumsq_buffer = lambda buf, count, most, dtype, device: torch.zeros(count, 2)
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1500)
    args = ap.parse_args()
    os.environ["TENSOR_TRACE_NATIVE"] = "1"
    native.ensure(block=True)
    torch.set_num_threads(1)
    llama = cp.LlamaCalls().eval()
    ids = torch.randint(0, 100, (cp.B,))
    tr = tracer.start(out_dir=tempfile.mkdtemp(), fingerprint=True, lineage=False, fingerprint_mode="deferred")
    os.environ["TENSOR_TRACE_NATIVE"] = "0"
    fps = {"fp": tr.fps, "fp-py": StepFingerprints(defer_cuda=False, defer_cpu=True)}
    keys = (native.pair_key(), native.call_key())
    traced_call = torch.nn.Module.__call__
    plain_call = traced_call.__wrapped__
    variants = ("plain", "nofp-py", "nofp", "fp-py", "fp")

    def run(v):
        torch.nn.Module.__call__ = plain_call if v == "plain" else traced_call
        tr.fingerprint = v.startswith("fp")
        if tr.fingerprint:
            tr.fps = fps[v]
        spans.use_native_keys(*((None, None) if v.endswith("-py") else keys))
        t0 = time.perf_counter_ns()
        llama(ids.view(cp.B, 1))
        return time.perf_counter_ns() - t0

    with torch.inference_mode():
        shuffled_rounds(run, variants, 20)  # warm-up
        times = shuffled_rounds(run, variants, args.rounds)
    torch.nn.Module.__call__ = traced_call
    tracer.stop()
    med = {v: statistics.median(t) / 1e3 for v, t in times.items()}
    print(f"# native_proxy {time.strftime('%Y-%m-%d %H:%M')} rounds={args.rounds}; median us/step:",
          {v: round(m) for v, m in med.items()})
    for a, b in (("nofp", "plain"), ("nofp-py", "plain"), ("fp", "nofp"), ("fp-py", "nofp-py"),
                 ("nofp", "nofp-py"), ("fp", "fp-py")):
        d = paired_median(times, a, b) / 1e3
        print(f"  paired {a} - {b}: {d:+.0f} us/step")


if __name__ == "__main__":
    main()
