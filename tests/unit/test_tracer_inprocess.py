"""The tracer inside one process: spans, hook hygiene, error containment, fingerprints."""

import pytest
import torch
import torch.nn as nn
from torch.nn.modules import module as nn_module

from tensor_trace import schema, tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.down = nn.Linear(16, 8)

    def forward(self, x, *, scale=None):
        y = self.down(self.act(self.up(x)))
        return (y * (scale if scale is not None else 1.0), {"skip": x})


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x, scale=torch.tensor(2.0))[0]
        x = self.blocks[0].act(x)  # the same module twice in a step: call 0 and call 1
        return self.head(x)


def _hooks_left():
    return (len(nn_module._global_forward_hooks) + len(nn_module._global_forward_pre_hooks))


def _interceptions():
    """Global hooks, plus one for a wrapped ``Module.__call__`` (``intercept="call"``)."""
    wrapped = getattr(torch.nn.Module.__call__, "_tensor_trace_wrapper", None) is not None
    return _hooks_left() + wrapped


def _run(tmp_path, steps=3, **opts):
    torch.manual_seed(0)
    net = Net()
    xs = [torch.randn(2, 8) for _ in range(steps)]
    plain = [net(x) for x in xs]
    tr = tracer.start(out_dir=str(tmp_path), **opts)
    traced = [net(x) for x in xs]
    tracer.stop()
    assert tr.hook_count() == 0
    return net, plain, traced


@pytest.mark.parametrize("intercept", ["call", "hooks"])
def test_spans_paths_calls_and_slots(tmp_path, intercept):
    net, plain, traced = _run(tmp_path, intercept=intercept)
    for a, b in zip(plain, traced):
        assert torch.equal(a, b)
    (f,) = rank_files(str(tmp_path))
    rt = load_rank_file(f)
    assert sorted(rt.steps) == [0, 1, 2]
    spans = rt.steps[1].spans
    by = {(s.path, s.call): s for s in spans}
    assert ("blocks.0.act", 1) in by and ("blocks.0.act", 0) in by
    up = by[("blocks.1.up", 0)]
    assert up.cls == "Linear"
    assert [(t.slot, t.shape) for t in up.tensors] == [("input.0", [2, 8]), ("output", [2, 16])]
    blk = by[("blocks.0", 0)]
    assert [t.slot for t in blk.tensors] == ["input.0", "input.scale", "output.0", "output.1.skip"]
    root = by[("", 0)]
    assert root.parent == -1 and root.cls == "Net"
    assert by[("blocks.0.up", 0)].parent == blk.index
    # Fingerprints are the fp32 sum and sum of squares of the values.
    head_out = by[("head", 0)].tensors[-1]
    s, q = head_out.fp
    assert abs(s - traced[1].sum().item()) < 1e-4
    assert abs(q - traced[1].pow(2).sum().item()) < 1e-4
    # A tensor seen twice (output of up, input of act) has the same fingerprint.
    assert by[("blocks.0.up", 0)].tensors[-1].fp == by[("blocks.0.act", 0)].tensors[0].fp


@pytest.mark.parametrize("intercept", ["call", "hooks"])
def test_stop_leaves_no_hooks_and_no_patches(tmp_path, intercept):
    import torch.distributed as dist

    before_ar = dist.all_reduce
    before_ns = torch.ops._c10d_functional.all_reduce
    before_call = torch.nn.Module.__call__
    assert _hooks_left() == 0
    net = Net()
    tr = tracer.start(out_dir=str(tmp_path), intercept=intercept)
    net(torch.randn(2, 8))
    if intercept == "hooks":
        assert _hooks_left() == 2 and torch.nn.Module.__call__ is before_call
    else:  # torch's __call__ wrapped, no global hook
        assert _hooks_left() == 0 and torch.nn.Module.__call__ is not before_call
    assert len(net._forward_pre_hooks) == 1
    assert dist.all_reduce is not before_ar
    tracer.stop()
    assert _hooks_left() == 0
    assert not nn_module._has_any_global_hook()  # the side tables of hooks too
    assert torch.nn.Module.__call__ is before_call
    assert len(net._forward_pre_hooks) == 0 and len(net._forward_hooks) == 0
    assert dist.all_reduce is before_ar
    assert torch.ops._c10d_functional.all_reduce is before_ns
    assert tr.hook_count() == 0


@pytest.mark.parametrize("intercept", ["call", "hooks"])
def test_failing_hook_body_does_not_break_the_model(tmp_path, monkeypatch, capsys, intercept):
    from tensor_trace.tracer import spans

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(spans, "flatten_output", boom)
    net, plain, traced = _run(tmp_path, steps=12, intercept=intercept)
    for a, b in zip(plain, traced):
        assert torch.equal(a, b)
    err = capsys.readouterr().err
    assert err.count("tensor-trace: error in forward hook") == 1
    assert "tracing is now off" in err
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    assert len(rt.errors) >= 20 and "injected" in rt.errors[0]["message"]
    assert rt.end["reason"] == "too many errors"


def _spans_by_step(out_dir):
    rt = load_rank_file(rank_files(str(out_dir))[0])
    return {n: [(s.index, s.parent, s.path, s.call, s.cls, [(t.slot, t.shape, t.dtype, t.fp) for t in s.tensors])
                for s in sorted(st.spans, key=lambda s: s.index)]
            for n, st in rt.steps.items()}


@pytest.mark.parametrize("fingerprint", [False, True])
def test_call_wrapper_records_what_the_hooks_record(tmp_path, fingerprint):
    # The wrapper records one-tensor calls inline (its fast path) and the rest through the hook
    # bodies: the rank file must not tell the two interceptions apart.
    tables = {}
    for intercept in ("call", "hooks"):
        _run(tmp_path / intercept, intercept=intercept, fingerprint=fingerprint)
        tables[intercept] = _spans_by_step(tmp_path / intercept)
    assert tables["call"] == tables["hooks"]
    spans = tables["call"][1]
    assert len(spans) == 11 and {p for _, _, p, _, _, _ in spans} >= {"blocks.0.up", "blocks.1.down", "head"}
    assert all((fp is not None) == fingerprint for *_, ts in spans for *_, fp in ts)


@pytest.mark.parametrize("where", ["pre", "post"])
def test_failure_inside_the_call_wrappers_inline_path_is_contained(tmp_path, monkeypatch, capsys, where):
    from tensor_trace.tracer import fingerprint as fp_mod
    from tensor_trace.tracer.writer import RankWriter

    def boom(*a, **k):
        raise RuntimeError("injected")

    if where == "pre":  # the inline pre-hook: fingerprinting a one-tensor input
        real = fp_mod.StepFingerprints.add_one
        monkeypatch.setattr(fp_mod.StepFingerprints, "add_one",
                            lambda self, t, store=True: boom() if not store else real(self, t, store))
    else:  # the inline post-hook: a new layout
        monkeypatch.setattr(RankWriter, "layout", boom)
    net, plain, traced = _run(tmp_path, steps=12, intercept="call")
    for a, b in zip(plain, traced):
        assert torch.equal(a, b)
    err = capsys.readouterr().err
    assert err.count(f"tensor-trace: error in forward {'pre-' if where == 'pre' else ''}hook") == 1
    assert "tracing is now off" in err
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    assert len(rt.errors) >= 20 and "injected" in rt.errors[0]["message"]
    # no step's lineage mode outlives it, also where recording the step's end failed
    assert not torch.overrides._get_current_function_mode_stack()


@pytest.mark.parametrize("intercept,n", [("call", 1), ("hooks", 2)])
def test_step_window_installs_no_global_hooks_outside(tmp_path, intercept, n):
    net = Net()
    tracer.start(out_dir=str(tmp_path), steps=(2, 4), intercept=intercept)
    seen = []
    for i in range(6):
        net(torch.randn(2, 8))
        seen.append(_interceptions())
    tracer.stop()
    # Global hooks (or the call wrapper) exist only from the first windowed step's start until
    # the last one ends (kept between steps 2 and 3, gone after step 0, 1, 4, 5).
    assert seen == [0, 0, n, 0, 0, 0]
    assert _interceptions() == 0
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    assert sorted(rt.steps) == [2, 3]


def test_inference_mode_and_in_place_updates(tmp_path):
    class InPlace(nn.Module):
        def forward(self, x):
            x.mul_(3)
            return x

    class Net2(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = InPlace()

        def forward(self, x):
            return self.b(self.a(x))

    net = Net2()
    tracer.start(out_dir=str(tmp_path))
    with torch.inference_mode():
        out = net(torch.randn(3, 4))
    tracer.stop()
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    by = {s.path: s for s in rt.steps[0].spans}
    a_out = by["a"].tensors[-1].fp
    b_in, b_out = by["b"].tensors[0].fp, by["b"].tensors[1].fp
    assert a_out == b_in
    # The in-place update is visible: b's output is 3x its input, not a stale cached value.
    assert abs(b_out[0] - 3 * b_in[0]) < 1e-4
    assert abs(b_out[0] - out.sum().item()) < 1e-4


def test_replays_of_graphs_captured_untraced_are_counted_and_announced_once(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_replay(graph):  # stands in for the real method, which needs a GPU
        calls.append(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", fake_replay)
    tr = tracer.start(out_dir=str(tmp_path))
    Net()(torch.randn(2, 8))
    for _ in range(3):
        torch.cuda.CUDAGraph.replay("g")
    assert calls == ["g", "g", "g"] and tr.stats["graph_replays_untraced"] == 3
    tracer.stop()
    assert torch.cuda.CUDAGraph.replay is fake_replay  # restored
    assert capsys.readouterr().err.count("captured without tracing is being replayed") == 1
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    assert rt.end["stats"]["graph_replays_untraced"] == 3


def test_a_step_that_raised_is_marked_interrupted_in_the_store(tmp_path):
    import json as _json

    from tensor_trace.exporters.pipeline import merge_ranks
    from tensor_trace.exporters.query import sql

    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            y = self.lin(x)
            if self.calls == 2:
                raise KeyboardInterrupt  # Ctrl-C in the middle of a forward
            return y

    m = Flaky()
    tracer.start(out_dir=str(tmp_path))
    for i in range(3):
        try:
            m(torch.randn(2, 4))
        except KeyboardInterrupt:
            pass
    tracer.stop()
    with open(tmp_path / "run.json", "w") as f:
        _json.dump({"run_id": load_rank_file(rank_files(str(tmp_path))[0]).header["run_id"]}, f)
    merge_ranks(str(tmp_path), warn=lambda msg: None)
    import sqlite3

    con = sqlite3.connect(str(tmp_path / "merged.sqlite"))
    rows = sql(con, "SELECT step, interrupted FROM steps ORDER BY step")["rows"]
    assert rows == [[0, 0], [1, 1], [2, 0]]


@pytest.mark.parametrize("intercept", ["call", "hooks"])
def test_a_module_that_raises_gets_an_error_span_and_the_next_step_is_clean(tmp_path, intercept):
    # The failing module's span is closed as failed (by the wrapper's except clause, or by
    # torch's always_call hook), its caller goes on, and the next step has no leftovers.
    class Bad(nn.Module):
        def forward(self, x):
            raise ValueError("bad input")

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.bad = Bad()

        def forward(self, x, fail=False):
            y = self.lin(x)
            if fail:
                try:
                    self.bad(y)
                except ValueError:
                    pass
            return y

    m = Outer()
    tracer.start(out_dir=str(tmp_path), intercept=intercept)
    m(torch.randn(2, 4), fail=True)
    m(torch.randn(2, 4))
    tracer.stop()
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    by0 = {s.path: s for s in rt.steps[0].spans}
    assert by0["bad"].flags & schema.FLAG_ERROR and not by0["lin"].flags & schema.FLAG_ERROR
    assert [t.slot for t in by0["bad"].tensors] == ["input.0"]
    assert sorted(s.path for s in rt.steps[1].spans) == ["", "lin"]
    assert _interceptions() == 0


def test_compiled_module_inside_traced_steps_runs_without_graph_breaks(tmp_path):
    # torch.compile traces Module.__call__, which the call wrapper replaces while steps are
    # traced: the wrapper must be a plain call there (no tracer code, nothing to break on).
    from torch._dynamo.utils import counters

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.lin(x))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Inner(), Inner()

        def forward(self, x):
            return self.b(self.a(x))

    torch.manual_seed(0)
    m = Outer()
    x = torch.randn(2, 4)
    want = m(x)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, backend="eager")
    tracer.start(out_dir=str(tmp_path))
    try:
        got = [compiled(x) for _ in range(3)]
    finally:
        tracer.stop()
        torch._dynamo.reset()
    assert all(torch.equal(g, want) for g in got)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    assert sorted(rt.steps) == [0, 1, 2] and rt.errors == []


def test_stop_never_raises_into_the_program(tmp_path, monkeypatch, capsys):
    # stop runs at exit and on signals, inside the traced program: a failure there is recorded,
    # and the rank file is still closed with its END record.
    from tensor_trace.tracer import fingerprint as fp_mod

    net = Net()
    tr = tracer.start(out_dir=str(tmp_path))
    net(torch.randn(2, 8))

    def boom(self, wait=False):
        raise RuntimeError("collect exploded")

    monkeypatch.setattr(fp_mod.StepFingerprints, "collect", boom)
    tracer.stop()
    assert tr.hook_count() == 0 and _interceptions() == 0
    assert "tensor-trace: error in stop" in capsys.readouterr().err
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    assert rt.end["reason"] == "stop" and any("collect exploded" in e["message"] for e in rt.errors)


def _batch_type():
    """A framework's per-batch context (SGLang's ForwardBatch is a dataclass too)."""
    import dataclasses

    return dataclasses.make_dataclass("Batch", [("positions", torch.Tensor), ("seq_lens", torch.Tensor),
                                                ("mode", int)])


class _ParallelLinear(nn.Linear):
    def forward(self, x):  # SGLang's linear layers return (output, bias)
        return super().forward(x), None


class _Norm(nn.Module):
    def forward(self, x, residual=None):  # SGLang's RMSNorm: (x, residual) in, a pair out
        if residual is None:
            return x * 2
        return x + residual, x


class _Rotary(nn.Module):
    def forward(self, positions, q, k):
        return q + positions[:, None], k - 1


class _Attn(nn.Module):
    def forward(self, q, k, v, forward_batch):
        return q * k.sum() + v + forward_batch.seq_lens[:, None]


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = _Norm()
        self.qkv = _ParallelLinear(8, 24)
        self.rotary = _Rotary()
        self.attn = _Attn()

    def forward(self, positions, hidden_states, forward_batch, residual):
        hidden_states, residual = self.norm(hidden_states, residual)
        q, k, v = self.qkv(hidden_states)[0].split(8, dim=-1)
        q, k = self.rotary(positions, q, k)
        return self.attn(q, k, v, forward_batch=forward_batch), residual


class _SglLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, positions, hidden_states, forward_batch):
        residual = torch.zeros_like(hidden_states)
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual=residual)
        return hidden_states


def _sgl_like_with_context(monkeypatch):
    """The SGLang-like model and its arguments, with its batch type registered as a context."""
    from tensor_trace.tracer import intercept, spans, tensor_slots

    batch_cls = _batch_type()
    for module in (tensor_slots, spans, intercept):
        monkeypatch.setattr(module, "CONTEXT_TYPES", {batch_cls})
    torch.manual_seed(0)
    args = (torch.arange(4), torch.randn(4, 8), batch_cls(torch.arange(4), torch.full((4,), 7), 1))
    return _SglLike(), args


@pytest.mark.parametrize("fingerprint", [False, True])
def test_framework_call_patterns_recorded_inline_as_the_general_path_does(tmp_path, monkeypatch, fingerprint):
    # (output, None) results, (x, residual) pairs, plain values and a batch context among the
    # arguments, keyword arguments: recorded without walking structures (record_tensors), the
    # same as the general path records them; the batch context only in the step root's span.
    from tensor_trace.tracer import intercept

    # record_tensors is the Python path's (the C call wrapper records these calls itself:
    # tests/unit/test_native_call.py compares its rank file with the Python path's)
    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "0")
    net, args = _sgl_like_with_context(monkeypatch)
    tables = {}
    inline_calls = []
    real = intercept.record_tensors
    for how in ("inline", "general"):
        with monkeypatch.context() as m:
            if how == "general":
                m.setattr(intercept, "record_tensors", lambda self, *a: False)
            else:
                m.setattr(intercept, "record_tensors",
                          lambda self, *a: inline_calls.append(1) or real(self, *a))
            # (lineage off: steps that record lineage take the general path anyway)
            tracer.start(out_dir=str(tmp_path / how), fingerprint=fingerprint, lineage=False)
            outs = [net(*args) for _ in range(2)]
            tracer.stop()
        tables[how] = _spans_by_step(tmp_path / how)
        assert torch.equal(outs[0], net(*args))
    assert tables["inline"] == tables["general"] and len(inline_calls) >= 2 * 8
    spans = {path: ts for _, _, path, _, _, ts in tables["inline"][1]}
    assert [s for s, *_ in spans[""]][:4] == ["input.0", "input.1", "input.2.positions", "input.2.seq_lens"]
    assert [s for s, *_ in spans["layers.0.attn"]] == ["input.0", "input.1", "input.2", "output"]
    assert [s for s, *_ in spans["layers.0.qkv"]] == ["input.0", "output.0"]
    assert [s for s, *_ in spans["layers.1.norm"]] == ["input.0", "input.1", "output.0", "output.1"]
    assert [s for s, *_ in spans["layers.1"]] == ["input.0", "input.1", "input.residual", "output.0", "output.1"]


@pytest.mark.parametrize("fingerprint", [False, True])
def test_framework_call_patterns_the_same_through_the_call_wrapper_and_the_hooks(tmp_path, monkeypatch,
                                                                                 fingerprint):
    # The call wrapper records calls of tensors and plain values itself (record_tensors, with
    # global_post's checks known true); the hooks go through global_post: same rank file.
    from tensor_trace.tracer import intercept as interception

    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "0")  # (record_tensors: the Python path's, as above)
    net, args = _sgl_like_with_context(monkeypatch)
    calls = []
    real = interception.record_tensors
    monkeypatch.setattr(interception, "record_tensors",
                        lambda self, *a: calls.append(1) or real(self, *a))
    tables = {}
    for intercept in ("call", "hooks"):
        tracer.start(out_dir=str(tmp_path / intercept), fingerprint=fingerprint, intercept=intercept,
                     lineage=False)  # (steps that record lineage take the general path)
        for _ in range(2):
            net(*args)
        tracer.stop()
        tables[intercept] = _spans_by_step(tmp_path / intercept)
        calls.append(intercept)
    assert tables["call"] == tables["hooks"] and len(tables["call"][1]) > 5
    n_call = calls.index("call")
    assert n_call > 0 and calls.count(1) == 2 * n_call, calls  # both record every such call once


def test_a_name_bound_to_a_stopped_tracers_wrapper_gets_the_new_one(tmp_path, monkeypatch):
    """install rebinds module-level names: originals, and wrappers a stopped tracer left behind
    (code that imported a collective while it ran); other functions are left as they are."""
    import sys
    import types

    import torch.distributed as dist
    from tensor_trace.tracer.patching import ORIGINAL

    original = dist.all_reduce
    user = types.ModuleType("tt_user_module")

    def helper():
        return None

    user.helper = helper
    user.early = original  # bound before tracing started
    monkeypatch.setitem(sys.modules, user.__name__, user)
    tracer.start(out_dir=str(tmp_path / "a"))
    first = dist.all_reduce
    assert user.early is first and getattr(first, ORIGINAL) is original
    user.late = first  # bound while the first tracer ran: stale once it stops
    tracer.stop()
    assert user.early is original and user.late is first
    tracer.start(out_dir=str(tmp_path / "b"))
    try:
        second = dist.all_reduce
        assert second is not first and user.early is second and user.late is second
        assert user.helper is helper
    finally:
        tracer.stop()
    assert dist.all_reduce is original and user.early is original
