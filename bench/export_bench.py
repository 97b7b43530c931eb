"""Export throughput: the synthetic 2-million-span trace (bench/synth.py) through the Perfetto
exporter, plain and gzip, timed in this process.

    OMP_NUM_THREADS=1 python bench/export_bench.py [--steps N] [--dir DIR]
"""

import argparse
import os
import platform
import resource
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import synth  # noqa: E402

from tensor_trace.exporters.merge import merge_ranks  # noqa: E402
from tensor_trace.exporters.perfetto import export_perfetto  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None, help="default: about 2,000,000 span records")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="tt-export-bench-")
    steps = a.steps or synth.steps_for(2_000_000, 8)
    print(f"# export_bench {time.strftime('%Y-%m-%dT%H:%M:%S')} {platform.node()} python {platform.python_version()} "
          f"load {os.getloadavg()[0]:.2f}")
    trace = os.path.join(work, "t")
    info = synth.generate(trace, steps, 8, 0, "realistic", log=lambda m: None)
    t = time.perf_counter()
    merge_ranks(trace, warn=lambda m: None)
    print(f"trace: {steps} steps x 8 ranks, {info.get('span_records', '?')} span records; merge {time.perf_counter() - t:.1f} s")
    for name in ("trace.json", "trace.json.gz"):
        out = os.path.join(work, name)
        t0, c0 = time.perf_counter(), time.process_time()
        r = export_perfetto(trace, out)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(f"perfetto {name:14s} {r['events']:>10,} events  {r['bytes'] / 2**20:8.1f} MiB  "
              f"{wall:6.1f} s wall  {cpu:6.1f} s cpu  {r['events'] / wall:,.0f} events/s  "
              f"{'PASS' if wall < 60 else 'FAIL'} (< 60 s)")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    if not a.dir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
