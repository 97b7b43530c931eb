"""Where a traced CUDA-graph replay spends its extra device time, by kernel.

    python bench/replay_profile.py [--batch 64] [--replays 5]     # needs a GPU

Captures the Llama-8B-shaped decode step of bench/overhead.py untraced and traced (fingerprints
on), replays each under torch.profiler (CUDA activity) and prints, per graph, the kernels grouped
by name with their device time per replay, then the difference: the fingerprint kernels that
the traced capture added and any change in the model's own kernels.
"""
from __future__ import annotations

import argparse
import collections
import tempfile

import torch

import overhead as ov  # bench/ is this script's folder, first on sys.path
from gpu_timing import replays_device_us
from tensor_trace import tracer


def kernels_per_replay(graph, replays: int) -> dict:
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    by_name: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(e, "device_time_total", None) or e.cuda_time_total
            by_name[e.name][0] += 1
            by_name[e.name][1] += t
    return {k: (n / replays, us / replays) for k, (n, us) in by_name.items()}


def host_and_wall(graph, n: int = 50) -> tuple:
    """(median host µs of a ``replay()`` call, median µs of replay + synchronize, device µs per
    replay from events around ``n`` back-to-back replays)."""
    import statistics
    import time

    pc = time.perf_counter_ns
    host, wall = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = pc()
        graph.replay()
        t1 = pc()
        torch.cuda.synchronize()
        t2 = pc()
        host.append((t1 - t0) / 1e3)
        wall.append((t2 - t0) / 1e3)
    return statistics.median(host), statistics.median(wall), replays_device_us(graph, n)


def host_profile(graph, n: int = 50) -> None:
    """Where a traced replay's host time goes (cProfile, synchronised replays), whether anything
    in it synchronises (torch's sync debug mode), and back-to-back replays' host and device time."""
    import cProfile
    import io
    import pstats
    import time
    import warnings

    prof = cProfile.Profile()
    for _ in range(n):
        torch.cuda.synchronize()
        prof.enable()
        graph.replay()
        prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    print(f"== traced replay host profile ({n} replays, tottime):")
    print("\n".join(line for line in buf.getvalue().splitlines()[6:] if line.strip()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(5):
                graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    print(f"== sync debug mode over 5 traced replays: {len(caught)} warning(s)",
          *{str(w.message)[:160] for w in caught})
    for k in (10, 50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        a.record()
        for _ in range(k):
            graph.replay()
        t1 = time.perf_counter_ns()
        b.record()
        torch.cuda.synchronize()
        print(f"== {k} back-to-back traced replays: host {(t1 - t0) / 1e3 / k:.0f} us per replay call, "
              f"device {a.elapsed_time(b) * 1000 / k:.0f} us per replay")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--llama-shape", default="8b")
    args = ap.parse_args()
    dev = torch.device("cuda")
    shape = dict(ov.LLAMA_SHAPES[args.llama_shape], kv_len=512)
    with torch.inference_mode():
        model = ov.LlamaForCausalLM(shape, dev, torch.bfloat16).eval()
        model.set_batch(args.batch)
        ids = torch.randint(0, shape["vocab"], (args.batch, 1), device=dev)
        for _ in range(3):
            model(ids)
        graphs = {}
        timing = {}
        for name in ("plain", "traced"):
            if name == "traced":
                tracer.start(out_dir=tempfile.mkdtemp(prefix="tt-prof-"), fingerprint=True)
            g = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                model(ids)
            torch.cuda.synchronize()
            graphs[name] = kernels_per_replay(g, args.replays)
            timing[name] = host_and_wall(g)
            if name == "traced":
                host_profile(g)
            if name == "traced":
                tracer.stop()
                # the same graphs again, tracer stopped (its kernels still in the traced graph):
                # what the graph costs apart from the replay wrapper, and any drift since
                timing["traced graph, tracer stopped"] = host_and_wall(g)
                timing["plain, again"] = host_and_wall(plain_graph)
            else:
                plain_graph = g
    for name, (host, wall, dev_us) in timing.items():
        print(f"== {name}: replay() call {host:.1f} us host (median, no wait); replay + synchronize "
              f"{wall:.1f} us (median); device {dev_us:.1f} us per replay (events over 50)")
    for name, ks in graphs.items():
        total = sum(us for _, us in ks.values())
        print(f"== {name}: {sum(n for n, _ in ks.values()):.0f} kernels, {total:.0f} us device time per replay")
        for k, (n, us) in sorted(ks.items(), key=lambda kv: -kv[1][1])[:12]:
            print(f"   {us:9.1f} us {n:6.1f}x  {k[:110]}")
    plain, traced = graphs["plain"], graphs["traced"]
    print("== traced minus plain, by kernel name (us per replay)")
    diff = {k: (traced.get(k, (0, 0))[0] - plain.get(k, (0, 0))[0], traced.get(k, (0, 0))[1] - plain.get(k, (0, 0))[1])
            for k in set(plain) | set(traced)}
    for k, (n, us) in sorted(diff.items(), key=lambda kv: -abs(kv[1][1]))[:20]:
        print(f"   {us:+9.1f} us {n:+6.1f}x  {k[:110]}")
    print(f"   total {sum(us for _, us in diff.values()):+.1f} us per replay")


if __name__ == "__main__":
    main()
