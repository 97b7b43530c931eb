"""Placement through the ops the tracer's lineage watcher records (tracer/lineage.py): one rule
per op family, mapping input placements to the output's, as DTensor's sharding propagation does.
They apply between module boundaries: a tensor that a module received was built by a split, a
view, an add or a cat of tensors judged earlier in the step, or from a module's parameters by
indexing, dimension moves and matrix products (dataflow_ops.py: an MoE's experts inside one call).
"""

from __future__ import annotations

import math

from tensor_trace.exporters.analysis import dataflow_ops
from tensor_trace.format.lineage_refs import REF_PARAM

# single-input ops that keep every value (a dtype, layout or memory change)
_KEEP = {"clone", "to", "contiguous", "detach"}
_RESHAPE = {"view", "reshape", "flatten"}
_PARTS = {"split", "chunk", "unbind"}
MAX_DEPTH = 32
# dimension moves (tracer/lineage_attrs.py), as the evidence names them
_DIMS = {"getitem": "[...]", "index_select": "index_select", "transpose": "transpose", "t": "t",
         "permute": "permute", "unsqueeze": "unsqueeze", "squeeze": "squeeze",
         "repeat_interleave": "repeat_interleave"}


def _shard_dim(p: str):
    return int(p[6:-1]) if p.startswith("shard(") else None


def reshape_placement(placement: str, old_shape, new_shape):
    """A shard along dim d of ``old_shape`` lies, after a reshape, along the outermost new
    dimension that the old dimension d was split into (heads out of a hidden dimension, a
    size-1 heads dimension included), or along the dimension it was merged into."""
    d = _shard_dim(placement)
    if d is None:
        return placement
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
    before = math.prod(old[:d])
    acc = 1
    for i, n in enumerate(new):
        # The first new dimension whose elements before it are exactly the old dimensions
        # before d starts the split of d, a size-1 one included: heads split out of a shard of
        # the hidden dimension with one head per rank (GQA's KV heads at TP = their count) put
        # the shard on that size-1 heads dimension, the outermost, not on head_dim.
        if acc == before and _group_end(new, i, old[d]) is not None:
            return f"shard({i})"
        if acc <= before < acc * n:
            return f"shard({i})"
        acc *= n
    return None


def _group_end(new, start: int, size: int):
    """The index past the new dimensions from ``start`` whose product is ``size``, or None."""
    acc = 1
    for i in range(start, len(new)):
        acc *= new[i]
        if acc == size:
            return i + 1
        if acc > size:
            return None
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


class LineageWalk:
    """Resolves a point's lineage reference to the judged points it was built from."""

    def __init__(self, judge, pt):
        self.j, self.pt = judge, pt
        self.nodes, self.sources = judge.v.lineage()
        self.proc = judge.v.procs[0]
        self.ops: list = []  # op names along the way, for the evidence

    def slot_ref(self):
        t = self.j.v.times.get(self.pt.key)
        if t is None:
            return None
        return self.sources.get((t[1], t[2]))

    def placement_of(self, ref, depth=0):
        """(placement, shape) of what ``ref`` points at, or (None, None)."""
        if depth > MAX_DEPTH or not ref:
            return None, None
        if ref[0] == REF_PARAM:
            return self.param(ref[1], ref[2])
        if ref[0] == 0:
            if ref[1] != self.j.v.step:
                return None, None
            key = self.j.v.slot_key.get((self.proc, ref[2], ref[3]))
            verdict = self.j.done.get(key) if key else None
            if verdict is None:
                return None, None
            t = self.j.v.points[key].get(self.proc)
            self.ops.append(f"from {self.j.name(key)} ({verdict.placement})")
            return verdict.placement, t.shape if t is not None else None
        if ref[0] != 1 or ref[1] != self.j.v.step:
            return None, None
        node = self.nodes.get(ref[2])
        if node is None:
            return None, None
        op, attrs, inputs = node
        if op in _KEEP or op in _PARTS:
            if len(inputs) != 1:
                return None, None
            placement, shape = self.placement_of(inputs[0], depth + 1)
            self.ops.append(op)
            if op == "unbind":  # the unbound dimension goes: a shard after it moves in by one
                placement = unbind_placement(placement, attrs.get("dim", 0) if attrs else 0)
            return placement, (None if op in _PARTS else shape)
        if op in _RESHAPE:
            placement, shape = self.placement_of(inputs[0], depth + 1) if len(inputs) == 1 else (None, None)
            new_shape = attrs.get("shape")
            self.ops.append(op)
            if placement is None or shape is None or new_shape is None:
                return (placement if placement in ("replicate", "partial") else None), None
            return reshape_placement(placement, shape, new_shape), new_shape
        if op in dataflow_ops.PRODUCTS:
            # each operand's own chain, inside the product's parentheses
            outer, parts, texts = self.ops, [], []
            for r in inputs:
                self.ops = []
                parts.append(self.placement_of(r, depth + 1))
                texts.append(", ".join(reversed(self.ops)) or "?")
            self.ops = outer
            self.ops.append(f"{op}({'; '.join(texts)})")
            return dataflow_ops.product_placement(op, [p for p, _ in parts], attrs.get("ndims") or []), None
        if op in _DIMS:
            placement, _shape = self.placement_of(inputs[0], depth + 1) if len(inputs) == 1 else (None, None)
            self.ops.append(_DIMS[op])
            return (dataflow_ops.dims_placement(placement, attrs) if placement is not None else None), None
        if op in ("add", "add_", "cat", "stack"):
            parts = [self.placement_of(r, depth + 1) for r in inputs]
            self.ops.append(op + (f"(dim={attrs['dim']})" if "dim" in attrs else ""))
            if op in ("add", "add_") and len(parts) < 2:
                return None, None
            placement = combine(op, [p for p, _ in parts])
            if placement is not None and op == "stack":
                d = _shard_dim(placement)
                dim = attrs.get("dim", 0)
                if d is not None and dim <= d:
                    placement = f"shard({d + 1})"
            return placement, None
        return None, None

    def param(self, module, name):
        """(placement, local shape) of a module's parameter, from its records on every rank."""
        per = self.j.module_params(module, self.pt.procs)
        if per is None:
            return None, None
        rows = [next(((shape, fp, meta) for n, shape, fp, meta in params if n == name), None) for params in per]
        if None in rows:
            return None, None
        hit = dataflow_ops.param_placement(rows)
        if hit is None:
            return None, None
        self.ops.append(f"{module}.{name} ({hit[0]}: {hit[1]})")
        return hit[0], rows[0][0]


def placement_from_lineage(judge, pt):
    """(placement, ops text) for ``pt`` from the recorded ops that built it, or None."""
    walk = LineageWalk(judge, pt)
    ref = walk.slot_ref()
    if ref is None:
        return None
    placement, shape = walk.placement_of(ref)
    if placement is None:
        return None
    d = _shard_dim(placement)
    if d is not None and d >= pt.ndim:
        return None
    return placement, ", ".join(reversed(walk.ops))
