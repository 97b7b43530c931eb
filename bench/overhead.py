"""Tracing overhead benchmark: per-step wall time of a forward step, traced and not, side by side.

Variants, measured in one process, interleaved and repeated:

- ``plain``        no tracing;
- ``traced-nofp``  ``tracer.start(out_dir=..., fingerprint=False)``;
- ``traced-fp``    ``tracer.start(out_dir=..., fingerprint=True)``;
- ``traced-fp-hooks`` the same with ``intercept="hooks"`` (global forward pre/post hooks
                   instead of the ``Module.__call__`` wrapper that the two above use by default);
- ``empty-hooks``  two empty global forward hooks, no tracer: the floor of any tracer built on
                   torch's global hooks (what the issue "Record every rank" quotes as x1.07..x1.11);
- ``profiler``     ``torch.profiler.profile(record_shapes=True)`` (CPU activity, plus CUDA on GPU).

For each of R rounds the variants run in a shuffled order; each variant block starts its tracer
(a fresh out_dir under a temporary folder) or profiler, runs W warm-up steps and N timed steps, and
stops it again (one extra round of all variants runs first and is discarded, so first-use costs
such as the profiler's set-up do not land in round 1). Every step is timed with ``time.perf_counter_ns()``; on CUDA the device is
synchronised before a block starts and at the end of every step, before its timer stops (so every
step starts on an idle device, and the synchronisation is in the step time of every variant
alike). The host-side time (until the forward call returns, before the synchronisation) is kept
too: it shows whether a step is bound by the host (Python, hooks, kernel launches) or the device.

Reported per variant: median step time over all timed steps, p10..p90 of the steps, min..max of
the per-round medians, the ratio of medians to ``plain`` (and min..max of the per-round paired
ratios), bytes of rank file per record (spans + collectives) and per step for the traced
variants, and the module calls per step.

Workloads:

- ``example-cpu``     the mini Llama of examples/tp_llama.py on CPU, tp=1, float32, defaults
                      (6 layers, hidden 96), batch 2, seq 8, under ``torch.inference_mode()``;
- ``llama8b-decode``  a Llama-3-8B-shaped eager decode step (bf16, cuda, one token per sequence,
                      a fixed KV cache read by ``scaled_dot_product_attention``), batches 8 and 64;
- ``all``             example-cpu, then llama8b-decode when CUDA is available.

    OMP_NUM_THREADS=1 python bench/overhead.py --workload example-cpu --json /tmp/bench-cpu.json
    python bench/overhead.py --workload llama8b-decode --json bench-gpu.json --breakdown

The targets printed at the end are informational; ``--check`` makes a FAIL exit with status 1.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import importlib.util
import io
import json
import math
import os
import platform
import pstats
import random
import shutil
import socket
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("plain", "empty-hooks", "traced-nofp", "traced-fp", "traced-fp-hooks", "profiler")


def load_example():
    """examples/tp_llama.py, by file path (examples/ is not an installed package)."""
    path = os.path.join(ROOT, "examples", "tp_llama.py")
    spec = importlib.util.spec_from_file_location("_bench_tp_llama", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- Llama-8B-shaped decode model
# Plain nn.Modules with SGLang's module layout, so the module-call count per step is realistic.

LLAMA_SHAPES = {
    # Llama-3-8B
    "8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256),
    # for a smoke test of the code path on a CPU
    "tiny": dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=1024),
}


# Tensor parallelism of the llama8b-decode model (set from torchrun's environment, --tp runs):
# SGLang's layout at toy cost: vocab-parallel embedding + all_reduce, column-parallel qkv and
# gate_up, row-parallel o_proj and down_proj each followed by an all_reduce inside the module,
# a vocab-parallel lm_head whose logits are all-gathered. Same module calls per step as tp=1.
TP = dict(size=1, rank=0, group=None)


def _linear(n_in, n_out, device, dtype, cls=nn.Linear):
    lin = cls(n_in, n_out, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.02)  # = torch.randn * 0.02, drawn on the device
    return lin


class RowParallelLinear(nn.Linear):
    """A linear layer over this rank's slice of the input features; the partial sums are
    all-reduced inside the module, as SGLang's RowParallelLinear does (reduce_results=True)."""

    def forward(self, x):
        out = F.linear(x, self.weight)
        if TP["size"] > 1:
            torch.distributed.all_reduce(out, group=TP["group"])
        return out


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding: masked lookup, then all_reduce (SGLang's layout)."""

    def __init__(self, vocab, hidden, device, dtype):
        super().__init__()
        per = vocab // TP["size"]
        self.start, self.end = TP["rank"] * per, (TP["rank"] + 1) * per
        self.weight = nn.Parameter(torch.empty(per, hidden, device=device, dtype=dtype).normal_(0.0, 0.02))

    def forward(self, ids):
        mask = (ids >= self.start) & (ids < self.end)
        out = F.embedding((ids - self.start) * mask, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        torch.distributed.all_reduce(out, group=TP["group"])
        return out


class ParallelLMHead(nn.Linear):
    """This rank's vocabulary slice of the logits, all-gathered along the vocabulary."""

    def forward(self, x):
        local = F.linear(x, self.weight)
        if TP["size"] == 1:
            return local
        n = TP["size"]
        parts = torch.empty((n * local.shape[0], *local.shape[1:]), device=local.device, dtype=local.dtype)
        torch.distributed.all_gather_into_tensor(parts, local.contiguous(), group=TP["group"])
        return torch.cat(list(parts.view(n, *local.shape).unbind(0)), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, device, dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE of q and k at one fixed decode position (the slot after the cache)."""

    def __init__(self, head_dim, position, theta, device, dtype):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
        ang = position * inv_freq
        self.register_buffer("cos", torch.cat([ang.cos()] * 2).to(dtype), persistent=False)
        self.register_buffer("sin", torch.cat([ang.sin()] * 2).to(dtype), persistent=False)
        self.head_dim = head_dim

    def rope(self, x):
        b, s, width = x.shape
        x = x.view(b, s, width // self.head_dim, self.head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        return (x * self.cos + torch.cat([-x2, x1], -1) * self.sin).view(b, s, width)

    def forward(self, q, k):
        return self.rope(q), self.rope(k)


class DecodeAttention(nn.Module):
    """One query token per sequence attends to a fixed KV cache through SDPA (GQA)."""

    def __init__(self, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.k_cache = self.v_cache = None

    def set_cache(self, batch, length, device, dtype):
        shape = (batch, self.kv_heads, length, self.head_dim)
        self.k_cache = torch.randn(shape, device=device, dtype=dtype)
        self.v_cache = torch.randn(shape, device=device, dtype=dtype)

    def forward(self, q, k, v):
        # k, v (the new token's) are not written into the cache: the step reads a fixed cache.
        b, s, _ = q.shape
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache,
                                           enable_gqa=self.heads != self.kv_heads)
        return o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)


class LlamaAttention(nn.Module):
    def __init__(self, c, device, dtype):
        super().__init__()
        hd, tp = c["head_dim"], TP["size"]
        heads, kv_heads = c["heads"] // tp, c["kv_heads"] // tp
        self.split = [heads * hd, kv_heads * hd, kv_heads * hd]
        self.qkv_proj = _linear(c["hidden"], sum(self.split), device, dtype)
        self.rotary_emb = RotaryEmbedding(hd, c["kv_len"], 500000.0, device, dtype)
        self.attn = DecodeAttention(heads, kv_heads, hd)
        self.o_proj = _linear(heads * hd, c["hidden"], device, dtype, RowParallelLinear)

    def forward(self, x):
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q, k = self.rotary_emb(q, k)
        return self.o_proj(self.attn(q, k, v))


class SiluAndMul(nn.Module):
    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class LlamaMLP(nn.Module):
    def __init__(self, c, device, dtype):
        super().__init__()
        ffn = c["ffn"] // TP["size"]
        self.gate_up_proj = _linear(c["hidden"], 2 * ffn, device, dtype)
        self.act_fn = SiluAndMul()
        self.down_proj = _linear(ffn, c["hidden"], device, dtype, RowParallelLinear)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c, device, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden"], 1e-5, device, dtype)
        self.self_attn = LlamaAttention(c, device, dtype)
        self.post_attention_layernorm = RMSNorm(c["hidden"], 1e-5, device, dtype)
        self.mlp = LlamaMLP(c, device, dtype)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c, device, dtype):
        super().__init__()
        if TP["size"] > 1:
            self.embed_tokens = VocabParallelEmbedding(c["vocab"], c["hidden"], device, dtype)
        else:
            self.embed_tokens = nn.Embedding(c["vocab"], c["hidden"], device=device, dtype=dtype)
            with torch.no_grad():
                self.embed_tokens.weight.normal_(0.0, 0.02)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, device, dtype) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"], 1e-5, device, dtype)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    def __init__(self, c, device, dtype):
        super().__init__()
        self.c = c
        self.model = LlamaModel(c, device, dtype)
        self.lm_head = _linear(c["hidden"], c["vocab"] // TP["size"], device, dtype, ParallelLMHead)

    def set_batch(self, batch):
        """(Re)allocate every layer's KV cache for ``batch`` sequences of kv_len tokens."""
        w = self.lm_head.weight
        for layer in self.model.layers:
            layer.self_attn.attn.k_cache = layer.self_attn.attn.v_cache = None
        if w.is_cuda:
            torch.cuda.empty_cache()
        for layer in self.model.layers:
            layer.self_attn.attn.set_cache(batch, self.c["kv_len"], w.device, w.dtype)

    def forward(self, input_ids):  # [B, 1] -> logits [B, 1, V]
        return self.lm_head(self.model(input_ids))


# ---------------------------------------------------------------- measuring

def _pct(sorted_vals, q):
    """Linear-interpolated percentile (q in [0, 100]) of a sorted list."""
    if not sorted_vals:
        return float("nan")
    k = (len(sorted_vals) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def _median(vals):
    return _pct(sorted(vals), 50)


def count_module_calls(step_fn) -> int:
    """Module calls of one step, counted by a temporary global forward pre-hook."""
    from torch.nn.modules import module as nn_module

    n = [0]

    def pre(mod, args):
        n[0] += 1

    h = nn_module.register_module_forward_pre_hook(pre)
    try:
        step_fn()
    finally:
        h.remove()
    return n[0]


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
            tr = tracer.start(out_dir=out_dir, fingerprint=variant.startswith("traced-fp"),
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
    spans = colls = steps = 0
    problems = []
    for f in res["files"]:
        rt = load_rank_file(f)
        steps += len(rt.steps)
        for st in rt.steps.values():
            spans += len(st.spans)
            colls += len(st.collectives)
        problems += rt.report.problems()
    return dict(files=len(res["files"]), steps=steps, spans=spans, collectives=colls,
                matches_stats=(spans == res["spans"] and colls == res["collectives"]),
                problems=problems)


def summarise(acc, failed, module_calls):
    out = {}
    plain = acc["plain"]
    plain_med = _median(plain["total"])
    for v in VARIANTS:
        a = acc[v]
        if v in failed or not a["total"]:
            out[v] = dict(failed=failed.get(v, "no samples"))
            continue
        s = sorted(a["total"])
        med = _pct(s, 50)
        paired = [m / p for m, p in zip(a["round_medians"], plain["round_medians"])]
        d = dict(median_ns=med, p10_ns=_pct(s, 10), p90_ns=_pct(s, 90), min_ns=s[0], max_ns=s[-1],
                 round_medians_ns=a["round_medians"],
                 round_median_min_ns=min(a["round_medians"]), round_median_max_ns=max(a["round_medians"]),
                 host_median_ns=_median(a["host"]), round_host_medians_ns=a["round_host_medians"],
                 ratio=med / plain_med, paired_ratios=paired,
                 paired_ratio_min=min(paired), paired_ratio_max=max(paired),
                 paired_ratio_median=_median(paired),
                 # min of round medians over plain's: the least disturbed block of each variant,
                 # robust when other processes share the CPUs (timeit's reasoning)
                 best_round_ratio=min(a["round_medians"]) / min(plain["round_medians"]),
                 samples=len(s), steps_ns=a["total"], host_ns=a["host"],
                 block_start_s_median=_median(a["start_s"]), block_stop_s_median=_median(a["stop_s"]))
        if v.startswith("traced"):
            recs = a["spans"] + a["collectives"]
            d.update(bytes_on_disk=a["bytes"], spans=a["spans"], collectives=a["collectives"],
                     traced_steps=a["traced_steps"], errors=a["errors"], dropped_spans=a["dropped"],
                     bytes_per_span=a["bytes"] / recs if recs else None,
                     bytes_per_step=a["bytes"] / a["traced_steps"] if a["traced_steps"] else None,
                     spans_per_step=a["spans"] / a["traced_steps"] if a["traced_steps"] else None,
                     verified=a["verified"])
        out[v] = d
    return out


def targets_for(workload, variants):
    def ratio(v):
        d = variants.get(v, {})
        return d.get("ratio")

    checks = []

    def add(name, value, limit, kind):
        if value is None or limit is None:
            checks.append(dict(name=name, value=value, limit=limit, result="n/a"))
        else:
            ok = value <= limit if kind == "le" else value < limit
            checks.append(dict(name=name, value=value, limit=limit, result="PASS" if ok else "FAIL"))

    prof = ratio("profiler")
    if workload == "llama8b-decode":
        add("traced-nofp <= x1.15", ratio("traced-nofp"), 1.15, "le")
        add("traced-fp <= x1.30", ratio("traced-fp"), 1.30, "le")
    add("traced-nofp < profiler", ratio("traced-nofp"), prof, "lt")
    add("traced-fp < profiler", ratio("traced-fp"), prof, "lt")
    return checks


def print_table(res):
    c = res
    print()
    tp = c.get("model", {}).get("tp", 1)
    print(f"== {c['workload']}  device={c['device']} dtype={c['dtype']} batch={c['batch']} "
          f"seq={c['seq']}" + (f" tp={tp} (figures of rank 0)" if tp > 1 else "") + f"  module calls/step={c['module_calls_per_step']}  "
          f"R={c['rounds']} W={c['warmup']} N={c['steps']} ==")
    if c.get("note"):
        print(f"   note: {c['note']}")
    hdr = (f"{'variant':<12} {'median ms':>10} {'p10..p90 ms':>19} {'round med min..max':>20} "
           f"{'ratio':>7} {'paired med':>10} {'paired min..max':>16} {'best-rnd':>8} {'host ms':>9} {'B/span':>8} {'KiB/step':>9}")
    print(hdr)
    print("-" * len(hdr))
    for v in VARIANTS:
        d = c["variants"][v]
        if "failed" in d:
            print(f"{v:<12} FAILED: {d['failed']}")
            continue
        ms = lambda x: x / 1e6  # noqa: E731
        bps = f"{d['bytes_per_span']:.1f}" if d.get("bytes_per_span") else "-"
        kps = f"{d['bytes_per_step'] / 1024:.1f}" if d.get("bytes_per_step") else "-"
        print(f"{v:<12} {ms(d['median_ns']):>10.3f} "
              f"{ms(d['p10_ns']):>8.3f}..{ms(d['p90_ns']):<9.3f} "
              f"{ms(d['round_median_min_ns']):>9.3f}..{ms(d['round_median_max_ns']):<9.3f} "
              f"{'x%.3f' % d['ratio']:>7} {'x%.3f' % d['paired_ratio_median']:>10} "
              f"{d['paired_ratio_min']:>7.3f}..{d['paired_ratio_max']:<7.3f} "
              f"{'x%.3f' % d['best_round_ratio']:>8} "
              f"{ms(d['host_median_ns']):>9.3f} {bps:>8} {kps:>9}")
    for v in ("traced-nofp", "traced-fp", "traced-fp-hooks"):
        d = c["variants"][v]
        if "failed" in d:
            continue
        ver = d.get("verified") or {}
        print(f"   {v}: {d['spans']} spans + {d['collectives']} collectives in {d['traced_steps']} steps "
              f"({d['spans_per_step']:.1f} spans/step), {d['bytes_on_disk']} bytes on disk, "
              f"errors={d['errors']}, dropped={d['dropped_spans']}; reader check of one block: "
              f"{ver.get('spans')} spans, matches stats: {ver.get('matches_stats')}"
              f"{', problems: ' + '; '.join(ver['problems']) if ver.get('problems') else ''}")
    stops = ", ".join(f"{v} {c['variants'][v]['block_stop_s_median'] * 1e3:.0f} ms"
                      for v in VARIANTS if "failed" not in c["variants"][v])
    print("   ratio = pooled median / plain's; paired = per-round median / plain's in the same round; "
          "best-rnd = min round median / plain's min round median")
    print(f"   block stop cost (median, untimed): {stops}")
    print("   targets (informational):")
    for t in c["targets"]:
        val = "n/a" if t["value"] is None else f"x{t['value']:.3f}"
        lim = "n/a" if t["limit"] is None else f"x{t['limit']:.3f}"
        print(f"     {t['name']:<26} {val:>8} vs {lim:<8} {t['result']}")


# ---------------------------------------------------------------- breakdown (where tracer time goes)

def breakdown(bench: Bench, step_fn, label, steps=10, warmup=3):
    """cProfile of the traced variants, and device kernels per step by variant."""
    out = {}
    for variant in ("traced-nofp", "traced-fp"):
        out_dir = os.path.join(bench.tmp_root, f"breakdown-{variant}")
        tracer.start(out_dir=out_dir, fingerprint=variant == "traced-fp")
        try:
            for _ in range(warmup):
                step_fn()
                bench.sync()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(steps):
                step_fn()
                bench.sync()
            prof.disable()
        finally:
            tracer.stop()
            shutil.rmtree(out_dir, ignore_errors=True)
        st = pstats.Stats(prof, stream=io.StringIO())
        rows = []
        for (fn, line, name), (cc, nc, tt, ct, _callers) in st.stats.items():
            rows.append(dict(func=f"{os.path.basename(fn)}:{line}({name})", ncalls=nc,
                             tottime_ms_per_step=tt * 1e3 / steps, cumtime_ms_per_step=ct * 1e3 / steps,
                             calls_per_step=nc / steps))
        rows.sort(key=lambda r: -r["tottime_ms_per_step"])
        total = sum(r["tottime_ms_per_step"] for r in rows)
        by_file: dict = {}
        for r in rows:
            f = r["func"].split(":")[0]
            by_file[f] = by_file.get(f, 0.0) + r["tottime_ms_per_step"]
        print(f"\n   cProfile [{label}] {variant}: {total:.2f} ms/step of profiled time "
              f"(cProfile inflates Python-heavy code); top functions by own time per step:")
        for r in rows[:18]:
            print(f"     {r['tottime_ms_per_step']:8.3f} ms own {r['cumtime_ms_per_step']:8.3f} ms cum "
                  f"{r['calls_per_step']:8.1f} calls  {r['func']}")
        top_files = sorted(by_file.items(), key=lambda kv: -kv[1])[:10]
        print("     own time by file (ms/step): " + ", ".join(f"{f} {t:.2f}" for f, t in top_files))
        out[variant] = dict(total_ms_per_step=total, top=rows[:40], by_file=dict(top_files))

    if bench.cuda:
        kernels = {}
        for variant in ("plain", "traced-nofp", "traced-fp"):
            try:
                out_dir = os.path.join(bench.tmp_root, f"kernels-{variant}")
                if variant != "plain":
                    tracer.start(out_dir=out_dir, fingerprint=variant == "traced-fp")
                for _ in range(2):
                    step_fn()
                bench.sync()
                n_steps = 3
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as p:
                    for _ in range(n_steps):
                        step_fn()
                    bench.sync()
                if variant != "plain":
                    tracer.stop()
                    shutil.rmtree(out_dir, ignore_errors=True)
                dev = torch.autograd.DeviceType.CUDA
                evs = [e for e in p.events() if e.device_type == dev]
                launches = sum(1 for e in p.events() if e.device_type != dev
                               and e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                              "cuLaunchKernelEx"))
                gpu_us = sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                             for e in evs)
                kernels[variant] = dict(device_events_per_step=len(evs) / n_steps,
                                        launch_calls_per_step=launches / n_steps,
                                        device_busy_ms_per_step=gpu_us / 1e3 / n_steps)
            except Exception as exc:
                kernels[variant] = dict(error=f"{type(exc).__name__}: {exc}")
                if tracer.current() is not None:
                    tracer.stop()
        print(f"\n   device work per step [{label}] (torch.profiler, 3 steps each):")
        for v, d in kernels.items():
            if "error" in d:
                print(f"     {v:<12} error: {d['error']}")
            else:
                print(f"     {v:<12} {d['device_events_per_step']:8.1f} device events, "
                      f"{d['launch_calls_per_step']:8.1f} launch calls, "
                      f"{d['device_busy_ms_per_step']:8.3f} ms device busy (sum of event durations)")
        out["kernels"] = kernels
    return out


# ---------------------------------------------------------------- workloads

def workload_example_cpu(args, bench: Bench):
    ex = load_example()
    cfg = ex.TinyLlamaConfig()
    model = ex.build_model(cfg, 0, 1, None, device="cpu", dtype=torch.float32)
    batch, seq = 2, 8
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (batch, seq), generator=gen)

    def step():
        return model(ids)

    rounds = args.rounds or 7
    warmup = args.warmup if args.warmup is not None else 3
    steps = args.steps or 20
    with torch.inference_mode():
        calls = count_module_calls(step)
        acc, orders, failed = measure(bench, step, rounds=rounds, warmup=warmup, steps=steps,
                                      seed=args.seed, label="example-cpu",
                                      warm_round=not args.no_warm_round)
        res = dict(workload="example-cpu", device="cpu", dtype="float32", batch=batch, seq=seq,
                   model=dict(layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads,
                              kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, ffn=cfg.ffn,
                              vocab=cfg.vocab, tp=1),
                   module_calls_per_step=calls, rounds=rounds, warmup=warmup, steps=steps,
                   orders=orders, torch_threads=torch.get_num_threads())
        res["variants"] = summarise(acc, failed, calls)
        res["targets"] = targets_for("example-cpu", res["variants"])
        print_table(res)
        bench.emit(res)
        if args.breakdown:
            res["breakdown"] = breakdown(bench, step, "example-cpu")
            bench.emit(None)
    return [res]


def workload_llama(args, bench: Bench):
    device = torch.device(args.device or "cuda")
    if TP["size"] > 1 and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    dtype = getattr(torch, args.dtype)
    shape = dict(LLAMA_SHAPES[args.llama_shape], kv_len=args.kv_len)
    if args.vocab:
        shape["vocab"] = args.vocab
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model = LlamaForCausalLM(shape, device, dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    bench.sync()
    print(f"  [llama8b-decode] built {n_params / 1e9:.3f} B parameters ({args.dtype}) on {device} "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    cuda = device.type == "cuda"
    from tensor_trace.tracer import native

    if native.enabled():  # (the default where CUDA is): built or loaded now, not during the rounds
        t0 = time.perf_counter()
        native.ensure(block=True)
        print(f"  [llama8b-decode] tracer/native.py "
              f"{'ready' if native.pair_key() else 'UNAVAILABLE: ' + str(native.error())} "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
    rounds = args.rounds or 7
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 3)
    steps = args.steps or (30 if cuda else 20)
    results = []
    for batch in args.batch:
        model.set_batch(batch)
        ids = torch.randint(0, shape["vocab"], (batch, 1), device=device)

        def step():
            return model(ids)

        with torch.inference_mode():
            for _ in range(3):
                step()
            bench.sync()
            calls = count_module_calls(step)
            label = f"llama8b-decode b{batch}" + (f" tp{TP['size']}" if TP["size"] > 1 else "")
            acc, orders, failed = measure(bench, step, rounds=rounds, warmup=warmup, steps=steps,
                                          seed=args.seed + batch, label=label,
                                          warm_round=not args.no_warm_round)
            res = dict(workload="llama8b-decode", device=str(device),
                       device_name=torch.cuda.get_device_name(device) if cuda else platform.processor(),
                       dtype=args.dtype, batch=batch, seq=1,
                       model=dict(shape, shape_name=args.llama_shape, tp=TP["size"]),
                       params=n_params, module_calls_per_step=calls, rounds=rounds, warmup=warmup,
                       steps=steps, orders=orders,
                       kv_cache_bytes=2 * shape["layers"] * batch * shape["kv_heads"] * shape["kv_len"]
                       * shape["head_dim"] * torch.tensor([], dtype=dtype).element_size())
            if cuda:
                res["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            res["variants"] = summarise(acc, failed, calls)
            res["targets"] = targets_for("llama8b-decode", res["variants"])
            print_table(res)
            bench.emit(res)
            if args.breakdown and batch == args.batch[0]:
                res["breakdown"] = breakdown(bench, step, label)
                bench.emit(None)
        results.append(res)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return results


def header() -> dict:
    cuda = torch.cuda.is_available()
    return dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                hostname=socket.gethostname(), torch=torch.__version__,
                python=platform.python_version(),
                device_name=torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu"),
                cuda=torch.version.cuda if cuda else None,
                cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                tensor_trace=os.path.dirname(tracer.__file__), argv=sys.argv)


def write_json(path, h, args, results) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(header=h, args=vars(args), results=results), f, indent=1)
    os.replace(tmp, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["example-cpu", "llama8b-decode", "all"], default="all")
    p.add_argument("--rounds", type=int, default=None, help="rounds R (default 7)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps W per block (3 CPU, 5 GPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps N per block (20 CPU, 30 GPU)")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 64], help="llama8b-decode batches")
    p.add_argument("--kv-len", type=int, default=512, help="cached tokens per sequence (llama8b-decode)")
    p.add_argument("--vocab", type=int, default=None, help="override the vocab (default 128256)")
    p.add_argument("--llama-shape", choices=sorted(LLAMA_SHAPES), default="8b",
                   help="'tiny' only smoke-tests the llama8b-decode code path")
    p.add_argument("--device", default=None, help="llama8b-decode device (default cuda)")
    p.add_argument("--dtype", default="bfloat16", help="llama8b-decode dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warm-round", action="store_true",
                   help="skip the discarded warm-up round of every variant before the R rounds")
    p.add_argument("--breakdown", action="store_true",
                   help="after the measurements: cProfile of the traced variants and, on CUDA, "
                        "device kernels per step")
    p.add_argument("--json", metavar="PATH", help="write every figure here")
    p.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    return p.parse_args(argv)


def _init_tp(args) -> None:
    """Under torchrun (WORLD_SIZE > 1): one process per GPU, a TP group of all of them. Every
    rank runs the same interleaved schedule (same seed); rank 0 prints and writes the JSON."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return
    if args.workload != "llama8b-decode":
        raise SystemExit("several ranks: only --workload llama8b-decode is tensor-parallel")
    if args.breakdown:
        raise SystemExit("--breakdown profiles one rank: run it with one process")
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = (args.device or "cuda").startswith("cuda")
    if cuda:
        torch.cuda.set_device(local)
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    TP.update(size=world, rank=rank, group=torch.distributed.group.WORLD)
    if rank != 0:
        sys.stdout = open(os.devnull, "w")
        args.json = None


def main(argv=None) -> int:
    args = parse_args(argv)
    _init_tp(args)
    h = header()
    h["tp"] = TP["size"]
    print(f"# tensor-trace overhead | {h['date']} | host {h['hostname']} | torch {h['torch']} "
          f"| device {h['device_name']} | cpus {h['cpu_count']} | torch threads {h['torch_threads']} "
          f"| OMP_NUM_THREADS={h['omp_num_threads']} | python {h['python']}", flush=True)
    results = []

    def emit(res):  # the JSON is rewritten after every table, so a run cut short keeps its figures
        if res is not None:  # None: a result already in the list got more figures
            results.append(res)
        if args.json:
            write_json(args.json, h, args, results)

    tmp_root = tempfile.mkdtemp(prefix="tt-bench-")
    try:
        if args.workload in ("example-cpu", "all"):
            workload_example_cpu(args, Bench(args, False, tmp_root, emit))
        if args.workload == "llama8b-decode" or (args.workload == "all" and torch.cuda.is_available()):
            dev = torch.device(args.device or "cuda")
            workload_llama(args, Bench(args, dev.type == "cuda", tmp_root, emit))
        elif args.workload == "all":
            print("\n(no CUDA: llama8b-decode skipped)")
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    failed = [(r["workload"], r["batch"], t["name"]) for r in results for t in r["targets"]
              if t["result"] == "FAIL"]
    print(f"\ntargets: {sum(t['result'] == 'PASS' for r in results for t in r['targets'])} PASS, "
          f"{len(failed)} FAIL" + (": " + "; ".join(f"{w} b{b}: {n}" for w, b, n in failed) if failed else ""))
    if args.json:
        write_json(args.json, h, args, results)
        print(f"wrote {args.json}")
    return 1 if (args.check and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
