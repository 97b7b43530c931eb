"""docs/store-schema.md lists every table, view and column of a merged store."""

import os
import re
import sqlite3

import torch
import torch.nn as nn

from tensor_trace import tracer
from tensor_trace.exporters.pipeline import merge_ranks, store_path

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "store-schema.md")


def _doc_rows() -> dict:
    """table -> the text of its row in the doc's table of tables (the first table of the page)."""
    with open(DOC) as f:
        tables = f.read().split("\n## ")[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \|(.*)$", tables, re.M)}


def test_the_doc_lists_every_table_view_and_column_of_a_merged_store(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    tracer.start(out_dir=str(tmp_path))
    net(torch.randn(2, 4))
    tracer.stop()
    merge_ranks(str(tmp_path), warn=lambda msg: None)
    con = sqlite3.connect(store_path(str(tmp_path)))
    tables = sorted(n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'"))
    views = sorted(n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type='view'"))
    rows = _doc_rows()
    assert sorted(rows) == tables
    with open(DOC) as f:
        text = f.read()
    assert views == ["collective_view", "span_view"] and all(f"`{v}`" in text for v in views)
    for table in tables:
        columns = [r[1] for r in con.execute(f"PRAGMA table_info({table})")]
        missing = [c for c in columns if f"`{c}`" not in rows[table]]
        assert not missing, (table, missing)
    con.close()
