"""A module held under several paths is named by its call site, per call (design.md: MODULE_PATH
is the ``named_modules()`` path; a shared module has several, and the one through the module
that is calling it names the call)."""

import pytest
import torch
import torch.nn as nn

from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files


class Attn(nn.Module):
    def __init__(self, rotary):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.rotary_emb = rotary  # one module for every layer, as SGLang's get_rope caches it

    def forward(self, x):
        return self.rotary_emb(self.proj(x)) + self.rotary_emb(x)  # twice: call 0 and call 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        rotary = nn.Linear(4, 4)
        self.layers = nn.ModuleList([Attn(rotary), Attn(rotary)])
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        x = self.layers[1].rotary_emb(x)  # called by the root: no holder of it is running
        return self.norm(x)


def _trace(tmp_path, net, steps=2, **opts):
    torch.manual_seed(0)
    xs = [torch.randn(2, 4) for _ in range(steps)]
    plain = [net(x) for x in xs]
    tr = tracer.start(out_dir=str(tmp_path), lineage=False, **opts)
    traced = [net(x) for x in xs]
    tracer.stop()
    assert tr.hook_count() == 0
    assert all(torch.equal(a, b) for a, b in zip(plain, traced))
    (f,) = rank_files(str(tmp_path))
    return load_rank_file(f)


@pytest.mark.parametrize("intercept", ["call", "hooks"])
def test_a_shared_module_is_named_by_its_call_site(tmp_path, intercept):
    rt = _trace(tmp_path, Net(), intercept=intercept)
    for step in rt.steps.values():
        by = {(s.path, s.call): s for s in step.spans}
        rotary = sorted(k for k in by if "rotary" in k[0])
        # Each layer's calls under its own path, the repeat within one site as #K; the call from
        # the root (which holds it through no attribute of its own) under its first path.
        assert rotary == [("layers.0.rotary_emb", 0), ("layers.0.rotary_emb", 1), ("layers.0.rotary_emb", 2),
                          ("layers.1.rotary_emb", 0), ("layers.1.rotary_emb", 1)]
        for layer in (0, 1):
            for call in (0, 1):
                span = by[(f"layers.{layer}.rotary_emb", call)]
                assert span.parent == by[(f"layers.{layer}", 0)].index and span.cls == "Linear"
        assert by[("layers.0.rotary_emb", 2)].parent == by[("", 0)].index
    # Its weights are recorded under each of its paths (a rule reading a module's weights finds
    # them whichever site the call was named by), with the same fingerprints.
    p0, p1 = rt.params["layers.0.rotary_emb"], rt.params["layers.1.rotary_emb"]
    assert [(t.slot, t.shape) for t in p0] == [(t.slot, t.shape) for t in p1] == [("weight", [4, 4]), ("bias", [4])]
    assert [t.fp for t in p0] == [t.fp for t in p1] and p0[0].fp is not None


def test_the_selection_follows_the_call_site(tmp_path):
    rt = _trace(tmp_path, Net(), modules=["layers.1*"])
    paths = {(s.path, s.call) for s in rt.steps[0].spans}
    assert ("layers.1.rotary_emb", 0) in paths and ("layers.1.rotary_emb", 1) in paths
    assert not any(p.startswith("layers.0") for p, _ in paths)


class Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class Outer(nn.Module):
    """A shared block (with children of its own) held by two wrappers: its children's call site
    is their holder's path in that call."""

    def __init__(self):
        super().__init__()
        block = Attn(nn.Tanh())
        self.wraps = nn.ModuleList([Wrap(block), Wrap(block)])
        self.same = nn.Tanh()
        self.alias = self.same  # one holder, two attributes: which one was used is not visible

    def forward(self, x):
        return self.alias(self.same(self.wraps[1](self.wraps[0](x))))


def test_a_shared_holder_names_its_children_by_its_own_call_site(tmp_path):
    rt = _trace(tmp_path, Outer(), steps=1)
    got = sorted((s.path, s.call) for s in rt.steps[0].spans)
    block = [f"wraps.{i}{sub}" for i in (0, 1) for sub in ("", ".inner", ".inner.proj")]
    rotary = [(f"wraps.{i}.inner.rotary_emb", k) for i in (0, 1) for k in (0, 1)]
    # The alias: the first path, and the second call as #1, as for any repeat from one site.
    assert got == sorted([("", 0), ("same", 0), ("same", 1)] + [(p, 0) for p in block] + rotary)


def test_only_shared_modules_are_named_per_call(tmp_path, monkeypatch):
    # The hot path looks a module's entry up by id; only a shared module's entry never matches,
    # so only its calls take the slow path that finds the call site.
    from tensor_trace.tracer import intercept, naming

    slow = []
    real = naming.entry_slow
    monkeypatch.setattr(intercept.naming, "entry_slow", lambda t, m: slow.append(m) or real(t, m))
    net = Net()
    _trace(tmp_path, net, steps=3)
    rotary = net.layers[0].rotary_emb
    assert sum(m is rotary for m in slow) == 3 * 5  # every call, every step
    others = [m for m in slow if m is not rotary]
    assert len(others) == len({id(m) for m in others}) == 5  # once each: layers, projs, norm
