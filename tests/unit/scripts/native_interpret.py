"""Run with TENSOR_TRACE_NATIVE=1 TRITON_INTERPRET=1 TENSOR_TRACE_MULTI_TENSOR=interpret: the C++
fingerprint table (tracer/native.py) against the Python path, on CPU tensors through Triton's
interpreter. Prints one JSON line."""
import json
import math

import torch

from tensor_trace.format.fingerprints import fingerprint_pairs
from tensor_trace.tracer import native
from tensor_trace.tracer.fingerprint import StepFingerprints

native.ensure(block=True)
assert native.table_class() is not None, native.error()
report = {}


def values(records):
    out = {}
    for _, step, first, data, indices in records:
        out.update({(step, i): (s, q) for i, s, q in fingerprint_pairs(first, data, indices)})
    return out


torch.manual_seed(0)
qkv = torch.randn(4, 1, 96)
q, k, v = qkv.split([64, 16, 16], -1)
fixed = [torch.randn(4, 64), qkv, torch.randn(5, 7).half(), torch.randn(16, 3).t(), torch.arange(6)]
A, B, C = torch.randn(6), torch.randn(6), torch.randn(8, 8)
got, held = {}, {}
for use_native in (False, True):
    fps = StepFingerprints(defer_cuda=False, defer_cpu=True, native_mode=None if use_native else "0")
    for step in (0, 1):  # the first tensor of step 0 finds the table; step 1 starts with it
        refs = [fps.add_one(t) for t in fixed]
        refs.append(fps.add([q, k], store=False))  # rotary's inputs: row-strided views
        qo, ko = q * 2, k * 2
        refs.append(fps.add([qo, ko]))
        refs.append(fps.add([qo, ko, v], store=False))  # repeats of the last outputs; v held
        a = A.clone()
        refs.append(fps.add_one(a))
        fps.materialize([a])  # a collective's input: reduced now, then updated in place
        a.mul_(3)
        fps.forget([a])
        refs.append(fps.add_one(a, False))
        b = B.clone()
        refs.append(fps.add_one(b))
        b.add_(1)  # updated in place after it was seen: no value
        with torch.inference_mode():
            c = C * 1  # an inference tensor: held without a version counter
            refs.append(fps.add_one(c))
        held[(use_native, step)] = fps.native_held() or 0
        fps.finish_step(step)
    got[use_native] = values(fps.collect(wait=True))
    report[f"stale_{use_native}"] = fps.stale
    report[f"table_{use_native}"] = fps.native_held() is not None
assert got[True].keys() == got[False].keys(), (sorted(got[True]), sorted(got[False]))
for key, (s, sq) in got[False].items():
    s2, sq2 = got[True][key]
    assert math.isclose(s, s2, rel_tol=1e-4, abs_tol=1e-4) and math.isclose(sq, sq2, rel_tol=1e-4), (key, s, s2, sq, sq2)
report["values_equal"] = len(got[False])
report["held_in_table"] = [held[(True, 0)], held[(True, 1)]]

# A mid-step flush: past the hold bound, the table is reduced and emptied within the step.
fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
fps.defer_bytes = 1000
xs = [torch.randn(100) for _ in range(6)]
for x in xs:
    fps.add_one(x)
sizes_after = fps.native_held()
fps.finish_step(7)
vals = values(fps.collect(wait=True))
assert sorted(vals) == [(7, i) for i in range(6)]
for i, x in enumerate(xs):
    assert math.isclose(vals[(7, i)][0], x.double().sum().item(), rel_tol=1e-4, abs_tol=1e-4)
report["mid_step_left"] = sizes_after

# What the table does not take goes back to the Python path: -2 for what is not dense (a sparse,
# a meta, a nested tensor: their memory is not read), -1 for a dense one of another dtype.
nt = native.table_class()(1 << 24, torch.device("cpu"))
report["not_taken"] = [nt.hold(torch.randn(4, 4).to_sparse(), 0), nt.hold(torch.empty(4, device="meta"), 1),
                       nt.hold(torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), 8),
                       nt.hold(torch.arange(4), 2), nt.size()]
# hold_in, the hooks' way in: plain tensors of the table's own device only
hold_in = native.hold_in()
Sub = type("Sub", (torch.Tensor,), {})
report["hold_in_not_taken"] = [hold_in(nt.slot, torch.randn(4).as_subclass(Sub), 3),
                               hold_in(nt.slot, torch.empty(0), 4), hold_in(10**6, torch.randn(4), 5),
                               hold_in(nt.slot, "x", 6), nt.size()]
report["hold_in_taken"] = hold_in(nt.slot, torch.randn(4), 7) == 16 and nt.size() == 1

# pair_key: one int per distinct (shape, dtype, device) pair, matched exactly; -1 for what it
# does not read (then the tracer keys the span in Python).
pk = native.pair_key()
x, y = torch.randn(4, 64), torch.randn(4, 64)
keys = {
    "same": pk(x, y) == pk(torch.empty(4, 64), torch.zeros(4, 64)),  # values do not matter
    "distinct": len({pk(x, y), pk(x, torch.randn(4, 65)), pk(x, torch.randn(64, 4)), pk(x, y.half()),
                     pk(x, y.view(4, 1, 64)), pk(y.t(), x), pk(x, torch.empty(4, 64, device="meta")),
                     pk(torch.randn(256), y)}),
    "order": pk(x, torch.randn(2)) != pk(torch.randn(2), x),
    "unread": [pk(torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), x), pk(x, 3), pk(x)],
}
report["pair_key"] = keys

# call_key: the layout of a call of tensors and plain values, or -1 where Python decides.
ck = native.call_key()


class Ctx:  # a batch context type (as SGLang's ForwardBatch is registered)
    pass


ctx_types = {Ctx}
ctx = Ctx()
calls = {
    "plain_args": ck((x, 3, None, "s", 1.5, True), {}, y, ctx_types),
    "plain_args_again": ck((torch.zeros(4, 64), 4, None, "t", 2.5, False), {}, torch.ones(4, 64), ctx_types),
    "context": ck((x, ctx), {}, y, ctx_types),
    "kw": ck((x,), {"residual": y}, (x, y), ctx_types),
    "kw_other_name": ck((x,), {"other": y}, (x, y), ctx_types),
    "tuple_bias": ck((x,), {}, (y, None), ctx_types),
    "list_out": ck((x,), {}, [y, None], ctx_types),
    "no_result": ck((x,), {}, None, ctx_types),
    "unread": [ck((x, object()), {}, y, ctx_types), ck((x,), {"a": [y]}, y, ctx_types),
               ck((x,), {}, {"a": y}, ctx_types), ck((x,), {}, (y, object()), ctx_types),
               ck((torch.nn.Parameter(x).as_subclass(type("Sub", (torch.Tensor,), {})),), {}, y, ctx_types)],
}
report["call_key"] = {
    "same": calls["plain_args"] == calls["plain_args_again"] >= 0,
    "distinct": len({calls[k] for k in ("plain_args", "context", "kw", "kw_other_name", "tuple_bias",
                                        "list_out", "no_result")}),
    "tuple_is_list": calls["tuple_bias"] == calls["list_out"],  # as spans' Python key has it
    "unread": calls["unread"],
}

# The tracer with the native keys writes the same spans as with the Python ones: one tensor in
# and out (pair_key), and SGLang's call shapes (call_key): (output, bias), (x, residual) with a
# keyword, plain values and a batch context among the arguments.
import tempfile

from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files
from tensor_trace.tracer import spans, tensor_slots

tensor_slots.add_context_type(Ctx)


class Lin(torch.nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.inner = torch.nn.Linear(i, o)

    def forward(self, x):
        return self.inner(x), None


class Norm(torch.nn.Module):
    def forward(self, x, residual=None):
        return (x * 2, x + residual) if residual is not None else x * 2


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.norm = Lin(8, 16), Lin(16, 8), Norm()

    def forward(self, positions, h, batch, residual):
        h, residual = self.norm(h, residual=residual)
        out, _ = self.up(h)
        out, _ = self.down(torch.relu(out))
        return out * positions.float().mean(), residual


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        h = self.embed(x)
        residual = torch.zeros_like(h)
        for b in self.blocks:
            h, residual = b(torch.arange(x.shape[0]), h, ctx, residual)
        return h


model = Model()
layouts = {}
for use in (True, False):
    out = tempfile.mkdtemp()
    tr = tracer.start(out_dir=out, fingerprint=True, lineage=False)
    if not use:  # the Python keys throughout
        tr.native_pending = False
        spans.use_native_keys(None)
    torch.manual_seed(1)
    for batch in (2, 3, 2):
        model(torch.randn(batch, 8))
    if use:  # taken at the first step, as TENSOR_TRACE_NATIVE=1 asks
        report["native_key_taken"] = spans.pair_key is pk and spans.call_key is ck
        report["call_layouts"] = len(tr.layouts.by_call_key)
    tracer.stop()
    trace = load_rank_file(rank_files(out)[0])
    layouts[use] = [(s.step, s.path, s.call, [(t.slot, t.shape, t.dtype, t.fp) for t in s.tensors])
                    for st in trace.steps.values() for s in st.spans]
report["spans"] = len(layouts[True])
report["tracer_layouts_equal"] = layouts[True] == layouts[False]
print(json.dumps(report))
