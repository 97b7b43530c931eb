"""Tensor lineage: which recorded tensors a tensor was built from, and by which ops.

During a traced step a ``TorchFunctionMode`` watches a small set of ops that build tensors out of
others (``_TRACKED``: cat, stack, clone, view/reshape and friends, split/chunk, add in and out of
place). Each call becomes a *node*: its op, arguments that matter (``dim``, the new shape), and
a reference to where each input came from:

- ``[0, step, span, slot]``: the tensor *is* that module call's recorded tensor (identity: the
  same tensor object, kept by a weak reference, so a freed tensor whose id is reused is not
  mistaken for it);
- ``[1, step, node]``: the result of an earlier node;
- ``[2, fingerprint index, shape]``: an input of a concatenation the tracer had not seen (a copy
  made by an op it does not watch, e.g. ``x * 1``, ``empty().copy_(x)``) next to inputs it had:
  its fingerprint, so that the merge can find where the values came from;
- ``[3, shape]``: unknown (fingerprints off).

A module input (or output) that is a node's result gets a ``SLOT_SRC`` record linking the span's
slot to the node. Inputs that are plainly another module's output need no record: the merge
links those by identity of values (fingerprints). An op none of whose inputs was recorded
(rotary tables, norms' intermediates) is not recorded either. Every other torch call goes
straight through (one dictionary lookup), and the tracer's own hooks run with the mode off. Nothing is recorded outside traced steps, and the tracer's own
fingerprint ops never are (``tracer.busy``).
"""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode

from tensor_trace import schema

MAX_PRODUCERS = 1 << 16  # tensors remembered per process (cleared, not grown, past this)

T = torch.Tensor
# op -> (name, kind): kind "many" (first argument is a sequence of tensors), "one" (first
# argument is the tensor, one result), "split" (one tensor in, a tuple out), "binary" (add),
# "inplace" (add_: the first argument becomes the result).
_TRACKED = {}
for _f, _name, _kind in [
    (torch.cat, "cat", "many"), (torch.concat, "cat", "many"), (torch.concatenate, "cat", "many"),
    (torch.stack, "stack", "many"),
    (torch.clone, "clone", "one"), (T.clone, "clone", "one"),
    (T.view, "view", "one"), (torch.reshape, "reshape", "one"), (T.reshape, "reshape", "one"),
    (torch.flatten, "flatten", "one"), (T.flatten, "flatten", "one"),
    (T.view_as, "view", "one"), (T.reshape_as, "reshape", "one"),
    (torch.split, "split", "split"), (T.split, "split", "split"),
    (torch.chunk, "chunk", "split"), (T.chunk, "chunk", "split"),
    (torch.tensor_split, "split", "split"), (T.tensor_split, "split", "split"),
    (torch.unbind, "unbind", "split"), (T.unbind, "unbind", "split"),
    (torch.add, "add", "binary"), (T.add, "add", "binary"), (T.__add__, "add", "binary"),
    (T.__radd__, "add", "binary"),
    (T.add_, "add_", "inplace"), (T.__iadd__, "add_", "inplace"),
    # copies that keep the values (a dtype or layout change): followed, not matched by values
    (T.to, "to", "one"), (T.float, "to", "one"), (T.half, "to", "one"), (T.bfloat16, "to", "one"),
    (T.contiguous, "contiguous", "one"), (T.detach, "detach", "one"),
]:
    _TRACKED[_f] = (_name, _kind)
_get_ident = __import__("threading").get_ident
_tracked_get = _TRACKED.get
_is_compiling = torch.compiler.is_compiling


class LineageMode(TorchFunctionMode):
    """The step's op watcher; entered at a traced step's start, left at its end."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Runs for every torch call of a traced step: the common case is one lookup and the call.
        if _is_compiling():
            # torch.compile (SGLang compiles small helpers) traces modes into its graphs: inside
            # one this mode must be a plain pass-through, with no Python side effects to trace.
            return func(*args, **kwargs) if kwargs else func(*args)
        hit = _tracked_get(func)
        if hit is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rec = self.recorder
        tracer = rec.tracer
        if tracer.tracing_step and not tracer.busy and _get_ident() == tracer.step_thread:
            tracer.busy = True
            try:
                rec.node(hit[0], hit[1], args, kwargs, out)
            except Exception as exc:
                tracer._on_error("lineage", exc)
            finally:
                tracer.busy = False
        return out


class LineageRecorder:
    """Producers of the tensors seen in traced steps, and the LINEAGE / SLOT_SRC records."""

    def __init__(self, tracer):
        self.tracer = tracer
        self.producers: dict = {}  # id(tensor) -> (weak reference, ref list)
        self.nodes = 0  # node ids of the current step
        self.pending: list = []
        self.used: list = []
        self.mode = None

    # ------------------------------------------------------------------ step
    def begin_step(self) -> None:
        self.nodes = 0
        self.pending = []  # this step's nodes, written at its end if a module boundary uses them
        self.used = []  # node refs that SLOT_SRC records point at
        if len(self.producers) > MAX_PRODUCERS:
            self.producers = {}
        mode = LineageMode(self)
        mode.__enter__()
        self.mode = mode

    def end_step(self) -> None:
        """Leave the mode; write the nodes a module boundary depends on, and no others: most
        watched ops (rotary halves, views inside attention) lead nowhere recorded."""
        mode, self.mode = self.mode, None
        if mode is None:
            return
        quiet = self.tracer.leaf_quiet
        while quiet:  # leaf calls an exception left open
            try:
                quiet.pop()[1].__exit__(None, None, None)
            except Exception:
                pass
        try:
            mode.__exit__(None, None, None)
        except Exception:
            pass
        pending, self.pending = self.pending, []
        used, self.used = self.used, []
        if not pending:
            return
        step = self.tracer.step
        keep = set()
        todo = [r[2] for r in used if r[1] == step]
        while todo:
            n = todo.pop()
            if n in keep or n >= len(pending):
                continue
            keep.add(n)
            todo += [r[2] for r in pending[n][3] if r[0] == 1 and r[1] == step]
        tracer = self.tracer
        writer = tracer.writer
        producers = self.producers
        for node, (name, attrs, shape, refs, unknown, out_id) in enumerate(pending):
            if node not in keep:
                producers.pop(out_id, None)  # a later step must not point at a node never written
                continue
            for i, t in unknown:
                # Concatenations are where captures get combined: an input made by an op not
                # watched here (a copy) is matched back by its values (deferred: no launch).
                refs[i] = [2, tracer.fps.add([t], store=False), list(t.shape)] if tracer.fp_now else [3, list(t.shape)]
            writer.add((schema.LINEAGE, step, node, writer.string(name), attrs, refs, shape))

    # ------------------------------------------------------------------ producers
    def note(self, t, ref) -> None:
        try:
            self.producers[id(t)] = (weakref.ref(t), ref)
        except TypeError:
            pass

    def ref_of(self, t):
        hit = self.producers.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        return None

    def link_span(self, step, span, slots) -> None:
        """A module call's slots ([(name, tensor)], inputs then outputs): an input or output that
        is a node's result links its slot to the node; outputs, and inputs not seen before,
        become that span's tensors."""
        producers = self.producers
        writer = None
        for i, (name, t) in enumerate(slots):
            hit = producers.get(id(t))
            if hit is not None and hit[1][0] == 1 and hit[0]() is t:
                writer = writer or self.tracer.writer
                writer.add((schema.SLOT_SRC, step, span, i, hit[1]))
                self.used.append(hit[1])
            if name[0] == "o":  # "output..."
                # The innermost call that produced a tensor names it: an outer module that
                # passes it on (a model returning its layers' hidden states) does not.
                if hit is not None and hit[1][0] == 0 and hit[1][1] == step and hit[0]() is t:
                    continue
                self.note(t, [0, step, span, i])
            elif hit is None or hit[0]() is not t:
                # An input nobody recorded making (the step's input ids, a cache) is named by
                # the first call that receives it.
                self.note(t, [0, step, span, i])

    # ------------------------------------------------------------------ nodes
    def node(self, name, kind, args, kwargs, out) -> None:
        # Hot: runs for every watched op of a traced step. Decide from the inputs' producers
        # first (a dictionary lookup each); most calls stop there.
        Tensor = torch.Tensor
        if kind == "many":
            seq = args[0] if args else kwargs.get("tensors")
            ins = [t for t in seq if isinstance(t, Tensor)]
        elif kind == "one" or kind == "split":
            a0 = args[0] if args else None
            if not isinstance(a0, Tensor) or (kind == "one" and out is a0):
                return  # .to() / .contiguous() that returned its input: the identity holds
            ins = [a0]
        else:  # binary / inplace: a scalar operand combines nothing
            ins = [a for a in args[:2] if isinstance(a, Tensor)]
            if len(ins) < 2:
                if kind == "inplace" and ins:
                    self.producers.pop(id(ins[0]), None)  # its old identity no longer holds
                return
        producers = self.producers
        refs = []
        known = False
        for t in ins:
            hit = producers.get(id(t))
            if hit is not None and hit[0]() is t:
                refs.append(hit[1])
                known = True
            else:
                refs.append(None)
        if not known:
            return  # built from nothing recorded: not worth a record (rotary tables, norms...)
        tracer = self.tracer
        step = tracer.step
        writer = tracer.writer
        attrs = None
        if kind == "many":
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            attrs = {"dim": int(dim)}
        elif name in ("view", "reshape", "flatten") and isinstance(out, Tensor):
            attrs = {"shape": list(out.shape)}
        elif kind == "split":
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
            attrs = {"dim": int(dim) if isinstance(dim, int) else 0}
        elif name == "to" and isinstance(out, Tensor):
            attrs = {"dtype": str(out.dtype).replace("torch.", "")}
        unknown = []
        for i, r in enumerate(refs):
            if r is None:
                t = ins[i]
                refs[i] = [3, list(t.shape)]
                if kind == "many":
                    unknown.append((i, t))
        outs = list(out) if kind == "split" and isinstance(out, (tuple, list)) else [out]
        pending = self.pending
        for k, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                continue
            node = self.nodes
            self.nodes = node + 1
            a = attrs
            if kind == "split":
                a = dict(attrs or {}, index=k, of=len(outs))
            pending.append((name, a, list(o.shape), refs, unknown, id(o)))
            self.note(o, [1, step, node])
