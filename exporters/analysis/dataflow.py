"""Placement through the ops the tracer's lineage watcher records (tracer/lineage.py): one rule
per op family, mapping input placements to the output's, as DTensor's sharding propagation does.
They apply between module boundaries: a tensor that a module received was built by a split, a
view, an add or a cat of tensors judged earlier in the step, or from a module's parameters by
indexing, dimension moves and matrix products (dataflow_ops.py: an MoE's experts inside one call).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from tensor_trace.exporters.analysis import dataflow_ops
from tensor_trace.format.lineage_refs import REF_PARAM

# single-input ops that keep every value (a dtype, layout or memory change)
_KEEP = {"clone", "to", "contiguous", "detach"}
_SCALE = {"mul", "div"}  # by a number (tracer/lineage.py's "scale" nodes): a common scale
_RESHAPE = {"view", "reshape", "flatten", "unflatten"}
_PARTS = {"split", "chunk", "unbind"}
_WRITES = {"copy_", "setitem", "index_copy_"}
MAX_DEPTH = 32
# dimension moves (tracer/lineage_attrs.py), as the evidence names them
_DIMS = {"getitem": "[...]", "index_select": "index_select", "transpose": "transpose", "t": "t",
         "permute": "permute", "movedim": "movedim", "unsqueeze": "unsqueeze", "squeeze": "squeeze",
         "repeat_interleave": "repeat_interleave"}


def _shard_dim(p: str):
    return int(p[6:-1]) if p.startswith("shard(") else None


def reshape_shard(placement: str, old_shape, new_shape, block=None, asked=None):
    """(placement, block) after a view or reshape, from local shapes, or None.

    A shard is where the rank's position sits among the tensor's elements: above ``block``
    elements of its dim d (None: the whole local dim, the rank outermost in it, a contiguous
    slice), so at one flat stride of the local tensor. After the reshape it sits at the same
    stride: as the outermost part of the first new dim that ends there (heads split out of a
    shard of the hidden dim; a size-1 heads dim, GQA's KV heads at TP = their count, being the
    outermost), else inside the new dim that spans it: an interleaved slice of that dim, in
    runs of the new ``block`` (a dim split into heads, then merged with the tokens before it:
    ``view(-1, head_dim)`` of a column shard, as SGLang's per-head q/k norms take it). Size-1
    dims end at the same stride as the dim after them; the old shape's size-1 dims just before
    d (one token in a decode step) take the first of those, as DTensor's view rule pairs them.

    ``asked``: the sizes the op was given, where one is -1, the dim that grows with the ranks'
    parts when the others are fixed sizes. The rank is taken to be in it where the stride is its
    outer edge, and at its inner edge where the reshape leaves the local shape as it was (one KV
    head per rank, ``view(-1, head_dim)``: the heads merged into dim 0, which only the -1 says;
    where the local shape changes, an explicit size is as likely the local one, as in
    ``view(-1, x.shape[-1])``, and the stride decides)."""
    d = _shard_dim(placement)
    if d is None:
        return placement, None
    old, new = list(old_shape or ()), list(new_shape or ())
    if not old or not new or d >= len(old):
        return None
    if new.count(-1) == 1:  # view(-1, h): the inferred size
        rest = math.prod(n for n in new if n != -1)
        if rest <= 0:
            return None
        new[new.index(-1)] = math.prod(old) // rest
    if -1 in new or math.prod(new) != math.prod(old):
        return None
    inner = block if block else old[d]
    if inner <= 0 or old[d] % inner:
        return None
    stride = math.prod(old[d + 1:]) * inner
    below = [math.prod(new[i + 1:]) for i in range(len(new))]
    if asked is not None and len(asked) == len(new) and list(asked).count(-1) == 1:
        m = list(asked).index(-1)
        if below[m] * new[m] == stride and new[m] > 1:  # (a size-1 -1: one token, says nothing)
            return f"shard({m})", None
        if below[m] == stride and list(old) == new:  # (a local no-op: -1 is all it says)
            return f"shard({m})", 1
    run = [i for i, n in enumerate(new) if below[i] * n == stride]
    if run:
        if block is None and list(old) == new:
            return placement, None  # (the same shape, and no -1 that says otherwise)
        # Several dims end at that stride only where all but the last are size 1: the old
        # shape's size-1 dims just before d (one token: a decode step's [1, heads, head_dim]),
        # and for an interleaved slice what is left of d above it where that is size 1, are
        # the first of them; a size-1 dim after those is the rank's where the dims after it
        # are the dims after d (one KV head per rank: [t, head_dim] to [t, 1, head_dim]; the
        # heads split out of [b * np, sq, sk] as [b, 1, sq, sk]), not where the last of them
        # also holds d's own elements ([2, 16] of one token's two heads viewed back to [1, 32]:
        # the 1 is the token).
        ones = 0
        while ones < d and old[d - 1 - ones] == 1:
            ones += 1
        if block is not None and old[d] == block:
            ones += 1  # (what is left of d above the rank's runs, size 1, takes one too)
        at = min(run[0] + ones, run[-1])
        if at < run[-1] and math.prod(old[d + 1:]) not in below[at:]:
            at = run[-1]
        return f"shard({at})", None
    for i, n in enumerate(new):
        if below[i] < stride < below[i] * n and stride % below[i] == 0:
            return f"shard({i})", stride // below[i]
    return None


def merged_left(placement: str, old_shape, new_shape, block=None):
    """The other reading of a reshape that merges a sharded size-1 dim away, or None.

    Each rank holding one head of a heads dim (``[sq, b, 1, hn]``) reshaped to ``[sq, b, hn]``
    reads two ways from local shapes: the heads merged into hn (reshape_shard's reading, the
    rank the outer part of hn, as ``[sq, b, np * hn]`` before a row-parallel projection) or into
    the batch before them (Megatron's ``[sq, b * np, hn]`` for its batched product: the rank's
    head interleaved with the batch, in runs of one). This is the second: the new dim whose
    inner edge the rank sits at, as an interleaved slice in runs of one."""
    d = _shard_dim(placement)
    old, new = list(old_shape or ()), list(new_shape or ())
    if d is None or block not in (None, 1) or not old or not new or d >= len(old) or old[d] != 1:
        return None
    if -1 in new or math.prod(new) != math.prod(old) or len(new) >= len(old):
        return None
    stride = math.prod(old[d + 1:])
    below = [math.prod(new[i + 1:]) for i in range(len(new))]
    left = [i for i, n in enumerate(new) if below[i] == stride and n > 1 and below[i] * n > stride]
    right = [i for i, n in enumerate(new) if below[i] * n == stride]
    if not left or not right or d == 0 or old[d - 1] == 1:
        return None
    return f"shard({left[0]})", 1


def strided_shard(placement: str, vshape, vstride, shape, strides):
    """(placement, block) of a tensor of ``shape`` / ``strides`` whose elements were all
    written through a view of it (``vshape`` / ``vstride``, the same storage) holding
    ``placement``, or None. The rank's part of the view's sharded dim d spans ``vstride[d] *
    vshape[d]`` storage elements: the result's dim that ends there holds the ranks, one that
    spans more holds them interleaved, in runs (as reshape_shard, with strides for positions)."""
    d = _shard_dim(placement)
    if d is None:
        return placement, None
    if d >= len(vshape):
        return None
    extent = vstride[d] * vshape[d]
    dims = sorted(range(len(shape)), key=lambda i: -strides[i])
    for i in dims:
        if shape[i] > 1 and strides[i] * shape[i] == extent:
            return f"shard({i})", None
    for i in dims:
        if strides[i] > 0 and strides[i] < extent < strides[i] * shape[i] and extent % strides[i] == 0:
            return f"shard({i})", extent // strides[i]
    return None


def unbind_placement(placement, dim: int):
    """A shard after ``unbind(dim)``: along d - 1 past the removed dimension, unchanged before
    it; a shard along the removed dimension itself gives no answer (each rank's pieces are
    other rows of it, not slices of one piece)."""
    d = _shard_dim(placement) if placement else None
    if d is None:
        return placement
    if d == dim:
        return None
    return f"shard({d - 1})" if d > dim else placement


def combine(op: str, placements: list):
    """The placement of a multi-input op's result from its inputs' placements, or None when
    the op does not determine it (a partial plus a whole tensor, mixed shards)."""
    if not placements or any(p in (None, "unknown", "divergent") for p in placements):
        return None
    first = placements[0]
    if all(p == first for p in placements):
        return first  # add, cat or stack of like placements: shards stay shards of the result
    return None


class Placed(NamedTuple):
    """What the walk knows of a tensor: its placement, local shape (None: not known) and, for a
    shard, reshape_shard's block (None: a contiguous slice); ``cut``, for a whole tensor, the dim
    along which it is one group-size-th of a whole one it was sliced from (a slice the same on
    every rank is whole; one taken by each rank at its own offset, Megatron's
    ``scatter_to_sequence_parallel_region``, is that rank's part: the values tell which)."""

    placement: str | None
    shape: tuple | None = None
    block: int | None = None
    cut: int | None = None


NOTHING = Placed(None)


class LineageWalk:
    """Resolves a point's lineage reference to the judged points it was built from."""

    def __init__(self, judge, pt, merge_left=False):
        self.j, self.pt = judge, pt
        self.nodes, self.sources = judge.v.lineage()
        self.proc = judge.v.procs[0]
        self.ops: list = []  # op names along the way, for the evidence
        # a reshape that left the local shape as it was moved the shard by its -1 alone: a
        # reading the shapes cannot confirm (reshape_shard), which steps that show it outvote
        self.read_from_asked = False
        # merge_left: read reshapes that merge a sharded size-1 dim away as merged_left does;
        # ambiguous: the walk met such a reshape (the caller may try the other reading)
        self.merge_left, self.ambiguous = merge_left, False

    def slot_ref(self):
        t = self.j.v.times.get(self.pt.key)
        if t is None:
            return None
        return self.sources.get((t[1], t[2]))

    def placement_of(self, ref, depth=0) -> Placed:
        """What ``ref`` points at (NOTHING where the walk cannot tell)."""
        if depth > MAX_DEPTH or not ref:
            return NOTHING
        if ref[0] == REF_PARAM:
            return self.param(ref[1], ref[2])
        if ref[0] == 0:
            if ref[1] != self.j.v.step:
                return NOTHING
            key = self.j.v.slot_key.get((self.proc, ref[2], ref[3]))
            verdict = self.j.done.get(key) if key else None
            if verdict is None:
                return NOTHING
            t = self.j.v.points[key].get(self.proc)
            self.ops.append(f"from {self.j.name(key)} ({verdict.placement})")
            return Placed(verdict.placement, t.shape if t is not None else None, verdict.block)
        if ref[0] != 1 or ref[1] != self.j.v.step:
            return NOTHING
        node = self.nodes.get(ref[2])
        if node is None:
            return NOTHING
        seen = self._judged_point(ref[2])
        if seen is not None:
            return seen
        op, attrs, inputs = node[:3]
        out_shape = tuple(node[3]) if len(node) > 3 and node[3] is not None else None  # (the op's result)
        if op in _KEEP or op in _PARTS or op in _SCALE:
            if len(inputs) != 1:
                return NOTHING
            src = self.placement_of(inputs[0], depth + 1)
            self.ops.append(op)
            if op in _KEEP or op in _SCALE:
                return src
            placement = src.placement
            if src.block is not None and _cuts(src, attrs.get("dim", 0) if attrs else 0):
                return NOTHING  # parts of an interleaved slice's dim: not one slice each
            if op == "unbind":  # the unbound dimension goes: a shard after it moves in by one
                placement = unbind_placement(placement, attrs.get("dim", 0) if attrs else 0)
            return Placed(placement, out_shape, src.block)
        if op in _RESHAPE:
            src = self.placement_of(inputs[0], depth + 1) if len(inputs) == 1 else NOTHING
            new_shape = attrs.get("shape") or out_shape
            self.ops.append(op)
            if src.placement is None or src.shape is None or new_shape is None:
                return Placed(src.placement) if src.placement in ("replicate", "partial") else NOTHING
            left = merged_left(src.placement, src.shape, new_shape, src.block)
            self.ambiguous = self.ambiguous or left is not None
            hit = left if left is not None and self.merge_left else reshape_shard(
                src.placement, src.shape, new_shape, src.block, attrs.get("asked"))
            if hit and hit[0] != src.placement and list(src.shape) == list(new_shape):
                self.read_from_asked = True
            return Placed(hit[0], tuple(new_shape), hit[1]) if hit else NOTHING
        if op in dataflow_ops.PRODUCTS:
            # each operand's own chain, inside the product's parentheses
            outer, parts, texts = self.ops, [], []
            for r in inputs:
                self.ops = []
                parts.append(self.placement_of(r, depth + 1))
                texts.append(", ".join(reversed(self.ops)) or "?")
            self.ops = outer
            self.ops.append(f"{op}({'; '.join(texts)})")
            if any(p.block is not None for p in parts):  # an interleaved slice: only a batch dim keeps it
                batched = dataflow_ops.batch_shard(op, [p.placement for p in parts], attrs.get("ndims") or [])
                return NOTHING if batched is None or parts[0].block is None else Placed(batched, out_shape,
                                                                                        parts[0].block)
            return Placed(dataflow_ops.product_placement(op, [p.placement for p in parts], attrs.get("ndims") or []),
                          out_shape)
        if op in _DIMS:
            src = self.placement_of(inputs[0], depth + 1) if len(inputs) == 1 else NOTHING
            self.ops.append(_DIMS[op])
            if src.placement is None:
                return NOTHING
            return Placed(dataflow_ops.dims_placement(src.placement, attrs), out_shape, src.block,
                          self._cut(op, src, attrs, out_shape))
        if op in _WRITES and attrs and "view" in attrs and len(inputs) == 1:
            # the whole of a buffer written through a view that is no box of it (a product
            # written with out= into a transposed view: DeepSeek's absorbed MLA)
            src = self.placement_of(inputs[0], depth + 1)
            self.ops.append(f"{op}(into {attrs['into']})")
            off, vshape, vstride = attrs["view"]
            into, strides = attrs["into"], attrs.get("strides")
            if (src.placement is None or src.block is not None or off != 0 or strides is None
                    or math.prod(vshape) != math.prod(into)):
                return NOTHING
            hit = strided_shard(src.placement, vshape, vstride, into, strides)
            return Placed(hit[0], tuple(into), hit[1]) if hit else NOTHING
        if op in ("add", "add_", "cat", "stack"):
            parts = [self.placement_of(r, depth + 1) for r in inputs]
            self.ops.append(op + (f"(dim={attrs['dim']})" if "dim" in attrs else ""))
            if op in ("add", "add_") and len(parts) < 2:
                return NOTHING
            blocks = {p.block for p in parts}
            if len(blocks) != 1 or (op == "cat" and None not in blocks):
                return NOTHING  # (a cat of interleaved slices along any dim: not placed here)
            placement = combine(op, [p.placement for p in parts])
            if placement is not None and op == "stack":
                d = _shard_dim(placement)
                dim = attrs.get("dim", 0)
                if d is not None and dim <= d:
                    placement = f"shard({d + 1})"
            return Placed(placement, out_shape, parts[0].block if parts else None)
        return NOTHING

    def _cut(self, op, src, attrs, out_shape) -> int | None:
        """The result's dim that a slice of a whole tensor keeps one group-size-th of, or None."""
        part = (attrs or {}).get("part") or ()
        dims = (attrs or {}).get("dims") or ()
        if (op != "getitem" or src.placement != "replicate" or len(part) != 1 or src.shape is None
                or out_shape is None or part[0] >= len(dims) or part[0] >= len(src.shape)):
            return None
        k = dims[part[0]]
        n = self.j.group_size
        if k < 0 or k >= len(out_shape) or n < 2 or src.shape[part[0]] != n * out_shape[k]:
            return None
        return k

    def _judged_point(self, node) -> Placed | None:
        """The node's result as a point judged earlier in the step knows it (a residual sum
        that the next norm received): its verdict, from the values, outranks a walk through
        the ops that built it (whose sources may be hidden, as a DTensor's redistribution is)."""
        for key in self.j.v.node_points().get(node, ()):
            verdict = self.j.done.get(key)
            if key == self.pt.key or verdict is None or verdict.placement in ("unknown", "divergent"):
                continue
            t = self.j.v.points[key].get(self.proc)
            self.ops.append(f"as {self.j.name(key)} ({verdict.placement})")
            return Placed(verdict.placement, t.shape if t is not None else None, verdict.block)
        return None

    def param(self, module, name) -> Placed:
        """A module's parameter, placed from its records on every rank."""
        per = self.j.module_params(module, self.pt.procs)
        if per is None:
            return NOTHING
        rows = [next(((shape, fp, meta) for n, shape, fp, meta in params if n == name), None) for params in per]
        if None in rows:
            return NOTHING
        hit = dataflow_ops.param_placement(rows)
        if hit is None:
            return NOTHING
        self.ops.append(f"{module}.{name} ({hit[0]}: {hit[1]})")
        return Placed(hit[0], tuple(rows[0][0]))


def built_by_sum(judge, pt) -> str | None:
    """How ``pt`` is known to be a sum of tensors, or None: the step's recorded ops built it by
    an add (behind views, clones or casts), or it is, or carries, a module output that its
    layer class declares a residual sum. Its values may then equal a reduction's output (an
    addend lost to the other's rounding, as dummy weights' tiny layer outputs are in bf16), but
    it is not that output carried on."""
    says = judge.residual_sum(pt.key)
    if says:
        return says
    # the very values (bit for bit) of an earlier module output declared a residual sum: that
    # tensor handed on (SGLang's norms return x + residual, which the next layer's norm receives)
    t = pt.obs.get(judge.v.procs[0])
    for producer in (judge.producer(t), judge.latest_producer(t)):
        if producer is not None and producer != pt.key:
            says = judge.residual_sum(producer)
            if says:
                return f"the values of {judge.name(producer)}: {says}"
    key, _ops, last = _walk_carried(judge, pt)
    if key is not None:  # a point of the step, as is
        return judge.residual_sum(key)
    if last is not None and last[0] in ("add", "add_"):
        return "the recorded ops built it by an add" if len(last[2]) >= 2 else None
    return None


def carried_from(judge, pt):
    """(key, ops) where the recorded ops built ``pt`` from a point of the step by views,
    reshapes, clones, casts and scaling by numbers alone (the contract's "carried unchanged up
    to a view, reshape, clone, cast or common scale"): that point's key and the ops, innermost
    last; None otherwise."""
    key, ops, _last = _walk_carried(judge, pt)
    return (key, ops) if key is not None and ops else None


def _walk_carried(judge, pt) -> tuple:
    """(key, ops, last) of the walk from ``pt``'s lineage back through views, reshapes, clones,
    casts and scalings by numbers: ``key`` the point of the step it reached (None where it
    reached none), ``ops`` the ops it passed (innermost last), ``last`` the node that stopped it
    ((op, attrs, inputs), or None)."""
    walk = LineageWalk(judge, pt)
    ref = walk.slot_ref()
    ops: list = []
    for _ in range(MAX_DEPTH):
        if ref and ref[0] == 0 and ref[1] == judge.v.step:
            return judge.v.slot_key.get((walk.proc, ref[2], ref[3])), ops, None
        if not ref or ref[0] != 1 or ref[1] != judge.v.step:
            return None, ops, None
        node = walk.nodes.get(ref[2])
        if node is None:
            return None, ops, None
        op, attrs, inputs = node[:3]
        if (op not in _KEEP and op not in _RESHAPE and op not in _SCALE) or len(inputs) != 1:
            return None, ops, node[:3]
        ops.append(f"{op} {attrs['factor']:.4g}" if op in _SCALE and attrs and "factor" in attrs else op)
        ref = inputs[0]
    return None, ops, None


def _cuts(src: Placed, dim: int) -> bool:
    """Whether a split along ``dim`` cuts ``src``'s sharded dim (unknown rank: taken to)."""
    d = _shard_dim(src.placement or "")
    if d is None:
        return False
    if dim < 0:
        if src.shape is None:
            return True
        dim += len(src.shape)
    return dim == d


class FromLineage(NamedTuple):
    """A point placed by the ops that built it: ``block``, reshape_shard's, for an interleaved
    slice of the shard's dim; ``read_from_asked``, a shard moved by a local no-op reshape's -1;
    ``cut``, Placed's; ``ambiguous``, the walk met a reshape that merged a sharded size-1 dim
    away (merged_left: the other reading may be asked for)."""

    placement: str
    ops: str
    block: int | None
    read_from_asked: bool
    cut: int | None = None
    ambiguous: bool = False


def placement_from_lineage(judge, pt, merge_left=False) -> FromLineage | None:
    """What the recorded ops that built ``pt`` say of its placement, or None; ``merge_left``:
    with merged_left's reading of the ambiguous reshapes."""
    walk = LineageWalk(judge, pt, merge_left)
    ref = walk.slot_ref()
    if ref is None:
        return None
    found = walk.placement_of(ref)
    if found.placement is None:
        return None
    d = _shard_dim(found.placement)
    if d is not None and d >= pt.ndim:
        return None
    return FromLineage(found.placement, ", ".join(reversed(walk.ops)), found.block if d is not None else None,
                       walk.read_from_asked and d is not None, found.cut, walk.ambiguous)
