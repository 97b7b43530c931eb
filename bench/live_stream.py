"""Live OTLP at a GPU decode server's span rate: one rank's records, as the writer hands them to
``LiveOTLP.offer`` once a second, streamed into a loopback receiver for a bounded time
(used by bench/export_bench.py)."""

import glob
import os
import time

import synth

from tensor_trace import schema
from tensor_trace.exporters.store.reader import iter_records
from tensor_trace.tracer.live_otlp import LiveOTLP

STEP_NS = 8_000_000  # a decode step
DECODE_SHAPE = synth.Shape(layers=38)  # 11 * 38 + 5 = 423 module spans per step, 78 collectives
STEPPED = (schema.STEP_BEGIN, schema.SPAN, schema.COLLECTIVE, schema.STEP_END)


def rank_records(work: str) -> tuple:
    """(every record of one rank of a short synthetic TP-8 decode trace, its last step's
    step-numbered records as a template for the steps that follow)."""
    synth.generate(work, 4, 8, 0, "realistic", shape=DECODE_SHAPE, log=lambda m: None)
    records = list(iter_records(sorted(glob.glob(os.path.join(work, "ranks", "*")))[0]))
    last = max(r[1] for r in records if r[0] == schema.STEP_BEGIN)
    return records, [r for r in records if r[0] in STEPPED and r[1] == last]


def _renumbered(template, step):
    out = [[kind, step, *rest] for kind, _, *rest in template]
    out[0][3] = step * STEP_NS  # STEP_BEGIN's mono_ns: steps back to back
    return out


def stream(endpoint: str, records, template, seconds: float, module_every: int) -> dict:
    """Offer a decode server's records for ``seconds`` (a batch a second, as the writer flushes),
    then shut down as the tracer does at exit. Counts in spans."""
    live = LiveOTLP(endpoint, "bench", {"host": "bench", "pid": 1, "mono_ns": 0, "wall_ns": time.time_ns()},
                    protocol="grpc", module_every=module_every).start()
    offered = sum(1 for r in records if r[0] in (schema.SPAN, schema.COLLECTIVE))
    live.offer(records)
    step = max(r[1] for r in template) + 1
    steps_per_batch = round(1e9 / STEP_NS)
    t0 = time.perf_counter()
    for second in range(int(seconds)):
        batch = [r for s in range(step, step + steps_per_batch) for r in _renumbered(template, s)]
        step += steps_per_batch
        offered += sum(1 for r in batch if r[0] in (schema.SPAN, schema.COLLECTIVE))
        live.offer(batch)
        time.sleep(max(0.0, t0 + second + 1 - time.perf_counter()))
    with live.cond:  # what waits when the program ends: a backlog that grows is a future drop
        backlog = sum(1 for b in live.queue for r in b if r[0] in (schema.SPAN, schema.COLLECTIVE))
    t_end = time.perf_counter()
    stats = live.shutdown()
    return dict(offered=offered, sent=stats["live_otlp_sent"], left_out=stats["live_otlp_left_out"],
                dropped=stats["live_otlp_dropped"], wall=time.perf_counter() - t0, backlog=backlog,
                drain=time.perf_counter() - t_end, offered_per_s=offered / seconds)
