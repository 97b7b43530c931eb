"""C++ for what tracer/native_call.py's ``TracedCall`` reads of a module at each call, kept in C:
a small open-addressing table keyed by the module's address, holding the module's entry in
``Tracer.ids`` (its path id, naming, whether it is recorded) and the layout of its last
one-tensor call with the metadata it was keyed by.

Why: a GPU step is host-bound and a call's host cost is mostly memory touched. Found in Python's
containers, each call made an int of the module's address and looked it up in ``ids``, then
hashed its tensors' metadata into the process's layout-id map and looked the id up in the rank
file's layout dict: three hash tables, cold by the next call of the module. A slot here is one
cache line or two, with the metadata compared in place.

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

constexpr int kKeyMax = 16;  // metadata of a one-tensor call kept in a slot (longer: not kept)

struct ModuleSlot {
  PyObject* module;      // the key, by address only (NULL: an empty slot)
  PyObject* entry;       // ids[id(module)] (strong)
  PyObject* one;         // SpanLayouts.one where `layout` was found (strong), at version one_version
  uint64_t one_version;
  PyObject* layout;      // (strong)
  int n_key;
  int64_t key[kKeyMax];  // the metadata (key_buf) `layout` was found for
};

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

// ids[id(module)] (borrowed), or NULL (none; or an exception). `slot` and `epoch` name the
// module's slot for module_layout and keep_layout (-1: none kept).
PyObject* module_entry(TracedCall* self, PyObject* ids, PyObject* module, Py_ssize_t* slot, uint64_t* epoch) {
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
  if (s.entry != nullptr) return s.entry;
#endif
  PyObject* key = PyLong_FromVoidPtr(module);  // id(module)
  if (key == nullptr) return nullptr;
  PyObject* entry = PyDict_GetItemWithError(ids, key);
  Py_DECREF(key);
#ifdef TT_DICT_VERSIONS
  if (entry != nullptr) s.entry = Py_NewRef(entry);
#endif
  return entry;
}

// The layout of this one-tensor call (borrowed) where the module's slot holds it for `one` as
// it is and the metadata in key_buf; else NULL.
PyObject* module_layout(TracedCall* self, Py_ssize_t slot, uint64_t epoch, PyObject* one) {
#ifdef TT_DICT_VERSIONS
  ModuleTable* t = self->modules;
  if (slot < 0 || t == nullptr || t->epoch != epoch) return nullptr;
  ModuleSlot& s = t->slots[slot];
  if (s.layout == nullptr || s.one != one || s.one_version != dict_version(one)) return nullptr;
  if (static_cast<size_t>(s.n_key) != key_buf.size() ||
      memcmp(s.key, key_buf.data(), key_buf.size() * sizeof(int64_t)) != 0)
    return nullptr;
  return s.layout;
#else
  return nullptr;
#endif
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
static_assert(kNames <= 32, "state_int keeps a bit per name");
bool state_int(TracedCall* self, Name n, long long* v) {
  PyObject* o = state_item(self, n);
  if (o == nullptr || !PyLong_CheckExact(o)) return false;
  bool kept = self->cache_state && cacheable(n);
  if (kept && self->ints_seen != self->seen_version) {
    self->ints_ok = 0;
    self->ints_seen = self->seen_version;
  }
  uint32_t bit = 1u << n;
  if (kept && (self->ints_ok & bit)) {
    *v = self->ints[n];
    return true;
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

// Keeps `layout`, found in `one` for the metadata in key_buf, in the module's slot.
void keep_layout(TracedCall* self, Py_ssize_t slot, uint64_t epoch, PyObject* one, PyObject* layout) {
#ifdef TT_DICT_VERSIONS
  ModuleTable* t = self->modules;
  if (slot < 0 || t == nullptr || t->epoch != epoch || !PyDict_CheckExact(one) || key_buf.size() > kKeyMax) return;
  ModuleSlot& s = t->slots[slot];
  Py_XSETREF(s.one, Py_NewRef(one));
  Py_XSETREF(s.layout, Py_NewRef(layout));
  s.one_version = dict_version(one);
  s.n_key = static_cast<int>(key_buf.size());
  memcpy(s.key, key_buf.data(), key_buf.size() * sizeof(int64_t));
#endif
}
"""
