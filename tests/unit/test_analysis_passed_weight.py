"""A parameter handed to another module is placed as its owner split it. The case from a
held-out Megatron-style program (not written here): the output layer tied to a vocab-parallel
embedding is called with ``weight=`` the embedding's weight (Megatron-Core's GPT does so), its
logits' padded vocab columns -inf on the last rank. The weight was judged a shard of the
latest sharded activation before it, on the wrong dim."""

import numpy as np

from synthetic_trace import SyntheticTrace, arrays, check, gen, items, point, pos, same

R = [0, 1]


def _tied_head(tr, rng, pad_inf: bool):
    ids = np.array([[1, 6, 3], [7, 0, 2]], dtype=np.int64)
    E = pos(rng, 8, 4)  # vocab 8 split by rows: rank r looks up ids in [4r, 4r + 4)
    tables = {r: E[4 * r:4 * (r + 1)] for r in R}
    tr.param("embedding", "weight", arrays(tables))
    parts = {r: np.where(((ids >= 4 * r) & (ids < 4 * (r + 1)))[..., None], E[ids], 0).astype(np.float32) for r in R}
    x = E[ids]
    with tr.call("model", same(ids, R, "int64")) as outer:
        with tr.call("embedding", same(ids, R, "int64")) as c:
            tr.coll("all_reduce", [arrays(parts)], [same(x, R)])
            c.returns(same(x, R))
        h = x * 2
        with tr.call("final_norm", same(x, R)) as c:
            c.returns(same(h, R))
        logits = {r: h @ tables[r].T for r in R}
        if pad_inf:
            logits[1][..., 3:] = -np.inf
        with tr.call("output_layer", same(h, R), arrays(tables)) as c:
            c.returns(arrays(logits))
        whole = np.concatenate([logits[0], logits[1]], -1)
        tr.coll("all_gather_into_tensor", [arrays(logits)], [same(whole, R)])
        outer.returns(same(whole, R))


def test_the_embedding_weight_handed_to_a_tied_head_is_split_by_rows(tmp_path):
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        _tied_head(tr, gen(21), pad_inf=False)
    con = tr.merge(tmp_path)
    w = point(con, "output_layer:input.1")
    check(w, "shard(0)", "no-reduction", "passed-parameter")
    assert any("embedding.weight" in i["text"] and "split by rows" in i["text"] for i in items(w, "weights")), w["evidence"]
    check(point(con, "output_layer:output"), "shard(2)", "no-reduction", "gather-input")


def test_a_tied_head_with_infinite_padding_columns_is_placed_by_the_weight_it_was_handed(tmp_path):
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        _tied_head(tr, gen(22), pad_inf=True)
    con = tr.merge(tmp_path)
    check(point(con, "output_layer:input.1"), "shard(0)", "no-reduction", "passed-parameter")
    p = point(con, "output_layer:output")
    check(p, "shard(2)", "no-reduction", "sharded-weight")
    assert any("applied as a linear weight" in i["text"] for i in items(p, "weights")), p["evidence"]


def test_a_sequence_parallel_tied_head_gathers_its_input_then_applies_the_rows_it_was_handed(tmp_path):
    """Megatron-Core's tied output layer under sequence parallelism (a held-out real
    megatron-core GPTModel): it all_gathers each rank's part of the sequence, then applies the
    embedding's rows it was handed; the local logits are returned. Before, the gather inside the
    call left the logits divergent."""
    rng = gen(23)
    ids = np.array([[1, 6, 3, 5], [1, 0, 6, 6]], dtype=np.int64)  # [b, s]
    E = pos(rng, 8, 4)
    tables = {r: E[4 * r:4 * (r + 1)] for r in R}
    x = E[ids]
    parts = {r: np.where(((ids >= 4 * r) & (ids < 4 * (r + 1)))[..., None], x, 0).astype(np.float32) for r in R}
    h = np.ascontiguousarray(x.transpose(1, 0, 2)) * 2  # [s, b, d], whole
    seq = {r: h[2 * r:2 * (r + 1)] for r in R}  # each rank's part of the sequence
    logits = {r: h @ tables[r].T for r in R}
    tr = SyntheticTrace(2, root="run")
    tr.param("embedding", "weight", arrays(tables))
    with tr.step():
        with tr.call("model", same(ids, R, "int64")) as outer:
            with tr.call("embedding", same(ids, R, "int64")) as c:
                tr.coll("all_reduce", [arrays(parts)], [same(x, R)])
                c.returns(same(x, R))
            with tr.call("output_layer", arrays(seq), arrays(tables)) as c:
                tr.coll("all_gather_into_tensor", [arrays(seq)], [same(h, R)])
                c.returns(arrays(logits))
            outer.returns(arrays(logits))
    con = tr.merge(tmp_path)
    check(point(con, "output_layer:input.0"), "shard(0)", "no-reduction", "gather-input")
    check(point(con, "output_layer:input.1"), "shard(0)", "no-reduction", "passed-parameter")
    p = point(con, "output_layer:output")
    check(p, "shard(2)", "no-reduction", "sharded-weight")
    assert any("gathered inside the call by all_gather_into_tensor" in i["text"] for i in items(p, "weights")), p
