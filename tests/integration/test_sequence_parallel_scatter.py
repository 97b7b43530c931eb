"""A sequence-parallel region entered by a local slice (Megatron's
``scatter_to_sequence_parallel_region``, no collective): each rank's part of a whole tensor is
``shard(0)`` of the sequence, found from the recorded ``getitem`` (1/N of the whole along that
dim) and the values that differ across ranks; a slice the same on every rank stays whole.
Before, the part and everything computed from it were ``divergent``."""

from pathlib import Path

from tt_helpers import TORCHRUN, placements, record

SCRIPT = Path(__file__).parent / "scripts" / "sp_scatter.py"


def test_each_ranks_sequence_part_is_a_shard_of_the_sequence(tmp_path):
    out = tmp_path / "t"
    record(out, [TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT], timeout=240)
    pts = placements(out)
    p = pts["embedding:output"]
    assert (p["placement"], p["reduction"], p["rule"]) == ("shard(0)", "no-reduction", "lineage-ops"), p["evidence"]
    assert any("a slice of 1/2 of a whole tensor along its dim 0" in e for e in p["evidence"]), p["evidence"]
    assert (pts["norm:output"]["placement"], pts["norm:output"]["reduction"]) == ("shard(0)", "no-reduction")
    assert (pts["embedding.word:output"]["placement"]) == "replicate"


def test_a_slice_the_same_on_every_rank_is_whole(tmp_path):
    out = tmp_path / "t"
    record(out, [TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT, "--same-part"], timeout=240)
    p = placements(out)["embedding:output"]
    assert (p["placement"], p["reduction"]) == ("replicate", "no-reduction"), p["evidence"]
