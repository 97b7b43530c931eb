"""Run under TRITON_INTERPRET=1 TENSOR_TRACE_MULTI_TENSOR=interpret: the multi-tensor fingerprint
kernel on CPU tensors (Triton's interpreter), checked against torch. Prints one JSON line."""
import json
import math

import torch

from tensor_trace.format.fingerprints import fingerprint_pairs
from tensor_trace.tracer import multi_tensor
from tensor_trace.tracer.fingerprint import StepFingerprints

torch.manual_seed(0)
report = {}
x = torch.randn(2, 3)
assert multi_tensor.usable(x), "kernel not usable under the interpreter"

# 1. The kernel itself: sizes below, at and across chunk boundaries, an empty tensor, bf16
#    and odd sizes and offsets.
C = multi_tensor.CHUNK
fp32 = [torch.randn(3, 5), torch.randn(C), torch.randn(C + 7), torch.randn(3 * C - 1) * 100,
        torch.empty(0)]
bf16 = [torch.randn(8, 96).bfloat16(), torch.randn(2 * C + 3).bfloat16()[1:]]
assert all(multi_tensor.supported(t) for t in fp32 + bf16)
assert not multi_tensor.supported(torch.randn(16, 16).t())  # not contiguous
assert not multi_tensor.supported(torch.arange(16))  # not floating
worst = 0.0
for group in (fp32, bf16):
    order, values, fill = multi_tensor.sum_l2(group)
    assert fill is None and sorted(order) == list(range(len(group)))
    for (s, l2), t in zip(values.tolist(), [group[i] for i in order]):
        f = t.double()
        es, eq = f.sum().item(), f.pow(2).sum().item()
        tol = 1e-5 * math.sqrt(max(eq, 1.0) * max(t.numel(), 1))
        assert abs(s - es) <= tol, (t.shape, s, es)
        assert abs(l2 * l2 - eq) <= 1e-5 * max(eq, 1.0), (t.shape, l2 * l2, eq)
        worst = max(worst, abs(s - es) / tol if tol else 0.0)
# Row-strided views (q, k, v split from a fused projection) are read where they are too.
wide = torch.randn(3, 2 * C)
rows = [wide[:, 5:C + 9], torch.randn(4, 1, 24)[:, :, 8:16], torch.randn(2, 3, 10).bfloat16()[:, :, 2:6]]
assert [multi_tensor.row_layout(t) for t in rows] == [(C + 4, 2 * C), (8, 24), (4, 10)]
assert multi_tensor.row_layout(torch.randn(16, 16).t()) is None  # columns strided: stacked
assert multi_tensor.row_layout(torch.randn(4, 6, 8)[:, :3, :4]) is None  # rows not equally spaced
assert multi_tensor.row_layout(torch.randn(4, 6, 8)[:, ::2, :4]) == (4, 16)  # they are here
for group in (rows[:2], rows[2:]):
    order, values, _ = multi_tensor.sum_l2(group, layouts=[multi_tensor.row_layout(t) for t in group])
    for (s, l2), t in zip(values.tolist(), [group[i] for i in order]):
        f = t.double()
        es, eq = f.sum().item(), f.pow(2).sum().item()
        assert abs(s - es) <= 1e-5 * math.sqrt(max(eq, 1.0) * t.numel()), (t.shape, s, es)
        assert abs(l2 * l2 - eq) <= 1e-5 * max(eq, 1.0), (t.shape, l2 * l2, eq)
report["kernel_tensors"] = len(fp32) + len(bf16) + len(rows)
report["worst_sum_error_over_tolerance"] = worst


def values(records):
    out = {}
    for _, step, first, data, indices in records:
        out.update({(step, i): (s, q) for i, s, q in fingerprint_pairs(first, data, indices)})
    return out


# 2. Deferred fingerprints through the kernel equal immediate ones; a non-contiguous tensor and
#    an integer tensor take the other paths.
ts = [torch.randn(4, 8), torch.randn(16, 3).t(), torch.randn(5, 7).half(), torch.arange(6),
      torch.randn(5, 16).half(),
      torch.randn(2, 96).bfloat16(), torch.randn(3, 1, 40)[:, :, 8:24]]
got = {}
launched_rows = []
_sum_l2 = multi_tensor.sum_l2
_sum_sumsq_table = multi_tensor.sum_sumsq_table


def spy(tensors, capturing=False, layouts=None):
    if layouts is not None:
        launched_rows.extend(layouts)
    return _sum_l2(tensors, capturing=capturing, layouts=layouts)


def spy_table(table, count, most, dtype, device):
    # (address, numel, columns, row stride) rows: a contiguous tensor is one row of numel
    assert len(table) == 4 * count
    for i in range(count):
        _, n, cols, stride = table[4 * i:4 * i + 4]
        if cols != n:
            launched_rows.append((cols, stride))
    return _sum_sumsq_table(table, count, most, dtype, device)


multi_tensor.sum_l2 = spy
multi_tensor.sum_sumsq_table = spy_table
for defer in (False, True):
    fps = StepFingerprints(defer_cuda=False, defer_cpu=defer)
    fps.add(ts)
    fps.finish_step(3)
    got[defer] = values(fps.collect(wait=True))
assert got[True].keys() == got[False].keys() == {(3, i) for i in range(len(ts))}
for k, (s, q) in got[False].items():
    s2, q2 = got[True][k]
    assert math.isclose(s, s2, rel_tol=1e-4, abs_tol=1e-4) and math.isclose(q, q2, rel_tol=1e-4), (k, s, s2, q, q2)
report["deferred_equal_immediate"] = len(ts)
report["deferred_row_strided_in_kernel"] = launched_rows

# 2b. The table the hooks build: one kind of tensor is one launch of the table as it was built;
#     materialised and stale tensors leave it before the launch.
launches = []


def count_table(table, count, most, dtype, device):
    launches.append(count)
    return _sum_sumsq_table(table, count, most, dtype, device)


multi_tensor.sum_sumsq_table = count_table
one_kind = [torch.randn(4, 8), torch.randn(3, 1, 40)[:, :, 8:24], torch.randn(7), torch.empty(0)]
with torch.inference_mode():
    fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
    for t in one_kind:
        fps.add_one(t.clone() if t.is_contiguous() else t)
    fps.finish_step(4)
    got_one = values(fps.collect(wait=True))
assert launches == [4] and sorted(got_one) == [(4, i) for i in range(4)], (launches, got_one)
for i, t in enumerate(one_kind):
    f = t.double()
    assert math.isclose(got_one[(4, i)][0], f.sum().item(), rel_tol=1e-4, abs_tol=1e-4)
    assert math.isclose(got_one[(4, i)][1], f.pow(2).sum().item(), rel_tol=1e-4, abs_tol=1e-4)
a, b, c = torch.randn(6), torch.randn(6), torch.randn(6)
fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
for t in (a, b, c):
    fps.add_one(t)
b_sum = b.sum().item()
fps.materialize([b])  # a collective's input: reduced now, then updated in place
b.mul_(3)
c.add_(1)  # updated in place after it was seen: no value
fps.finish_step(5)
got_abc = values(fps.collect(wait=True))
assert launches == [4, 1] and sorted(got_abc) == [(5, 0), (5, 1)] and fps.stale == 1
assert math.isclose(got_abc[(5, 0)][0], a.sum().item(), rel_tol=1e-4, abs_tol=1e-4)
assert math.isclose(got_abc[(5, 1)][0], b_sum, rel_tol=1e-4, abs_tol=1e-4)
report["hook_table_launches"] = launches
multi_tensor.sum_l2 = _sum_l2
multi_tensor.sum_sumsq_table = _sum_sumsq_table

# 3. Capture bookkeeping: the kernel's table is left for after the capture, then filled with
#    one entry per chunk of each tensor (contiguous or row-strided, one launch); large tensors
#    are deferred too.
fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
assert multi_tensor.sum_l2([torch.ones(16)], capturing=True) is None, \
    "a capture without an arena must fall back"
multi_tensor.begin_capture(torch.device("cpu"))  # GraphTracker does this before capture_begin
arena = multi_tensor._state["arena"]
fps.begin_capture()
CC = multi_tensor.CAPTURE_CHUNK
big = torch.randn(CC * 40 + 3)  # deferred under capture, whatever its size
split = torch.randn(5, 1, 3 * CC)[:, :, CC // 2:CC // 2 + CC + 100]  # rows of CC + 100 columns
group = [torch.randn(4, 8), torch.randn(3, 16), big, split, torch.empty(0)]
fps.add(group)
captured = fps.finish_capture()
assert not fps.capturing and fps.defer_bytes > (64 << 20)
assert len(captured.fills) == 1, captured.fills
table = captured.fills[0].table
assert table.data_ptr() == arena.buf[2:].data_ptr(), "the table is a slice of the arena, after its gate"
n_chunks = 1 + 1 + 41 + 6 + 1  # 32 and 48 elements; 40 chunks and 3; 5 rows of CC + 100: 6
#                               chunks; an empty tensor: one chunk that reads nothing
assert table.numel() == 4 * n_chunks and table.eq(0).all(), table  # not filled during the "capture"
captured.prepare()
multi_tensor.end_capture()
entries = [table[i:i + 4].tolist() for i in range(0, table.numel(), 4)]
expect = []
for row, t in enumerate(group):
    n = t.numel()
    layout = multi_tensor.row_layout(t) if not t.is_contiguous() else None
    where = row if layout is None else row + (layout[0] << 32)
    for start in range(0, max(n, 1), CC):
        expect.append([t.data_ptr(), start + (min(n, start + CC) << 32), where,
                       0 if layout is None else layout[1]])
assert entries == expect, (entries[:3], expect[:3])
assert arena.buf[2 + 4 * n_chunks:].eq(0).all() and arena.buf[0].item() == 1  # the gate: on


def run_chunks(table, k, dtype, gate=None):
    out = torch.zeros(k, 2)
    if gate is None:
        gate = torch.ones(1, dtype=torch.int64)
    multi_tensor._state["chunks"][(table.numel() // 4,)](
        table, out, gate, BLOCK=multi_tensor.BLOCK, DTYPE=multi_tensor._state["tl_dtypes"][dtype])
    return out


def check_values(out, ts):
    for (s, q), t in zip(out.tolist(), ts):
        f = t.double()
        es, eq = f.sum().item(), f.pow(2).sum().item()
        assert abs(s - es) <= 1e-5 * math.sqrt(max(eq, 1.0) * t.numel()), (t.shape, s, es)
        assert abs(q - eq) <= 1e-5 * max(eq, 1.0), (t.shape, q, eq)


check_values(run_chunks(table, len(group), torch.float32), group)  # what a replay computes
# A replay outside the fingerprint schedule: the capture's gate off, its kernel reads nothing.
gate = captured.fills[0].gate
assert gate is arena.gate
captured.read_at_replay(False)
assert arena.buf[0].item() == 0
report["gated_off_sums"] = run_chunks(table, len(group), torch.float32, gate.flag).abs().sum().item()
captured.read_at_replay(True)
check_values(run_chunks(table, len(group), torch.float32, gate.flag), group)
# A short arena: longer chunks, the same values.
multi_tensor.begin_capture(torch.device("cpu"))
multi_tensor._state["arena"].used = multi_tensor.ARENA_ENTRIES - 4 * 7
fps.begin_capture()
fps.add(group)
captured = fps.finish_capture()
multi_tensor.end_capture()
table = captured.fills[0].table
assert table.numel() <= 4 * 7 and captured.static.shape == (5, 2), table.numel()
captured.prepare()
check_values(run_chunks(table, len(group), torch.float32), group)
report["capture_chunks_short_arena"] = table.numel() // 4
# A full arena: the tensors are stacked instead, with the same values.
multi_tensor.begin_capture(torch.device("cpu"))
multi_tensor._state["arena"].used = multi_tensor.ARENA_ENTRIES - 2
fps.begin_capture()
fps.add(group[:2])
captured = fps.finish_capture()
multi_tensor.end_capture()
assert captured.fills == [] and captured.static.shape == (2, 2)
expect = [(t.sum().item(), t.norm().item()) for t in group[:2]]
for (s, l2), (es, el2) in zip(captured.static.tolist(), expect):
    assert math.isclose(s, es, rel_tol=1e-5, abs_tol=1e-5) and math.isclose(l2, el2, rel_tol=1e-5)
report["capture_table_filled"] = len(group)
report["capture_chunks"] = n_chunks
print(json.dumps(report))
