"""Points under DP attention: judged across the group whose ranks hold the same data.

Two ranks, one TP group [0, 1], split by DP attention into two attention-DP ranks whose
attention-TP groups have one rank each (SGLang's ``--tp 2 --enable-dp-attention --dp-size 2``).
Each DP rank runs its own tokens (here 3 and 0, then 2 and 1), gathered for the MoE block by an
all_reduce over zero-filled buffers and taken back after it.
"""

from __future__ import annotations

import numpy as np
import pytest

from synthetic_trace import SyntheticTrace, arrays, check, gen, point, pos, same, store_has
from tensor_trace.exporters import query

needs_coll_attrs = pytest.mark.skipif(not store_has("collectives", "attrs"), reason="no collective attrs")
R = [0, 1]
H = 4


def _groups(rank, dp=2):
    attn_tp = dict(size=1, rank=0, ranks=[rank])
    return dict(groups=dict(tp=dict(size=2, rank=rank, ranks=R), attn_tp=attn_tp,
                            attn_dp=dict(size=dp, rank=rank, ranks=R),
                            moe_tp=dict(size=2, rank=rank, ranks=R), moe_ep=dict(size=1, rank=0, ranks=[rank])),
                dp_attention=True)


def _dp_step(tr, rng, tokens):
    """Embedding, attention output projection (per DP rank), the DP gather by all_reduce, the
    MoE block on the gathered tokens (a partial sum per rank) and its all_reduce."""
    n = sum(tokens)
    ids = {r: np.arange(tokens[r], dtype=np.int64) for r in R}
    emb = {r: pos(rng, tokens[r], H) for r in R}
    per_rank = {r: dict(tokens=tokens[r], batch_size=1 if tokens[r] else 0, dp_tokens=list(tokens)) for r in R}
    with tr.step(dict(forward_mode="extend"), per_rank=per_rank):
        with tr.call("model.embed_tokens", arrays(ids)) as c:
            c.returns(arrays(emb))
        attn = {r: pos(rng, tokens[r], H) for r in R}
        with tr.call("model.layers.0.self_attn.o_proj", arrays(emb)) as c:
            c.returns(arrays(attn))
        padded, start = {}, 0
        for r in R:
            buf = np.zeros((n, H), np.float32)
            buf[start:start + tokens[r]] = attn[r]
            padded[r] = buf
            start += tokens[r]
        total = padded[0] + padded[1]
        rows = {r: {"nonzero_rows": [[int(np.nonzero(padded[r].any(1))[0][0]), int(np.nonzero(padded[r].any(1))[0][-1]),
                                      tokens[r]] if tokens[r] else [0, 0, 0]]} for r in R}
        tr.coll("all_reduce", [arrays(padded)], [same(total, R)], attrs=rows)
        parts = {r: pos(rng, n, H) for r in R}
        with tr.call("model.layers.0.mlp", same(total, R)) as c:
            c.returns(arrays(parts))
        tr.coll("all_reduce", [arrays(parts)], [same(parts[0] + parts[1], R)])


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    rng = gen(3)
    tr = SyntheticTrace(2, tp_ranks=R, identity={r: _groups(r) for r in R})
    _dp_step(tr, rng, (3, 0))
    _dp_step(tr, rng, (2, 1))
    return tr.merge(tmp_path_factory.mktemp("dp"))


def test_dp_local_points_are_judged_in_their_attention_tp_group(con):
    for name in ("model.embed_tokens:output", "model.layers.0.self_attn.o_proj:output"):
        p = point(con, name)
        check(p, "replicate", "no-reduction", "one-rank-group")
        assert p["group"]["name"] == "attn_tp" and p["group"]["size"] == 1, p["group"]
        assert p["data_split"]["over"] == "attn_dp" and p["data_split"]["dim"] == 0, p
        assert not any("other steps disagree" in e for e in p["evidence"]), p["evidence"]
        assert any(i["kind"] == "group" and "data split" in i["text"] for i in p["evidence_items"]), p


@needs_coll_attrs
def test_dp_gather_by_all_reduce_with_an_empty_dp_rank_is_a_gather(con):
    p = point(con, "model.layers.0.mlp:input.0")
    check(p, "replicate", "no-reduction", "gathered-by-all-reduce")
    assert p["group"]["name"] == "tp" and p["data_split"] is None


def test_moe_points_stay_in_the_tp_group(con):
    p = point(con, "model.layers.0.mlp:output")
    check(p, "partial", "pre-reduction", "reduction-input")
    assert p["group"] == dict(name="tp", size=2, ranks=[[0, 1]])


def test_without_declared_groups_the_split_is_judged_over_the_tp_group(tmp_path):
    """A trace whose processes declared no groups (older traces) keeps its TP-group verdicts."""
    tr = SyntheticTrace(2, tp_ranks=R)
    _dp_step(tr, gen(3), (3, 0))
    p = point(tr.merge(tmp_path), "model.embed_tokens:output")
    assert p["placement"] == "shard(0)" and "group" not in p


def _padded_step_with_garbage(tr, rng, tokens):
    """SGLang's padded DP gather (all_gather_into_tensor of max(tokens) rows per DP rank, then
    reduce_scatter): the idle DP rank's padding rows are uninitialised memory, here NaN, so the
    MoE block's gathered input and its partial sums have NaN sums on every rank."""
    width = max(tokens)
    n = width * len(R)
    per_rank = {r: dict(tokens=tokens[r], batch_size=1 if tokens[r] else 0, dp_tokens=list(tokens)) for r in R}
    with tr.step(dict(forward_mode="extend"), per_rank=per_rank):
        own = {r: np.full((width, H), np.nan, np.float32) for r in R}
        for r in R:
            own[r][:tokens[r]] = pos(rng, tokens[r], H)
        with tr.call("model.embed_tokens", arrays({r: np.arange(width, dtype=np.int64) for r in R})) as c:
            c.returns(arrays(own))
        gathered = np.concatenate([own[r] for r in R])
        tr.coll("all_gather_into_tensor", [arrays(own)], [same(gathered, R)])
        parts = {r: pos(rng, n, H) * gathered[:, :1] for r in R}
        with tr.call("model.layers.0.mlp", same(gathered, R)) as c:
            c.returns(arrays(parts))
        tr.coll("reduce_scatter_tensor", [arrays(parts)],
                [arrays({r: (parts[0] + parts[1])[r * width:(r + 1) * width] for r in R})])


def test_nan_padding_is_no_evidence_and_does_not_outvote_the_steps_that_have_it(tmp_path):
    """A step whose MoE points hold NaN garbage judges them unknown (not DP-local, not values
    that differ), and the steps with finite values decide the point."""
    rng = gen(5)
    tr = SyntheticTrace(2, tp_ranks=R, identity={r: _groups(r) for r in R})
    _padded_step_with_garbage(tr, rng, (1, 0))
    _dp_step(tr, rng, (3, 0))
    _padded_step_with_garbage(tr, rng, (1, 0))
    _dp_step(tr, rng, (2, 1))
    con = tr.merge(tmp_path)
    p = point(con, "model.layers.0.mlp:output")
    check(p, "partial", "pre-reduction", "reduction-input")
    assert p["group"] == dict(name="tp", size=2, ranks=[[0, 1]]) and p["data_split"] is None, p
    assert not any("other steps disagree" in e for e in p["evidence"]), p["evidence"]
    assert any("unknown in steps [0, 2]" in e for e in p["evidence"]), p["evidence"]
    (nan_step,) = query.placement(con, "model.layers.0.mlp:output", step=0)
    assert (nan_step["placement"], nan_step["rule"]) == ("unknown", "non-finite-values"), nan_step["evidence"]
    assert nan_step.get("data_split") is None, nan_step
    assert any("non-finite values (NaN or inf) on ranks [0, 1]" in e for e in nan_step["evidence"])


def _max_len_padded_step(tr, rng, tokens, learnt=True):
    """SGLang's MAX_LEN padding (a decode step with an idle DP rank): inside the forward every
    DP rank is padded to max(tokens) rows, the idle one included, the post-attention norm runs
    on them, all_gather_into_tensor gathers them for the MoE block and reduce_scatter takes its
    sums back. The step began before the padding: its ``tokens`` and ``dp_tokens`` are the
    unpadded ones, and the rows run come with the step's end (``learnt``), as the SGLang
    integration writes them."""
    width = max(tokens)
    n = width * len(R)
    begin = {r: dict(tokens=tokens[r], batch_size=1 if tokens[r] else 0, dp_tokens=list(tokens)) for r in R}
    end = {r: dict(rows=width, batch_rows=width, dp_rows=[width] * len(R), dp_padding="max_len") for r in R}
    with tr.step(dict(forward_mode="decode"), per_rank=begin, end_per_rank=end if learnt else None):
        with tr.call("model.embed_tokens", arrays({r: np.arange(tokens[r], dtype=np.int64) for r in R})) as c:
            c.returns(arrays({r: pos(rng, tokens[r], H) for r in R}))
        hidden = {r: pos(rng, width, H) for r in R}  # the idle rank's padding row: finite
        normed = {r: pos(rng, width, H) for r in R}
        with tr.call("model.layers.0.post_attention_layernorm", arrays(hidden)) as c:
            c.returns(arrays(normed))
        gathered = np.concatenate([normed[r] for r in R])
        tr.coll("all_gather_into_tensor", [arrays(normed)], [same(gathered, R)])
        parts = {r: pos(rng, n, H) for r in R}
        with tr.call("model.layers.0.mlp", same(gathered, R)) as c:
            c.returns(arrays(parts))
        tr.coll("reduce_scatter_tensor", [arrays(parts)],
                [arrays({r: (parts[0] + parts[1])[r * width:(r + 1) * width] for r in R})])


def _norm_steps(tr, rng, tokens):
    """A step whose DP ranks both hold tokens, the norm's rows their own (SUM_LEN: no padding)."""
    per_rank = {r: dict(tokens=tokens[r], batch_size=1, dp_tokens=list(tokens)) for r in R}
    with tr.step(dict(forward_mode="decode"), per_rank=per_rank):
        with tr.call("model.layers.0.post_attention_layernorm", arrays({r: pos(rng, tokens[r], H) for r in R})) as c:
            c.returns(arrays({r: pos(rng, tokens[r], H) for r in R}))


@pytest.mark.parametrize("learnt", [True, False])
def test_a_max_len_padded_idle_rank_holds_padding_of_its_own(tmp_path, learnt):
    """The idle DP rank's padded rows are its own (padding), not every DP rank's tokens: the
    norm's output that the DP gather takes is DP-local in the padded step as in the others.
    Without the rows the step ran (an older trace) its rows looked like nobody's and the
    all_gather's input made it a shard of the TP group (the CI failure of 2026-12-04)."""
    rng = gen(11)
    tr = SyntheticTrace(2, tp_ranks=R, identity={r: _groups(r) for r in R})
    _norm_steps(tr, rng, (2, 1))
    _max_len_padded_step(tr, rng, (1, 0), learnt=learnt)
    _norm_steps(tr, rng, (1, 2))
    con = tr.merge(tmp_path)
    (padded,) = query.placement(con, "model.layers.0.post_attention_layernorm:output", step=1)
    if not learnt:
        assert (padded["placement"], padded["rule"]) == ("shard(0)", "gather-input"), padded["evidence"]
        assert padded.get("data_split") is None
        return
    check(padded, "replicate", "no-reduction", "one-rank-group")
    assert padded["data_split"]["rows"] == {0: 1, 1: 1} and padded["data_split"]["padding"] == {1: 1}, padded
    assert any("rank 1: 1 (1 of them padding)" in e for e in padded["evidence"]), padded["evidence"]
    p = point(con, "model.layers.0.post_attention_layernorm:output")
    check(p, "replicate", "no-reduction", "one-rank-group")
    assert not any("other steps disagree" in e for e in p["evidence"]), p["evidence"]
    # the MoE block's gathered input and partial sums stay in the TP group
    moe = point(con, "model.layers.0.mlp:output")
    assert moe["placement"] == "partial" and moe["group"]["name"] == "tp", moe
