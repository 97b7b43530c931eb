"""What the tracer's CPU-side work costs in CPU time, against the ways it replaced, side by side:

- fingerprint pairs (sum, sum of squares) of CPU tensors (tracer/host_values.py's ``pair``)
  against one dot with a ones vector of the tensor's length plus one dot with itself (the former
  way: it also made and kept a ones vector of every length it met) and torch's ``sum`` + ``dot``,
  over the tensors record_cpu.py's ``llama`` workload fingerprints: its parameters (first step,
  at TP=1) and one step's module inputs and outputs; each with its error against float64;
- the nonzero rows of an all_reduce's input (``host_values.nonzero_rows``) against the torch ops;
- ``tracer.start()`` in fresh processes, and within it the rebinding of module-level names,
  beside the same with the former test of every module-level function for a wrapper's mark
  (reading its ``__dict__``, which makes one: the allocations set off full collections).

    OMP_NUM_THREADS=1 .venv/bin/python bench/host_values_bench.py [--reps 7]

CPU time (``time.process_time``), the minimum over repetitions: what the work costs, even on a
shared machine (wall time there says more about the other processes)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np
import torch

from common import header, header_line  # bench/ is first on sys.path
from tensor_trace.tracer import host_values

# (shape, count): the llama workload at TP=1 (hidden 1024, ffn 2816, 16 heads, 8 KV heads of 64,
# vocab 32000, batch 2, seq 16), counted from a traced step
PARAMS = [((32000, 1024), 2), ((2048, 1024), 6), ((1024, 1024), 6), ((5632, 1024), 6),
          ((1024, 2816), 6), ((1024,), 14), ((1024, 3072), 1)]
STEP = [((2, 16, 1024), 74), ((2, 16, 5632), 6), ((2, 16, 2816), 6), ((2, 16, 32000), 1),
        ((2, 16, 2048), 6), ((2, 16, 512), 12), ((2, 16, 3072), 1), ((2, 16), 1)]


def _former_pair(t, ones_cache: dict):
    a = t.numpy().ravel()
    ones = ones_cache.get(a.size)
    if ones is None:
        ones = ones_cache[a.size] = np.ones(a.size, dtype=a.dtype)
    return float(a.dot(ones)), float(a.dot(a))


def _torch_pair(t):
    flat = t.reshape(-1)
    return float(flat.sum()), float(torch.dot(flat, flat))


def _tensors(spec, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape, count in spec:
        for _ in range(count):
            if len(shape) == 2 and shape[0] == 2:  # the token ids
                out.append(torch.randint(0, 32000, shape, generator=gen))
            else:
                out.append(torch.randn(shape, generator=gen) * 0.02 + 0.001)
    return out


def _cpu_ms(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        c0 = time.process_time()
        fn()
        best = min(best, time.process_time() - c0)
    return best * 1e3


def _worst_error(pair_fn, tensors) -> tuple:
    """Largest relative error of the sums and of the sums of squares against float64."""
    err_s = err_q = 0.0
    for t in tensors:
        s, q = pair_fn(t)
        f = t.double()
        ref_s, ref_q = f.sum().item(), f.pow(2).sum().item()
        err_s = max(err_s, abs(s - ref_s) / max(abs(ref_s), 1e-12))
        err_q = max(err_q, abs(q - ref_q) / max(ref_q, 1e-12))
    return err_s, err_q


def fingerprints(reps: int) -> dict:
    out = {}
    for name, spec in (("parameters, first step", PARAMS), ("one step's inputs and outputs", STEP)):
        tensors = _tensors(spec, 0)
        first = name.startswith("parameters")

        def former():
            cache = {} if first else former_cache  # a first step makes its ones vectors
            for t in tensors:
                _former_pair(t, cache)

        def current():
            if first:
                host_values._ONES_F32.clear()
                host_values._ONES.clear()
            for t in tensors:
                host_values.pair(t)

        former_cache: dict = {}
        former()
        rows = {"host_values.pair": (current, host_values.pair),
                "dot with ones of its length": (former, lambda t: _former_pair(t, {})),
                "torch sum + dot": (lambda: [_torch_pair(t) for t in tensors], _torch_pair)}
        figures = {}
        for label, (run, pair_fn) in rows.items():
            figures[label] = dict(cpu_ms=_cpu_ms(run, reps), error=_worst_error(pair_fn, tensors[:40]))
        out[name] = dict(tensors=len(tensors), elements=sum(t.numel() for t in tensors), figures=figures)
    return out


def nonzero_rows(reps: int) -> dict:
    from tensor_trace.tracer.collectives import _nonzero_rows

    x = torch.randn(2, 16, 1024)

    def torch_rows():
        for _ in range(1000):
            nz = torch.nonzero(x.reshape(x.shape[0], -1).ne(0).any(1)).flatten()
            n = int(nz.numel())
            _ = [int(nz[0]), int(nz[-1]), n] if n else [0, 0, 0]

    def current():
        for _ in range(1000):
            _nonzero_rows([x])

    return {"tracer (numpy)": _cpu_ms(current, reps), "torch ops": _cpu_ms(torch_rows, reps)}


_START_CHILD = """
import gc, json, sys, time
import torch
from tensor_trace import tracer
from tensor_trace.tracer import collectives
rebind = collectives.CollectiveInterceptor._rebind
former = sys.argv[2] == 'former'
out = {}
def touch_every_function_dict(modules):
    # what the former test of every module-level function for a wrapper's mark did besides the
    # rebinding itself: read the function's __dict__, which makes one
    for _, m in modules:
        d = getattr(m, '__dict__', None)
        if isinstance(d, dict):
            for v in list(d.values()):
                if type(v) is type(touch_every_function_dict):
                    v.__dict__
def timed(self, modules, originals):
    c0 = time.process_time()
    if former:
        touch_every_function_dict(modules)
    rebind(self, modules, originals)
    out['rebind_ms'] = (time.process_time() - c0) * 1e3
collectives.CollectiveInterceptor._rebind = timed
c0 = time.process_time()
tracer.start(out_dir=sys.argv[1])
out['start_ms'] = (time.process_time() - c0) * 1e3
tracer.stop()
print(json.dumps(out))
"""


def tracer_start(reps: int) -> dict:
    """CPU ms of tracer.start() and of its rebinding, now and with the former test, each in
    fresh processes, alternated: the minimum over ``reps``."""
    import tempfile

    runs = {"now": [], "former": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(reps):
            for mode, got in runs.items():
                res = subprocess.run([sys.executable, "-c", _START_CHILD, tmp, mode], capture_output=True, text=True,
                                     check=True)
                got.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return {mode: {k: min(r[k] for r in got) for k in got[0]} for mode, got in runs.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    info = header(sys.argv)
    print(header_line("host_values_bench", info))
    fps = fingerprints(args.reps)
    for name, block in fps.items():
        print(f"\n== fingerprints, {name}: {block['tensors']} tensors, {block['elements'] / 1e6:.2f}M elements "
              f"(CPU ms, min of {args.reps}; worst relative error of sum / sum of squares against float64)")
        base = block["figures"]["host_values.pair"]["cpu_ms"]
        for label, fig in block["figures"].items():
            print(f"  {label:<30} {fig['cpu_ms']:9.2f} ms  x{fig['cpu_ms'] / base:5.2f}   "
                  f"errors {fig['error'][0]:.1e} / {fig['error'][1]:.1e}")
    rows = nonzero_rows(args.reps)
    print(f"\n== nonzero rows of a [2, 16, 1024] all_reduce input (us a call): tracer {rows['tracer (numpy)']:.1f}, "
          f"torch ops {rows['torch ops']:.1f}")
    start = tracer_start(args.reps)
    print(f"\n== tracer.start() in a fresh process after import torch (CPU ms, min of {args.reps}): "
          f"{start['now']['start_ms']:.1f}, of which rebinding module-level names {start['now']['rebind_ms']:.1f}; "
          f"with the former test for a wrapper's mark (a function's __dict__): {start['former']['start_ms']:.1f}, "
          f"rebinding {start['former']['rebind_ms']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=info, fingerprints=fps, nonzero_rows_us=rows, tracer_start_ms=start), f, indent=1)


if __name__ == "__main__":
    main()
