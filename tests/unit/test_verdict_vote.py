"""The vote over a point's sampled steps (verdicts.vote): which steps count."""

from tensor_trace.exporters.analysis.evidence import READ_FROM_ASKED
from tensor_trace.exporters.analysis.verdicts import vote


def v(step, placement, reduction, rule):
    return dict(step=step, placement=placement, reduction=reduction, rule=rule)


def test_a_step_without_recorded_ops_does_not_outvote_the_ops_that_placed_a_shard():
    # lineage on steps 0 and 1 only (its schedule); step 2 has the same differing values
    verdicts = [v(0, "shard(1)", "no-reduction", "lineage-ops"), v(2, "divergent", "unknown", "divergent"),
                v(3, "divergent", "unknown", "divergent")]
    blind, unwatched, voting, counts, chosen = vote(verdicts, lineage_steps={0, 1})
    assert chosen["placement"] == "shard(1)" and [u["step"] for u in unwatched] == [2, 3]
    assert list(counts) == [("shard(1)", "no-reduction")]


def test_a_replicate_point_is_still_outvoted_by_steps_whose_ranks_disagree():
    # equal values in step 0, differing in 2 and 3: a divergence that appears later is kept
    verdicts = [v(0, "replicate", "no-reduction", "equal-values"), v(2, "divergent", "unknown", "divergent"),
                v(3, "divergent", "unknown", "divergent")]
    blind, unwatched, voting, counts, chosen = vote(verdicts, lineage_steps={0, 1})
    assert chosen["placement"] == "divergent" and unwatched == []


def test_divergent_in_a_step_with_recorded_ops_still_votes():
    verdicts = [v(0, "shard(1)", "no-reduction", "lineage-ops"), v(1, "divergent", "unknown", "divergent"),
                v(2, "divergent", "unknown", "divergent")]
    blind, unwatched, voting, counts, chosen = vote(verdicts, lineage_steps={0, 1})
    assert [u["step"] for u in unwatched] == [2]
    assert counts[("divergent", "unknown")] == 1 and counts[("shard(1)", "no-reduction")] == 1


def test_steps_without_evidence_are_blind():
    verdicts = [v(0, "partial", "pre-reduction", "sums-add-up"), v(1, "unknown", "unknown", "no-fingerprint")]
    blind, unwatched, voting, counts, chosen = vote(verdicts, lineage_steps=set())
    assert chosen["placement"] == "partial" and [b["step"] for b in blind] == [1]


def test_a_placement_from_values_alone_is_still_outvoted_by_later_divergence():
    # sums-add-up needs no recorded ops: where the sums stop adding up in a later step without
    # lineage, that step saw the same kind of evidence and disagrees; it is not "unwatched"
    verdicts = [v(0, "partial", "pre-reduction", "sums-add-up"), v(2, "divergent", "unknown", "divergent"),
                v(3, "divergent", "unknown", "divergent")]
    blind, unwatched, voting, counts, chosen = vote(verdicts, lineage_steps={0, 1})
    assert unwatched == [] and chosen["placement"] == "divergent"


def test_a_point_derived_from_a_lineage_placed_shard_keeps_its_placement():
    # act_fn's output: derived from its input, which only the recorded ops placed
    verdicts = [v(0, "shard(1)", "no-reduction", "derived-from-shard"), v(2, "divergent", "unknown", "divergent"),
                v(3, "divergent", "unknown", "divergent")]
    blind, unwatched, voting, counts, chosen = vote(verdicts, lineage_steps={0, 1})
    assert chosen["placement"] == "shard(1)" and [u["step"] for u in unwatched] == [2, 3]


def test_the_analysis_version_follows_its_sources(tmp_path, monkeypatch):
    """A digest of exporters/analysis/*.py; where no source is there to read (compiled files
    only), the package's version, never a digest of nothing."""
    import os

    from tensor_trace.exporters import analysis

    analysis.version.cache_clear()
    here = analysis.version()
    assert len(here) == 16 and not here.startswith("package-")
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: [n for n in real(p) if not n.endswith(".py")])
    analysis.version.cache_clear()
    try:
        assert analysis.version().startswith("package-") or analysis.version() == "unknown"
    finally:
        monkeypatch.undo()
        analysis.version.cache_clear()
    assert analysis.version() == here


def test_a_dataflow_guess_in_a_step_without_recorded_ops_does_not_outvote_them():
    # SGLang's q_norm input: reshape(-1, head_dim) of a column shard is an interleaved shard(0)
    # by the ops; a step without them derives shard(1) from the latest shard before it
    verdicts = [v(0, "shard(0)", "no-reduction", "lineage-ops"), v(2, "shard(1)", "no-reduction", "derived-from-shard"),
                v(3, "shard(1)", "no-reduction", "derived-from-shard"), v(4, "shard(1)", "no-reduction", "same-values")]
    blind, unwatched, voting, counts, chosen = vote(verdicts, lineage_steps={0, 1})
    assert chosen["placement"] == "shard(0)" and [u["step"] for u in unwatched] == [2, 3, 4]
    # in a step with recorded ops such a rule still votes
    verdicts[1]["step"] = 1
    assert vote(verdicts, lineage_steps={0, 1})[3][("shard(1)", "no-reduction")] == 1


def read(step, placement):
    d = v(step, placement, "no-reduction", "lineage-ops")
    d["items"] = [dict(kind=READ_FROM_ASKED, text="...", refs={})]
    return d


def test_a_shard_read_from_a_no_op_reshape_does_not_outvote_steps_whose_shapes_placed_it():
    # Gemma3 in SGLang: the attention's output [3, 2, 16] viewed (-1, 32) in the extend steps,
    # [1, 32] viewed (-1, 32) in the decode steps (a no-op, whose -1 alone says shard(0))
    verdicts = [v(0, "shard(1)", "no-reduction", "lineage-ops"), read(1, "shard(0)"), read(2, "shard(0)")]
    blind, unwatched, voting, counts, chosen = vote(verdicts, lineage_steps={0, 1, 2})
    assert chosen["placement"] == "shard(1)" and list(counts) == [("shard(1)", "no-reduction")]


def test_a_shard_read_from_a_no_op_reshape_in_every_step_stands():
    # one KV head per rank, k.reshape(-1, head_dim) of [tokens, head_dim]: no step shows more
    verdicts = [read(0, "shard(0)"), read(1, "shard(0)")]
    blind, unwatched, voting, counts, chosen = vote(verdicts, lineage_steps={0, 1})
    assert chosen["placement"] == "shard(0)" and len(voting) == 2


def test_equal_values_in_a_step_of_identical_shards_without_ops_do_not_outvote_the_ops():
    # --load-format dummy: every rank's shard alike, so a step whose ops were not recorded sees
    # only equal values (replicate); the steps whose ops placed the shard decide
    whole = v(2, "replicate", "no-reduction", "equal-values")
    whole["identical_shards"] = True
    verdicts = [v(0, "shard(0)", "no-reduction", "lineage-ops"), whole, dict(whole, step=3)]
    blind, unwatched, voting, counts, chosen = vote(verdicts, lineage_steps={0, 1})
    assert chosen["placement"] == "shard(0)" and [u["step"] for u in unwatched] == [2, 3]
    # without identical shards in those steps, equal values there still vote
    verdicts = [v(0, "shard(0)", "no-reduction", "lineage-ops"), v(2, "replicate", "no-reduction", "equal-values"),
                v(3, "replicate", "no-reduction", "equal-values")]
    assert vote(verdicts, lineage_steps={0, 1})[4]["placement"] == "replicate"
