"""What the in-process CPU A/Bs (example_tp2_ab.py, instructions_ab.py) switch between, by name:
the model alone, a tracer session with record's defaults or one option changed, the floor of any
hook-based tracer (two empty global forward hooks) and what a user would pick instead
(``torch.profiler`` with shapes recorded). ``start`` starts one and returns what stops it."""
from __future__ import annotations


def start(variant: str, out_dir: str, **options):
    """Start ``variant``; returns the callable that stops it. ``options`` are TraceConfig fields
    for the tracer's variants.

    ``untraced*`` nothing; ``empty-hooks``; ``profiler``; ``record`` (record's defaults),
    ``record-nofp`` (``fingerprint=False``), ``record-0:1`` (``steps=(0, 1)``: steps after the
    first come after the window, which has closed for good), ``record-before``
    (``steps=(10**9, None)``: every step comes before a window not reached yet), ``record-nocoll`` (the collective wrappers taken out again after
    start), ``record-nowake`` (the step end's wake-up of the writer's thread a no-op),
    ``record-nolineage`` (``lineage=False``: what the lineage schedule's steps cost)."""
    if variant.startswith("untraced"):
        return lambda: None
    if variant == "empty-hooks":
        return empty_global_hooks()
    if variant == "profiler":
        return cpu_profiler()
    from tensor_trace import tracer

    if variant == "record-nolineage":
        options = dict(options, lineage=False)
    steps = {"record-0:1": (0, 1), "record-before": (10**9, None)}.get(variant, (0, None))
    tr = tracer.start(out_dir=out_dir, fingerprint=variant != "record-nofp", steps=steps, **options)
    if variant == "record-nocoll" and tr.collectives is not None:
        tr.collectives.uninstall()
    if variant == "record-nowake":
        tr.ensure_writer()
        tr.writer.flush_when_idle = lambda: None
    return tracer.stop


def empty_global_hooks():
    """Two global forward hooks (pre and post, ``always_call``) that do nothing."""
    from torch.nn.modules import module as nn_module

    handles = [nn_module.register_module_forward_pre_hook(lambda m, a: None),
               nn_module.register_module_forward_hook(lambda m, a, o: None, always_call=True)]
    return lambda: [h.remove() for h in handles]


def cpu_profiler():
    """``torch.profiler.profile(activities=[CPU], record_shapes=True)`` entered now; its trace
    stays in memory (nothing is exported). Stopping checks that it recorded events: a profiler
    that recorded nothing would be a false floor."""
    import torch

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
    prof.__enter__()

    def stop():
        prof.__exit__(None, None, None)
        if not prof.events():
            raise RuntimeError("torch.profiler recorded no events")
    return stop
