"""Fingerprints, immediate and deferred (the GPU path, exercised here on CPU tensors)."""

import math

import pytest
import torch

from tensor_trace import schema
from tensor_trace.format.fingerprints import fingerprint_pairs
from tensor_trace.tracer.fingerprint import StepFingerprints


def _values(records):
    out = {}
    for kind, step, first, data, indices in (r for r in records if r[0] == schema.FINGERPRINTS):
        for i, s, q in fingerprint_pairs(first, data, indices):
            out[(step, i)] = (s, q)
    return out


@pytest.mark.parametrize("defer", [False, True])
def test_values_and_indices(defer):
    fps = StepFingerprints(defer_cuda=False, defer_cpu=defer)
    torch.manual_seed(0)
    a = torch.randn(4, 8)
    b = torch.randn(3, 5, dtype=torch.bfloat16)
    ids = torch.tensor([1, 2, 3])
    assert fps.add([a, b]) == 0
    assert fps.add([ids, a]) == 2  # a again: a cached value, no recomputation
    fps.finish_step(7)
    vals = _values(fps.collect(wait=True))
    for i, t in ((0, a), (1, b), (2, ids), (3, a)):
        s, q = vals[(7, i)]
        f = t.float()
        assert math.isclose(s, f.sum().item(), rel_tol=1e-4, abs_tol=1e-4)
        assert math.isclose(q, f.pow(2).sum().item(), rel_tol=1e-4)


def test_deferred_tensor_materialised_before_in_place_update():
    fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
    x = torch.randn(16)
    before = x.sum().item()
    fps.add([x])
    fps.materialize([x])  # what a collective does before updating its input in place
    x.mul_(3)
    fps.finish_step(0)
    (s, _), = _values(fps.collect(wait=True)).values()
    assert math.isclose(s, before, rel_tol=1e-5, abs_tol=1e-5)


def test_deferred_tensor_updated_in_place_is_reported_not_guessed():
    fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
    x = torch.randn(16)
    fps.add([x])
    x.add_(1)  # version counter moves; the value at capture time is gone
    fps.finish_step(0)
    assert _values(fps.collect(wait=True)) == {}
    assert fps.stale == 1


def test_inference_tensor_reuse_is_one_shot():
    fps = StepFingerprints(defer_cuda=False)
    with torch.inference_mode():
        x = torch.randn(8)
        fps.add([x])  # output of module A
        fps.add([x], store=False)  # input of module B: reuses A's value
        x.mul_(2)  # B updates its input in place; no version counter tells us
        fps.add([x])  # output of B: must be computed again, not reused
    fps.finish_step(0)
    vals = _values(fps.collect(wait=True))
    assert vals[(0, 0)] == vals[(0, 1)]
    assert math.isclose(vals[(0, 2)][0], 2 * vals[(0, 0)][0], rel_tol=1e-5, abs_tol=1e-5)


def test_host_values_through_numpy_equal_torch_and_fall_back_without_it(monkeypatch):
    from tensor_trace.tracer import fingerprint as fp_mod, host_values

    # (the numpy path: not the C readers an earlier traced session in this process may have taken)
    monkeypatch.setattr(host_values, "native_pair", None)
    torch.manual_seed(1)
    full = torch.randn(6, 10)
    cases = [full, full[:, 2:7], torch.tensor([3, 1, 4, 1, 5]), torch.randn(5, dtype=torch.float64)]
    for t in cases:
        s, q = fp_mod._host_pair(t)
        f = t.double()
        assert math.isclose(s, f.sum().item(), rel_tol=1e-5, abs_tol=1e-5)
        assert math.isclose(q, f.pow(2).sum().item(), rel_tol=1e-5)
    assert fp_mod._host_pair(torch.randn(3, dtype=torch.bfloat16)) is None  # numpy has no bf16
    assert type(fp_mod._pair(torch.randn(3, dtype=torch.bfloat16))[0]) is torch.Tensor
    monkeypatch.setattr(host_values, "_numpy", [None])  # no numpy: torch reductions, same values
    assert fp_mod._host_pair(full) is None
    s, l2 = fp_mod._pair(full)
    assert math.isclose(float(s), full.sum().item(), rel_tol=1e-5, abs_tol=1e-5)


@pytest.mark.parametrize("defer", [False, True])
def test_repeats_of_the_last_output_are_found_by_identity(defer):
    fps = StepFingerprints(defer_cuda=False, defer_cpu=defer)
    x = torch.randn(8)
    y = torch.randn(8)
    assert fps.add_one(x) == 0
    # the next module's input: the same value, so the same index (no new value, no repeat)
    assert fps.add_one(x, False) == 0
    assert fps.add_one(x, False) == 0
    assert fps.add_one(y) == 1
    assert fps.count == 2 and fps._dups == []
    if defer:
        assert len(fps._def_ts) == 2
    else:
        assert fps._host_idx == [0, 1]
    fps.finish_step(0)
    vals = _values(fps.collect(wait=True))
    assert sorted(vals) == [(0, 0), (0, 1)] and vals[(0, 0)] != vals[(0, 1)]
    assert math.isclose(vals[(0, 0)][0], x.sum().item(), rel_tol=1e-5, abs_tol=1e-5)


def test_immediate_repeat_needs_an_unchanged_version():
    fps = StepFingerprints(defer_cuda=False, defer_cpu=False)
    x = torch.randn(8)
    fps.add_one(x)
    x.mul_(2)  # between the producer's output and the consumer's input
    fps.add_one(x, False)
    fps.finish_step(0)
    vals = _values(fps.collect(wait=True))
    assert math.isclose(vals[(0, 1)][0], x.sum().item(), rel_tol=1e-5, abs_tol=1e-5)
    assert math.isclose(vals[(0, 1)][0], 2 * vals[(0, 0)][0], rel_tol=1e-5, abs_tol=1e-5)


def test_deferred_repeat_of_an_updated_tensor_has_no_value_and_materialize_breaks_the_chain():
    fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
    x = torch.randn(8)
    fps.add_one(x)
    fps.add_one(x, False)
    x.add_(1)  # after both sightings: the deferred value would be a later one
    fps.finish_step(0)
    assert _values(fps.collect(wait=True)) == {} and fps.stale == 1
    # A collective reduces its input at once before updating it in place; the tensor's next
    # sighting is then a new value, not a repeat of the old one.
    y = torch.ones(4)
    fps.add_one(y)
    fps.materialize([y])
    y.mul_(5)
    fps.forget([y])
    fps.add_one(y, False)
    fps.finish_step(1)
    vals = _values(fps.collect(wait=True))
    assert vals[(1, 0)][0] == 4.0 and vals[(1, 1)][0] == 20.0


def test_held_tensors_stay_within_the_bound(monkeypatch):
    from tensor_trace.tracer import fingerprint as fp_mod

    monkeypatch.setattr(fp_mod, "DEFER_MAX_NUMEL", 64)
    fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
    fps.defer_bytes = 1024  # 256 fp32 values
    torch.manual_seed(0)
    tensors = [torch.randn(48) for _ in range(40)]
    most_held = 0
    for t in tensors:
        fps.add_one(t)
        held = sum(x.numel() * 4 for x in fps._def_ts if x is not None)
        assert held == fps._def_bytes
        most_held = max(most_held, held)
    # Between hook calls at most the bound is held (within one, the bound plus the tensor that
    # crossed it, reduced at once with the rest).
    assert 1024 - 48 * 4 < most_held <= 1024
    big = torch.randn(65)  # above DEFER_MAX_NUMEL: reduced at once, never held
    fps.add_one(big)
    assert all(x is not big for x in fps._def_ts)
    fps.finish_step(0)
    vals = _values(fps.collect(wait=True))
    assert len(vals) == 41  # every value, whether reduced mid-step, at the end or at once
    for i, t in enumerate(tensors + [big]):
        assert math.isclose(vals[(0, i)][0], t.sum().item(), rel_tol=1e-4, abs_tol=1e-4)


@pytest.mark.parametrize("defer", [False, True])
def test_values_made_under_inference_mode_are_collected_outside_it(defer):
    # A GPU step's copies are often collected later: at a later step, or at stop, outside the
    # inference_mode the step ran under (the values are then inference tensors).
    fps = StepFingerprints(defer_cuda=False, defer_cpu=defer)
    with torch.inference_mode():
        x = torch.randn(8, 4)
        ids = torch.arange(5)
        fps.add_one(x)
        fps.add([ids, x * 2])
        fps.finish_step(0)
    vals = _values(fps.collect(wait=True))
    for i, t in enumerate((x, ids, x * 2)):
        f = t.double()
        assert math.isclose(vals[(0, i)][0], f.sum().item(), rel_tol=1e-4, abs_tol=1e-4)
        assert math.isclose(vals[(0, i)][1], f.pow(2).sum().item(), rel_tol=1e-4)


def test_captured_tensor_held_twice_keeps_every_repeat():
    # Under capture the flush makes the second hold of a tensor a repeat of its first row; a
    # hook's repeat of that second sighting must still get the value (a repeat of a repeat).
    fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
    fps.begin_capture()
    x, y = torch.randn(8), torch.randn(8)
    fps.add_one(x)  # 0: held
    fps.add_one(y)  # 1: held
    fps.add_one(x, False)  # 2: seen again (not the last tensor added)
    fps.add_one(x, False)  # 3: and again
    captured = fps.finish_capture()
    assert captured.static.shape[0] == 2  # x and y: one row each
    for step in (5, 6):  # a step of its own each: fingerprints from 0 again
        fps.add_replay(step, fps.reserve(captured.count), captured)
        fps.reset()
    records = fps.collect(wait=True)
    # one record a replay, repeats in place, no indices (format 2)
    assert [(r[1], r[2], len(r[3]) // 8, r[4]) for r in records] == [(5, 0, 4, None), (6, 0, 4, None)]
    vals = _values(records)
    assert sorted(vals) == [(s, i) for s in (5, 6) for i in range(4)]
    assert vals[(5, 0)] == vals[(5, 2)] == vals[(5, 3)] != vals[(5, 1)]
    assert vals[(6, 0)] == vals[(6, 2)] == vals[(6, 3)] == vals[(5, 0)]
    assert list(captured.plans) == [0]  # the record layout was resolved once, for both replays


def test_hold_bound_from_the_environment():
    import os
    import subprocess
    import sys

    code = "from tensor_trace.tracer import fingerprint as f; print(f.DEFER_BYTES >> 20)"
    for value, expect in (("64", "64"), ("junk", "512"), (None, "512")):
        env = dict(os.environ)
        env.pop("TENSOR_TRACE_FP_HOLD_MIB", None)
        if value is not None:
            env["TENSOR_TRACE_FP_HOLD_MIB"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.stdout.strip() == expect, out.stderr[-500:]


def test_under_capture_a_tensor_is_held_once_per_bucket():
    # Held twice, a tensor would count twice against the bucket's bytes (more buckets, more
    # kernels in every replay); a second sighting under capture is a repeat instead.
    fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
    fps.begin_capture()
    x, y = torch.randn(8), torch.randn(8)
    fps.add_one(x)
    fps.add_one(y)
    fps.add([x, y], store=False)  # both seen again, not right after they were added
    assert len(fps._def_ts) == 2 and fps._def_bytes == 2 * 8 * 4
    assert fps._dups == [(2, 0), (3, 1)]
    captured = fps.finish_capture()
    fps.add_replay(1, fps.reserve(captured.count), captured)
    vals = _values(fps.collect(wait=True))
    assert vals[(1, 0)] == vals[(1, 2)] and vals[(1, 1)] == vals[(1, 3)]


@pytest.mark.parametrize("defer", [False, True])
def test_inputs_that_are_the_previous_calls_outputs_are_repeats(defer):
    # rotary returns (q, k); attention receives (q, k, v); o_proj receives attention's output
    fps = StepFingerprints(defer_cuda=False, defer_cpu=defer)
    q, k, v, o = (torch.randn(8) for _ in range(4))
    assert fps.add([q, k]) == 0  # rotary's outputs: 0, 1
    assert fps.add([q, k, v], store=False) == 2  # attention's inputs: 2, 3 repeat 0, 1; v is 4
    assert fps.add([o]) == 5
    o_in = fps.add_one(o, False)  # o_proj's input
    if defer:
        assert len(fps._def_ts) == 4  # q, k, v, o held once each
        assert fps._dups == [(2, 0), (3, 1)] and o_in == 5
    fps.finish_step(0)
    vals = _values(fps.collect(wait=True))
    assert vals[(0, 2)] == vals[(0, 0)] and vals[(0, 3)] == vals[(0, 1)]
    assert vals[(0, o_in)] == vals[(0, 5)]
    for i, t in ((0, q), (1, k), (4, v), (5, o)):
        assert math.isclose(vals[(0, i)][0], t.sum().item(), rel_tol=1e-5, abs_tol=1e-5)


def test_a_collective_ends_the_repeats_of_the_previous_outputs():
    fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
    q, k = torch.randn(8), torch.randn(8)
    fps.add([q, k])
    fps.materialize([k])  # k is about to be updated in place (an all_reduce)
    k.mul_(2)
    fps.forget([k])
    assert fps.add([q, k], store=False) == 2
    assert fps._dups == []  # both held again: after a collective nothing is taken for a repeat
    fps.finish_step(0)
    vals = _values(fps.collect(wait=True))
    assert math.isclose(vals[(0, 1)][0] * 2, vals[(0, 3)][0], rel_tol=1e-5, abs_tol=1e-5)


def test_a_step_is_one_record_in_index_order_repeats_included():
    """Deferred values, host values (integer ids) and repeats come from apart, each with its own
    indices: a step is still written as one record of consecutive indices, no index bytes
    (format 2), the values those indices had."""
    fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
    q, k, v = (torch.randn(8) for _ in range(3))
    ids = torch.tensor([3, 1, 2])
    assert fps.add([q, k]) == 0  # deferred
    assert fps.add([ids]) == 2  # on the host at once
    assert fps.add([q, k, v], store=False) == 3  # 3, 4 repeat 0, 1
    assert fps.add([ids, v]) == 6
    fps.finish_step(4)
    records = fps.collect(wait=True)
    assert [(step, first, len(data) // 8, indices) for _, step, first, data, indices in records] == [(4, 0, 8, None)]
    vals = _values(records)
    assert vals[(4, 3)] == vals[(4, 0)] and vals[(4, 4)] == vals[(4, 1)]
    for i, t in ((0, q), (1, k), (2, ids), (5, v), (6, ids), (7, v)):
        assert math.isclose(vals[(4, i)][0], t.float().sum().item(), rel_tol=1e-5, abs_tol=1e-5)


def _wide(records):
    from tensor_trace.format.fingerprints import decode_wide

    out = {}
    for r in records:
        if r[0] == schema.WIDE_FINGERPRINTS:
            decode_wide(r[2], out, key=lambda i, step=r[1]: (step, i))
    return out


def test_values_past_float32s_range_are_kept_in_float64(monkeypatch):
    """A float32 attention mask of finfo.min (its sum of squares about 1e78) and a float64
    tensor of 1e30s: their FINGERPRINTS values are +-inf, their exact sums a WIDE_FINGERPRINTS
    record's; the step's other values are kept (a float64 value past float32's range raised
    OverflowError and lost the step's records). Through numpy here; test_native_host.py runs
    it with the extension's readers."""
    from tensor_trace.tracer import host_values

    monkeypatch.setattr(host_values, "native_pair", None)
    monkeypatch.setattr(host_values, "native_add", None)
    check_values_past_float32s_range()


def check_values_past_float32s_range():
    fps = StepFingerprints(defer_cuda=False, defer_cpu=False)
    mask = torch.full((1, 1, 8, 8), torch.finfo(torch.float32).min).triu(1)
    big = torch.full((4,), 1e30, dtype=torch.float64)
    small = torch.arange(6.0)
    assert fps.add([mask, big, small]) == 0
    assert fps.add([mask]) == 3  # the same tensor again: a repeat of index 0
    fps.finish_step(5)
    records = fps.collect(wait=True)
    vals, wide = _values(records), _wide(records)
    assert vals[(5, 0)] == (float("-inf"), float("inf"))
    assert vals[(5, 2)] == (15.0, 55.0)
    m = mask.double()
    for i, t in ((0, m), (1, big), (3, m)):
        s, q = wide[(5, i)]
        assert math.isclose(s, t.sum().item(), rel_tol=1e-12) and math.isclose(q, t.pow(2).sum().item(), rel_tol=1e-12)
    assert (5, 2) not in wide


def test_a_bfloat16_cpu_mask_past_float32s_range_is_kept_in_float64():
    """A bfloat16 attention mask of its finfo.min on a CPU (transformers' eager mask in a bf16
    model): torch's float32 sums overflow; the float64 ones are a WIDE_FINGERPRINTS value, and
    the other bf16 tensors keep their float32 sums."""
    fps = StepFingerprints(defer_cuda=False, defer_cpu=False)
    mask = torch.full((1, 1, 6, 6), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16).triu(1)
    other = torch.randn(3, 4, dtype=torch.bfloat16)
    fps.add([mask, other])
    fps.finish_step(2)
    records = fps.collect(wait=True)
    vals, wide = _values(records), _wide(records)
    assert vals[(2, 0)] == (float("-inf"), float("inf"))
    m = mask.double()
    assert wide == {(2, 0): (m.sum().item(), m.square().sum().item())}
    s, q = vals[(2, 1)]
    f = other.float()
    assert math.isclose(s, f.sum().item(), rel_tol=1e-5, abs_tol=1e-5)
    assert math.isclose(q, f.square().sum().item(), rel_tol=1e-5)


def _nonfinite(records):
    from tensor_trace.format.fingerprints import decode_nonfinite

    return {(r[1], e[0]): tuple(e[1:]) for r in records if r[0] == schema.NONFINITE_FINGERPRINTS
            for e in decode_nonfinite(r[2])}


def _add_one(fps, t, add_one_host):
    i = add_one_host(fps, t, True) if add_one_host is not None else None
    return fps.add_one(t, True) if i is None else i


def test_values_that_are_not_finite_are_fingerprinted_over_their_finite_values(monkeypatch):
    """An attention mask of -inf has sums of -inf and +inf on every rank, whatever it holds: a
    NONFINITE_FINGERPRINTS record gives its finite values' sums and how many +inf, -inf and NaN
    it holds, for it and for each repeat of it (a mask handed to every layer). Through numpy
    here; test_native_host.py runs it with the extension's readers."""
    from tensor_trace.tracer import host_values

    monkeypatch.setattr(host_values, "native_pair", None)
    monkeypatch.setattr(host_values, "native_add", None)
    check_nonfinite_values()


def check_nonfinite_values(add_one_host=None):
    fps = StepFingerprints(defer_cuda=False, defer_cpu=False)
    mask = torch.full((4, 4), float("-inf")).triu(1)  # 6 -inf above the diagonal, 10 zeros
    bad = torch.tensor([1.0, float("nan"), float("inf"), -2.0, float("-inf")])
    x = torch.arange(4.0)
    assert [_add_one(fps, t, add_one_host) for t in (x, mask, bad, mask)] == [0, 1, 2, 3]
    assert fps.add([mask, x]) == 4  # repeats of indices 1 and 0
    fps.finish_step(7)
    records = fps.collect(wait=True)
    vals, nonfinite = _values(records), _nonfinite(records)
    assert vals[(7, 1)] == (float("-inf"), float("inf")) and vals[(7, 0)] == (6.0, 14.0)
    assert nonfinite == {(7, 1): (0.0, 0.0, 0, 6, 0), (7, 3): (0.0, 0.0, 0, 6, 0), (7, 4): (0.0, 0.0, 0, 6, 0),
                         (7, 2): (-1.0, 5.0, 1, 1, 1)}
