"""The example's model traced in-process, C call wrapper against the Python path, by CPU time.

bench/record_cpu.py measures what a user runs (two ranks, wall time), which on a shared 2-core
VM spreads ±20 % and more between rounds. This measures the part of it that the C call wrapper
changes, by the process's CPU time (``time.process_time``: the traced thread and the rank
file's writer thread, not other processes): the example's default model (examples/tp_llama.py,
74 module calls a step) at tp=1 (no collectives), one process, variants in blocks shuffled
within each round:

- ``untraced``  the model alone;
- ``record-c``  a tracer session with record's defaults (fingerprints and lineage on their
                schedules) and tracer/native.py's keys and C call wrapper (TENSOR_TRACE_NATIVE=1);
- ``record-py`` the same session on the Python path (TENSOR_TRACE_NATIVE=0).

Each block starts a tracer session (a fresh rank file), runs ``--warmup`` steps (the first
fingerprinted steps of the schedule) and then times ``--steps`` steps one by one. Printed: per
variant the median step and the mean step (the periodic fingerprinted and lineage steps
included), each as the median over rounds of its ratio to that round's untraced block.

    OMP_NUM_THREADS=1 .venv/bin/python bench/example_cpu_ab.py --rounds 9
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from common import header, header_line, shuffled_rounds  # bench/ is first on sys.path
from models import load_example

VARIANTS = ("untraced", "record-c", "record-py")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(header_line("example_cpu_ab", header(sys.argv)))
    from tensor_trace import tracer
    from tensor_trace.tracer import native

    os.environ["TENSOR_TRACE_NATIVE"] = "1"
    native.ensure(block=True, timeout=900)
    if native.traced_call() is None:
        sys.exit(f"tracer/native.py is unavailable: {native.error()}")
    ex = load_example()
    cfg = ex.TinyLlamaConfig()
    model = ex.build_model(cfg, 0, 1, None, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    work = tempfile.mkdtemp(prefix="tt-example-ab-")
    counter = [0]

    def block(variant: str) -> dict:
        if variant != "untraced":
            os.environ["TENSOR_TRACE_NATIVE"] = "1" if variant == "record-c" else "0"
            counter[0] += 1
            tracer.start(out_dir=os.path.join(work, str(counter[0])))
        try:
            for _ in range(args.warmup):
                model(ids)
            steps = []
            for _ in range(args.steps):
                t0 = time.process_time()
                model(ids)
                steps.append(time.process_time() - t0)
            if variant != "untraced":
                handles = tracer.current().global_handles
                in_c = sum(getattr(h, "native_call", None) is not None for h in handles)
                assert in_c == (variant == "record-c"), (variant, in_c)
        finally:
            if variant != "untraced":
                tracer.stop()
        return dict(median=statistics.median(steps), mean=sum(steps) / len(steps))

    try:
        with torch.inference_mode():
            times = shuffled_rounds(block, VARIANTS, args.rounds, args.seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = times["untraced"]
    print(f"\n== example model (tp=1, 74 module calls a step), {args.rounds} rounds of {args.steps} steps "
          f"after {args.warmup}: process CPU time per step; ratio = median over rounds of the "
          f"variant's block over that round's untraced block (min-max) ==")
    for v in VARIANTS:
        row = []
        for key in ("median", "mean"):
            vals = [r[key] for r in times[v]]
            ratios = [r[key] / b[key] for r, b in zip(times[v], base)]
            row.append(f"{key} {statistics.median(vals) * 1e3:7.3f} ms x{statistics.median(ratios):.3f} "
                       f"({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"{v:<10} " + "   ".join(row))


if __name__ == "__main__":
    main()
