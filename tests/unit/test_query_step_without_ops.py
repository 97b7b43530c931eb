"""``query placement --step N`` on a step whose ops were not recorded (lineage is taken on a
schedule; transformers' generate under tp_plan, held out, not written here): a decode step's
rotary q/k [2, 1, 1, 16] at TP 4 (one head, one token per rank) guessed shard(2) along the
dataflow, and eager attention's weights were divergent, where the steps with recorded ops place
them shard(1). The all-steps verdict is taken for those, with the reason; other differences
keep the step's own verdict and gain a note."""

import sqlite3

from tensor_trace.exporters import query


def _row(point, placement, reduction, rule):
    return dict(point=point, placement=placement, reduction=reduction, rule=rule,
                evidence=["...", "step 2"], evidence_items=[])


def _run(monkeypatch, step_rows, overall_rows, lineage_steps=(0, 1)):
    con = sqlite3.connect(":memory:")
    con.execute("CREATE TABLE lineage(step INTEGER)")
    con.executemany("INSERT INTO lineage VALUES (?)", [(s,) for s in lineage_steps])
    monkeypatch.setattr(query, "match_points", lambda con, pattern: overall_rows)
    query._against_all_steps(con, 2, step_rows)
    return step_rows


def test_a_guessed_shard_dim_and_a_divergent_point_take_the_steps_with_ops(monkeypatch):
    rows = _run(monkeypatch, [_row("rope:output.0", "shard(2)", "no-reduction", "derived-from-shard"),
                              _row("attn:output.1", "divergent", "unknown", "divergent"),
                              _row("norm:output", "replicate", "no-reduction", "equal-values")],
                [_row("rope:output.0", "shard(1)", "no-reduction", "lineage-ops"),
                 _row("attn:output.1", "shard(1)", "no-reduction", "derived-from-shard"),
                 _row("norm:output", "shard(0)", "no-reduction", "lineage-ops")])
    rope, attn, norm = rows
    assert (rope["placement"], attn["placement"], attn["reduction"]) == ("shard(1)", "shard(1)", "no-reduction")
    assert "this step guessed shard(2)" in rope["evidence"][-2] and rope["evidence"][-1] == "step 2"
    assert "no evidence of a shard" in attn["evidence"][-2]
    # a verdict from the values is the step's own: kept, with the all-steps answer beside it
    assert norm["placement"] == "replicate" and "all steps together: shard(0)" in norm["evidence"][-2]


def test_a_step_with_recorded_ops_keeps_its_own_verdicts(monkeypatch):
    rows = _run(monkeypatch, [_row("rope:output.0", "shard(2)", "no-reduction", "derived-from-shard")],
                [_row("rope:output.0", "shard(1)", "no-reduction", "lineage-ops")], lineage_steps=(2,))
    assert rows[0]["placement"] == "shard(2)" and rows[0]["evidence"] == ["...", "step 2"]
