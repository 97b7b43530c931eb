"""Live OTLP's streaming policy: collectives always, module spans of sampled steps; what is left
out is counted and reported apart from drops."""

from tensor_trace import schema
from tensor_trace.tracer.live_otlp import STREAM_FIRST, LiveOTLP, StreamPolicy

ROOT, OTHER_ROOT = 1, 2


def _step(step, root=ROOT, mode="decode"):
    recs = [(schema.STEP_BEGIN, step, root, 1000 * step, {"forward_mode": mode})]
    recs += [(schema.SPAN, step, i, -1, 3, 0, 10 * i, 5, -1, None, None, 0, 0) for i in range(3)]
    recs.append((schema.COLLECTIVE, step, 3, 0, 4, -1, 5, step, 40, 5, -1, None, None, 0, 0, 64))
    return recs


def _streamed(records):
    """{step: (module spans, collective spans)} of what passed the policy."""
    out = {}
    for rec in records:
        if rec[0] in (schema.SPAN, schema.COLLECTIVE):
            mods, colls = out.get(rec[1], (0, 0))
            out[rec[1]] = (mods + (rec[0] == schema.SPAN), colls + (rec[0] == schema.COLLECTIVE))
    return out


def test_first_steps_of_each_kind_then_every_nth_stream_module_spans():
    policy = StreamPolicy(module_every=4)
    records = [r for s in range(12) for r in _step(s)]
    records += [r for s in range(12, 15) for r in _step(s, mode="extend")]
    streamed = _streamed(policy.filter(records))
    sampled = {s for s, (mods, _) in streamed.items() if mods}
    # decode: steps 0 and 1 (the first STREAM_FIRST), then n % 4 == 0 of that kind: 4 and 8;
    # extend is a kind of its own, so its first two stream too.
    assert STREAM_FIRST == 2 and sampled == {0, 1, 4, 8, 12, 13}
    assert all(streamed[s] == ((3 if s in sampled else 0), 1) for s in range(15))  # collectives always
    assert policy.left_out == 3 * (15 - len(sampled))


def test_every_step_streams_with_module_every_one():
    policy = StreamPolicy(module_every=1)
    records = [r for s in range(10) for r in _step(s)]
    assert policy.filter(records) == records and policy.left_out == 0


def test_batches_split_mid_step_keep_the_step_decision():
    policy = StreamPolicy(module_every=8)
    records = [r for s in range(4) for r in _step(s)]
    batches = [records[i:i + 3] for i in range(0, len(records), 3)]
    streamed = _streamed([r for b in batches for r in policy.filter(b)])
    assert {s for s, (mods, _) in streamed.items() if mods} == {0, 1}
    assert policy.left_out == 6


def test_left_out_is_reported_at_exit_apart_from_drops(capsys):
    live = LiveOTLP("http://127.0.0.1:9", "run", {"host": "h", "pid": 1}, module_every=4)
    for s in range(8):
        live.offer(_step(s))
    queued = [r for batch in live.queue for r in batch]
    assert sum(r[0] == schema.SPAN for r in queued) == 3 * 3  # steps 0, 1, 4
    assert sum(r[0] == schema.COLLECTIVE for r in queued) == 8
    stats = live.shutdown(timeout_s=0.1)  # never started: nothing sent, nothing dropped
    assert stats == dict(live_otlp_sent=0, live_otlp_dropped=0, live_otlp_left_out=15)
    err = capsys.readouterr().err
    assert "0 dropped, 15 module spans left out by the policy (every 4th step)" in err


def test_an_ended_step_leaves_no_state_behind():
    # A server runs for millions of steps: the policy keeps no step number once a step has ended.
    policy = StreamPolicy(module_every=4)
    for s in range(40):
        policy.filter(_step(s) + [(schema.STEP_END, s, 1000 * s + 500, 3, 1)])
    assert policy.sampled == set() and policy.left_out == 3 * (40 - (2 + 9))
