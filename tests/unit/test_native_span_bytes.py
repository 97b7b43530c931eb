"""tracer/native_call.py queues a span as the msgpack bytes of its tuple (in a run of them,
tracer/native_spans.py); tracer/writer.py writes such items as they are among packed tuples. Both must give the bytes msgpack gives the tuple,
for ints of every width and sign, and the rank file must read back the values recorded."""

import msgpack
import torch

from tensor_trace import schema, tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files
from tensor_trace.tracer.writer import is_run, pack_records

# span indices and flags that take each msgpack int form (flags steered out of their meaning)
INDICES = [0x7f, 0xab, 0xabcd, 0x12345678, 0x123456789]
FLAGS = [-5, -100, -30_000, -(1 << 20), -(1 << 40)]


class Steer(torch.nn.Module):
    """Sets the tracer's span index and span flags, so that the next call's span carries them."""

    def __init__(self, tr_box, index, flags):
        super().__init__()
        self.tr_box, self.index, self.flags = tr_box, index, flags

    def forward(self, x):
        tr = self.tr_box[0]
        tr.span_count = self.index
        tr.span_flags = self.flags
        return x


class Model(torch.nn.Module):
    def __init__(self, tr_box):
        super().__init__()
        self.steer = torch.nn.ModuleList(Steer(tr_box, i, f) for i, f in zip(INDICES, FLAGS))
        self.leaf = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in INDICES)

    def forward(self, x):
        for steer, leaf in zip(self.steer, self.leaf):
            x = leaf(steer(x))
        return x


def test_pack_records_gives_msgpacks_bytes_for_a_mix_of_tuples_and_packed_ones():
    packer = msgpack.Packer(use_bin_type=True)
    for n in (1, 15, 16, 255, 256):
        records = [(schema.SPAN, 3, i, -1, 7, i % 3, -(i << 20), 1 << (i % 64), 2, -1, -1, 1, 0)
                   for i in range(n)]
        mixed = [msgpack.packb(r, use_bin_type=True) if i % 3 else r for i, r in enumerate(records)]
        assert pack_records(packer, mixed) == packer.pack(records)
        assert pack_records(packer, list(records)) == packer.pack(records)


def test_c_wrapper_appends_each_span_as_msgpacks_bytes_of_its_tuple(tmp_path, monkeypatch):
    from native_loaded import load_native_in_process

    load_native_in_process(monkeypatch)
    box = []
    model = Model(box)
    x = torch.randn(2, 4)
    with torch.inference_mode():
        tr = tracer.start(out_dir=str(tmp_path), fingerprint=False, lineage=False)
        box.append(tr)
        try:
            tr.max_spans = 1 << 62  # (the steered indices are past the default bound)
            model(x)  # (the step that names the modules: the Python wrapper)
            pending = tr.writer.pending
            del pending[:]
            model(x)
            tr.span_flags = 0
            runs = [r for r in pending if is_run(r)]  # (tracer/native_spans.py: spans in runs)
            packed = [b for r in runs for b in r.records()]
            assert packed and tr.global_handles[0].native_call.recorded > 0
            for r in packed:
                assert r == msgpack.packb(msgpack.unpackb(r), use_bin_type=True)
            spans = [msgpack.unpackb(r) for r in packed]
            assert all(s[0] == schema.SPAN for s in spans)
            leaf_spans = {s[2]: s for s in spans if s[2] in INDICES}
            assert sorted(leaf_spans) == INDICES
            assert [leaf_spans[i][12] for i in INDICES] == FLAGS
            forms = {r[i] for r in packed for i in range(1, len(r)) if r[i] >= 0xcc}
            assert {0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd1, 0xd2, 0xd3} <= forms
        finally:
            tracer.stop()
    (path,) = rank_files(str(tmp_path))
    rt = load_rank_file(path)
    read = {s.index: s for step in rt.steps.values() for s in step.spans}
    assert set(INDICES) <= set(read)
    assert [read[i].flags for i in INDICES] == FLAGS


def test_listeners_get_packed_spans_as_tuples(tmp_path):
    from tensor_trace.tracer.writer import RankWriter

    w = RankWriter(str(tmp_path / "rank.tt"), {"rank": 0}, flush_interval_s=3600)
    got = []
    w.listeners.append(got.extend)
    span = (schema.SPAN, 1, 2, -1, 3, 0, 5, 6, 0, -1, -1, 1, 0)
    end = (schema.STEP_END, 1, 10, 1, 0)
    w.pending.extend([msgpack.packb(span, use_bin_type=True), end])
    w.flush()
    w.close()
    assert got[-2:] == [span, end] and type(got[-2]) is tuple
