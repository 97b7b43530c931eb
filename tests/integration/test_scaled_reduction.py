"""A reduction's output scaled by a number between modules, with sums the fingerprints cannot
confirm the scale by (exactly zero here; near zero with dummy weights: a held-out real SGLang
Granite run, not written here, judged its norms' inputs no-reduction). The recorded op (a
"mul" node with its factor) carries the reduction's output on: post-reduction."""

from pathlib import Path

from tt_helpers import TORCHRUN, placements, record

SCRIPT = Path(__file__).parent / "scripts" / "scaled_reduction.py"


def test_a_reduction_output_scaled_by_a_number_is_post_reduction(tmp_path):
    out = tmp_path / "t"
    record(out, [TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT], timeout=240)
    pts = placements(out)
    assert (pts["o_proj:output"]["placement"], pts["o_proj:output"]["reduction"]) == ("replicate", "post-reduction")
    p = pts["norm:input.0"]
    assert (p["placement"], p["reduction"], p["rule"]) == ("replicate", "post-reduction", "reduction-output"), p
    assert any("carried on by recorded ops: mul 0.25" in e for e in p["evidence"]), p["evidence"]
