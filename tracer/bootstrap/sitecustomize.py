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


class _ImportWatcher:
    """A meta-path finder that runs a callback right after chosen modules are first imported:
    ``torch`` starts the tracer; framework modules (SGLang's) get their integration patched in
    before any other module can import names from them."""

    def __init__(self, callbacks):
        self.callbacks = dict(callbacks)  # module name -> callable(module)
        self._busy = False

    def find_spec(self, name, path=None, target=None):
        callback = self.callbacks.get(name)
        if callback is None or self._busy:
            return None
        import importlib.util

        self._busy = True
        try:
            spec = importlib.util.find_spec(name)
        except Exception:
            return None
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        del self.callbacks[name]
        if not self.callbacks:
            try:
                _sys.meta_path.remove(self)
            except ValueError:
                pass
        exec_module = spec.loader.exec_module

        def exec_then_call(module):
            exec_module(module)
            try:
                callback(module)
            except Exception as exc:  # never take the host program down
                try:
                    _sys.stderr.write(f"tensor-trace: {name}: {exc}\n")
                except Exception:
                    pass

        spec.loader.exec_module = exec_then_call
        return spec


def _on_framework_import(module):
    from tensor_trace.tracer import integrations

    integrations.on_import(module.__name__, module)


def _tensor_trace_start():
    try:
        from tensor_trace.tracer import env_start

        env_start.start_from_env()
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
    _callbacks = {"torch": lambda module: _tensor_trace_start()}
    try:
        from tensor_trace.tracer.integrations import WATCHED as _WATCHED
    except Exception:
        _WATCHED = ()
    for _name in _WATCHED:
        _callbacks[_name] = _on_framework_import
    if "torch" in _sys.modules:
        _tensor_trace_start()
        del _callbacks["torch"]
    _sys.meta_path.insert(0, _ImportWatcher(_callbacks))
