"""Where the eager GPU path's fingerprint host time goes, by ablation, on a CPU: the Llama
structure of bench/call_patterns.py (389 module calls per step) traced with
fingerprint_mode="deferred" and tracer/native.py, kernel launches stubbed, variants switched step
by step:

- ``nofp``          fingerprints off;
- ``fp``            fingerprints as they come (the native table);
- ``fp-nohold``     the same Python, the C++ hold replaced by a Python function returning 0;
- ``fp-countonly``  add_one and _add replaced by index counters (the tracer's fingerprint code
                    paths with no fingerprint work).

So fp - fp-nohold is the C++ hold inside a step, fp-nohold - fp-countonly the Python of add_one
and _add, fp-countonly - nofp the rest of the tracer's fingerprint paths.

    OMP_NUM_THREADS=1 python bench/fp_ablation.py [--rounds 800]
"""
import argparse
import os
import statistics
import tempfile
import time

import torch

import call_patterns as cp  # bench/ is this script's folder, first on sys.path
from _paired import paired_median, shuffled_rounds
from tensor_trace import tracer
from tensor_trace.tracer import multi_tensor, native
from tensor_trace.tracer.fingerprint import StepFingerprints


class _NoHoldTable:
    device = torch.device("cpu")

    def hold(self, t, i):
        return 0

    def size(self):
        return 0

    def clear(self):
        pass

    def materialize(self, t):
        return []


class _CountOnly(StepFingerprints):
    def add_one(self, t, store=True):
        i = self.count
        self.count = i + 1
        return i

    def _add(self, tensors, store, immediate=False):
        i = self.count
        self.count = i + len(tensors)
        return i


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=800)
    args = ap.parse_args()
    os.environ["TENSOR_TRACE_NATIVE"] = "1"
    multi_tensor.usable = lambda t: True
    multi_tensor.sum_sumsq_table = lambda table, count, most, dtype, device: torch.zeros(count, 2)
    multi_tensor.sum_sumsq_buffer = lambda buf, count, most, dtype, device: torch.zeros(count, 2)
    native.ensure(block=True)
    torch.set_num_threads(1)
    llama = cp.LlamaCalls().eval()
    ids = torch.randint(0, 100, (cp.B,)).view(cp.B, 1)
    tr = tracer.start(out_dir=tempfile.mkdtemp(), fingerprint=True, lineage=False,
                      fingerprint_mode="deferred")
    nohold = StepFingerprints(defer_cuda=False, defer_cpu=True)
    nohold._nt, nohold._native_wanted, nohold._hold = _NoHoldTable(), False, lambda s, t, i: 0
    variants = {"nofp": None, "fp": tr.fps, "fp-nohold": nohold,
                "fp-countonly": _CountOnly(defer_cuda=False, defer_cpu=True)}
    def run(v):
        tr.fingerprint = variants[v] is not None
        if tr.fingerprint:
            tr.fps = variants[v]
        t0 = time.perf_counter_ns()
        llama(ids)
        return time.perf_counter_ns() - t0

    with torch.inference_mode():
        shuffled_rounds(run, variants, 30)  # warm-up
        times = shuffled_rounds(run, variants, args.rounds)
    tracer.stop()
    med = {v: statistics.median(t) / 1e3 for v, t in times.items()}
    print(f"# fp_ablation {time.strftime('%Y-%m-%d %H:%M')} rounds={args.rounds}; median us/step:",
          {v: round(m) for v, m in med.items()})
    for a, b in (("fp", "nofp"), ("fp", "fp-nohold"), ("fp-nohold", "fp-countonly"),
                 ("fp-countonly", "nofp")):
        d = paired_median(times, a, b) / 1e3
        print(f"  paired {a} - {b}: {d:+.0f} us/step")


if __name__ == "__main__":
    main()
