# tensor-trace bootstrap. `tensor-trace record` puts this folder first on PYTHONPATH, so every
# Python process of the traced command (torchrun workers, multiprocessing spawn/forkserver
# children, subprocess children) imports it at start-up. It must stay cheap and never fail:
# it runs any sitecustomize that it shadows, then waits for `import torch` to start tracing.
import os as _os
import sys as _sys


def _tensor_trace_chain():
    import importlib.machinery
    import importlib.util

    here = _os.path.dirname(_os.path.abspath(__file__))
    rest = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    _sys.modules["_tensor_trace_chained_sitecustomize"] = module
    spec.loader.exec_module(module)


class _TorchImportWatcher:
    """A meta-path finder that runs the tracer right after the first ``import torch``."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        import importlib.util

        try:
            _sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_trace(module):
            exec_module(module)
            _tensor_trace_start()

        spec.loader.exec_module = exec_then_trace
        return spec


def _tensor_trace_start():
    try:
        from tensor_trace.tracer import auto

        auto.start_from_env()
    except Exception as exc:  # never take the host program down
        try:
            _sys.stderr.write(f"tensor-trace: tracing not started in pid {_os.getpid()}: {exc}\n")
        except Exception:
            pass


try:
    _tensor_trace_chain()
except Exception as _exc:
    _sys.stderr.write(f"tensor-trace: the shadowed sitecustomize failed: {_exc}\n")

if _os.environ.get("TENSOR_TRACE_DIR"):
    if "torch" in _sys.modules:
        _tensor_trace_start()
    else:
        _sys.meta_path.insert(0, _TorchImportWatcher())
