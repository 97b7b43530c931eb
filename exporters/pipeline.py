"""A trace folder's store, analysed: the merge (``store``) followed by the placement and
reduction verdicts (``analysis``). Queries and output formats open a trace through here."""

from __future__ import annotations

import os
import sqlite3
import sys

from tensor_trace.errors import BadInput
from tensor_trace.exporters import analysis
from tensor_trace.exporters.store import merge
from tensor_trace.exporters.store.merge import is_stale, store_path
from tensor_trace.exporters.store.reader import rank_files

__all__ = ["merge_ranks", "open_store", "store_path"]


def merge_ranks(trace_dir: str, warn=None, workers: int | None = None) -> dict:
    """Merge every rank file of ``trace_dir`` into ``trace_dir/merged.sqlite`` and compute the
    verdicts of every point; return the merge's report (``store.merge.merge_ranks``)."""
    return merge.merge_ranks(trace_dir, warn=warn, workers=workers, analyse=_analyse)


def _analyse(con) -> dict:
    # The verdicts are kept in the store: it says which analysis made them, so that a store
    # judged by another version of the rules is judged again rather than read as is. Written
    # after them: the merge builds an index beside the analysis (merge._index_beside), and the
    # analysis' first write waits for it to finish; written first, the verdicts waited too.
    points = analysis.compute_verdicts(con)
    con.execute("INSERT INTO meta VALUES ('analysis_version', ?)", (analysis.version(),))
    return points


def open_store(trace_dir: str, warn=None) -> sqlite3.Connection:
    """Open a trace folder's store (read only), merging first when it is missing or stale."""
    if not os.path.isdir(trace_dir):
        raise BadInput(f"{trace_dir}: no such trace folder")
    if is_stale(trace_dir, {"analysis_version": analysis.version()}):
        if not is_stale(trace_dir) and not rank_files(trace_dir):
            # Judged by another analysis, but nothing to judge it again from (a store kept or
            # shipped without its rank files): its verdicts as they are, said so, rather than
            # no store at all (what such a store read as before the version was kept).
            (warn or (lambda msg: sys.stderr.write(f"tensor-trace: warning: {msg}\n")))(
                f"{store_path(trace_dir)}: judged by another version of the analysis, and no rank "
                "files to merge again: its verdicts are read as they are")
        else:
            merge_ranks(trace_dir, warn=warn)
    return sqlite3.connect(f"file:{store_path(trace_dir)}?mode=ro", uri=True)
