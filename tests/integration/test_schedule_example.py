"""Fingerprints on a schedule (`record --fingerprint-every N`) on real traced runs of the example
(torchrun, 2 ranks, gloo): values only in the scheduled steps, the same verdicts as a run that
fingerprints every step, `query placement --step` saying when a step has no values, `compare`
and `check` reading only fingerprinted steps and still finding a planted double reduction."""

import json

import pytest

from tt_helpers import SMALL_MODEL, TENSOR_TRACE, load_traces, run_cmd

STEPS = 12
EXAMPLE = (*SMALL_MODEL, "--steps", str(STEPS))
EVERY = 4
FIRST = 4  # tracer/steps.py FINGERPRINT_FIRST
SCHEDULED = [s for s in range(STEPS) if s < FIRST or s % EVERY == 0]  # one kind of step: 0-4, 8
UNSCHEDULED = [s for s in range(STEPS) if s not in SCHEDULED]
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def runs(example_traces, tmp_path_factory):
    d = tmp_path_factory.mktemp("fp-schedule")
    sched = ("--fingerprint-every", str(EVERY))
    return dict(sched=example_traces.copy(2, d / "sched", EXAMPLE, sched),
                sched2=example_traces.copy(2, d / "sched2", EXAMPLE, sched),
                every=example_traces.copy(2, d / "every", EXAMPLE, ("--fingerprint-every", "1")),
                double=example_traces.copy(2, d / "double", (*EXAMPLE, "--bug-double-reduce", "1"), sched))


def tt_json(*args, code=0):
    r = run_cmd([TENSOR_TRACE, *args, "--json"], timeout=240)
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return json.loads(r.stdout)


def test_fingerprints_exactly_on_the_scheduled_steps(runs):
    traces = load_traces(runs["sched"])
    assert [t.rank for t in traces] == [0, 1]
    for t in traces:
        assert sorted(t.steps) == list(range(STEPS))
        assert all(st.spans for st in t.steps.values())  # spans on every step
        assert sorted(s for s, st in t.steps.items() if st.fingerprints) == SCHEDULED
        assert sorted(s for s, st in t.steps.items() if st.fingerprinted) == SCHEDULED
        for s in UNSCHEDULED:
            assert all(x.fp is None for sp in t.steps[s].spans for x in sp.tensors)
            assert all(x.fp is None for c in t.steps[s].collectives for x in c.tensors)
    steps = tt_json("query", "steps", "--trace", runs["sched"])
    assert sorted({r["step"] for r in steps if r["fingerprinted"]}) == SCHEDULED


def test_verdicts_equal_those_of_every_step_fingerprinted(runs):
    def verdicts(name):
        return {p["point"]: (p["placement"], p["reduction"])
                for p in tt_json("query", "placement", "--trace", runs[name])}

    sched, every = verdicts("sched"), verdicts("every")
    assert sched == every
    assert sched["model.layers.0.mlp:output"] == ("replicate", "post-reduction")
    assert sched["model.layers.0.mlp.act_fn:output"] == ("shard(2)", "no-reduction")


def test_placement_at_an_unfingerprinted_step_says_so(runs):
    step = UNSCHEDULED[0]
    pts = tt_json("query", "placement", "model.layers.0.mlp", "--step", str(step), "--trace", runs["sched"])
    note = pts[0]["evidence"][0]
    assert note.startswith(f"step {step} was not fingerprinted"), pts[0]["evidence"]
    assert ", ".join(map(str, SCHEDULED)) in note and "--fingerprint-every 1" in note
    # no values, no placement: never a verdict read from their absence
    assert (pts[0]["placement"], pts[0]["reduction"]) == ("unknown", "unknown")
    assert any("--fingerprint-every skipped" in e for e in pts[0]["evidence"])
    at_scheduled = tt_json("query", "placement", "model.layers.0.mlp", "--step", "8", "--trace", runs["sched"])
    assert (at_scheduled[0]["placement"], at_scheduled[0]["reduction"]) == ("replicate", "post-reduction")
    assert not any("not fingerprinted" in e for e in at_scheduled[0]["evidence"])


def test_compare_reads_only_steps_fingerprinted_in_both(runs):
    res = tt_json("compare", runs["sched"], runs["sched2"])
    assert res["steps"] == [[s, s] for s in SCHEDULED]
    assert res["steps_not_fingerprinted"] == [[s, s] for s in UNSCHEDULED]
    assert res["first_divergence"] is None and {p["status"] for p in res["points"]} == {"same"}
    text = run_cmd([TENSOR_TRACE, "compare", runs["sched"], runs["every"]], timeout=240)
    assert text.returncode == 0, text.stderr
    assert f"{len(SCHEDULED)} step pair(s) compared" in text.stdout
    assert f"{len(UNSCHEDULED)} more step pair(s) not compared: not fingerprinted in both runs" in text.stdout


def test_planted_double_reduction_still_found(runs):
    res = tt_json("compare", runs["sched"], runs["double"], code=1)
    f = res["first_divergence"]
    assert f["point"] == "model.layers.1.self_attn.o_proj:output", f
    assert f["step_a"] in SCHEDULED and f["step_b"] in SCHEDULED
    found = tt_json("check", "--trace", runs["double"], code=1)
    assert [x["kind"] for x in found] == ["double-reduction"], found
    assert tt_json("check", "--trace", runs["sched"]) == []
