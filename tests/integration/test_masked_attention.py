"""An additive attention mask as HuggingFace transformers' eager attention builds it (0, and
``torch.finfo(float32).min`` where a position may not attend), handed to every layer by keyword:
the same on every rank, so ``replicate`` / ``no-reduction``. Its sum of squares (about 1e78)
is past float32's range: the fingerprint is kept in float64 (WIDE_FINGERPRINTS). Before, its
fingerprint was +-inf and the point ``unknown``. A true -inf mask has no finite sums: its finite
values and how many -inf it holds are recorded (NONFINITE_FINGERPRINTS), the same on every rank:
``replicate`` too (it was ``unknown``)."""

import json
from pathlib import Path

from click.testing import CliRunner

from tensor_trace.cli import main
from tt_helpers import TORCHRUN, placements, record

SCRIPT = Path(__file__).parent / "scripts" / "masked_attention.py"
MASKS = ("layers.0:input.attention_mask", "layers.0.attn:input.attention_mask",
         "layers.1:input.attention_mask", "layers.1.attn:input.attention_mask")


def test_a_finfo_min_mask_is_replicated(tmp_path):
    out = tmp_path / "t"
    record(out, [TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT], timeout=240)
    pts = placements(out)
    for name in MASKS:
        p = pts[name]
        assert (p["placement"], p["reduction"], p["rule"]) == ("replicate", "no-reduction", "equal-values"), p
    r = CliRunner().invoke(main, ["query", "sql", "SELECT COUNT(*), MIN(sumsq) FROM wide_fingerprints",
                                  "--trace", str(out), "--json"])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)
    n, least = row.values()
    assert n >= 8 and least > 1e78  # 2 steps x 2 ranks x the mask (its repeats share its index)
    assert pts["layers.0.attn:output"]["reduction"] == "post-reduction"


def test_a_minus_inf_mask_is_replicated(tmp_path):
    out = tmp_path / "t"
    record(out, [TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT, "--mask-value", "inf"], timeout=240)
    pts = placements(out)
    for name in MASKS:
        p = pts[name]
        assert (p["placement"], p["reduction"], p["rule"]) == ("replicate", "no-reduction", "equal-values"), p
        assert any("the same non-finite values (28 -inf)" in e for e in p["evidence"]), p["evidence"]
    assert pts["layers.0.attn:output"]["reduction"] == "post-reduction"
