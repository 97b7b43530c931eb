"""tracer/native_spans.py and tracer/native_modules.py: the C call wrapper queues its spans in runs
of packed records, and keeps what it reads of a module (its entry, its last one-tensor layout) in
C; the rank file is what the records queued one by one make, the bound on queued records counts
a run by its records, and what is kept follows the tracer's state as it changes."""

import gc

import msgpack
import torch

from tensor_trace import schema, tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files
from tensor_trace.tracer.writer import CHUNK_RECORDS, RankWriter, is_run


def _span(i):
    return (schema.SPAN, 3, i, -1, 7, i % 3, -(i << 20), 1 << (i % 64), 2, -1, -1, 1, 0)


def _write(path, items):
    w = RankWriter(str(path), {"rank": 0}, flush_interval_s=3600)
    got = []
    w.listeners.append(got.extend)
    w.pending.extend(items)
    w.flush()
    w.close()
    return path.read_bytes(), got


def test_runs_are_written_as_their_records_queued_one_by_one(tmp_path, monkeypatch):
    from native_loaded import load_native_in_process

    span_run = load_native_in_process(monkeypatch).span_run_class()
    records, items, i = [], [], 0
    # runs across chunk boundaries (CHUNK_RECORDS), between tuples and packed bytes
    for n in (1, 300, 2, CHUNK_RECORDS - 5, 0, 600):
        run = span_run()
        for _ in range(n):
            records.append(_span(i))
            run.append(msgpack.packb(_span(i), use_bin_type=True))
            i += 1
        items += [run, (schema.STEP_END, 3, i, 1, 0), msgpack.packb(_span(i), use_bin_type=True)]
        records += [(schema.STEP_END, 3, i, 1, 0), _span(i)]
        i += 1
    assert sum(len(r) if is_run(r) else 1 for r in items) == len(records)
    want, want_got = _write(tmp_path / "tuples.ttr", list(records))
    got, got_got = _write(tmp_path / "runs.ttr", items)
    assert got == want
    assert got_got == want_got == records and all(type(r) is tuple for r in got_got)


class Chain(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.leaves = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(n))

    def forward(self, x):
        for leaf in self.leaves:
            x = leaf(x)
        return x


def _queued(writer):
    return sum(len(r) if is_run(r) else 1 for r in writer.pending)


def test_c_wrapper_queues_runs_and_flushes_at_the_bound_in_records(tmp_path, monkeypatch):
    from native_loaded import load_native_in_process

    load_native_in_process(monkeypatch)
    model = Chain(60)
    x = torch.randn(2, 4)
    with torch.inference_mode():
        tr = tracer.start(out_dir=str(tmp_path), fingerprint=False, lineage=False, flush_interval_s=3600)
        try:
            model(x)  # (the step that names the modules: the Python wrapper)
            model(x)  # (the C wrapper has read the writer's attributes: kept until one is assigned)
            w = tr.writer
            w.flush()
            model(x)
            assert any(map(is_run, w.pending)) and len(w.pending) < _queued(w) - 50  # a run a step, not a record
            w.flush()
            w.max_buffered = 40
            chunks = w.chunks_written
            model(x)
            assert w.chunks_written > chunks  # flushed inside the step: 60 spans over a bound of 40
            assert _queued(w) < 40
            assert tr.global_handles[0].native_call.recorded >= 2 * 60 + 50
        finally:
            tracer.stop()
    (path,) = rank_files(str(tmp_path))
    rt = load_rank_file(path)
    assert sorted(rt.steps) == [0, 1, 2, 3] and not rt.errors
    for step in rt.steps.values():
        assert [s.path for s in sorted(step.spans, key=lambda s: s.index)][1:] == [f"leaves.{i}" for i in range(60)]


def _spans_by_step(out, attr: str) -> list:
    """Each step of the one rank file under ``out``: its spans in order, as (path, each
    tensor's ``attr``)."""
    (path,) = rank_files(str(out))
    rt = load_rank_file(path)
    assert not rt.errors
    return [[(s.path, [getattr(t, attr) for t in s.tensors]) for s in sorted(step.spans, key=lambda s: s.index)]
            for _, step in sorted(rt.steps.items())]


def _layouts_and_new_modules(out, monkeypatch):
    """Steps of one model: other layouts, a step while torch compiles (traced by neither wrapper),
    then a module replaced (the old one dies and its entry in Tracer.ids with it; the new one may
    take its address); the spans' paths and shapes a step, the spans whose layout the C wrapper
    kept (0 without it) and those it recorded while torch compiled."""
    torch.manual_seed(0)
    model = Chain(5)
    with torch.inference_mode():
        tr = tracer.start(out_dir=str(out), fingerprint=False, lineage=False, flush_interval_s=3600)
        try:
            for batch in (2, 2, 2, 2, 3, 3):
                model(torch.randn(batch, 4))
            call = tr.global_handles[0].native_call
            kept = call.kept_layouts if call is not None else 0
            recorded = call.recorded if call is not None else 0
            with monkeypatch.context() as m:
                m.setattr(torch.compiler, "_is_compiling_flag", True)
                model(torch.randn(3, 4))
            compiling = (call.recorded if call is not None else 0) - recorded
            model.leaves[2] = torch.nn.Linear(4, 4)
            gc.collect()
            for batch in (3, 3, 2):
                model(torch.randn(batch, 4))
        finally:
            tracer.stop()
    return _spans_by_step(out, "shape"), kept, compiling


def test_what_c_keeps_of_a_module_follows_new_layouts_and_new_modules(tmp_path, monkeypatch):
    from native_loaded import load_native_in_process

    load_native_in_process(monkeypatch)
    got, kept, compiling = _layouts_and_new_modules(tmp_path / "c", monkeypatch)
    assert kept >= 5 and compiling == 0  # (the fourth step's at least) from the modules' slots
    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "0")
    want, kept, _ = _layouts_and_new_modules(tmp_path / "python", monkeypatch)
    assert kept == 0
    assert got == want
    assert len(got) == 10 and {tuple(shape) for _, shapes in got[4][1:] for shape in shapes} == {(3, 4)}


class Same(torch.nn.Module):
    def forward(self, x):
        return x + 0


def _dtypes(out):
    """Steps of one-tensor calls whose inputs differ from the last step's by dtype alone (the
    module's slot keeps a layout by the call's metadata, packed): each span's dtypes."""
    model = torch.nn.Sequential(*(Same() for _ in range(4)))
    with torch.inference_mode():
        tr = tracer.start(out_dir=str(out), fingerprint=False, lineage=False, flush_interval_s=3600)
        try:
            for dtype in (torch.float32,) * 3 + (torch.float64,) * 2 + (torch.float32, torch.int64):
                model(torch.ones(3, 2, dtype=dtype))
            call = tr.global_handles[0].native_call
            kept = call.kept_layouts if call is not None else 0
        finally:
            tracer.stop()
    return _spans_by_step(out, "dtype"), kept


def test_what_c_keeps_of_a_layout_follows_the_dtype(tmp_path, monkeypatch):
    from native_loaded import load_native_in_process

    load_native_in_process(monkeypatch)
    got, kept = _dtypes(tmp_path / "c")
    assert kept >= 6  # (in the third and fifth steps, from the modules' slots)
    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "0")
    want, _ = _dtypes(tmp_path / "python")
    assert got == want
    assert [{d for _, ds in step[1:] for d in ds} for step in got] == [
        {"float32"}, {"float32"}, {"float32"}, {"float64"}, {"float64"}, {"float32"}, {"int64"}]


def test_c_wrapper_follows_the_writer_forgetting_its_ids(tmp_path, monkeypatch):
    """The writer forgets its interned ids (a new generation) between steps: what the C wrapper
    kept of the writer and of the modules' entries is dropped, the modules named again."""
    from native_loaded import load_native_in_process

    load_native_in_process(monkeypatch)
    model = Chain(6)
    with torch.inference_mode():
        tr = tracer.start(out_dir=str(tmp_path), fingerprint=False, lineage=False, flush_interval_s=3600)
        try:
            for _ in range(3):
                model(torch.randn(2, 4))
            recorded = tr.global_handles[0].native_call.recorded
            for _ in range(2):
                tr.writer._forget_ids()
                for _ in range(2):
                    model(torch.randn(2, 4))
            assert tr.global_handles[0].native_call.recorded >= recorded + 2 * 5  # (a step after each: in C)
        finally:
            tracer.stop()
    (path,) = rank_files(str(tmp_path))
    rt = load_rank_file(path)
    assert sorted(rt.steps) == list(range(7)) and not rt.errors
    for step in rt.steps.values():
        assert [s.path for s in sorted(step.spans, key=lambda s: s.index)][1:] == [f"leaves.{i}" for i in range(6)]
