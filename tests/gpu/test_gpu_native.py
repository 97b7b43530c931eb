"""tracer/native.py's C++ fingerprint table on a real GPU (opt-in, TENSOR_TRACE_NATIVE=1): the
values of a step's deferred CUDA tensors equal those of the Python path and of torch, and the
memory it holds is not handed out again before the step's kernel has read it."""

import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU; tests/unit/test_native.py checks the "
                                       "table under Triton's interpreter on a CPU")


def _values(fps, step):
    from tensor_trace.format.fingerprints import fingerprint_pairs

    fps.finish_step(step)
    out = {}
    for _, _, first, data, indices in fps.collect(wait=True):
        out.update({i: (s, q) for i, s, q in fingerprint_pairs(first, data, indices)})
    return out


def test_native_table_equals_torch_and_the_python_path(monkeypatch):
    from tensor_trace.tracer import native
    from tensor_trace.tracer.fingerprint import StepFingerprints

    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "1")
    native.ensure(block=True)
    assert native.table_class() is not None, native.error()
    dev = torch.device("cuda")
    torch.manual_seed(2)
    qkv = torch.randn(64, 1, 6144, device=dev, dtype=torch.bfloat16)
    q, k, v = qkv.split([4096, 1024, 1024], dim=-1)
    got, expect = {}, {}
    for use_native in (False, True):
        fps = StepFingerprints(defer_cuda=True, native_mode=None if use_native else "0")
        fps.add_one(torch.randn(4, device=dev, dtype=torch.bfloat16))  # finds the table
        refs = []
        with torch.inference_mode():
            for step_tensors in range(3):
                # fresh outputs that die right after their "module", as in a step: the table
                # keeps their memory from being handed to the next ones before the flush
                t = torch.randn(64, 28672, device=dev, dtype=torch.bfloat16) * (step_tensors + 1)
                expect[(use_native, len(refs))] = (t.double().sum().item(), t.double().pow(2).sum().item())
                refs.append(fps.add_one(t))
                del t
                scratch = torch.empty(64 * 28672, device=dev, dtype=torch.bfloat16).fill_(7.0)
                del scratch
        for t in (q, k, v):
            expect[(use_native, len(refs))] = (t.double().sum().item(), t.double().pow(2).sum().item())
            refs.append(fps.add([t], store=False))
        if use_native:
            assert fps.native_held() == len(refs)
        vals = _values(fps, 0)
        got[use_native] = [vals[r] for r in refs]
    for j in range(len(got[True])):
        for use_native in (False, True):
            (s, sq), (es, eq) = got[use_native][j], expect[(use_native, j)]
            assert abs(s - es) <= 1e-3 * math.sqrt(eq) + 1e-3 and math.isclose(sq, eq, rel_tol=1e-3), \
                (use_native, j, s, es, sq, eq)
