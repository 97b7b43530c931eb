"""The Python API (tensor_trace.open / tensor_trace.trace): a block traced in this process, then
read back as plain Python objects with the keys of the CLI's --json."""

import json
import os

import pytest
import torch
from click.testing import CliRunner

import tensor_trace
from tensor_trace.api import Answer, Rows, Trace
from tensor_trace.cli import main
from tensor_trace.errors import BadInput, NoAnswer


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(3))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(torch.cat([x, x], dim=0))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("api") / "trace"
    torch.manual_seed(0)
    model = Model()
    with tensor_trace.trace(out_dir=str(out)) as rec:
        for _ in range(2):
            model(torch.randn(2, 8))
    assert rec.out_dir == str(out)
    return str(out)


def cli_json(*args):
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def as_json(obj):
    return json.loads(json.dumps(obj, default=str))


def test_trace_block_records_steps_and_stops(recorded):
    from tensor_trace import tracer

    assert tracer.current() is None  # the block stopped its tracer
    t = tensor_trace.open(recorded)
    steps = t.steps()
    assert isinstance(steps, Rows) and [s["step"] for s in steps] == [0, 1]
    assert {s["root"] for s in steps} == {""}


def test_points_match_query_placement_json(recorded):
    t = tensor_trace.open(recorded)
    pts = t.points("layers.1.*")
    assert isinstance(pts, Rows) and all(isinstance(p, dict) for p in pts)
    assert [p["point"] for p in pts] == ["layers.1.norm:output", "layers.1.up:output", "layers.1.down:output"]
    for p in pts:
        assert {"point", "module", "call", "placement", "reduction", "shapes", "dtype", "evidence"} <= set(p)
        assert p["shapes"] == {0: [2, 16] if p["module"].endswith("up") else [2, 8]}
    assert as_json(pts) == cli_json("query", "placement", "layers.1.*", "--trace", recorded)


def test_answers_match_the_cli(recorded):
    t = tensor_trace.open(recorded)
    red = t.reduction("head")
    assert isinstance(red, Answer) and red["point"] == "head:output"
    assert as_json(red) == cli_json("query", "reduction", "head", "--trace", recorded)
    lin = t.lineage("head:input.0")
    assert lin["op"] == "cat(dim=0)" and [s["point"] for s in lin["sources"]] == ["layers.2:output", "layers.2:output"]
    assert as_json(lin) == cli_json("query", "lineage", "head:input.0", "--trace", recorded)
    assert as_json(t.shapes("head")) == cli_json("query", "shapes", "head", "--trace", recorded)
    assert t.collectives() == [] == cli_json("query", "collectives", "--trace", recorded)
    assert as_json(t.check()) == cli_json("check", "--trace", recorded)


def test_sql_rows_keep_columns_and_values(recorded):
    t = tensor_trace.open(recorded)
    rows = t.sql("SELECT step, n_spans, step FROM steps ORDER BY step")
    assert rows.columns == ["step", "n_spans", "step"]
    assert [(step, again) for step, _, again in rows.values] == [(0, 0), (1, 1)]
    assert {n for _, n, _ in rows.values} == {14}  # root, 3 x (layer, norm, up, down), head
    assert [r["step"] for r in rows] == [0, 1]
    assert as_json(rows) == cli_json("query", "sql", "SELECT step, n_spans, step FROM steps ORDER BY step",
                                     "--trace", recorded)
    with pytest.raises(BadInput):
        t.sql("SELEC nothing")


def test_compare_with_itself_is_all_same(recorded):
    t = tensor_trace.open(recorded)
    res = t.compare(recorded)
    assert res["first_divergence"] is None
    assert res["points"] and {p["status"] for p in res["points"]} == {"same"}
    assert t.compare(Trace(recorded))["points"] == res["points"]


def test_unknown_point_and_folder(recorded, tmp_path):
    t = tensor_trace.open(recorded)
    with pytest.raises(NoAnswer, match="nearest"):
        t.reduction("layers.1.upp")
    with pytest.raises(BadInput, match="no such trace folder"):
        tensor_trace.open(str(tmp_path / "missing"))


def test_to_pandas_frames_rows_or_says_what_it_needs(recorded):
    t = tensor_trace.open(recorded)
    pts = t.points()
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install pandas"):
            pts.to_pandas()
        return
    frame = pts.to_pandas()
    assert list(frame["point"]) == [p["point"] for p in pts]
    assert list(t.lineage("head:input.0").to_pandas()["point"]) == ["layers.2:output", "layers.2:output"]


def test_a_second_tracer_in_the_process_is_refused(tmp_path):
    with tensor_trace.trace(out_dir=str(tmp_path / "a")):
        with pytest.raises(BadInput, match="already running"):
            with tensor_trace.trace(out_dir=str(tmp_path / "b")):
                pass


def test_a_folder_holding_a_run_is_refused_unless_replace(tmp_path):
    out = str(tmp_path / "t")
    model = Model()
    with tensor_trace.trace(out_dir=out):
        model(torch.randn(2, 8))
    with pytest.raises(BadInput, match="replace=True"):
        with tensor_trace.trace(out_dir=out):
            model(torch.randn(2, 8))
    with tensor_trace.trace(out_dir=out, replace=True):
        for _ in range(3):
            model(torch.randn(2, 8))
    # One run in the folder, the second block's: its three steps and nothing of the first.
    assert len(os.listdir(os.path.join(out, "ranks"))) == 1
    assert tensor_trace.open(out).sql("SELECT COUNT(*) AS n FROM steps")[0]["n"] == 3
