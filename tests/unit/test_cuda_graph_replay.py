"""CUDA-graph capture and replay bookkeeping, on the CPU with a stand-in graph class.

``FakeGraph`` has CUDAGraph's three methods; while it "captures", the tracer's capture check says
yes, so the captured step goes down the graph path (fingerprint kernels into a static buffer,
the graph remembered for its replays). On a CPU the captured computation also executes, so the
static buffer holds the values of the capture's input, and a replay that changes nothing must
give fingerprints equal to an eager step on the same input. The GPU half (real capture, real
replays with new inputs) is tests/gpu/test_gpu_graph_replay.py and bench/cuda_graph_replay.py.
"""

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from tensor_trace import schema, tracer
from tensor_trace.exporters import query as q
from tensor_trace.exporters.pipeline import merge_ranks, open_store
from tensor_trace.exporters.store.reader import iter_records, load_rank_file, rank_files
from tensor_trace.tracer import steps


class FakeGraph:
    active = None

    def __init__(self):
        self.replays = 0
        self.on_replay = None

    def capture_begin(self, *args, **kwargs):
        FakeGraph.active = self

    def capture_end(self):
        FakeGraph.active = None

    def replay(self):
        self.replays += 1
        if self.on_replay is not None:
            self.on_replay()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        y = self.down(torch.relu(self.up(x)))
        dist.all_reduce(y)  # a no-op on the fake backend: structure only
        return x + y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(steps, "is_capturing", lambda: FakeGraph.active is not None)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()
    FakeGraph.active = None


def _capture(model, static_in):
    g = torch.cuda.CUDAGraph()
    g.capture_begin()
    out = model(static_in)
    g.capture_end()
    return g, out


def test_replays_are_steps_with_the_captured_structure_and_the_graph_values(tmp_path, graphs):
    model = Net().eval()
    x = torch.randn(4, 8)
    tr = tracer.start(out_dir=str(tmp_path))
    try:
        with torch.no_grad():
            model(x)                      # step 0: eager
            g, _ = _capture(model, x)     # step 1: captured
            g.replay()                    # step 2
            g.replay()                    # step 3
    finally:
        tracer.stop()
    assert g.replays == 2 and tr.stats["graph_replays"] == 2
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    assert sorted(rt.steps) == [0, 1, 2, 3]
    eager, captured = rt.steps[0], rt.steps[1]
    assert all(s.flags & schema.FLAG_CAPTURED for s in captured.spans)
    assert captured.fingerprints == {}  # a capture executes nothing: no values of its own
    for step in (2, 3):
        st = rt.steps[step]
        assert st.attrs == {"replay_of": 1} and st.spans == []
        assert len(st.fingerprints) == max(i for s in eager.spans for i in s.fp_refs) + 1
    replays = [r for r in iter_records(rank_files(str(tmp_path))[0]) if r[0] == schema.REPLAY]
    assert [(r[1], r[2], r[3], r[4], r[5]) for r in replays] == [(2, 1, 0, 0, 0), (3, 1, 0, 0, 0)]

    merge_ranks(str(tmp_path))
    con = open_store(str(tmp_path))
    n_eager = con.execute("SELECT COUNT(*) FROM spans WHERE step=0").fetchone()[0]
    for step in (2, 3):
        n, flagged = con.execute("SELECT COUNT(*), SUM((flags & ?) != 0) FROM spans WHERE step=?",
                                 (schema.FLAG_REPLAYED, step)).fetchone()
        assert n == flagged == n_eager
        assert con.execute("SELECT COUNT(*) FROM collectives WHERE step=?", (step,)).fetchone()[0] == 2
    # Same input: each replayed point has the eager step's fingerprint (within fp32 rounding).
    eager_pts = {p["point"]: p for p in q.placement(con, "*:*", step=0)}
    for step in (2, 3):
        replay_pts = {p["point"]: p for p in q.placement(con, "*:*", step=step)}
        assert replay_pts.keys() == eager_pts.keys()
        for name, p in replay_pts.items():
            assert p["placement"] == eager_pts[name]["placement"]
            assert p["reduction"] == eager_pts[name]["reduction"]
            assert p["fingerprint"] == pytest.approx(eager_pts[name]["fingerprint"], rel=1e-5, abs=1e-5)
    assert sum(p["fingerprint"] is not None for p in eager_pts.values()) >= 10
    # Collectives: replayed copies are not taken for skipped or mismatched calls.
    assert con.execute("SELECT COUNT(*) FROM collective_issues").fetchone()[0] == 0
    (row,) = [r for r in q.collectives(con, "blocks.0")]
    assert row["per_step"] == {0: 1, 1: 1, 2: 1, 3: 1}


def test_replay_values_are_read_from_the_static_buffer_at_each_replay(tmp_path, graphs):
    model = Net().eval()
    x = torch.randn(4, 8)
    tr = tracer.start(out_dir=str(tmp_path))
    try:
        with torch.no_grad():
            g, _ = _capture(model, x)     # step 0: captured
            (cap,) = tr.graphs.graphs[g]
            static = cap.fps.static
            assert static.shape == (len(cap.fps.indices), 2) and static.dtype == torch.float32

            def device_writes():          # what the graph's kernels do on a GPU
                static[:, 0] = torch.arange(len(static), dtype=torch.float32) + 100 * g.replays
                static[:, 1] = 2.0
            g.on_replay = device_writes
            g.replay()                    # step 1
            g.replay()                    # step 2
    finally:
        tracer.stop()
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    for step, k in ((1, 1), (2, 2)):
        fps = rt.steps[step].fingerprints
        for row, index in enumerate(cap.fps.indices):
            assert fps[index] == (row + 100 * k, 4.0)  # l2 2.0 is written as its square
        for dup, src in cap.fps.dups:
            assert fps[dup] == fps[src]


def test_a_replay_inside_a_framework_step_joins_that_step(tmp_path, graphs):
    """SGLang replays inside ModelRunner.forward, which the integration makes a step: the
    replay's spans go into that step after its own, indices shifted."""
    model = Net().eval()
    x = torch.randn(4, 8)

    class Runner(nn.Module):
        pass

    runner = Runner()
    tr = tracer.start(out_dir=str(tmp_path))
    try:
        with torch.no_grad():
            model(x)                                                     # step 0
            g, _ = _capture(model, x)                                     # step 1
            tr.run_external_step(runner, (x,), {"forward_mode": "decode"}, g.replay)   # step 2
    finally:
        tracer.stop()
    merge_ranks(str(tmp_path))
    con = open_store(str(tmp_path))
    rows = con.execute("SELECT idx, parent, flags FROM spans WHERE step=2 ORDER BY idx").fetchall()
    n_cap = con.execute("SELECT COUNT(*) FROM spans WHERE step=1").fetchone()[0]
    assert rows[0][:2] == (0, -1) and not rows[0][2] & schema.FLAG_REPLAYED  # the runner's own root
    assert len(rows) == 1 + n_cap and all(f & schema.FLAG_REPLAYED for _, _, f in rows[1:])
    assert [r[0] for r in rows] == list(range(len(rows)))
    attrs = json.loads(con.execute("SELECT attrs FROM steps WHERE step=2").fetchone()[0])
    assert attrs == {"forward_mode": "decode"}
    eager = {p["point"]: p["placement"] for p in q.placement(con, "*:*", step=0)}
    in_step = {p["point"]: p["placement"] for p in q.placement(con, "*:*", step=2)}
    assert {k: v for k, v in in_step.items() if k in eager} == eager


def test_replays_follow_the_fingerprint_schedule_and_gate_the_graph_kernels(tmp_path, graphs):
    """Replays run as steps of their own take fingerprints on the schedule (first 4 of the kind,
    then every Nth, counted apart from eager steps); on the others the graph's kernels are gated
    off before the replay runs, and after the tracer stops they stay off."""
    from tensor_trace.tracer.multi_tensor import ReplayGate, TableFill

    model = Net().eval()
    x = torch.randn(4, 8)
    gate_at_replay = []
    tr = tracer.start(out_dir=str(tmp_path), fingerprint_every=3)
    try:
        with torch.no_grad():
            for _ in range(6):
                model(x)                  # steps 0-5: eager, their own schedule
            g, _ = _capture(model, x)     # step 6: captured
            (cap,) = tr.graphs.graphs[g]
            # On a GPU the kernel's table comes with the capture's gate; a stand-in one here.
            gate = ReplayGate(torch.ones(1, dtype=torch.int64))
            cap.fps.fills.append(TableFill(torch.zeros(4, dtype=torch.int64), [0] * 4, gate))
            g.on_replay = lambda: gate_at_replay.append(int(gate.flag.item()))
            for _ in range(9):
                g.replay()                # steps 7-15
    finally:
        tracer.stop()
    g.replay()                            # untraced: no one reads the values
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    replays = [rt.steps[s] for s in range(7, 16)]
    assert all(st.attrs == {"replay_of": 6} for st in replays)
    due = [n < 4 or n % 3 == 0 for n in range(9)]  # the 5th eager-step count does not carry over
    assert [bool(st.fingerprints) for st in replays] == due
    assert gate_at_replay == [int(d) for d in due] + [0]
    fp_base = [r[5] for r in iter_records(rank_files(str(tmp_path))[0]) if r[0] == schema.REPLAY]
    assert [b >= 0 for b in fp_base] == due
    merge_ranks(str(tmp_path))
    con = open_store(str(tmp_path))
    flags = [r[0] for r in con.execute(
        "SELECT fingerprinted FROM steps WHERE step BETWEEN 7 AND 15 ORDER BY step")]
    assert flags == [int(d) for d in due]


def test_a_replay_inside_a_framework_step_reads_values_on_that_steps_schedule(tmp_path, graphs):
    """SGLang's decode replays inside ModelRunner.forward: the step's own schedule decides, and
    the graph's kernels are gated the same way."""
    from tensor_trace.tracer.multi_tensor import ReplayGate, TableFill

    model = Net().eval()
    x = torch.randn(4, 8)

    class Runner(nn.Module):
        pass

    runner = Runner()
    gate_at_replay = []
    tr = tracer.start(out_dir=str(tmp_path), fingerprint_every=2)
    try:
        with torch.no_grad():
            g, _ = _capture(model, x)                                     # step 0
            (cap,) = tr.graphs.graphs[g]
            gate = ReplayGate(torch.ones(1, dtype=torch.int64))
            cap.fps.fills.append(TableFill(torch.zeros(4, dtype=torch.int64), [0] * 4, gate))
            g.on_replay = lambda: gate_at_replay.append(int(gate.flag.item()))
            for _ in range(8):                                            # steps 1-8
                tr.run_external_step(runner, (x,), {"forward_mode": "decode"}, g.replay)
    finally:
        tracer.stop()
    due = [n < 4 or n % 2 == 0 for n in range(8)]
    assert gate_at_replay == [int(d) for d in due]
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    assert [bool(rt.steps[s].fingerprints) for s in range(1, 9)] == due


def test_no_fingerprint_replays_keep_structure(tmp_path, graphs):
    model = Net().eval()
    tracer.start(out_dir=str(tmp_path), fingerprint=False)
    try:
        with torch.no_grad():
            g, _ = _capture(model, torch.randn(4, 8))
            g.replay()
    finally:
        tracer.stop()
    merge_ranks(str(tmp_path))
    con = open_store(str(tmp_path))
    assert con.execute("SELECT COUNT(*) FROM spans WHERE step=1").fetchone()[0] == \
        con.execute("SELECT COUNT(*) FROM spans WHERE step=0").fetchone()[0] > 0
    assert con.execute("SELECT COUNT(*) FROM fingerprints").fetchone()[0] == 0


def test_stop_restores_the_graph_methods(graphs):
    before = {n: FakeGraph.__dict__[n] for n in ("capture_begin", "capture_end", "replay")}
    tracer.start(out_dir="/tmp/unused-tt")
    assert all(getattr(FakeGraph, n) is not f for n, f in before.items())
    tracer.stop()
    assert all(FakeGraph.__dict__[n] is f for n, f in before.items())


class _StubFingerprints:
    """Stands in for CapturedFingerprints: counts the calls GraphTracker makes."""

    def __init__(self):
        self.prepared = self.waits = 0

    def prepare(self):
        self.prepared += 1

    def before_replay(self):
        self.waits += 1


class _StubTracer:
    enabled, fingerprint = True, True

    def __init__(self):
        self.stats, self.errors, self.replays = {}, [], 0

    def on_error(self, where, exc):
        self.errors.append((where, exc))

    def run_replay(self, captured, fn, *args, **kwargs):
        self.replays += 1
        return fn(*args, **kwargs)


def test_graph_keeps_its_buffers_and_orders_table_copies_before_replays():
    from tensor_trace.tracer.cuda_graphs import CapturedStep, GraphTracker

    class Graph:  # its own methods: the tracker wraps a class's own methods only
        def __init__(self):
            self.replays = 0

        def capture_begin(self):
            pass

        def capture_end(self):
            pass

        def replay(self):
            self.replays += 1

    tr = _StubTracer()
    tracker = GraphTracker(tr, graph_cls=Graph)
    tracker.install()
    try:
        g = Graph()
        fps = _StubFingerprints()
        g.capture_begin()
        tracker.add_captured(CapturedStep(1, ("", "Net"), {}, 3, 0, fps))
        g.capture_end()
        # Filled once the capture has ended; owned by the graph, which rewrites and reads them
        # at every replay even after the tracer has stopped.
        assert fps.prepared == 1 and g._tensor_trace_buffers == [fps]
        g.replay()
        assert fps.waits == 1 and tr.replays == 1 and g.replays == 1
    finally:
        tracker.uninstall()
    assert fps.waits == 2  # uninstall orders pending copies before unwrapped replays
    assert tr.errors == []
    g.replay()  # unwrapped now
    assert g.replays == 2 and fps.waits == 2
