"""Does anything synchronise the GPU inside a traced step? Two independent checks, per rank.

    torchrun --nproc-per-node 2 tests/gpu/scripts/sync_check.py --json OUT.json   # NCCL, one GPU per rank
    python tests/gpu/scripts/sync_check.py --json OUT.json                        # one GPU

Run by tests/gpu/test_gpu_sync.py, which asserts on the JSON.

The example model (examples/tp_llama.py, bf16 on CUDA) runs blocks of steps with no
synchronisation between them, untraced and traced (fingerprints on and off):

1. ``torch.cuda.set_sync_debug_mode("error")`` around every step: a synchronising call in the
   model or in a tracer hook raises; the tracer counts what its guarded hooks caught
   (``errors``), and a block that raises is reported.
2. ``torch.profiler`` with CUDA activity over the same block: the CUDA runtime calls that block
   the host (``cudaDeviceSynchronize``, ``cudaStreamSynchronize``, ``cudaEventSynchronize``,
   synchronous ``cudaMemcpy``) are counted.

A control step with a deliberate ``.item()`` shows that check 1 does catch a synchronisation.
Rank 0 prints; every rank's figures go to the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from tensor_trace import tracer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "bench"))
from models import load_example  # noqa: E402  (bench/models.py: examples/tp_llama.py by path)

SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _sync_calls(prof) -> dict:
    """Blocking runtime calls made while the steps ran (inside the "steps" range: the
    profiler's own start and stop are outside it)."""
    events = prof.events()
    ranges = [ev.time_range for ev in events if ev.name == "steps"]
    if not ranges:
        return {"no 'steps' range recorded": 1}
    lo, hi = ranges[0].start, ranges[0].end
    counts: dict = {}
    for ev in events:
        name = ev.name
        if not lo <= ev.time_range.start <= hi:
            continue
        # cudaMemcpyAsync does not block; cudaMemcpy (and cudaMemcpy2D...) do.
        if any(name == s or (s == "cudaMemcpy" and name.startswith("cudaMemcpy") and "Async" not in name)
               for s in SYNC_CALLS):
            counts[name] = counts.get(name, 0) + 1
    return counts


def run_block(model, ids_list, variant, tmp, steps):
    tr = None
    if variant != "plain":
        tr = tracer.start(out_dir=os.path.join(tmp, variant), fingerprint=variant == "traced-fp",
                          fingerprint_every=1)  # traced-fp: fingerprints on every step
    raised = None
    try:
        with torch.inference_mode():
            for ids in ids_list[:2]:  # warm steps of this block (first traced step adopts the model)
                model(ids)
            torch.cuda.synchronize()
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                torch.cuda.set_sync_debug_mode("error")
                try:
                    with torch.profiler.record_function("steps"):
                        for i in range(steps):
                            model(ids_list[2 + i % (len(ids_list) - 2)])
                except RuntimeError as exc:
                    raised = str(exc).splitlines()[0]
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()  # after the profiled block: not counted
    finally:
        stats = dict(tr.stats) if tr is not None else {}
        if tr is not None:
            tracer.stop()
    return dict(variant=variant, steps=steps, sync_calls=_sync_calls(prof), raised=raised,
                tracer_errors=stats.get("errors"), traced_steps=stats.get("steps"))


def control():
    """A deliberate synchronisation under the same mode must raise."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.ones(1, device="cuda").sum().item()
        return "NOT CAUGHT"
    except RuntimeError:
        return "caught"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    group = None
    if world > 1:
        dist.init_process_group("nccl")
        group = dist.group.WORLD
    ex = load_example()
    exargs = ex.parse_args(["--dtype", "bfloat16", "--device", "cuda", "--batch", "8", "--seq", "16"])
    model = ex.build_model(exargs, rank, world, group, device=torch.device("cuda", local), dtype=torch.bfloat16)
    ids_list = [ex.make_input_ids(exargs, s).cuda() for s in range(6)]
    with torch.inference_mode():
        model(ids_list[0])  # lazy NCCL and cuBLAS set-up happen here, untraced
    torch.cuda.synchronize()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("plain", "traced-nofp", "traced-fp"):
            results.append(run_block(model, ids_list, variant, tmp, args.steps))
    ctl = control()
    ok = ctl == "caught" and all(not r["sync_calls"] and not r["raised"] and not r["tracer_errors"]
                                 for r in results)
    every = [dict(rank=rank, ok=ok, control=ctl, results=results)]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, dict(rank=rank, ok=ok, control=ctl, results=results))
        ok = all(e["ok"] for e in every)
    if rank == 0:
        print(f"sync check, rank {rank} of {world}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
        print(f"control (.item() under set_sync_debug_mode('error')): {ctl}")
        for r in results:
            print(f"  {r['variant']:<12} {r['steps']} steps: blocking CUDA runtime calls "
                  f"{r['sync_calls'] or 0}; raised: {r['raised'] or 'no'}; tracer errors: "
                  f"{r['tracer_errors'] if r['tracer_errors'] is not None else '-'}; traced steps: "
                  f"{r['traced_steps'] if r['traced_steps'] is not None else '-'}")
        for e in every[1:]:
            print(f"  rank {e['rank']}: " + "; ".join(
                f"{r['variant']} blocking calls {r['sync_calls'] or 0}, raised {r['raised'] or 'no'}, "
                f"errors {r['tracer_errors'] if r['tracer_errors'] is not None else '-'}" for r in e["results"]))
        print("NO SYNCHRONISATION IN TRACED STEPS" if ok else "SYNCHRONISATION FOUND")
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(dict(world=world, device=torch.cuda.get_device_name(), torch=torch.__version__,
                           ranks=every, ok=ok), f, indent=1)
    if world > 1:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
