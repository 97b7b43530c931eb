"""Values that are each rank's own by design, and norms over a hidden dim split across ranks.
The cases from held-out hand-written TP programs (not written here, in the style of vLLM's and
Megatron's internals):

- a norm over a hidden dim split across ranks (vLLM's Mamba2 gated RMSNorm, MiniMax's RMSNormTP):
  its 1-D weight is each rank's slice, applied element by element, and where the norm all-reduces
  each row's sum of squares itself, that statistic did not make its output: shard, not
  ``partial`` (the weight read as a contracted matmul weight) nor ``divergent``;
- a vocab-parallel sampler's per-rank max over its vocab slice, combined by an all_reduce of max:
  no slice of anything (it was called shard(0), "another rank of tensor: dim 0 assumed"), and
  per-rank by design, so ``check`` does not call it a problem; nor a buffer only the source of
  a broadcast filled;
- the output of a ``reduce`` of a sum on its destination (the others return None): post-reduction
  there;
- a ``gather``, whose destination alone holds the list of outputs: not a collective mismatch.
"""

import json

import numpy as np
from click.testing import CliRunner

from synthetic_trace import SyntheticTrace, arrays, check, gen, items, point, pos, same
from tensor_trace.cli import main as cli_main

R = [0, 1]


def _findings(trace) -> list:
    r = CliRunner().invoke(cli_main, ["check", "--trace", str(trace), "--json"])
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.output)


def _sharded_norm(tmp_path, stats_in_call: bool):
    """x is shard(2) of a [2, 3, 8] hidden; the norm's weight is each rank's slice of a [8] one."""
    rng = gen(61)
    x = rng.standard_normal((2, 3, 8))
    w = pos(rng, 8)
    xs = {r: x[..., 4 * r:4 * (r + 1)] for r in R}
    tr = SyntheticTrace(2, root="run")
    tr.param("norm", "weight", arrays({r: w[4 * r:4 * (r + 1)] for r in R}))
    with tr.step():
        with tr.call("run", same(x, R)) as root:
            with tr.call("split", same(x, R)) as c:
                c.returns(arrays(xs))
            with tr.call("norm", arrays(xs)) as c:
                ss = (x * x).sum(-1, keepdims=True)
                if stats_in_call:
                    local = {r: (xs[r] * xs[r]).sum(-1, keepdims=True) for r in R}
                    tr.coll("all_reduce", [arrays(local)], [same(ss, R)])
                out = {r: xs[r] / np.sqrt(ss / 8) * w[4 * r:4 * (r + 1)] for r in R}
                c.returns(arrays(out))
            root.returns(same(x, R))
    return tr.merge(tmp_path)


def test_a_norm_whose_weight_is_a_slice_of_a_sharded_hidden_dim_gives_a_shard(tmp_path):
    p = point(_sharded_norm(tmp_path, stats_in_call=False), "norm:output")
    check(p, "shard(2)", "no-reduction", "sharded-weight")
    assert any("applies element by element" in i["text"] for i in items(p, "dataflow")), p["evidence"]


def test_a_norm_that_all_reduces_its_statistic_itself_is_still_placed_by_its_weight(tmp_path):
    p = point(_sharded_norm(tmp_path, stats_in_call=True), "norm:output")
    check(p, "shard(2)", "no-reduction", "sharded-weight")
    assert any("a statistic it used, not these values" in i["text"] for i in items(p, "dataflow")), p["evidence"]
    assert not [f for f in _findings(tmp_path) if f["point"] == "norm:output"]


def test_a_row_parallel_output_reduced_inside_its_call_is_no_statistic(tmp_path):
    """The collective of a row-parallel layer moves as many elements as its output: it made it."""
    rng = gen(62)
    x = pos(rng, 2, 8)
    W = pos(rng, 6, 8)
    xs = {r: x[:, 4 * r:4 * (r + 1)] for r in R}
    part = {r: xs[r] @ W[:, 4 * r:4 * (r + 1)].T for r in R}
    tr = SyntheticTrace(2, root="run")
    tr.param("down", "weight", arrays({r: W[:, 4 * r:4 * (r + 1)] for r in R}))
    with tr.step():
        with tr.call("run", same(x, R)) as root:
            with tr.call("split", same(x, R)) as c:
                c.returns(arrays(xs))
            with tr.call("down", arrays(xs)) as c:
                tr.coll("all_reduce", [arrays(part)], [same(part[0] + part[1], R)])
                c.returns(same(part[0] + part[1] + 1.0, R))  # a bias added after the reduction
            root.returns(same(part[0] + part[1] + 1.0, R))
    p = point(tr.merge(tmp_path), "down:output")
    assert p["placement"] == "replicate" and p["rule"] != "sharded-weight", p
    assert not any("a statistic" in e for e in p["evidence"]), p["evidence"]


def _sampler(tmp_path):
    rng = gen(63)
    logits = rng.standard_normal((1, 12))
    parts = {r: logits[:, 6 * r:6 * (r + 1)] for r in R}
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("run", same(logits, R)) as root:
            with tr.call("split", same(logits, R)) as c:
                c.returns(arrays(parts))
            with tr.call("sampler", arrays(parts)) as s:
                with tr.call("sampler.local", arrays(parts)) as c:
                    c.returns(arrays({r: parts[r].max(-1) for r in R}),
                              arrays({r: parts[r].argmax(-1) + 6 * r for r in R}, "int64"))
                tr.coll("all_reduce", [arrays({r: parts[r].max(-1) for r in R})], [same(logits.max(-1), R)],
                        reduce_op="max")
                s.returns(same(logits.max(-1), R))
            root.returns(same(logits.max(-1), R))
    return tr.merge(tmp_path)


def test_each_ranks_max_over_its_vocab_slice_is_no_shard_and_no_finding(tmp_path):
    con = _sampler(tmp_path)
    p = point(con, "sampler.local:output.0")
    check(p, "divergent", "no-reduction", "divergent")
    assert p["collective"]["op"] == "all_reduce" and p["collective"]["reduce_op"] == "max", p
    assert any("each rank reduced its own slice" in e for e in p["evidence"]), p["evidence"]
    # the argmax beside it, which no collective takes as it is (the winner's id is masked first)
    check(point(con, "sampler.local:output.1"), "divergent", "no-reduction", "reduced-own-slice")
    assert not [f for f in _findings(tmp_path) if f["point"].startswith("sampler.local:")]


def test_a_buffer_only_the_source_filled_before_its_broadcast_is_no_finding(tmp_path):
    rng = gen(64)
    ids = pos(rng, 2, 5)
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        bufs = arrays({0: ids, 1: np.zeros_like(ids)})
        with tr.call("run", bufs) as root:
            with tr.call("bcast", bufs) as c:
                tr.coll("broadcast", [bufs], [same(ids, R)])
                c.returns(same(ids, R))
            root.returns(same(ids, R))
    con = tr.merge(tmp_path)
    p = point(con, "bcast:input.0")
    check(p, "divergent", "no-reduction", "divergent")
    assert p["collective"]["op"] == "broadcast", p
    assert not [f for f in _findings(tmp_path) if f["kind"] == "divergent"]
    out = point(con, "bcast:output")
    check(out, "replicate", "no-reduction", "broadcast-output")
    assert out["collective"]["op"] == "broadcast", out


def test_a_reduce_of_a_sum_delivered_to_one_rank_is_post_reduction_there(tmp_path):
    rng = gen(65)
    parts = {r: pos(rng, 2, 3) for r in R}
    total = parts[0] + parts[1]
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("run", same(total, R)) as root:
            with tr.call("head", same(total, R)) as c:
                with tr.call("head.linear", same(total, R)) as lin:
                    lin.returns(arrays(parts))
                tr.coll("reduce", [arrays(parts)], [arrays({0: total, 1: parts[1]})])
                c.returns(arrays({0: total}))
            with tr.call("score", same(total, R)) as c:
                with tr.call("score.linear", same(total, R)) as lin:
                    lin.returns(arrays(parts))
                tr.coll("reduce", [arrays(parts)], [arrays({0: total, 1: parts[1]})])
                c.returns(arrays({0: total, 1: parts[1]}))  # the buffer on every rank
            root.returns(arrays({0: total}))
    con = tr.merge(tmp_path)
    p = point(con, "head:output")
    check(p, "unknown", "post-reduction", "reduce-destination")
    assert p["collective"]["op"] == "reduce", p
    check(point(con, "run:output"), "unknown", "post-reduction", "reduce-destination")
    assert not [f for f in _findings(tmp_path) if f["kind"] == "divergent"]


def test_a_gather_is_no_collective_mismatch(tmp_path):
    rng = gen(66)
    parts = {r: pos(rng, 2, 3) for r in R}
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("run", arrays(parts)) as root:
            tr.coll("gather", [arrays(parts)], [arrays({0: parts[0]}), arrays({0: parts[1]})])
            root.returns(arrays({0: np.concatenate([parts[0], parts[1]], -1)}))
    tr.merge(tmp_path)
    assert not [f for f in _findings(tmp_path) if f["kind"].startswith("collective")]


def test_a_collective_that_raised_where_a_peer_never_issued_it_is_a_finding(tmp_path):
    """A held-out SGLang Phi server at TP 2 (not written here): rank 1 crashed in its model's
    own code; rank 0's next all_reduce raised. Alignment leaves a rank whose trace stops early
    out (a killed rank), so check said nothing."""
    from tensor_trace import schema

    rng = gen(67)
    x = pos(rng, 2, 3)
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("run", same(x, R)) as root:
            with tr.call("embed", same(x, R)) as c:
                tr.coll("all_reduce", [same(x / 2, R)], [same(x, R)])
                c.returns(same(x, R))
            with tr.call("layers.0.dense", same(x, R)) as c:
                tr.coll("all_reduce", [same(x / 2, R)], [same(x, R)], flags={0: schema.FLAG_ERROR, 1: None})
                c.returns(same(x, R))
            root.returns(same(x, R))
    tr.merge(tmp_path)
    (f,) = [f for f in _findings(tmp_path) if f["kind"] == "collective-error"]
    assert f["point"] == "layers.0.dense" and f["collective"]["seq"] == 1, f
    assert "raised on ranks [0]; ranks [1] never issued it" in f["detail"] and "rank 1 at #0" in f["detail"], f


def test_a_reduce_then_a_broadcast_from_its_destination_is_post_reduction(tmp_path):
    """An all_reduce in two (a held-out program: ``dist.reduce`` to rank 0, then ``broadcast``
    from it): what every rank ends with is the sum-reduction's result, sent on unchanged."""
    rng = gen(68)
    parts = {r: pos(rng, 2, 3) for r in R}
    total = parts[0] + parts[1]
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("run", same(total, R)) as root:
            with tr.call("both", same(total, R)) as c:
                with tr.call("both.linear", same(total, R)) as lin:
                    lin.returns(arrays(parts))
                tr.coll("reduce", [arrays(parts)], [arrays({0: total, 1: parts[1]})])
                tr.coll("broadcast", [arrays({0: total, 1: parts[1]})], [same(total, R)])
                c.returns(same(total, R))
            with tr.call("only_sent", same(total, R)) as c:
                tr.coll("broadcast", [arrays({0: total * 3, 1: parts[1]})], [same(total * 3, R)])
                c.returns(same(total * 3, R))
            root.returns(same(total, R))
    con = tr.merge(tmp_path)
    p = point(con, "both:output")
    check(p, "replicate", "post-reduction", "broadcast-output")
    assert p["collective"]["op"] == "reduce", p
    check(point(con, "only_sent:output"), "replicate", "no-reduction", "broadcast-output")


def test_a_table_handed_in_beside_a_shard_is_not_derived_from_it(tmp_path):
    """A held-out PyTorch TP plan (not written here) with a planted bug: rank 1's rotary cos
    table ([seq, head_dim], whole on every rank) off by 1e-2, handed to each layer beside the
    sequence-parallel hidden state ([b, seq/tp, dim], shard(1)). It was judged shard(1),
    "derived locally ... (another rank of tensor: dim 1 assumed)", and check said nothing."""
    rng = gen(69)
    x = pos(rng, 2, 8, 6)
    cos = pos(rng, 8, 4)
    hs = {r: x[:, 4 * r:4 * (r + 1)] for r in R}
    tables = {0: cos, 1: cos + 1e-2}
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("run", same(x, R)) as root:
            with tr.call("scatter", same(x, R)) as c:
                c.returns(arrays(hs))
            with tr.call("layers.0", arrays(hs), arrays(tables)) as c:
                c.returns(arrays({r: hs[r] * 2 for r in R}))
            root.returns(same(x, R))
    con = tr.merge(tmp_path)
    p = point(con, "layers.0:input.1")
    assert p["placement"] == "divergent", p["evidence"]
    assert [f["point"] for f in _findings(tmp_path) if f["kind"] == "divergent"] == ["layers.0:input.1"]
