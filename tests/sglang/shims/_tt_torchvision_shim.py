"""Let torchvision 0.28.0 (a CUDA build on PyPI) import on a CPU-only torch.

Installed into the SGLang test venv's site-packages by tests/sglang/setup.sh, together with
torchvision_ops.pth, whose single line `import _tt_torchvision_shim` runs at every interpreter
start (SGLang's spawned TP workers included).

Why: torchvision's `_C.so` cannot load against the CPU torch, so its ops are never defined and
`torchvision/_meta_registrations.py` dies with `RuntimeError: operator torchvision::nms does not
exist`. SGLang only imports torchvision (for image decoding); it never runs NMS. Defining the two
op schemas that `_meta_registrations.py` registers fake kernels for makes the import succeed.

Cost: nothing is imported at interpreter start. A `sys.meta_path` finder waits for the first
`import torchvision`, then (once) defines the schemas and steps aside, so pip, the launcher and
any process that never touches torchvision do not pay for importing torch here.

Guard: if the ops already exist, or torchvision's own `_C` extension loads (a build that matches
torch), nothing is defined.
"""

import sys

# Schemas as torchvision itself defines them:
#   torchvision/csrc/ops/nms.cpp:                    nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor
#   torchvision/csrc/ops/quantized/cpu/qnms_kernel.cpp: qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor
SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}

_library = None  # the torch.library.Library must stay alive, or its definitions are dropped
_done = False


def _op_exists(torch, name):
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False


def _try_load_real_extension(torch):
    """Load torchvision's own _C if it works with this torch (then its ops are real)."""
    import importlib.machinery
    from pathlib import Path

    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    for location in spec.submodule_search_locations:
        for so in sorted(Path(location).glob("_C*.so")):
            try:
                torch.ops.load_library(str(so))
                return
            except (OSError, RuntimeError):
                continue


def define_missing_schemas():
    """Define torchvision::nms and torchvision::qnms if they do not exist. Idempotent."""
    global _library, _done
    if _done:
        return
    _done = True
    import torch

    if all(_op_exists(torch, name) for name in SCHEMAS):
        return
    _try_load_real_extension(torch)
    missing = [name for name in SCHEMAS if not _op_exists(torch, name)]
    if not missing:
        return
    kind = "DEF" if len(missing) == len(SCHEMAS) else "FRAGMENT"
    library = torch.library.Library("torchvision", kind)
    for name in missing:
        library.define(SCHEMAS[name])
    _library = library


class _BeforeTorchvision:
    """Meta path finder: runs define_missing_schemas() right before torchvision is imported."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            _uninstall()
            try:
                define_missing_schemas()
            except Exception as exc:  # never break the import itself; torchvision will say why
                print(f"[tensor-trace torchvision shim] could not define schemas: {exc!r}", file=sys.stderr)
        return None  # let the normal finders import torchvision


def _uninstall():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _BeforeTorchvision)]


def install():
    if "torchvision" in sys.modules:
        return
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())


install()
