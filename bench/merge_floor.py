"""The floor under a merge in Python over SQLite, measured on the rank files being merged.

Three costs that no per-record Python can remove, each timed on its own on one rank file
(CPU time of this process): (1) decoding, the format layer's framing (``iter_chunks``) and
msgpack's unpacking of every chunk; (2) inserting, the file's module-span and collective rows
(values as the merge stores them, ids unmapped) into empty ``spans`` and ``collectives`` tables
of a new store with the merge's own multi-row statements (``tables.insert_rows``); (3) copying
those rows from that store into another that already holds rows, as the merging process copies a
worker's part (``merge_workers.copy_part``: spans with their layout ids shifted, collectives as
they are). Every record is decoded and inserted once; a worker's records are copied once more,
and with one worker per other core the workers load (cores - 1) / cores of the files
(``merge_workers.plan``). So (1) + (2) per span record, plus (3) times that share, times the
trace's records, over the cores, is the fastest a merge of this design can load it;
``merge_bench.py`` prints it beside the merge's own rate.

    OMP_NUM_THREADS=1 .venv/bin/python bench/merge_floor.py DIR/ranks/FILE.ttr
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def measure(rank_file: str) -> dict:
    """Decode and insert CPU seconds of one rank file, and its records."""
    import msgpack

    from tensor_trace import schema
    from tensor_trace.exporters.store import loader
    from tensor_trace.exporters.store.reader import ReadReport, iter_chunks
    from tensor_trace.exporters.store.tables import insert_rows, open_new_store

    t = time.process_time()
    chunks = [msgpack.unpackb(p, raw=False, strict_map_key=False)
              for p in iter_chunks(rank_file, ReadReport(rank_file))]
    decode_s = time.process_time() - t
    spans, colls = [], []
    for records in chunks:
        for rec in records:
            if rec[0] == schema.SPAN:
                spans.extend(rec)
            elif rec[0] == schema.COLLECTIVE:
                colls.extend([*rec[:16], None, 0])  # the loader's row (loader.COLLECTIVE_ROW)
    del chunks
    with tempfile.TemporaryDirectory(prefix="tt-floor-") as tmp:
        con = open_new_store(os.path.join(tmp, "floor.sqlite"))
        t = time.process_time()
        insert_rows(con, "INSERT INTO spans", loader.SPAN_COLUMNS, spans)
        spans_s = time.process_time() - t
        t = time.process_time()
        insert_rows(con, "INSERT OR IGNORE INTO collectives", loader.COLLECTIVE_VALUES, colls,
                    row=loader.COLLECTIVE_ROW)
        con.commit()
        colls_s = time.process_time() - t
        con.close()
        # A store already holding rows (another rank's, at a lower process id), then the copy.
        dst = open_new_store(os.path.join(tmp, "copy.sqlite"))
        insert_rows(dst, "INSERT INTO spans", loader.SPAN_COLUMNS, [-1] * loader.SPAN_COLUMNS)
        insert_rows(dst, "INSERT INTO collectives", loader.COLLECTIVE_COLUMNS, [-1] * loader.COLLECTIVE_COLUMNS)
        dst.commit()
        dst.execute("ATTACH DATABASE ? AS part", (os.path.join(tmp, "floor.sqlite"),))
        cols = [r[1] for r in dst.execute("PRAGMA main.table_info(spans)")]
        sel = ["(layout_id + 1)" if c == "layout_id" else c for c in cols]
        t = time.process_time()
        dst.execute(f"INSERT INTO main.spans({', '.join(cols)}) SELECT {', '.join(sel)} FROM part.spans "
                    "ORDER BY rowid")
        dst.execute("INSERT INTO main.collectives SELECT * FROM part.collectives")
        dst.commit()
        copy_s = time.process_time() - t
        dst.execute("DETACH DATABASE part")
        dst.close()
    n_spans, n_colls = len(spans) // loader.SPAN_COLUMNS, len(colls) // loader.COLLECTIVE_VALUES
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
