"""Placement rules for mixture-of-experts layers (SGLang's FusedMoE and what runs inside it).

A FusedMoE layer is a column-parallel and a row-parallel product in one module, with a router
choosing which expert rows each token meets, so the rule of a plain linear layer (a replicated
input and a weight split across ranks give a slice) does not hold for it. What is split, and
how, is read off the layer's recorded attributes (``declared.moe_split``) and checked against the
weights' per-rank fingerprints:

- its output: each rank's sum over its experts (tensor parallel: over its slice of every
  expert's intermediate dimension; expert parallel: over its own experts) is a partial sum of
  the layer's output, completed by a later sum-reduction (the layer boundary's all_reduce, or
  an expert-parallel combine that reduces). The same holds for any output whose layer class
  declares a partial sum (a row-parallel linear with ``reduce_results=False``, a shared
  expert's ``down_proj``) when its weights are split and its values differ;
- points computed inside its call under tensor parallel (the per-expert activation
  ``SiluAndMul#K``): every rank runs the same experts on the same tokens, on its slice of the
  intermediate dimension: a shard along the last dimension where that dimension is the slice's
  width (or twice it, gate and up side by side);
- points inside its call under expert parallel: each rank runs different experts on different
  tokens (call K is another expert on each rank, with its own token count). They are not
  comparable across ranks: placement ``local``, never ``divergent`` or a shard.
"""

from __future__ import annotations

from tensor_trace.exporters.analysis import declared
from tensor_trace.exporters.analysis.evidence import decide, item
from tensor_trace.exporters.analysis.step_view import coll_desc, coll_json, next_sum_reduction
from tensor_trace.exporters.analysis.tolerance import Observed, fp_equal


def enclosing_moe(j, module: str):
    """(path, split) of the nearest experts layer whose call ``module`` ran inside (a path
    prefix of it, not the module itself), or None: an SGLang FusedMoE, or a module whose
    grouped expert weights are DTensors split along the expert dim (``dtensor_experts``)."""
    parts = module.split(".")
    for n in range(len(parts) - 1, 0, -1):
        path = ".".join(parts[:n])
        split = declared.moe_split(j.layer_attrs.get(path)) or dtensor_experts(j, path)
        if split is not None:
            return path, split
    return None


def dtensor_experts(j, path: str) -> dict | None:
    """The expert-parallel split of a module whose weights of three dims or more ([experts,
    in, out]) are all DTensors split along dim 0 across more than one rank (transformers'
    ``grouped_gemm`` plan under expert parallel, a DTensor plan sharding grouped experts with
    ``Shard(0)``): each rank holds whole experts of its own. None otherwise."""
    if path in j.dtensor_experts:
        return j.dtensor_experts[path]
    out = None
    per = j.module_params(path, j.v.procs[:1])
    grouped = [(name, shape, meta) for name, shape, _fp, meta in (per[0] if per else ()) if len(shape) >= 3]
    if grouped and all(declared.param_split_dim(meta) == 0 for _, _, meta in grouped):
        meta = grouped[0][2]
        ranks = int((meta.get("mesh_shape") or [1])[0])
        if ranks > 1:
            local, total = grouped[0][1][0], (meta.get("global_shape") or [None])[0]
            out = dict(tp=1, ep=ranks, inter=None, local=local, experts=total,
                       text=f"{', '.join(n for n, _, _ in grouped)} DTensors Shard(0) over {ranks} ranks",
                       says="its expert weights")
    j.dtensor_experts[path] = out
    return out


def _split_says(path, split) -> str:
    if split.get("says") == "its expert weights":
        return f"{path}'s expert weights ({split['text']})"
    return f"{path}, SGLang's FusedMoE({split['text']})"


def split_params(j, module: str, procs) -> list:
    """Names and local shapes of ``module``'s own parameters that have equal shapes and
    different values across ranks: each rank holds its own part."""
    per = j.module_params(module, procs)
    if per is None:
        return []
    out = []
    for i, (name, shape, fp, _meta) in enumerate(per[0]):
        others = [x[i] for x in per[1:] if i < len(x)]
        if fp is None or len(others) != len(per) - 1 or any(o[1] != shape for o in others):
            continue
        ref = Observed(shape, "float32", fp)
        if any(o[2] is not None and not fp_equal(ref, Observed(shape, "float32", o[2])) for o in others):
            out.append((name, shape))
    return out


def _weights_item(module, params) -> dict:
    names = ", ".join(f"{n} {list(s)}" for n, s in params)
    return item("weights", f"{module}.{{{names}}}: equal shapes, different values across ranks: each rank "
                           f"holds its own part", param=f"{module}.{params[0][0]}")


def expert_parallel_local(j, pt):
    """A point computed inside an expert-parallel FusedMoE call: per rank, not comparable.
    Tried before the shape and rank-count rules, since under expert parallel a rank runs as
    many expert calls, on as many tokens, as the router sent to its experts."""
    if j.group_size <= 1 or not pt.procs:
        return None
    hit = enclosing_moe(j, pt.module)
    if hit is None or hit[1]["ep"] <= 1:
        return None
    path, split = hit
    seen = ", ".join(f"rank {j.rank_of[p]} {list(pt.obs[p].shape)}" for p in pt.procs)
    local = (f"{split['local']} of {split['experts']} experts" if split.get("local") and split.get("experts")
             else "its own experts")
    extra = [item("semantics", f"inside {_split_says(path, split)}: each rank runs {local} "
                               f"on the tokens routed to them, so call {pt.call} is a different expert on "
                               f"each rank: per-rank values, not comparable across ranks"),
             item("shape", f"seen on {seen}" + ("" if len(pt.procs) == j.group_size else
                                                 f" (not on the other ranks of a group of {j.group_size}: "
                                                 f"they ran fewer expert calls)"))]
    params = split_params(j, path, pt.procs)
    if params:
        extra.append(_weights_item(path, params))
    return decide(pt, "local", "no-reduction", "expert-parallel-local", None, *extra)


def expert_parallel_routing(j, pt):
    """Values that differ across ranks and that an expert-parallel experts call takes as its
    routing (transformers' ``ep_router`` leaves each rank its own experts' weights and ids,
    renumbered locally), or that same routing where the router returned it: per rank by design,
    ``local``, not ``divergent``."""
    if pt.equal or j.group_size <= 1 or len(pt.procs) < 2:
        return None
    for key, obs in j.v.points.items():
        if not key[2].startswith("input") or (key[0] == pt.module and pt.is_output):
            continue
        if key != pt.key and not all(p in obs and obs[p].fp is not None and pt.obs[p].fp is not None
                                     and obs[p].shape == pt.obs[p].shape and fp_equal(obs[p], pt.obs[p])
                                     for p in pt.procs):
            continue
        split = declared.moe_split(j.layer_attrs.get(key[0])) or dtensor_experts(j, key[0])
        if split is None or split["ep"] <= 1 or key[2] == "input.0":
            continue
        via = "" if key == pt.key else f" (the same values as {j.name(key)})"
        return decide(pt, "local", "no-reduction", "expert-parallel-routing", None,
                      item("semantics", f"routing that {_split_says(key[0], split)} takes{via}: each rank holds "
                                        "its own experts' weights and ids: per-rank values, not comparable "
                                        "across ranks", point=j.name(key)))
    return None


def expert_tp_slice(j, pt):
    """A point computed inside a tensor-parallel FusedMoE call whose last dimension is this
    rank's slice of the experts' intermediate dimension (or gate and up side by side)."""
    hit = enclosing_moe(j, pt.module)
    if hit is None or hit[1]["ep"] > 1 or hit[1]["tp"] <= 1 or not pt.ndim:
        return None
    path, split = hit
    width, last = split.get("inter"), pt.tref.shape[-1]
    if not width or last not in (width, 2 * width):
        return None
    params = split_params(j, path, pt.procs)
    what = "the experts' intermediate slice" if last == width else "gate and up slices side by side"
    extra = [item("semantics", f"inside {path}, SGLang's FusedMoE({split['text']}, "
                               f"intermediate_size_per_partition={width}): every rank runs the same experts on "
                               f"the same tokens, each on its slice of the intermediate dimension; the last "
                               f"dimension ({last}) is {what}")]
    if params:
        extra.append(_weights_item(path, params))
    elif not pt.equal:
        return None  # values differ and the weights do not say why
    return decide(pt, f"shard({pt.ndim - 1})", "no-reduction", "expert-tp-slice", None, *extra)


def declared_partial(j, pt):
    """An output whose layer class declares a partial sum (a FusedMoE's expert sum, a
    row-parallel linear with ``reduce_results=False``), with values that differ across ranks
    and weights split across them: a partial sum, even when it is not itself the input of the
    reduction that completes it (SGLang adds a shared expert's and the routed experts' partial
    sums together in place, and all-reduces the sum at the layer boundary)."""
    if pt.equal or not pt.is_output:
        return None
    sem = declared.expected_by_layer(j.layer_attrs.get(pt.module), pt.slot, j.group_size)
    if sem is None or sem["placement"] != "partial":
        return None
    params = split_params(j, pt.module, pt.procs)
    if not params:
        return None
    c = next_sum_reduction(j.v, pt)
    extra = [item("semantics", f"{sem['says']} says partial, and the values differ across ranks"),
             _weights_item(pt.module, params)]
    if c is not None:
        extra.append(item("collective", f"the next sum-reduction of its size is {coll_desc(c)}",
                          collective=dict(group=c.group_name, seq=c.seq, op=c.op)))
    return decide(pt, "partial", "pre-reduction" if c else "unknown", "declared-partial",
                  coll_json(c, pt.procs[0]) if c else None, *extra)
