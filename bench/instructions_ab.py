"""What the tracer costs the example in executed instructions and simulated cache misses: a
measure that a shared, noisy VM does not move.

Wall and CPU-time ratios of record against untraced (example_tp2_ab.py, example_cpu_ab.py) swing
by several per cent between hours on a shared 2-core VM. Here each variant runs in its own
process under valgrind's callgrind, which counts every instruction executed and simulates the
caches (this host's L1 sizes, L2 as the last level). The counts are the same from run to run, so
the variants can be compared to a fraction of a per cent. What they cannot show is time itself;
the cycle estimate (cachegrind's usual weights: an instruction 1, an L1 miss 10, a last-level
miss 100) is a proxy for it that counts what the added instructions do to the caches.

Per variant: the example's model (examples/tp_llama.py, 74 module calls a step at tp=1) warms up
for ``--warmup`` steps under the variant, then ``--steps`` steps are counted (callgrind dumps
its counts at two calls of ``os.getpgrp`` around them). With the defaults (8 and 128) the counted
steps are one whole period of record's schedules: 16 of the 128 take fingerprints and one
records lineage, as in a long run. Counted: the traced (main) thread, which here also flushes the
counted steps' records to the rank file (msgpack, zlib, write; the writer's thread is kept idle),
so that what the writer's thread would do is in the count. gloo's threads (at tp=2) are not.

Variants: ``untraced``; ``record`` (record's defaults: tracer/native.py's C call wrapper,
fingerprints and lineage on their schedules); ``record-nofp`` (``--no-fingerprint``);
``record-nocoll`` (the collective wrappers taken out again: what tracing the collectives
costs, at tp=2); ``record-nolineage`` (``--no-lineage``: what the lineage schedule's one step in
128 costs); ``record-0:1`` (``--steps 0:1``: every counted step after the window, which has
closed for good); ``record-before`` (a window that begins after the run: every counted step
before it, its step count and the collectives' sequence numbers still kept);
``empty-hooks`` (two empty global forward hooks, no tracer: a floor); ``profiler``
(``torch.profiler.profile(activities=[CPU], record_shapes=True)`` entered before the warm-up).

    OMP_NUM_THREADS=1 .venv/bin/python bench/instructions_ab.py [--tp 2] [--jobs 2]

Needs ``valgrind`` on PATH. A variant takes 4-6 min of a core under the cache simulation
(importing torch is much of it), ``--jobs`` variants at a time: tp=1's three about 12 min with
``--jobs 2``; at ``--tp 2`` both ranks of a variant run under valgrind through torchrun (use
``--jobs 1``), about 6 min a variant.
"""
from __future__ import annotations

import argparse
import gc
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from common import ROOT, header, header_line  # bench/ is first on sys.path

VARIANTS = ("untraced", "record", "record-nofp", "record-nolineage", "record-nocoll", "record-0:1", "record-before",
            "empty-hooks", "profiler")
# This host's L1 caches (48 KiB data, 64 KiB instructions a core) and its 2 MiB L2 as the last
# level (the simulator's sizes must give a power-of-two number of sets).
CACHES = ["--I1=65536,8,64", "--D1=49152,12,64", "--LL=2097152,16,64"]


# ---------------------------------------------------------------------------- child (one variant)


def _start(variant: str, out_dir: str):
    """Start what ``variant`` runs before its warm-up; returns what stops it. The writer's thread
    never flushes here (its period and idle wait are longer than the run): the counted steps'
    records are flushed on the traced thread (_flush), inside the count."""
    from variants import start as start_variant  # (bench/; the driver process needs no torch)

    return start_variant(variant, out_dir, flush_interval_s=1e6, idle_flush_s=1e6)


def _flush() -> None:
    """The rank file's records so far encoded, compressed and written, on this thread."""
    from tensor_trace import tracer

    if tracer.current() is not None and tracer.current().writer is not None:
        tracer.current().writer.flush()


def _check_c_path(variant: str) -> None:
    """A traced variant's steps must go through the C call wrapper (taken at the first steps),
    or this would count the Python path."""
    from tensor_trace import tracer

    if variant.startswith("record") and variant not in ("record-0:1", "record-before"):
        handles = tracer.current().global_handles
        if not handles or getattr(handles[0], "native_call", None) is None:
            raise SystemExit(f"{variant}: the C call wrapper was not taken")


def child(args) -> None:
    import torch

    from models import load_example

    os.environ.setdefault("TENSOR_TRACE_NATIVE", "1")
    from tensor_trace.tracer import native

    native.ensure(block=True, timeout=900)
    world, rank, group = 1, 0, None
    if args.tp > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    ex = load_example()
    cfg = ex.TinyLlamaConfig()
    model = ex.build_model(cfg, rank, world, group, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for _ in range(3):  # torch's own first-call work, before any variant
            model(ids)[0].argmax(-1).tolist()
        stop = _start(args.child, tempfile.mkdtemp(prefix="tt-instr-"))
        for _ in range(args.warmup):
            model(ids)[0].argmax(-1).tolist()
        _check_c_path(args.child)
        _flush()
        # The garbage collector's counters from zero: the collections inside the count are the
        # ones the counted steps' own allocations set off, the same in every run of a variant
        # (without it, whether a full collection, ~3 points of a step at tp=1, falls inside
        # depended on where the counters stood)
        gc.collect()
        os.getpgrp()  # callgrind dumps its counts here (--dump-before=getpgrp) ...
        for _ in range(args.steps):
            model(ids)[0].argmax(-1).tolist()
        _flush()
        os.getpgrp()  # ... and here: the second part is the counted steps and their flush
        stop()
    if args.tp > 1:
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------- driver


def _summary(path: str) -> dict:
    """A callgrind file's totals by event name."""
    heads = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("events", "summary"):
                heads[key] = rest.split()
    return dict(zip(heads["events"], map(int, heads["summary"])))


def run_variant(args, variant: str, work: str) -> dict:
    """Per rank: the traced thread's events in the counted steps, per step."""
    out = os.path.join(work, variant.replace(":", "_"))
    os.makedirs(out)
    # (files named by the rank torchrun gives each process: %q{RANK}, set to 0 at tp=1)
    vg = ["valgrind", "--tool=callgrind", "--cache-sim=yes", *CACHES, "--separate-threads=yes",
          "--dump-before=getpgrp", f"--callgrind-out-file={out}/cg.%q{{RANK}}"]
    me = [os.path.abspath(__file__), "--child", variant, "--tp", str(args.tp),
          "--warmup", str(args.warmup), "--steps", str(args.steps)]
    if args.tp > 1:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, "--nproc-per-node", str(args.tp), "--no-python", *vg, sys.executable, *me]
    else:
        cmd = [*vg, sys.executable, *me]
    env = dict(os.environ, RANK="0", PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{variant}: exit {done.returncode}\n{done.stderr[-3000:]}")
    # callgrind's files: cg.RANK.PART-THREAD; part 2 is between the two dumps, which only the
    # thread that calls getpgrp makes: thread 01, the main one
    ranks = {int(os.path.basename(path).split(".")[1]): {k: v / args.steps for k, v in _summary(path).items()}
             for path in glob.glob(os.path.join(out, "cg.*.2-01"))}
    if sorted(ranks) != list(range(args.tp)):
        raise SystemExit(f"{variant}: callgrind's counts of the steps under {out} are of ranks {sorted(ranks)}")
    return ranks


def cycles(ev: dict) -> float:
    """cachegrind's estimate: Ir + 10 (L1 misses) + 100 (last-level misses)."""
    l1 = ev["I1mr"] + ev["D1mr"] + ev["D1mw"]
    ll = ev["ILmr"] + ev["DLmr"] + ev["DLmw"]
    return ev["Ir"] + 10 * l1 + 100 * ll


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--keep", metavar="DIR", help="keep callgrind's files here (callgrind_annotate reads them)")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on PATH")
    print(header_line("instructions_ab", header(sys.argv)), flush=True)
    variants = ["untraced", *[v for v in args.variants if v != "untraced"]]
    work = args.keep or tempfile.mkdtemp(prefix="tt-instr-ab-")
    os.makedirs(work, exist_ok=True)
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            counts = dict(zip(variants, pool.map(lambda v: run_variant(args, v, work), variants)))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n== example, tp={args.tp}, {args.steps} steps counted after {args.warmup}, the traced thread "
          f"(the steps' flush to the rank file included): per step, instructions (Ir), L1 misses "
          f"(instructions, data), last-level (L2) misses, and the cycle estimate Ir + 10 L1 + 100 LL; "
          f"x = ratio to untraced ==")
    base = counts["untraced"]
    for rank in sorted(base):
        print(f"-- rank {rank}")
        b = base[rank]
        for v in variants:
            ev = counts[v][rank]
            row = [f"Ir {ev['Ir'] / 1e6:8.3f} M x{ev['Ir'] / max(b['Ir'], 1):.3f}",
                   f"I1 {ev['I1mr'] / 1e3:6.1f} k", f"D1 {(ev['D1mr'] + ev['D1mw']) / 1e3:6.1f} k",
                   f"LL {(ev['ILmr'] + ev['DLmr'] + ev['DLmw']) / 1e3:5.1f} k",
                   f"cycles {cycles(ev) / 1e6:8.3f} M x{cycles(ev) / max(cycles(b), 1):.3f}"]
            print(f"   {v:<13} " + "  ".join(row))


if __name__ == "__main__":
    main()
