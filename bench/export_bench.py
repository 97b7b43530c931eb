"""Export throughput: the synthetic 2-million-span trace (bench/synth.py) through the Perfetto
exporter, plain and gzip, timed in this process.

    OMP_NUM_THREADS=1 python bench/export_bench.py [--steps N] [--dir DIR]
"""

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import synth  # noqa: E402
from common import header, header_line  # noqa: E402

from tensor_trace.exporters.pipeline import merge_ranks  # noqa: E402
from tensor_trace.exporters.formats.perfetto import export_perfetto  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None, help="default: about 2,000,000 span records")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--otlp-steps", type=int, default=16, help="steps of the trace sent over OTLP")
    a = ap.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="tt-export-bench-")
    steps = a.steps or synth.steps_for(2_000_000, 8)
    print(header_line("export_bench", header(sys.argv)))
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
    # OTLP into a real receiver on loopback (the test one, from opentelemetry-proto's services),
    # on a smaller trace: the receiver decodes every span in this same process.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests", "integration"))
    from otlp_receiver import GrpcReceiver, HttpReceiver
    from tensor_trace.exporters.formats.otlp import export_otlp

    small = os.path.join(work, "small")
    info = synth.generate(small, a.otlp_steps, 8, 0, "realistic", log=lambda m: None)
    merge_ranks(small, warn=lambda m: None)
    for protocol, receiver_cls in (("grpc", GrpcReceiver), ("http", HttpReceiver)):
        with receiver_cls() as rcv:
            t0 = time.perf_counter()
            r = export_otlp(small, f"http://127.0.0.1:{rcv.port}", protocol)
            wall = time.perf_counter() - t0
        got = sum(len(ss.spans) for req in rcv.requests for rs in req.resource_spans for ss in rs.scope_spans)
        print(f"otlp {protocol:5s} {r['spans']:>10,} spans ({got:,} received)  {wall:6.1f} s wall  "
              f"{r['spans'] / wall:,.0f} spans/s  ({a.otlp_steps} steps x 8 ranks)")
    if not a.dir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
