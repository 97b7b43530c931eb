"""Merge and query on real traced runs of the example (torchrun, gloo, CPU)."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tensor_trace.cli import main
from tt_helpers import SMALL_MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.dirname(sys.executable)
HEADS, KV, HEAD_DIM, FFN, VOCAB, HIDDEN = 6, 6, 16, 192, 384, 96


def record(out, tp, *extra, layers=2, steps=3):
    cmd = [os.path.join(VENV_BIN, "tensor-trace"), "record", "-o", str(out), "--",
           os.path.join(VENV_BIN, "torchrun"), "--standalone", "--nproc-per-node", str(tp),
           os.path.join(ROOT, "examples", "tp_llama.py"), "--layers", str(layers), "--steps", str(steps), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module", params=[2, 3])
def trace(request, example_traces, tmp_path_factory):
    return example_traces.copy(request.param, tmp_path_factory.mktemp(f"tp{request.param}") / "t"), request.param


@pytest.fixture(scope="module")
def deferred(tmp_path_factory):
    return record(tmp_path_factory.mktemp("deferred") / "t", 2, "--deferred-reduction")


def q(*args, code=0):
    r = CliRunner().invoke(main, ["query", *map(str, args)])
    assert r.exit_code == code, (r.output, r.exception)
    return r.output


def qj(*args):
    return json.loads(q(*args, "--json"))


def by_point(rows):
    return {r["point"]: r for r in rows}


def test_embedding_is_post_reduction_and_names_the_all_reduce(trace):
    d, tp = trace
    r = qj("reduction", "model.embed_tokens", "--trace", d)
    assert r["point"] == "model.embed_tokens:output"
    assert r["verdict"] == "post-reduction" and r["placement"] == "replicate"
    c = r["collective"]
    assert c["op"] == "all_reduce" and c["reduce_op"] == "sum" and c["module"] == "model.embed_tokens"
    assert c["group_ranks"] == list(range(tp)) and c["shape"] == [2, 8, HIDDEN] and c["bytes"] == 2 * 8 * HIDDEN * 4
    assert any("all_reduce" in e for e in r["evidence"])
    text = q("reduction", "model.embed_tokens", "--trace", d)
    assert "post-reduction" in text and "all_reduce(sum)" in text


def test_placements_of_a_layer(trace):
    d, tp = trace
    pts = by_point(qj("placement", "model.layers.*", "--trace", d))
    for layer in (0, 1):
        p = f"model.layers.{layer}"
        for name in (f"{p}.self_attn.o_proj:output", f"{p}.mlp.down_proj:output"):
            assert (pts[name]["placement"], pts[name]["reduction"]) == ("replicate", "post-reduction"), name
            assert pts[name]["collective"]["module"] == name.split(":")[0]
        for name, width in ((f"{p}.self_attn.qkv_proj:output", (HEADS + 2 * KV) * HEAD_DIM // tp),
                            (f"{p}.mlp.gate_up_proj:output", 2 * FFN // tp)):
            assert pts[name]["placement"] == "shard(2)", pts[name]
            assert pts[name]["shapes"] == {str(r): [2, 8, width] for r in range(tp)} or \
                pts[name]["shapes"] == {r: [2, 8, width] for r in range(tp)}
    # Final logits after the all_gather are replicate; the lm_head slice before it is a shard.
    all_pts = by_point(qj("placement", "*:*", "--trace", d))
    assert all_pts[":output.0"]["placement"] == "replicate"
    assert all_pts["lm_head:output"]["placement"] == "shard(2)"
    assert all_pts["lm_head:output"]["collective"]["op"] == "all_gather"
    table = q("placement", "model.layers.0.*", "--trace", d)
    assert "model.layers.0.self_attn.qkv_proj:output" in table and "shard(2)" in table
    assert table.splitlines()[0].split()[:3] == ["point", "placement", "reduction"]


def test_row_parallel_output_before_its_reduction_is_partial(deferred):
    pts = by_point(qj("placement", "model.layers.0.*", "--trace", deferred))
    for name in ("model.layers.0.self_attn.o_proj:output", "model.layers.0.mlp.down_proj:output"):
        assert (pts[name]["placement"], pts[name]["reduction"]) == ("partial", "pre-reduction")
        assert pts[name]["collective"]["op"] == "all_reduce"
        assert pts[name]["collective"]["module"] == "model.layers.0"
    r = qj("reduction", "model.layers.0.mlp.down_proj", "--trace", deferred)
    assert r["verdict"] == "pre-reduction" and r["collective"]["module"] == "model.layers.0"


def test_collectives_per_module(trace):
    d, tp = trace
    rows = qj("collectives", "--trace", d)
    got = {(r["module"], r["op"]): r for r in rows}
    expect = ["model.embed_tokens"] + [f"model.layers.{i}.{m}" for i in (0, 1)
                                       for m in ("self_attn.o_proj", "mlp.down_proj")]
    for m in expect:
        r = got[(m, "all_reduce")]
        assert r["per_step"] == {0: 1, 1: 1, 2: 1} or r["per_step"] == {"0": 1, "1": 1, "2": 1}
        assert r["count"] == 3 and r["group_ranks"] == list(range(tp)) and r["ranks"] == tp
        assert r["bytes"] == 3 * 2 * 8 * HIDDEN * 4 and r["time_ms"] >= 0
    assert got[("", "all_gather")]["count"] == 3
    assert len(rows) == len(expect) + 1
    table = q("collectives", "model.layers.0.*", "--trace", d)
    assert "model.layers.0.mlp.down_proj" in table and "model.embed_tokens" not in table


def test_shapes(trace):
    d, tp = trace
    rows = qj("shapes", "model.layers.1.self_attn.qkv_proj", "--trace", d)
    assert len(rows) == 1 and rows[0]["steps"] == 3 and rows[0]["dtype"] == "float32"
    assert list(rows[0]["shapes"].values()) == [[2, 8, (HEADS + 2 * KV) * HEAD_DIM // tp]] * tp
    assert "qkv_proj:output" in q("shapes", "model.layers.1.self_attn.qkv_proj", "--trace", d)


def test_unknown_point_gives_nearest_names(trace):
    d, _ = trace
    out = CliRunner().invoke(main, ["query", "reduction", "model.embed_token", "--trace", str(d)])
    assert out.exit_code == 1
    assert "model.embed_tokens" in out.output and "Traceback" not in out.output


def test_sql_and_merge_twice_is_identical(trace):
    d, tp = trace
    rows = qj("sql", "SELECT rank, COUNT(*) AS n FROM collective_view WHERE op='all_reduce' GROUP BY rank",
              "--trace", d)
    assert [r["rank"] for r in rows] == list(range(tp)) and all(r["n"] == 3 * 5 for r in rows)

    def dump():
        import sqlite3

        con = sqlite3.connect(os.path.join(d, "merged.sqlite"))
        return [list(con.execute(f"SELECT * FROM {t} ORDER BY 1, 2")) for t in
                ("spans", "collectives", "points", "processes", "layouts")]

    r = CliRunner().invoke(main, ["merge", str(d)])
    assert r.exit_code == 0, r.output
    first = dump()
    CliRunner().invoke(main, ["merge", str(d)])
    assert dump() == first


def test_diff_names_the_aux_capture_difference(example_traces, tmp_path):
    a = example_traces.copy(2, tmp_path / "a", (*SMALL_MODEL, "--steps", "2"))  # test_compare_example.py's tp2
    b = record(tmp_path / "b", 2, "--aux-layer-ids=-1,0", steps=2)
    d = json.loads(q("diff", a, b, "--json"))
    changed = {c["point"]: c for c in d["changed"]}
    assert "draft:input.0.0" in changed and "draft.fc:input.0" in changed
    # The embedding's output (post-reduction) replaced layer 0's residual sum (no-reduction):
    # the verdict changed, which diff reports before (and instead of) the values.
    fields = {f["field"]: f for f in changed["draft:input.0.0"]["fields"]}
    assert (fields["reduction"]["a"], fields["reduction"]["b"]) == ("no-reduction", "post-reduction")
    # Nothing upstream of the capture changed.
    assert not any(p.startswith("model.layers.0.self_attn") for p in changed)
    c = record(tmp_path / "c", 2, "--aux-layer-ids=-1,0,1", steps=2)
    d2 = json.loads(q("diff", a, c, "--json"))
    assert any(x["point"] == "draft:input.0.2" for x in d2["added"])
    fc = {x["point"]: x for x in d2["changed"]}["draft.fc:input.0"]["fields"][0]
    assert fc["field"] == "shapes"
    assert "draft.fc:input.0" in q("diff", a, c)


def test_step_option_and_staleness(trace):
    d, tp = trace
    rows = by_point(qj("placement", "model.layers.0.*", "--trace", d, "--step", 1))
    p = rows["model.layers.0.self_attn.qkv_proj:output"]
    assert p["placement"] == "shard(2)" and "step 1" in p["evidence"]
    out = CliRunner().invoke(main, ["query", "placement", "--trace", str(d), "--step", "99"])
    assert out.exit_code == 1 and "not traced" in out.output
    # A rank file newer than the store makes it stale: the next query merges again.
    from tensor_trace.exporters.store.merge import is_stale, store_path

    assert not is_stale(str(d))
    t = os.path.getmtime(store_path(str(d))) - 60
    os.utime(store_path(str(d)), (t, t))
    assert is_stale(str(d))
    qj("shapes", "model.embed_tokens", "--trace", d)
    assert not is_stale(str(d))


def test_a_store_judged_by_another_analysis_is_judged_again(trace):
    """Verdicts are kept in the store: one made by another version of the rules (an upgrade, a
    fix) must not be read as this version's answer."""
    import sqlite3

    from tensor_trace.exporters import analysis
    from tensor_trace.exporters.store.merge import store_path

    d, tp = trace
    qj("shapes", "model.embed_tokens", "--trace", d)  # merged (if it was not) by this analysis
    path = store_path(str(d))
    mtime = os.path.getmtime(path)
    con = sqlite3.connect(path)
    assert con.execute("SELECT value FROM meta WHERE key='analysis_version'").fetchone() == (analysis.version(),)
    con.execute("UPDATE meta SET value='older-rules' WHERE key='analysis_version'")
    con.execute("UPDATE points SET placement='divergent'")  # what the older rules said
    con.commit()
    con.close()
    os.utime(path, (mtime, mtime))  # newer than every rank file still
    rows = by_point(qj("placement", "model.layers.0.*", "--trace", d))
    assert rows["model.layers.0.self_attn.qkv_proj:output"]["placement"] == "shard(2)"
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    assert con.execute("SELECT value FROM meta WHERE key='analysis_version'").fetchone() == (analysis.version(),)
    con.close()


def test_sql_table(trace):
    d, tp = trace
    text = q("sql", "SELECT rank, world_size FROM processes ORDER BY rank", "--trace", d)
    lines = text.splitlines()
    assert lines[0].split() == ["rank", "world_size"] and set(lines[1]) <= {"-", " "}
    assert [ln.split() for ln in lines[2:]] == [[str(r), str(tp)] for r in range(tp)]
    bad = CliRunner().invoke(main, ["query", "sql", "SELECT nope FROM nowhere", "--trace", str(d)])
    assert bad.exit_code == 2 and "SQL error" in bad.output
