"""The placement rules, one per kind of evidence, tried in this order for every point.

A rule either decides (returns a ``Verdict`` naming itself and what it saw) or adds what it
observed to the point's items and passes. Strongest first:

- the TP group's ranks: fewer readable than the group has make ``unknown``;
- shapes across ranks (an uneven shard);
- fingerprints: without them, ``unknown``; where a rank's values are not finite (-inf padding,
  uninitialised memory) their sums say nothing, and only what built the tensor places it (a
  split weight, recorded ops, a producer's values where finite). Not a shard it merely seems to
  derive from with no op recorded between: a buffer gathered by a collective (SGLang's MoE
  input under DP attention, its padding rows uninitialised) looks derived from the shard it
  gathered;
- collectives linked by fingerprint on every rank (identity, or one common scale, so a view,
  reshape, clone, cast or scaling in between does not hide the link): the output of a
  sum-reduction is post-reduction, its input a partial sum (even when the ranks' partial sums
  happen to be equal), the input of an all_gather a shard, the output of a reduce_scatter a
  reduced shard, the output of an all_to_all each rank's rows (shard(0), no reduction); the
  output of a max, min or product all_reduce is whole but no reduction's in the contract's
  sense. Collective linkage outranks value equality. An all_reduce of zero-padded slices
  (their sums of squares add up exactly) is a gather, not a reduction;
- values equal on every rank: replicate, unless a declaration (a DTensor's placements, a
  framework's layer class) says the layer is sharded, which equal values cannot refute
  (identical shards, e.g. dummy weights);
- values that differ: per-rank sums adding up to a later reduction's output (one number,
  which a replicated input times a weight split along its output dim outranks), a DTensor's
  declared placement, a concatenation seen in the step, the module's parameters with its
  input's placement (a replicated input and a weight split along its output dimension give a
  shard; an input sharded along the contracted dimension and a weight split along its input
  dimension give a partial sum), the same values as a producer, or a local derivation of a
  shard; otherwise the ranks disagree (``divergent``).

Each family of rules has its own module (as ``experts.py`` holds those of mixture-of-experts
layers): ``rules_reductions`` (collectives linked by fingerprint, per-rank sums adding up),
``rules_declared`` (equal values, DTensor declarations), ``rules_weights`` (a module's split
parameters), ``rules_dataflow`` (concatenations, recorded ops, producers, derivations of a shard).
This module holds the checks every point passes first (ranks, shapes, fingerprints, equal
values), the last rule (``divergent``) and ``RULES``, the order they are tried in.
"""

from __future__ import annotations

import collections

from tensor_trace.exporters.analysis import (declared, experts, rules_dataflow, rules_declared, rules_reductions,
                                             rules_weights)
from tensor_trace.exporters.analysis.evidence import coll_item, decide, item
from tensor_trace.exporters.analysis.step_view import REDUCE_SCATTER, coll_desc, coll_json
from tensor_trace.exporters.analysis.tolerance import FLOAT_DTYPES, Observed, all_equal, linked


def _fmt_fp(t) -> str:
    if t.fp is None:
        return "no fingerprint"
    s, q = t.fp
    return f"sum {s:.6g}, sumsq {q:.6g}" if q is not None else f"sum {s:.6g}"


def _ranks_text(j, pt) -> str:
    return ", ".join(f"rank {j.rank_of[p]} {list(pt.obs[p].shape)}" for p in pt.procs)


def group_ranks(j, pt):
    if j.group_size == 1:
        return decide(pt, "replicate", "no-reduction", "one-rank-group",
                      None, item("shape", "one rank in its TP group: every tensor is whole"))
    if len(pt.procs) < j.group_size:
        verdict = _gather_destination(j, pt)
        if verdict is not None:
            return verdict
        verdict = j.missing(pt)
        # (undeclared pipeline stages: each stage's modules run on its TP group's ranks alone)
        hint = _smaller_reduction_groups(j)
        if hint is not None:
            verdict.items.append(hint)
        return verdict
    return None


def _gather_destination(j, pt):
    """A point seen only on the ranks a ``gather`` delivered to (vLLM's logits processor gathers
    the vocab shards to rank 0; the others get None), or the same values carried on: its
    placement across the group is unknown (the other ranks hold nothing), but nothing reduced
    it. Likewise the output of a ``reduce`` of a sum on its destination (the others get None):
    post-reduction where it was delivered."""
    seen = f"seen on ranks {j.ranks(pt.procs)} only, of a TP group of {j.group_size}"
    for c in j.call_collectives(pt):
        if c.op == "gather":
            return decide(pt, "unknown", "no-reduction", "gather-destination", coll_json(c, pt.procs[0]),
                          item("missing", seen),
                          coll_item(c, f"its call gathered the ranks' parts with {coll_desc(c)}: whole where it "
                                       "was delivered, absent on the other ranks, not reduced"))
        if c.op == "reduce" and c.sums and _holds_output(c, pt):
            return decide(pt, "unknown", "post-reduction", "reduce-destination", coll_json(c, pt.procs[0]),
                          item("missing", seen),
                          coll_item(c, f"equals the output of {coll_desc(c)} where it was delivered; absent on "
                                       "the other ranks"))
    hit = j.producer(pt.tref)
    prev = j.done.get(hit) if hit is not None else None
    if prev is not None and prev.rule in _DESTINATION_RULES and set(j.v.points[hit]) == set(pt.procs):
        return decide(pt, "unknown", prev.reduction, prev.rule, prev.collective, item("missing", seen),
                      item("dataflow", f"the same values as {j.name(hit)}, delivered to these ranks", point=j.name(hit)))
    return None


_DESTINATION_RULES = ("gather-destination", "reduce-destination")


def _holds_output(c, pt) -> bool:
    """Whether ``pt`` holds collective ``c``'s output, as it is, on every rank it was seen on."""
    outs = {p: c.outs[p][0] for p in pt.procs if c.outs.get(p)}
    return len(outs) == len(pt.procs) and linked(outs, pt.obs) == 1.0


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
                    return decide(pt, f"shard({diff[0]})", "post-reduction", "reduce-scatter-output",
                                  coll_json(c, pt.procs[0]),
                                  coll_item(c, f"is the output of {coll_desc(c)} on every rank: a reduced slice per rank"))
            return decide(pt, f"shard({diff[0]})", "no-reduction", "uneven-shard")
    pt.items.append(item("shape", f"shapes differ in more than one dimension: {_ranks_text(j, pt)}"))
    return decide(pt, "divergent", "unknown", "shapes-disagree")


NONFINITE_RULE = "non-finite-values"


def fingerprints(j, pt):
    if all(t.fp is not None for t in pt.ts):
        return None
    bad = [p for p, t in zip(pt.procs, pt.ts) if t.nonfinite]
    if bad:
        pt.items.append(item("values", f"non-finite values (NaN or inf) on ranks {j.ranks(bad)}: "
                                       "their sums say nothing (an attention mask's -inf, a padded vocabulary's masked "
                                       "logits, uninitialised padding)"))
        verdict = _equal_nonfinite(j, pt)
        if verdict is not None:
            return verdict
        # What built the tensor still places it (a vocab-parallel head whose padded columns
        # are -inf is a shard by its weight): the rules that read no values of the point itself.
        for rule in STRUCTURAL_RULES:
            verdict = rule(j, pt)
            # (ops from a source that is itself unknown place nothing: SGLang's MoE output
            # under DP attention, viewed from its experts' garbage padding rows)
            if verdict is not None and verdict.placement not in ("unknown", "divergent"):
                return verdict
        pt.items.append(item("values", "no weight or recorded op places it: placement needs values"))
        return decide(pt, "unknown", "unknown", NONFINITE_RULE)
    kinds = sorted({(t.meta or {}).get("kind") for t in pt.ts if t.fp is None} - {None})
    why = (f"no fingerprint ({', '.join(kinds)})" if kinds else
           "no fingerprints for these values (recorded with --no-fingerprint, in a step that "
           "--fingerprint-every skipped, or in a CUDA-graph capture)")
    says = declared.dtensor_placement_at(pt)
    extra = [item("declared", f"the DTensor declares {says} (not checked against values)")] if says else []
    pt.items.append(item("values", why + ": placement needs them"))
    return decide(pt, "unknown", "unknown", "no-fingerprint", None, *extra)


def _equal_nonfinite(j, pt):
    """A tensor with non-finite values on every rank whose finite values and counts of +inf,
    -inf and NaN the tracer recorded (NONFINITE_FINGERPRINTS: CPU tensors) and that are the same
    on every rank: an attention mask of -inf built alike everywhere is ``replicate``. Counts
    that differ, or finite values that do, leave it to the other rules."""
    nfs = [t.nf for t in pt.ts]
    if any(nf is None for nf in nfs) or len({t.shape for t in pt.ts}) != 1 or len({nf[2:] for nf in nfs}) != 1:
        return None
    finite = [Observed(t.shape, t.dtype, t.nf[:2]) for t in pt.ts]
    if not all_equal(finite):
        return None
    s, q, pos, neg, nan = nfs[0]
    counts = ", ".join(f"{n} {what}" for n, what in ((neg, "-inf"), (pos, "+inf"), (nan, "NaN")) if n)
    return decide(pt, "replicate", "no-reduction", "equal-values", None,
                  item("values", f"equal on every rank: the same non-finite values ({counts}) and finite values "
                                 f"equal (sum {s:.6g}, sumsq {q:.6g})"))


def note_undeclared_groups(j, verdict) -> None:
    """Add ``_smaller_reduction_groups``'s hint to a divergent verdict another rule made (the
    output of a reduction of each undeclared TP group's own: divergent, post-reduction)."""
    hint = _smaller_reduction_groups(j)
    if hint is not None and hint not in verdict.items:
        verdict.items.append(hint)


def divergent(j, pt):
    pt.items.append(item("values", "no partial-sum, gather, concatenation or sharded-weight evidence: "
                                   "the ranks disagree"))
    hint = _smaller_reduction_groups(j)
    if hint is not None:
        pt.items.append(hint)
    c = rules_dataflow.combined_by(j, pt)
    if c is not None:
        # each rank's own by design (a vocab slice's max, a buffer only the source fills):
        # never sum-reduced, and a collective that is no sum makes them one
        what = "sends the source rank's" if c.op == "broadcast" else "combines them by a reduction that is no sum"
        return decide(pt, "divergent", "no-reduction", "divergent", coll_json(c, pt.procs[0]),
                      coll_item(c, f"the input of {coll_desc(c)} on every rank, which {what}: per-rank "
                                   "values by design"))
    return decide(pt, "divergent", "unknown", "divergent")


def _smaller_reduction_groups(j):
    """Where the group judged is the world by default but the step's sum-reductions ran in
    smaller groups that partition it (data-parallel replicas of a tensor-parallel model whose
    groups were made with ``new_group`` and never declared), the ranks differ because they hold
    different data: say which groups those are (the most reducing ones first, as TP groups
    reduce in every layer and a DP metric once) and how to declare them."""
    ranks = set(j.ranks(j.v.procs))
    uses = collections.Counter(g for c in j.v.colls.values() if c.sums
                               for g in _groups_of(c) if g and len(g) < len(ranks))
    chosen, covered = [], set()
    for g, _n in sorted(uses.items(), key=lambda kv: (-kv[1], kv[0])):
        if set(g) <= ranks and not covered & set(g):
            chosen.append(list(g))
            covered |= set(g)
    if len(chosen) < 2 or covered != ranks:
        return None
    return item("groups", f"this step's sum-reductions ran mostly in groups {', '.join(map(str, sorted(chosen)))}, "
                          f"none over all of {sorted(ranks)}: if those are the tensor-parallel groups (data-parallel "
                          "replicas differ by their data), declare each with tensor_trace.tracer.set_tp_group(group) "
                          "in its processes; until then the TP group is the world")


def _groups_of(c) -> set:
    """The groups a collective ran in, as sorted rank tuples: one per rank where it stands for a
    family of groups (step_view._family_keys)."""
    return {tuple(sorted(g)) for g in (c.groups_of or {}).values()} or {tuple(sorted(c.group_ranks or ()))}


def _values(j, pt):
    """Not a rule: says whether the values are equal on every rank (``pt.equal``)."""
    pt.equal = all_equal(pt.ts)
    why = _too_alike(j, pt) if pt.equal else None
    if why is not None:
        pt.equal = False
        j.alike.append(pt.key)
        pt.items.append(item("values", f"values read equal on every rank ({_fmt_fp(pt.tref)}), not quite, "
                                       f"but {why}: fingerprints too alike to tell apart (a softmax's rows all "
                                       "sum to 1), taken as values that differ"))
    elif pt.equal:
        pt.items.append(item("values", f"values equal on every rank ({_fmt_fp(pt.tref)})"))
    else:
        pt.items.append(item("values", "values differ across ranks: " + "; ".join(
            f"rank {j.rank_of[p]} {_fmt_fp(pt.obs[p])}" for p in pt.procs)))
    return None


def _too_alike(j, pt) -> str | None:
    """Why values that read equal on every rank, within the tolerance but further apart than
    summing noise (``_apart``), are still values that differ, or None. What a call computes locally (no collective inside it)
    from an input of the same shape whose values differ across ranks differs too, unless it
    throws them away: a softmax of each rank's attention scores, near-uniform in a small
    model, reads as equal (every row sums to 1 exactly, and the sums of squares differ little).
    A tensor with the same values as such an output is as alike. Values the same bit for bit
    (a constant, a mask of the input's shape) are equal."""
    if not pt.tref.dtype.startswith(FLOAT_DTYPES) or len(pt.tref.shape) < 2:
        return None
    if not _apart(pt.ts):
        return None  # the same, or as near as two ways of summing the same values get
    for key in j.alike:
        if linked(j.v.points[key], pt.obs) == 1.0:
            return f"they are the values of {j.name(key)}, which are too"
    if not pt.is_output or j.links(pt)[0]:
        return None  # (a collective's output: its own summation order can differ by rank)
    # Computed inside its call from a shard its own modules made, whose ranks differ (eager
    # attention's weights from each rank's q and k heads, returned beside the all_reduced
    # output): what is computed from whole values after a reduction is the same bit for bit.
    # Not where a collective inside the call returned a tensor of its size: values carried on
    # from a reduction (a layer's residual sum of its MoE's reduce_scatter output) need not be
    # the same bit for bit, as each rank's slice is summed in its own order.
    # And only where the values hold a rank's part of that shard's dim (the heads of q and k),
    # not more (logits gathered from each rank's part: the same in every rank's copy, though
    # their last bits may differ).
    inputs = j.call_inputs(pt)
    inner = j.inner_shard(pt)
    inner_t = j.v.points[inner].get(pt.procs[0]) if inner is not None else None
    if inner_t is not None and tuple(inner_t.shape) != tuple(pt.tref.shape) \
            and rules_dataflow.inner_shard_dim(inner_t.shape, int(j.done[inner].placement[6:-1]),
                                               pt.tref.shape) is not None \
            and not rules_dataflow.equal_on_ranks(j, inner, pt.procs) \
            and not _collective_inside(j, pt, numel=pt.tref.numel):
        return f"its call computed them where {j.name(inner)}, a shard made inside it, differs across ranks"
    if not inputs or _collective_inside(j, pt):
        return None
    for key, _verdict in inputs:
        obs = j.v.points[key]
        ts = [obs.get(p) for p in pt.procs]
        if any(t is None or t.fp is None for t in ts) or not ts[0].dtype.startswith(FLOAT_DTYPES):
            continue
        if tuple(ts[0].shape) == tuple(pt.tref.shape) and not all_equal(ts):
            return f"its call's input {j.name(key)}, of its shape, differs across ranks"
    return None


def _apart(ts) -> bool:
    """Whether the ranks' sums of squares differ by more than two ways of summing the same
    values do: a rank whose compiled fingerprint reader was not loaded yet sums with numpy's
    BLAS, another with the extension's float32 lanes (their sums of squares differ by up to
    about 1e-7 of them, 1e-6 at a million elements); near-uniform attention probabilities
    made from different scores differ by 1e-6 and more."""
    qs = [t.fp[1] for t in ts if t.fp is not None and t.fp[1] is not None]
    if len(qs) < 2 or max(qs) <= 0.0:
        return False
    n = ts[0].numel
    return (max(qs) - min(qs)) / max(qs) > 4e-7 * max(1.0, n / 65536.0)


def _collective_inside(j, pt, numel=None) -> bool:
    """Whether any collective ran while the call of output ``pt`` did (its own or a child's:
    a module whose child all_reduces its partial input returns whole values); with ``numel``,
    one with an output of that many elements."""
    at = j.v.times.get(pt.key)
    start = j.v.span_t0.get(at[1]) if at is not None else None
    if start is None:
        return True
    end = at[0]
    p0 = pt.procs[0]
    return any(start <= c.t0 <= end and (numel is None or any(o.numel == numel for o in c.outs.get(p0) or ()))
               for c in j.v.coll_list)


# Rules that place a point from what built it (its module's split weight and its inputs'
# placements, recorded ops, a producer's values where finite), reading no sums of the point's
# non-finite values.
STRUCTURAL_RULES = (rules_weights.sharded_weight, rules_dataflow.lineage_ops,
                    rules_dataflow.same_values_where_finite)

RULES = (experts.expert_parallel_local, group_ranks, shapes, fingerprints, _values,
         rules_reductions.reduction_output, rules_reductions.scatter_output, rules_reductions.reduction_input,
         rules_reductions.gather_input, rules_reductions.scaled_reduction_output,
         rules_reductions.scaled_reduction_input, rules_reductions.carried_reduction_output,
         experts.expert_tp_slice, rules_declared.equal_values,
         rules_reductions.sums_add_up, rules_declared.declared_dtensor, experts.declared_partial,
         rules_dataflow.concatenation, rules_dataflow.lineage_ops, rules_weights.sharded_weight,
         rules_weights.passed_parameter, rules_dataflow.same_values_as_producer, rules_dataflow.derived_from_shard,
         rules_dataflow.derived_from_inner_shard, rules_dataflow.compiled_residual, experts.expert_parallel_routing,
         divergent)
