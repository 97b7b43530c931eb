"""CUDA-graph replay benchmark: plain replay, traced replay, eager and traced eager, side by side.

    python bench/cuda_graph_replay.py --json OUT.json            # needs a GPU

Workload: the Llama-8B-shaped eager decode step of bench/overhead.py (bf16, one token per
sequence, a fixed KV cache read by SDPA), batches 8 and 64. Variants, interleaved in a shuffled
order for R rounds after one discarded warm-up round, each block W warm-up + N timed steps:

- ``replay``         a graph captured untraced, replayed;
- ``traced-replay``  tracing on with record's defaults; the graph is captured while traced,
                     so its fingerprint kernels are in it; each replay is a traced step, and
                     the fingerprint schedule (first 4 replays, then every 8th) picks the
                     replays whose kernels read their tensors (gated off on the others);
- ``traced-replay-fp1``  the same with every replay fingerprinted (``fingerprint_every=1``);
- ``traced-replay-nofp`` the same without fingerprints (no kernels in the graph);
- ``eager``          the model called eagerly;
- ``traced-eager``   the same, traced (fingerprints on, deferred for small tensors).
- ``traced-replay-<M>m`` (with ``--graph-defer-mib M ...``): traced replay with captures that
                     hold at most M MiB of tensors before fingerprinting them (the default
                     is ``GRAPH_DEFER_BYTES``);
- ``traced-replay-stacked``, ``traced-eager-stacked``: the same two with the multi-tensor
                     kernel (tracer/multi_tensor.py) turned off: same-shape tensors stacked and
                     reduced, as before that kernel existed.

Every step copies the next of 4 input-id tensors into the input (the graph's static buffer for
the replays) and ends with ``torch.cuda.synchronize()``. Reported: median and mean step time
(a schedule makes some steps dearer: the mean is what a run pays), p10..p90,
min..max of the round medians, ratios to ``replay`` and to ``eager``; the extra graph-pool
memory of a traced capture (peak allocated during capture, traced minus untraced) and the static
fingerprint buffer; and, read back from a traced-replay-fp1 block's rank file (else
traced-replay's), how many of a replay's fingerprints changed when its input ids changed.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time

import torch

from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files

import models  # bench/ is this script's folder, first on sys.path
from common import header as run_header, header_line, percentile

from tensor_trace.tracer import fingerprint as fp_mod
from tensor_trace.tracer import multi_tensor

VARIANTS = ("replay", "traced-replay", "traced-replay-fp1", "traced-replay-nofp",
            "traced-replay-stacked", "eager", "traced-eager", "traced-eager-stacked")


def capture(model, static_ids):
    """Capture one forward of ``model`` on ``static_ids`` (warmed up already)."""
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        out = model(static_ids)
    torch.cuda.synchronize()
    return g, out


def capture_memory(model, static_ids) -> tuple:
    """(peak bytes allocated by a capture, the graph, its output) for the current tracing state."""
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    g, out = capture(model, static_ids)
    return torch.cuda.max_memory_allocated() - base, g, out


def run_block(variant, model, ids, static_ids, plain_graph, tmp, warmup, steps, block):
    tr = None
    graph = plain_graph
    out_dir = None
    usable = multi_tensor.usable
    defer_bytes = fp_mod.GRAPH_DEFER_BYTES
    if variant.endswith("-stacked"):
        multi_tensor.usable = lambda t: False
    if variant.startswith("traced-replay-") and variant.endswith("m"):
        fp_mod.GRAPH_DEFER_BYTES = int(variant[len("traced-replay-"):-1]) << 20
    if variant.startswith("traced"):
        out_dir = os.path.join(tmp, f"b{block:04d}-{variant}")
        if variant == "traced-replay":  # record's defaults: fingerprints on its schedule
            tr = tracer.start(out_dir=out_dir, fingerprint=True)
        else:  # eager, fp1, stacked: every step; nofp: none
            tr = tracer.start(out_dir=out_dir, fingerprint=not variant.endswith("-nofp"),
                              fingerprint_every=1)
    try:
        if variant.startswith("traced-replay"):
            graph, _ = capture(model, static_ids)  # traced capture: not timed
        times = []
        pc = time.perf_counter_ns
        torch.cuda.synchronize()
        for i in range(warmup + steps):
            t0 = pc()
            if "replay" in variant:
                static_ids.copy_(ids[i % len(ids)], non_blocking=True)
                graph.replay()
            else:
                model(ids[i % len(ids)])
            torch.cuda.synchronize()
            t1 = pc()
            if i >= warmup:
                times.append(t1 - t0)
    finally:
        multi_tensor.usable = usable
        fp_mod.GRAPH_DEFER_BYTES = defer_bytes
        stats = dict(tr.stats) if tr is not None else {}
        if tr is not None:
            tracer.stop()
    if variant.startswith("traced-replay"):
        del graph
    return times, out_dir, stats


def fingerprint_change(out_dir) -> dict:
    """Between consecutive replays (different input ids), the share of fingerprints that changed."""
    files = rank_files(out_dir)
    if not files:
        return {}
    rt = load_rank_file(files[0])
    # (fingerprinted replays only; the bench's input ids cycle through 4, so under a schedule
    # two consecutive fingerprinted replays may have had the same ids)
    reps = [rt.steps[s] for s in sorted(rt.steps)
            if rt.steps[s].attrs.get("replay_of") is not None and rt.steps[s].fingerprints]
    changed = total = 0
    for a, b in zip(reps, reps[1:]):
        for k, v in a.fingerprints.items():
            if k in b.fingerprints:
                total += 1
                changed += b.fingerprints[k] != v
    n = len(reps[0].fingerprints) if reps else 0
    return dict(replayed_steps=len(reps), fingerprints_per_replay=n, pairs_compared=total,
                changed=changed, share_changed=round(changed / total, 4) if total else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kv-len", type=int, default=512)
    ap.add_argument("--llama-shape", default="8b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--graph-defer-mib", type=int, nargs="*", default=[])
    ap.add_argument("--variants", nargs="*", default=None, help="a subset of the variants")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    global VARIANTS
    VARIANTS = tuple(args.variants or VARIANTS) + tuple(f"traced-replay-{m}m" for m in args.graph_defer_mib)
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU")
        return 2
    dev = torch.device("cuda")
    shape = dict(models.LLAMA_SHAPES[args.llama_shape], kv_len=args.kv_len)
    torch.manual_seed(args.seed)
    model = models.LlamaForCausalLM(shape, dev, torch.bfloat16).eval()
    header = dict(run_header(sys.argv), device=torch.cuda.get_device_name(), torch=torch.__version__,
                  shape=shape, rounds=args.rounds, warmup=args.warmup, steps=args.steps)
    print(header_line("cuda_graph_replay", header, header["device"]))
    results = []
    tmp = tempfile.mkdtemp(prefix="tt-graph-")
    block = 0
    try:
        for batch in args.batch:
            model.set_batch(batch)
            gen = torch.Generator().manual_seed(args.seed + batch)
            ids = [torch.randint(0, shape["vocab"], (batch, 1), generator=gen).to(dev) for _ in range(4)]
            static_ids = ids[0].clone()
            with torch.inference_mode():
                for _ in range(3):
                    model(static_ids)
                calls = models.count_module_calls(lambda: model(static_ids))
                mem_plain, plain_graph, _ = capture_memory(model, static_ids)
                tr = tracer.start(out_dir=os.path.join(tmp, f"mem-{batch}"), fingerprint=True)
                try:
                    mem_traced, g_traced, _ = capture_memory(model, static_ids)
                    (cap,) = tr.graphs.graphs[g_traced]
                    static_bytes = cap.fps.static.numel() * 4 if cap.fps and cap.fps.static is not None else 0
                    n_fp = len(cap.fps.indices) if cap.fps else 0
                finally:
                    tracer.stop()
                del g_traced
                rng = random.Random(args.seed + batch)
                change_from = "traced-replay-fp1" if "traced-replay-fp1" in VARIANTS else "traced-replay"
                acc = {v: dict(times=[], round_medians=[]) for v in VARIANTS}
                change = {}
                for r in range(-1, args.rounds):
                    order = list(VARIANTS)
                    rng.shuffle(order)
                    for v in order:
                        block += 1
                        times, out_dir, stats = run_block(v, model, ids, static_ids, plain_graph, tmp,
                                                          args.warmup, args.steps, block)
                        if r >= 0:
                            acc[v]["times"] += times
                            acc[v]["round_medians"].append(percentile(times, 50))
                            if v == change_from and not change:
                                change = fingerprint_change(out_dir)
                                change["tracer_errors"] = stats.get("errors")
                        if out_dir:
                            shutil.rmtree(out_dir, ignore_errors=True)
                    if r >= 0:
                        print(f"  [b{batch}] round {r + 1}/{args.rounds}: " + "  ".join(
                            f"{v}={acc[v]['round_medians'][-1] / 1e6:.3f}" for v in VARIANTS), flush=True)
            med = {v: percentile(acc[v]["times"], 50) for v in VARIANTS}
            mean = {v: sum(acc[v]["times"]) / max(1, len(acc[v]["times"])) for v in VARIANTS}
            res = dict(batch=batch, module_calls_per_step=calls, graph_fingerprints=n_fp,
                       capture_peak_bytes=dict(plain=mem_plain, traced=mem_traced, extra=mem_traced - mem_plain),
                       static_buffer_bytes=static_bytes, fingerprint_change=change, variants={})
            for v in VARIANTS:
                t = acc[v]["times"]
                res["variants"][v] = dict(
                    median_ms=med[v] / 1e6, mean_ms=mean[v] / 1e6,
                    p10_ms=percentile(t, 10) / 1e6, p90_ms=percentile(t, 90) / 1e6,
                    mean_vs_replay=mean[v] / mean["replay"],
                    round_median_min_ms=min(acc[v]["round_medians"]) / 1e6,
                    round_median_max_ms=max(acc[v]["round_medians"]) / 1e6,
                    vs_replay=med[v] / med["replay"], vs_eager=med[v] / med.get("eager", float("nan")),
                    paired_vs_base=[a / b for a, b in zip(
                        acc[v]["round_medians"],
                        acc["replay" if "replay" in v else "eager"]["round_medians"])]
                    if acc["replay" if "replay" in v else "eager"]["round_medians"] else [])
            results.append(res)
            print(f"\n== batch {batch}: {calls} module calls/step, {n_fp} fingerprinted tensors per replay ==")
            print(f"{'variant':<21} {'median ms':>9} {'p10..p90 ms':>17} {'round med min..max':>19} "
                  f"{'x replay':>8} {'mean x':>8} {'x eager':>8} {'paired min..max':>16}")
            for v in VARIANTS:
                x = res["variants"][v]
                pr = x["paired_vs_base"]
                print(f"{v:<21} {x['median_ms']:9.3f} {x['p10_ms']:8.3f}..{x['p90_ms']:<8.3f} "
                      f"{x['round_median_min_ms']:9.3f}..{x['round_median_max_ms']:<9.3f} "
                      f"x{x['vs_replay']:<7.3f} x{x['mean_vs_replay']:<7.3f} x{x['vs_eager']:<7.3f} "
                      f"{min(pr or [math.nan]):.3f}..{max(pr or [math.nan]):.3f}")
            print(f"   capture peak allocated: untraced {mem_plain / 2**20:.1f} MiB, traced "
                  f"{mem_traced / 2**20:.1f} MiB (extra {(mem_traced - mem_plain) / 2**20:.1f} MiB); "
                  f"static fingerprint buffer {static_bytes} bytes")
            print(f"   fingerprints across replays with different ids: {change}")
            if "traced-replay" in VARIANTS:
                tr = res["variants"]["traced-replay"]
                worst = max(tr["vs_replay"], tr["mean_vs_replay"])
                print(f"   #22 target: traced replay (record's defaults) <= x1.02 of replay, median "
                      f"x{tr['vs_replay']:.3f} mean x{tr['mean_vs_replay']:.3f}: "
                      f"{'PASS' if worst <= 1.02 else 'FAIL'}")
            del plain_graph
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=header, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
