"""Placement rules from a module's parameters: a weight split across ranks (declared by a
DTensor, or seen as equal shapes with different values) and the module's input placement. A
replicated input and a weight split along its output dimension give a shard; an input sharded
along the contracted dimension and a weight split along its input dimension give a partial sum.
"""

from __future__ import annotations

from tensor_trace.exporters.analysis import declared
from tensor_trace.exporters.analysis.evidence import decide, item
from tensor_trace.exporters.analysis.step_view import GATHER, coll_desc, coll_json, next_sum_reduction
from tensor_trace.exporters.analysis.tolerance import FLOAT_DTYPES, Observed, fp_equal, linked


def sharded_param(j, pt):
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


def from_weight(j, pt, split):
    """A module's output from its split weight and its input's placement."""
    name, shape, how, dim = split
    inputs = j.call_inputs(pt)
    first = inputs[0][1] if inputs else None
    obs_in = j.v.points.get(inputs[0][0], {}).get(pt.procs[0]) if inputs else None
    integer_input = obs_in is not None and not obs_in.dtype.startswith(FLOAT_DTYPES)
    weight = f"{pt.module}.{name} {list(shape)}"
    last = pt.ndim - 1
    # The weight and the input tell what the call computes locally; a collective inside the
    # call (a row-parallel layer's all_reduce before its bias) makes the output something else.
    # Only an all_gather of the input itself is followed: the weight meets the gathered tensor.
    gather = _gathered_in_call(j, pt, inputs[0][0]) if inputs else None
    others = [c for c in j.call_collectives(pt) if c is not gather]
    if others:
        pt.items.append(item("dataflow", f"the weight does not place it: its call issued {coll_desc(others[0])}"))
        return None
    if how == "declared" and len(shape) == 2:
        # nn.Linear's weight is [out, in]; an embedding's [vocab, dim] is looked up by its rows.
        split_out = (dim == 0) != integer_input
        text = f"{weight} is a DTensor split along dim {dim}"
    else:
        if first is None:
            return None
        if first.placement == "replicate" or (gather is not None and first.placement.startswith("shard(")):
            split_out = not integer_input
        elif first.placement.startswith("shard(") and int(first.placement[6:-1]) == len(obs_in.shape) - 1:
            split_out = False
        else:
            return None
        text = f"{weight} has equal shapes and different values across ranks: each rank holds a slice"
    in_text = f"its input {j.name(inputs[0][0])} is {first.placement}" if first else "its input was not seen"
    if gather is not None:
        in_text += f", gathered inside the call by {coll_desc(gather)}"
    if split_out:
        return decide(pt, f"shard({last})", "no-reduction", "sharded-weight", None,
                      item("weights", text, param=f"{pt.module}.{name}"),
                      item("dataflow", f"{in_text}, the weight is split along its output dimension: a shard"))
    c = next_sum_reduction(j.v, pt)
    return decide(pt, "partial", "pre-reduction" if c else "unknown", "sharded-weight",
                  coll_json(c, pt.procs[0]) if c else None,
                  item("weights", text, param=f"{pt.module}.{name}"),
                  item("dataflow", f"{in_text}, the weight is split along its input (contracted) dimension: "
                                   f"a partial sum"))


def _gathered_in_call(j, pt, in_key):
    """The all_gather the module call of output ``pt`` issued, whose input is the call's input
    ``in_key`` on every rank (a sequence-parallel projection gathers the sequence first)."""
    obs = j.v.points.get(in_key, {})
    for c in j.call_collectives(pt):
        if c.op not in GATHER:
            continue
        ins = {p: c.ins[p][0] for p in pt.procs if c.ins.get(p)}
        if len(ins) == len(pt.procs) and all(p in obs for p in pt.procs) and linked(
                {p: obs[p] for p in pt.procs}, ins) == 1.0:
            return c
    return None


def sharded_weight(j, pt):
    split = sharded_param(j, pt)
    return from_weight(j, pt, split) if split is not None else None
