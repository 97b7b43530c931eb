"""CPU tensors read through numpy (tracer/host_values.py): fingerprint pairs of every size
against torch's float64 sums, and the nonzero rows of a collective's input against torch's."""
import math

import pytest
import torch

from tensor_trace.tracer import host_values


@pytest.fixture(autouse=True)
def numpy_readers(monkeypatch):
    """These tests are of the numpy path: the C readers an earlier traced session in this
    process took (tests/unit/test_native_host.py tests those) are put aside."""
    monkeypatch.setattr(host_values, "native_pair", None)
    monkeypatch.setattr(host_values, "native_rows", None)
    monkeypatch.setattr(host_values, "native_add", None)


def _float64_pair(t):
    f = t.double()
    return f.sum().item(), f.pow(2).sum().item()


@pytest.mark.parametrize("numel", [0, 1, 1000, host_values.ROWS_FROM - 1, host_values.ROWS_FROM,
                                   host_values.ROWS_FROM + 7, 3 * host_values.SQ_PIECE + 5, 1 << 23])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_pair_equals_torch_float64_sums(numel, dtype):
    gen = torch.Generator().manual_seed(numel)
    if dtype.is_floating_point:
        t = (torch.randn(numel, generator=gen, dtype=torch.float64) + 0.25).to(dtype)
    else:
        t = torch.randint(-1000, 1000, (numel,), generator=gen, dtype=dtype)
    s, q = host_values.pair(t)
    ref_s, ref_q = _float64_pair(t)
    # float32 partial sums combined in float64: a sum this far from torch's float64 one would
    # be within the merge's tolerance anyway; a whole-tensor float32 dot was 1.6e-4 off at 32M
    assert math.isclose(s, ref_s, rel_tol=1e-6, abs_tol=1e-6 * math.sqrt(max(numel, 1)))
    assert math.isclose(q, ref_q, rel_tol=1e-6, abs_tol=1e-9)
    if not dtype.is_floating_point:
        assert (s, q) == (ref_s, ref_q)  # integers: exact


def test_pair_of_views_and_shapes_is_that_of_their_values():
    full = torch.randn(300, 500)  # past ROWS_FROM elements: the rows path
    for t in (full, full[:, 3:411], full.t(), full.view(500, 300), full[::2]):
        s, q = host_values.pair(t)
        ref_s, ref_q = _float64_pair(t)
        assert math.isclose(s, ref_s, rel_tol=1e-6, abs_tol=1e-3)
        assert math.isclose(q, ref_q, rel_tol=1e-6)
    assert host_values.pair(torch.randn(3, dtype=torch.bfloat16)) is None  # numpy has no bf16
    assert host_values.pair(torch.randn(3, requires_grad=True)) is None


def _torch_rows(t):
    nz = torch.nonzero(t.reshape(t.shape[0], -1).ne(0).any(1)).flatten()
    n = int(nz.numel())
    return [int(nz[0]), int(nz[-1]), n] if n else [0, 0, 0]


def test_nonzero_rows_equal_torch_ones():
    padded = torch.zeros(6, 4, 8)
    padded[2:5] = torch.randn(3, 4, 8)
    special = torch.zeros(4, 3)
    special[1, 2] = float("nan")
    special[3, 0] = -0.0
    cases = [padded, torch.zeros(5, 7), torch.randn(2, 16, 96), special, torch.arange(6),
             padded[:, 1:3], torch.randn(9, 5).t()]
    for t in cases:
        assert host_values.nonzero_rows(t) == _torch_rows(t)
    assert host_values.nonzero_rows(special) == [1, 1, 1]  # NaN is nonzero, -0.0 is not
    assert host_values.nonzero_rows(torch.ones(3, 2, dtype=torch.bfloat16)) is None


def test_without_numpy_the_callers_use_torch(monkeypatch):
    from tensor_trace.tracer import collectives

    padded = torch.zeros(6, 8)
    padded[1:4] = 1.0
    monkeypatch.setattr(host_values, "_numpy", [None])
    assert host_values.pair(padded) is None and host_values.nonzero_rows(padded) is None
    assert collectives._nonzero_rows([padded]) == [[1, 3, 3]]


@pytest.mark.parametrize("numel", [1000, host_values.ROWS_FROM + 7])
def test_an_overflowing_sum_is_inf_and_warns_nothing_in_the_host(numel):
    """Values whose squares overflow float32 (an attention mask of finfo.min; uninitialised
    memory, a receive buffer before its broadcast): the pair is added again in float64, where
    it is finite (the writer keeps it as a WIDE_FINGERPRINTS value; the analysis reads such
    values only where they are equal on every rank), and no RuntimeWarning reaches the host's
    stderr, or raises under ``-W error``. A true inf stays inf."""
    import subprocess
    import sys
    code = ("import torch\nfrom tensor_trace.tracer import host_values\nhost_values.native_pair = None\n"
            f"print(host_values.pair(torch.full(({numel},), 3e38)))\n"
            f"print(host_values.pair(torch.full(({numel},), float('inf'))))\n")
    want = (numel * float(torch.tensor(3e38)), numel * float(torch.tensor(3e38)) ** 2)
    for flags in ([], ["-W", "error"]):
        run = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stderr == "", run.stderr
        wide, inf = run.stdout.strip().splitlines()
        got = tuple(float(v) for v in wide.strip("()").split(","))
        assert got[0] == pytest.approx(want[0], rel=1e-9) and got[1] == pytest.approx(want[1], rel=1e-9), wide
        assert inf == "(inf, inf)", run.stdout
