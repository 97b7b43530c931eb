"""C++ for the tracer's hottest per-call work, on by default where it can be built.

``TENSOR_TRACE_NATIVE``: ``1`` always, ``0`` never, unset or ``auto`` where CUDA is available or
the machine has what the build needs (a C++ compiler, ninja, Python's headers): on a GPU host
it cuts a step's host time, on a CPU the per-call cost that dominates a small model's traced
step (bench/record_cpu.py). A CPU-only machine without that toolchain is spared a compiler run
that could only fail, and says nothing.

- ``pair_key(a, b)``: the layout key of the common span (one tensor in, one out) as one int,
  read from the TensorImpls, instead of six attribute reads and a tuple hash in Python
  (about 0.75 of a traced call's 3.2 us on a CPU; ``bench/overhead.py --workload linear-chain``).
- ``traced_call``: ``torch.nn.Module.__call__`` in C for a traced step's common calls
  (tracer/native_call.py), which tracer/intercept.py's ``CallWrapper`` puts in the call slot of
  the modules' classes once this is built: no Python frame of the tracer's per such call.
- ``traced_collective``: a traced c10d collective's common case in C (tracer/native_coll.py),
  which tracer/collectives.py's wrappers call first once this is built.
- ``host_pair`` and ``nonzero_rows``: a CPU tensor's fingerprint pair and a collective input's
  nonzero rows read in C (tracer/native_host.py), which tracer/host_values.py asks before numpy.
- ``Table``: the eager fingerprint path's deferred tensors (C++ in tracer/native_table.py). A traced eager GPU step holds a few
  hundred tensors for its fingerprint kernel; in Python each costs a dozen tensor attribute
  reads in the hook and again at the step's end, when they are cold in the CPU's caches. The
  table does that work in C++: in the hook it checks the tensor and records the kernel's table
  row (address, numel, row layout), its storage (so the memory is not reused before the
  kernel reads it) and its version counter (an in-place update is still seen); the Python
  tensor is not kept, so it dies in the step as it would untraced. At the step's end it builds
  the kernel's pinned buffer with no Python per tensor. The rest (repeats, immediate values,
  collecting) stays in ``tracer/fingerprint.py`` and its ``fingerprint_*.py``; a tensor the table does not take (another
  dtype or device, another layout, too large, a subclass) takes the Python path.

Built with ``torch.utils.cpp_extension.load_inline`` (a C++ compiler and ninja are needed) into
torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default under ``~/.cache``), once per
machine, Python and torch version: about 25 s of one core, 20 to 30 s on the H200 host. A
process's first traced step starts it from a background thread, which runs the compiler in an
untraced child process of its own session, at the lowest CPU priority (``nice`` 19: on a CPU
box the compiler shares the cores with the traced run that started it): a traced process that
exits first does not take the build with it, and the next one loads the finished build at once.
The traced program never waits for the compiler: the process uses the Python path until the
build is ready (the first traced run on a machine, or most of it, is traced in Python). Ranks
building at once wait for one another (an flock, which a killed holder releases); a rank that
finds the build done once it holds the lock leaves at once. A failed build is reported once on
stderr, by the process that ran it, with the log's path, and leaves the Python path in place;
it is marked in the build folder, so that later processes under ``auto`` take the Python path
at once instead of compiling again (``TENSOR_TRACE_NATIVE=1`` tries again; so does a new
source or torch version). Measured in bench/RESULTS.md (``bench/fp_ab.py``, its ``--cpu-model``, and
``bench/overhead.py --workload linear-chain``).
"""

from __future__ import annotations

import os
import sys
import threading

from tensor_trace.tracer import native_call, native_call_type, native_coll, native_coll_type, native_modules, native_spans, native_table
from tensor_trace.tracer import native_counters, native_host
from tensor_trace.tracer import native_build
from tensor_trace.tracer.native_build import build_directory, missing_toolchain

SOURCE = r"""
#include <torch/extension.h>
#include <structmember.h>
#include <algorithm>
#include <cmath>
#include <ctime>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// -- pair_key: the (shape, dtype, device) of two tensors as one small int ----------------------
// The hooks' common span has one tensor in and one out; its layout is looked up by these six
// values, which from Python cost six attribute reads (torch.Size and device objects made each
// time) and a tuple hash: about 0.75 us of a traced call's 3. Here they are read from the
// TensorImpl and matched exactly (no hash collision can alias two layouts) in one map for the
// process; the same metadata always gets the same int.
struct KeyHash {
  size_t operator()(const std::vector<int64_t>& v) const {
    size_t h = 1469598103934665603ULL;
    for (int64_t x : v) h = (h ^ static_cast<size_t>(x)) * 1099511628211ULL;
    return h;
  }
};

// never freed: process-wide tables read until the interpreter exits
auto* pair_ids = new std::unordered_map<std::vector<int64_t>, int64_t, KeyHash>();
auto* call_ids = new std::unordered_map<std::vector<int64_t>, int64_t, KeyHash>();
auto* kw_ids = new std::unordered_map<std::string, int64_t>();
std::vector<int64_t>& key_buf = *new std::vector<int64_t>();

// A plain torch.Tensor or Parameter (a subclass may report other shapes: the caller's Python).
bool put_meta(PyObject* o) {
  if (!THPVariable_CheckExact(o)) return false;
  const at::Tensor& t = THPVariable_Unpack(o);
  try {
    auto* impl = t.unsafeGetTensorImpl();
    if (impl->is_nested() || impl->has_symbolic_sizes_strides()) return false;
    auto sizes = t.sizes();
    key_buf.push_back(static_cast<int64_t>(sizes.size()));
    key_buf.insert(key_buf.end(), sizes.begin(), sizes.end());
    key_buf.push_back(static_cast<int64_t>(t.scalar_type()));
    auto d = t.device();
    key_buf.push_back((static_cast<int64_t>(d.type()) << 16) | (static_cast<int64_t>(d.index()) & 0xffff));
    return true;
  } catch (...) {  // any tensor whose sizes cannot be read so: the caller's Python key
    return false;
  }
}

int64_t id_of(std::unordered_map<std::vector<int64_t>, int64_t, KeyHash>* ids) {
  auto it = ids->find(key_buf);
  if (it != ids->end()) return it->second;
  int64_t id = static_cast<int64_t>(ids->size());
  ids->emplace(key_buf, id);
  return id;
}

// pair_key(a, b): an int (>= 0) standing for a's and b's (shape, dtype, device), or -1 for a
// tensor it does not read (a subclass, nested, symbolic sizes, not a tensor). Under the GIL.
int64_t pair_id(PyObject* a, PyObject* b) {
  key_buf.clear();
  return put_meta(a) && put_meta(b) ? id_of(pair_ids) : -1;
}

PyObject* pair_key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return PyLong_FromLongLong(nargs == 2 ? pair_id(args[0], args[1]) : -1);
}

// What spans.record_tensors skips: None, int, float, str (bool is an int) and the
// registered batch-context types. 1 plain, 0 not, -1 error (raised).
int plain(PyObject* o, PyObject* context) {
  if (o == Py_None || PyLong_Check(o) || PyFloat_Check(o) || PyUnicode_Check(o)) return 1;
  return PySet_Contains(context, reinterpret_cast<PyObject*>(Py_TYPE(o)));
}

// Slot tags in a call key, each followed by the tensor's metadata: position i >= 0 for
// arguments, kKeyword - id for keyword arguments, -1 a tensor result, -2 - j item j of a
// tuple or list result.
constexpr int64_t kKeyword = -(int64_t(1) << 40);

// Items of a tuple or list one level down (an argument ``input.i.j``, an item of a result
// ``output.j.k``, as tensor_slots.flatten names them): kNestedArg + (i << 20) + j, and
// kNestedOut - (j << 20) - k. A longer sequence than kMaxNested, or a deeper one: the caller's
// Python (whose walk caps a call's tensors at tensor_slots.MAX_TENSORS).
constexpr int64_t kNestedArg = int64_t(1) << 44;
constexpr int64_t kNestedOut = -(int64_t(1) << 46);
constexpr Py_ssize_t kMaxNested = 64;

// The items of the exact tuple or list `seq` at tags base + sign * j: tensors keyed, None and
// numbers and strings no slot (what spans.record_tensors skips inside a sequence). 1 done, 0 not
// such a sequence.
int put_nested(int64_t base, int64_t sign, PyObject* seq) {
  Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
  if (m > kMaxNested) return 0;
  for (Py_ssize_t j = 0; j < m; ++j) {
    PyObject* x = PySequence_Fast_GET_ITEM(seq, j);
    key_buf.push_back(base + sign * j);
    if (put_meta(x)) continue;
    key_buf.pop_back();
    if (!(x == Py_None || PyLong_Check(x) || PyFloat_Check(x) || PyUnicode_Check(x))) return 0;
  }
  return 1;
}

// One argument at slot `tag`: a tensor (its slot and metadata keyed), or a plain value (no
// slot), or a tuple or list of those (put_nested). 1 done, 0 neither (the caller's Python
// decides), -1 error (raised).
int put_argument(int64_t tag, PyObject* x, PyObject* context) {
  key_buf.push_back(tag);
  if (put_meta(x)) return 1;
  key_buf.pop_back();
  int p = plain(x, context);
  if (p == 0 && tag >= 0 && tag < (int64_t(1) << 20) && (PyTuple_CheckExact(x) || PyList_CheckExact(x)))
    return put_nested(kNestedArg + (tag << 20), 1, x);
  return p < 0 ? -1 : p;
}

// call_key(args, kwargs, result, context): an int (>= 0) standing for the layout that
// spans.record_tensors would build for this call, or -1 where it would not record it
// (another kind of argument or result) or a tensor is not read here: the caller's Python then
// decides. Under the GIL. call_id: the same as a C value, -2 for an error (raised).
int64_t call_id(PyObject* args, PyObject* kwargs, PyObject* result, PyObject* context);

PyObject* call_key(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_Check(a[0]) || !PySet_Check(a[3])) return PyLong_FromLongLong(-1);
  int64_t id = call_id(a[0], a[1], a[2], a[3]);
  return id == -2 ? nullptr : PyLong_FromLongLong(id);
}

int64_t call_id(PyObject* args, PyObject* kwargs, PyObject* result, PyObject* context) {
  key_buf.clear();
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  for (Py_ssize_t i = 0; i < n; ++i) {
    int r = put_argument(i, PyTuple_GET_ITEM(args, i), context);
    if (r < 0) return -2;
    if (r == 0) return -1;
  }
  if (kwargs != Py_None) {
    if (!PyDict_Check(kwargs)) return -1;
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs, &pos, &k, &v)) {
      if (!PyUnicode_Check(k)) return -1;
      Py_ssize_t len;
      const char* name = PyUnicode_AsUTF8AndSize(k, &len);
      if (name == nullptr) return -2;
      std::string s(name, static_cast<size_t>(len));
      auto it = kw_ids->find(s);
      int64_t kid;
      if (it == kw_ids->end()) {
        kid = static_cast<int64_t>(kw_ids->size());
        kw_ids->emplace(std::move(s), kid);
      } else {
        kid = it->second;
      }
      int r = put_argument(kKeyword - kid, v, context);
      if (r < 0) return -2;
      if (r == 0) return -1;
    }
  }
  if (result != Py_None) {
    key_buf.push_back(-1);
    if (!put_meta(result)) {
      key_buf.pop_back();
      if (!PyTuple_CheckExact(result) && !PyList_CheckExact(result)) return -1;
      PyObject* seq = result;
      Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
      for (Py_ssize_t j = 0; j < m; ++j) {
        PyObject* r = PySequence_Fast_GET_ITEM(seq, j);
        key_buf.push_back(-2 - j);
        if (put_meta(r)) continue;
        key_buf.pop_back();
        if ((PyTuple_CheckExact(r) || PyList_CheckExact(r)) && j < (Py_ssize_t(1) << 20)) {
          if (!put_nested(kNestedOut - (static_cast<int64_t>(j) << 20), -1, r)) return -1;
          continue;
        }
        if (!(r == Py_None || PyLong_Check(r) || PyFloat_Check(r) || PyUnicode_Check(r)))
          return -1;
      }
    }
  }
  return id_of(call_ids);
}

PyMethodDef pair_key_def = {"pair_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(pair_key)),
                            METH_FASTCALL, "pair_key(a, b) -> int: see tracer/native.py"};
PyMethodDef call_key_def = {"call_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(call_key)),
                            METH_FASTCALL, "call_key(args, kwargs, result, context) -> int: see tracer/native.py"};


"""  # the source goes on with tracer/native_table.py's, native_host.py's, native_counters.py's,
# native_call.py's, native_modules.py's, native_spans.py's and native_call_type.py's
_SOURCE_END = r"""
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  if (!ready_traced_call() || !ready_span_run() || !ready_traced_collective() || !ready_step_counters() ||
      !ready_host_values())
    throw py::error_already_set();
  py::class_<Table>(m, "Table")
      .def(py::init<int64_t, c10::Device>())
      .def("hold", &Table::hold)
      .def("materialize", &Table::materialize)
      .def("flush", &Table::flush)
      .def("clear", &Table::clear)
      .def("size", &Table::size)
      .def_readonly("slot", &Table::slot)
      .def_readonly("device", &Table::device);
  m.attr("hold_in") = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&hold_in_def, nullptr, nullptr));
  m.attr("pair_key") = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&pair_key_def, nullptr, nullptr));
  m.attr("call_key") = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&call_key_def, nullptr, nullptr));
  m.attr("host_pair") = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&host_pair_def, nullptr, nullptr));
  m.attr("nonzero_rows") = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&nonzero_rows_def, nullptr, nullptr));
  m.attr("add_one_host") = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&add_one_host_def, nullptr, nullptr));
  m.attr("add_host") = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&add_host_def, nullptr, nullptr));
  m.attr("coll_fp_inputs_host") = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&coll_fp_inputs_host_def, nullptr, nullptr));
  m.attr("coll_fp_outputs_host") = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&coll_fp_outputs_host_def, nullptr, nullptr));
  m.attr("traced_call") = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&traced_call_def, nullptr, nullptr));
  m.attr("traced_collective") = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&traced_collective_def, nullptr, nullptr));
  m.attr("SpanRun") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&SpanRunType));
  m.attr("StepCounters") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&StepCountersType));
  m.attr("patch_call_slots") = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&patch_call_slots_def, nullptr, nullptr));
}
"""
SOURCE = (SOURCE + native_table.SOURCE + native_host.SOURCE + native_counters.SOURCE + native_call.SOURCE + native_modules.SOURCE + native_spans.SOURCE
          + native_call_type.SOURCE + native_coll.SOURCE + native_coll_type.SOURCE + _SOURCE_END)

_state: dict = {"span_run": None, "step_counters": None, "table": None, "hold_in": None, "pair_key": None, "call_key": None,
                "traced_call": None, "patch_call_slots": None, "host_values": None, "add_one_host": None, "coll_fp_host": None, "traced_collective": None, "started": False,
                "error": None}
_lock = threading.Lock()
_done = threading.Event()  # set when a build or load has finished, either way


def enabled(mode: str | None = None) -> bool:
    """Whether this process uses the extension (``TraceConfig.native``, by default
    ``TENSOR_TRACE_NATIVE``): ``1`` yes, ``0`` no; ``auto`` (the default), yes where CUDA is
    available (a GPU step's host time is what it cuts) or where the machine can build it (a C++
    compiler, ninja and Python's headers; on a CPU it cuts the per-call cost that dominates a
    small model's traced step), unless a build of this source failed here already (the
    process that ran it said so). A CPU-only machine without that toolchain is spared a
    compiler run that could only fail. Yes does not mean ready: see ``ensure``."""
    if mode is None:
        from tensor_trace.tracer.config import native_from_env

        mode = native_from_env()
    if mode == "1":
        return True
    if mode != "auto" and mode != "":
        return False
    if _state.get("auto") is None:
        _state["auto"] = _auto()
    return _state["auto"]


def _stamp() -> str:
    return native_build.stamp_of(SOURCE)


def _built(folder: str) -> bool:
    """Whether ``folder`` holds a finished build of this source."""
    return native_build.built(folder, _stamp())


def _auto() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except Exception:
        return False
    try:
        return missing_toolchain() is None and not native_build.failed(build_directory(), _stamp())
    except Exception:  # (no folder name to read: no build to try either)
        return False


def table_class():
    """The compiled ``Table`` class, or None (not asked for, not ready yet, or unavailable)."""
    return _state["table"]


def pair_key():
    """The compiled ``pair_key(a, b)`` (an int standing for both tensors' shape, dtype and
    device, -1 for tensors it does not read), or None (not asked for, not ready, unavailable)."""
    return _state["pair_key"]


def hold_in():
    """The compiled ``hold_in(slot, t, i)``: ``Table.hold(t, i)`` of the table whose ``slot``
    is given, without pybind's method dispatch; or None."""
    return _state["hold_in"]


def call_key():
    """The compiled ``call_key(args, kwargs, result, context)`` (an int standing for the layout
    of a call of tensors and plain values, -1 where the caller's Python decides), or None."""
    return _state["call_key"]


def host_values():
    """The compiled ``(host_pair, nonzero_rows, add_host)`` of tracer/native_host.py (a CPU
    tensor's fingerprint pair and nonzero rows read in C, and ``StepFingerprints.add``'s case of
    one such tensor; None for a tensor they do not take), or None."""
    return _state["host_values"]


def add_one_host():
    """The compiled ``add_one_host(fps, t, store)`` (tracer/native_host.py: the C call wrapper's
    ``StepFingerprints.add_one`` for a CPU tensor; None where add_one must take it), or None. For
    tests: the C call wrapper calls it in C."""
    return _state["add_one_host"]


def coll_fp_host():
    """The compiled ``(coll_fp_inputs_host, coll_fp_outputs_host)`` (tracer/native_host.py: a
    collective's ``fp_inputs`` and ``fp_outputs`` for CPU tensors; None where those must take
    them), or None. For tests: tracer/native_coll.py's C path calls them in C."""
    return _state["coll_fp_host"]


def traced_call():
    """The compiled ``traced_call(...)``, which makes tracer/native_call.py's ``TracedCall``
    (``torch.nn.Module.__call__`` in C for a traced step's common calls), or None."""
    return _state["traced_call"]


def traced_collective():
    """The compiled ``traced_collective(...)``, which makes tracer/native_coll.py's
    ``TracedCollective`` (a traced c10d collective's common case in C), or None."""
    return _state["traced_collective"]


def span_run_class():
    """The compiled ``SpanRun`` (tracer/native_spans.py: packed spans queued as one item of a
    writer's ``pending``), or None."""
    return _state["span_run"]


def step_counters_class():
    """The compiled ``StepCounters`` (tracer/native_counters.py: a step's span and call counters,
    which the C call wrapper counts in), or None."""
    return _state["step_counters"]


def patch_call_slots():
    """The compiled ``patch_call_slots(traced_call, base, classes)`` (tracer/native_call.py), or None."""
    return _state["patch_call_slots"]


def error():
    """Why the extension is unavailable (after a failed build), else None."""
    return _state["error"]


def ensure(block: bool = False, timeout: float | None = 900.0) -> None:
    """Load the extension, building it first if needed, in a background thread; with
    ``block``, return once that is done (also when another call started it) or ``timeout``
    seconds have passed. Does nothing unless enabled."""
    if not enabled():
        return
    if not _state["started"]:
        with _lock:
            if not _state["started"]:
                _state["started"] = True
                threading.Thread(target=_build, name="tensor-trace-native", daemon=True).start()
    if block:
        _done.wait(timeout)


def _after_fork_in_child() -> None:
    # A build thread of the parent does not exist in the child: look again when asked.
    global _done
    if _state["table"] is None and _state["error"] is None:
        _state["started"] = False
        _done = threading.Event()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Unavailable(Exception):
    pass


def _build() -> None:
    quiet = False
    try:
        folder = build_directory()
        os.makedirs(folder, exist_ok=True)
        if not _built(folder):
            try:
                status = native_build.build_detached(folder, _stamp())
            except Exception:  # (no child: the build below runs in this process)
                status = None
            if status == native_build.CHILD_MARKED:
                quiet = True
                raise _Unavailable(f"a build of this source failed in {folder} before")
            if status == native_build.CHILD_FAILED:
                raise _Unavailable(f"the build failed: {os.path.join(folder, 'tensor_trace.build.log')}")
        module = native_build.load(folder, SOURCE)
        _state["span_run"] = module.SpanRun
        _state["step_counters"] = module.StepCounters
        _state["call_key"] = module.call_key
        _state["traced_call"] = module.traced_call
        _state["patch_call_slots"] = module.patch_call_slots
        _state["traced_collective"] = module.traced_collective
        _state["hold_in"] = module.hold_in
        _state["pair_key"] = module.pair_key
        _state["host_values"] = (module.host_pair, module.nonzero_rows, module.add_host)
        _state["add_one_host"] = module.add_one_host
        _state["coll_fp_host"] = (module.coll_fp_inputs_host, module.coll_fp_outputs_host)
        _state["table"] = module.Table
    except Exception as exc:  # no compiler, no ninja, no headers: the Python path stays
        _state["error"] = repr(exc)
        if not quiet:
            sys.stderr.write(f"tensor-trace: the native extension is unavailable ({exc!r:.300}); "
                             f"the tracer takes its Python path (TENSOR_TRACE_NATIVE=0: never try; "
                             f"=1: try again after a failed build)\n")
    finally:
        _done.set()


if __name__ == "__main__":  # native_build.build_detached's child: python -m ... FOLDER STAMP
    try:
        sys.exit(native_build.main(sys.argv[1], sys.argv[2], SOURCE))
    except Exception:
        import traceback

        traceback.print_exc()  # (into the build's log)
        sys.exit(native_build.CHILD_FAILED)
