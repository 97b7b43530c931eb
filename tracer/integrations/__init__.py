"""Framework integrations: extra evidence and exact step boundaries where a framework is known.

``WATCHED`` names the modules whose first import patches their integration (the bootstrap
watches them); ``on_import`` is called right after one is imported, and ``apply_loaded`` applies
every integration whose modules were already imported when tracing started. This module must
stay importable without torch (the bootstrap imports it at interpreter start-up).
"""

from __future__ import annotations

import sys

WATCHED = (
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.layers.aux_hidden_states",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner",
    # Python functions that know what the functional collective ops they call do not
    # (tracer/functional.py): wrapped before DTensor's modules import them.
    "torch.distributed._functional_collectives",
    "torch.distributed.tensor._redistribute",
)

_applied: set = set()


def on_import(name: str, module) -> None:
    """Patch the integration of ``name`` (once per process; torch's modules once per tracer,
    which keeps track itself)."""
    if name.startswith("torch."):
        from tensor_trace.tracer import collectives

        collectives.on_import(name, module)
        return
    if name in _applied:
        return
    _applied.add(name)
    if name.startswith("sglang."):
        from tensor_trace.tracer.integrations import sglang

        sglang.patch(name, module)


def apply_loaded() -> None:
    for name in WATCHED:
        module = sys.modules.get(name)
        if module is not None:
            on_import(name, module)


def module_attrs(module) -> dict | None:
    """What a framework's own layer class says about a module (for the merge to cross-check
    against the observed evidence), and whether its calls run compiled; None for modules no
    integration knows that run as they are."""
    attrs = None
    if type(module).__module__.startswith("sglang."):
        from tensor_trace.tracer.integrations import sglang

        attrs = sglang.module_attrs(module)
    compiled = compiled_how(module)
    if compiled:
        attrs = dict(attrs or {}, compiled=compiled)
    return attrs


def compiled_how(module) -> str | None:
    """How a module's calls run compiled, or None: ``torch.compile(module)`` (the wrapper that
    takes its place) or ``module.compile()`` (its compiled call). The ops and collectives inside
    run in the compiled graph, which the tracer does not see."""
    if type(module).__name__ == "OptimizedModule" and type(module).__module__.startswith("torch._dynamo"):
        return "torch.compile(module)"
    if getattr(module, "__dict__", {}).get("_compiled_call_impl") is not None:
        return "module.compile()"
    return None
