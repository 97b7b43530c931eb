"""What the idle flush (tracer/writer.py ``flush_when_idle``) costs a busy process, and how soon
a process that goes idle has its last step on disk.

    python bench/idle_flush.py [--rounds 15] [--steps 50]

- busy: bench/call_patterns.py's SGLang-signature decode step (388 module calls), steps back to
  back, with the step end's ``flush_when_idle`` as it is (``idle``) and replaced by a no-op
  (``off``, the writer before it existed), interleaved rounds; ms per step and the idle flushes
  the writer made while steps followed each other (expected: none).
- idle: one step, then no other; how long until the rank file holds its STEP_END (with the
  periodic flush at its default 1 s, that was up to 1 s; now about ``idle_flush_s``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import call_patterns as cp  # noqa: E402

from tensor_trace import tracer  # noqa: E402
from tensor_trace.tracer import tensor_slots  # noqa: E402
from tensor_trace.tracer.config import TraceConfig  # noqa: E402
from tensor_trace.tracer.writer import RankWriter  # noqa: E402


def busy_block(step, steps: int, idle: bool) -> tuple[float, float, int]:
    real = RankWriter.flush_when_idle
    if not idle:
        RankWriter.flush_when_idle = lambda self: None
    try:
        tr = tracer.start(out_dir=tempfile.mkdtemp(prefix="tt-idle-"), fingerprint=True, lineage=False)
        for _ in range(3):
            step()
        c0 = time.process_time_ns()  # CPU time of all threads: the writer thread's wake-ups too
        t0 = time.perf_counter_ns()
        for _ in range(steps):
            step()
        ms = (time.perf_counter_ns() - t0) / steps / 1e6
        cpu_ms = (time.process_time_ns() - c0) / steps / 1e6
        flushes = tr.writer.idle_flushes
        tracer.stop()
        return ms, cpu_ms, flushes
    finally:
        RankWriter.flush_when_idle = real


def time_to_disk(step) -> float:
    """ms from the end of one step (no other follows) until its STEP_END is in the file."""
    tr = tracer.start(out_dir=tempfile.mkdtemp(prefix="tt-idle-"), fingerprint=True, lineage=False)
    step()
    writer = tr.writer
    t0 = time.perf_counter()
    while writer.idle_flushes == 0 and time.perf_counter() - t0 < 5:
        time.sleep(0.0005)
    ms = (time.perf_counter() - t0) * 1e3
    tracer.stop()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tensor_slots.CONTEXT_TYPES.add(cp.ForwardBatch)
    model = cp.SGLangCalls().eval()
    ids, pos, fb = torch.randint(0, 100, (cp.B,)), torch.arange(cp.B), cp.forward_batch()

    def step():
        model(ids, pos, fb)

    res = {(idle, k): [] for idle in (True, False) for k in ("wall", "cpu")}
    flushes = {True: 0, False: 0}
    ratios = {"wall": [], "cpu": []}
    rng = random.Random(0)
    with torch.inference_mode():
        for _ in range(args.rounds):
            order = [True, False]
            rng.shuffle(order)
            got = {}
            for idle in order:
                ms, cpu_ms, n = busy_block(step, args.steps, idle)
                res[(idle, "wall")].append(ms)
                res[(idle, "cpu")].append(cpu_ms)
                flushes[idle] += n
                got[(idle, "wall")], got[(idle, "cpu")] = ms, cpu_ms
            for k in ratios:
                ratios[k].append(got[(True, k)] / got[(False, k)])
        lat = [time_to_disk(step) for _ in range(5)]
        tr = tracer.start(out_dir=tempfile.mkdtemp(prefix="tt-idle-"), lineage=False)
        step()
        w = tr.writer
        n = 20000
        t0 = time.perf_counter_ns()
        for _ in range(n):
            w.flush_when_idle()
        call_us = (time.perf_counter_ns() - t0) / n / 1e3
        tracer.stop()
    print(f"# idle_flush {time.strftime('%Y-%m-%d %H:%M')} torch={torch.__version__} rounds={args.rounds} "
          f"steps={args.steps} (CPU, one thread; load {os.getloadavg()[0]:.1f})")
    for k in ("wall", "cpu"):
        q = statistics.quantiles(ratios[k], n=4)
        print(f"busy, {k} ms/step median: idle flush on {statistics.median(res[(True, k)]):.3f}, off "
              f"{statistics.median(res[(False, k)]):.3f}; paired on/off median {statistics.median(ratios[k]):.4f} "
              f"[p25 {q[0]:.4f}, p75 {q[2]:.4f}]; minima on {min(res[(True, k)]):.3f}, off "
              f"{min(res[(False, k)]):.3f}")
    print(f"idle flushes while steps followed each other: {flushes[True]}; "
          f"flush_when_idle() itself: {call_us:.2f} us a call")
    print(f"idle: last step on disk after {', '.join(f'{x:.1f}' for x in lat)} ms "
          f"(idle_flush_s {TraceConfig().idle_flush_s * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
