"""Stand-ins that let real SGLang 0.5.23 serve MoE, MLA, EP, DP-attention and EAGLE-3 models on
a CPU-only test machine (facts: ../shared/sglang-cpu/BEYOND-LLAMA.md), plus the test weights.

Loaded in every SGLang process (the launcher and its spawned schedulers) by the one-line
``tt_sglang_standins.pth`` that tests/sglang/setup.sh installs into the SGLang venv, and only
where ``TT_SGLANG_STANDINS`` names what to apply (tests/sglang/server.py sets it): a comma list of
this package's modules, or ``all``. Untraced and traced servers get the same stand-ins, so the
comparison of their tokens is fair; tensor-trace itself is never imported here.

Each module of this package defines ``PATCHES = {"sglang.module.name": function(module), ...}``.
A function runs right after its SGLang module has been imported (an import hook, since SGLang
imports most of its modules lazily), or at once when it already was. A module not named in
``TT_SGLANG_STANDINS`` is never imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys

MODULES = ("wide_dummy", "dp_attention", "moe_kernels", "mla_backend", "ep_ids", "eagle3")  # what ``all`` applies, in order

_pending: dict[str, list] = {}


def wanted() -> list[str]:
    spec = os.environ.get("TT_SGLANG_STANDINS", "").strip()
    if not spec:
        return []
    if spec == "all":
        return list(MODULES)
    return [m.strip() for m in spec.split(",") if m.strip()]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the patch functions of a module right after the module's own code has run."""

    def find_spec(self, name, path=None, target=None):
        if name not in _pending:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            for fn in _pending.pop(name, ()):
                fn(module)

        spec.loader.exec_module = exec_then_patch
        return spec


def install(names=None) -> None:
    """Register the PATCHES of the given stand-in modules (default: ``wanted()``)."""
    import importlib.util  # noqa: F401  (find_spec above)

    for mod_name in names if names is not None else wanted():
        standin = importlib.import_module(f"{__name__}.{mod_name}")
        for target, fn in standin.PATCHES.items():
            if target in sys.modules:
                fn(sys.modules[target])
            else:
                _pending.setdefault(target, []).append(fn)
    if _pending and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
