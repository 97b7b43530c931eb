"""Export throughput: the synthetic 2-million-span trace (bench/synth.py) through the Perfetto
exporter, plain and gzip, timed in this process; OTLP export into a loopback receiver; live OTLP
at a decode server's span rate (bench/live_stream.py) with the streaming policy and without it.

    OMP_NUM_THREADS=1 python bench/export_bench.py [--steps N] [--dir DIR] [--live-only | --otlp-only]
"""

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import live_stream  # noqa: E402
import synth  # noqa: E402
from common import header, header_line  # noqa: E402

from tensor_trace.exporters.pipeline import merge_ranks  # noqa: E402
from tensor_trace.exporters.formats.perfetto import export_perfetto  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None, help="default: about 2,000,000 span records")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--otlp-steps", type=int, default=16, help="steps of the trace sent over OTLP")
    ap.add_argument("--live-seconds", type=int, default=10, help="live OTLP streaming time")
    ap.add_argument("--live-only", action="store_true", help="only the live OTLP figures")
    ap.add_argument("--otlp-only", action="store_true", help="only `export otlp` over gRPC and HTTP")
    a = ap.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="tt-export-bench-")
    print(header_line("export_bench", header(sys.argv)))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests", "integration"))
    if not a.otlp_only:
        live(work, a.live_seconds)
    if not a.live_only:
        if not a.otlp_only:
            perfetto(work, a)
        otlp(work, a)
    if not a.dir:
        shutil.rmtree(work)


def live(work, seconds):
    """Live OTLP of one TP-8 rank at a decode server's rate, policy (default every 16th step's
    module spans) and no policy (every span) side by side: the zero-drop target is the policy's."""
    from otlp_receiver import GrpcReceiver
    from tensor_trace.tracer.config import TraceConfig

    records, template = live_stream.rank_records(os.path.join(work, "live"))
    for every in (TraceConfig.otlp_module_every, 1):
        with GrpcReceiver() as rcv:
            r = live_stream.stream(f"http://127.0.0.1:{rcv.port}", records, template, seconds, every)
        got = sum(len(ss.spans) for req in rcv.requests for rs in req.resource_spans for ss in rs.scope_spans)
        verdict = ("PASS" if r["dropped"] == 0 else "FAIL") if every > 1 else "(reference)"
        print(f"live otlp module_every={every:<3d} {r['offered']:>9,} spans offered ({r['offered_per_s']:,.0f}/s "
              f"for {seconds} s)  {r['sent']:>9,} streamed ({got:,} received)  {r['left_out']:>9,} left out  "
              f"{r['dropped']:>9,} dropped  {r['sent'] / r['wall']:,.0f} streamed/s  "
              f"backlog at end {r['backlog']:,} (drained in {r['drain']:.1f} s)  {verdict} (0 dropped)")


def perfetto(work, a):
    steps = a.steps or synth.steps_for(2_000_000, 8)
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


def otlp(work, a):
    # OTLP into a real receiver on loopback (the test one, from opentelemetry-proto's services),
    # on a smaller trace: the receiver decodes every span in this same process.
    from otlp_receiver import GrpcReceiver, HttpReceiver
    from tensor_trace.exporters.formats.otlp import export_otlp

    small = os.path.join(work, "small")
    info = synth.generate(small, a.otlp_steps, 8, 0, "realistic", log=lambda m: None)
    merge_ranks(small, warn=lambda m: None)
    for protocol, receiver_cls in (("grpc", GrpcReceiver), ("http", HttpReceiver)):
        with receiver_cls() as rcv:
            t0, c0 = time.perf_counter(), time.process_time()
            r = export_otlp(small, f"http://127.0.0.1:{rcv.port}", protocol)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        got = sum(len(ss.spans) for req in rcv.requests for rs in req.resource_spans for ss in rs.scope_spans)
        rcv.requests.clear()
        at_2m = 2e6 * wall / r["spans"]
        # The receiver decodes in this process (its CPU is in cpu): its share is timed apart.
        print(f"otlp {protocol:5s} {r['spans']:>10,} spans ({got:,} received)  {wall:6.1f} s wall  "
              f"{cpu:6.1f} s cpu, of which the receiver's decode {rcv.decode_s:5.1f} s  "
              f"{r['spans'] / wall:,.0f} spans/s  ({a.otlp_steps} steps x 8 ranks; 2,000,000 spans at this "
              f"rate: {at_2m:,.1f} s)  {'PASS' if at_2m < 60 else 'FAIL'} (< 60 s)")


if __name__ == "__main__":
    main()
