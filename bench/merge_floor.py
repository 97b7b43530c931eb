"""The floor under a merge in Python over SQLite, measured on the rank files being merged.

Three costs that no per-record Python can remove, each timed on its own on one rank file
(CPU time of this process): (1) decoding, the format layer's framing (``iter_chunks``) and
msgpack's unpacking of every chunk; (2) inserting, the file's module-span and collective rows
(values as the merge stores them, ids unmapped) into empty ``spans`` and ``collectives`` tables
of a new store with the merge's own multi-row statements (``tables.insert_rows``); (3) copying
those rows from that store into another that already holds rows, as the merging process copies a
worker's part whose ids need no mapping (``merge_workers.copy_part``: records as stored, the
workers' layout-id guess right). Decoding and inserting stream as the merge does (one chunk at a
time, rows in the loader's batches). Every record is decoded and inserted once; a worker's records are copied once more,
and with one worker per other core the workers load (cores - 1) / cores of the files
(``merge_workers.plan``). So (1) + (2) per span record, plus (3) times that share, times the
trace's records, over the cores, is the fastest a merge of this design can load it;
``merge_bench.py`` prints it beside the merge's own rate. It leaves out what follows the loading
(indexes, clocks, verdicts: on the merge's serial tail, about 3 s at 20M span records).

    OMP_NUM_THREADS=1 .venv/bin/python bench/merge_floor.py DIR/ranks/FILE.ttr
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def measure(rank_file: str) -> dict:
    """Decode, insert and copy CPU seconds of one rank file, and its records. Streamed as the
    merge streams (one chunk decoded at a time, rows inserted in batches of the loader's size and
    dropped): memory and allocator costs as in the merge, whatever the file's size. Building
    the rows is not timed (it is the per-record Python a merge of this design adds)."""
    import msgpack

    from tensor_trace import schema
    from tensor_trace.exporters.store import loader
    from tensor_trace.exporters.store.reader import ReadReport, iter_chunks
    from tensor_trace.exporters.store.tables import insert_rows, open_new_store

    unpackb, clock = msgpack.unpackb, time.process_time
    decode_s = spans_s = colls_s = 0.0
    n_spans = n_colls = 0
    with tempfile.TemporaryDirectory(prefix="tt-floor-") as tmp:
        con = open_new_store(os.path.join(tmp, "floor.sqlite"))
        spans, colls = [], []

        def insert(last):
            nonlocal spans_s, colls_s
            t = clock()
            n = insert_rows(con, "INSERT INTO spans", loader.SPAN_COLUMNS, spans, last)
            del spans[:n * loader.SPAN_COLUMNS]
            t1 = clock()
            n = insert_rows(con, "INSERT OR IGNORE INTO collectives", loader.COLLECTIVE_VALUES, colls, last,
                            row=loader.COLLECTIVE_ROW)
            del colls[:n * loader.COLLECTIVE_VALUES]
            spans_s, colls_s = spans_s + (t1 - t), colls_s + (clock() - t1)

        chunks = iter_chunks(rank_file, ReadReport(rank_file))
        while True:
            t = clock()
            payload = next(chunks, None)  # framing, CRC and inflating
            if payload is None:
                decode_s += clock() - t
                break
            records = unpackb(payload, raw=False, strict_map_key=False)
            decode_s += clock() - t
            for rec in records:
                if rec[0] == schema.SPAN:
                    spans.extend(rec)
                    n_spans += 1
                elif rec[0] == schema.COLLECTIVE:
                    colls.extend([*rec[:16], None, 0])  # the loader's row (loader.COLLECTIVE_ROW)
                    n_colls += 1
            if len(spans) // loader.SPAN_COLUMNS + len(colls) // loader.COLLECTIVE_VALUES >= loader.BATCH:
                insert(False)
        insert(True)
        t = clock()
        con.commit()
        colls_s += clock() - t
        con.close()
        # A store already holding rows (another rank's, at a lower process id), then the copy as
        # the merging process copies a worker's part whose ids need no mapping (copy_part: the
        # records as stored).
        dst = open_new_store(os.path.join(tmp, "copy.sqlite"))
        insert_rows(dst, "INSERT INTO spans", loader.SPAN_COLUMNS, [-1] * loader.SPAN_COLUMNS)
        insert_rows(dst, "INSERT INTO collectives", loader.COLLECTIVE_COLUMNS, [-1] * loader.COLLECTIVE_COLUMNS)
        dst.commit()
        dst.execute("ATTACH DATABASE ? AS part", (os.path.join(tmp, "floor.sqlite"),))
        t = clock()
        dst.execute("INSERT INTO main.spans SELECT * FROM part.spans")
        dst.execute("INSERT INTO main.collectives SELECT * FROM part.collectives")
        dst.commit()
        copy_s = clock() - t
        dst.execute("DETACH DATABASE part")
        dst.close()
    return dict(file=rank_file, span_records=n_spans + n_colls, spans=n_spans, collectives=n_colls,
                decode_s=decode_s, insert_spans_s=spans_s, insert_collectives_s=colls_s, copy_s=copy_s,
                us_per_span_record=(decode_s + spans_s + colls_s) / max(1, n_spans + n_colls) * 1e6,
                copy_us_per_span_record=copy_s / max(1, n_spans + n_colls) * 1e6)


def floor_rate(m: dict, cores: int) -> float:
    """Span records per second that decoding, inserting and copying the workers' share alone
    allow on ``cores`` cores (one process per core)."""
    copied = (cores - 1) / cores if cores > 1 else 0.0
    return cores * 1e6 / (m["us_per_span_record"] + copied * m.get("copy_us_per_span_record", 0.0))


if __name__ == "__main__":
    res = measure(sys.argv[1])
    res["floor_rate_2_cores"] = floor_rate(res, 2)
    res["floor_rate_1_core"] = floor_rate(res, 1)
    print(json.dumps(res, indent=1))
