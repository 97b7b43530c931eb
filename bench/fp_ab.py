"""The tracer's variants compared step by step on one traced model: robust to a host whose
speed drifts (the lent H200's host: the same step measured 15 to 38 ms within a minute).

    python bench/fp_ab.py [--batch 8 64] [--rounds 300] [--python-only]     # needs a GPU
    OMP_NUM_THREADS=1 python bench/fp_ab.py --cpu-model [--rounds 1000]     # on a CPU

One tracer runs the Llama-8B-shaped decode step of bench/models.py. Each round runs one step of
each variant, in shuffled order, device synchronised after each:

- ``plain``   torch's own ``Module.__call__`` put back for that step: nothing of the tracer runs;
- ``nofp``    the tracer as it comes, fingerprints off for that step;
- ``fp``      the tracer as it comes, fingerprints on (every step);
- ``default`` the tracer as it comes with ``record``'s default schedule of fingerprints (the first
              4 steps, then every 8th, of this variant's own steps): its figure is the MEAN over the
              rounds (most of its steps take no fingerprints); the median of per-round ratios is
              printed beside it, and shows the unfingerprinted steps;
- where tracer/native.py is available (the default where CUDA is, built first):
  ``nofp-py`` and ``fp-py``, the same with the Python call wrapper, layout key and fingerprint
  table (the tracer with ``TENSOR_TRACE_NATIVE=0``), and ``fp-py2``, a second instance of fp-py
  (the noise floor of a paired difference); ``nofp-pycall`` and ``fp-pycall``, native keys and
  table with the Python call wrapper (without tracer/native_call.py's C one); fp's values are checked on one step against fp-py's
  and against torch's own at hook time;
- ``fp-old``  bench/_old_fingerprint.py, an earlier version, when present;
- floors, no tracer: ``empty-wrapper`` (``Module.__call__`` replaced by the thinnest Python
  pass-through to torch's own, the floor of the tracer's ``--intercept call``) and
  ``empty-hooks`` (two empty global forward hooks on torch's own ``__call__``, the floor of
  ``--intercept hooks``, as in bench/overhead.py). ``--gpu-step-ms`` gives the ratio to plain
  that a GPU step of that plain time sees when each step pays a variant's paired host time;
  ``--thread-time`` times steps by the thread's CPU time (``--cpu-model`` on a shared host).

Switching is a per-step attribute change (the tracer's ``fps`` object, its ``fingerprint``
flag, the layout key function, ``Module.__call__``: torch's, the Python wrapper or the C one),
so consecutive steps differ only in the variant. Reports the
median step time of each, its ratio to plain (of medians, and the median of per-round ratios),
and the median and interquartile range of the per-round difference to fp-py (fp without
native), and the paired per-step differences nofp - plain, fp - nofp (and of the -py paths).

``--cpu-model``: the host cost of the GPU path measured on a CPU. The Llama structure of
bench/call_patterns.py (389 module calls per step, modules that do no work) traced with
fingerprint_mode="deferred" (the GPU's path) and tracer/native.py forced on, the fingerprint
kernel launches stubbed out (so no value check). What it leaves out, measured only on a GPU: the
launch itself, the copies, and reading the held tensors again at the step's end after the rest
of the step has evicted them from the CPU's caches."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import call_patterns  # bench/ is this script's folder, first on sys.path
import models
from common import header, header_line, paired_median, paired_ratio, shuffled_rounds
from tensor_trace import tracer
from tensor_trace.tracer.config import TraceConfig
from tensor_trace.tracer.fingerprint import StepFingerprints
from tensor_trace.tracer.steps import FINGERPRINT_FIRST

try:
    import _old_fingerprint as OLD
except ImportError:
    OLD = None


def _spy(f, meta):
    """Wrap ``f``'s add_one and _add (instance attributes, so the tracer's calls find them) to note,
    per fingerprint index, the tensor's layout, whether the C++ table took it, and torch's own
    fp32 sum and sum of squares at hook time (on the device; read after the step)."""
    add_one, add = f.add_one, f._add

    def note(t, i, took):
        if i not in meta:
            meta[i] = (tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", ""), took,
                       t.float().sum(), t.float().pow(2).sum())

    def size():
        return f.native_held() or 0

    def spy_one(t, store=True):
        n = size()
        i = add_one(t, store)
        if hasattr(t, "float"):
            note(t, i, size() > n)
        return i

    def spy_add(tensors, store, immediate=False):
        tensors = list(tensors)
        n = size()
        base = add(tensors, store, immediate)
        for j, t in enumerate(tensors):
            note(t, base + j, size() > n)
        return base

    f.add_one, f._add = spy_one, spy_add
    return lambda: (f.__dict__.pop("add_one"), f.__dict__.pop("_add"))


def check_same_values(tr, fps, run, sync, names) -> tuple:
    """One step each of ``names`` (reference, its A/A twin, the candidate): the same
    fingerprint indices, and values equal within what two steps of the same path differ by.
    The model itself is not bitwise deterministic on the H200 (two steps of one path differ in
    hundreds of values, each equal to torch's own at hook time), so each value is also checked
    against torch's own fp32 sum and sum of squares of that tensor at hook time, which is the
    verdict. Returns (summary line, ok, details of the values off)."""
    import math

    from tensor_trace import schema
    from tensor_trace.format.fingerprints import fingerprint_pairs

    got, metas = {}, {}
    add = tr.writer.add
    ref, twin, cand = names
    for v in names:
        for f in fps.values():
            f.collect(wait=True)  # nothing of earlier steps left pending
        recs = []
        tr.writer.add = lambda rec, recs=recs: recs.append(rec) if rec[0] == schema.FINGERPRINTS else add(rec)
        meta = metas[v] = {}
        unspy = _spy(fps[v], meta)
        try:
            run(v)
            sync()
            recs += fps[v].collect(wait=True)
        finally:
            tr.writer.add = add
            unspy()
        vals = {}
        for _, step, first, data, indices in recs:
            vals.update((i, (s, q)) for i, s, q in fingerprint_pairs(first, data, indices))
        got[v] = vals
        for i, m in meta.items():
            meta[i] = m[:4] + (m[4].item(), m[5].item())

    def far(x, y, tol_l2, tol_sq):
        return (abs(x[0] - y[0]) > tol_l2 * math.sqrt(max(x[1], 1e-12)) + 1e-6
                or not math.isclose(x[1], y[1], rel_tol=tol_sq, abs_tol=1e-9))

    a = got[ref]
    out, ok, details = [], True, []
    for v in (twin, cand):
        b = got[v]
        if a.keys() != b.keys():
            out.append(f"{v}: other indices ({len(a)} against {len(b)} values)")
            ok = False
            continue
        off = [i for i in a if far(a[i], b[i], 1e-3, 1e-4)]
        wrong = [i for i in a if far(a[i], b[i], 2e-2, 1e-3)]
        # against torch at hook time, in the same step: the verdict
        vs_torch = [i for i in b if i in metas[v] and far(metas[v][i][4:], b[i], 2e-2, 1e-3)]
        missing = [i for i in b if i not in metas[v]]
        ok = ok and not vs_torch and not missing
        out.append(f"{v}: {len(a)} values, {len(off)} beyond 1e-3 of the l2 norm or 1e-4 of the sum "
                   f"of squares, {len(wrong)} beyond 2e-2 / 1e-3; {len(vs_torch)} beyond 2e-2 / 1e-3 "
                   f"of torch's own at hook time, {len(missing)} not seen by the spy")
        for i in sorted(set(wrong) | set(vs_torch))[:12]:
            details.append(dict(variant=v, index=i, ref=a[i], other=b[i], meta_ref=metas[ref].get(i),
                                meta_other=metas[v].get(i)))
    if fps[cand].native_held() is None:
        out.append(f"{cand}: the C++ table was not taken (kernel not usable here?)")
        ok = False
    return "; ".join(out), ok, details


SCHEDULE_EVERY = TraceConfig().fingerprint_every


def _scheduled(n: int) -> bool:
    """Whether the n-th step (from 0) of the ``default`` variant takes fingerprints."""
    return n < FINGERPRINT_FIRST or n % SCHEDULE_EVERY == 0


FLOORS = ["empty-wrapper", "empty-hooks"]


def empty_wrapper(inner):
    def __call__(m, *a, **k):  # noqa: N807 (Module.__call__'s replacement)
        return inner(m, *a, **k)
    return __call__


def empty_hooks():
    """Two empty global forward hooks, as the tracer's hooks intercept installs them; returns
    their remover."""
    from torch.nn.modules import module as nn_module

    hooks = [nn_module.register_module_forward_pre_hook(lambda m, a: None),
             nn_module.register_module_forward_hook(lambda m, a, *r: None, with_kwargs=True, always_call=True)]

    def remove():
        for h in hooks:
            h.remove()
            nn_module._global_forward_hooks_with_kwargs.pop(h.id, None)  # torch leaves it
    return remove


def stub_kernels() -> None:
    """The fingerprint kernels replaced by zeros (--cpu-model): on a CPU, the deferred path's
    host work without Triton."""
    from tensor_trace.tracer import multi_tensor

    multi_tensor.usable = lambda t: True
    multi_tensor.sum_sumsq_table = lambda table, count, most, dtype, device: torch.zeros(count, 2)
    multi_tensor.sum_sumsq_buffer = lambda buf, count, most, dtype, device: torch.zeros(count, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fingerprint-mode", default="auto",
                    help="the tracer's fingerprint_mode (deferred: the GPU's path on a CPU, for a check)")
    ap.add_argument("--python-only", action="store_true",
                    help="TENSOR_TRACE_NATIVE=0: no native variants (the default, where CUDA is "
                         "available, builds tracer/native.py and adds the -py variants)")
    ap.add_argument("--cpu-model", action="store_true",
                    help="the GPU path's host cost on a CPU: call_patterns' Llama, deferred "
                         "fingerprints, native on, kernel launches stubbed")
    ap.add_argument("--thread-time", action="store_true",
                    help="time steps by this thread's CPU time (with --cpu-model on a shared host: "
                         "the time the step was descheduled left out, and so is other threads' work, the writer's)")
    ap.add_argument("--gpu-step-ms", type=float, nargs="*", default=[],
                    help="plain GPU step times (ms) to give each variant's host time as a ratio to")
    args = ap.parse_args()
    from tensor_trace.tracer import native, spans

    if args.cpu_model:
        stub_kernels()
        os.environ["TENSOR_TRACE_NATIVE"] = "1"
        args.device, args.fingerprint_mode, args.batch = "cpu", "deferred", [call_patterns.B]
        torch.set_num_threads(1)
    if args.python_only:
        os.environ["TENSOR_TRACE_NATIVE"] = "0"
    have_native = False
    if native.enabled():
        t0 = time.perf_counter()
        native.ensure(block=True)
        have_native = native.table_class() is not None
        print(f"# native extension {'built/loaded' if have_native else 'UNAVAILABLE'} in "
              f"{time.perf_counter() - t0:.1f} s{'' if have_native else ': ' + str(native.error())}")
    dev = torch.device(args.device)
    clock = time.thread_time_ns if args.thread_time else time.perf_counter_ns
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    shape = dict(models.LLAMA_SHAPES[args.shape], kv_len=512)
    torch.manual_seed(0)
    if args.cpu_model:
        model, shape["vocab"] = call_patterns.LlamaCalls().eval(), 100
        model.set_batch = lambda batch: None
    else:
        model = models.LlamaForCausalLM(shape, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    py = ["nofp-py", "fp-py", "fp-py2", "nofp-pycall", "fp-pycall"] if have_native else []
    variants = (["plain", "nofp", "fp", "default"] + py + (["fp-old"] if OLD is not None else []) + FLOORS)
    ref_v = "fp-py" if have_native else "fp"
    print(header_line("fp_ab", dict(header(sys.argv), torch=torch.__version__), torch.cuda.get_device_name(dev) if dev.type == "cuda" else None))
    print(f"# rounds={args.rounds} variants={variants} native={have_native} cpu_model={args.cpu_model}"
          f"{' clock=thread CPU time' if args.thread_time else ''}")
    report = {}
    for batch in args.batch:
        model.set_batch(batch)
        ids = torch.randint(0, shape["vocab"], (batch, 1), device=dev)
        tr = tracer.start(out_dir=tempfile.mkdtemp(prefix="tt-ab-"), fingerprint=True, lineage=False,
                          fingerprint_mode=args.fingerprint_mode)
        counts = {v: {} for v in variants}  # each variant's own count of steps, for the schedule
        try:
            defer_cuda, defer_cpu = tr.fps.defer_cuda, tr.fps.defer_cpu
            # the default: the C++ table where native is available
            fps = {"fp": tr.fps, "fp-pycall": tr.fps}
            if have_native:  # the Python path: StepFingerprints made with native off
                old_env = os.environ.get("TENSOR_TRACE_NATIVE")
                os.environ["TENSOR_TRACE_NATIVE"] = "0"
                fps["fp-py"] = StepFingerprints(defer_cuda=defer_cuda, defer_cpu=defer_cpu)
                fps["fp-py2"] = StepFingerprints(defer_cuda=defer_cuda, defer_cpu=defer_cpu)
                if old_env is None:
                    del os.environ["TENSOR_TRACE_NATIVE"]
                else:
                    os.environ["TENSOR_TRACE_NATIVE"] = old_env
            if OLD is not None:
                fps["fp-old"] = OLD.StepFingerprints(defer_cuda=defer_cuda, defer_cpu=defer_cpu)

            wrapper = tr.global_handles[0]  # the tracer's call wrapper (--intercept call)
            plain_call = wrapper.python_call.__wrapped__  # torch's own
            calls = {"plain": plain_call, "empty-hooks": plain_call, "empty-wrapper": empty_wrapper(plain_call)}

            def python_keys(v) -> bool:  # the -py variants (and fp-old): no native at all
                return v in ("nofp-py", "fp-py", "fp-py2", "fp-old")

            def select_call(v) -> None:
                # plain and the floors: torch's own __call__ (or a pass-through to it) for this
                # step: nothing of the tracer runs; the Python wrapper for the -py and -pycall
                # variants; else the C one (tracer/native_call.py) where native is built
                if v in calls:
                    torch.nn.Module.__call__ = calls[v]
                    return
                torch.nn.Module.__call__ = wrapper.python_call  # (CPython's call slots)
                if not (python_keys(v) or v.endswith("-pycall")):
                    wrapper.use_native()

            def run(v) -> int:
                remove_hooks = empty_hooks() if v == "empty-hooks" else None
                tr.fingerprint = v not in ("plain", "nofp", "nofp-py", "nofp-pycall", *FLOORS)
                tr.config.fingerprint_every = SCHEDULE_EVERY if v == "default" else 1
                tr.fp_steps = counts[v]
                if tr.fingerprint:
                    tr.fps = fps["fp" if v == "default" else v]
                # the spans' layout key: native pair_key, or the Python tuple (-py, fp-old)
                if python_keys(v):
                    spans.use_native_keys(None)
                else:
                    spans.use_native_keys(native.pair_key(), native.call_key())
                select_call(v)
                t0 = clock()
                model(ids)
                sync()
                took = clock() - t0
                if remove_hooks is not None:
                    remove_hooks()
                return took

            with torch.inference_mode():
                for _ in range(5):
                    for v in variants:
                        run(v)
                if have_native and not args.cpu_model:
                    line, ok, details = check_same_values(tr, fps, run, sync, ("fp-py", "fp-py2", "fp"))
                    print(f"  fp (native) against fp-py, one step: {'ok' if ok else 'MISMATCH'}: {line}")
                    for d in details:
                        print(f"    {d}")
                    report[f"check_b{batch}"] = dict(ok=ok, line=line, details=details)
                times = shuffled_rounds(run, variants, args.rounds, seed=batch)
            spans.use_native_keys(native.pair_key(), native.call_key())
            select_call("nofp")
            for f in fps.values():
                f.collect(wait=True)
            tr.fps = fps["fp"]
        finally:
            tracer.stop()
        ref = times[ref_v]
        rows = {}
        print(f"\n== batch {batch}: median ms/step; per-round difference to {ref_v}, ms: median [p25, p75]")
        for v in variants:
            med = statistics.median(times[v]) / 1e6
            diff = sorted((a - b) / 1e6 for a, b in zip(times[v], ref))
            q = lambda p: diff[min(len(diff) - 1, int(p * len(diff)))]
            rows[v] = dict(median_ms=med, p10_ms=sorted(times[v])[len(times[v]) // 10] / 1e6,
                           diff_to_ref_median=statistics.median(diff), diff_p25=q(0.25), diff_p75=q(0.75))
            rows[v]["ratio_to_plain"] = med / (statistics.median(times["plain"]) / 1e6)
            rows[v]["paired_ratio_to_plain"] = statistics.median(a / b for a, b in zip(times[v], times["plain"]))
            print(f"  {v:<8} {med:8.3f}  p10 {rows[v]['p10_ms']:8.3f}  x{rows[v]['ratio_to_plain']:.3f} "
                  f"(paired x{rows[v]['paired_ratio_to_plain']:.3f}) | {v} - {ref_v}: "
                  f"{rows[v]['diff_to_ref_median']:+7.3f} [{rows[v]['diff_p25']:+7.3f}, {rows[v]['diff_p75']:+7.3f}]")
        mean = {v: statistics.fmean(times[v]) for v in ("plain", "nofp", "fp", "default")}
        rows["default_mean"] = d = dict(
            mean_ms={v: m / 1e6 for v, m in mean.items()},
            mean_ratio_to_plain={v: mean[v] / mean["plain"] for v in ("nofp", "fp", "default")},
            paired_ratio_median=paired_ratio(times, "default", "plain"),
            fingerprinted_rounds=sum(1 for n in range(args.rounds) if _scheduled(5 + n)))
        print(f"  default (schedule, every {SCHEDULE_EVERY}th): MEAN x{d['mean_ratio_to_plain']['default']:.3f} of "
              f"plain's mean (nofp x{d['mean_ratio_to_plain']['nofp']:.3f}, fp x{d['mean_ratio_to_plain']['fp']:.3f}); "
              f"median of per-round ratios x{d['paired_ratio_median']:.3f}; fingerprinted in "
              f"{d['fingerprinted_rounds']} of {args.rounds} rounds")
        for a, b in (("nofp", "plain"), ("fp", "nofp"), ("nofp-py", "plain"), ("fp-py", "nofp-py"),
                     ("nofp-pycall", "plain"), ("fp-pycall", "plain"), ("fp", "plain"),
                     *((f, "plain") for f in FLOORS)):
            if a in times:
                rows[f"{a} - {b}"] = d = paired_median(times, a, b) / 1e3
                on_gpu = "".join(f"; on a {ms:g} ms GPU step x{(ms + d / 1e3) / ms:.3f}"
                                 for ms in args.gpu_step_ms if b == "plain")
                print(f"  paired {a} - {b}: {d:+.0f} us/step (x{paired_ratio(times, a, b):.3f}){on_gpu}")
        report[batch] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
