"""Dummy weights in which partial sums are visible: ``--load-format dummy`` with a wider draw.

SGLang's own dummy loader seeds every parameter by (numel, dtype) and draws it from
U(-1e-3, 1e-3), so every TP shard of a sharded weight is bit-identical (the ranks' partial sums
are then equal, and a partial sum looks replicated) and every logit is a near-tie. Here each
parameter is drawn again after SGLang's draw, seeded by its name and, for a sharded module, by
its shard index, so shards differ and replicated parameters stay equal on every rank:
- matrices (and expert stacks): U(-b, b) with b = sqrt(3 / fan_in), unit variance per output;
- norm weights: 1 + U(-0.1, 0.1); other vectors (biases): U(-0.1, 0.1).
A module is sharded when its ``tp_group`` has more than one rank, when it says so with
``tp_size`` > 1 (VocabParallelEmbedding), or when it is a FusedMoE with ep * tp > 1.
"""

from __future__ import annotations

import math
import zlib


def shard_key(module) -> str | None:
    """The module's shard index as text, None where every rank holds the same parameters."""
    ep = getattr(module, "moe_ep_size", None)
    if ep is not None:
        tp = getattr(module, "moe_tp_size", 1) or 1
        if ep * tp > 1:
            return f"moe{getattr(module, 'moe_ep_rank', 0)}.{getattr(module, 'moe_tp_rank', 0)}"
        return None
    group = getattr(module, "tp_group", None)
    if group is not None and getattr(group, "world_size", 1) > 1:
        return f"tp{group.rank_in_group}"
    if (getattr(module, "tp_size", 1) or 1) > 1:
        return f"tp{getattr(module, 'tp_rank', 0)}"
    return None


def redraw(model) -> None:
    """Draw every floating-point parameter of ``model`` again (see the module docstring)."""
    import torch

    with torch.no_grad():
        for mod_name, module in model.named_modules():
            key = shard_key(module)
            for p_name, param in module.named_parameters(recurse=False):
                if not torch.is_floating_point(param) or torch.finfo(param.dtype).bits < 16:
                    continue
                name = f"{mod_name}.{p_name}" if mod_name else p_name
                g = torch.Generator(device=param.device)
                g.manual_seed(zlib.crc32(f"{name}|{key}".encode()))
                draw = torch.empty(param.shape, dtype=torch.float32, device=param.device)
                if param.dim() >= 2:
                    b = math.sqrt(3.0 / max(1, param.shape[-1]))
                    draw.uniform_(-b, b, generator=g)
                elif "norm" in name:
                    draw.uniform_(0.9, 1.1, generator=g)
                else:
                    draw.uniform_(-0.1, 0.1, generator=g)
                param.data.copy_(draw.to(param.dtype))


def _patch_loader(loader_module) -> None:
    original = loader_module.initialize_dummy_weights

    def initialize_dummy_weights(model, *args, **kwargs):
        original(model, *args, **kwargs)
        redraw(model)

    loader_module.initialize_dummy_weights = initialize_dummy_weights


PATCHES = {"sglang.srt.model_loader.loader": _patch_loader}
