"""Tracing overhead benchmark: per-step wall time of a forward step, traced and not, side by side.

Variants, measured in one process, interleaved and repeated:

- ``plain``        no tracing;
- ``traced-nofp``  ``tracer.start(out_dir=..., fingerprint=False)``;
- ``traced-fp``    ``tracer.start(out_dir=..., fingerprint=True, fingerprint_every=1)``: fingerprints
                   on every step;
- ``traced-default`` ``tracer.start(out_dir=...)``: ``record``'s defaults, fingerprints on a
                   schedule (the first 4 steps of a kind, then every 8th): its figure is the MEAN
                   step time (a few fingerprinted steps among plain ones; the median shows the
                   unfingerprinted steps alone), printed with the median below the table;
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
- ``linear-chain``    ``--modules`` (200) tiny Linear(64, 64) modules in a chain on a [4, 64] input
                      (``--device`` cpu or cuda): modules that do almost no work, so the table's
                      ``+us/call`` column is the cost per module call of each variant (the floor
                      of hook-based tracing is ``empty-hooks``);
- ``llama8b-decode``  a Llama-3-8B-shaped eager decode step (models.py) (bf16, cuda, one token per sequence,
                      a fixed KV cache read by ``scaled_dot_product_attention``), batches 8 and 64;
- ``all``             example-cpu, then llama8b-decode when CUDA is available.

    OMP_NUM_THREADS=1 python bench/overhead.py --workload example-cpu --json bench/results/cpu.json
    OMP_NUM_THREADS=1 python bench/overhead.py --workload linear-chain [--device cuda]
    python bench/overhead.py --workload llama8b-decode --json bench/results/gpu.json

The targets printed at the end are informational; ``--check`` makes a FAIL exit with status 1.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import torch

from common import header, header_line  # bench/ is first on sys.path
from models import LLAMA_SHAPES, TP, LinearChain, LlamaForCausalLM, count_module_calls, load_example
from overhead_measure import Bench, measure
from overhead_report import print_table, summarise, targets_for
from tensor_trace import tracer


def ensure_native(label: str) -> None:
    """tracer/native.py (the default where CUDA is) built or loaded now, not during the rounds:
    every traced step measured takes its keys and C call wrapper."""
    from tensor_trace.tracer import native

    if native.enabled():
        t0 = time.perf_counter()
        native.ensure(block=True)
        print(f"  [{label}] tracer/native.py "
              f"{'ready' if native.pair_key() else 'UNAVAILABLE: ' + str(native.error())} "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)


def run_workload(args, bench: Bench, step, res: dict, defaults=(7, 3, 20)) -> dict:
    """Measure ``step`` (every variant, interleaved rounds), print its table and emit ``res``
    with the figures; ``defaults`` are the rounds, warm-up and timed steps per block."""
    ensure_native(res["workload"])
    rounds = args.rounds or defaults[0]
    warmup = args.warmup if args.warmup is not None else defaults[1]
    steps = args.steps or defaults[2]
    label = res["workload"]
    with torch.inference_mode():
        calls = count_module_calls(step)
        acc, orders, failed = measure(bench, step, rounds=rounds, warmup=warmup, steps=steps,
                                      seed=args.seed, label=label, warm_round=not args.no_warm_round)
        res.update(module_calls_per_step=calls, rounds=rounds, warmup=warmup, steps=steps,
                   orders=orders, torch_threads=torch.get_num_threads())
        res["variants"] = summarise(acc, failed, calls)
        res["targets"] = targets_for(label, res["variants"])
        print_table(res)
        bench.emit(res)
    return res


def workload_example_cpu(args, bench: Bench):
    ex = load_example()
    cfg = ex.TinyLlamaConfig()
    model = ex.build_model(cfg, 0, 1, None, device="cpu", dtype=torch.float32)
    batch, seq = 2, 8
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (batch, seq), generator=gen)
    res = dict(workload="example-cpu", device="cpu", dtype="float32", batch=batch, seq=seq,
               model=dict(layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads,
                          kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, ffn=cfg.ffn,
                          vocab=cfg.vocab, tp=1))
    return [run_workload(args, bench, lambda: model(ids), res)]


def workload_linear_chain(args, bench: Bench):
    """Per-call cost: a chain of tiny Linear modules (the table's +us/call column)."""
    device = torch.device(args.device or "cpu")
    model = LinearChain(args.modules).to(device)
    x = torch.randn(4, 64, device=device)
    res = dict(workload="linear-chain", device=str(device), dtype="float32", batch=4, seq=1,
               model=dict(modules=args.modules, tp=1))
    return [run_workload(args, bench, lambda: model(x), res, defaults=(7, 5, 50))]


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
    ensure_native("llama8b-decode")
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
        results.append(res)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return results


def run_header() -> dict:
    cuda = torch.cuda.is_available()
    h = header(sys.argv)
    return dict(h, device_name=torch.cuda.get_device_name() if cuda else h["cpu"],
                torch=torch.__version__, cuda=torch.version.cuda if cuda else None,
                torch_threads=torch.get_num_threads(), tensor_trace=os.path.dirname(tracer.__file__))


def write_json(path, h, args, results) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(header=h, args=vars(args), results=results), f, indent=1)
    os.replace(tmp, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["example-cpu", "linear-chain", "llama8b-decode", "all"], default="all")
    p.add_argument("--modules", type=int, default=200, help="modules of the linear-chain workload")
    p.add_argument("--rounds", type=int, default=None, help="rounds R (default 7)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps W per block (3 CPU, 5 GPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps N per block (20 CPU, 30 GPU)")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 64], help="llama8b-decode batches")
    p.add_argument("--kv-len", type=int, default=512, help="cached tokens per sequence (llama8b-decode)")
    p.add_argument("--vocab", type=int, default=None, help="override the vocab (default 128256)")
    p.add_argument("--llama-shape", choices=sorted(LLAMA_SHAPES), default="8b",
                   help="'tiny' only smoke-tests the llama8b-decode code path")
    p.add_argument("--device", default=None, help="llama8b-decode (default cuda) or linear-chain (default cpu) device")
    p.add_argument("--dtype", default="bfloat16", help="llama8b-decode dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warm-round", action="store_true",
                   help="skip the discarded warm-up round of every variant before the R rounds")
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
    h = run_header()
    h["tp"] = TP["size"]
    print(header_line("overhead", h, h["device_name"]), flush=True)
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
        if args.workload == "linear-chain":
            dev = torch.device(args.device or "cpu")
            workload_linear_chain(args, Bench(args, dev.type == "cuda", tmp_root, emit))
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
