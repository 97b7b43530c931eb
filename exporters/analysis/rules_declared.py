"""Placement rules where values and declarations meet: values equal on every rank are
replicate unless a declaration (a DTensor's placements, a framework's layer class, a weight a
DTensor declares split) or the step's dataflow says the layer is sharded, which equal values
cannot refute (identical shards, e.g. dummy weights); values that differ take a DTensor's declared
placement (a declared Replicate() is reported as a disagreement and decides nothing).
"""

from __future__ import annotations

from tensor_trace.exporters.analysis import declared, rules_dataflow, rules_weights
from tensor_trace.exporters.analysis.evidence import coll_item, decide, item
from tensor_trace.exporters.analysis.step_view import BROADCAST, REDUCING, coll_desc, coll_json, next_sum_reduction
from tensor_trace.exporters.analysis.tolerance import FLOAT_DTYPES, fp_equal, linked


def equal_values(j, pt):
    """Values equal on every rank: replicate, unless a declaration says the layer is sharded."""
    if not pt.equal:
        return None
    verdict = _equal_values(j, pt)
    if verdict.placement.startswith("shard("):
        j.identical_shards = True
    return verdict


def _broadcast_of(j, pt):
    """The latest broadcast issued by ``pt`` whose output ``pt`` holds on every rank, or None."""
    for c in j.v.before(pt.t_point + 1, BROADCAST, limit=4):
        outs = {p: c.outs[p][0] for p in pt.procs if c.outs.get(p)}
        if len(outs) == len(pt.procs) and linked(outs, pt.obs) == 1.0:
            return c
    return None


def _reduced_before_broadcast(j, c):
    """The sum-reduction whose output broadcast ``c``'s source rank sent (its input there equals
    its output), or None."""
    src = [p for p in c.ins if c.ins[p] and c.outs.get(p) and fp_equal(c.ins[p][0], c.outs[p][0])]
    if len(src) != 1 or len(c.ins) < 2:
        return None
    p = src[0]
    for r in j.v.before(c.t0, REDUCING, limit=4):
        if r.sums and r.outs.get(p) and r.outs[p][0].numel == c.ins[p][0].numel and fp_equal(r.outs[p][0], c.ins[p][0]):
            return r
    return None


def _equal_values(j, pt):
    says = declared.dtensor_placement_at(pt)
    note = item("values", "values equal on every rank: identical shards, e.g. dummy weights")
    if says and says != "replicate":
        pt.items.append(item("declared", f"the DTensor declares {says}"))
        if says == "partial":
            return decide(pt, "partial", "pre-reduction", "declared-dtensor", None, note)
        return decide(pt, says, "no-reduction", "declared-dtensor", None, note)
    sem = declared.expected_by_layer(j.layer_attrs.get(pt.module), pt.slot, j.group_size)
    if sem is not None and sem["placement"] in ("shard", "partial"):
        pt.items.append(item("semantics", f"{sem['says']} says {sem['placement']}: the verdict follows the layer"))
        if sem["placement"] == "shard":
            return decide(pt, f"shard({pt.ndim - 1})", "no-reduction", "layer-semantics", None, note)
        c = next_sum_reduction(j.v, pt)
        extra = [coll_item(c, f"the next sum-reduction of its size is {coll_desc(c)}")] if c else []
        return decide(pt, "partial", "pre-reduction" if c else "unknown", "layer-semantics",
                      coll_json(c, pt.procs[0]) if c else None, note, *extra)
    split = rules_weights.sharded_param(j, pt)
    if split is not None and split[2] in ("declared", "several"):
        verdict = rules_weights.from_weight(j, pt, split)
        if verdict is not None:
            verdict.items.append(note)
            return verdict
    c = _broadcast_of(j, pt)
    if c is not None:
        sent = coll_item(c, f"equals the output of {coll_desc(c)} on every rank: the source rank's values, "
                            "sent to every rank")
        r = _reduced_before_broadcast(j, c)
        if r is not None:  # (a reduce to one rank, then a broadcast from it: an all_reduce in two)
            return decide(pt, "replicate", "post-reduction", "broadcast-output", coll_json(r, pt.procs[0]), sent,
                          coll_item(r, f"which its source held as the output of {coll_desc(r)}: the result of a "
                                       "sum-reduction, sent on unchanged"))
        return decide(pt, "replicate", "no-reduction", "broadcast-output", coll_json(c, pt.procs[0]), sent)
    if not pt.tref.dtype.startswith(FLOAT_DTYPES):
        what = ("boolean values (masks, flags)" if pt.tref.dtype == "bool"
                else "integer values (ids, positions, lengths)")
        return decide(pt, "replicate", "no-reduction", "equal-values", None,
                      item("values", f"{what} equal on every rank"))
    # Computed from a shard that only looks whole (identical shards): the dataflow says so.
    whole = False  # (the ops that built it, or a producer of the same values, say it is whole)
    for rule in (rules_dataflow.lineage_ops, rules_dataflow.same_values_as_producer,
                 rules_dataflow.derived_from_shard_inputs, rules_dataflow.input_shaped_as_shard):
        if rule is rules_dataflow.input_shaped_as_shard and (whole or not j.identical_shards):
            break  # (a shard's shape is evidence only where equal values hide shards)
        verdict = rule(j, pt)
        if verdict is not None and verdict.placement != "replicate":
            verdict.items.append(note)
            return verdict
        whole = whole or verdict is not None
    compiled = _compiled_call(j, pt)
    if compiled is not None:
        # (a compiled block ends with its residual add more often than with its reduction:
        # the verdict stays, with the caution)
        key, how = compiled
        pt.items.append(item("values", f"{j.name(key)} ran compiled ({how}): the ops inside it are not seen (the "
                                       "collectives its graph ran are, as spans of its call)", point=j.name(key)))
    if pt.is_output and any(c.sums for c in j.call_collectives(pt)):
        # (the contract's post-reduction is the reduction's output carried unchanged)
        why = ("not the output of its call's sum-reduction itself: computed locally from it or from other "
               "whole values (a bias added after the all_reduce)")
    else:
        why = "not the output of a sum-reduction: computed locally from whole values"
    return decide(pt, "replicate", "no-reduction", "equal-values", None, item("values", why))


def _compiled_call(j, pt):
    """(point, how) of the compiled module call (torch.compile) whose output ``pt`` is, or whose
    output's values (bit for bit) it carries on, or None: the ops inside a compiled call are not
    recorded (its graph's functional collectives are), which the evidence says."""
    keys = [pt.key] if pt.is_output else []
    producer = j.producer(pt.obs.get(j.v.procs[0]))
    if producer is not None:
        keys.append(producer)
    for key in keys:
        how = (j.layer_attrs.get(key[0]) or {}).get("compiled")
        if how:
            return key, how
    return None


def declared_dtensor(j, pt):
    says = declared.dtensor_placement_at(pt)
    if not says:
        return None
    if says == "replicate":
        pt.items.append(item("declared", "the DTensor declares Replicate() -- DISAGREES with values that differ"))
        return None
    pt.items.append(item("declared", f"the DTensor declares {says}, and the values differ across ranks"))
    if says == "partial":
        c = next_sum_reduction(j.v, pt)
        return decide(pt, "partial", "pre-reduction" if c else "unknown", "declared-dtensor",
                      coll_json(c, pt.procs[0]) if c else None)
    return decide(pt, says, "no-reduction", "declared-dtensor")
