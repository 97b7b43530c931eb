"""A program on PyTorch's TP API (DTensor) at 2 ranks: every DTensor module output and parameter
is recorded as the rank's local tensor, fingerprinted from its values, with its placement; no
tracer error, and no collective the program did not issue."""

import json
import math
from pathlib import Path

import pytest

from tt_helpers import TORCHRUN, load_traces, record

SCRIPT = Path(__file__).parent / "scripts" / "dtensor_sp.py"


def _close(a, b):
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)


@pytest.mark.parametrize("plan", [[], ["--no-sp"]], ids=["sequence-parallel", "tensor-parallel"])
def test_dtensor_outputs_and_parameters_are_local_with_placements(tmp_path, plan):
    out, truth_dir = tmp_path / "t", tmp_path / "truth"
    record(out, [TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT, truth_dir, "--dtensor-out", *plan],
           timeout=240)
    traces = load_traces(out)
    assert [t.rank for t in traces] == [0, 1]
    for rt in traces:
        rank = rt.rank
        truth = json.loads((truth_dir / f"rank{rank}.json").read_text())
        assert rt.errors == [] and rt.end["stats"]["errors"] == 0
        # sequence parallel reduce-scatters and gathers; the tracer's own reductions of a
        # DTensor once added all-reduces of their own
        ops = {c.op for st in rt.steps.values() for c in st.collectives}
        assert "all_reduce" not in ops if not plan else "all_reduce" in ops
        seen = {}
        for step, st in rt.steps.items():
            for sp in st.spans:
                for t in sp.tensors:
                    if t.slot == "output" and t.meta and t.meta["kind"] == "DTensor":
                        seen[(step, sp.path, sp.call)] = t
        want = {(s, p, c): (shape, q, sq) for s, p, c, shape, q, sq in truth["outputs"]}
        assert set(seen) == set(want)
        # the final norm's output (SequenceParallel) and the logits (use_local_output=False)
        paths = {p for _, p, _ in want}
        assert "output" in paths and ("norm" in paths) == (not plan)
        for key, t in seen.items():
            shape, s, sq = want[key]
            assert t.shape == shape and t.fp is not None, key
            assert _close(t.fp[0], s) and _close(t.fp[1], sq), (key, t.fp, (s, sq))
            meta = t.meta
            assert meta["mesh_ranks"] == [0, 1] and meta["coordinate"] == [rank], key
            assert meta["mesh_dim_names"] == ["tp"]
            if key[1] in ("output", ""):  # the logits, also the step's (the root's) output
                assert meta["placements"] == ["Replicate()"] and meta["global_shape"] == shape == [2, 12, 96]
            else:  # a sequence-parallel norm: this rank's half of the sequence
                assert meta["placements"] == ["Shard(1)"] and meta["global_shape"] == [2, 12, 48]
                assert shape == [2, 6, 48] and meta["global_offset"] == [0, 6 * rank, 0]
        params = {(path, p.slot): p for path, plist in rt.params.items() for p in plist}
        assert len(truth["params"]) >= 16
        for path, name, shape, s, sq in truth["params"]:
            p = params[(path, name)]
            assert p.shape == shape and p.meta["kind"] == "DTensor", (path, name)
            assert _close(p.fp[0], s) and _close(p.fp[1], sq), (path, name, p.fp, (s, sq))
        wq = params[("layers.0.attention.wq", "weight")]
        assert wq.shape == [24, 48] and wq.meta["global_shape"] == [48, 48]
        assert wq.meta["placements"] == ["Shard(0)"] and wq.meta["global_offset"] == [24 * rank, 0]
        # the rotary table, a complex buffer passed to every block
        freqs = [t for sp in rt.steps[0].spans if sp.path == "layers.0" for t in sp.tensors
                 if t.slot == "input.1"]
        assert [(t.shape, t.meta) for t in freqs] == [([12, 4], {"kind": "complex", "fp": "view_as_real"})]
        assert _close(freqs[0].fp[1], 12 * 4)  # |z| = 1 everywhere
