"""The placement rules, one per kind of evidence, tried in this order for every point.

A rule either decides (returns a ``Verdict`` naming itself and what it saw) or adds what it
observed to the point's items and passes. Strongest first:

- the TP group's ranks: fewer readable than the group has make ``unknown``;
- shapes across ranks (an uneven shard);
- collectives linked by fingerprint on every rank (identity, or one common scale, so a view,
  reshape, clone, cast or scaling in between does not hide the link): the output of a
  sum-reduction is post-reduction, its input a partial sum (even when the ranks' partial sums
  happen to be equal), the input of an all_gather a shard, the output of a reduce_scatter a
  reduced shard. Collective linkage outranks value equality. An all_reduce of zero-padded slices
  (their sums of squares add up exactly) is a gather, not a reduction;
- values equal on every rank: replicate, unless a declaration (a DTensor's placements, a
  framework's layer class) says the layer is sharded, which equal values cannot refute
  (identical shards, e.g. dummy weights);
- values that differ: per-rank sums adding up to a later reduction's output, a DTensor's
  declared placement, a concatenation seen in the step, the module's parameters with its
  input's placement (a replicated input and a weight split along its output dimension give a
  shard; an input sharded along the contracted dimension and a weight split along its input
  dimension give a partial sum), the same values as a producer, or a local derivation of a
  shard; otherwise the ranks disagree (``divergent``).
"""

from __future__ import annotations

from tensor_trace.exporters.analysis import dataflow, declared, experts
from tensor_trace.exporters.analysis.evidence import Verdict, item
from tensor_trace.exporters.analysis.step_view import (GATHER, REDUCE_SCATTER, REDUCING, coll_desc,
                                                       coll_json, next_sum_reduction)
from tensor_trace.exporters.analysis.tolerance import (Observed, all_equal, close, disjoint_sum,
                                                       fp_equal, linked)

_FLOAT = ("float", "bfloat", "complex")


def _fmt_fp(t) -> str:
    if t.fp is None:
        return "no fingerprint"
    s, q = t.fp
    return f"sum {s:.6g}, sumsq {q:.6g}" if q is not None else f"sum {s:.6g}"


def _ranks_text(j, pt) -> str:
    return ", ".join(f"rank {j.rank_of[p]} {list(pt.obs[p].shape)}" for p in pt.procs)


def _decide(pt, placement, reduction, rule, collective=None, *extra) -> Verdict:
    return Verdict(placement, reduction, rule, pt.items + [item("rule", f"rule: {rule}")] + list(extra),
                   collective)


def _scale_ok(j, t, scale) -> bool:
    """A link through a common scale factor is evidence unless the tensor has a single row: a
    norm over the last dimension scales each row by its own factor, so a one-row tensor's norm
    looks like a scaled copy. There only averaging over the group (1/N, N) counts."""
    if scale is None:
        return False
    if scale == 1.0 or (t.shape and t.numel > t.shape[-1]):
        return True
    n = j.group_size
    return any(abs(scale - k) <= 1e-3 * k for k in (n, 1.0 / n))


def _coll_item(c, text) -> dict:
    return item("collective", text, collective=dict(group=c.group_name, seq=c.seq, op=c.op))


def _declared(pt):
    return declared.dtensor_placement(pt.tref.meta, pt.ndim) if pt.tref is not None else None


# ---------------------------------------------------------------------------------- the rules
def group_ranks(j, pt):
    if j.group_size == 1:
        return _decide(pt, "replicate", "no-reduction", "one-rank-group",
                       None, item("shape", "one rank in its TP group: every tensor is whole"))
    if len(pt.procs) < j.group_size:
        return j.missing(pt)
    return None


def shapes(j, pt):
    ts, tref = pt.ts, pt.tref
    if len({t.shape for t in ts}) == 1:
        pt.items.append(item("shape", f"same shape {list(tref.shape)} {tref.dtype} on ranks {j.ranks(pt.procs)}"))
        return None
    if len({len(t.shape) for t in ts}) == 1:
        diff = [d for d in range(len(tref.shape)) if len({t.shape[d] for t in ts}) > 1]
        if len(diff) == 1:
            pt.items.append(item("shape", f"shapes differ only along dim {diff[0]}: {_ranks_text(j, pt)}"))
            for c in j.v.before(pt.t_point + 1, REDUCE_SCATTER):
                outs = {p: c.outs[p][0] for p in pt.procs if c.outs.get(p)}
                if linked(outs, pt.obs) is not None:
                    return _decide(pt, f"shard({diff[0]})", "post-reduction", "reduce-scatter-output",
                                   coll_json(c, pt.procs[0]),
                                   _coll_item(c, f"is the output of {coll_desc(c)} on every rank: a reduced slice per rank"))
            return _decide(pt, f"shard({diff[0]})", "no-reduction", "uneven-shard")
    pt.items.append(item("shape", f"shapes differ in more than one dimension: {_ranks_text(j, pt)}"))
    return _decide(pt, "divergent", "unknown", "shapes-disagree")


NONFINITE_RULE = "non-finite-values"


def fingerprints(j, pt):
    if all(t.fp is not None for t in pt.ts):
        return None
    bad = [p for p, t in zip(pt.procs, pt.ts) if t.nonfinite]
    if bad:
        pt.items.append(item("values", f"non-finite values (NaN or inf) on ranks {j.ranks(bad)}: "
                                       "their sums say nothing (uninitialised padding?); placement needs values"))
        return _decide(pt, "unknown", "unknown", NONFINITE_RULE)
    kinds = sorted({(t.meta or {}).get("kind") for t in pt.ts if t.fp is None} - {None})
    why = (f"no fingerprint ({', '.join(kinds)})" if kinds else
           "no fingerprints for these values (recorded with --no-fingerprint, in a step that "
           "--fingerprint-every skipped, or in a CUDA-graph capture)")
    says = _declared(pt)
    extra = [item("declared", f"the DTensor declares {says} (not checked against values)")] if says else []
    pt.items.append(item("values", why + ": placement needs them"))
    return _decide(pt, "unknown", "unknown", "no-fingerprint", None, *extra)


def _gathering(c, procs, step_attrs=None) -> bool:
    """An all_reduce that puts slices together: on each rank its input is zero outside one
    contiguous, dense range of rows, the ranges follow the ranks' order and tile the tensor, at
    least two ranks contribute, and the sums of squares add up exactly (no cross terms). A
    vocab-parallel embedding's masked lookup is zero outside scattered rows, not one range: a
    reduction. Needs the rows the tracer saw nonzero (collective attribute ``nonzero_rows``).

    A rank may contribute no rows where its step says it holds no tokens of its own while other
    DP ranks do (DP attention's gather of each DP rank's tokens, ``step_attrs``: proc -> the
    step's ``tokens`` and ``dp_tokens``): then every rank's slice must be exactly its own tokens."""
    ins = [c.ins[p][0] for p in procs if c.ins.get(p)]
    out = c.outs.get(procs[0])
    if not ins or len(ins) < len(procs) or not out:
        return False
    spans = []
    own = {}
    for p in procs:
        rows = (c.attrs_of.get(p) or {}).get("nonzero_rows")
        if not rows or not isinstance(rows[0], list):
            return False
        first, last, dense = rows[0]
        own[p] = dense
        if dense:
            if dense != last - first + 1:
                return False
            spans.append((first, last))
    if not spans or spans[0][0] != 0 or spans[-1][1] != out[0].shape[0] - 1:
        return False  # the slices must tile the gathered tensor
    if len(spans) < 2 and not _own_tokens(own, step_attrs):
        return False
    if not all(a[1] + 1 == b[0] for a, b in zip(spans, spans[1:])):
        return False
    # slices in different rows: equal fingerprints (the same values in each slice) do not refute it
    return disjoint_sum(ins, out[0], known_distinct=len(spans) > 1)


def _own_tokens(rows: dict, step_attrs) -> bool:
    """Each rank's nonzero rows are its own tokens of a DP-split step: a rank holds as many rows
    as the tokens its step ran, the ranks ran different token counts (a DP split, ``dp_tokens``)
    and one of them none."""
    if not step_attrs:
        return False
    tokens = {p: (step_attrs.get(p) or {}).get("tokens") for p in rows}
    if any(not isinstance(n, int) for n in tokens.values()):
        return False
    if not all((step_attrs.get(p) or {}).get("dp_tokens") for p in rows):
        return False
    return tokens == rows and 0 in tokens.values() and len(set(tokens.values())) > 1


def reduction_output(j, pt, exact=True):
    """The values of the latest collective output they carry (up to a view, clone, cast or,
    when ``exact`` is off, a common scale): a sum-reduction's output is post-reduction, a
    gather's output is not."""
    for c, _i, scale in j.links(pt)[0]:  # the latest first
        if c.op in REDUCE_SCATTER or (c.op in REDUCING and not c.sums):
            continue
        if not _scale_ok(j, pt.tref, scale) or (exact and scale != 1.0):
            continue
        if c.op in GATHER and (scale != 1.0 or any(len(c.outs.get(p) or ()) != 1 for p in pt.procs)):
            continue  # a list of gathered slices is not the gathered tensor
        times = f" (times {scale:.4g})" if scale != 1.0 else ""
        if c.op in GATHER:
            return _decide(pt, "replicate" if pt.equal else "divergent", "no-reduction", "gather-output",
                           coll_json(c, pt.procs[0]),
                           _coll_item(c, f"equals the output of {coll_desc(c)} on every rank: gathered, not reduced"))
        if _gathering(c, pt.procs, j.v.step_attrs):
            return _decide(pt, "replicate", "no-reduction", "gathered-by-all-reduce", coll_json(c, pt.procs[0]),
                           _coll_item(c, f"equals the output of {coll_desc(c)}{times}, whose inputs are zero "
                                         f"outside one slice each: a gather, not a reduction"))
        return _decide(pt, "replicate" if pt.equal else "divergent", "post-reduction",
                       "reduction-output", coll_json(c, pt.procs[0]),
                       _coll_item(c, f"equals the output of {coll_desc(c)} on every rank{times}"))
    return None


def _input_links(j, pt, exact):
    """(collective, its inputs as {proc: Observed}, scale) of sum-reductions the point feeds,
    the nearest first, including a list reduce_scatter whose chunks are views of the point."""
    seen = set()
    for c, i, scale in j.links(pt)[1]:
        if c.sums and c.key not in seen and _scale_ok(j, pt.tref, scale) and (scale == 1.0 or not exact):
            seen.add(c.key)
            yield c, {p: c.ins[p][i] for p in pt.procs}, scale
    if exact:
        for c in j.v.after(pt.t_point, REDUCE_SCATTER):
            if c.sums and c.key not in seen and _is_concat_of_inputs(c, pt):
                yield c, {p: pt.obs[p] for p in pt.procs}, 1.0


def reduction_input(j, pt, exact=True):
    """The input of a later sum-reduction: a partial sum it completes (the very input, or,
    when ``exact`` is off, a scaled copy)."""
    for c, ins, scale in _input_links(j, pt, exact):
        if pt.equal and (scale != 1.0 or _reduced_before(j, c, ins)):
            # Equal values summed again: a partial only if they are the very input, not a
            # scaled copy of whole values or the output of an earlier reduction (a double
            # reduction, which that earlier reduction's output reports).
            continue
        times = f" (times {scale:.4g})" if scale != 1.0 else ""
        if c.op not in REDUCE_SCATTER and _gathering(c, pt.procs, j.v.step_attrs):
            return _decide(pt, "shard(0)", "no-reduction", "gather-by-all-reduce-input", coll_json(c, pt.procs[0]),
                           _coll_item(c, f"is the input of {coll_desc(c)}{times} and zero outside its own "
                                         f"slice (the sums of squares add up exactly): the all_reduce gathers"))
        extra = []
        if pt.equal:
            extra.append(item("values", "values equal on every rank, and summed by a reduction: identical "
                                        "shards (e.g. dummy weights), or a double reduction"))
        return _decide(pt, "partial", "pre-reduction", "reduction-input", coll_json(c, pt.procs[0]),
                       _coll_item(c, f"is the input of {coll_desc(c)} on every rank{times}: a partial sum "
                                     f"that this reduction completes"), *extra)
    return None


def _is_concat_of_inputs(c, pt) -> bool:
    """A reduce_scatter over a list of chunks: on every rank the point's fingerprint is the sum
    of the chunks' (the chunks are views of it)."""
    for p in pt.procs:
        parts = c.ins.get(p) or []
        t = pt.obs[p]
        if len(parts) < 2 or any(x.fp is None or x.fp[1] is None for x in parts) or t.fp is None:
            return False
        if sum(x.numel for x in parts) != t.numel:
            return False
        whole = Observed(t.shape, t.dtype, (sum(x.fp[0] for x in parts), sum(x.fp[1] for x in parts)))
        if not fp_equal(whole, t):
            return False
    return True


def _reduced_before(j, c, ins) -> bool:
    """The inputs of collective ``c`` are the output of an earlier sum-reduction."""
    for prev in j.v.before(c.t0, REDUCING - REDUCE_SCATTER):
        outs = {p: prev.outs[p][0] for p in ins if prev.outs.get(p)}
        if prev.sums and prev is not c and linked(outs, ins) == 1.0:
            return True
    return False


def scaled_reduction_output(j, pt):
    """Identity links are tried first everywhere: with equal values on every rank, x and the
    all_reduce of x (N times x) are also "a scaled copy" of each other."""
    return reduction_output(j, pt, exact=False)


def scaled_reduction_input(j, pt):
    return reduction_input(j, pt, exact=False)


def _gather_dim(j, pt, c):
    """Which dimension a gather (or a scatter) puts the ranks' slices along, and why."""
    says = _declared(pt)
    if says and says.startswith("shard("):
        return int(says[6:-1]), f"the DTensor declares {says}"
    for name in ("gather_dim", "scatter_dim", "dim"):
        d = (c.attrs or {}).get(name) if c is not None else None
        if isinstance(d, int):
            return d % max(pt.ndim, 1), f"the collective's {name}={d}"
    hit = j.concat_dim(pt)
    if hit is not None:
        return hit[0], f"their concatenation along dim {hit[0]} appears in this step"
    if c is not None and c.op in REDUCE_SCATTER:
        # the point is the (scattered) output: the input is the larger tensor
        other, what = c.ins.get(pt.procs[0]), "input"
    else:
        other, what = (c.outs.get(pt.procs[0]) if c is not None else None), "output"
    if other and len(other) == 1 and len(other[0].shape) == pt.ndim:
        diff = [d for d in range(pt.ndim) if other[0].shape[d] != pt.tref.shape[d]]
        if len(diff) == 1:
            return diff[0], f"the collective's {what} is larger along dim {diff[0]}"
    return pt.ndim - 1, f"the dimension was not seen; dim {pt.ndim - 1} assumed"


def _slice_of(j, pt, c, reduction, rule, role, piece):
    """``pt`` is a slice per rank, the ``role`` of collective ``c``: sharded along its dim."""
    dim, why = _gather_dim(j, pt, c)
    return _decide(pt, f"shard({dim})", reduction, rule, coll_json(c, pt.procs[0]),
                   _coll_item(c, f"is the {role} of {coll_desc(c)} on every rank: {piece} per rank"),
                   item("dataflow", why))


def gather_input(j, pt):
    for c, _i, scale in j.links(pt)[1]:
        if c.op not in GATHER or scale != 1.0:
            continue
        if pt.equal:
            return None  # every rank sends the same values: nothing to tell from this gather
        return _slice_of(j, pt, c, "no-reduction", "gather-input", "input", "a slice")
    return None


def scatter_output(j, pt):
    if pt.equal:
        return None
    for c, _i, _scale in j.links(pt)[0]:
        if c.op not in REDUCE_SCATTER:
            continue
        return _slice_of(j, pt, c, "post-reduction", "reduce-scatter-output", "output", "a reduced slice")
    return None


def equal_values(j, pt):
    """Values equal on every rank: replicate, unless a declaration says the layer is sharded."""
    if not pt.equal:
        return None
    says = _declared(pt)
    note = item("values", "values equal on every rank: identical shards, e.g. dummy weights")
    if says and says != "replicate":
        pt.items.append(item("declared", f"the DTensor declares {says}"))
        if says == "partial":
            return _decide(pt, "partial", "pre-reduction", "declared-dtensor", None, note)
        return _decide(pt, says, "no-reduction", "declared-dtensor", None, note)
    sem = declared.expected_by_layer(j.layer_attrs.get(pt.module), pt.slot, j.group_size)
    if sem is not None and sem["placement"] in ("shard", "partial"):
        pt.items.append(item("semantics", f"{sem['says']} says {sem['placement']}: the verdict follows the layer"))
        if sem["placement"] == "shard":
            return _decide(pt, f"shard({pt.ndim - 1})", "no-reduction", "layer-semantics", None, note)
        c = next_sum_reduction(j.v, pt)
        extra = [_coll_item(c, f"the next sum-reduction of its size is {coll_desc(c)}")] if c else []
        return _decide(pt, "partial", "pre-reduction" if c else "unknown", "layer-semantics",
                       coll_json(c, pt.procs[0]) if c else None, note, *extra)
    split = _sharded_param(j, pt)
    if split is not None and split[2] == "declared":
        verdict = _from_weight(j, pt, split)
        if verdict is not None:
            verdict.items.append(note)
            return verdict
    if not pt.tref.dtype.startswith(_FLOAT):
        return _decide(pt, "replicate", "no-reduction", "equal-values", None,
                       item("values", "integer values (ids, positions, lengths) equal on every rank"))
    # Computed from a shard that only looks whole (identical shards): the dataflow says so.
    for rule in (lineage_ops, same_values_as_producer, _derived_from_shard_inputs):
        verdict = rule(j, pt)
        if verdict is not None and verdict.placement != "replicate":
            verdict.items.append(note)
            return verdict
    return _decide(pt, "replicate", "no-reduction", "equal-values", None,
                   item("values", "not the output of a sum-reduction: computed locally from whole values"))


def sums_add_up(j, pt):
    ts, tref = pt.ts, pt.tref
    total = sum(t.fp[0] for t in ts)
    for c in j.v.after(pt.t_point, REDUCING - REDUCE_SCATTER):
        if not c.sums:
            continue
        o = c.outs.get(pt.procs[0])
        if o and o[0].numel == tref.numel and o[0].fp is not None and close(
                total, o[0].fp[0], tref.numel, sum(t.fp[1] or 0 for t in ts), tref.dtype):
            return _decide(pt, "partial", "pre-reduction", "sums-add-up", coll_json(c, pt.procs[0]),
                           _coll_item(c, f"per-rank sums add up to the output of {coll_desc(c)} ({total:.6g}): "
                                         f"a partial sum that this reduction completes"))
    return None


def declared_dtensor(j, pt):
    says = _declared(pt)
    if not says:
        return None
    if says == "replicate":
        pt.items.append(item("declared", "the DTensor declares Replicate() -- DISAGREES with values that differ"))
        return None
    pt.items.append(item("declared", f"the DTensor declares {says}, and the values differ across ranks"))
    if says == "partial":
        c = next_sum_reduction(j.v, pt)
        return _decide(pt, "partial", "pre-reduction" if c else "unknown", "declared-dtensor",
                       coll_json(c, pt.procs[0]) if c else None)
    return _decide(pt, says, "no-reduction", "declared-dtensor")


def concatenation(j, pt):
    hit = j.concat_dim(pt)
    if hit is None:
        return None
    dim, key = hit
    where = j.name(key) if key else "a collective's output"
    return _decide(pt, f"shard({dim})", "no-reduction", "concatenation", None,
                   item("concat", f"their concatenation along dim {dim} appears in this step ({where})",
                        point=where))


def lineage_ops(j, pt):
    """Built by recorded ops (split, view, add, cat...) from points judged earlier."""
    hit = dataflow.placement_from_lineage(j, pt)
    if hit is None:
        return None
    placement, ops = hit
    c = next_sum_reduction(j.v, pt) if placement == "partial" else None
    reduction = "pre-reduction" if c else ("unknown" if placement == "partial" else "no-reduction")
    return _decide(pt, placement, reduction, "lineage-ops", coll_json(c, pt.procs[0]) if c else None,
                   item("dataflow", f"built by recorded ops: {ops}"))


def _derived_from_shard_inputs(j, pt):
    """An output of a parameter-free module all of whose floating-point inputs are shards."""
    if not pt.is_output or j.params.get((pt.procs[0], pt.module)):
        return None
    inputs = [(k, vd) for k, vd in j.call_inputs(pt)
              if (j.v.points[k].get(pt.procs[0]) or pt.tref).dtype.startswith(_FLOAT)]
    if not inputs or not all(vd.placement.startswith("shard(") for _, vd in inputs):
        return None
    return derived_from_shard(j, pt)


def _sharded_param(j, pt):
    """(name, local shape, how) of the module's first parameter that is split across ranks:
    declared by a DTensor (``how`` = "declared", with the split dim) or seen as equal shapes with
    different values (``how`` = "values")."""
    if not pt.is_output:
        return None
    per = j.module_params(pt.module, pt.procs)
    if per is None:
        return None
    for i, (name, shape, fp, meta) in enumerate(per[0]):
        d = declared.param_split_dim(meta)
        if d is not None:
            return name, shape, "declared", d
    for i, (name, shape, fp, meta) in enumerate(per[0]):
        others = [x[i] for x in per[1:] if i < len(x)]
        if len(others) != len(per) - 1 or any(o[1] != shape for o in others) or fp is None:
            continue
        ref = Observed(shape, "float32", fp)
        if any(o[2] is not None and not fp_equal(ref, Observed(shape, "float32", o[2])) for o in others):
            return name, shape, "values", None
    return None


def _from_weight(j, pt, split):
    """A module's output from its split weight and its input's placement."""
    name, shape, how, dim = split
    inputs = j.call_inputs(pt)
    first = inputs[0][1] if inputs else None
    obs_in = j.v.points.get(inputs[0][0], {}).get(pt.procs[0]) if inputs else None
    integer_input = obs_in is not None and not obs_in.dtype.startswith(_FLOAT)
    weight = f"{pt.module}.{name} {list(shape)}"
    last = pt.ndim - 1
    if how == "declared" and len(shape) == 2:
        # nn.Linear's weight is [out, in]; an embedding's [vocab, dim] is looked up by its rows.
        split_out = (dim == 0) != integer_input
        text = f"{weight} is a DTensor split along dim {dim}"
    else:
        if first is None:
            return None
        if first.placement == "replicate":
            split_out = not integer_input
        elif first.placement.startswith("shard(") and int(first.placement[6:-1]) == len(obs_in.shape) - 1:
            split_out = False
        else:
            return None
        text = f"{weight} has equal shapes and different values across ranks: each rank holds a slice"
    in_text = f"its input {j.name(inputs[0][0])} is {first.placement}" if first else "its input was not seen"
    if split_out:
        return _decide(pt, f"shard({last})", "no-reduction", "sharded-weight", None,
                       item("weights", text, param=f"{pt.module}.{name}"),
                       item("dataflow", f"{in_text}, the weight is split along its output dimension: a shard"))
    c = next_sum_reduction(j.v, pt)
    return _decide(pt, "partial", "pre-reduction" if c else "unknown", "sharded-weight",
                   coll_json(c, pt.procs[0]) if c else None,
                   item("weights", text, param=f"{pt.module}.{name}"),
                   item("dataflow", f"{in_text}, the weight is split along its input (contracted) dimension: "
                                    f"a partial sum"))


def sharded_weight(j, pt):
    split = _sharded_param(j, pt)
    return _from_weight(j, pt, split) if split is not None else None


def same_values_as_producer(j, pt):
    """Carrying, on every rank, the values of a point judged earlier: an input that is an
    earlier output, an output that passes its call's input through, or one that returns a
    child's output."""
    cands = [k for k, _ in j.call_inputs(pt)] if pt.is_output else []
    hit = j.by_fp0.get((pt.tref.fp, pt.tref.numel))
    if hit is not None:
        cands.append(hit)
    for prod in cands:
        pv = j.done.get(prod)
        if pv is None or pv.placement in ("divergent", "unknown"):
            continue
        src = {p: j.v.points[prod][p] for p in pt.procs if p in j.v.points[prod]}
        if len(src) < len(pt.procs) or linked(src, pt.obs) != 1.0:
            continue
        return _decide(pt, pv.placement, pv.reduction, "same-values", pv.collective,
                       item("dataflow", f"the same values as {j.name(prod)} on every rank",
                            point=j.name(prod)))
    return None


def derived_from_shard(j, pt):
    """Computed locally from a shard: an output from its call's sharded input, or a tensor
    inside a call from the latest shard before it in that call."""
    src = None
    if pt.is_output:
        for k, vd in j.call_inputs(pt):
            if vd.placement.startswith("shard("):
                src = k
                break
    else:
        src = j.enclosing_shard(pt)
    if src is None:
        return None
    placement = j.done[src].placement
    d = int(placement[6:-1])
    src_t = j.v.points[src].get(pt.procs[0])
    same_rank = src_t is not None and len(src_t.shape) == pt.ndim and d < pt.ndim
    dim = d if same_rank else pt.ndim - 1
    return _decide(pt, f"shard({dim})", "no-reduction", "derived-from-shard", None,
                   item("dataflow", f"derived locally from {j.name(src)}, {placement}"
                                    + ("" if same_rank else f" (another rank of tensor: dim {dim} assumed)"),
                        point=j.name(src)))


def divergent(j, pt):
    pt.items.append(item("values", "no partial-sum, gather, concatenation or sharded-weight evidence: "
                                   "the ranks disagree"))
    return _decide(pt, "divergent", "unknown", "divergent")


def _values(j, pt):
    """Not a rule: says whether the values are equal on every rank (``pt.equal``)."""
    pt.equal = all_equal(pt.ts)
    if pt.equal:
        pt.items.append(item("values", f"values equal on every rank ({_fmt_fp(pt.tref)})"))
    else:
        pt.items.append(item("values", "values differ across ranks: " + "; ".join(
            f"rank {j.rank_of[p]} {_fmt_fp(pt.obs[p])}" for p in pt.procs)))
    return None


RULES = (experts.expert_parallel_local, group_ranks, shapes, fingerprints, _values, reduction_output,
         scatter_output, reduction_input, gather_input, scaled_reduction_output, scaled_reduction_input,
         experts.expert_tp_slice, equal_values, sums_add_up, declared_dtensor, experts.declared_partial,
         concatenation, lineage_ops, sharded_weight, same_values_as_producer, derived_from_shard, divergent)
