"""The verdict engine's reduction rules (exporters/analysis/rules.py) on small synthetic traces:
sum-reductions, gathers, reduce_scatters, gathers by all_reduce. See test_analysis_rules.py.

Values are real arrays (a row-parallel partial sum is a product of slices, an all_reduce's output
their sum, a gather a concatenation), so fingerprints relate as they do in a traced program.
"""

import numpy as np
import pytest

from synthetic_trace import (SyntheticTrace, arrays, bf16, check, fingerprint, gen, items, names_collective,
                             no_fp, point, pos, same, store_has)

R = [0, 1]
needs_coll_attrs = pytest.mark.skipif(
    not store_has("collectives", "attrs"), reason="the store has no collectives.attrs column yet: the rank "
                                                  "files cannot carry a collective's gather_dim / nonzero_rows "
                                                  "to the engine")


def row_parallel(tr, rng, x_full, w_full, module="row", reduce=True, in_fp=True):
    """``module`` computes its slice of x @ w.T per rank and (``reduce``) all_reduces it."""
    k = x_full.shape[-1] // 2
    xs = {r: x_full[:, r * k:(r + 1) * k] for r in R}
    parts = {r: xs[r] @ w_full[:, r * k:(r + 1) * k].T for r in R}
    total = parts[0] + parts[1]
    with tr.call(module, arrays(xs)) as c:
        if reduce:
            ins = arrays(parts) if in_fp else no_fp(parts[0].shape, R)
            tr.coll("all_reduce", [ins], [same(total, R)])
            c.returns(same(total, R))
        else:
            c.returns(arrays(parts))
    return parts, total


def rms_norm(x, w):
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w).astype(np.float32)


# ------------------------------------------------------------------------- sum-reductions
def test_all_reduce_output_and_a_scaled_copy_are_post_reduction_a_norm_of_it_is_not(tmp_path):
    rng = gen()
    x, w, g = pos(rng, 4, 8), pos(rng, 6, 8), pos(rng, 6)
    tr = SyntheticTrace(2)
    with tr.step():
        _, total = row_parallel(tr, rng, x, w)
        with tr.call("scale", same(total, R)) as c:
            c.returns(same(total * 0.125, R))
        with tr.call("norm", same(total * 0.125, R)) as c:
            c.returns(same(rms_norm(total * 0.125, g), R))
    con = tr.merge(tmp_path)
    p = point(con, "row:output")
    check(p, "replicate", "post-reduction", "reduction-output")
    names_collective(p, "all_reduce", 0)
    p = point(con, "scale:output")
    check(p, "replicate", "post-reduction", "reduction-output")
    names_collective(p, "all_reduce", 0)
    p = point(con, "norm:output")
    check(p, "replicate", "no-reduction", "equal-values")
    assert p["collective"] is None


def test_output_cast_to_bf16_is_still_the_reduction_output(tmp_path):
    """Within the tolerance: the fp32 reduction's output, cast to bfloat16 by the module."""
    rng = gen(3)
    x, w = pos(rng, 16, 64), rng.normal(size=(32, 64)).astype(np.float32)
    k = 32
    parts = {r: x[:, r * k:(r + 1) * k] @ w[:, r * k:(r + 1) * k].T for r in R}
    total = parts[0] + parts[1]
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("row", arrays({r: x[:, r * k:(r + 1) * k] for r in R})) as c:
            tr.coll("all_reduce", [arrays(parts)], [same(total, R)])
            c.returns(same(total, R, dtype="bfloat16"))
    p = point(tr.merge(tmp_path), "row:output")
    check(p, "replicate", "post-reduction", "reduction-output")
    names_collective(p, "all_reduce", 0)


def test_all_gather_output_is_replicate_not_reduced(tmp_path):
    rng = gen()
    xs = {r: pos(rng, 3, 4) for r in R}
    cat = np.concatenate([xs[0], xs[1]], 0)
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("gather", arrays(xs)) as c:
            tr.coll("all_gather_into_tensor", [arrays(xs)], [same(cat, R)], reduce_op=None)
            c.returns(same(cat, R))
    con = tr.merge(tmp_path)
    p = point(con, "gather:output")
    check(p, "replicate", "no-reduction", "gather-output")
    names_collective(p, "all_gather_into_tensor", 0)
    # Its input is a slice per rank, along the dim of the concatenation the step shows (0, where
    # a default of the last dim would say 1).
    p = point(con, "gather:input.0")
    check(p, "shard(0)", "no-reduction", "gather-input")
    names_collective(p, "all_gather_into_tensor", 0)


def test_all_gather_input_dim_from_the_concatenation_seen(tmp_path):
    """A gather along dim 1 the way functional collectives do it: the collective gathers into a
    dim-0 buffer, the module returns the chunks put together along dim 1."""
    rng = gen()
    xs = {r: pos(rng, 4, 3) for r in R}
    buf = np.concatenate([xs[0], xs[1]], 0)
    cat = np.concatenate([xs[0], xs[1]], 1)
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("gather", arrays(xs)) as c:
            tr.coll("all_gather_into_tensor", [arrays(xs)], [same(buf, R)], reduce_op=None)
            c.returns(same(cat, R))
    con = tr.merge(tmp_path)
    p = point(con, "gather:input.0")
    check(p, "shard(1)", "no-reduction", "gather-input")
    names_collective(p, "all_gather_into_tensor", 0)
    # The values of the gathered buffer, rearranged: still the gather's output.
    check(point(con, "gather:output"), "replicate", "no-reduction", "gather-output")


@needs_coll_attrs
def test_all_gather_input_dim_from_the_collectives_gather_dim(tmp_path):
    rng = gen()
    xs = {r: pos(rng, 4, 3) for r in R}
    buf = np.concatenate([xs[0], xs[1]], 0)
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("gather", arrays(xs)) as c:
            # Nothing in the step shows the dim-1 concatenation: only the collective's attrs.
            tr.coll("all_gather_into_tensor", [arrays(xs)], [same(buf, R)], reduce_op=None,
                    attrs={"gather_dim": 1})
            c.returns(same(buf, R))
    con = tr.merge(tmp_path)
    assert con.execute("SELECT COUNT(*) FROM collectives WHERE attrs IS NOT NULL").fetchone()[0] == 2, \
        "the merge did not take the collective attrs as synthetic_trace.py writes them"
    p = point(con, "gather:input.0")
    check(p, "shard(1)", "no-reduction", "gather-input")
    names_collective(p, "all_gather_into_tensor", 0)
    assert any("gather_dim=1" in i["text"] for i in items(p, "dataflow"))


def test_all_reduce_input_is_a_partial_sum(tmp_path):
    rng = gen()
    tr = SyntheticTrace(2)
    with tr.step():
        parts, total = row_parallel(tr, rng, pos(rng, 4, 8), pos(rng, 6, 8), module="row", reduce=False)
        tr.coll("all_reduce", [arrays(parts)], [same(total, R)])
    p = point(tr.merge(tmp_path), "row:output")
    check(p, "partial", "pre-reduction", "reduction-input")
    names_collective(p, "all_reduce", 0)


def test_all_reduce_input_equal_on_every_rank_is_still_partial(tmp_path):
    """Identical dummy-weight shards: the partial sums happen to be equal."""
    y = pos(gen(), 4, 6)
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("row", same(pos(gen(1), 4, 4), R)) as c:
            c.returns(same(y, R))
        tr.coll("all_reduce", [same(y, R)], [same(2 * y, R)])
    p = point(tr.merge(tmp_path), "row:output")
    check(p, "partial", "pre-reduction", "reduction-input")
    names_collective(p, "all_reduce", 0)
    assert any("identical shards" in i["text"] for i in items(p, "values")), p["evidence"]


def test_scaled_copy_of_whole_values_fed_to_a_reduction_is_not_partial(tmp_path):
    """x / tp, all_reduce(sum): x is whole on every rank; only the scaled copy is summed."""
    x = pos(gen(), 4, 6)
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("m", same(pos(gen(1), 4, 4), R)) as c:
            c.returns(same(x, R))
        tr.coll("all_reduce", [same(x / 2, R)], [same(x, R)])
    check(point(tr.merge(tmp_path), "m:output"), "replicate", "no-reduction", "equal-values")


def test_scaled_partial_sums_fed_to_a_reduction_are_partial(tmp_path):
    """Values that differ, a scaling of which is a sum-reduction's input: still its partial sum."""
    rng = gen()
    tr = SyntheticTrace(2)
    with tr.step():
        parts, total = row_parallel(tr, rng, pos(rng, 4, 8), pos(rng, 6, 8), module="row", reduce=False)
        tr.coll("all_reduce", [arrays({r: parts[r] * 0.5 for r in R})], [same(total * 0.5, R)])
    p = point(tr.merge(tmp_path), "row:output")
    check(p, "partial", "pre-reduction", "reduction-input")
    names_collective(p, "all_reduce", 0)


def _reduce_scatter(tmp_path, rng):
    ys = {r: pos(rng, 4, 6) for r in R}
    total = ys[0] + ys[1]
    outs = {r: total[2 * r:2 * r + 2] for r in R}
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("proj", same(pos(rng, 4, 8), R)) as c:
            c.returns(arrays(ys))
        tr.coll("reduce_scatter_tensor", [arrays(ys)], [arrays(outs)])
        with tr.call("post", arrays(outs)) as c:
            c.returns(arrays({r: 2 * outs[r] for r in R}))
    return tr.merge(tmp_path)


def test_reduce_scatter_input_is_partial(tmp_path):
    p = point(_reduce_scatter(tmp_path, gen()), "proj:output")
    check(p, "partial", "pre-reduction", "reduction-input")
    names_collective(p, "reduce_scatter_tensor", 0)


def test_reduce_scatter_output_is_a_reduced_shard(tmp_path):
    p = point(_reduce_scatter(tmp_path, gen()), "post:input.0")
    check(p, "shard(0)", "post-reduction", "reduce-scatter-output")
    names_collective(p, "reduce_scatter_tensor", 0)


def test_reduce_scatter_output_is_post_reduction_shard(tmp_path):
    """Placement kind and reduction, whatever the dim."""
    p = point(_reduce_scatter(tmp_path, gen()), "post:input.0")
    assert p["placement"].startswith("shard(") and p["reduction"] == "post-reduction", p["evidence"]
    assert p["rule"] == "reduce-scatter-output"
    names_collective(p, "reduce_scatter_tensor", 0)


def _uneven_reduce_scatter(tmp_path):
    """A list reduce_scatter of uneven chunks of proj's partial sums."""
    rng = gen()
    ys = {r: pos(rng, 5, 6) for r in R}
    total = ys[0] + ys[1]
    outs = {0: total[:2], 1: total[2:]}
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("proj", same(pos(rng, 5, 8), R)) as c:
            c.returns(arrays(ys))
        tr.coll("reduce_scatter", [arrays({r: ys[r][:2] for r in R}), arrays({r: ys[r][2:] for r in R})],
                [arrays(outs)])
        with tr.call("post", arrays(outs)) as c:
            c.returns(arrays({r: 2 * outs[r] for r in R}))
    return tr.merge(tmp_path)


def test_uneven_reduce_scatter_output_is_a_reduced_shard(tmp_path):
    """The ranks' outputs differ along dim 0."""
    p = point(_uneven_reduce_scatter(tmp_path), "post:input.0")
    check(p, "shard(0)", "post-reduction", "reduce-scatter-output")
    names_collective(p, "reduce_scatter", 0)


def _zero_mean_reduction(tr, n_rows=8, hidden=2048):
    """A bf16 all_reduce of zero-mean partial sums (hidden states): the first seed whose sum is
    1.5 to 3 times the root of its sum of squares, i.e. far above bf16 rounding (which is 2**-7
    of it), so a common scale is plain in the sums."""
    for seed in range(100):
        rng = gen(seed)
        parts = {r: rng.normal(size=(n_rows, hidden)).astype(np.float32) for r in R}
        total = bf16(parts[0] + parts[1])
        s, q = fingerprint(total, "bfloat16")
        if 1.5 < abs(s) / np.sqrt(q) < 3:
            break
    with tr.call("emb", same(np.arange(n_rows, dtype=np.float32), R)) as c:
        tr.coll("all_reduce", [arrays(parts, "bfloat16")], [same(total, R, "bfloat16")])
        c.returns(same(total, R, "bfloat16"))
    return total


@pytest.mark.parametrize("scale", [0.125, 2048 ** 0.5], ids=["1/8", "sqrt2048"])
def test_zero_mean_bf16_reduction_output_times_a_scale_is_post_reduction(tmp_path, scale):
    """Gemma-style embedding normalizer (times sqrt(hidden)), or a 1/8 scaling, of a reduced
    bf16 tensor whose sum is well above rounding: carried up to a common scale (design.md)."""
    tr = SyntheticTrace(2)
    with tr.step():
        total = _zero_mean_reduction(tr)
        with tr.call("scale", same(total, R, "bfloat16")) as c:
            c.returns(same(bf16(total * np.float32(scale)), R, "bfloat16"))
    p = point(tr.merge(tmp_path), "scale:output")
    check(p, "replicate", "post-reduction", "reduction-output")
    names_collective(p, "all_reduce", 0)


def test_zero_mean_bf16_reduction_output_times_two_is_post_reduction(tmp_path):
    """The same with a scale of 2, which the threshold still lets through for this seed."""
    tr = SyntheticTrace(2)
    with tr.step():
        total = _zero_mean_reduction(tr)
        with tr.call("scale", same(total, R, "bfloat16")) as c:
            c.returns(same(bf16(total * np.float32(2)), R, "bfloat16"))
    p = point(tr.merge(tmp_path), "scale:output")
    check(p, "replicate", "post-reduction", "reduction-output")


def _coalesced(tmp_path):
    rng = gen()
    a, b = {r: pos(rng, 4, 6) for r in R}, {r: pos(rng, 3, 5) for r in R}
    A, B = a[0] + a[1], b[0] + b[1]
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("pa", same(pos(rng, 2, 2), R)) as c:
            c.returns(arrays(a))
        with tr.call("pb", same(pos(rng, 2, 2), R)) as c:
            c.returns(arrays(b))
        tr.coll("all_reduce_coalesced", [arrays(a), arrays(b)], [same(A, R), same(B, R)])
        with tr.call("ua", same(A, R)) as c:
            c.returns(same(2 * A, R))
        with tr.call("ub", same(B, R)) as c:
            c.returns(same(2 * B, R))
    return tr.merge(tmp_path)


def test_coalesced_all_reduce_first_input_is_partial(tmp_path):
    p = point(_coalesced(tmp_path), "pa:output")
    check(p, "partial", "pre-reduction", "reduction-input")
    names_collective(p, "all_reduce_coalesced", 0)


def test_coalesced_all_reduce_second_input_is_partial(tmp_path):
    p = point(_coalesced(tmp_path), "pb:output")
    check(p, "partial", "pre-reduction", "reduction-input")


@pytest.mark.parametrize("name", ["ua:input.0", "ub:input.0"])
def test_coalesced_all_reduce_outputs_are_post_reduction(tmp_path, name):
    p = point(_coalesced(tmp_path), name)
    check(p, "replicate", "post-reduction", "reduction-output")


def test_list_reduce_scatter_input_is_partial(tmp_path):
    p = point(_uneven_reduce_scatter(tmp_path), "proj:output")
    check(p, "partial", "pre-reduction", "reduction-input")


def test_per_rank_sums_adding_up_to_a_reduction_are_partial(tmp_path):
    """The reduction's inputs carry no fingerprint, so nothing links them: the sums of the
    ranks' values add up to its output."""
    rng = gen()
    tr = SyntheticTrace(2)
    with tr.step():
        parts, total = row_parallel(tr, rng, pos(rng, 4, 8), pos(rng, 6, 8), module="row", reduce=False)
        tr.coll("all_reduce", [no_fp(total.shape, R)], [same(total, R)])
    p = point(tr.merge(tmp_path), "row:output")
    check(p, "partial", "pre-reduction", "sums-add-up")
    names_collective(p, "all_reduce", 0)


# ------------------------------------------------------------------------- gathers by all_reduce
def _padded(rows_of, width, rng, n_rows):
    """Per rank: zero except at its rows (and, with ``cols``, only its columns)."""
    out = {}
    for r, (rows, cols) in rows_of.items():
        a = np.zeros((n_rows, width), np.float32)
        a[np.ix_(rows, cols)] = pos(rng, len(rows), len(cols))
        out[r] = a
    return out


def _all_reduce_of(tmp_path, padded, nonzero_rows):
    total = padded[0] + padded[1]
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("emb", same(np.arange(6, dtype=np.float32), R)) as c:
            c.returns(arrays(padded))
        tr.coll("all_reduce", [arrays(padded)], [same(total, R)], attrs=nonzero_rows)
        with tr.call("next", same(total, R)) as c:
            c.returns(same(total * 3, R))
    con = tr.merge(tmp_path)
    assert con.execute("SELECT COUNT(*) FROM collectives WHERE attrs IS NOT NULL").fetchone()[0] == 2, \
        "the merge did not take the collective attrs as synthetic_trace.py writes them"
    return con


@needs_coll_attrs
def test_all_reduce_of_zero_padded_row_slices_is_a_gather(tmp_path):
    w = list(range(4))
    padded = _padded({0: ([0, 1, 2], w), 1: ([3, 4, 5], w)}, 4, gen(), 6)
    con = _all_reduce_of(tmp_path, padded, {0: {"nonzero_rows": [[0, 2, 3]]}, 1: {"nonzero_rows": [[3, 5, 3]]}})
    p = point(con, "emb:output")
    check(p, "shard(0)", "no-reduction", "gather-by-all-reduce-input")
    names_collective(p, "all_reduce", 0)
    p = point(con, "next:input.0")
    check(p, "replicate", "no-reduction", "gathered-by-all-reduce")
    names_collective(p, "all_reduce", 0)


@needs_coll_attrs
@pytest.mark.parametrize("case", ["scattered", "overlapping"])
def test_vocab_parallel_embedding_all_reduce_stays_a_reduction(tmp_path, case):
    """Disjoint elements (the sums of squares add up), but not one dense row range per rank in
    rank order: a masked lookup's scattered rows, or overlapping ranges (disjoint columns)."""
    if case == "scattered":
        w = list(range(4))
        padded = _padded({0: ([0, 2, 5], w), 1: ([1, 3, 4], w)}, 4, gen(), 6)
        rows = {0: {"nonzero_rows": [[0, 5, 3]]}, 1: {"nonzero_rows": [[1, 4, 3]]}}
    else:
        padded = _padded({0: ([0, 1, 2, 3], [0, 1]), 1: ([2, 3, 4, 5], [2, 3])}, 4, gen(), 6)
        rows = {0: {"nonzero_rows": [[0, 3, 4]]}, 1: {"nonzero_rows": [[2, 5, 4]]}}
    con = _all_reduce_of(tmp_path, padded, rows)
    p = point(con, "next:input.0")
    check(p, "replicate", "post-reduction", "reduction-output")
    names_collective(p, "all_reduce", 0)
    p = point(con, "emb:output")
    check(p, "partial", "pre-reduction", "reduction-input")


def test_disjoint_slices_without_row_attrs_stay_a_reduction(tmp_path):
    """Without the rows the tracer saw nonzero, sums of squares that add up are not enough."""
    w = list(range(4))
    padded = _padded({0: ([0, 1, 2], w), 1: ([3, 4, 5], w)}, 4, gen(), 6)
    total = padded[0] + padded[1]
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("emb", same(np.arange(6, dtype=np.float32), R)) as c:
            c.returns(arrays(padded))
        tr.coll("all_reduce", [arrays(padded)], [same(total, R)])
    con = tr.merge(tmp_path)
    check(point(con, "emb:output"), "partial", "pre-reduction", "reduction-input")


@needs_coll_attrs
def test_a_vocab_parallel_lookup_whose_two_tokens_fall_one_per_rank_stays_a_reduction(tmp_path):
    """Two decode tokens, the first in rank 0's half of the vocabulary and the second in rank
    1's (transformers' generate under tp_plan, held out, not written here): each rank's masked
    lookup is nonzero in one row, in rank order, tiling the output like a gather's slices. The
    module that issued the all_reduce looks integer ids up in a weight split across ranks: a
    vocab-parallel embedding, whose all_reduce is its reduction (post-reduction)."""
    rng = gen(5)
    rows = {r: pos(rng, 4) for r in R}
    padded = {0: np.stack([rows[0], np.zeros(4, np.float32)]), 1: np.stack([np.zeros(4, np.float32), rows[1]])}
    total = padded[0] + padded[1]
    ids = np.array([[3, 9]], dtype=np.int64)
    tr = SyntheticTrace(2)
    tr.param("embed", "weight", arrays({r: pos(rng, 8, 4) for r in R}))  # [vocab / 2, hidden] each
    with tr.step():
        with tr.call("embed", same(ids, R, dtype="int64")) as c:
            tr.coll("all_reduce", [arrays(padded)], [same(total, R)],
                    attrs={0: {"nonzero_rows": [[0, 0, 1]]}, 1: {"nonzero_rows": [[1, 1, 1]]}})
            c.returns(same(total, R))
        with tr.call("next", same(total, R)) as c:
            c.returns(same(total * 3 + 1, R))
    con = tr.merge(tmp_path)
    for name in ("embed:output", "next:input.0"):
        check(point(con, name), "replicate", "post-reduction", "reduction-output")
