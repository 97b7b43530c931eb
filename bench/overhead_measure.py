"""overhead.py's measuring: the variants, one block of a variant (its tracer, hooks or profiler
started, warm-up and timed steps, stopped, its rank files read back) and the interleaved rounds
that accumulate every variant's step times (the method is in overhead.py's docstring)."""
from __future__ import annotations

import gc
import os
import random
import shutil
import time

import torch
import torch.nn as nn

from common import median as _median  # bench/ is first on sys.path
from models import TP
from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files

VARIANTS = ("plain", "empty-hooks", "traced-nofp", "traced-default", "traced-fp", "traced-fp-hooks", "profiler")


def _global_hooks_installed() -> int:
    from torch.nn.modules import module as nn_module

    return (len(nn_module._global_forward_pre_hooks) + len(nn_module._global_forward_hooks))


class Bench:
    def __init__(self, args, cuda: bool, tmp_root: str, emit=None):
        self.args, self.cuda, self.tmp_root = args, cuda, tmp_root
        self.emit = emit or (lambda res: None)
        self.block_id = 0

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def run_block(self, variant, step_fn, warmup, steps):
        """One variant block: start, W+N steps, stop. Returns per-step times and trace figures."""
        self.block_id += 1
        gc.collect()
        out_dir = tr = prof = None
        t_start = time.perf_counter()
        empty = []
        if variant.startswith("traced"):
            out_dir = os.path.join(self.tmp_root, f"b{self.block_id:04d}-{variant}-r{TP['rank']}")
            if variant == "traced-default":
                tr = tracer.start(out_dir=out_dir)
            else:
                tr = tracer.start(out_dir=out_dir, fingerprint=variant.startswith("traced-fp"), fingerprint_every=1,
                                  intercept="hooks" if variant.endswith("-hooks") else "call")
        elif variant == "empty-hooks":
            empty = [nn.modules.module.register_module_forward_pre_hook(lambda m, a: None),
                     nn.modules.module.register_module_forward_hook(lambda m, a, *r: None,
                                                                    with_kwargs=True, always_call=True)]
        elif variant == "profiler":
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=acts, record_shapes=True)
            prof.__enter__()
        start_s = time.perf_counter() - t_start
        total, host = [], []
        pc = time.perf_counter_ns
        try:
            self.sync()
            for i in range(warmup + steps):
                t0 = pc()
                step_fn()
                t1 = pc()
                self.sync()
                t2 = pc()
                if i >= warmup:
                    total.append(t2 - t0)
                    host.append(t1 - t0)
        finally:
            t_stop = time.perf_counter()
            if tr is not None:
                tracer.stop()
            for h in empty:
                h.remove()
                nn.modules.module._global_forward_hooks_with_kwargs.pop(h.id, None)  # torch leaves it
            if prof is not None:
                prof.__exit__(None, None, None)
            stop_s = time.perf_counter() - t_stop
        res = dict(total=total, host=host, start_s=start_s, stop_s=stop_s)
        if tr is not None:
            files = rank_files(out_dir)
            res.update(out_dir=out_dir, files=files, bytes=sum(os.path.getsize(f) for f in files),
                       spans=tr.stats["spans"], collectives=tr.stats["collectives"],
                       traced_steps=tr.stats["steps"], errors=tr.stats["errors"],
                       dropped=tr.stats["dropped_spans"], hooks_left=tr.hook_count())
        leftover = _global_hooks_installed()
        if leftover:
            raise RuntimeError(f"{leftover} global module hooks left after a {variant} block")
        return res


def measure(bench: Bench, step_fn, *, rounds, warmup, steps, seed, label, warm_round=True):
    rng = random.Random(seed)
    acc = {v: dict(total=[], host=[], round_medians=[], round_host_medians=[], bytes=0, spans=0,
                   collectives=0, traced_steps=0, errors=0, dropped=0, start_s=[], stop_s=[],
                   verified=None) for v in VARIANTS}
    orders = []
    failed: dict = {}
    for r in range(-1 if warm_round else 0, rounds):
        order = list(VARIANTS)
        rng.shuffle(order)
        if r >= 0:
            orders.append(order)
        t_round = time.perf_counter()
        for v in order:
            if v in failed:
                continue
            try:
                res = bench.run_block(v, step_fn, warmup, steps)
            except Exception as exc:  # a profiler that cannot start must not sink the whole run
                if v == "plain":
                    raise
                failed[v] = f"{type(exc).__name__}: {exc}"
                print(f"  [{label}] variant {v} failed and is dropped: {failed[v]}", flush=True)
                continue
            if r < 0:  # the warm-up round: first-use costs (profiler, allocator, caches) land here
                if "out_dir" in res:
                    shutil.rmtree(res["out_dir"], ignore_errors=True)
                continue
            a = acc[v]
            a["total"] += res["total"]
            a["host"] += res["host"]
            a["round_medians"].append(_median(res["total"]))
            a["round_host_medians"].append(_median(res["host"]))
            a["start_s"].append(res["start_s"])
            a["stop_s"].append(res["stop_s"])
            if "bytes" in res:
                for k in ("bytes", "spans", "collectives", "traced_steps", "errors", "dropped"):
                    a[k] += res[k]
                if a["verified"] is None:  # read the first block's rank file back once
                    a["verified"] = _verify(res)
                shutil.rmtree(res["out_dir"], ignore_errors=True)
        if r < 0:
            print(f"  [{label}] warm-up round, discarded ({time.perf_counter() - t_round:.1f} s)", flush=True)
            continue
        meds = "  ".join(f"{v}={acc[v]['round_medians'][-1] / 1e6:.3f}"
                         for v in VARIANTS if acc[v]["round_medians"] and v not in failed)
        print(f"  [{label}] round {r + 1}/{rounds} ({time.perf_counter() - t_round:.1f} s): "
              f"median ms {meds}", flush=True)
    return acc, orders, failed


def _verify(res) -> dict:
    """Load the block's rank file(s) with the reader and compare with the tracer's stats."""
    spans = colls = steps = fingerprinted = 0
    problems = []
    for f in res["files"]:
        rt = load_rank_file(f)
        steps += len(rt.steps)
        for st in rt.steps.values():
            fingerprinted += bool(st.fingerprinted)
            spans += len(st.spans)
            colls += len(st.collectives)
        problems += rt.report.problems()
    return dict(files=len(res["files"]), steps=steps, fingerprinted_steps=fingerprinted, spans=spans, collectives=colls,
                matches_stats=(spans == res["spans"] and colls == res["collectives"]),
                problems=problems)
