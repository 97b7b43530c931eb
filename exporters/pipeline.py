"""A trace folder's store, analysed: the merge (``store``) followed by the placement and
reduction verdicts (``analysis``). Queries and output formats open a trace through here."""

from __future__ import annotations

import os
import sqlite3

from tensor_trace.errors import BadInput
from tensor_trace.exporters import analysis
from tensor_trace.exporters.store import merge
from tensor_trace.exporters.store.merge import is_stale, store_path

__all__ = ["merge_ranks", "open_store", "store_path"]


def merge_ranks(trace_dir: str, warn=None, workers: int | None = None) -> dict:
    """Merge every rank file of ``trace_dir`` into ``trace_dir/merged.sqlite`` and compute the
    verdicts of every point; return the merge's report (``store.merge.merge_ranks``)."""
    return merge.merge_ranks(trace_dir, warn=warn, workers=workers, analyse=_analyse)


def _analyse(con) -> dict:
    # The verdicts are kept in the store: it says which analysis made them, so that a store
    # judged by another version of the rules is judged again rather than read as is.
    con.execute("INSERT INTO meta VALUES ('analysis_version', ?)", (analysis.version(),))
    return analysis.compute_verdicts(con)


def open_store(trace_dir: str, warn=None) -> sqlite3.Connection:
    """Open a trace folder's store (read only), merging first when it is missing or stale."""
    if not os.path.isdir(trace_dir):
        raise BadInput(f"{trace_dir}: no such trace folder")
    if is_stale(trace_dir, {"analysis_version": analysis.version()}):
        merge_ranks(trace_dir, warn=warn)
    return sqlite3.connect(f"file:{store_path(trace_dir)}?mode=ro", uri=True)
