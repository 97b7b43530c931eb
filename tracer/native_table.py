"""C++ for the eager fingerprint path's deferred tensors: ``Table`` and ``hold_in`` (tracer/native.py
says what they do, and builds them with the rest of the extension)."""

SOURCE = r"""
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

  int64_t slot;  // in `tables`: hold_in(slot, t, i) reaches it without pybind's dispatch

  Table(int64_t max_numel_, c10::Device device_);
  ~Table();
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  // Hold t as fingerprint index i: the bytes held then, or -1 when t is a dense tensor it does
  // not take, -2 when t is not dense (sparse, nested, meta, no storage): the caller then reads
  // its values as tracer/kinds.py says, never its memory.
  int64_t hold(const at::Tensor& t, int64_t i) {
    if (t.layout() != c10::kStrided || !t.has_storage() || t.is_meta() || t.is_nested()) return -2;
    auto st = t.scalar_type();
    if (st != at::kFloat && st != at::kHalf && st != at::kBFloat16) return -1;
    if (t.device() != device) return -1;
    if (idx.empty()) dtype = st;
    else if (st != dtype) return -1;
    int64_t n = t.numel();
    if (n > max_numel || n >= (int64_t(1) << 31)) return -1;
    int64_t cols = n, rs = n;
    if (!t.is_contiguous() && !row_layout(t, cols, rs)) return -1;
    const void* ptr = t.data_ptr();
    if (ptr == nullptr) return -1;  // no memory to read (an empty or meta-backed tensor)
    idx.push_back(i);
    int64_t e[4] = {reinterpret_cast<int64_t>(ptr), n, cols, rs};
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
    // (only dense tensors were held; another kind's data_ptr may not even be readable)
    if (idx.empty() || t.layout() != c10::kStrided || !t.has_storage() || t.is_nested()) return out;
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

// Live tables by slot (a freed slot is null): hold_in finds its table with an index, not a
// pybind instance lookup.
// (never freed, as the maps above: a Table that Python frees late must find it)
std::vector<Table*>& tables = *new std::vector<Table*>();

Table::Table(int64_t max_numel_, c10::Device device_) : max_numel(max_numel_), device(device_) {
  slot = static_cast<int64_t>(tables.size());
  tables.push_back(this);
}

Table::~Table() { tables[slot] = nullptr; }

// hold_in(slot, t, i): Table.hold(t, i) of the table in that slot, as a plain C call (pybind's
// method dispatch cost more than the hold itself: 0.68 against about 0.4 us a tensor inside a
// step). -1 for anything it does not take, -2 as hold. Under the GIL.
PyObject* hold_in(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  int64_t held = -1;
  // plain tensors only: a subclass (a FakeTensor, say) may have no real memory behind it
  if (nargs == 3 && THPVariable_CheckExact(a[1])) {
    long long slot = PyLong_AsLongLong(a[0]);
    long long i = PyLong_AsLongLong(a[2]);
    if (PyErr_Occurred()) return nullptr;
    if (slot >= 0 && slot < static_cast<long long>(tables.size()) && tables[slot] != nullptr) {
      try {
        held = tables[slot]->hold(THPVariable_Unpack(a[1]), i);
      } catch (...) {
        held = -1;
      }
    }
  }
  return PyLong_FromLongLong(held);
}

PyMethodDef hold_in_def = {"hold_in", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(hold_in)),
                           METH_FASTCALL, "hold_in(slot, t, i) -> int: Table.hold of the table in that slot"};
"""
