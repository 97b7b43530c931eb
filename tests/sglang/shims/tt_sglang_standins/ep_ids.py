"""Expert parallel (``--ep-size 2``) with SGLang 0.5.23's torch-native MoE on CPU.

Under EP each rank holds some of the experts; the router ids of experts held by another rank
reach ``moe_forward_native`` as -1, and its ``scatter_`` fails with ``RuntimeError: index -1 is
out of bounds for dimension 1 with size 8``. Here each -1 becomes a local expert id not already
used in its row, with routing weight 0, so the rank computes a zero contribution for it. (A
plain -1 -> 0 is not enough: a row can then name expert 0 twice, ``scatter_`` does not count
duplicates, and the per-expert token counts no longer cover the sorted tokens: ``shape mismatch:
value tensor of shape [5, 64] cannot be broadcast to indexing result of shape [6, 64]``.)
So a rank also runs its local experts on the tokens it does not own, with weight 0: the traced
per-expert ``SiluAndMul`` calls include those rows (the rank's output sum is unchanged).
"""

from __future__ import annotations


def local_ids(topk_ids, topk_weights, num_local: int):
    """``(ids, weights)`` with every -1 replaced by an unused local id of its row, weight 0."""
    import torch

    missing = topk_ids < 0
    if not bool(missing.any()):
        return topk_ids, topk_weights
    ids = topk_ids.clone()
    weights = topk_weights.clone()
    for row in torch.nonzero(missing.any(dim=1)).flatten().tolist():
        used = {int(i) for i in ids[row].tolist() if i >= 0}
        free = (e for e in range(num_local) if e not in used)
        for col in torch.nonzero(ids[row] < 0).flatten().tolist():
            ids[row, col] = next(free)
            weights[row, col] = 0
    return ids, weights


def _patch(native_module) -> None:
    original = native_module.moe_forward_native

    def moe_forward_native(layer, x, topk_output, moe_runner_config):
        num_local = getattr(layer, "num_local_experts", None) or layer.w13_weight.shape[0]
        ids, weights = local_ids(topk_output.topk_ids, topk_output.topk_weights, num_local)
        if ids is not topk_output.topk_ids:
            topk_output = topk_output._replace(topk_ids=ids, topk_weights=weights)
        return original(layer, x, topk_output, moe_runner_config)

    native_module.moe_forward_native = moe_forward_native


PATCHES = {"sglang.srt.layers.moe.fused_moe_native": _patch}
