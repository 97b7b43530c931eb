"""What the in-process CPU benchmarks run beside the tracer: the floor of any hook-based tracer
(two empty global forward hooks) and what a user would pick instead (``torch.profiler`` with
shapes recorded). Each starts it and returns the callable that stops it."""
from __future__ import annotations


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
