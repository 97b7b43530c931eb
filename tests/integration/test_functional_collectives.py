"""Functional collectives on real values: a torchtitan-style Llama on PyTorch's TP API (its
collectives are DTensor redistributions, waited later through AsyncCollectiveTensors), two ranks
on gloo, recorded as a user would."""

import json

import pytest

from tt_helpers import ROOT, TENSOR_TRACE, TORCHRUN, base_env, load_traces, record, run_cmd

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "funcol_tp.py")
LAYERS = 2
STEPS = 2


@pytest.fixture(scope="module", params=["plain", "sp"])
def traced(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"funcol_{request.param}") / "t"
    proc = record(out, [TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT, "--plan", request.param,
                        "--steps", str(STEPS)], timeout=180)
    assert f"ok {request.param}" in proc.stdout
    return request.param, out, load_traces(out)


def _by_issue(traces, step):
    """Per collective index of ``step``: (rank 0's, rank 1's) record and their parent paths."""
    per_rank = [rt.steps[step].collectives for rt in traces]
    assert len(per_rank[0]) == len(per_rank[1])
    paths = [{s.index: s.path for s in rt.steps[step].spans} for rt in traces]
    return [(pair, [paths[r][c.parent] for r, c in enumerate(pair)]) for pair in zip(*per_rank)]


def _fp(c, prefix):
    (t,) = [t for t in c.tensors if t.slot.startswith(prefix)]
    assert t.fp is not None, (c.op, c.index, prefix)
    return t


def _close(a, b):
    return a == pytest.approx(b, rel=1e-4, abs=1e-4)


def test_reductions_have_their_issuing_module_and_output_fingerprints(traced):
    plan, _, traces = traced
    assert [rt.identity.get("rank") for rt in traces] == [0, 1]
    reducing = "all_reduce" if plan == "plain" else "reduce_scatter_tensor"
    expected = ["tok_embeddings"] + [f"layers.{i}.{m}" for i in range(LAYERS)
                                     for m in ("attention.wo", "feed_forward.w2")]
    for step in range(STEPS):
        seen = []
        for (c0, c1), (p0, p1) in _by_issue(traces, step):
            assert (c0.op, c0.seq, p0) == (c1.op, c1.seq, p1)  # the same call on both ranks
            assert not c0.flags & 16 and not c1.flags & 16  # waited inside the step
            if c0.op != reducing:
                continue
            seen.append(p0)
            in0, in1 = _fp(c0, "input").fp, _fp(c1, "input").fp
            out0, out1 = _fp(c0, "output").fp, _fp(c1, "output").fp
            if plan == "plain":
                # Every rank holds the whole sum: equal outputs, their sum that of the inputs.
                assert _close(out0, out1)
                assert _close(out0[0], in0[0] + in1[0])
            else:
                # Each rank holds its slice of the sum: the slices add up to the inputs' sum.
                assert _close(out0[0] + out1[0], in0[0] + in1[0])
                assert not _close(out0, out1)
        assert seen == expected, seen


def test_a_rowwise_output_is_the_reductions_output(traced):
    plan, _, traces = traced
    if plan != "plain":
        pytest.skip("the plain plan's RowwiseParallel outputs are the all_reduce results")
    for rt in traces:
        step = rt.steps[1]
        spans = {s.index: s for s in step.spans}
        for c in step.collectives:
            if c.op != "all_reduce":
                continue
            module_out = [t for t in spans[c.parent].tensors if t.slot == "output"][0]
            assert _close(module_out.fp, _fp(c, "output").fp), spans[c.parent].path


def test_sequence_parallel_records_say_their_dims(traced):
    plan, out, traces = traced
    if plan != "sp":
        pytest.skip("sequence parallel only")
    gathers = [f"layers.{i}.{m}" for i in range(LAYERS)
                               for m in ("attention", "feed_forward")]
    for step in range(STEPS):
        pairs = _by_issue(traces, step)
        rs = [(c0, p0) for (c0, _), (p0, _) in pairs if c0.op == "reduce_scatter_tensor"]
        ag = [(pair, p0) for pair, (p0, _) in pairs if pair[0].op == "all_gather_into_tensor"]
        assert all(c.attrs["scatter_dim"] == 1 for c, _ in rs)
        assert all(c.attrs["redistribute"]["to"] == ["S(1)"] for c, _ in rs)
        seq_gathers = [(pair, p) for pair, p in ag if pair[0].attrs.get("gather_dim") == 1]
        assert [p for _, p in seq_gathers if p != "output"] == gathers
        for (c0, c1), _ in seq_gathers:
            # The op gathers along dim 0; the dims say its input was the sequence slice.
            assert _fp(c0, "input").shape == [2, 6, 48] and _fp(c0, "output").shape == [4, 6, 48]
            assert _close(_fp(c0, "output").fp, _fp(c1, "output").fp)
            assert _close(_fp(c0, "output").fp[0], _fp(c0, "input").fp[0] + _fp(c1, "input").fp[0])
    # The merged store carries the attributes.
    proc = run_cmd([TENSOR_TRACE, "query", "sql", "SELECT DISTINCT op, attrs FROM collectives WHERE step = 1",
                    "--trace", str(out), "--json"], env=base_env(), check=True)
    rows = json.loads(proc.stdout)
    dims = {(r["op"], json.loads(r["attrs"]).get("scatter_dim"), json.loads(r["attrs"]).get("gather_dim"))
            for r in rows}
    assert ("reduce_scatter_tensor", 1, None) in dims and ("all_gather_into_tensor", None, 1) in dims
