"""Two fingerprint implementations compared step by step on one traced model: robust to a host
whose speed drifts (the lent H200's host: the same step measured 15 to 38 ms within a minute).

    python bench/fp_ab.py [--batch 8 64] [--rounds 300]      # needs a GPU; bench/_old_fingerprint.py

One tracer runs the Llama-8B-shaped decode step of bench/overhead.py. Each round runs one step of
each variant, in shuffled order, device synchronised after each: ``plain`` (torch's own
``Module.__call__`` put back for that step: nothing of the tracer runs), ``nofp`` (the tracer with
fingerprints off for that step), ``fp`` (tracer/fingerprint.py), ``fp2`` (a second instance of
the same class: the noise floor of a paired difference), and ``fp-old`` (bench/_old_fingerprint.py,
an earlier version, when present), and with ``--native`` ``fp-native`` (tracer/native.py's C++
table, TENSOR_TRACE_NATIVE=1: built first, its values checked against fp's on one step). Switching is a per-step attribute change (the tracer's
``fps`` object, its ``fingerprint`` flag), so consecutive steps differ only in the variant.
Reports the median step time of each and the median and interquartile range of the per-round
difference to ``fp``."""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

import torch

import overhead as ov  # bench/ is this script's folder, first on sys.path
from tensor_trace import tracer
from tensor_trace.tracer.fingerprint import StepFingerprints

try:
    import _old_fingerprint as OLD
except ImportError:
    OLD = None


def check_same_values(tr, fps, run, sync) -> str:
    """One step each of fp, fp2 and fp-native: the same fingerprint indices, and values equal
    within what two steps of the same path differ by. The model itself is not bitwise
    deterministic on a GPU (bf16 matrix products of large outputs), so fp against fp2 is
    reported beside fp against fp-native; a native table reading the wrong memory would give
    other sums of squares, which raises."""
    import math

    from tensor_trace import schema

    got = {}
    add = tr.writer.add
    for v in ("fp", "fp2", "fp-native"):
        for f in fps.values():
            f.collect(wait=True)  # nothing of earlier steps left pending
        recs = []
        tr.writer.add = lambda rec, recs=recs: recs.append(rec) if rec[0] == schema.FINGERPRINTS else add(rec)
        try:
            run(v)
            sync()
            recs += fps[v].collect(wait=True)
        finally:
            tr.writer.add = add
        vals = {}
        for _, step, first, data, indices in recs:
            vals.update((i, (s, q)) for i, s, q in schema.fingerprint_pairs(first, data, indices))
        got[v] = vals
    a = got["fp"]
    out = []
    for v in ("fp2", "fp-native"):
        b = got[v]
        if a.keys() != b.keys():
            raise SystemExit(f"{v}: other indices ({len(a)} against {len(b)} values)")
        off = [i for i in a if abs(a[i][0] - b[i][0]) > 1e-3 * math.sqrt(max(a[i][1], 1e-12)) + 1e-6
               or not math.isclose(a[i][1], b[i][1], rel_tol=1e-4, abs_tol=1e-9)]
        wrong = [i for i in a if abs(a[i][0] - b[i][0]) > 2e-2 * math.sqrt(max(a[i][1], 1e-12)) + 1e-6
                 or not math.isclose(a[i][1], b[i][1], rel_tol=1e-3, abs_tol=1e-9)]
        if wrong:
            raise SystemExit(f"{v}: {len(wrong)} of {len(a)} values differ, e.g. {a[wrong[0]]} {b[wrong[0]]}")
        out.append(f"{v}: {len(a)} values, {len(off)} beyond 1e-3 of the l2 norm or 1e-4 of the sum of squares")
    if fps["fp-native"]._nt is None:
        raise SystemExit("fp-native: the C++ table was not taken (kernel not usable here?)")
    return "; ".join(out) + f"; fp-native's table held {fps['fp-native']._nt.device} tensors"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fingerprint-mode", default="auto",
                    help="the tracer's fingerprint_mode (deferred: the GPU's path on a CPU, for a check)")
    ap.add_argument("--native", action="store_true",
                    help="add fp-native: tracer/native.py's C++ table (built first; checked "
                         "against fp on one step before timing)")
    args = ap.parse_args()
    native = None
    if args.native:
        from tensor_trace.tracer import native

        os.environ["TENSOR_TRACE_NATIVE"] = "1"  # only while fp-native's objects are made
        t0 = time.perf_counter()
        native.ensure(block=True)
        del os.environ["TENSOR_TRACE_NATIVE"]
        if native.table_class() is None:
            raise SystemExit(f"fp-native: the extension is unavailable: {native.error()}")
        print(f"# native extension built/loaded in {time.perf_counter() - t0:.1f} s")
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    shape = dict(ov.LLAMA_SHAPES[args.shape], kv_len=512)
    torch.manual_seed(0)
    model = ov.LlamaForCausalLM(shape, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    variants = (["plain", "nofp", "fp", "fp2"] + (["fp-old"] if OLD is not None else [])
                + (["fp-native"] if native is not None else []))
    print(f"# fp_ab {time.strftime('%Y-%m-%d %H:%M:%S')} device={dev} torch={torch.__version__} "
          f"rounds={args.rounds} variants={variants}")
    report = {}
    for batch in args.batch:
        model.set_batch(batch)
        ids = torch.randint(0, shape["vocab"], (batch, 1), device=dev)
        tr = tracer.start(out_dir=tempfile.mkdtemp(prefix="tt-ab-"), fingerprint=True, lineage=False,
                          fingerprint_mode=args.fingerprint_mode)
        try:
            defer_cuda, defer_cpu = tr.fps.defer_cuda, tr.fps.defer_cpu
            fps = {"fp": tr.fps, "fp2": StepFingerprints(defer_cuda=defer_cuda, defer_cpu=defer_cpu)}
            if OLD is not None:
                fps["fp-old"] = OLD.StepFingerprints(defer_cuda=defer_cuda, defer_cpu=defer_cpu)
            if native is not None:  # StepFingerprints with tracer/native.py's C++ table
                os.environ["TENSOR_TRACE_NATIVE"] = "1"
                fps["fp-native"] = StepFingerprints(defer_cuda=defer_cuda, defer_cpu=defer_cpu)
                del os.environ["TENSOR_TRACE_NATIVE"]

            traced_call = torch.nn.Module.__call__  # the tracer's wrapper (--intercept call)
            plain_call = traced_call.__wrapped__  # torch's own

            def run(v) -> int:
                # plain: torch's own __call__ for this step (nothing of the tracer runs)
                torch.nn.Module.__call__ = plain_call if v == "plain" else traced_call
                tr.fingerprint = v not in ("plain", "nofp")
                if tr.fingerprint:
                    tr.fps = fps[v]
                t0 = time.perf_counter_ns()
                model(ids)
                sync()
                return time.perf_counter_ns() - t0

            times = {v: [] for v in variants}
            rng = random.Random(batch)
            with torch.inference_mode():
                for _ in range(5):
                    for v in variants:
                        run(v)
                if native is not None:
                    print(f"  fp-native against fp, one step: {check_same_values(tr, fps, run, sync)}")
                for _ in range(args.rounds):
                    order = list(variants)
                    rng.shuffle(order)
                    for v in order:
                        times[v].append(run(v))
            torch.nn.Module.__call__ = traced_call
            for f in fps.values():
                f.collect(wait=True)
            tr.fps = fps["fp"]
        finally:
            tracer.stop()
        ref = times["fp"]
        rows = {}
        print(f"\n== batch {batch}: median ms/step; per-round difference to fp, ms: median [p25, p75]")
        for v in variants:
            med = statistics.median(times[v]) / 1e6
            diff = sorted((a - b) / 1e6 for a, b in zip(times[v], ref))
            q = lambda p: diff[min(len(diff) - 1, int(p * len(diff)))]
            rows[v] = dict(median_ms=med, p10_ms=sorted(times[v])[len(times[v]) // 10] / 1e6,
                           diff_to_fp_median=statistics.median(diff), diff_p25=q(0.25), diff_p75=q(0.75))
            rows[v]["ratio_to_plain"] = med / (statistics.median(times["plain"]) / 1e6)
            rows[v]["paired_ratio_to_plain"] = statistics.median(a / b for a, b in zip(times[v], times["plain"]))
            print(f"  {v:<8} {med:8.3f}  p10 {rows[v]['p10_ms']:8.3f}  x{rows[v]['ratio_to_plain']:.3f} "
                  f"(paired x{rows[v]['paired_ratio_to_plain']:.3f}) | {v} - fp: {rows[v]['diff_to_fp_median']:+7.3f} "
                  f"[{rows[v]['diff_p25']:+7.3f}, {rows[v]['diff_p75']:+7.3f}]")
        report[batch] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
