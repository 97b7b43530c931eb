"""What a framework learns about a step after it began (``Tracer.add_step_attrs``: SGLang's DP
padding, decided inside the forward that is the step) is written with the step's end and read
over the attributes the step began with, by the merge and by the rank-file reader alike."""

from __future__ import annotations

import json

import torch
import torch.nn as nn

from tensor_trace import tracer
from tensor_trace.exporters.pipeline import merge_ranks, open_store
from tensor_trace.exporters.store.reader import load_rank_file, rank_files


class Runner(nn.Module):
    def forward(self, x):
        return x * 2


def test_attrs_added_during_a_step_are_read_over_its_begin_attrs(tmp_path):
    runner = Runner()
    x = torch.randn(2, 4)
    tr = tracer.start(out_dir=str(tmp_path))
    try:
        tr.add_step_attrs(rows=99)  # outside a step: nothing

        def padded_forward():
            tr.add_step_attrs(rows=4, dp_rows=[4, 4])
            tr.add_step_attrs(tokens=3)  # a later call adds, and overrides what the step began with
            return runner(x)

        tr.run_external_step(runner, (x,), {"forward_mode": "decode", "tokens": 1}, padded_forward)  # step 0
        tr.run_external_step(runner, (x,), {"forward_mode": "decode", "tokens": 2}, lambda: runner(x))  # step 1
    finally:
        tracer.stop()
    want = {0: {"forward_mode": "decode", "tokens": 3, "rows": 4, "dp_rows": [4, 4]},
            1: {"forward_mode": "decode", "tokens": 2}}
    (path,) = rank_files(str(tmp_path))
    read = load_rank_file(path)
    assert {s: st.attrs for s, st in read.steps.items()} == want
    merge_ranks(str(tmp_path))
    con = open_store(str(tmp_path))
    merged = {s: json.loads(a) for s, a in con.execute("SELECT step, attrs FROM steps")}
    assert merged == want
