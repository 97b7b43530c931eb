"""Optional C++ for the eager fingerprint path, opt-in with ``TENSOR_TRACE_NATIVE=1``.

A traced eager GPU step holds a few hundred tensors for its fingerprint kernel; in Python each
costs a dozen tensor attribute reads in the hook and again at the step's end, when they are
cold in the CPU's caches. ``Table`` does that work in C++: in the hook it checks the tensor and
records the kernel's table row (address, numel, row layout), its storage (so the memory is not
reused before the kernel reads it) and its version counter (an in-place update is still seen);
the Python tensor is not kept, so it dies in the step as it would untraced. At the step's end it
builds the kernel's pinned buffer with no Python per tensor. The rest (repeats, immediate
values, collecting) stays in ``tracer/fingerprint.py``; a tensor the table does not take (another
dtype or device, another layout, too large) takes the Python path.

Built with ``torch.utils.cpp_extension.load_inline`` (a C++ compiler and ninja are needed) into
torch's extension cache, once per machine and torch version (about 25 s on 2 cores, 30 s on the
H200 host; ranks building at once wait for one another). ``ensure()`` loads or builds it in a
background thread: a process uses the Python path until it is ready, and any failure is
reported once on stderr and leaves the Python path in place. Measured in bench/RESULTS.md
(``bench/fp_ab.py --native``, ``bench/native_proxy.py``).
"""

from __future__ import annotations

import os
import sys
import threading

SOURCE = r"""
#include <torch/extension.h>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

bool row_layout(const at::Tensor& t, int64_t& cols, int64_t& rstride) {
  auto sizes = t.sizes();
  auto strides = t.strides();
  int64_t nd = static_cast<int64_t>(sizes.size());
  if (nd < 2 || strides[nd - 1] != 1) return false;
  int64_t row = -1, expect = -1;
  for (int64_t d = nd - 2; d >= 0; --d) {
    int64_t n = sizes[d];
    if (n == 1) continue;
    if (row < 0) row = strides[d];
    else if (strides[d] != expect) return false;
    expect = strides[d] * n;
  }
  if (row < 0) return false;
  cols = sizes[nd - 1];
  rstride = row;
  return true;
}

// The deferred tensors of one step on one device: see tracer/native.py.
struct Table {
  int64_t max_numel;
  c10::Device device;
  std::vector<int64_t> idx, tab, ver;  // ver: version when held, -1 without one (inference)
  std::vector<c10::Storage> keep;
  std::vector<c10::VariableVersion> counters;
  std::vector<char> dead;
  at::ScalarType dtype = at::kFloat;
  int64_t bytes = 0;

  Table(int64_t max_numel_, c10::Device device_) : max_numel(max_numel_), device(device_) {}

  // Hold t as fingerprint index i: the bytes held then, or -1 when t is not one it takes.
  int64_t hold(const at::Tensor& t, int64_t i) {
    // dense tensors with memory of their own only (not sparse, meta or wrapper subclasses)
    if (t.layout() != c10::kStrided || !t.has_storage() || t.is_meta()) return -1;
    auto st = t.scalar_type();
    if (st != at::kFloat && st != at::kHalf && st != at::kBFloat16) return -1;
    if (t.device() != device) return -1;
    if (idx.empty()) dtype = st;
    else if (st != dtype) return -1;
    int64_t n = t.numel();
    if (n > max_numel || n >= (int64_t(1) << 31)) return -1;
    int64_t cols = n, rs = n;
    if (!t.is_contiguous() && !row_layout(t, cols, rs)) return -1;
    idx.push_back(i);
    int64_t e[4] = {reinterpret_cast<int64_t>(t.data_ptr()), n, cols, rs};
    tab.insert(tab.end(), e, e + 4);
    keep.push_back(t.storage());
    if (t.is_inference()) {
      counters.emplace_back(c10::VariableVersion(c10::VariableVersion::DISABLED));
      ver.push_back(-1);
    } else {
      counters.push_back(t.unsafeGetTensorImpl()->version_counter());
      ver.push_back(counters.back().current_version());
    }
    dead.push_back(0);
    bytes += n * static_cast<int64_t>(t.element_size());
    return bytes;
  }

  // The entries holding t's memory (same address and numel), which a collective is about to
  // update in place: marked dead; (index, stale) for each.
  std::vector<std::pair<int64_t, bool>> materialize(const at::Tensor& t) {
    std::vector<std::pair<int64_t, bool>> out;
    if (idx.empty()) return out;
    int64_t ptr = reinterpret_cast<int64_t>(t.data_ptr()), n = t.numel();
    for (size_t j = 0; j < idx.size(); ++j) {
      if (dead[j] || tab[4 * j] != ptr || tab[4 * j + 1] != n) continue;
      dead[j] = 1;
      bool stale = ver[j] >= 0 && counters[j].current_version() != ver[j];
      out.emplace_back(idx[j], stale);
    }
    return out;
  }

  // (indices, buffer: table then zeroed output, count, largest numel, stale, dtype code) of the
  // live entries; indices None when none is live. The storages stay held until clear(), which
  // the caller runs once the kernel that reads them is enqueued (freed earlier, their memory
  // could be handed to the buffer's own device copy).
  py::tuple flush() {
    std::vector<int64_t> live_idx, live_tab;
    live_idx.reserve(idx.size());
    live_tab.reserve(tab.size());
    int64_t most = 1, stale = 0;
    for (size_t j = 0; j < idx.size(); ++j) {
      if (dead[j]) continue;
      if (ver[j] >= 0 && counters[j].current_version() != ver[j]) {
        ++stale;
        continue;
      }
      live_idx.push_back(idx[j]);
      live_tab.insert(live_tab.end(), tab.begin() + 4 * j, tab.begin() + 4 * j + 4);
      most = std::max(most, tab[4 * j + 1]);
    }
    int code = dtype == at::kFloat ? 0 : (dtype == at::kHalf ? 1 : 2);
    if (live_idx.empty()) return py::make_tuple(py::none(), py::none(), 0, 0, stale, code);
    int64_t count = static_cast<int64_t>(live_idx.size());
    auto buf = at::empty({static_cast<int64_t>(live_tab.size()) + count},
                         at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda()));
    auto* p = buf.data_ptr<int64_t>();
    std::memcpy(p, live_tab.data(), live_tab.size() * sizeof(int64_t));
    std::memset(p + live_tab.size(), 0, count * sizeof(int64_t));
    return py::make_tuple(py::cast(live_idx), buf, count, most, stale, code);
  }

  void clear() {
    idx.clear(); tab.clear(); ver.clear(); keep.clear(); counters.clear(); dead.clear();
    bytes = 0;
  }

  int64_t size() const { return static_cast<int64_t>(idx.size()); }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Table>(m, "Table")
      .def(py::init<int64_t, c10::Device>())
      .def("hold", &Table::hold)
      .def("materialize", &Table::materialize)
      .def("flush", &Table::flush)
      .def("clear", &Table::clear)
      .def("size", &Table::size)
      .def_readonly("device", &Table::device);
}
"""

_state: dict = {"table": None, "started": False, "error": None}
_lock = threading.Lock()


def enabled() -> bool:
    """Whether this process asked for the C++ table (``TENSOR_TRACE_NATIVE=1``)."""
    return os.environ.get("TENSOR_TRACE_NATIVE") == "1"


def table_class():
    """The compiled ``Table`` class, or None (not asked for, not ready yet, or unavailable)."""
    return _state["table"]


def error():
    """Why the extension is unavailable (after a failed build), else None."""
    return _state["error"]


def ensure(block: bool = False) -> None:
    """Load the extension, building it first if needed: now when ``block``, else in a
    background thread. Does nothing unless enabled, or after the first call."""
    if not enabled() or _state["started"]:
        return
    with _lock:
        if _state["started"]:
            return
        _state["started"] = True
    if block:
        _build()
    else:
        threading.Thread(target=_build, name="tensor-trace-native", daemon=True).start()


def _after_fork_in_child() -> None:
    # A build thread of the parent does not exist in the child: look again when asked.
    if _state["table"] is None and _state["error"] is None:
        _state["started"] = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _build() -> None:
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(name="tensor_trace_native", cpp_sources=[SOURCE],
                             extra_cflags=["-O2"], verbose=False)
        _state["table"] = module.Table
    except Exception as exc:  # no compiler, no ninja, no headers: the Python path stays
        _state["error"] = repr(exc)
        sys.stderr.write(f"tensor-trace: the native fingerprint table is unavailable "
                         f"({exc!r:.300}); fingerprints take the Python path\n")
