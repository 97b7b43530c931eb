"""The report's parts that need no browser: layers and point kinds from any model's names, the
page's data from a trace traced in this process, and progress lines."""

import io
import json
import re

import pytest
import torch

import tensor_trace
from tensor_trace import progress
from tensor_trace.exporters.formats import layer_map, report


@pytest.mark.parametrize("name,layer,kind", [
    ("model.layers.3.self_attn.qkv_proj:output.0", ("model.layers", 3), "self_attn.qkv_proj:output.0"),  # SGLang
    ("model.layers.12.self_attn.q_proj:output", ("model.layers", 12), "self_attn.q_proj:output"),  # HF
    ("layers.7.attention.wq:output", ("layers", 7), "attention.wq:output"),  # torchtitan
    ("transformer.h.0.mlp.c_fc:output", ("transformer.h", 0), "mlp.c_fc:output"),  # GPT-2
    ("model.layers.1.mlp.experts.SiluAndMul#0:output", ("model.layers", 1), "mlp.experts.SiluAndMul#0:output"),
    ("model.layers.0:output", ("model.layers", 0), ":output"),
    ("model.layers.0#1:output", ("model.layers", 0), "#1:output"),
    ("model.embed_tokens:output", None, "model.embed_tokens:output"),
    ("capture:eagle3.aux.0", None, "capture:eagle3.aux.0"),
    ("model.layers10.x:output", None, "model.layers10.x:output"),
])
def test_layer_of_any_naming(name, layer, kind):
    key, rest = layer_map.layer_of(name)
    assert (tuple(key) if key else None, rest) == (layer, kind)


def test_stacks_order_columns_by_first_execution_across_layers():
    names = ["embed:output",
             "model.layers.0.norm:output", "model.layers.0.mlp:output", "model.layers.0:output",
             "model.layers.1.norm:output", "model.layers.1.gate:output", "model.layers.1.mlp:output",
             "model.layers.1:output", "draft.layers.0.fc:output", "head:output"]
    stacks, where, outside = layer_map.stacks(names)
    assert [(s.path, s.indices) for s in stacks] == [("model.layers", [0, 1]), ("draft.layers", [0])]
    # layer 1's router (gate) runs between the norm and the MLP: its column goes there
    assert stacks[0].columns == ["norm:output", "gate:output", "mlp:output", ":output"]
    assert where["model.layers.1.gate:output"] == ("model.layers", 1, "gate:output")
    assert outside == ["embed:output", "head:output"]
    assert layer_map.column_label(":output") == "layer:output"


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_on_a_terminal_only():
    tty, pipe = _Tty(), io.StringIO()
    for stream in (tty, pipe):
        with progress.task("merge: rank files", total=4, stream=stream) as bar:
            for _ in range(4):
                bar.advance()
    assert pipe.getvalue() == ""
    text = tty.getvalue()
    assert "merge: rank files: 0/4 (0%)" in text and "4/4 (100%)" in text
    assert text.endswith("\r")  # the line is erased at the end: the command's own output follows cleanly
    progress.set_quiet(True)
    try:
        quiet = _Tty()
        with progress.task("x", stream=quiet) as bar:
            bar.advance()
        assert quiet.getvalue() == ""
    finally:
        progress.set_quiet(False)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + self.proj(self.norm(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.layers = torch.nn.ModuleList(Block() for _ in range(4))

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.layers:
            x = b(x)
        return x


def test_report_page_of_a_traced_block(tmp_path):
    torch.manual_seed(0)
    net = Net()
    with tensor_trace.trace(out_dir=str(tmp_path / "t")) as rec:
        net(torch.tensor([[1, 2, 3]]))
    t = rec.open()
    out = tmp_path / "r.html"
    res = t.report(str(out))
    assert res["path"] == str(out) and res["layers"] == 4 and res["bytes"] == out.stat().st_size
    page = out.read_text()
    literal = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', page, re.S).group(1)
    data = json.loads(literal)
    assert data["stacks"] == [dict(path="layers", layers=[0, 1, 2, 3],
                                   columns=["norm:output", "proj:output", "layer:output"])]
    cell = next(p for p in data["points"] if p["point"] == "layers.2.proj:output")
    assert (cell["stack"], cell["layer"], cell["column"]) == ("layers", 2, 1)
    assert cell["placement"] == t.reduction("layers.2.proj")["placement"]
    assert {p["point"] for p in data["points"] if p["stack"] is None} == {"embed:output", ":output"}
    assert data["facts"]["steps"] == 1 and data["compare"] is None
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", page)  # nothing to fetch


def test_script_data_cannot_close_the_script_element():
    data = dict(title="</script><script>alert(1)</script>", stacks=[], points=[], facts={})
    page = report.render(data)
    assert "</script><script>alert" not in page
    literal = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', page, re.S).group(1)
    assert json.loads(literal)["title"] == data["title"]
