"""When two fingerprints describe the same values (exporters/analysis/tolerance.py): rounding to
bfloat16 and fp32 accumulation in another order are within the tolerance, a 1% difference in the
values is not."""

import numpy as np
import pytest

from synthetic_trace import SyntheticTrace, bf16, fps, same
from tensor_trace.exporters import query
from tensor_trace.exporters.analysis.tolerance import Observed, close, disjoint_sum, fp_equal, linked


def _fp64(a):
    a = np.asarray(a, np.float64)
    return float(a.sum()), float((a * a).sum())


def _fp32_blocked(a, block=1024):
    """fp32 sums the way a GPU kernel takes them: per block in fp32, then the blocks in fp32."""
    a = np.asarray(a, np.float32).ravel()
    sums = [np.sum(a[i:i + block], dtype=np.float32) for i in range(0, a.size, block)]
    sqs = [np.sum(a[i:i + block] * a[i:i + block], dtype=np.float32) for i in range(0, a.size, block)]
    return float(np.sum(sums, dtype=np.float32)), float(np.sum(sqs, dtype=np.float32))


def _obs(a, dtype, fp=None):
    return Observed(np.shape(a), dtype, fp or _fp64(a))


def _values(n, seed=0, mean=0.0):
    return (np.random.default_rng(seed).normal(size=n) + mean).astype(np.float32)


@pytest.mark.parametrize("n", [64, 4096, 1 << 20])
@pytest.mark.parametrize("mean", [0.0, 1.0])
def test_bf16_rounding_of_fp32_values_is_equal(n, mean):
    x = _values(n, mean=mean)
    assert fp_equal(_obs(x, "float32"), _obs(bf16(x), "bfloat16"))
    assert fp_equal(_obs(bf16(x), "bfloat16"), _obs(x, "float32"))


@pytest.mark.parametrize("n", [64, 4096, 1 << 20])
def test_fp32_accumulation_in_another_order_is_equal(n):
    x = _values(n, seed=1, mean=0.5)
    assert fp_equal(_obs(x, "float32"), _obs(x, "float32", _fp32_blocked(x[::-1])))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [64, 4096, 1 << 20])
def test_values_one_percent_larger_are_not_equal(dtype, n):
    x = _values(n, seed=2)
    if dtype == "bfloat16":
        x = bf16(x)
    y = (x * np.float32(1.01)).astype(np.float32)
    if dtype == "bfloat16":
        y = bf16(y)
    assert not fp_equal(_obs(x, dtype), _obs(y, dtype))


@pytest.mark.parametrize("n", [4096, 1 << 20])
def test_one_percent_noise_per_value_is_not_equal_in_fp32(n):
    x = _values(n, seed=3)
    y = (x * (1 + 0.01 * _values(n, seed=4))).astype(np.float32)
    assert not fp_equal(_obs(x, "float32"), _obs(y, "float32"))


def test_bf16_partial_sums_add_up_to_their_bf16_reduction():
    """What sums-add-up relies on: a bfloat16 all_reduce of bfloat16 partial sums."""
    n = 1 << 16
    parts = [bf16(_values(n, seed=s)) for s in (5, 6, 7, 8)]
    out = bf16(np.sum(parts, axis=0, dtype=np.float32))
    s_total = sum(_fp64(p)[0] for p in parts)
    q_total = sum(_fp64(p)[1] for p in parts)
    assert close(s_total, _fp64(out)[0], n, q_total, "bfloat16")
    # ... and one rank's partial 1% larger does not.
    s_off = s_total + 0.01 * float(np.abs(parts[0]).sum())
    assert not close(s_off, _fp64(out)[0], n, q_total, "bfloat16")


def test_missing_or_mismatched_fingerprints_are_never_equal():
    x = _values(64)
    assert not fp_equal(Observed((64,), "float32", None), _obs(x, "float32"))
    assert not fp_equal(Observed((64,), "float32", (_fp64(x)[0], None)), _obs(x, "float32"))
    assert not fp_equal(Observed((32, 4), "float32", _fp64(x)), _obs(x, "float32"))  # numel differs


def test_common_scale_is_found_only_where_the_sums_carry_it():
    x = _values(4096, seed=9, mean=1.0)
    xs = {0: _obs(x, "float32"), 1: _obs(2 * x, "float32")}
    ys = {0: _obs(0.25 * x, "float32"), 1: _obs(0.5 * x, "float32")}
    assert linked(xs, ys) == pytest.approx(0.25)
    assert linked(xs, xs) == 1.0
    # Zero-mean values: the sums are noise, a scale seen only in the sums of squares is not believed.
    z = _values(4096, seed=10) - _values(4096, seed=10).mean()
    assert linked({0: _obs(z, "float32")}, {0: _obs(0.5 * z, "float32")}) is None
    # A rank whose values are not the common scale of its input breaks the link.
    ys[1] = _obs(0.3 * x, "float32")
    assert linked(xs, ys) is None


def test_disjoint_slices_sum_without_cross_terms():
    rng = np.random.default_rng(11)
    a, b = np.zeros((8, 4), np.float32), np.zeros((8, 4), np.float32)
    a[:4], b[4:] = rng.normal(size=(4, 4)), rng.normal(size=(4, 4))
    assert disjoint_sum([_obs(a, "float32"), _obs(b, "float32")], _obs(a + b, "float32"))
    # Real partial sums overlap: their sum's sum of squares has cross terms.
    c, d = rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 4)).astype(np.float32)
    assert not disjoint_sum([_obs(c, "float32"), _obs(d, "float32")], _obs(c + d, "float32"))


# ------------------------------------------------------------------------- through a merged trace
def _placement(tmp_path, fp0, fp1, dtype):
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("m", same(np.ones(4, np.float32), [0, 1])) as c:
            c.returns(fps((4096,), {0: fp0, 1: fp1}, dtype=dtype))
    (p,) = query.placement(tr.merge(tmp_path), "m:output")
    return p


def test_ranks_whose_sums_differ_by_rounding_are_replicate(tmp_path):
    x = _values(4096, seed=12, mean=0.3)
    p = _placement(tmp_path, _fp64(bf16(x)), _fp32_blocked(bf16(x)[::-1]), "bfloat16")
    assert (p["placement"], p["rule"]) == ("replicate", "equal-values"), p["evidence"]


def test_ranks_one_percent_apart_are_not_replicate(tmp_path):
    x = bf16(_values(4096, seed=12, mean=0.3))
    p = _placement(tmp_path, _fp64(x), _fp64(bf16(x * np.float32(1.01))), "bfloat16")
    assert (p["placement"], p["rule"]) == ("divergent", "divergent"), p["evidence"]
