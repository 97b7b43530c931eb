"""Tensor lineage: which recorded tensors a tensor was built from, and by which ops.

During a traced step a ``TorchFunctionMode`` watches a small set of ops that build tensors out of
others (``_TRACKED``: cat, stack, clone, view/reshape and friends, split/chunk, a tensor times or
over a number, add in and out of
place). Each call becomes a *node*: its op, arguments that matter (``dim``, the new shape), and
a reference to where each input came from:

- ``[0, step, span, slot]``: the tensor *is* that module call's recorded tensor (identity: the
  same tensor object, kept by a weak reference, so a freed tensor whose id is reused is not
  mistaken for it);
- ``[1, step, node]``: the result of an earlier node;
- ``[2, fingerprint index, shape]``: an input of a concatenation the tracer had not seen (a copy
  made by an op it does not watch, e.g. ``x * 1``, ``empty().copy_(x)``) next to inputs it had:
  its fingerprint, so that the merge can find where the values came from;
- ``[3, shape]``: unknown (fingerprints off);
- ``[4, module path, parameter name]``: a module's parameter (string ids as written).

Writes into a tensor (``copy_``, ``__setitem__``, ``index_copy_``; ``slice_scatter``,
``select_scatter``, ``index_copy`` out of place) are how packers lay captures side by side in a
preallocated buffer (``buf[:, 0:h].copy_(a)``). Each becomes a node ``[src]`` or ``[src, prev]``
(``prev``: what the tensor held before) whose attrs give the written tensor's shape (``into``)
and, where the region is a box of it, its start and extent per dim (``at``, ``len``): the reader
orders the pieces by place, not time. The region is read off storage offsets and strides (no
values; an index is read only when it is a short CPU tensor).

A module input (or output) that is a node's result gets a ``SLOT_SRC`` record linking the span's
slot to the node; so does one that is, as is, a module output that a cat, stack or write laid
out (its identity, which values cannot tell from an equal copy). Inputs that are plainly another
module's output need no record: the merge links those by identity of values (fingerprints). An
op none of whose inputs was recorded (rotary tables, norms' intermediates) is not recorded
either, but parameters count as recorded (``lineage_params``; the ops that follow them, from
indexing to grouped_mm: ``lineage_attrs``). Every other torch call goes straight through (one
dictionary lookup), and the tracer's own hooks run with the mode off, as do leaf modules'
bodies. Nothing is recorded outside traced steps, and the tracer's own fingerprint ops never are
(``tracer.busy``).
"""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode

from tensor_trace import schema
from tensor_trace.format.lineage_refs import REF_PARAM
from tensor_trace.tracer import lineage_attrs as _attrs
from tensor_trace.tracer import lineage_params as _params
from tensor_trace.tracer.regions import PLAIN as _PLAIN
from tensor_trace.tracer.regions import box as _box
from tensor_trace.tracer.regions import disjoint as _disjoint
from tensor_trace.tracer.regions import scatter_region as _scatter_region
from tensor_trace.tracer.regions import written as _written

MAX_PRODUCERS = 1 << 16  # tensors remembered per process (cleared, not grown, past this)
MAX_WRITES = 256  # writes kept per storage and step (each view of it read later carries them)

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
    (torch.unflatten, "unflatten", "one"), (T.unflatten, "unflatten", "one"),
    (T.view_as, "view", "one"), (T.reshape_as, "reshape", "one"),
    (torch.split, "split", "split"), (T.split, "split", "split"),
    (torch.chunk, "chunk", "split"), (T.chunk, "chunk", "split"),
    (torch.tensor_split, "split", "split"), (T.tensor_split, "split", "split"),
    (torch.unbind, "unbind", "split"), (T.unbind, "unbind", "split"),
    (torch.add, "add", "binary"), (T.add, "add", "binary"), (T.__add__, "add", "binary"),
    (T.__radd__, "add", "binary"),
    (T.add_, "add_", "inplace"), (T.__iadd__, "add_", "inplace"),
    # other in-place arithmetic: no lineage node, but what it updates is fingerprinted first
    (T.mul_, "mul_", "mutate"), (T.__imul__, "mul_", "mutate"), (T.sub_, "sub_", "mutate"),
    (T.__isub__, "sub_", "mutate"), (T.div_, "div_", "mutate"), (T.__itruediv__, "div_", "mutate"),
    # a tensor times or over a Python number (a residual multiplier, a logit scale): "scale"
    # nodes with the factor, a common scale that keeps what the values are (a reduction's output
    # scaled is still post-reduction); a product of two tensors is not one
    (T.mul, "mul", "scale"), (T.__mul__, "mul", "scale"), (T.__rmul__, "mul", "scale"), (torch.mul, "mul", "scale"),
    (T.div, "div", "scale"), (T.__truediv__, "div", "scale"), (torch.div, "div", "scale"),
    # copies that keep the values (a dtype or layout change): followed, not matched by values
    (T.to, "to", "one"), (T.float, "to", "one"), (T.half, "to", "one"), (T.bfloat16, "to", "one"),
    (T.contiguous, "contiguous", "one"), (T.detach, "detach", "one"),
    # writes into (a region of) a buffer: how packers lay captures side by side in a preallocated
    # tensor; "write" updates its first argument in place, "scatter" returns an updated copy
    (T.copy_, "copy_", "write"), (T.__setitem__, "setitem", "write"), (T.index_copy_, "index_copy_", "write"),
    (torch.index_copy, "index_copy", "scatter"), (T.index_copy, "index_copy", "scatter"),
    (torch.slice_scatter, "slice_scatter", "scatter"), (T.slice_scatter, "slice_scatter", "scatter"),
    (torch.select_scatter, "select_scatter", "scatter"), (T.select_scatter, "select_scatter", "scatter"),
]:
    _TRACKED[_f] = (_name, _kind)
# from a module's parameters to what a module receives: indexing, dimension moves, products
_TRACKED.update(_attrs.tracked())
_get_ident = __import__("threading").get_ident
_UPDATES_FIRST_ARG = frozenset(("inplace", "write", "mutate"))
_ONE_IN = frozenset(("one", "index", "split", "scale"))
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
        rec = self.recorder
        if hit[1] in _ONE_IN and args and not rec.writes and id(args[0]) not in rec.producers:
            # one tensor in, made by nothing recorded (most views and slices): node() would stop
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        tracer = rec.tracer
        if hit[1] in _UPDATES_FIRST_ARG and args and isinstance(args[0], T):
            # A recorded output updated in place later in the step (a shared expert's output
            # that the routed experts' output is added into) is fingerprinted as it was.
            rec.before_update(args[0])
            if hit[1] == "mutate":
                return func(*args, **kwargs) if kwargs else func(*args)
        out = func(*args, **kwargs)
        if tracer.tracing_step and not tracer.busy and _get_ident() == tracer.step_thread:
            tracer.busy = True
            try:
                rec.node(hit[0], hit[1], args, kwargs, out)
                if "out" in kwargs and isinstance(out, T) and out is kwargs["out"]:
                    # A result written into a given tensor (``torch.bmm(a, b, out=buf.view(...))``,
                    # DeepSeek's absorbed MLA): a write into that buffer, as copy_ is.
                    rec.write("copy_", "write", (out, out), {}, out)
            except Exception as exc:
                tracer.on_error("lineage", exc)
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
        self.writes: dict = {}  # storage -> [weak handle, writes into it]: this step's, not yet on a tensor
        self.write_seen: dict = {}  # id(tensor) -> (weak reference, writes of its storage it carries)
        self.laid_out: set = set()  # (step, span, slot) of module outputs laid out by cat/stack/writes
        self.params: dict = {}  # id(parameter) -> (weak reference, ref): seeds producers (lineage_params)
        self.mode = None

    # ------------------------------------------------------------------ step
    def begin_step(self) -> None:
        self.nodes = 0
        self.pending = []  # this step's nodes, written at its end if a module boundary uses them
        self.used = []  # node refs that SLOT_SRC records point at
        self._drop_writes()
        if len(self.producers) > MAX_PRODUCERS + len(self.params):
            self.producers = dict(self.params)
            self.laid_out = set()
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
        self._drop_writes()
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
                hit = producers.get(out_id)
                if hit is not None and hit[1] == [1, step, node]:
                    del producers[out_id]  # a later step must not point at a node never written
                continue
            for i, t in unknown:
                # Concatenations are where captures get combined: an input made by an op not
                # watched here (a copy) is matched back by its values (deferred: no launch).
                refs[i] = [2, tracer.fps.add([t], store=False), list(t.shape)] if tracer.fp_now else [3, list(t.shape)]
            if any(r[0] == REF_PARAM for r in refs):
                refs = [_params.encode(writer, r) for r in refs]
            if type(attrs) is _attrs.LazyDims:
                attrs = attrs.resolve()
            writer.add((schema.LINEAGE, step, node, writer.string(name), attrs, refs, shape))

    def add_params(self, root) -> None:
        """Ops on ``root``'s modules' parameters are recorded from now on (lineage_params)."""
        _params.add_params(self.tracer, root, self.params, self.producers)

    def before_update(self, t) -> None:
        """``t`` is about to be updated in place: a deferred fingerprint it holds is taken now,
        and a cached immediate one is not reused for its next sighting (a tensor made under
        ``inference_mode`` has no version counter that would tell)."""
        tracer = self.tracer
        if not tracer.tracing_step or tracer.busy or not tracer.fp_now or _get_ident() != tracer.step_thread:
            return
        tracer.busy = True
        try:
            tracer.fps.materialize((t,))
            tracer.fps.forget((t,))
        except Exception as exc:
            tracer.on_error("lineage: before an in-place update", exc)
        finally:
            tracer.busy = False

    # ------------------------------------------------------------------ producers
    def note(self, t, ref) -> None:
        try:
            self.producers[id(t)] = (weakref.ref(t), ref)
        except TypeError:
            pass

    def link_span(self, step, span, slots) -> None:
        """A module call's slots ([(name, tensor)], inputs then outputs): an input or output that
        is a node's result links its slot to the node; outputs, and inputs not seen before,
        become that span's tensors."""
        producers = self.producers
        writer = None
        writes = self.writes
        for i, (name, t) in enumerate(slots):
            if writes:
                self._sight(t)
            hit = producers.get(id(t))
            if hit is not None and hit[0]() is t:
                ref = hit[1]
                if ref[0] == 1:
                    writer = writer or self.tracer.writer
                    writer.add((schema.SLOT_SRC, step, span, i, ref))
                    self.used.append(ref)
                    if name[0] == "o" and self._laid_out(ref):
                        self.laid_out.add((step, span, i))
                elif ref[0] == 0 and self.laid_out and (ref[1], ref[2], ref[3]) in self.laid_out:
                    # Passed on as is (the draft receiving the target's packed captures): its
                    # identity is written, since values alone cannot tell it from an equal copy.
                    writer = writer or self.tracer.writer
                    writer.add((schema.SLOT_SRC, step, span, i, ref))
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

    def link_capture(self, step, span, t) -> None:
        """A named capture point (``capture:NAME``) of tensor ``t``: the capture names the
        tensor from now on (what is later built from it, e.g. a concatenation of EAGLE-3 aux
        hidden states, points at the capture), and a SLOT_SRC record keeps what it captured
        (a module's output, or an op's result), so that both can be told."""
        if self.writes:
            self._sight(t)
        hit = self.producers.get(id(t))
        if hit is not None and hit[0]() is t:
            ref = hit[1]
            self.tracer.writer.add((schema.SLOT_SRC, step, span, 0, _params.encode(self.tracer.writer, ref)))
            if ref[0] == 1:
                self.used.append(ref)
        self.note(t, [0, step, span, 0])

    def _laid_out(self, ref) -> bool:
        """Whether a node of this step laid tensors side by side (cat, stack, writes into a
        buffer), possibly behind single-input ops (a dtype change, a view)."""
        step = self.tracer.step
        pending = self.pending
        for _ in range(8):
            if ref[0] == 0:
                return (ref[1], ref[2], ref[3]) in self.laid_out
            if ref[0] != 1 or ref[1] != step or ref[2] >= len(pending):
                return False
            name, attrs, _shape, refs, _unknown, _out = pending[ref[2]]
            if name == "cat" or name == "stack" or (attrs is not None and "into" in attrs):
                return True
            if len(refs) != 1:
                return False
            ref = refs[0]
        return False

    # ------------------------------------------------------------------ nodes
    def node(self, name, kind, args, kwargs, out) -> None:
        # Hot: runs for every watched op of a traced step. Decide from the inputs' producers
        # first (a dictionary lookup each); most calls stop there.
        Tensor = torch.Tensor
        if kind == "many":
            seq = args[0] if args else kwargs.get("tensors")
            ins = [t for t in seq if isinstance(t, Tensor)]
        elif kind == "one" or kind == "split" or kind == "index":
            a0 = args[0] if args else None
            if not isinstance(a0, Tensor) or (kind != "split" and out is a0):
                return  # .to() / .contiguous() that returned its input: the identity holds
            ins = [a0]
        elif kind == "mm":
            ins = [t for t in _attrs.mm_inputs(name, args, kwargs) if isinstance(t, Tensor)]
        elif kind == "scale":
            a0 = args[0] if args else None
            by = args[1] if len(args) > 1 else kwargs.get("other")
            if (not isinstance(a0, Tensor) or type(by) not in (int, float) or out is a0 or not by
                    or kwargs.get("rounding_mode") is not None):
                return  # a product of tensors, an integer division: no common scale
            ins = [a0]
        elif kind == "write" or kind == "scatter":
            return self.write(name, kind, args, kwargs, out)
        else:  # binary / inplace: a scalar operand combines nothing
            ins = [a for a in args[:2] if isinstance(a, Tensor)]
            if len(ins) < 2:
                if kind == "inplace" and ins:
                    self.producers.pop(id(ins[0]), None)  # its old identity no longer holds
                return
        producers = self.producers
        if self.writes:
            for t in ins:
                self._sight(t)
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
        attrs = None
        if kind == "many":
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            attrs = {"dim": int(dim)}
        elif name in _attrs.RESHAPES and isinstance(out, Tensor):
            attrs = {"shape": list(out.shape)}
            asked = _attrs.asked_shape(name, args, kwargs)
            if asked is not None:
                attrs["asked"] = asked  # (where the -1 was: the dim a shard's rank lands in)
        elif kind == "split":  # split(x, size, dim), chunk(x, n, dim), unbind(x, dim)
            at = 1 if name == "unbind" else 2
            dim = kwargs.get("dim", args[at] if len(args) > at else 0)
            dim = int(dim) if isinstance(dim, int) else 0
            attrs = {"dim": dim + args[0].dim() if name == "unbind" and dim < 0 else dim}  # (unbind's: dataflow)
        elif name == "to" and isinstance(out, Tensor):
            attrs = {"dtype": str(out.dtype).replace("torch.", "")}
        elif name in _attrs.DIMS_OPS and isinstance(out, Tensor):
            attrs = _attrs.LazyDims(name, args[1:], kwargs, ins[0].shape, out.dim())
        elif kind == "mm":
            attrs = {"ndims": [t.dim() for t in ins]}
        elif kind == "scale":
            by = float(args[1] if len(args) > 1 else kwargs.get("other"))
            attrs = {"factor": by if name == "mul" else 1.0 / by}
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

    # ------------------------------------------------------------------ writes
    # A write into a view changes the tensor the view was taken from, which a consumer uses
    # later; under inference_mode a view does not know that tensor (``_base`` is None). So a
    # write is kept by storage, with where it landed (storage offset, sizes, strides), and
    # turned into nodes on the first tensor of that storage seen afterwards (``_sight``), its
    # region then computed in that tensor's dims.
    def write(self, name, kind, args, kwargs, out) -> None:
        """A write of one tensor into (a region of) another, as nodes ``[src]`` or ``[src,
        prev]`` (what the tensor held before) with ``into`` (the written tensor's shape) and,
        where the region is a plain box of it, ``at`` and ``len`` per dim, so that the reader
        orders the pieces by place."""
        Tensor = torch.Tensor
        a = args
        if name == "copy_":
            dst, src = a[0], a[1] if len(a) > 1 else kwargs.get("src")
        elif name == "setitem":
            dst, src = a[0], a[2] if len(a) > 2 else None
        elif name in ("slice_scatter", "select_scatter"):
            dst, src = a[0] if a else kwargs.get("input"), a[1] if len(a) > 1 else kwargs.get("src")
        else:  # index_copy(_)(input, dim, index, source)
            dst = a[0] if a else kwargs.get("input")
            src = a[3] if len(a) > 3 else kwargs.get("source")
        if not isinstance(src, Tensor) or not isinstance(dst, Tensor) or type(dst) not in _PLAIN:
            return  # a scalar fill combines nothing; subclasses (DTensor) keep their own storage
        if self.writes:
            self._sight(src)  # a source read from a buffer written earlier in the step
        producers = self.producers
        hit = producers.get(id(src))
        sref = hit[1] if hit is not None and hit[0]() is src else None
        if kind == "scatter":  # a new tensor: its nodes now, in the input's dims
            if not isinstance(out, Tensor):
                return
            hit = producers.get(id(dst))
            prev = hit[1] if hit is not None and hit[0]() is dst else None
            if sref is None and prev is None:
                return
            try:
                region = _scatter_region(name, dst, args, kwargs, src)
            except Exception:
                region = None
            self._write_node(name, out, region, sref, src, prev)
            return
        storage = dst.untyped_storage()
        key = storage._cdata
        entry = self.writes.get(key)
        if entry is None:
            hit = producers.get(id(dst))
            if sref is None and (hit is None or hit[0]() is not dst):
                return  # nothing recorded on either side (caches, scratch buffers)
            # The weak handle keeps the storage's address from being reused by another
            # storage while this step may still look it up.
            entry = self.writes[key] = [storage._weak_ref(), []]
        if len(entry[1]) >= MAX_WRITES:
            return
        try:
            geom = _written(name, dst, args, kwargs)
        except Exception:
            geom = None  # an unusual index: the reader falls back to time order
        entry[1].append((name, sref, src if sref is None else None, geom))

    def _sight(self, t) -> None:
        """``t`` is used: writes into its storage since it was last seen become its nodes."""
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return
        try:
            entry = self.writes.get(t.untyped_storage()._cdata)
        except Exception:
            return  # no storage (sparse, ...)
        if entry is None:
            return
        events = entry[1]
        seen = self.write_seen.get(id(t))
        done = seen[1] if seen is not None and seen[0]() is t else 0
        if done >= len(events):
            return
        self.write_seen[id(t)] = (weakref.ref(t), len(events))
        hit = self.producers.get(id(t))
        prev = hit[1] if hit is not None and hit[0]() is t else None
        mine = (t.storage_offset(), tuple(t.shape), t.stride())
        for name, sref, src, geom in events[done:]:
            region = None
            if geom is not None:
                if _disjoint(geom, mine):
                    continue  # another part of the storage (a neighbouring view)
                region = _box(geom, mine)
            prev = self._write_node(name, t, region, sref, src, prev,
                                    None if region is not None or geom is None else (geom, mine))

    def _write_node(self, name, result, region, sref, src, prev, geoms=None):
        attrs = {"into": list(result.shape)}
        if region is not None:
            attrs["at"], attrs["len"] = region
        elif geoms is not None:
            # no box of the result (a transposed view of it): the written view's offset, sizes
            # and strides and the result's strides, from which the placement walk maps a shard
            (voff, vshape, vstride), (boff, _bshape, bstride) = geoms
            attrs["view"] = [voff - boff, list(vshape), list(vstride)]
            attrs["strides"] = list(bstride)
        unknown = []
        if sref is None:
            sref = [3, list(src.shape)]
            unknown.append((0, src))  # matched by values at the step's end
        step = self.tracer.step
        node = self.nodes
        self.nodes = node + 1
        self.pending.append((name, attrs, list(result.shape), [sref] if prev is None else [sref, prev],
                             unknown, id(result)))
        ref = [1, step, node]
        self.note(result, ref)
        return ref

    def _drop_writes(self) -> None:
        for handle, _events in self.writes.values():
            try:
                torch.UntypedStorage._free_weak_ref(handle)
            except Exception:
                pass
        self.writes = {}
        self.write_seen = {}
