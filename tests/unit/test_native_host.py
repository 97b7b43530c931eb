"""tracer/native_host.py: a CPU tensor's fingerprint pair and nonzero rows read in C, against
torch's float64 sums and ``ne(0)`` rows; None for every tensor it does not read (the numpy and
torch paths take those); and a traced session's use of it, or not, as its configuration says."""
import math

import pytest
import torch

from tensor_trace.tracer import host_values


@pytest.fixture
def native_host(monkeypatch):
    from native_loaded import load_native_in_process

    return load_native_in_process(monkeypatch).host_values()


def _float64_pair(t):
    f = t.double()
    return f.sum().item(), f.pow(2).sum().item()


def _torch_rows(t):
    nz = torch.nonzero(t.reshape(t.shape[0], -1).ne(0).any(1)).flatten()
    n = int(nz.numel())
    return [int(nz[0]), int(nz[-1]), n] if n else [0, 0, 0]


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 1023, 1024, 1025, 9000, (1 << 20) + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32])
def test_pair_equals_torch_float64_sums(native_host, numel, dtype):
    host_pair, _, _ = native_host
    gen = torch.Generator().manual_seed(numel)
    if dtype.is_floating_point:
        t = (torch.randn(numel, generator=gen, dtype=torch.float64) * 3 + 0.25).to(dtype)
    else:
        t = torch.randint(-1000, 1000, (numel,), generator=gen, dtype=dtype)
    s, q = host_pair(t.reshape(-1, 1) if numel else t)
    ref_s, ref_q = _float64_pair(t)
    abs_sum = t.double().abs().sum().item()
    # float32 lanes over at most 128 values each, their sums in float64: well inside the merge's
    # tolerance (2**-20 of sqrt(n * sumsq) for float32 sums in another order)
    assert abs(s - ref_s) <= 1e-6 * abs_sum + 1e-12
    assert math.isclose(q, ref_q, rel_tol=1e-6, abs_tol=1e-12)
    if not dtype.is_floating_point:
        assert (s, q) == (ref_s, ref_q)  # integers below 2**53: exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32])
def test_pair_reads_views_where_they_lie(native_host, dtype):
    """Views (transposes, slices, steps, a fused projection's q/k/v, broadcasts, size-1 dims)
    give the float64 sums of their own elements, not of the memory around them."""
    host_pair, _, _ = native_host
    gen = torch.Generator().manual_seed(7)
    full = (torch.randn(30, 50, generator=gen, dtype=torch.float64) * 3 + 0.5).to(dtype)
    big = (torch.randn(4, 700, 3, generator=gen, dtype=torch.float64) * 2).to(dtype)
    qkv = (torch.randn(2, 8, 3 * 48, generator=gen, dtype=torch.float64)).to(dtype)
    q, k, v = qkv.split(48, dim=-1)
    views = [full.t(), full[:, 3:41], full[::2], full[3:5, :].t(), full[:, 7], full.t()[5:9],
             big.permute(2, 0, 1), big[:, 100:650, 1], big.unsqueeze(1).transpose(0, 3), q, k, v,
             full[2].expand(4, 50), full[:1, :1].expand(3, 5), full[4, 4], full[:, :0]]
    for t in views:
        assert not t.is_contiguous() or t.numel() <= 1, t.shape
        s, sq = host_pair(t)
        ref_s, ref_q = _float64_pair(t)
        abs_sum = t.double().abs().sum().item()
        assert abs(s - ref_s) <= 1e-6 * abs_sum + 1e-12, (t.shape, t.stride())
        assert math.isclose(sq, ref_q, rel_tol=1e-6, abs_tol=1e-12), (t.shape, t.stride())
        if not dtype.is_floating_point:
            assert (s, sq) == (ref_s, ref_q)
    # a contiguous copy's value, within float32 summation order
    s, sq = host_pair(q)
    cs, csq = host_pair(q.contiguous())
    assert math.isclose(s, cs, rel_tol=1e-5, abs_tol=1e-4) and math.isclose(sq, csq, rel_tol=1e-6)


def test_pair_reads_only_plain_host_memory(native_host):
    host_pair, _, _ = native_host
    full = torch.randn(30, 50)
    assert host_pair(full) is not None
    for t in (torch.randn(3, dtype=torch.bfloat16),
              torch.randn(3, dtype=torch.float16), torch.randn(3, requires_grad=True),
              torch.nn.Parameter(torch.randn(3), requires_grad=False),
              torch.randn(3, dtype=torch.complex64).conj(), torch.randn(3, dtype=torch.complex64),
              torch.empty(3, device="meta"), torch.ones(4, dtype=torch.bool), [1.0, 2.0]):
        assert host_pair(t) is None, t
    # what it does not read, host_values.pair still does (numpy)
    host_values.use_native(host_pair, None)
    small = torch.arange(-5, 25, dtype=torch.int16).reshape(5, 6)
    assert host_pair(small) is None
    assert host_values.pair(small.t()) == _float64_pair(small)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                                   torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool])
def test_nonzero_rows_equal_torch_ones(native_host, dtype):
    _, rows, _ = native_host
    gen = torch.Generator().manual_seed(3)
    for shape in [(1,), (5,), (6, 3), (4, 2, 5), (64, 96)]:
        for trial in range(12):
            mask = torch.rand(shape, generator=gen) < (0.05 if trial % 2 else 0.4)
            t = torch.zeros(shape).masked_fill(mask, 2.0).to(dtype)
            if dtype.is_floating_point:
                if trial % 3 == 0:
                    t = t.masked_fill(~mask, -0.0)  # negative zeros are zeros
                if trial % 4 == 1:
                    t.view(-1)[-1] = float("nan")  # NaN is not
            assert rows(t) == _torch_rows(t), (shape, trial)


def test_nonzero_rows_reads_only_what_it_can(native_host):
    _, rows, _ = native_host
    special = torch.zeros(4, 3)
    special[1, 2] = float("nan")
    special[3, 0] = -0.0
    assert rows(special) == [1, 1, 1]
    assert rows(torch.zeros(5, 7)) == [0, 0, 0]
    for t in (torch.tensor(3.0), torch.zeros(0, 3), torch.randn(2, 2, dtype=torch.complex64),
              torch.randn(9, 5).t(), torch.randn(3, requires_grad=True)):
        assert rows(t) is None
    # collective_specs asks it first and keeps its own answer for the rest
    from tensor_trace.tracer.collective_specs import nonzero_rows

    host_values.use_native(None, rows)
    padded = torch.zeros(6, 8)
    padded[1:4] = 1.0
    assert nonzero_rows([padded, padded.t().contiguous().t()]) == [[1, 3, 3], [1, 3, 3]]


def _fingerprints(out_dir):
    from tensor_trace.exporters.analysis.tolerance import Observed
    from tensor_trace.exporters.store.reader import load_rank_file, rank_files

    rt = load_rank_file(rank_files(str(out_dir))[0])
    return {(n, s.path, t.slot): Observed(t.shape, t.dtype, t.fp) for n, st in rt.steps.items() for s in st.spans for t in s.tensors}


def test_a_traced_session_reads_through_the_extension_unless_it_says_no(native_host, tmp_path, monkeypatch):
    """A session takes the C readers with the extension's other functions, and one with
    TENSOR_TRACE_NATIVE=0 puts numpy back (an earlier session may have taken them): the same
    fingerprints either way, within the merge's tolerance."""
    from tensor_trace import tracer
    from tensor_trace.exporters.analysis.tolerance import fp_equal

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))
    x = torch.randn(5, 64)
    taken, fps = {}, {}
    for setting in ("1", "0"):
        monkeypatch.setenv("TENSOR_TRACE_NATIVE", setting)
        tr = tracer.start(out_dir=str(tmp_path / setting), fingerprint_every=1, lineage=False)
        try:
            with torch.no_grad():
                for _ in range(3):
                    model(x)
            taken[setting] = (host_values.native_pair, host_values.native_rows, host_values.native_add)
        finally:
            tracer.stop()
        assert tr.errors == 0
        fps[setting] = _fingerprints(tmp_path / setting)
    assert taken["1"] == tuple(native_host)
    assert taken["0"] == (None, None, None)
    assert fps["1"].keys() == fps["0"].keys() and len(fps["1"]) >= 12
    for key, seen in fps["1"].items():
        assert seen.fp is not None and fp_equal(seen, fps["0"][key]), key


def _sightings():
    """A step's sightings (tensor, store) as module calls make them: outputs added with store,
    the next call's inputs without; repeats, in-place updates, inference and ordinary tensors,
    and tensors add_one_host leaves to add_one."""
    torch.manual_seed(5)
    with torch.inference_mode():
        a, b = torch.randn(4, 8), torch.randn(2, 3, dtype=torch.float64)
        ids = torch.arange(6)
    with torch.no_grad():
        c, d = torch.randn(16), torch.randn(3, 5)
    half, strided = torch.randn(8, dtype=torch.bfloat16), torch.randn(6, 4).t()
    grad = torch.randn(3, requires_grad=True)
    seq = [(a, True), (a, False), (a, False), (b, True), (ids, False), (c, True), (c, False), (a, False),
           (d, True), ("bump", d), (d, False), (d, True), (half, True), (half, False), (strided, True),
           (c, True), (grad, False), (b, False), (b, True), (torch.zeros(0), True)]
    return seq


def test_add_one_host_keeps_add_ones_state_and_indices(native_host):
    """The same sightings through add_one alone and through add_one_host first (add_one where it
    returns None): the same indices, repeats, cache of values by id and last tensor; host values
    within float32 summation order."""
    from tensor_trace.tracer import native
    from tensor_trace.tracer.fingerprint import StepFingerprints

    add_one_host = native.add_one_host()
    seq = _sightings()
    python, native = StepFingerprints(), StepFingerprints()
    got, want, in_c = [], [], 0
    for t, store in seq:
        if isinstance(t, str):  # an in-place update between sightings (the version moves)
            with torch.no_grad():
                store.add_(1.0)
            continue
        want.append(python.add_one(t, store))
        i = add_one_host(native, t, store)
        in_c += i is not None
        got.append(native.add_one(t, store) if i is None else i)
    assert got == want
    assert 8 <= in_c < len(got)
    for name in ("count", "_host_idx", "_host_pos", "_dups", "_imm_idx", "last_idx", "last_version"):
        assert getattr(native, name) == getattr(python, name), name
    assert native.last is python.last
    assert native._seen.keys() == python._seen.keys()
    assert [(e[0](), e[1], e[2]) for e in native._seen.values()] == [(e[0](), e[1], e[2]) for e in python._seen.values()]
    assert native._host_vals == pytest.approx(python._host_vals, rel=1e-6, abs=1e-5)


def test_add_through_add_host_keeps_adds_state_and_indices(native_host, monkeypatch):
    """StepFingerprints.add with the extension's add_host (a tensor at a time, _add for the rest
    from the first it leaves) and without it: the same indices and state, over a step's
    sightings added one by one and in calls of several tensors."""
    from tensor_trace.tracer import native
    from tensor_trace.tracer.fingerprint import StepFingerprints

    states = {}
    for name, host in (("python", None), ("native", native.host_values()[2])):
        monkeypatch.setattr(host_values, "native_add", host)
        seq = _sightings()  # (the same values; tensors of this run's own, their versions too)
        position = {id(t): i for i, (t, _) in enumerate(seq)}
        fps, got = StepFingerprints(), []
        pending = []
        for t, store in seq:
            if isinstance(t, str):
                with torch.no_grad():
                    store.add_(1.0)
                continue
            got.append(fps.add([t], store, immediate=not store))
            pending.append(t)
            if len(pending) == 3:  # (a call of three tensors, the third perhaps one add_host leaves)
                got.append(fps.add(tuple(pending), False))
                pending = []
        state = {name: getattr(fps, name) for name in
                 ("count", "_host_idx", "_host_pos", "_dups", "_imm_idx", "last_idx", "last_version")}
        state["last"] = position.get(id(fps.last))
        state["seen"] = [(position[k], position[id(e[0]())], e[1], e[2]) for k, e in fps._seen.items()]
        states[name] = (got, state, fps._host_vals)
    (want, python, python_vals), (got, state, vals) = states["python"], states["native"]
    assert got == want
    assert state == python
    assert vals == pytest.approx(python_vals, rel=1e-6, abs=1e-5)


def _interceptor_of(fps):
    """CollectiveInterceptor's fp_inputs and fp_outputs bound to a stand-in holding only what they
    read: the tracer's busy flag and its StepFingerprints."""
    import types

    from tensor_trace.tracer.collectives import CollectiveInterceptor

    tracer = types.SimpleNamespace(_busy=False, busy=False, fps=fps)
    me = types.SimpleNamespace(tracer=tracer)
    return (lambda ins, rows: CollectiveInterceptor.fp_inputs(me, ins, rows),
            lambda outs: CollectiveInterceptor.fp_outputs(me, outs))


def test_collectives_fingerprints_in_c_keep_fp_inputs_and_outputs_state(native_host):
    """A step's collectives through coll_fp_inputs_host / coll_fp_outputs_host (the C path's,
    tracer/native_coll.py) and through CollectiveInterceptor.fp_inputs / fp_outputs: the same
    indices, nonzero rows and StepFingerprints state, over in-place reductions of a module's
    output, gathers into a list, views, and tensors the C functions leave (None: nothing changed)."""
    from tensor_trace.tracer import native
    from tensor_trace.tracer.fingerprint import StepFingerprints

    c_in, c_out = native.coll_fp_host()
    states = {}
    for name in ("python", "native"):
        torch.manual_seed(11)  # (the same values in both)
        fps = StepFingerprints()
        fp_inputs, fp_outputs = _interceptor_of(fps)
        with torch.inference_mode():
            x = torch.randn(6, 4)
            x[0] = 0.0
        y = torch.randn(5, 3)
        half = torch.randn(4, 2, dtype=torch.bfloat16)
        view = torch.randn(4, 6)[:, 1:5]
        parts = [torch.empty(6, 4) for _ in range(2)]
        got, in_c = [], 0
        for t, out, rows in [(x, [x], True), (x, parts, False), (y, [y], True), (parts[0], [parts[0]], True),
                             (view, [view], True), (view, [view], False), (half, [half], True), (y, [half, y], False)]:
            got.append(fps.add_one(t, True))  # the module's output that feeds the collective
            if name == "native":
                r = c_in(fps, t, rows)
                in_c += r is not None
                pre = r if r is not None else fp_inputs([t], rows)
            else:
                pre = fp_inputs([t], rows)
            for o in out:  # the collective's work, in place
                with torch.inference_mode() if o.is_inference() else torch.no_grad():
                    o.copy_(t[: o.shape[0], : o.shape[1]] * 2 if o.dtype == t.dtype else o)
            if name == "native":
                post = c_out(fps, list(out))
                in_c += post is not None
                post = post if post is not None else fp_outputs(list(out))
            else:
                post = fp_outputs(list(out))
            got += [pre, post, fps.add_one(out[0], False)]  # the next module's input
        states[name] = (got, in_c, fps)
    (want, _, python), (got, in_c, fps) = states["python"], states["native"]
    assert got == want
    assert 8 <= in_c < 16  # (bfloat16, and a view's rows, left to the Python functions)
    for name in ("count", "_host_idx", "_host_pos", "_dups", "last_idx", "last_version", "_last_out"):
        assert getattr(fps, name) == getattr(python, name), name
    assert (fps.last is None) == (python.last is None)
    assert fps._seen and len(fps._seen) == len(python._seen)
    assert fps._host_vals == pytest.approx(python._host_vals, rel=1e-6, abs=1e-5)


def test_collectives_fingerprints_in_c_leave_what_is_held_to_python(native_host):
    """Deferred values held (materialize would reduce them) or a C++ table: nothing taken, nothing changed."""
    from tensor_trace.tracer import native
    from tensor_trace.tracer.fingerprint import StepFingerprints

    c_in, c_out = native.coll_fp_host()
    fps = StepFingerprints()
    x = torch.randn(3, 3)
    fps._def_ts.append(x)
    assert c_in(fps, x, True) is None and c_out(fps, [x]) is None
    assert fps.count == 0 and not fps._host_vals
    fps._def_ts.clear()
    fps._nt = object()
    assert c_in(fps, x, False) is None and c_out(fps, [x]) is None
    fps._nt = None
    assert c_in(fps, x, False) == (0, None) and c_out(fps, [x]) == 1 and fps.count == 2


@pytest.mark.parametrize("view", [False, True])
def test_float32_values_near_its_limit_are_added_in_float64(native_host, view):
    """An attention mask of finfo.min overflows float32 lanes; read again in float64 its sums
    are finite (the writer keeps them as WIDE_FINGERPRINTS), and a true -inf stays -inf."""
    host_pair, _, _ = native_host
    low = torch.finfo(torch.float32).min
    mask = torch.full((2, 1, 40, 40), low).triu(1)
    t = mask.transpose(2, 3) if view else mask
    s, q = host_pair(t)
    ref_s, ref_q = _float64_pair(t)
    assert math.isfinite(s) and math.isfinite(q)
    assert math.isclose(s, ref_s, rel_tol=1e-12) and math.isclose(q, ref_q, rel_tol=1e-12)
    s, _ = host_pair(torch.full((2, 40), float("-inf")).triu(1))
    assert s == float("-inf")


def test_a_steps_values_past_float32s_range_through_the_extension(native_host, monkeypatch):
    """test_fingerprint.py's check of WIDE_FINGERPRINTS with the extension's pair and add."""
    from test_fingerprint import check_values_past_float32s_range

    host_pair, _, add_host = native_host
    monkeypatch.setattr(host_values, "native_pair", host_values.native_pair)
    monkeypatch.setattr(host_values, "native_add", host_values.native_add)
    host_values.use_native(host_pair, None, add_host)
    check_values_past_float32s_range()


def test_values_that_are_not_finite_through_the_extension(native_host, monkeypatch):
    """test_fingerprint.py's check of NONFINITE_FINGERPRINTS with the extension's pair, add and
    add_one (which leave such values, and repeats of them, to the Python that records them)."""
    from test_fingerprint import check_nonfinite_values
    from tensor_trace.tracer import native

    host_pair, _, add_host = native_host
    monkeypatch.setattr(host_values, "native_pair", host_values.native_pair)
    monkeypatch.setattr(host_values, "native_add", host_values.native_add)
    host_values.use_native(host_pair, None, add_host)
    check_nonfinite_values(native.add_one_host())
