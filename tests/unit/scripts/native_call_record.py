"""Record one program into OUT (``python native_call_record.py OUT``), under the
TENSOR_TRACE_NATIVE the caller sets: tests/unit/test_native_call.py runs it with the C call
wrapper (tracer/native_call.py) and without, and compares the two traces. Prints one JSON line:
each session's tracer stats and errors, and how many spans the C wrapper recorded.

The program: bench/call_patterns.py's two decode-step models (nn.Linear-style calls; SGLang's
signatures, with its ForwardBatch registered as a batch context and not), and a model of the
unusual calls (a call that raises, a module held under two paths, an excluded module, a
Parameter, None and a dict returned, no argument, keywords only, a tensor subclass, the span
limit changed inside a step), in four
sessions: no fingerprints; fingerprints; fingerprints and lineage; a span limit per step."""
import json
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench"))
import call_patterns  # noqa: E402

from tensor_trace import tracer  # noqa: E402
from tensor_trace.tracer import native, tensor_slots  # noqa: E402

class Boom(nn.Module):
    def forward(self, x):
        raise ValueError("boom")


class Returns(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, *args, **kwargs):
        return self.value


class Sub(torch.Tensor):
    pass


class Bound(nn.Module):
    """Sets the tracer's span limit from inside the step (``None``: back to the config's): the
    C wrapper must see an attribute changed between two of its calls."""

    def __init__(self, room):
        super().__init__()
        self.room = room

    def forward(self, x):
        t = tracer.current()
        t.max_spans = t.config.max_spans_per_step if self.room is None else t.span_count + self.room
        return x


class Edge(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.boom = Boom()
        self.shared = nn.ReLU()
        self.a, self.b = nn.Sequential(self.shared), nn.Sequential(self.shared)
        self.skip = nn.Identity()
        self.param = Returns(nn.Parameter(torch.ones(4)))
        self.none = Returns(None)
        self.dict = Returns({"y": torch.ones(2)})
        self.pair = Returns((torch.ones(2, 4), None))
        self.sub = Returns(torch.ones(3).as_subclass(Sub))
        self.tight, self.loose = Bound(2), Bound(None)

    def forward(self, x):
        x = self.lin(x)
        try:
            self.boom(x)
        except ValueError:
            pass
        x = self.b(self.a(x))
        x = self.skip(x)
        self.param(x)
        self.none(x)
        self.dict(x, 3)
        self.none()
        self.pair(x=x)
        self.pair(x, 2.0, None, "s")
        self.sub(x)
        self.lin(x.as_subclass(Sub))
        self.tight(x)  # two more spans in this step, then none until loose
        for _ in range(4):
            x = self.lin(x)
        self.loose(x)
        return self.lin(x)


def main():
    out = sys.argv[1]
    if native.enabled():
        native.ensure(block=True)
        assert native.traced_call() is not None, native.error()
    torch.manual_seed(0)
    llama, sgl, edge = call_patterns.LlamaCalls().eval(), call_patterns.SGLangCalls().eval(), Edge()
    B = call_patterns.B
    ids, pos, fb = torch.randint(0, 100, (B,)), torch.arange(B), call_patterns.forward_batch()
    x = torch.randn(2, 4)

    def sglang(registered):
        if registered:
            tensor_slots.CONTEXT_TYPES.add(call_patterns.ForwardBatch)
        else:
            tensor_slots.CONTEXT_TYPES.discard(call_patterns.ForwardBatch)
        sgl(ids, pos, fb)

    sessions = {
        "nofp": (dict(fingerprint=False, lineage=False, exclude=["skip"]),
                 [lambda: llama(ids.view(B, 1))] * 3 + [lambda: sglang(True)] * 3
                 + [lambda: sglang(False)] * 2 + [lambda: edge(x)] * 3),
        "fp": (dict(fingerprint=True, fingerprint_mode="immediate", lineage=False),
               [lambda: edge(x)] * 3 + [lambda: llama(ids.view(B, 1))] * 2 + [lambda: sglang(True)] * 2),
        "fp-lineage": (dict(fingerprint=True, fingerprint_mode="immediate"),
                       [lambda: edge(x)] * 3 + [lambda: llama(ids.view(B, 1))]),
        "limit": (dict(fingerprint=False, lineage=False, max_spans_per_step=50), [lambda: llama(ids.view(B, 1))] * 2),
    }
    report = {}
    with torch.inference_mode():
        for name, (opts, steps) in sessions.items():
            tr = tracer.start(out_dir=os.path.join(out, name), **opts)
            try:
                for step in steps:
                    step()
                (wrapper,) = tr.global_handles
                in_c = wrapper.native_call.recorded if wrapper.native_call is not None else 0
            finally:
                tracer.stop()
            report[name] = dict(stats=tr.stats, errors=tr.errors, in_c=in_c)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
