"""Fingerprints, immediate and deferred (the GPU path, exercised here on CPU tensors)."""

import math

import pytest
import torch

from tensor_trace import schema
from tensor_trace.tracer.fingerprint import StepFingerprints


def _values(records):
    out = {}
    for _, step, first, data, indices in records:
        n = len(data) // 8
        idx = range(first, first + n) if indices is None else __import__("struct").unpack(f"<{n}I", indices)
        for i, pair in zip(idx, schema.FP_PAIR.iter_unpack(data)):
            out[(step, i)] = pair
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
