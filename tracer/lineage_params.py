"""Module parameters as lineage inputs: an op on a parameter (an MoE's experts indexing their
stacked weights) is recorded with the ref ``[REF_PARAM, module path, parameter name]``, so the
placement rules can start from the parameter's declared split (tracer/lineage.py).
"""

from __future__ import annotations

import weakref

import torch

from tensor_trace.format.lineage_refs import REF_PARAM, param_ref


def add_params(tracer, root, params: dict, producers: dict) -> None:
    """Know ``root``'s modules' parameters by identity from now on (``params`` and
    ``producers``: id -> (weak reference, ref)). A DTensor parameter's local tensor too: a TP
    style that runs its module on local tensors (transformers' ``moe_tp_experts``) hands the
    module a view of it (``to_local``), which the watcher records as a view of the parameter."""
    from tensor_trace.tracer.naming import entries_of

    for sub in root.modules():
        entries = entries_of(tracer, sub)
        if not entries:
            continue
        for name, p in sub.named_parameters(recurse=False):
            ref = [REF_PARAM, entries[0][0], name]
            for t in (p, getattr(p, "_local_tensor", None)):
                if not isinstance(t, torch.Tensor):
                    continue
                try:
                    hit = (weakref.ref(t), ref)
                except TypeError:
                    continue
                params[id(t)] = producers[id(t)] = hit


def encode(writer, ref):
    """A ref as written: a parameter's module path and name become string ids."""
    if ref[0] != REF_PARAM:
        return ref
    return param_ref(writer.string(ref[1]), writer.string(ref[2]))
