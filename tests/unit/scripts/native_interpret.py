"""Run with TENSOR_TRACE_NATIVE=1 TRITON_INTERPRET=1 TENSOR_TRACE_MULTI_TENSOR=interpret: the C++
fingerprint table (tracer/native.py) against the Python path, on CPU tensors through Triton's
interpreter. Prints one JSON line."""
import json
import math

import torch

from tensor_trace import schema
from tensor_trace.tracer import native
from tensor_trace.tracer.fingerprint import StepFingerprints

native.ensure(block=True)
assert native.table_class() is not None, native.error()
report = {}


def values(records):
    out = {}
    for _, step, first, data, indices in records:
        out.update({(step, i): (s, q) for i, s, q in schema.fingerprint_pairs(first, data, indices)})
    return out


torch.manual_seed(0)
qkv = torch.randn(4, 1, 96)
q, k, v = qkv.split([64, 16, 16], -1)
fixed = [torch.randn(4, 64), qkv, torch.randn(5, 7).half(), torch.randn(16, 3).t(), torch.arange(6)]
A, B, C = torch.randn(6), torch.randn(6), torch.randn(8, 8)
got, held = {}, {}
for use_native in (False, True):
    fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
    if not use_native:
        fps._native_wanted = False
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
        held[(use_native, step)] = 0 if fps._nt is None else fps._nt.size()
        fps.finish_step(step)
    got[use_native] = values(fps.collect(wait=True))
    report[f"stale_{use_native}"] = fps.stale
    report[f"table_{use_native}"] = fps._nt is not None
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
sizes_after = fps._nt.size()
fps.finish_step(7)
vals = values(fps.collect(wait=True))
assert sorted(vals) == [(7, i) for i in range(6)]
for i, x in enumerate(xs):
    assert math.isclose(vals[(7, i)][0], x.double().sum().item(), rel_tol=1e-4, abs_tol=1e-4)
report["mid_step_left"] = sizes_after

# What the table does not take goes back to the Python path: a sparse tensor, a meta tensor.
nt = native.table_class()(1 << 24, torch.device("cpu"))
report["not_taken"] = [nt.hold(torch.randn(4, 4).to_sparse(), 0), nt.hold(torch.empty(4, device="meta"), 1),
                       nt.hold(torch.arange(4), 2), nt.size()]
print(json.dumps(report))
