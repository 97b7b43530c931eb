"""Where a traced eager step's extra host time goes: ablations side by side, phase timers, GC and
CUDA runtime calls per step.

    python bench/eager_fp_probe.py [--batch 8 64] [--rounds 5] [--trace-dir DIR]   # needs a GPU

For the Llama-8B-shaped decode step of bench/overhead.py, each variant runs in shuffled blocks
(W warm-up + N timed steps, device synchronised after every step) and reports its median step
time and the ratio to ``plain`` of the same run:

- ``nofp`` / ``fp``        the tracer without / with fingerprints (defaults otherwise);
- ``fp-alldefer``          every floating CUDA tensor deferred (no immediate reductions);
- ``fp-noflush``           deferred tensors are held but never reduced (the flush drops them):
                           the hooks' own fingerprint bookkeeping without the step-end kernels;
- ``fp-holdonly``          ``add_one``/``add`` only hold the tensors (dropped at the step's end);
- ``fp-old``               ``fp`` with ``bench/_old_fingerprint.py`` (an earlier version), if present;
- ``fp-nokeep``            ``add_one``/``add`` only count indices: spans as with fingerprints,
                           no fingerprint work at all;
- ``call-nop``             the ``Module.__call__`` wrapper with empty bodies (its own floor);
- ``fp-gcoff``             ``fp`` with Python's garbage collector off;
- ``fp-holdM``              ``fp`` flushing whenever M MiB are held (``TENSOR_TRACE_FP_HOLD_MIB``):
                           more launches per step, fewer tensors alive at once.

Then, for ``nofp`` and ``fp``: host time per step spent in the step's end (``_end_step``), in the
deferred flush and in immediate reductions; Python GC collections and their time per step; and the
CUDA runtime calls per step by name (count and host time, torch.profiler), which shows any
synchronising call or allocation. ``--trace-dir`` also writes a Chrome trace of 2 steps each.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import random
import statistics
import tempfile
import time

import torch

import overhead as ov  # bench/ is this script's folder, first on sys.path
from tensor_trace import tracer
from tensor_trace.tracer import core, fingerprint as fpmod

try:  # bench/_old_fingerprint.py: an earlier tracer/fingerprint.py, for an "fp-old" variant
    import _old_fingerprint as OLD
except ImportError:
    OLD = None


@contextlib.contextmanager
def traced(fp: bool, tmp: str):
    tracer.start(out_dir=tempfile.mkdtemp(dir=tmp), fingerprint=fp)
    try:
        yield
    finally:
        tracer.stop()


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _drop_flush(self):
    self._def_i, self._def_v, self._def_ts, self._def_pos, self._def_bytes, self._last = [], [], [], {}, 0, None
    if hasattr(self, "_def_tab"):  # the kernel's table rows, built as tensors are held
        self._def_tab, self._def_dtype, self._def_dev, self._def_mixed, self._def_dead = [], None, None, False, 0


def _hold_one(self, t, store=True):
    self._def_ts.append(t)
    idx = self.count
    self.count = idx + 1
    return idx


def _hold_n(self, tensors, store=True, immediate=False):
    self._def_ts += tensors
    idx = self.count
    self.count = idx + len(tensors)
    return idx


def _count_one(self, t, store=True):
    idx = self.count
    self.count = idx + 1
    return idx


def _count_n(self, tensors, store=True, immediate=False):
    idx = self.count
    self.count = idx + len(tensors)
    return idx


def variant(name: str, tmp: str):
    stack = contextlib.ExitStack()
    if name == "plain":
        return stack
    if name == "fp-alldefer":
        stack.enter_context(patched(fpmod, "DEFER_MAX_NUMEL", 1 << 62))
    elif name == "fp-noflush":
        stack.enter_context(patched(fpmod.StepFingerprints, "_flush_deferred", _drop_flush))
    elif name == "call-nop":  # the Module.__call__ wrapper around bodies that do nothing
        stack.enter_context(patched(core.Tracer, "_global_pre", lambda self, m, a: None))
        stack.enter_context(patched(core.Tracer, "_global_post", lambda self, m, a, *r: None))
        stack.enter_context(traced(False, tmp))
        return stack
    elif name == "fp-gcoff":
        gc.disable()
        stack.callback(gc.enable)
    elif name == "fp-holdonly":  # tensors held until the step's end, nothing else
        stack.enter_context(patched(fpmod.StepFingerprints, "add_one", _hold_one))
        stack.enter_context(patched(fpmod.StepFingerprints, "add", _hold_n))
        stack.enter_context(patched(fpmod.StepFingerprints, "_flush_deferred", _drop_flush))
    elif name == "fp-old" and OLD is not None:  # the previous commit's tracer/fingerprint.py
        stack.enter_context(patched(core, "StepFingerprints", OLD.StepFingerprints))
    elif name.startswith("fp-hold") and name[7:].isdigit():  # fp-hold4: flush past 4 MiB held
        stack.enter_context(patched(fpmod, "DEFER_BYTES", int(name[7:]) << 20))
    elif name == "fp-nokeep":
        stack.enter_context(patched(fpmod.StepFingerprints, "add_one", _count_one))
        stack.enter_context(patched(fpmod.StepFingerprints, "add", _count_n))
    stack.enter_context(traced(name != "nofp", tmp))
    return stack


class PhaseTimer:
    """Accumulates host time spent in wrapped methods."""

    def __init__(self):
        self.ns = collections.Counter()
        self.calls = collections.Counter()
        self._stack = contextlib.ExitStack()

    def wrap(self, owner, name, label):
        fn = getattr(owner, name)
        ns, calls, pc = self.ns, self.calls, time.perf_counter_ns

        def timed(*a, **k):
            t0 = pc()
            try:
                return fn(*a, **k)
            finally:
                ns[label] += pc() - t0
                calls[label] += 1

        self._stack.enter_context(patched(owner, name, timed))

    def hold_during(self, owner, name, label):
        """Keep ``_def_ts`` alive through ``name`` (already wrapped by ``wrap``) and time its
        release separately: what freeing the held tensors costs, apart from the flush's work."""
        fn = getattr(owner, name)
        ns, calls, pc = self.ns, self.calls, time.perf_counter_ns

        def held(obj, *a, **k):
            keep = obj._def_ts
            try:
                return fn(obj, *a, **k)
            finally:
                t0 = pc()
                del keep
                ns[label] += pc() - t0
                calls[label] += 1

        self._stack.enter_context(patched(owner, name, held))

    def close(self):
        self._stack.close()


SYNC = [lambda: None]


CPU_NS: list = []  # main-thread CPU time of each step run_steps timed last


def run_steps(step, n):
    pc, tt = time.perf_counter_ns, time.thread_time_ns
    sync = SYNC[0]
    out = []
    CPU_NS.clear()
    for _ in range(n):
        c0 = tt()
        t0 = pc()
        step()
        sync()
        out.append(pc() - t0)
        CPU_NS.append(tt() - c0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--variants", nargs="+",
                    default=["plain", "call-nop", "nofp", "fp", "fp-alldefer", "fp-noflush", "fp-nokeep",
                             "fp-gcoff"])
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="8b", help="bench/overhead.py LLAMA_SHAPES (tiny: a CPU smoke test)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        SYNC[0] = torch.cuda.synchronize
    shape = dict(ov.LLAMA_SHAPES[args.shape], kv_len=512)
    torch.manual_seed(0)
    model = ov.LlamaForCausalLM(shape, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    tmp = tempfile.mkdtemp(prefix="tt-probe-")
    report = {}
    for batch in args.batch:
        model.set_batch(batch)
        ids = torch.randint(0, shape["vocab"], (batch, 1), device=dev)

        def step():
            return model(ids)

        res = {v: [] for v in args.variants}
        cpu = {v: [] for v in args.variants}
        rng = random.Random(batch)
        with torch.inference_mode():
            for _ in range(3):
                step()
            SYNC[0]()
            for _r in range(args.rounds + 1):
                order = list(args.variants)
                rng.shuffle(order)
                for v in order:
                    gc.collect()
                    with variant(v, tmp):
                        run_steps(step, args.warmup)
                        times = run_steps(step, args.steps)
                    if _r:  # the first round warms every variant up and is dropped
                        res[v] += times
                        cpu[v] += CPU_NS
            plain = statistics.median(res["plain"]) / 1e6
            plain_p10 = sorted(res["plain"])[len(res["plain"]) // 10] / 1e6
            plain_cpu = statistics.median(cpu["plain"]) / 1e6
            print(f"\n== batch {batch}: wall median ms/step, ratio, +ms; wall p10, ratio; main-thread "
                  "CPU ms/step (median), ratio, +ms")
            rows = {}
            for v in args.variants:
                ts = sorted(res[v])
                med = statistics.median(ts) / 1e6
                p10, p90 = ts[len(ts) // 10] / 1e6, ts[9 * len(ts) // 10] / 1e6
                c = statistics.median(cpu[v]) / 1e6
                rows[v] = dict(median_ms=med, ratio=med / plain, p10=p10, p90=p90, p10_ratio=p10 / plain_p10,
                               cpu_ms=c, cpu_ratio=c / plain_cpu)
                print(f"  {v:<12} {med:8.3f}  x{med / plain:.3f}  {med - plain:+7.3f} | p10 {p10:7.3f} "
                      f"x{p10 / plain_p10:.3f} | cpu {c:7.3f} x{c / plain_cpu:.3f} {c - plain_cpu:+7.3f}")

            # Phase timers, GC and runtime calls, per step.
            phases = {}
            for v in ("nofp", "fp") + (("fp-old",) if OLD is not None and "fp-old" in args.variants else ()):
                timer = PhaseTimer()
                fps_cls = OLD.StepFingerprints if v == "fp-old" else fpmod.StepFingerprints
                timer.wrap(core.Tracer, "_end_step", "end_step")
                timer.wrap(fps_cls, "_flush_deferred", "flush")
                timer.hold_during(fps_cls, "_flush_deferred", "free_held")
                timer.wrap(fpmod.multi_tensor, "sum_sumsq_table", "table_launch")
                timer.wrap(fps_cls, "_reduce_now", "reduce_now")
                timer.wrap(fps_cls, "collect", "collect")
                timer.wrap(fps_cls, "_finish_step", "finish_step")
                gcs = collections.Counter()
                gc_t = [0, 0]

                def on_gc(phase, info, gcs=gcs, gc_t=gc_t):
                    if phase == "start":
                        gc_t[1] = time.perf_counter_ns()
                    else:
                        gcs[info["generation"]] += 1
                        gc_t[0] += time.perf_counter_ns() - gc_t[1]

                n = 40
                try:
                    with variant(v, tmp):
                        run_steps(step, 4)
                        timer.ns.clear()
                        timer.calls.clear()
                        gc.callbacks.append(on_gc)
                        try:
                            times = run_steps(step, n)
                        finally:
                            gc.callbacks.remove(on_gc)
                finally:
                    timer.close()
                ph = {k: timer.ns[k] / n / 1e6 for k in timer.ns}
                ph_calls = {k: timer.calls[k] / n for k in timer.calls}
                phases[v] = dict(step_ms=statistics.median(times) / 1e6, ms_per_step=ph,
                                 calls_per_step=ph_calls, gc_per_step={g: c / n for g, c in gcs.items()},
                                 gc_ms_per_step=gc_t[0] / n / 1e6)
                print(f"  [{v}] step {phases[v]['step_ms']:.3f} ms; per step: "
                      + ", ".join(f"{k} {ph[k]:.3f} ms/{ph_calls[k]:.1f}x" for k in sorted(ph))
                      + f"; gc {dict(sorted(phases[v]['gc_per_step'].items()))} {phases[v]['gc_ms_per_step']:.3f} ms")

            api = {}
            for v in ("plain", "nofp", "fp"):
                with variant(v, tmp):
                    run_steps(step, 4)
                    acts = [torch.profiler.ProfilerActivity.CPU]
                    if dev.type == "cuda":
                        acts.append(torch.profiler.ProfilerActivity.CUDA)
                    with torch.profiler.profile(activities=acts) as prof:
                        run_steps(step, 3)
                if args.trace_dir:
                    os.makedirs(args.trace_dir, exist_ok=True)
                    prof.export_chrome_trace(os.path.join(args.trace_dir, f"b{batch}-{v}.json"))
                by = collections.defaultdict(lambda: [0, 0.0])
                for e in prof.events():
                    if e.device_type != torch.autograd.DeviceType.CUDA and e.name.startswith(("cuda", "cu")):
                        by[e.name][0] += 1
                        by[e.name][1] += e.cpu_time_total
                api[v] = {k: (c / 3, us / 3) for k, (c, us) in sorted(by.items(), key=lambda kv: -kv[1][1])}
                print(f"  [{v}] runtime calls per step: " + ", ".join(
                    f"{k} {c:.0f}x {us / 1e3:.3f} ms" for k, (c, us) in list(api[v].items())[:8]))
            report[batch] = dict(variants=rows, phases=phases, runtime_calls=api)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
