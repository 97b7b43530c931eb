"""Placement rules from a module's parameters: a weight split across ranks (declared by a
DTensor, or seen as equal shapes with different values) and the module's input placement. A
replicated input and a weight split along its output dimension give a shard; an input sharded
along the contracted dimension and a weight split along its input dimension give a partial sum.
A parameter handed to another module (a tied output head given the embedding's weight) is
placed as its owner uses it.
"""

from __future__ import annotations

from tensor_trace.exporters.analysis import declared
from tensor_trace.exporters.analysis.evidence import decide, item
from tensor_trace.exporters.analysis.step_view import GATHER, coll_desc, coll_json, next_sum_reduction
from tensor_trace.exporters.analysis.tolerance import FLOAT_DTYPES, Observed, all_equal, fp_equal, linked


def sharded_param(j, pt):
    """(name, local shape, how) of the module's first parameter that is split across ranks:
    declared by a DTensor (``how`` = "declared", with the split dim) or seen as equal shapes with
    different values (``how`` = "values")."""
    if not pt.is_output:
        return None
    per = j.module_params(pt.module, pt.procs)
    if per is None:
        return None
    declared_splits = [(name, shape, "declared", d) for name, shape, fp, meta in per[0]
                       if (d := declared.param_split_dim(meta)) is not None]
    if sum(1 for _, shape, _, _ in declared_splits if len(shape) >= 2) > 1:
        return _name_several(declared_splits)
    if declared_splits:
        return declared_splits[0]
    split = []
    for i, (name, shape, fp, meta) in enumerate(per[0]):
        others = [x[i] for x in per[1:] if i < len(x)]
        if len(others) != len(per) - 1 or any(o[1] != shape for o in others) or fp is None:
            continue
        ref = Observed(shape, "float32", fp)
        if any(o[2] is not None and not fp_equal(ref, Observed(shape, "float32", o[2])) for o in others):
            split.append((name, shape, "values", None))
    if sum(1 for _, shape, _, _ in split if len(shape) >= 2) > 1:
        # several split matrices in one call (an MLP's or experts' w1, w2, w3 as one module):
        # the first says nothing of the output, which the last applied makes (a partial sum
        # where it is split along its input dim)
        return None
    return split[0] if split else None


def _name_several(splits) -> tuple:
    """(names, local shapes, "several", split dims) of a call's several split matrices."""
    return (tuple(n for n, *_ in splits), tuple(tuple(sh) for _, sh, _, _ in splits), "several",
            tuple(d for *_, d in splits))


def _from_several(j, pt, split):
    """An output made by several declared-split matrices in one call (an MLP's or grouped
    experts' w1, w2, w3 as one module: torchtitan's GroupedExperts): from a whole input, an
    output as wide as the input's last dim, which no split dim is, has had the split dim
    contracted away: a partial sum; one as wide as a split dim's local size, a shard of it."""
    names, shapes, _, dims = split
    inputs = j.call_inputs(pt)
    if not inputs or j.call_collectives(pt) or pt.tref is None or not pt.tref.shape:
        return None
    first = inputs[0][1]
    obs_in = j.v.points.get(inputs[0][0], {}).get(pt.procs[0])
    if first.placement != "replicate" or obs_in is None or not obs_in.shape:
        return None
    out_last, in_last = pt.tref.shape[-1], obs_in.shape[-1]
    local = {sh[d] for sh, d in zip(shapes, dims)}
    text = item("weights", f"{pt.module} applies {len(names)} matrices split across ranks "
                           f"({', '.join(f'{n} {list(sh)} along dim {d}' for n, sh, d in zip(names, shapes, dims))})"
                           f" to {j.name(inputs[0][0])}, replicate")
    if out_last == in_last and out_last not in local:
        return _weight_verdict(j, pt, False, text,
                               item("dataflow", f"its output is as wide as its input ({out_last}), which no "
                                                "split dim is: the split dim was contracted: a partial sum"))
    if out_last in local and out_last != in_last:
        return _weight_verdict(j, pt, True, text,
                               item("dataflow", f"its output's last dim ({out_last}) is a split dim's local "
                                                "size: a shard"))
    return None


def from_weight(j, pt, split):
    """A module's output from its split weight and its input's placement."""
    if split[2] == "several":
        return _from_several(j, pt, split)
    name, shape, how, dim = split
    inputs = j.call_inputs(pt)
    first = inputs[0][1] if inputs else None
    obs_in = j.v.points.get(inputs[0][0], {}).get(pt.procs[0]) if inputs else None
    integer_input = obs_in is not None and not obs_in.dtype.startswith(FLOAT_DTYPES)
    weight = f"{pt.module}.{name} {list(shape)}"
    # The weight and the input tell what the call computes locally; a collective inside the
    # call (a row-parallel layer's all_reduce before its bias) makes the output something else.
    # Only an all_gather of the input itself is followed: the weight meets the gathered tensor.
    gather = _gathered_in_call(j, pt, inputs[0][0]) if inputs else None
    others = [c for c in j.output_collectives(pt) if c is not gather]
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
        if (len(shape) == 1 and obs_in is not None and obs_in.shape and obs_in.shape[-1] == shape[0]
                and gather is None and (first.placement == "replicate" or (
                    first.placement.startswith("shard(") and first.placement != f"shard({len(obs_in.shape) - 1})"))):
            # a weight of one dim as long as its input's last dim, which is whole (a norm's, a
            # scale's): it applies element by element, so values that differ are no slice of
            # a larger weight: the ranks hold different weights (one rank's stale or scaled copy)
            return decide(pt, "divergent", "unknown", "divergent-weight", None,
                          item("weights", f"{weight} has equal shapes and different values across ranks, and "
                                          f"applies element by element to {j.name(inputs[0][0])} "
                                          f"({first.placement}), whose last dim it spans whole: no slice of a "
                                          "larger weight; the ranks hold different weights",
                               param=f"{pt.module}.{name}"))
        if len(shape) == 1 and first.placement.startswith("shard("):
            # one dim: a norm's or a scale's weight, which applies element by element and so
            # never contracts: as long as the input's sharded last dim, each rank's slice of
            # it meets its slice of the input (a norm over a hidden dim split across ranks)
            last = len(obs_in.shape) - 1 if obs_in is not None and obs_in.shape else None
            if (last is None or first.placement != f"shard({last})" or obs_in.shape[-1] != shape[0]
                    or gather is not None or pt.tref is None or not pt.tref.shape or pt.tref.shape[-1] != shape[0]):
                return None
            return _weight_verdict(
                j, pt, True, item("weights", f"{weight} has equal shapes and different values across ranks: each "
                                             "rank holds a slice", param=f"{pt.module}.{name}"),
                item("dataflow", f"its input {j.name(inputs[0][0])} is {first.placement}, and the weight, as long as "
                                 "its last dim, applies element by element: each rank's slice of the weight meets "
                                 "its slice of the input: a shard"))
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
        return _weight_verdict(j, pt, True, item("weights", text, param=f"{pt.module}.{name}"),
                               item("dataflow", f"{in_text}, the weight is split along its output dimension: a shard"))
    return _weight_verdict(j, pt, False, item("weights", text, param=f"{pt.module}.{name}"),
                           item("dataflow", f"{in_text}, the weight is split along its input (contracted) "
                                            "dimension: a partial sum"))


def _weight_verdict(j, pt, split_out: bool, *evidence):
    """A weight split along its output dim gives a shard of the output's last dim; along its
    input (contracted) dim, a partial sum that the next sum-reduction completes."""
    if split_out:
        return decide(pt, f"shard({pt.ndim - 1})", "no-reduction", "sharded-weight", None, *evidence)
    c = next_sum_reduction(j.v, pt)
    return decide(pt, "partial", "pre-reduction" if c else "unknown", "sharded-weight",
                  coll_json(c, pt.procs[0]) if c else None, *evidence)


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
    return from_weight(j, pt, split) if split is not None else from_passed_weight(j, pt)


def from_passed_weight(j, pt):
    """A module's output from a weight it was handed (``passed_parameter``) applied as
    ``F.linear`` applies one (``[out, in]``: its input's last dim is ``in``, its output's
    ``out``) to its other input: a whole input and a weight split along ``out`` give a shard,
    an input sharded along ``in`` and a weight split along ``in`` a partial sum. An input the
    call gathers first (a sequence-parallel head: Megatron's tied ``output_layer`` gathers the
    sequence, then applies the embedding's rows) is whole where the weight meets it."""
    if not pt.is_output or pt.tref is None:
        return None
    inputs = j.call_inputs(pt)
    p0 = pt.procs[0]
    weight = next(((k, vd) for k, vd in inputs if vd.rule == "passed-parameter"), None)
    if weight is None:
        return None
    x = next(((k, vd) for k, vd in inputs if k != weight[0] and (t := j.v.points[k].get(p0)) is not None
              and t.dtype.startswith(FLOAT_DTYPES)), None)
    if x is None:
        return None
    gather = _gathered_in_call(j, pt, x[0])
    if any(c is not gather for c in j.call_collectives(pt)):
        return None
    w_shape, x_shape = j.v.points[weight[0]][p0].shape, j.v.points[x[0]][p0].shape
    out_shape = pt.tref.shape
    if len(w_shape) != 2 or not x_shape or x_shape[-1] != w_shape[1] or out_shape[-1] != w_shape[0]:
        return None
    d = int(weight[1].placement[6:-1])
    about = item("weights", f"{j.name(weight[0])} is {weight[1].placement} and is applied as a linear weight "
                            f"[out, in] to {j.name(x[0])}, {x[1].placement}"
                            + (f", gathered inside the call by {coll_desc(gather)}" if gather else ""),
                 point=j.name(weight[0]))
    if d == 0 and (x[1].placement == "replicate" or (gather is not None and x[1].placement.startswith("shard("))):
        return _weight_verdict(j, pt, True, about)
    if d == 1 and gather is None and x[1].placement == f"shard({len(x_shape) - 1})":
        return _weight_verdict(j, pt, False, about)
    return None


def passed_parameter(j, pt):
    """A tensor that is, on every rank, a module's parameter handed on (Megatron's tied output
    layer called with ``weight=`` the embedding's): a shard along the dim its owner split it,
    read from what the owner's call did with it where that is judged (its first call ran
    earlier in the step). A lookup table (integer input) whose call issued a sum-reduction, or
    whose output is a partial sum, is split by rows (vocab-parallel); one whose output is a shard
    of its last dim, by columns. A weight ``[out, in]`` applied to floats: a shard of the
    output's last dim is its dim 0, a partial sum its dim 1."""
    if pt.tref is None or any(t.fp is None for t in pt.ts) or all_equal(pt.ts):
        return None
    hit = _param_with_values(j, pt)
    if hit is None:
        return None
    module, name, meta = hit
    d = declared.param_split_dim(meta)
    how = f"a DTensor split along dim {d}" if d is not None else None
    if d is None:
        d, how = _split_by_use(j, module, pt.ndim)
    if d is None:
        return None
    return decide(pt, f"shard({d})", "no-reduction", "passed-parameter", None,
                  item("weights", f"the values of {module}.{name} on every rank, {how}",
                       param=f"{module}.{name}"))


def _param_with_values(j, pt):
    """(module, name, meta) of the parameter whose values the point holds on every rank."""
    shape = tuple(pt.tref.shape)
    for module, i in j.params_of_shape(shape):
        per = j.module_params(module, pt.procs)
        if per is not None and all(i < len(x) and x[i][2] is not None
                                   and fp_equal(Observed(shape, t.dtype, x[i][2]), t) for x, t in zip(per, pt.ts)):
            name, _shape, _fp, meta = per[0][i]
            return module, name, meta
    return None


def _split_by_use(j, module, ndim):
    """(dim, why) of the owner's split from its first call's verdicts, or (None, None)."""
    if ndim != 2:
        return None, None
    in_keys = j.inputs_of.get((module, 0), ())
    out_key = next((k for k in j.done if k[:2] == (module, 0) and k[2].startswith("output")), None)
    if not in_keys or out_key is None:
        return None, None
    p0 = j.v.procs[0]
    t_in, t_out = j.v.points[in_keys[0]].get(p0), j.v.points[out_key].get(p0)
    if t_in is None or t_out is None:
        return None, None
    out = j.done[out_key]
    lookup = not t_in.dtype.startswith(FLOAT_DTYPES)
    t = j.v.times.get(out_key)
    reduced = t is not None and any(c.sums for c in j.v.issued_by(t[1]))
    last = f"shard({len(t_out.shape) - 1})"
    if lookup:
        if reduced or out.placement == "partial":
            return 0, f"the table {module} looks rows up in and sums across ranks: split by rows"
        if out.placement == last:
            return 1, f"the table {module} looks rows up in, whose output is a shard of its last dim: split by columns"
        return None, None
    if reduced:
        return None, None
    if out.placement == last:
        return 0, f"the weight of {module}, whose output is a shard of its last dim: split along its output dim"
    if out.placement == "partial":
        return 1, f"the weight of {module}, whose output is a partial sum: split along its input dim"
    return None, None
