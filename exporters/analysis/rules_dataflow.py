"""Placement rules from the step's dataflow: values that differ across ranks placed by points
judged earlier in the step: a concatenation of the ranks' tensors seen in the step, a tensor
built by recorded ops (split, view, add, cat: dataflow.py), the same values as a producer, or a
local derivation of a shard.
"""

from __future__ import annotations

import math

from tensor_trace.exporters.analysis import dataflow
from tensor_trace.exporters.analysis.evidence import READ_FROM_ASKED, decide, item
from tensor_trace.exporters.analysis.step_view import (BROADCAST, REDUCE_SCATTER, REDUCING, coll_desc, coll_json,
                                                       next_sum_reduction)
from tensor_trace.exporters.analysis.tolerance import FLOAT_DTYPES, all_equal, close, linked


def concatenation(j, pt):
    hit = j.concat_dim(pt)
    if hit is None:
        return None
    dim, key = hit
    where = j.name(key) if key else "a collective's output"
    whole = j.done.get(key) if key else None
    if whole is not None and whole.reduction == "post-reduction":
        # slices of a reduction's output, values unchanged (a sequence-parallel plan's
        # Replicate -> Shard(1) of the embedding's all_reduce): carried on, up to a view
        return decide(pt, f"shard({dim})", "post-reduction", "concatenation", whole.collective,
                      item("concat", f"their concatenation along dim {dim} appears earlier in this step "
                                     f"({where}, post-reduction): each rank holds a slice of a reduction's "
                                     f"output", point=where))
    whole_t = j.v.points[key].get(pt.procs[0]) if key else None
    flat = (f", its leading dims {list(whole_t.shape[:len(whole_t.shape) - pt.ndim + 1])} flattened"
            if whole_t is not None and len(whole_t.shape) != pt.ndim else "")
    return decide(pt, f"shard({dim})", "no-reduction", "concatenation", None,
                  item("concat", f"their concatenation along dim {dim} appears in this step ({where}{flat})",
                       point=where))


def lineage_ops(j, pt):
    """Built by recorded ops (split, view, add, cat...) from points judged earlier."""
    hit = dataflow.placement_from_lineage(j, pt)
    if hit is None:
        return None
    placement, ops, block, read, cut, ambiguous = hit
    if placement == "replicate" and pt.equal is False:
        # Values that differ across ranks are not whole, whatever the ops say: an index or a
        # slice taken differently on each rank (DP attention's own tokens) is not seen in them.
        # Where the slice is one group-size-th of the whole along a dim, each rank took its
        # own part (Megatron's scatter to sequence-parallel regions): a shard of that dim.
        if cut is None or pt.tref is None or cut >= pt.ndim:
            return None
        return decide(pt, f"shard({cut})", "no-reduction", "lineage-ops", None,
                      item("dataflow", f"built by recorded ops: {ops}; a slice of 1/{j.group_size} of a whole tensor "
                                       f"along its dim {cut}, with values that differ across ranks: each rank's "
                                       "own part"))
    c = next_sum_reduction(j.v, pt) if placement == "partial" else None
    other = None
    if placement == "partial" and c is None and ambiguous:
        # a partial sum that no sum-reduction completes, read through a reshape of a size-1
        # sharded dim: the reshape's other reading (the heads merged into the batch before
        # them, not into the dim a product contracts) is taken where it gives a shard
        other = dataflow.placement_from_lineage(j, pt, merge_left=True)
        if other is not None and other.placement.startswith("shard(") and other.placement[6:-1].isdigit():
            placement, ops, block, read = other.placement, other.ops, other.block, other.read_from_asked
        else:
            other = None
    reduction = "pre-reduction" if c else ("unknown" if placement == "partial" else "no-reduction")
    verdict = decide(pt, placement, reduction, "lineage-ops", coll_json(c, pt.procs[0]) if c else None,
                     item("dataflow", f"built by recorded ops: {ops}"), *_interleaved(pt, placement, block),
                     *([item(READ_FROM_ASKED, "a reshape left the local shape as it was: the ranks are taken to be "
                                              "in its -1 dim, which the shapes alone cannot confirm")] if read else []),
                     *([item("dataflow", "a reshape merged a sharded size-1 dim away, which local shapes read two "
                                         "ways: merged into the dim after it, the ops make a partial sum that no "
                                         "sum-reduction completes; merged into the dim before it (heads into the "
                                         "batch), a shard: taken")] if other else []))
    verdict.block = block
    return verdict


def _interleaved(pt, placement, block) -> list:
    """The evidence that a shard is an interleaved slice of its dim (none for a contiguous one)."""
    if block is None:
        return []
    d = int(placement[6:-1])
    size = pt.tref.shape[d] if pt.tref is not None and d < len(pt.tref.shape) else None
    runs = f"{size // block} runs of {block}" if size else f"runs of {block}"
    return [item("dataflow", f"interleaved: each rank's part of dim {d} is {runs}, with the other ranks' "
                             f"between them (a sharded dim merged inside another by a reshape)")]


def _communicated(j, pt) -> bool:
    """A module call that issued collectives itself did not compute its output
    locally from its inputs: a row-parallel layer's all_reduce then a bias, a max taken across
    ranks, a sequence gathered before a projection. Says so in the point's evidence."""
    colls = j.output_collectives(pt)
    if not colls:
        return False
    names = ", ".join(coll_desc(c) for c in colls[:3]) + (f" and {len(colls) - 3} more" if len(colls) > 3 else "")
    note = item("dataflow", f"not derived locally from its inputs: its call issued {names}")
    if note not in pt.items:
        pt.items.append(note)
    return True


def derived_from_shard_inputs(j, pt):
    """An output of a module all of whose floating-point inputs are shards: one without
    parameters, or one whose output has its first input's shape (a norm of each rank's heads,
    whose weight is the same on every rank). Where the step's shards are identical (equal
    values hide them), a module of shards and whole tensors too: its output follows the input
    of its own shape (a rotary embedding's q and k), else the first shard (an attention's
    output from its q heads and a whole latent k and v)."""
    if not pt.is_output or _communicated(j, pt):
        return None
    inputs = [(k, vd) for k, vd in j.call_inputs(pt)
              if (j.v.points[k].get(pt.procs[0]) or pt.tref).dtype.startswith(FLOAT_DTYPES)]
    shards = [k for k, vd in inputs if vd.placement.startswith("shard(")]
    if not shards or (len(shards) < len(inputs) and not j.identical_shards):
        return None
    shape = tuple(pt.tref.shape) if pt.tref is not None else None
    same = [k for k, _ in inputs if (t := j.v.points[k].get(pt.procs[0])) is not None and tuple(t.shape) == shape]
    if j.params.get((pt.procs[0], pt.module)) and (not same or same[0] != inputs[0][0]):
        return None
    if len(shards) < len(inputs) and same:
        if same[0] not in shards:
            return None  # (the whole input of its shape: a whole output)
        src = same[0]
    else:
        src = shards[0]
    if pt.equal and not equal_on_ranks(j, src, pt.procs):
        return None
    return derived_from_shard(j, pt, src)


def compiled_residual(j, pt):
    """The output of a compiled call (torch.compile: the ops inside are not recorded) that is,
    by its sums on every rank, its input plus the outputs of the reduce_scatters the call issued
    (of its shape): a sequence-parallel block's residual adds of its attention's and its MLP's
    reduced slices. Slices of the same dim added make a slice of that dim, computed locally:
    no reduction."""
    if not pt.is_output or pt.equal or pt.tref is None or not (j.layer_attrs.get(pt.module) or {}).get("compiled"):
        return None
    shape = tuple(pt.tref.shape)
    scattered = [c for c in j.call_collectives(pt) if c.op in REDUCE_SCATTER and c.sums and all(
        (c.outs.get(p) or [None])[0] is not None and c.outs[p][0].fp is not None and tuple(c.outs[p][0].shape) == shape
        for p in pt.procs)]
    if not scattered:
        return None
    for key, vd in j.call_inputs(pt):
        obs = j.v.points[key]
        if not vd.placement.startswith("shard(") or any(
                p not in obs or obs[p].fp is None or tuple(obs[p].shape) != shape for p in pt.procs):
            continue
        for added in (scattered, scattered[-1:]):
            if all(close(pt.obs[p].fp[0], obs[p].fp[0] + sum(c.outs[p][0].fp[0] for c in added), pt.tref.numel,
                         pt.obs[p].fp[1] + obs[p].fp[1] + sum(c.outs[p][0].fp[1] for c in added), pt.tref.dtype)
                   for p in pt.procs):
                names = ", ".join(coll_desc(c) for c in added)
                return decide(pt, vd.placement, "no-reduction", "compiled-residual", None,
                              item("dataflow", f"by its sums on every rank, {j.name(key)} ({vd.placement}) plus the "
                                               f"outputs of {names} (reduced slices of the same shape), added inside "
                                               "the compiled call: a slice, computed locally", point=j.name(key)))
    return None


def equal_on_ranks(j, key, procs) -> bool:
    """Whether ``key``'s values are equal on every rank of ``procs``, or cannot be told (no
    fingerprints). Values equal on every rank derive from a shard only where that shard is
    identical on every rank too (dummy weights): from a shard whose ranks differ, what is equal
    everywhere took its shape or dtype alone (a rotary embedding's cos and sin from the v it is
    handed) or nothing of it (a bias returned beside a row-parallel output)."""
    obs = j.v.points.get(key) or {}
    ts = [obs.get(p) for p in procs]
    if any(t is None or t.fp is None for t in ts):
        return True
    return all_equal(ts)


def input_shaped_as_shard(j, pt):
    """A module's input built by ops no lineage records (a rotary embedding's products) from
    the latest shard before it in the enclosing call, and of that shard's local shape, where
    no whole tensor of the call has it: where the ranks' shards are identical, what tells it
    from a whole tensor (whose shape would be the tensor's whole one)."""
    if pt.is_output or pt.tref is None:
        return None
    shape = tuple(pt.tref.shape)
    src = j.enclosing_shard(pt, shape)
    if src is None or j.enclosing_shard(pt, shape, whole=True) is not None:
        return None  # (whole tensors of that shape in the call too: the shape tells nothing)
    if pt.equal and not equal_on_ranks(j, src, pt.procs):
        return None
    return derived_from_shard(j, pt, src)


def same_values_as_producer(j, pt):
    """Carrying, on every rank, the values of a point judged earlier: an input that is an
    earlier output, an output that passes its call's input through, or one that returns a
    child's output."""
    cands = [k for k, _ in j.call_inputs(pt)] if pt.is_output else []
    hit = j.producer(pt.tref)
    if hit is not None:
        cands.append(hit)
    for prod in cands:
        pv = j.done.get(prod)
        if pv is None or pv.placement in ("divergent", "unknown"):
            continue
        src = {p: j.v.points[prod][p] for p in pt.procs if p in j.v.points[prod]}
        if len(src) < len(pt.procs) or linked(src, pt.obs) != 1.0:
            continue
        if pv.placement.startswith("shard(") and tuple(src[pt.procs[0]].shape) != tuple(pt.tref.shape):
            continue  # (a shard's dim is one of its shape's: the same values viewed otherwise say nothing)
        verdict = decide(pt, pv.placement, pv.reduction, "same-values", pv.collective,
                         item("dataflow", f"the same values as {j.name(prod)} on every rank",
                              point=j.name(prod)))
        verdict.block = pv.block
        return verdict
    return None


def same_values_where_finite(j, pt):
    """A point with non-finite values on some ranks (a vocab-parallel head's -inf padding
    columns) carrying a producer's tensor: the same values on the ranks where they are finite,
    non-finite on the same ranks as the producer's, and the same shapes."""
    cands = [k for k, _ in j.call_inputs(pt)] if pt.is_output else []
    hit = j.producer(pt.tref)
    if hit is not None:
        cands.append(hit)
    if all(t.nonfinite for t in pt.ts):
        return None  # (nothing left to match by)
    for prod in cands:
        pv = j.done.get(prod)
        if pv is None or pv.placement in ("divergent", "unknown"):
            continue
        src = j.v.points[prod]
        if not all(p in src and src[p].shape == pt.obs[p].shape and src[p].nonfinite == pt.obs[p].nonfinite
                   and (pt.obs[p].nonfinite or linked({p: src[p]}, {p: pt.obs[p]}) == 1.0) for p in pt.procs):
            continue
        verdict = decide(pt, pv.placement, pv.reduction, "same-values", pv.collective,
                         item("dataflow", f"the same values as {j.name(prod)} where they are finite, and "
                                          f"non-finite on the same ranks", point=j.name(prod)))
        verdict.block = pv.block
        return verdict
    return None


def _no_room(src_shape: tuple, d: int, shape: tuple, ranks: int) -> bool:
    """Whether a tensor of ``shape`` (of another rank than ``src_shape``, sharded along ``d``
    across ``ranks``, and holding another number of values) cannot hold a part of that shard:
    none of the source's whole dims (larger than 1) is among its dims but the sharded dim's
    whole size is (a [seq, head_dim] rotary table beside a sequence-parallel [b, seq/tp, dim]),
    or its dims (larger than 1) are, in order, whole dims of the source alone (that table beside
    q [b, seq, heads, head_dim])."""
    whole = [n for i, n in enumerate(src_shape) if i != d and n > 1]
    mine = [n for n in shape if n > 1]
    if not whole or math.prod(src_shape) == math.prod(shape):
        return False  # (nothing to compare by; or as many values: perhaps the shard viewed, [1, 2, 4] as [1, 8])
    if not any(n in mine for n in whole):
        return src_shape[d] * ranks in mine
    it = iter(whole)
    return bool(mine) and all(any(n == w for w in it) for n in mine)


REDUCED_OWN_SLICE = "reduced-own-slice"


def combined_by(j, pt):
    """The collective that takes ``pt``'s values as they are on every rank and is no sum: an
    all_reduce of max or min (a vocab-parallel sampler's or cross-entropy's per-rank max), or a
    broadcast (a buffer only its source rank filled); None if none."""
    for c, _, scale in j.links(pt)[1]:
        if c.op in REDUCING and not c.sums and scale == 1.0:
            return c
    for c in j.v.after(pt.t_point, BROADCAST, limit=4):
        if all(c.ins.get(p) for p in pt.procs) and linked(pt.obs, {p: c.ins[p][0] for p in pt.procs}) == 1.0:
            return c
    return None


def _reduced_over(src_shape: tuple, d: int, shape: tuple) -> bool:
    """Whether ``shape`` is ``src_shape`` reduced over its last dim ``d`` (``max(-1)``, an
    argmax, ``sum(-1, keepdim=True)``): that dim, larger than 1, dropped or kept with size 1. A
    middle dim that goes is not read so (one head taken out of each rank's heads is a slice)."""
    if d != len(src_shape) - 1 or src_shape[d] <= 1:
        return False
    return shape == src_shape[:-1] or shape == src_shape[:-1] + (1,)


def _derived_dim(src_shape, d, shape, ndim) -> int:
    """Where a shard of dim ``d`` of ``src_shape`` is taken to lie in a tensor of another rank
    derived from it, with no recorded op between them: where the dims before d are the same and
    the dims from d on split (a part of) the sharded dim (heads split out of a column shard,
    ``[t, 64]`` to ``[t, 2, 16]``), the outermost of them; where the source's other dims are
    found, in order, among the tensor's, the outermost dim left over; else the last dim (heads
    merged back, perhaps after a transpose that no op recorded)."""
    if src_shape is None or shape is None or d >= ndim or d >= len(src_shape):
        return ndim - 1
    rest = math.prod(shape[d:])
    if list(src_shape[:d]) == list(shape[:d]) and rest > 0 and src_shape[d] % rest == 0:
        return d
    # The source's whole dims kept their sizes (tokens, batch), in order, perhaps moved by a
    # transpose: the dims left over split the sharded one, heads outermost (q viewed to
    # [b, s, heads, head_dim] and transposed to [b, heads, s, head_dim], or to heads of
    # another head_dim than the source's).
    left = _left_over(src_shape, d, shape)
    return left[0] if left else ndim - 1


def _left_over(src_shape, d, shape) -> list | None:
    """The dims of ``shape`` left over once the dims of ``src_shape`` other than ``d`` are
    found among them in order, by size; None where they are not all found."""
    left, k = [], 0
    whole = [n for i, n in enumerate(src_shape) if i != d]
    for i, n in enumerate(shape):
        if k < len(whole) and n == whole[k]:
            k += 1
        else:
            left.append(i)
    return left if k == len(whole) else None


def inner_shard_dim(a, d, b) -> int | None:
    """Where a tensor of shape ``b`` computed from a shard of dim ``d`` of shape ``a`` holds each
    rank's part: the same dim of the same size where both have the same rank, else where the
    shard's other dims lie in order with one dim left over whose size divides the shard's (each
    rank's heads); None otherwise (a gathered tensor is larger than a rank's part)."""
    a, b = tuple(a), tuple(b)
    if len(a) == len(b):
        return d if a[:d + 1] == b[:d + 1] else None
    left = _left_over(a, d, b)
    if not left or b[left[0]] < 2 or a[d] % b[left[0]]:
        return None
    return left[0]


def derived_from_inner_shard(j, pt):
    """An output whose values differ across ranks, of a call that issued no collective and was
    handed no shard, computed from a shard the modules it called made (eager attention's
    probabilities ``[b, heads, s, s]`` from the q heads its column-parallel projection made):
    a shard where that shard's dim is found in the output, the same dim of the same size where
    both have the same rank, else where the shard's other dims lie in order with one dim left
    over whose size divides the shard's. Anything else stays unexplained (``divergent``): an
    output that lost its reduction keeps the hidden size its shard does not have. Only in steps
    whose ops were recorded and did not build it."""
    if not pt.is_output or pt.tref is None or pt.equal or j.call_collectives(pt):
        return None
    if any(vd.placement.startswith("shard(") for _, vd in j.call_inputs(pt)):
        return None
    # Only in a step whose ops were watched, and where none built it: what recorded ops built
    # (a residual sum of a partial one, as in an aux hidden state captured before its
    # reduction) is theirs to place, and a step without them cannot tell.
    nodes, sources = j.v.lineage()
    t = j.v.times.get(pt.key)
    if not nodes or t is None or (t[1], t[2]) in sources:
        return None
    src = j.inner_shard(pt)
    src_t = j.v.points[src].get(pt.procs[0]) if src is not None else None
    if src_t is None:
        return None
    placement = j.done[src].placement
    a, b = tuple(src_t.shape), tuple(pt.tref.shape)
    dim = inner_shard_dim(a, int(placement[6:-1]), b)
    if dim is None:
        return None
    return decide(pt, f"shard({dim})", "no-reduction", "derived-from-shard", None,
                  item("dataflow", f"computed inside its call from {j.name(src)}, {placement}, which a module it "
                                   f"called made" + ("" if len(a) == len(b) else f" (its dims in order: dim {dim} the "
                                                                                  "shard's part)"),
                       point=j.name(src)))


def derived_from_shard(j, pt, src=None):
    """Computed locally from a shard (``src``, else found): an output from its call's sharded
    input, or a tensor inside a call from the latest shard before it in that call."""
    if src is None and pt.is_output:
        if _communicated(j, pt):
            return None
        shards = [k for k, vd in j.call_inputs(pt) if vd.placement.startswith("shard(")]
        # the input of the output's own shape first (a rotary embedding returns q and k rotated)
        shape = tuple(pt.tref.shape) if pt.tref is not None else None
        src = next((k for k in shards if (t := j.v.points[k].get(pt.procs[0])) is not None
                    and tuple(t.shape) == shape), shards[0] if shards else None)
    elif src is None:
        # a tensor of its own rank first: Megatron's MLP adds fc1's 1-D bias (its output.1, a
        # shard of dim 0) to fc1's [s, b, ffn] output (a shard of dim 2) before the activation
        src = (j.enclosing_shard(pt, ndim=pt.ndim) if pt.tref is not None else None) or j.enclosing_shard(pt)
    if src is None:
        return None
    placement = j.done[src].placement
    d = int(placement[6:-1])
    src_t = j.v.points[src].get(pt.procs[0])
    if src_t is not None and pt.tref is not None and _reduced_over(tuple(src_t.shape), d, tuple(pt.tref.shape)):
        why = item("dataflow", f"{j.name(src)} is {placement}, and its shape less dim {d} is this tensor's: each "
                               "rank reduced its own slice (a max or a sum over it), which is no slice of anything",
                   point=j.name(src))
        if pt.equal or combined_by(j, pt) is not None:
            pt.items.append(why)
            return None  # (one that a max all_reduce takes: rules.divergent names it)
        # per rank by design (a vocab slice's max and argmax before a sampler combines them):
        # a sum of it that a later sum-reduction completes is found before this rule
        return decide(pt, "divergent", "no-reduction", REDUCED_OWN_SLICE, None, why)
    same_rank = src_t is not None and len(src_t.shape) == pt.ndim and d < pt.ndim
    if not same_rank and src_t is not None and pt.tref is not None and _no_room(
            tuple(src_t.shape), d, tuple(pt.tref.shape), j.group_size):
        pt.items.append(item("dataflow", f"{j.name(src)} is {placement}, but this tensor's dims are none of its "
                                         f"whole dims, or only them: no part of its dim {d} to hold (a table "
                                         "handed in beside it, e.g. a rotary cos)", point=j.name(src)))
        return None
    dim = d if same_rank else _derived_dim(src_t.shape if src_t is not None else None, d,
                                           pt.tref.shape if pt.tref is not None else None, pt.ndim)
    verdict = decide(pt, f"shard({dim})", "no-reduction", "derived-from-shard", None,
                     item("dataflow", f"derived locally from {j.name(src)}, {placement}"
                                      + ("" if same_rank else f" (another rank of tensor: dim {dim} assumed)"),
                          point=j.name(src)))
    if src_t is not None and pt.tref is not None and tuple(src_t.shape) == tuple(pt.tref.shape):  # (a norm)
        verdict.block = j.done[src].block
    return verdict
