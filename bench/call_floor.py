"""What a traced module call costs against the floor of any ``Module.__call__`` wrapper, side by side.

    TENSOR_TRACE_NATIVE=1 OMP_NUM_THREADS=1 python bench/call_floor.py [--rounds 300] [--calls 400] [--work]

A chain of one-tensor leaf modules that do no work (``--work``: leaves that run a projection, an
RMS norm and an activation, so that torch's code and data go through the caches between two
calls, as in a model; the tracer's per-call cost then includes fetching its own code and data
back), one step per variant per round in shuffled order, timed on the step's thread CPU clock
(a shared host's descheduling left out). Variants:

- ``plain``       torch's own ``Module.__call__``;
- ``empty-py``    a Python wrapper that only calls it (``def __call__(m, *a, **k): return inner(m, *a, **k)``):
                  the floor of any wrapper written in Python;
- ``empty-c``     tracer/native_call.py's ``TracedCall`` in the modules' call slots, passing every
                  call on to torch's: the floor in C;
- ``traced-py``   the tracer without fingerprints, its Python wrapper and layout keys (``TENSOR_TRACE_NATIVE=0``);
- ``traced-pycall`` the same with tracer/native.py's layout keys (the Python wrapper of before the C one);
- ``traced-c``    the tracer without fingerprints as it comes with tracer/native.py: the C wrapper.

Prints the median ns per module call of each and its excess over plain. Needs tracer/native.py
(built here first: ``TENSOR_TRACE_NATIVE=1``).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import torch
import torch.nn as nn

from tensor_trace import schema, tracer
from tensor_trace.tracer import intercept, native, spans


class Leaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = torch.ones(2, 4)

    def forward(self, x):
        return self.out


class WorkingLeaf(nn.Module):
    """A leaf that does what the example's leaves do between two module calls (a projection, an
    RMS norm, an activation: a few torch ops, ~20 us on a CPU), so that torch's code and data
    pass through the caches between the tracer's calls, as in a model."""

    def __init__(self, hidden: int = 96):
        super().__init__()
        self.weight = torch.randn(hidden, hidden) * 0.01

    def forward(self, x):
        h = torch.nn.functional.linear(x, self.weight)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).relu()


class Chain(nn.Module):
    def __init__(self, n, leaf=Leaf):
        super().__init__()
        self.leaves = nn.ModuleList(leaf() for _ in range(n))

    def forward(self, x):
        for leaf in self.leaves:
            x = leaf(x)
        return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--work", action="store_true",
                    help="leaves that do torch work (WorkingLeaf) instead of returning a constant")
    args = ap.parse_args()
    torch.set_num_threads(1)
    native.ensure(block=True)
    if native.traced_call() is None:
        raise SystemExit(f"tracer/native.py is needed (TENSOR_TRACE_NATIVE=1): {native.error()}")
    if args.work:
        model, x = Chain(args.calls, WorkingLeaf), torch.randn(16, 96)
    else:
        model, x = Chain(args.calls), torch.ones(2, 4)
    inner = nn.Module.__call__

    def empty(module, *a, **k):
        return inner(module, *a, **k)

    tr = tracer.start(out_dir=tempfile.mkdtemp(prefix="tt-floor-"), fingerprint=False, lineage=False)
    try:
        with torch.inference_mode():
            for _ in range(3):
                model(x)
            wrapper = tr.global_handles[0]
            passing = native.traced_call()(inner, inner, tr, torch.Tensor, vars(torch.compiler),
                                           spans.span_one_tensor, intercept.finish_call,
                                           intercept.CONTEXT_TYPES, schema.SPAN)
            passing.close()  # (every call goes to its "Python wrapper": here torch's own)
            calls = {"plain": inner, "empty-py": empty, "empty-c": inner, "traced-py": wrapper.python_call,
                     "traced-pycall": wrapper.python_call, "traced-c": wrapper.python_call}
            times = {v: [] for v in calls}
            classes = [cls for cls in (nn.Module, Leaf, WorkingLeaf, Chain, nn.ModuleList)]
            rng = random.Random(0)
            for _ in range(args.rounds):
                order = list(calls)
                rng.shuffle(order)
                for v in order:
                    if v == "traced-py":
                        spans.use_native_keys(None)
                    else:
                        spans.use_native_keys(native.pair_key(), native.call_key())
                    nn.Module.__call__ = calls[v]  # (CPython's call slots back)
                    if v == "empty-c":  # the modules' call slots to the C object passing calls on
                        native.patch_call_slots()(passing, nn.Module, classes)
                    elif v == "traced-c":
                        wrapper.use_native()
                    t0 = time.thread_time_ns()
                    model(x)
                    times[v].append(time.thread_time_ns() - t0)
            nn.Module.__call__ = wrapper.python_call
    finally:
        tracer.stop()
    base = statistics.median(times["plain"])
    print(f"# call_floor {time.strftime('%Y-%m-%d %H:%M')} torch={torch.__version__} rounds={args.rounds} "
          f"calls={args.calls}{' work' if args.work else ''} (CPU, one thread, thread CPU time) load={' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for v, ts in times.items():
        med = statistics.median(ts)
        print(f"  {v:<14} {med / args.calls:7.0f} ns/call  {(med - base) / args.calls:+6.0f} over plain")


if __name__ == "__main__":
    main()
