"""The example at TP=2 (two gloo ranks) traced in-process, variants switched block by block.

bench/record_cpu.py runs a whole process tree per variant, whose wall time on a shared 2-core VM
spreads ±20 % between rounds. Here the two ranks stay up and switch between variants in blocks,
in one shuffled order that both ranks draw from the same seed; a block starts with a barrier,
starts its tracer session (a fresh rank file) on both ranks, runs ``--warmup`` steps, then times
``--steps`` steps. Per step: rank 0's wall time (it waits for rank 1 at every collective, so it
is the pair's step) and each rank's main-thread CPU time (``time.thread_time``: the traced
thread only, not the rank file's writer thread nor gloo's).

Variants (``--variants``):

- ``untraced``      the model alone;
- ``untraced-b``    the same again (a control: how far two identical variants differ);
- ``record``        a tracer session with record's defaults (tracer/native.py's C call wrapper
                    where it builds);
- ``record-nocoll`` the same with the collective wrappers taken out again after start (what
                    tracing the 14 collectives a step costs);
- ``record-nowake`` the same with the step end's ``flush_when_idle`` made a no-op (what waking
                    the writer thread costs);
- ``record-nofp``   ``fingerprint=False``;
- ``record-nolineage`` ``lineage=False`` (what the lineage schedule's steps cost);
- ``record-0:1``    ``steps=(0, 1)``: the block's first warm-up step traced, every timed step
                    after the window, which has closed for good (Tracer.go_dormant);
- ``record-before`` a window the run never reaches: every timed step before it (the root's
                    step hooks and the collectives' sequence numbers still kept);
- ``empty-hooks``   two empty global forward hooks (pre and post), no tracer: a floor;
- ``profiler``      ``torch.profiler.profile(activities=[CPU], record_shapes=True)`` entered at
                    the block's start and exited at its end, no tracer: what a user would run
                    instead (issue #22 target 1: ``record`` below it in the same runs). Its
                    trace stays in memory (events are collected when the block exits, after the
                    timed steps; nothing is exported); the block checks it recorded events.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 bench/example_tp2_ab.py --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from common import header, header_line  # bench/ is first on sys.path
from models import load_example
from variants import start as start_variant

VARIANTS = ("untraced", "untraced-b", "record", "record-nocoll", "record-nowake", "record-nofp", "record-nolineage",
            "record-0:1", "record-before", "empty-hooks", "profiler")


MAIN_TID = threading.get_native_id()


def thread_cpu() -> dict:
    """Per thread name (threads of one name summed): CPU seconds (/proc schedstat, ns) and
    context switches (voluntary + involuntary) so far."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:
            continue
        name = status.split("\n", 1)[0].split(":", 1)[1].strip()
        if int(tid) == MAIN_TID:
            name = "main"
        switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line)
        cpu, sw = out.get(name, (0.0, 0))
        out[name] = (cpu + ns / 1e9, sw + switches)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    os.environ.setdefault("TENSOR_TRACE_NATIVE", "1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from tensor_trace.tracer import native

    if rank == 0:
        print(header_line("example_tp2_ab", header(sys.argv)), flush=True)
        native.ensure(block=True, timeout=900)
        print(f"# tracer/native.py: {'C call wrapper' if native.traced_call() else native.error()}",
              flush=True)
    dist.barrier()
    ex = load_example()
    cfg = ex.TinyLlamaConfig()
    model = ex.build_model(cfg, rank, world, dist.group.WORLD, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    work = tempfile.mkdtemp(prefix=f"tt-tp2-ab-{rank}-")
    variants = ["untraced", *[v for v in args.variants if v != "untraced"]]
    rng = random.Random(args.seed)
    times = {v: [] for v in variants}
    n = 0
    try:
        with torch.inference_mode():
            for _ in range(args.rounds):
                order = list(variants)
                rng.shuffle(order)
                for v in order:
                    n += 1
                    dist.barrier()
                    stop = start_variant(v, os.path.join(work, str(n)))
                    try:
                        for _ in range(args.warmup):
                            model(ids)[0].argmax(-1).tolist()
                        wall, cpu = [], []
                        threads0, p0 = thread_cpu(), time.process_time()
                        for _ in range(args.steps):
                            t0, c0 = time.perf_counter(), time.thread_time()
                            logits, _ = model(ids)
                            wall.append(time.perf_counter() - t0)
                            cpu.append(time.thread_time() - c0)
                            logits.argmax(-1).tolist()  # as the example reads its result
                        p1, threads1 = time.process_time(), thread_cpu()
                    finally:
                        stop()
                    times[v].append(dict(wall=statistics.median(wall), wall_mean=sum(wall) / len(wall),
                                         cpu=statistics.median(cpu),
                                         process=(p1 - p0) / args.steps,
                                         threads={k: ((v[0] - threads0.get(k, (0.0, 0))[0]) / args.steps,
                                                      (v[1] - threads0.get(k, (0.0, 0))[1]) / args.steps)
                                                  for k, v in threads1.items()}))
        gathered = [None] * world
        dist.all_gather_object(gathered, times)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        dist.destroy_process_group()
    if rank != 0:
        return
    base0, base1 = gathered[0]["untraced"], gathered[1]["untraced"]
    print(f"\n== example at TP=2, gloo, {args.rounds} rounds x {args.steps} steps after {args.warmup}: "
          f"rank 0's step wall (median, mean) and each rank's main-thread CPU per step (median); "
          f"ratio = median over rounds of the block over its round's untraced block (min-max) ==")
    for v in variants:
        cells = []
        for label, rows, base, key in (("wall", gathered[0][v], base0, "wall"),
                                       ("wall mean", gathered[0][v], base0, "wall_mean"),
                                       ("cpu r0", gathered[0][v], base0, "cpu"),
                                       ("cpu r1", gathered[1][v], base1, "cpu")):
            ratios = [r[key] / b[key] for r, b in zip(rows, base)]
            cells.append(f"{label} {statistics.median(r[key] for r in rows) * 1e3:6.2f} ms "
                         f"x{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"{v:<14} " + "  ".join(cells))
        for r in (0, 1):
            rows = gathered[r][v]
            names = sorted({k for row in rows for k in row["threads"]})
            per = {k: (statistics.median(row["threads"].get(k, (0, 0))[0] for row in rows) * 1e3,
                       statistics.median(row["threads"].get(k, (0, 0))[1] for row in rows)) for k in names}
            print(f"{'':<14} rank {r}: process CPU {statistics.median(row['process'] for row in rows) * 1e3:6.2f} "
                  f"ms/step; threads (CPU ms, switches per step): "
                  + ", ".join(f"{k} {x:.2f} {n:.0f}" for k, (x, n) in per.items() if x > 0.005 or n))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), ranks=gathered), f, indent=1)


if __name__ == "__main__":
    main()
