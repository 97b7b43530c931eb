"""Host cost of each piece of a traced eager step's fingerprint work, measured one at a time in
tight loops (best of several repeats), so that a noisy host still gives a cost model:

    python bench/step_end_probe.py [--tensors 450] [--device cuda]

Pieces: tensor attribute reads a hook makes (per call); holding and releasing the step's tensors;
the eager kernel's launch (``multi_tensor.sum_sumsq_table``) and its parts (packing the table,
the pinned buffer, the copy, the launch alone); the step's device-to-host copy (``_to_host``);
and a whole StepFingerprints step (add_one per tensor, finish_step, collect)."""
from __future__ import annotations

import argparse
import array
import ctypes
import struct
import time
import timeit

import torch

from tensor_trace.tracer import fingerprint as fpm, multi_tensor


def best_us(fn, number, repeat=7, env=None) -> float:
    """Best of ``repeat`` timings of ``number`` runs, in microseconds per run (``fn``: a callable
    or a statement evaluated in ``env``)."""
    return min(timeit.repeat(fn, number=number, repeat=repeat, globals=env)) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=450)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n = args.tensors
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    print(f"# step_end_probe {time.strftime('%Y-%m-%d %H:%M:%S')} device={dev} torch={torch.__version__} tensors={n}")
    with torch.inference_mode():
        t = torch.randn(8, 4096, device=dev, dtype=dtype)
        for stmt in ("t.is_cuda", "t.dtype", "t.numel()", "t.is_inference()", "t.is_contiguous()",
                     "t.data_ptr()", "t.get_device()", "t.device"):
            print(f"  {stmt:<20} {best_us(stmt, 20000, env=dict(t=t)) * 1e3:7.1f} ns")
        ts = [torch.randn(8, 4096, device=dev, dtype=dtype) for _ in range(n)]
        sync()

        def make_and_free():
            held = [x + 0 for x in ts[:64]]
            del held
        # allocation + free of 64 tensors, held together vs one at a time
        def one_at_a_time():
            for x in ts[:64]:
                y = x + 0
                del y
        sync()
        print(f"  64 x (x + 0), all held then freed: {best_us(make_and_free, 20):8.1f} us; "
              f"one at a time: {best_us(one_at_a_time, 20):8.1f} us")
        sync()

        table = []
        for x in ts:
            k = x.numel()
            table += (x.data_ptr(), k, k, k)
        print(f"  table of {n}: struct.pack {best_us(lambda: struct.pack(f'={len(table)}q', *table), 200):7.1f} us, "
              f"array('q') {best_us(lambda: array.array('q', table).tobytes(), 200):7.1f} us")
        if dev.type == "cuda":
            print(f"  pinned empty({len(table) + n}): {best_us(lambda: torch.empty(len(table) + n, dtype=torch.int64, pin_memory=True), 200):7.1f} us")
            host = torch.empty(len(table) + n, dtype=torch.int64, pin_memory=True)
            print(f"  H2D non_blocking: {best_us(lambda: host.to(dev, non_blocking=True), 200):7.1f} us")
        if not multi_tensor.usable(ts[0]):
            print("  (no multi-tensor kernel here: the rest needs a GPU)")
            return
        idx = list(range(n))
        most = max(table[1::4])

        def launch():
            multi_tensor.sum_sumsq_table(table, n, most, dtype, dev)
        launch()
        sync()
        print(f"  sum_sumsq_table (whole): {best_us(launch, 50):7.1f} us")
        sync()
        kernel = multi_tensor._kernel()
        both = torch.zeros(len(table) + n, dtype=torch.int64, device=dev)
        dev_table, out = both[:len(table)], both[len(table):].view(torch.float32).view(n, 2)
        grid = (n, max(1, -(-most // multi_tensor.CHUNK)))
        tl_dtype = multi_tensor._state["tl_dtypes"][dtype]

        def launch_only():
            kernel[grid](dev_table, out, 0, CHUNK=multi_tensor.CHUNK, BLOCK=multi_tensor.BLOCK,
                         DTYPE=tl_dtype, ROWS=True, num_warps=multi_tensor.NUM_WARPS)
        print(f"  kernel[grid](...) alone: {best_us(launch_only, 100):7.1f} us")
        sync()
        vals = multi_tensor.sum_sumsq_table(table, n, most, dtype, dev)
        print(f"  _to_host (pinned + copy + event): {best_us(lambda: fpm._to_host(idx, vals, True), 200):7.1f} us")
        sync()

        # a whole step of StepFingerprints: add_one each (as module outputs), finish, collect
        fps = fpm.StepFingerprints(defer_cuda=True)
        step = [0]
        phase = {"add": [], "finish": [], "collect": []}
        for rep in range(30):
            outs = [x + 0 for x in ts]  # fresh tensors, as a step's outputs are
            sync()
            t0 = time.perf_counter_ns()
            for x in outs:
                fps.add_one(x)
            t1 = time.perf_counter_ns()
            del outs
            fps.finish_step(step[0])
            t2 = time.perf_counter_ns()
            sync()
            t3 = time.perf_counter_ns()
            fps.collect()
            t4 = time.perf_counter_ns()
            step[0] += 1
            if rep >= 5:
                phase["add"].append((t1 - t0) / 1e3)
                phase["finish"].append((t2 - t1) / 1e3)
                phase["collect"].append((t4 - t3) / 1e3)
        print("  StepFingerprints step (min over 25): " + ", ".join(
            f"{k} {min(v):.1f} us" for k, v in phase.items()) + f" for {n} tensors")


if __name__ == "__main__":
    main()
