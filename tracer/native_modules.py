"""C++ for what tracer/native_call.py's ``TracedCall`` reads of a module at each call, kept in C:
a small open-addressing table keyed by the module's address, holding the module's entry in
``Tracer.ids`` (its path id, naming, whether it is recorded) and the layout of its last
one-tensor call with the metadata it was keyed by.

Why: a GPU step is host-bound and a call's host cost is mostly memory touched. Found in Python's
containers, each call made an int of the module's address and looked it up in ``ids``, then
hashed its tensors' metadata into the process's layout-id map and looked the id up in the rank
file's layout dict: three hash tables, cold by the next call of the module. A slot here is two
cache lines, all a call reads of its module: the entry's path id (and its value), writer
generation and whether it is recorded, decoded once (an entry is a tuple, never changed in
place, and bools only are kept), the layout's value as a C int, and the call's metadata packed
into 32-bit words (a tensor's ndim, dtype and device in one; longer metadata: not kept).

It is never the source of truth, only a copy kept while that is provably unchanged:

- the entries, while ``Tracer.ids`` is the same dict and its version tag has not moved
  (``ma_version_tag``: CPython gives a dict a new one at every change, a module's entry made
  or dropped when it dies included; in 3.11 to 3.13, a deprecated field in 3.12 and 3.13);
  else the table is emptied and filled again as modules are called;
- a layout, while the rank file's ``SpanLayouts.one`` is the same dict at the same version and
  the call's metadata are those it was found for.

The same tag keeps torch.compiler's ``_is_compiling_flag`` (read at every call) while that
module's globals are unchanged. Where the version tag is not there (Python 3.14 on), nothing is
kept: every call looks up as before.
"""

SOURCE = r"""
// ---------------------------------------------------------------- module table: see tracer/native_modules.py
#if PY_VERSION_HEX < 0x030E0000
#define TT_DICT_VERSIONS 1
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
inline uint64_t dict_version(PyObject* d) { return reinterpret_cast<PyDictObject*>(d)->ma_version_tag; }
#pragma GCC diagnostic pop
#endif

constexpr int kKeyMax = 13;  // metadata of a one-tensor call kept in a slot, packed (longer: not kept)

// A module's slot: two cache lines (a call of a module reads both, nothing else of the table).
// The entry's items as C values, since the entry is a tuple (never changed) of immutable ints.
struct alignas(64) ModuleSlot {
  PyObject* module;      // the key, by address only (NULL: an empty slot)
  PyObject* path_id;     // entry[4] (borrowed from entry); NULL: no entry kept
  long long path_v;
  PyObject* generation;  // entry[3] (borrowed from entry)
  PyObject* one;         // SpanLayouts.one where `layout` was found (strong), at version one_version
  uint64_t one_version;
  PyObject* layout;      // (strong) an int of 64 bits, kept with its value
  long long layout_v;
  PyObject* entry;       // ids[id(module)] (strong)
  int8_t selected;       // entry[2] is True
  int8_t n_key;          // layout's metadata (key_buf, packed: pack_key), 0: no layout kept
  uint32_t key[kKeyMax];
};
static_assert(sizeof(ModuleSlot) == 128, "a module's slot is two cache lines");

// key_buf (put_meta's: per tensor ndim, sizes, dtype, device) packed into `out` as int32s, a
// tensor's ndim, dtype and device in one: its length, or -1 where it does not fit in kKeyMax.
int pack_key(uint32_t* out) {
  size_t i = 0, n = key_buf.size();
  int k = 0;
  while (i < n) {
    int64_t nd = key_buf[i];
    if (nd < 0 || nd > 0xff || i + nd + 3 > n || k + nd + 1 > kKeyMax) return -1;
    int64_t dtype = key_buf[i + nd + 1], dev = key_buf[i + nd + 2];
    int64_t dev_type = dev >> 16, dev_index = dev & 0xffff;  // (index -1, a CPU's: 0xffff, here 0xff)
    if (dtype < 0 || dtype > 0xff || dev_type < 0 || dev_type > 0xff || (dev_index >= 0xff && dev_index != 0xffff))
      return -1;
    if (dev_index == 0xffff) dev_index = 0xff;
    out[k++] = static_cast<uint32_t>(nd | dtype << 8 | dev_type << 16 | dev_index << 24);
    for (int64_t j = 1; j <= nd; ++j) {
      int64_t v = key_buf[i + j];
      if (v < 0 || v > INT32_MAX) return -1;
      out[k++] = static_cast<uint32_t>(v);
    }
    i += nd + 3;
  }
  return k;
}

struct ModuleTable {
  std::vector<ModuleSlot> slots;  // a power of two of them, at most half used
  size_t used = 0;
  PyObject* ids = nullptr;        // the dict the entries are from (strong), at version `version`
  uint64_t version = 0;
  uint64_t epoch = 1;             // moved whenever slots are emptied or moved
};

inline size_t slot_hash(PyObject* module, size_t mask) {
  return (static_cast<size_t>(reinterpret_cast<uintptr_t>(module)) >> 4) * 0x9E3779B97F4A7C15ULL >> 20 & mask;
}

void table_empty(ModuleTable* t) {
  for (ModuleSlot& s : t->slots) {
    if (s.module == nullptr) continue;
    Py_CLEAR(s.entry); Py_CLEAR(s.one); Py_CLEAR(s.layout);
    s.module = nullptr;
  }
  t->used = 0;
  ++t->epoch;
}

void table_drop(ModuleTable* t) {  // (TracedCall's clear and close)
  if (t == nullptr) return;
  table_empty(t);
  Py_CLEAR(t->ids);
}

// The slot of `module`, made (empty of an entry) where there is none: its index.
Py_ssize_t table_slot(ModuleTable* t, PyObject* module) {
  if (2 * (t->used + 1) > t->slots.size()) {
    std::vector<ModuleSlot> old;
    old.swap(t->slots);
    t->slots.assign(std::max<size_t>(64, old.size() * 2), ModuleSlot{});
    size_t mask = t->slots.size() - 1;
    for (ModuleSlot& s : old) {
      if (s.module == nullptr) continue;
      size_t h = slot_hash(s.module, mask);
      while (t->slots[h].module != nullptr) h = (h + 1) & mask;
      t->slots[h] = s;  // (its references move with it)
    }
    ++t->epoch;
  }
  size_t mask = t->slots.size() - 1;
  size_t h = slot_hash(module, mask);
  while (t->slots[h].module != nullptr && t->slots[h].module != module) h = (h + 1) & mask;
  if (t->slots[h].module == nullptr) {
    t->slots[h] = ModuleSlot{};
    t->slots[h].module = module;
    ++t->used;
  }
  return static_cast<Py_ssize_t>(h);
}

// An entry's items as a call reads them: false where it is not such an entry (no tuple of five,
// a path id that is no int of 64 bits) or on an exception.
bool decode_entry(PyObject* entry, ModuleInfo* info) {
  if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) < 5) return false;
  PyObject* selected = PyTuple_GET_ITEM(entry, 2);
  info->selected = selected == Py_True ? 1 : selected == Py_False ? 0 : PyObject_IsTrue(selected);
  info->generation = PyTuple_GET_ITEM(entry, 3);
  info->path_id = PyTuple_GET_ITEM(entry, 4);
  return info->selected >= 0 && PyLong_CheckExact(info->path_id) && path_id_of(info->path_id, &info->path_v);
}

// ids[id(module)] decoded into `info`: false where there is none or it is no entry a call takes
// here (or an exception). `slot` and `epoch` name the module's slot for module_layout and
// keep_layout (-1: none kept).
bool module_entry(TracedCall* self, PyObject* ids, PyObject* module, ModuleInfo* info, Py_ssize_t* slot,
                  uint64_t* epoch) {
  *slot = -1;
#ifdef TT_DICT_VERSIONS
  if (self->modules == nullptr) self->modules = new ModuleTable();
  ModuleTable* t = self->modules;
  uint64_t version = dict_version(ids);
  if (ids != t->ids || version != t->version) {
    table_empty(t);
    Py_XSETREF(t->ids, Py_NewRef(ids));
    t->version = version;
  }
  Py_ssize_t i = table_slot(t, module);
  ModuleSlot& s = t->slots[i];
  *slot = i;
  *epoch = t->epoch;
  if (s.path_id != nullptr) {
    info->path_id = s.path_id;
    info->path_v = s.path_v;
    info->generation = s.generation;
    info->selected = s.selected;
    return true;
  }
#endif
  PyObject* key = PyLong_FromVoidPtr(module);  // id(module)
  if (key == nullptr) return false;
  PyObject* entry = PyDict_GetItemWithError(ids, key);
  Py_DECREF(key);
  if (entry == nullptr) return false;
  // (kept: an entry whose truth decode_entry reads without running Python, that may move the table)
  [[maybe_unused]] bool plain = PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) >= 5 && PyBool_Check(PyTuple_GET_ITEM(entry, 2));
  if (!decode_entry(entry, info)) return false;
#ifdef TT_DICT_VERSIONS
  if (plain && t->epoch == *epoch) {
    ModuleSlot& kept = t->slots[i];
    Py_XSETREF(kept.entry, Py_NewRef(entry));
    kept.path_id = info->path_id;
    kept.path_v = info->path_v;
    kept.generation = info->generation;
    kept.selected = static_cast<int8_t>(info->selected);
  }
#endif
  return true;
}

// The layout of this one-tensor call where the module's slot holds it for `one` as it is and the
// metadata in key_buf: true, its value in *layout_v; else false.
bool module_layout(TracedCall* self, Py_ssize_t slot, uint64_t epoch, PyObject* one, long long* layout_v) {
#ifdef TT_DICT_VERSIONS
  ModuleTable* t = self->modules;
  if (slot < 0 || t == nullptr || t->epoch != epoch) return false;
  ModuleSlot& s = t->slots[slot];
  if (s.n_key == 0 || s.one != one || s.one_version != dict_version(one)) return false;
  uint32_t key[kKeyMax];
  if (pack_key(key) != s.n_key || memcmp(s.key, key, s.n_key * sizeof(uint32_t)) != 0) return false;
  *layout_v = s.layout_v;
  return true;
#else
  return false;
#endif
}

// A writer attribute as writer_attr reads it, borrowed (the writer's __dict__ holds it, or NULL):
// what it keeps taken without a reference, so the object itself is not read (a cache line a call).
PyObject* writer_kept(TracedCall* self, PyObject* writer, Name n) {
  int slot = writer_slot(n);
  if (slot >= 0 && writer == self->writer && self->writer_seen == state_version && self->writer_cached[slot] != nullptr)
    return self->writer_cached[slot];
  PyObject* v = writer_attr(self, writer, n);
  Py_XDECREF(v);  // (the writer holds it)
  return v;
}

// torch.compiler's _is_compiling_flag is True: read again once the module's globals changed.
bool compiling(TracedCall* self) {
#ifdef TT_DICT_VERSIONS
  uint64_t version = dict_version(self->compiler);
  if (version == self->compiler_version && version != 0) return self->compiling_now;
  self->compiler_version = version;
  self->compiling_now = PyDict_GetItemWithError(self->compiler, names[kCompilingFlag]) == Py_True;
  return self->compiling_now;
#else
  return PyDict_GetItemWithError(self->compiler, names[kCompilingFlag]) == Py_True;
#endif
}

// An attribute of the tracer that is an exact int of 64 bits, as a C int: false where it is
// missing or another value (the caller's own way then). Decoded once while what was read of the
// tracer's __dict__ stands (state_item), else at every call.
static_assert(kInts <= 32, "state_int keeps a bit per name");
bool state_int(TracedCall* self, Name n, long long* v) {
  bool kept = self->cache_state && n < kInts;
  uint32_t bit = 1u << n;
  // (decoded while nothing was assigned: the int object itself not read, a cache line a call)
  if (kept && self->seen_version == state_version && self->ints_seen == self->seen_version && (self->ints_ok & bit)) {
    *v = self->ints[n];
    return true;
  }
  PyObject* o = state_item(self, n);
  if (o == nullptr || !PyLong_CheckExact(o)) return false;
  if (kept && self->ints_seen != self->seen_version) {
    self->ints_ok = 0;
    self->ints_seen = self->seen_version;
  }
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || (x == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  if (kept) {
    self->ints[n] = x;
    self->ints_ok |= bit;
  }
  *v = x;
  return true;
}

// Keeps `layout`, found in `one` for the metadata in key_buf, in the module's slot: where it is an
// int of 64 bits (a span packs its value) and the metadata fit.
void keep_layout(TracedCall* self, Py_ssize_t slot, uint64_t epoch, PyObject* one, PyObject* layout) {
#ifdef TT_DICT_VERSIONS
  ModuleTable* t = self->modules;
  if (slot < 0 || t == nullptr || t->epoch != epoch || !PyDict_CheckExact(one) || !PyLong_CheckExact(layout)) return;
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(layout, &overflow);
  if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return;
  }
  ModuleSlot& s = t->slots[slot];
  int n = pack_key(s.key);
  s.n_key = static_cast<int8_t>(n > 0 ? n : 0);
  if (n <= 0) return;
  Py_XSETREF(s.one, Py_NewRef(one));
  Py_XSETREF(s.layout, Py_NewRef(layout));
  s.layout_v = v;
  s.one_version = dict_version(one);
#endif
}
"""
