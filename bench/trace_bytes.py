"""Where a rank file's bytes go: bytes per module span on disk, and a breakdown by record kind.

    OMP_NUM_THREADS=1 python bench/trace_bytes.py                      # both workloads below
    OMP_NUM_THREADS=1 python bench/trace_bytes.py --workload llama-cpu
    python bench/trace_bytes.py --trace DIR [DIR ...]                   # folders already recorded

Workloads (each recorded into a temporary folder, with fingerprints on every step:
``--fingerprint-every 1``):

- ``example``    ``tensor-trace record -- torchrun --nproc-per-node 2 examples/tp_llama.py
                 --steps 8`` (CPU, gloo; 74 module calls and 14 collectives a step per rank);
- ``llama-cpu``  bench/models.py's Llama-8B-shaped decode model (32 layers, SGLang's module
                 layout, 389 module calls a step) at toy width on a CPU, batch 8, 35 steps (a block
                 of ``overhead.py --workload llama8b-decode``: 5 warm-up and 30 timed), recorded
                 twice: fingerprints ``deferred`` (the GPU's path: the same records as on the H200,
                 values reduced at the step's end) and ``auto`` (a CPU's: immediate);
- ``llama-gpu``  the same model at Llama-3-8B's shape in bf16 on CUDA, batch 8, 35 steps,
                 fingerprints ``auto`` (deferred; tracer/native.py where it builds).

Bytes per span is what ``overhead.py`` reports: the rank files' bytes on disk over the module
spans and collectives they hold. The breakdown gives each kind of record its count, its msgpack
bytes (as the writer packs it, before the chunk is compressed) per span and per record, and what
that kind alone takes compressed as the writer compresses (its records of each chunk compressed
apart from the rest of the chunk: roughly where the compressed bytes go). Span records also get
their msgpack bytes per field. Last, the time zlib takes here to compress the chunks (the
writer's thread, without the GIL) and to inflate them (every reader), per span.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
import zlib

import msgpack

from common import ROOT, header, header_line  # bench/ is first on sys.path
from tensor_trace import schema
from tensor_trace.exporters.store.reader import ReadReport, iter_chunks, rank_files
from tensor_trace.format.records import SpanRecord

# Record kinds reported together (the rest: "other").
GROUPS = {
    schema.SPAN: "span records", schema.COLLECTIVE: "collectives", schema.FINGERPRINTS: "fingerprint blobs",
    schema.LAYOUT: "layouts (LAYOUT, META)", schema.META: "layouts (LAYOUT, META)",
    schema.STRING: "strings (STRING, MODULE)", schema.MODULE: "strings (STRING, MODULE)",
    schema.STEP_BEGIN: "step records", schema.STEP_END: "step records",
    schema.LINEAGE: "lineage (LINEAGE, SLOT_SRC)", schema.SLOT_SRC: "lineage (LINEAGE, SLOT_SRC)",
    schema.PARAMS: "params", schema.GROUP: "groups",
}


class Breakdown:
    """What one trace folder's rank files hold, by kind of record."""

    def __init__(self, trace_dir: str):
        self.files = rank_files(trace_dir)
        self.disk = sum(os.path.getsize(f) for f in self.files)
        self.chunks = self.payload = 0
        self.count: collections.Counter = collections.Counter()
        self.raw: collections.Counter = collections.Counter()
        self.zipped: collections.Counter = collections.Counter()
        self.span_fields: collections.Counter = collections.Counter()
        self.fp_values = self.fp_index_bytes = 0
        self.compress_s = self.inflate_s = 0.0
        for path in self.files:
            for payload in iter_chunks(path, ReadReport(path)):
                self.chunks += 1
                self.payload += len(payload)
                by_group = collections.defaultdict(list)
                for rec in msgpack.unpackb(payload, raw=False, strict_map_key=False):
                    self._take(rec, by_group)
                for group, recs in by_group.items():
                    self.zipped[group] += len(schema.chunk(msgpack.packb(recs)))
                self._time_codec(payload)
        self.spans = self.count["span records"]
        self.records = self.spans + self.count["collectives"]

    def _time_codec(self, payload: bytes) -> None:
        """The writer's compression and the reader's inflation of one chunk, timed."""
        t0 = time.perf_counter()
        framed = schema.chunk(payload)
        t1 = time.perf_counter()
        schema.chunk_payload(framed[:4], framed[schema.CHUNK_HEAD.size:])
        self.compress_s += t1 - t0
        self.inflate_s += time.perf_counter() - t1

    def _take(self, rec, by_group) -> None:
        group = GROUPS.get(rec[0], "other")
        self.count[group] += 1
        self.raw[group] += len(msgpack.packb(rec, use_bin_type=True))
        by_group[group].append(rec)
        if rec[0] == schema.SPAN:
            for name, value in zip(SpanRecord._fields, rec):
                self.span_fields[name] += len(msgpack.packb(value))
        elif rec[0] == schema.FINGERPRINTS:
            self.fp_values += len(rec[3]) // 8
            self.fp_index_bytes += len(rec[4] or b"")

    def per_span(self, n: float) -> float:
        return n / self.records if self.records else float("nan")

    def print(self, label: str) -> None:
        compressed = self.disk - len(schema.FILE_PREFIX) * len(self.files) - schema.CHUNK_HEAD.size * self.chunks
        print(f"\n== {label}: {len(self.files)} rank file(s), {self.spans} module spans, "
              f"{self.count['collectives']} collectives, {self.disk:,} bytes on disk ==")
        print(f"bytes per module span (spans + collectives, as overhead.py): {self.per_span(self.disk):.1f}"
              f"   (msgpack before compression {self.per_span(self.payload):.1f}; chunks stored at "
              f"x{compressed / self.payload:.2f} of it)")
        print(f"{'record kind':<30} {'records':>8} {'msgpack B':>10} {'B/span':>7} {'B/record':>9} "
              f"{'zlib alone B/span':>18}")
        for group, n in self.raw.most_common():
            print(f"{group:<30} {self.count[group]:>8} {n:>10,} {self.per_span(n):>7.2f} "
                  f"{n / self.count[group]:>9.1f} {self.per_span(self.zipped[group]):>18.2f}")
        if self.spans:
            fields = "  ".join(f"{name} {self.span_fields[name] / self.spans:.2f}" for name in SpanRecord._fields)
            print(f"span record fields, msgpack B each: {fields}")
        print(f"fingerprint values per span {self.per_span(self.fp_values):.2f} (8 B each), index bytes per span "
              f"{self.per_span(self.fp_index_bytes):.2f}")
        print(f"zlib level {schema.ZLIB_LEVEL} here: compressing {self.per_span(self.compress_s) * 1e6:.2f} us and "
              f"inflating {self.per_span(self.inflate_s) * 1e6:.2f} us per span ({self.payload / 1e6 / self.compress_s:.0f}"
              f" / {self.payload / 1e6 / self.inflate_s:.0f} MB of msgpack a second)")


def record_example(out: str) -> str:
    """The example on two CPU ranks under ``tensor-trace record``; returns its folder."""
    trace = os.path.join(out, "example")
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([os.path.join(bindir, "tensor-trace"), "record", "-o", trace, "--fingerprint-every", "1", "--",
                    os.path.join(bindir, "torchrun"), "--nproc-per-node", "2",
                    os.path.join(ROOT, "examples", "tp_llama.py"), "--steps", "8"],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    return trace


def record_llama(out: str, mode: str, device: str = "cpu", steps: int = 35) -> str:
    """bench/models.py's Llama decode model, at toy width on a CPU, at Llama-3-8B's shape in
    bf16 on a GPU (batch 8, 512 cached tokens: overhead.py's llama8b-decode); returns the trace
    folder."""
    import torch

    import models
    from tensor_trace import tracer

    if device == "cpu":
        torch.set_num_threads(1)
        shape = dict(models.LLAMA_SHAPES["8b"], hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256,
                     kv_len=16)
    else:
        from tensor_trace.tracer import native

        shape = dict(models.LLAMA_SHAPES["8b"], kv_len=512)
        if native.enabled():  # built first, so that every step takes the C++ table's path
            native.ensure(block=True)
    torch.manual_seed(0)
    model = models.LlamaForCausalLM(shape, torch.device(device),
                                    torch.float32 if device == "cpu" else torch.bfloat16).eval()
    model.set_batch(8)
    # New token ids at every step, as in decoding: values that repeat from step to step would
    # flatter the compression
    ids = [torch.randint(0, shape["vocab"], (8, 1), device=device) for _ in range(steps)]
    trace = os.path.join(out, f"llama-{device}-{mode}")
    tracer.start(out_dir=trace, fingerprint=True, fingerprint_every=1, fingerprint_mode=mode)
    try:
        with torch.inference_mode():
            for step_ids in ids:
                model(step_ids)
    finally:
        tracer.stop()
    return trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["example", "llama-cpu", "llama-gpu", "all"], default="all",
                    help="all: example and llama-cpu (llama-gpu: the 8B shape on CUDA, fingerprints auto)")
    ap.add_argument("--trace", nargs="+", metavar="DIR", help="break down these trace folders instead")
    args = ap.parse_args()
    print(header_line("trace_bytes", header(sys.argv)))
    print(f"# rank-file format {schema.FORMAT_VERSION}, zlib {zlib.ZLIB_RUNTIME_VERSION}")
    if args.trace:
        for trace in args.trace:
            Breakdown(trace).print(trace)
        return
    if args.workload != "llama-gpu":  # on a CPU the Python table: the C++ one writes the same records
        os.environ["TENSOR_TRACE_NATIVE"] = "0"
    with tempfile.TemporaryDirectory(prefix="tt-bytes-") as out:
        if args.workload in ("example", "all"):
            Breakdown(record_example(out)).print("example, 2 CPU ranks, 8 steps")
        if args.workload in ("llama-cpu", "all"):
            for mode in ("deferred", "auto"):
                Breakdown(record_llama(out, mode)).print(f"llama-cpu, 35 steps, fingerprints {mode}")
        if args.workload == "llama-gpu":
            Breakdown(record_llama(out, "auto", "cuda")).print("llama-gpu (8B shape, bf16, batch 8), 35 steps, "
                                                               "fingerprints auto")


if __name__ == "__main__":
    main()
