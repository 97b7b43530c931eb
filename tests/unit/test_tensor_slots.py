"""Finding the tensors in a module's arguments and results (tracer/tensor_slots.py)."""

import dataclasses

import torch

from tensor_trace.tracer import tensor_slots


@dataclasses.dataclass
class Inner:
    weight: torch.Tensor
    note: str = "x"


@dataclasses.dataclass
class Outer:
    a: torch.Tensor
    skip: object = None
    n: int = 3
    inner: Inner = None
    items: list = dataclasses.field(default_factory=list)


class Owed:  # shaped like a msgspec.Struct: fields named by __struct_fields__
    __struct_fields__ = ("partial", "done")

    def __init__(self, partial, done):
        self.partial, self.done = partial, done


def _slots(obj, context=False):
    out = []
    tensor_slots.flatten_args((obj,), out, context)
    return [s for s, _ in out]


def test_dataclasses_structs_and_containers_are_walked_by_field_name():
    t = torch.zeros(2)
    obj = Outer(t, inner=Inner(t), items=[t, None, {"k": t}])
    assert _slots(obj) == ["input.0.a", "input.0.inner.weight", "input.0.items.0", "input.0.items.2.k"]
    assert Outer in tensor_slots._FIELDS and tensor_slots._FIELDS[Outer][0] == "a"  # looked up once per type
    assert _slots(Owed(t, True)) == ["input.0.partial"]
    assert _slots(Outer) == []  # a class, not an instance


def test_walking_is_bounded_in_depth_and_count():
    t = torch.zeros(1)
    deep = [[[[[[t]]]]]]
    assert _slots(deep) == []  # past MAX_DEPTH: cut, not an error
    out = []
    tensor_slots.flatten_args(tuple([t] * (tensor_slots.MAX_TENSORS + 5)), out)
    assert len(out) == tensor_slots.MAX_TENSORS


def test_a_batch_context_is_walked_only_where_asked(monkeypatch):
    monkeypatch.setattr(tensor_slots, "CONTEXT_TYPES", set())
    t = torch.zeros(2)
    obj = Outer(t)
    assert _slots(obj) == ["input.0.a"]
    tensor_slots.add_context_type(Outer)
    assert _slots(obj) == [] and _slots([obj]) == []  # not inside containers either
    assert _slots(obj, context=True) == ["input.0.a"]  # the step root's inputs
    out = []
    tensor_slots.flatten_kwargs({"forward_batch": obj, "x": t}, out)
    assert [s for s, _ in out] == ["input.x"]
