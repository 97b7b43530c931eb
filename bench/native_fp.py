"""An experiment, not the tracer: the eager deferred-fingerprint path with its per-tensor work in
C++ (built at first import with ``torch.utils.cpp_extension.load_inline``; needs a C++ compiler
and ninja), to measure on a GPU how much of a traced step's fingerprint cost native code removes
(``bench/fp_ab.py --native``).

What moves to C++ (``Table``): for each held tensor, the checks and the kernel's table row
(address, numel, row layout) are made in the hook, while the tensor is fresh in the CPU's
caches; the table keeps only the tensor's storage (so its memory is not reused before the step's
kernel reads it) and its version counter (so an in-place update is still detected), not the
Python tensor, which dies in the step as it would untraced. The flush builds the pinned buffer
the kernel reads (table, then zeroed output) with no Python per tensor. The Python side keeps
the rest (repeats by identity, immediate values, collect); tensors the table cannot take fall
back to ``tracer/fingerprint.py``'s own path.
"""
from __future__ import annotations

import os

import torch

from tensor_trace.tracer import fingerprint as fpm, multi_tensor

_SRC = r"""
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

struct Table {
  std::vector<int64_t> idx, tab, ver;  // ver: version when held, -1 inference (none)
  std::vector<c10::Storage> keep;
  std::vector<c10::VariableVersion> counters;  // one per entry (disabled for inference tensors)
  std::vector<char> dead;
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
  int64_t bytes = 0;

  // Hold t as fingerprint index i; returns the bytes held, or -1 when t is not one it takes.
  int64_t hold(const at::Tensor& t, int64_t i) {
    auto st = t.scalar_type();
    if (st != at::kFloat && st != at::kHalf && st != at::kBFloat16) return -1;
    if (idx.empty()) {
      dtype = st;
      device = t.device();
    } else if (st != dtype || t.device() != device) {
      return -1;
    }
    int64_t n = t.numel();
    if (n >= (int64_t(1) << 31)) return -1;
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

  // Entries holding t's memory (same address and numel): marked dead; (index, stale) each.
  std::vector<std::pair<int64_t, bool>> materialize(const at::Tensor& t) {
    std::vector<std::pair<int64_t, bool>> out;
    int64_t ptr = reinterpret_cast<int64_t>(t.data_ptr()), n = t.numel();
    for (size_t j = 0; j < idx.size(); ++j) {
      if (dead[j] || tab[4 * j] != ptr || tab[4 * j + 1] != n) continue;
      dead[j] = 1;
      bool stale = ver[j] >= 0 && counters[j].current_version() != ver[j];
      out.emplace_back(idx[j], stale);
    }
    return out;
  }

  // (indices, buffer: table then zeroed output, count, most, stale, dtype code) of the live
  // entries; (None, ...) when none is live. The caller clears the table after the launch.
  py::object flush() {
    std::vector<int64_t> live_idx, live_tab;
    live_idx.reserve(idx.size());
    live_tab.reserve(tab.size());
    int64_t most = 1, stale = 0;
    for (size_t j = 0; j < idx.size(); ++j) {
      if (dead[j]) continue;
      if (ver[j] >= 0 && counters[j].current_version() != ver[j]) { ++stale; continue; }
      live_idx.push_back(idx[j]);
      live_tab.insert(live_tab.end(), tab.begin() + 4 * j, tab.begin() + 4 * j + 4);
      most = std::max(most, tab[4 * j + 1]);
    }
    bool cuda = device.is_cuda();
    at::ScalarType held = dtype;
    // (the storages stay held until clear(), which the caller runs once the kernel that reads
    // them is enqueued: freed earlier, their memory could be handed to the buffer's own copy)
    if (live_idx.empty()) return py::make_tuple(py::none(), py::none(), 0, 0, stale, 0);
    int64_t count = static_cast<int64_t>(live_idx.size());
    auto buf = at::empty({static_cast<int64_t>(live_tab.size()) + count},
                         at::TensorOptions().dtype(at::kLong).pinned_memory(cuda));
    auto* p = buf.data_ptr<int64_t>();
    std::memcpy(p, live_tab.data(), live_tab.size() * sizeof(int64_t));
    std::memset(p + live_tab.size(), 0, count * sizeof(int64_t));
    int code = held == at::kFloat ? 0 : (held == at::kHalf ? 1 : 2);
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
      .def(py::init<>())
      .def("hold", &Table::hold)
      .def("materialize", &Table::materialize)
      .def("flush", &Table::flush)
      .def("clear", &Table::clear)
      .def("size", &Table::size);
}
"""

_EXT: list = []
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def ext():
    """The compiled module (built once per machine and torch version, then loaded)."""
    if not _EXT:
        from torch.utils.cpp_extension import load_inline

        _EXT.append(load_inline(name="tt_native_fp", cpp_sources=[_SRC], extra_cflags=["-O2"],
                                verbose=os.environ.get("TT_NATIVE_VERBOSE") == "1"))
    return _EXT[0]


def launch(idx, buf, count, most, code, device):
    """The eager kernel over a buffer ``Table.flush`` built: [count, 2] fp32 (sum, sumsq)."""
    kernel = multi_tensor._kernel()
    both = buf.to(device, non_blocking=True) if device.type == "cuda" else buf
    n4 = 4 * count
    dev_table = both[:n4]
    out = both[n4:].view(torch.float32).view(count, 2)
    kernel[(count, max(1, -(-most // multi_tensor.CHUNK)))](
        dev_table, out, 0, CHUNK=multi_tensor.CHUNK, BLOCK=multi_tensor.BLOCK,
        DTYPE=multi_tensor._state["tl_dtypes"][_DTYPES[code]], ROWS=True,
        num_warps=multi_tensor.NUM_WARPS)
    return out


class NativeStepFingerprints(fpm.StepFingerprints):
    """``StepFingerprints`` whose eager deferred tensors go into the C++ ``Table``."""

    def reset(self) -> None:
        super().reset()
        if getattr(self, "_nt", None) is None:
            self._nt = ext().Table()
            self._nt_device = None
        else:
            self._nt.clear()

    def _deferrable(self, t) -> bool:
        return (self.defer_cuda and t.is_cuda) or self.defer_cpu

    def add_one(self, t, store: bool = True) -> int:
        if t is self._last and self._last_version is True:
            return self._last_idx
        if not self.capturing and self._deferrable(t):
            idx = self.count
            held = self._nt.hold(t, idx)
            if held >= 0:
                self.count = idx + 1
                if self._nt_device is None:
                    self._nt_device = t.device
                self._last, self._last_idx, self._last_version = t, idx, True
                if held > self.defer_bytes:
                    self._flush_mid_step()
                return idx
        return super().add_one(t, store)

    def _add(self, tensors, store: bool, immediate: bool = False) -> int:
        if (immediate or self.capturing
                or not all(t.dtype in _DTYPES and self._deferrable(t) for t in tensors)):
            return super()._add(tensors, store, immediate)
        base = idx = self.count
        out = [] if store else None
        held = 0
        for t in tensors:
            if not store:
                src = self._recent(t)
                if src >= 0:
                    self._dups.append((idx, src))
                    idx += 1
                    continue
            held = self._nt.hold(t, idx)
            if held < 0:
                self._reduce_now(idx, t)  # another layout, device or dtype: at once
            else:
                if self._nt_device is None:
                    self._nt_device = t.device
                if out is not None:
                    out.append((t, idx))
            idx += 1
        self.count = idx
        if out:
            self._last_out = out
            self._last, self._last_idx = out[-1]
            self._last_version = True
        if held > self.defer_bytes:
            self._flush_mid_step()
        return base

    def materialize(self, tensors) -> None:
        for t in tensors:
            for index, stale in self._nt.materialize(t):
                if stale:
                    self.stale += 1
                else:
                    self._reduce_now(index, t)
        super().materialize(tensors)

    def _reduce_rest(self) -> None:
        if self._nt.size():
            self._flush_deferred()
        super()._reduce_rest()

    def _flush_deferred(self) -> None:
        if not self.capturing:
            idx, buf, count, most, stale, code = self._nt.flush()
            self.stale += stale
            if idx is not None:
                self._blocks.append((idx, launch(idx, buf, count, most, code, self._nt_device), True))
            self._nt.clear()  # the kernel is enqueued: the held memory may go back now
            if self._last_version is True:
                self._last = None
            self._last_out = []
        super()._flush_deferred()
