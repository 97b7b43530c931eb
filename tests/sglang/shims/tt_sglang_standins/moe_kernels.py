"""Qwen2-MoE's shared-expert gate in torch: SGLang 0.5.23 calls a Triton kernel for it.

Without this, a Qwen2-MoE model with a shared expert dies at its first forward with
``RuntimeError: 0 active drivers ([]). There should only be one.`` (Triton's
``_fused_gate_sigmoid_mul_add_kernel``, from ``qwen2_moe.py``). The kernel computes, per token,
``sigmoid(hidden @ gate_weight)`` times the shared expert's output, and either adds it in place
into the routed experts' output (``fused_gate_sigmoid_mul_add``) or returns it
(``fused_gate_sigmoid_mul``). ``qwen2_moe.py`` binds both names at import time, so they are
replaced in the kernel module and again in the model module.
"""

from __future__ import annotations

_NAMES = ("fused_gate_sigmoid_mul", "fused_gate_sigmoid_mul_add")


def _gated(hidden_states, gate_weight, shared_output):
    import torch

    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float().reshape(-1, 1))
    return (gate * shared_output.float()).to(shared_output.dtype)


def fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output):
    """The gated shared-expert contribution, as a new tensor."""
    return _gated(hidden_states, gate_weight, shared_output)


def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
    """Add the gated shared-expert contribution into ``final_hidden_states`` in place."""
    final_hidden_states.add_(_gated(hidden_states, gate_weight, shared_output))


def _replace(module) -> None:
    for name in _NAMES:
        if hasattr(module, name):
            setattr(module, name, globals()[name])


PATCHES = {
    "sglang.kernels.ops.elementwise.elementwise": _replace,
    "sglang.srt.models.qwen2_moe": _replace,
}
