"""A keyword input that the TP API gathers before the module's call (a held-out TP API program,
not written here): its placement was right, but no collective was named, as it was for the same
values as the previous module's output; the gather, issued by the module's own call before its
span took the inputs, is named now."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tensor_trace.cli import main
from tt_helpers import TORCHRUN, record

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "scripts" / "kwarg_gather.py"


def test_a_keyword_input_gathered_by_its_call_names_the_gather(tmp_path):
    out = tmp_path / "t"
    record(out, [TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT], timeout=240)
    r = CliRunner().invoke(main, ["query", "reduction", "head:input.h", "--trace", str(out), "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)
    assert (p["placement"], p["verdict"]) == ("shard(1)", "no-reduction"), p["evidence"]
    assert p["collective"] and p["collective"]["op"].startswith("all_gather"), p
    assert p["collective"]["module"] == "head", p["collective"]
