"""What a framework declares about a tensor or a layer: extra evidence, never a replacement.

Two sources: a DTensor's own placements (recorded by the tracer as the slot's ``meta``), and a
framework's layer classes (SGLang's parallel linear and embedding layers, recorded as module
attributes). A verdict that follows a declaration says so; a declaration that the values refute
is reported as a disagreement.
"""

from __future__ import annotations

import math
import re

_SHARD = re.compile(r"^_?(?:Strided)?Shard\((?:dim=)?(-?\d+)")


def dtensor_placement(meta: dict | None, ndim: int) -> str | None:
    """The placement a DTensor declares over its (one-dimensional) TP mesh, in this project's
    vocabulary: ``shard(D)``, ``partial`` or ``replicate``; None for a plain tensor or a mesh
    of several dimensions whose TP dimension is not known."""
    if not meta or meta.get("kind") != "DTensor":
        return None
    placements = meta.get("placements") or []
    dim = tp_mesh_dim(meta)
    if dim is None or dim >= len(placements):
        return None
    p = str(placements[dim])
    m = _SHARD.match(p)
    if m:
        d = int(m.group(1))
        return f"shard({d % ndim if ndim else d})"
    if p.startswith("Partial") or p.startswith("_Partial") or "Partial" in p:
        return "partial"
    if p.startswith("Replicate"):
        return "replicate"
    return None


def dtensor_placement_at(pt) -> str | None:
    """What a DTensor recorded at a point of a step (``judge.Point``) declares, on its first rank."""
    return dtensor_placement(pt.tref.meta, pt.ndim) if pt.tref is not None else None


def tp_mesh_dim(meta: dict) -> int | None:
    """Which dimension of a DTensor's device mesh is the tensor-parallel one: the one named
    ``tp``, else the innermost (torchtitan's and transformers' convention: ``(dp, tp)``)."""
    placements = meta.get("placements") or []
    if not placements:
        return None
    names = meta.get("mesh_dim_names") or []
    if "tp" in names and names.index("tp") < len(placements):
        return names.index("tp")
    return len(placements) - 1


def tp_group_of(meta: dict | None, rank: int) -> list | None:
    """The ranks of ``rank``'s TP group on a DTensor's device mesh: a one-dimensional mesh's
    ranks (a TP sub-mesh such as ``mesh["tp"]``), or on a mesh of several dimensions those
    that differ from it only in the TP dimension's coordinate."""
    if not meta or meta.get("kind") != "DTensor":
        return None
    shape, ranks = meta.get("mesh_shape") or [], meta.get("mesh_ranks") or []
    if not shape or len(ranks) != math.prod(shape) or rank not in ranks:
        return None
    if len(shape) == 1:
        return list(ranks)
    dim = tp_mesh_dim(meta)
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    at = ranks.index(rank)
    base = at - (at // strides[dim] % shape[dim]) * strides[dim]
    return [ranks[base + k * strides[dim]] for k in range(shape[dim])]


def param_split_dim(meta: dict | None) -> int | None:
    """The dimension along which a DTensor parameter is split across the TP mesh."""
    placement = dtensor_placement(meta, 0) if meta else None
    if placement and placement.startswith("shard("):
        return int(placement[6:-1])
    return None


def expected_by_layer(attrs: dict | None, slot: str, ranks: int) -> dict | None:
    """What a framework's layer class says its output is (SGLang's parallel layers), to be
    cross-checked against the evidence, never used instead of it. Output slots only."""
    if not attrs or slot not in ("output", "output.0") or ranks < 2:
        return None
    if attrs.get("tp_size") == 1 or attrs.get("group_size") == 1:
        return None  # the layer's own group has one rank (e.g. attention TP under DP attention)
    cls = attrs.get("sglang_class")
    says = f"SGLang's {cls}"
    if cls in ("ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear"):
        gather = bool(attrs.get("gather_output"))
        return dict(says=f"{says}(gather_output={gather})",
                    placement="replicate" if gather else "shard", reduction=None)
    if cls == "RowParallelLinear":
        reduce = attrs.get("reduce_results", True)
        return dict(says=f"{says}(reduce_results={reduce})",
                    placement="replicate" if reduce else "partial",
                    reduction="post-reduction" if reduce else "pre-reduction")
    if cls == "VocabParallelEmbedding":
        return dict(says=says, placement="replicate", reduction="post-reduction")
    if cls == "ReplicatedLinear":
        return dict(says=says, placement="replicate", reduction=None)
    if cls == "FusedMoE":
        split = moe_split(attrs)
        if split is None:
            return None
        reduce = bool(attrs.get("reduce_results"))
        return dict(says=f"{says}({split['text']}, reduce_results={reduce})",
                    placement="replicate" if reduce else "partial",
                    reduction="post-reduction" if reduce else "pre-reduction")
    return None


def residual_sum(attrs: dict | None, slot: str, inputs: int) -> str | None:
    """What a framework's layer class says of an output that is a residual sum, or None: the
    integration names that output (``residual_sum_output``: SGLang's norms, called with a
    residual, return ``x + residual`` second)."""
    if attrs and attrs.get("residual_sum_output") == slot and inputs >= 2:
        return f"SGLang's {attrs.get('sglang_class')} returns x + residual as its {slot}"
    return None


def moe_split(attrs: dict | None) -> dict | None:
    """How an SGLang FusedMoE layer splits its experts across ranks, or None where every rank
    holds all of them whole: ``tp`` (moe_tp_size: every rank holds a slice of every expert's
    intermediate dimension, ``inter`` wide), ``ep`` (moe_ep_size: every rank holds whole experts
    of its own, ``local`` of ``experts``). Either way each rank's sum over its experts is a
    partial sum of the layer's output."""
    if not attrs or attrs.get("sglang_class") != "FusedMoE":
        return None
    tp, ep = int(attrs.get("moe_tp_size") or 1), int(attrs.get("moe_ep_size") or 1)
    if tp * ep <= 1:
        return None
    out = dict(tp=tp, ep=ep, inter=attrs.get("intermediate_size_per_partition"),
               local=attrs.get("num_local_experts"), experts=attrs.get("num_experts"))
    out["text"] = f"moe_tp_size={tp}, moe_ep_size={ep}"
    return out
