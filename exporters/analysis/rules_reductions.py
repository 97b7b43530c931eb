"""Placement rules from collectives linked by fingerprint on every rank (identity, or one
common scale, so a view, reshape, clone, cast or scaling in between does not hide the link).

The output of a sum-reduction is post-reduction, its input a partial sum (even when the ranks'
partial sums happen to be equal), the input of an all_gather a shard, the output of a
reduce_scatter a reduced shard. Collective linkage outranks value equality. An all_reduce of
zero-padded slices (their sums of squares add up exactly) is a gather, not a reduction. Per-rank
sums that add up to a later reduction's output are a partial sum too. ``rules.RULES`` says where
each is tried.
"""

from __future__ import annotations

from tensor_trace.exporters.analysis import dataflow, declared, rules_weights
from tensor_trace.exporters.analysis.evidence import ONE_ROW_SCALE, UNCONFIRMED_SCALE, coll_item, decide, item
from tensor_trace.exporters.analysis.step_view import EXCHANGE, GATHER, REDUCE_SCATTER, REDUCING, coll_desc, coll_json
from tensor_trace.exporters.analysis.tolerance import Observed, close, disjoint_sum, fp_equal, linked, unconfirmed_scale


def _scale_ok(j, t, scale) -> bool:
    """A link through a common scale factor is evidence unless the tensor has a single row: a
    norm over the last dimension scales each row by its own factor, so a one-row tensor's norm
    looks like a scaled copy. There only averaging over the group (1/N, N) and a negation (a
    loss, minus a log-probability: ``loss_parallel``'s per-token loss of a 1-D target) count,
    factors no norm gives but by chance."""
    if scale is None:
        return False
    if scale == 1.0 or (t.shape and t.numel > t.shape[-1]):
        return True
    n = j.group_size
    return any(abs(scale - k) <= 1e-3 * abs(k) for k in (n, 1.0 / n, -1.0))


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


def _lookup(j, c, procs) -> bool:
    """Whether ``c`` is issued by a vocab-parallel lookup: a module handed integer ids that owns
    a 2-D weight split across ranks as wide as the reduced rows (``[vocab / n, hidden]``). Its
    all_reduce sums each rank's masked rows; when a step's few tokens fall one range per rank in
    rank order (two decode tokens, one in each half of the vocabulary), the rows tile like a
    gather's, but it is the lookup's reduction, the same in every step."""
    ins = c.ins.get(procs[0])
    if not c.module or not ins or not ins[0].shape:
        return False
    if not any(k[0] == c.module and k[2].startswith("input") and (t := obs.get(procs[0])) is not None
               and t.dtype.startswith(("int", "uint")) for k, obs in j.v.points.items()):
        return False
    per = j.module_params(c.module, procs)
    if not per:
        return False
    for i, (name, shape, fp, meta) in enumerate(per[0]):
        if len(shape) != 2 or shape[1] != ins[0].shape[-1] or i >= min(len(x) for x in per):
            continue
        if declared.param_split_dim(meta) == 0 or any(
                x[i][2] is not None and fp is not None and x[i][2] != fp for x in per[1:]):
            return True
    return False


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


def _earlier_verdict(j, pt):
    """The verdict of the point that output ``pt``'s very values earlier in the step (its first
    producer), or None."""
    hit = j.producer(pt.tref)
    return j.done.get(hit) if hit is not None and hit != pt.key else None


def reduction_output(j, pt, exact=True):
    """The values of the latest collective output they carry (up to a view, clone, cast or,
    when ``exact`` is off, a common scale): a sum-reduction's output is post-reduction, a
    gather's output is not."""
    for c, _i, scale in j.links(pt)[0]:  # the latest first
        if c.op in REDUCE_SCATTER:
            if pt.equal and scale == 1.0 and c.sums:
                # each rank's slice of rows that were the same on every rank (Megatron-Core's
                # MoE all-gather dispatcher gathers the TP ranks' copies of the tokens, and its
                # combine reduce-scatters them back): a reduced slice, the same everywhere
                return decide(pt, "replicate", "post-reduction", "reduce-scatter-output", coll_json(c, pt.procs[0]),
                              coll_item(c, f"equals the output of {coll_desc(c)} on every rank: a reduced slice, "
                                           "the same on every rank"))
            continue
        if exact and scale != 1.0:
            continue
        if not _scale_ok(j, pt.tref, scale):
            if scale is not None and c.sums:
                note = item(ONE_ROW_SCALE, f"a scaled copy (times {scale:.4g}) of the output of {coll_desc(c)}, "
                                           "but of one row, which a norm of that row also is: not counted here")
                if note not in pt.items:
                    pt.items.append(note)
            continue
        if scale != 1.0:
            # a common scale leaves one test of the sums (a bfloat16 tolerance passes by chance
            # now and then): the point that held these very values earlier says what they are
            prev = _earlier_verdict(j, pt)
            if prev is not None and prev.reduction != "post-reduction":
                note = coll_item(c, f"a scaled copy (times {scale:.4g}) of the output of {coll_desc(c)} by its sums, "
                                    f"but {j.name(j.producer(pt.tref))} held these very values earlier, "
                                    f"{prev.placement} / {prev.reduction}: not counted here")
                if note not in pt.items:
                    pt.items.append(note)
                continue
        if c.op in REDUCING and not c.sums:
            if scale != 1.0:
                continue
            # max, min, product: every rank gets the whole result, and it is no partial sum's
            # completion, so not post-reduction (which the contract keeps for sums)
            return decide(pt, "replicate" if pt.equal else "divergent", "no-reduction", "non-sum-reduction-output",
                          coll_json(c, pt.procs[0]),
                          coll_item(c, f"equals the output of {coll_desc(c)} on every rank: the same result on "
                                       f"each rank, of a reduction that is not a sum"))
        if c.op in (GATHER | EXCHANGE) and (scale != 1.0 or any(len(c.outs.get(p) or ()) != 1 for p in pt.procs)):
            continue  # a list of gathered slices is not the gathered tensor
        if c.op in EXCHANGE:
            # all_to_all_single puts the pieces the ranks sent along dim 0: each rank holds its
            # own rows of what was exchanged (an expert's tokens), not a sum
            return decide(pt, "replicate" if pt.equal else "shard(0)", "no-reduction", "exchange-output",
                          coll_json(c, pt.procs[0]),
                          coll_item(c, f"equals the output of {coll_desc(c)} on every rank: the rows the ranks "
                                       f"sent it, exchanged along dim 0, not reduced"))
        times = f" (times {scale:.4g})" if scale != 1.0 else ""
        if c.op in GATHER:
            return decide(pt, "replicate" if pt.equal else "divergent", "no-reduction", "gather-output",
                          coll_json(c, pt.procs[0]),
                          coll_item(c, f"equals the output of {coll_desc(c)} on every rank: gathered, not reduced"))
        if _gathering(c, pt.procs, j.v.step_attrs) and not _lookup(j, c, pt.procs):
            return decide(pt, "replicate", "no-reduction", "gathered-by-all-reduce", coll_json(c, pt.procs[0]),
                          coll_item(c, f"equals the output of {coll_desc(c)}{times}, whose inputs are zero "
                                       f"outside one slice each: a gather, not a reduction"))
        summed = dataflow.built_by_sum(j, pt)
        if summed:
            note = coll_item(c, f"a sum ({summed}), not the output of {coll_desc(c)}{times} carried on, "
                                "though its values equal it")
            if note not in pt.items:  # (asked again for a scaled link)
                pt.items.append(note)
            return None
        return decide(pt, "replicate" if pt.equal else "divergent", "post-reduction",
                      "reduction-output", coll_json(c, pt.procs[0]),
                      coll_item(c, f"equals the output of {coll_desc(c)} on every rank{times}"))
    if not exact:
        _note_unconfirmed_scale(j, pt)
    return None


def _note_unconfirmed_scale(j, pt) -> None:
    """Say where the point's sums of squares fit a scaled copy of a sum-reduction's output
    whose sums are too near zero to confirm it (a bf16 embedding times a multiplier whose token
    sums cancel): this step cannot tell, and does not outvote one that can (verdicts.vote)."""
    for c in j.v.before(pt.t_point + 1, REDUCING):
        if not c.sums or c.op in REDUCE_SCATTER:
            continue
        outs = {p: c.outs[p][0] for p in pt.procs if c.outs.get(p) and len(c.outs[p]) == 1}
        if len(outs) < len(pt.procs) or outs[pt.procs[0]].numel != pt.tref.numel:
            continue
        scale = unconfirmed_scale(outs, pt.obs)
        if scale is not None:
            pt.items.append(item(UNCONFIRMED_SCALE, f"its sums of squares fit the output of {coll_desc(c)} times "
                                                    f"{scale:.4g}, but its sums are too near zero to confirm it"))
            return


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
        if c.op not in REDUCE_SCATTER and _gathering(c, pt.procs, j.v.step_attrs) and not _lookup(j, c, pt.procs):
            return decide(pt, "shard(0)", "no-reduction", "gather-by-all-reduce-input", coll_json(c, pt.procs[0]),
                          coll_item(c, f"is the input of {coll_desc(c)}{times} and zero outside its own "
                                       f"slice (the sums of squares add up exactly): the all_reduce gathers"))
        extra = []
        if pt.equal:
            extra.append(item("values", "values equal on every rank, and summed by a reduction: identical "
                                        "shards (e.g. dummy weights), or a double reduction"))
        return decide(pt, "partial", "pre-reduction", "reduction-input", coll_json(c, pt.procs[0]),
                      coll_item(c, f"is the input of {coll_desc(c)} on every rank{times}: a partial sum "
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


def carried_reduction_output(j, pt):
    """A tensor the recorded ops built from a point judged post-reduction by views, casts and
    scaling by numbers alone: post-reduction too, which the sums cannot always confirm (a
    residual multiplier times an attention's reduced output, with dummy weights' sums near
    zero)."""
    hit = dataflow.carried_from(j, pt)
    if hit is None:
        return None
    key, ops = hit
    src = j.done.get(key)
    if src is None or src.reduction != "post-reduction" or (src.placement == "replicate" and not pt.equal):
        return None
    return decide(pt, src.placement, "post-reduction", "reduction-output", src.collective,
                  item("dataflow", f"the output of {j.name(key)} ({src.placement}, post-reduction) carried on by "
                                   f"recorded ops: {', '.join(reversed(ops))}", point=j.name(key)))


def scaled_reduction_input(j, pt):
    return reduction_input(j, pt, exact=False)


def _gather_dim(j, pt, c):
    """Which dimension a gather (or a scatter) puts the ranks' slices along, and why."""
    says = declared.dtensor_placement_at(pt)
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
        moved = _moved_dim(pt.tref.shape, other[0].shape, len(c.group_ranks) if c is not None else 0)
        if moved is not None:
            return moved, (f"the collective's {what} {list(other[0].shape)} is its dims moved, one of them "
                           f"{len(c.group_ranks)} times larger: dim {moved} here")
    return pt.ndim - 1, f"the dimension was not seen; dim {pt.ndim - 1} assumed"


def _moved_dim(shape, larger, n: int):
    """The dim of ``shape`` that, ``n`` times larger, makes ``larger``'s sizes in another order,
    where exactly one does (a collective's tensor with its dims moved: spmd_types moves the
    sequence dim to the front for reduce_scatter_tensor, which scatters dim 0, and back)."""
    if n < 2:
        return None
    want = sorted(larger)
    hits = [d for d in range(len(shape))
            if sorted(list(shape[:d]) + [shape[d] * n] + list(shape[d + 1:])) == want]
    return hits[0] if len(hits) == 1 else None


def _slice_of(j, pt, c, reduction, rule, role, piece):
    """``pt`` is a slice per rank, the ``role`` of collective ``c``: sharded along its dim."""
    dim, why = _gather_dim(j, pt, c)
    return decide(pt, f"shard({dim})", reduction, rule, coll_json(c, pt.procs[0]),
                  coll_item(c, f"is the {role} of {coll_desc(c)} on every rank: {piece} per rank"),
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


def sums_add_up(j, pt):
    ts, tref = pt.ts, pt.tref
    total = sum(t.fp[0] for t in ts)
    for c in j.v.after(pt.t_point, REDUCING - REDUCE_SCATTER):
        if not c.sums:
            continue
        o = c.outs.get(pt.procs[0])
        if o and o[0].numel == tref.numel and o[0].fp is not None and close(
                total, o[0].fp[0], tref.numel, sum(t.fp[1] or 0 for t in ts), tref.dtype):
            # One sum that matches is a single number's coincidence, which the layer's weights
            # outrank: a replicated input times a weight split along its output dim is a shard.
            by_weight = rules_weights.sharded_weight(j, pt)
            if by_weight is not None and by_weight.placement.startswith("shard("):
                by_weight.items.append(coll_item(c, f"per-rank sums add up to the output of {coll_desc(c)} "
                                                    f"({total:.6g}), a single number: the weights outrank it"))
                return by_weight
            # nor these very values where an earlier point of the step held them as a shard
            # (a column-parallel output handed to the activation): its verdict carries on
            prev = _earlier_verdict(j, pt)
            if prev is not None and prev.placement.startswith("shard("):
                pt.items.append(coll_item(c, f"per-rank sums add up to the output of {coll_desc(c)} "
                                             f"({total:.6g}), a single number: {j.name(j.producer(tref))}, "
                                             f"the same values, is {prev.placement}"))
                return None
            return decide(pt, "partial", "pre-reduction", "sums-add-up", coll_json(c, pt.procs[0]),
                          coll_item(c, f"per-rank sums add up to the output of {coll_desc(c)} ({total:.6g}): "
                                       f"a partial sum that this reduction completes"))
    return None
