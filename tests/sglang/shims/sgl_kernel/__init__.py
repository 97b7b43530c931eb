"""Stand-in for sgl_kernel, for running real SGLang 0.5.23 on a CPU-only test machine.

With SGLANG_USE_CPU_ENGINE=1, SGLang does `from sgl_kernel import copy_all_layer_kv_cache_cpu`
(and a few `*_cpu` speculative-decoding helpers: assign_extend_cache_locs_cpu,
build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu, assign_draft_cache_locs_contiguous_cpu,
fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu). The CPU build of sgl-kernel is not on PyPI
(the PyPI wheel is CUDA-only) and needs AVX512/AMX. On a CPU without AMX, a tiny Llama served with
the torch_native attention backend only imports those names and never calls them, so every name
here resolves to a function that raises NotImplementedError if it ever is called.

NOT installed into any site-packages (it must never shadow a real sgl_kernel): whoever launches
the server puts this folder's parent, tests/sglang/shims, on PYTHONPATH (tests/sglang/server.py
does). SGLang's TP workers are spawned and inherit PYTHONPATH from the environment.
"""

__version__ = "0.0.0+tensor-trace-cpu-stub"
TENSOR_TRACE_STUB = True


def _stub(name):
    def not_implemented(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: this is tensor-trace's CPU test stand-in for sgl_kernel "
            "(tests/sglang/shims/sgl_kernel); the real kernel is not available on this machine"
        )

    not_implemented.__name__ = name
    not_implemented.__qualname__ = name
    return not_implemented


def __getattr__(name):
    # Dunder and private probes (copy, pickle, inspect, importlib) must see a plain module.
    if name.startswith("_"):
        raise AttributeError(name)
    fn = _stub(name)
    globals()[name] = fn
    return fn
