"""C++ for the traced module call: ``torch.nn.Module.__call__`` as a C object (tracer/native.py
builds it with the rest of the extension; tracer/intercept.py installs it).

``TracedCall`` does in C what tracer/intercept.py's Python wrapper does for the common calls of
a traced step without lineage: it opens the call's frame on ``Tracer.stack``
(the same list, item for item), calls torch's own ``Module.__call__``, and queues the same
SPAN record in the writer's ``pending`` list that tracer/spans.py would (packed, in a run of
them: tracer/native_spans.py, which records it), for a call of one plain
tensor in and one out (``span_one_tensor``) and for a call whose layout tracer/native.py's
``call_key`` already knows (``record_tensors``). With fingerprints on it takes the calls whose
positional arguments ``global_pre`` fingerprints without walking them (one plain tensor; plain
tensors, plain values and a batch context, one level down in tuples and lists: an attention's
q, k and v with its ``ForwardBatch``), and fingerprints them as the Python wrapper does:
``StepFingerprints.add_one`` for one tensor, ``add`` for the rest and for the outputs
``record_tensors`` fingerprints, a CPU tensor's in C (tracer/native_host.py).
Anything else goes to the Python code that handles it today, so there is one definition of
every other case:

- before the call (not the step's thread, the root, a module not yet named in this rank file,
  a shared module, past ``max_spans``, lineage on, torch compiling, fingerprints on and an
  argument ``global_pre`` walks): the whole call goes to the Python wrapper;
- after it (a layout not known yet, a result of another kind): ``intercept.finish_call``, with
  the frame left on top as the Python wrapper leaves it; an exception: the post hook body, as
  the Python wrapper calls it.

It reads the tracer's state from its ``__dict__`` (interned names, no attribute look-up
machinery), so the Python code that sets those attributes needs no change. The step's span and
call counters are a C object the tracer holds (tracer/native_counters.py), shared with the
Python wrapper: a call opened here writes no Python value.

What it keeps between calls (none of it a value of its own; each read again where it may have
changed), since a GPU step is host-bound and every call's microsecond shows in it:

- what it read of the tracer's ``__dict__`` (borrowed: the dict holds it; its ints as C ints),
  until an attribute of the tracer is assigned or deleted: the tracer's class gets object's
  ``__setattr__`` and ``__delattr__`` in C plus a counter (``state_version``), which every
  assignment moves (none comes at a call). A tracer class with a ``__setattr__`` of its own keeps
  the look-ups at every call. (Code that writes the tracer's ``__dict__`` directly: unseen.)
- the writer's ``__dict__`` (the writer held while it is the tracer's), where ``generation``,
  ``pending``, ``max_buffered`` and ``taken`` are read as Python finds them, and kept until an
  attribute of the writer is assigned: its class counts its assignments as the tracer's does
  (they come at a flush, once a second or so, not at a call); ``SpanLayouts``' dicts read at
  their slots' offsets;
- the run of packed spans at the end of the writer's queue, which spans are added to
  (tracer/native_spans.py);
- frames no one else holds once popped (their items let go of, out of the collector's sight),
  to open later calls with; a call through the class slot keeps torch's argument tuple as the
  frame's slots instead of a copy.

How calls reach it: ``torch.nn.Module.__call__`` stays the Python wrapper (what torch.compile
traces and guards on, what code that patches ``__call__`` in a chain reads). What changes is
the call slot of the classes that take their ``__call__`` from ``Module``: ``patch_call_slots``
points it at this object (CPython's slot would look ``__call__`` up and call the Python
wrapper). Any assignment of ``__call__`` on a class or a base puts CPython's slot back on it and
its subclasses (removing the wrapper does), and a class made after the patch keeps CPython's:
the Python wrapper, which records the same.
"""

SOURCE = r"""
// ---------------------------------------------------------------- TracedCall: see tracer/native_call.py
enum Name {  // (those every call reads first: side by side in TracedCall's ints and cached)
  kActiveThread, kMaxSpans, kStep, kStepT0Raw, kSpanFlags, kQuietHooks, kFpNow, kStepRoot, kIds, kWriter,
  kStack, kCounters, kLayouts, kGeneration, kOne, kByCallKey, kPending, kMaxBuffered, kFlush, kPostFn,
  kOnError, kCompilingFlag, kFps, kLast, kLastVersion, kLastIdx, kAddOne, kTaken, kAdd, kNames
};
const char* const kNameText[kNames] = {
  "active_thread", "max_spans", "step", "step_t0_raw", "span_flags", "quiet_hooks", "fp_now", "step_root",
  "ids", "writer", "stack", "counters", "layouts", "generation", "one", "by_call_key", "pending",
  "max_buffered", "flush", "post_fn", "on_error", "_is_compiling_flag", "fps", "last", "last_version",
  "last_idx", "add_one", "taken", "add"};
PyObject* names[kNames];
constexpr int kSpareFrames = 64;
// Bumped by every attribute assignment or deletion on the tracer's and its writer's classes
// (tracer_setattr, tracer/native_call_type.py): the state a TracedCall read is the same while it
// has not moved.
uint64_t state_version = 1;

bool intern_names() {
  for (int i = 0; i < kNames; ++i) {
    names[i] = PyUnicode_InternFromString(kNameText[i]);
    if (names[i] == nullptr) return false;
  }
  return true;
}

struct ModuleTable;  // (tracer/native_modules.py)

constexpr int kInts = kSpanFlags + 1;  // the names state_int keeps as C ints: the first ones
// What a call reads first, side by side (on a GPU host the model's own work between calls evicts
// it: a call's cost there is mostly the cache lines it touches); what it holds for Python after.
struct TracedCall {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* inner;        // torch's own Module.__call__
  PyObject* tensor_type;  // torch.Tensor (a call's tensors must be exactly that)
  PyObject* compiler;     // torch.compiler's module __dict__
  uint64_t compiler_version;  // its version when `compiling_now` was read
  int active;
  bool compiling_now, cache_state, writer_counts;  // the tracer's, the writer's class counts assignments
  int n_spare;            // (spare, last: frames no one else holds, items cleared, to open calls with)
  // Caches (tracer/native_call.py's "What it keeps"), none of them a value of the tracer's:
  uint64_t seen_version;  // state_version when `cached` was read
  uint64_t ints_seen;     // seen_version when `ints` was read (tracer/native_modules.py: state_int)
  uint32_t ints_ok;       // which of them are read
  long long ints[kInts];  // the ints among `cached`, as C ints
  PyObject* cached[kNames];  // the tracer's attributes then (borrowed: its __dict__ holds them)
  ModuleTable* modules;   // what a call reads of its module, kept (tracer/native_modules.py)
  PyObject* writer;       // the writer last seen (a strong reference: its address is the key)
  uint64_t writer_seen, most_seen;  // state_version when writer_cached, writer_most were read
  PyObject* writer_cached[4];  // generation, pending, max_buffered, taken (borrowed)
  long long writer_most;  // max_buffered as a C int
  PyObject* run;          // the SpanRun this appends spans to while it is the queue's last item
  PyObject* run_pending;  // the writer's queue that run_extra counts, and its `taken` then
  long long run_taken;
  Py_ssize_t run_extra;   // records queued there in runs beyond one an item (tracer/native_spans.py)
  long long recorded;     // spans recorded here (the rest: by the Python code)
  long long kept_layouts; // ... of them, one-tensor calls whose layout the module's slot held
  PyTypeObject* layouts_type;  // SpanLayouts as last seen, and its slots' offsets
  Py_ssize_t one_offset, by_call_key_offset;
  PyObject* writer_dict;  // the writer's __dict__, where its attributes are read
  PyObject* python_call;  // the Python wrapper: every other call, and what __get__ hands out
  PyObject* tracer;
  PyObject* state;        // tracer.__dict__
  PyObject *span_one, *finish;  // spans.span_one_tensor, intercept.finish_call
  PyObject* context;      // tensor_slots.CONTEXT_TYPES (a set)
  PyObject* span_tag;     // schema.SPAN
  PyObject* spare[kSpareFrames];
};

PyTypeObject TracedCallType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// Which attributes of the tracer are kept in `cached`: all this reads of its __dict__
// (_is_compiling_flag is torch.compiler's: compiling()).
inline bool cacheable(Name n) { return n != kCompilingFlag; }

void read_state(TracedCall* self) {
  for (int i = 0; i < kNames; ++i) {
    Name n = static_cast<Name>(i);
    self->cached[i] = cacheable(n) ? PyDict_GetItemWithError(self->state, names[i]) : nullptr;
    if (self->cached[i] == nullptr && PyErr_Occurred()) PyErr_Clear();  // (str keys: never)
  }
  self->seen_version = state_version;
}

// An attribute of the tracer: borrowed, NULL if missing. As it is in its __dict__ now: no
// assignment has been made since it was read (or it is read there).
inline PyObject* state_item(TracedCall* self, Name n) {
  if (!self->cache_state || !cacheable(n)) return PyDict_GetItemWithError(self->state, names[n]);
  if (self->seen_version != state_version) read_state(self);
  return self->cached[n];
}

bool count_assignments(PyTypeObject* type);  // (tracer/native_call_type.py)

// Where writer_attr keeps a writer attribute it read (-1: read at every call).
inline int writer_slot(Name n) {
  return n == kGeneration ? 0 : n == kPending ? 1 : n == kMaxBuffered ? 2 : n == kTaken ? 3 : -1;
}

// An attribute of the tracer's writer (a new reference, or NULL with an exception): read from its
// __dict__ (kept for as long as the writer is the tracer's), as Python's attribute look-up
// finds it there; anywhere else, by that look-up. Where the writer's class counts its
// assignments in state_version as the tracer's does (RankWriter, made so here: its attributes
// change at a flush, not at a call), what was read is kept until the next assignment.
PyObject* writer_attr(TracedCall* self, PyObject* writer, Name n) {
  if (writer != self->writer) {
    PyObject* d = PyObject_GenericGetDict(writer, nullptr);  // (AttributeError: it has none)
    if (d == nullptr) {
      PyErr_Clear();
      return PyObject_GetAttr(writer, names[n]);
    }
    Py_XSETREF(self->writer_dict, d);
    Py_XSETREF(self->writer, Py_NewRef(writer));
    self->writer_counts = count_assignments(Py_TYPE(writer));
    self->writer_seen = self->most_seen = 0;
  }
  int slot = self->writer_counts ? writer_slot(n) : -1;
  if (slot >= 0) {
    if (self->writer_seen != state_version) {
      for (PyObject*& v : self->writer_cached) v = nullptr;
      self->writer_seen = state_version;
    }
    if (self->writer_cached[slot] != nullptr) return Py_NewRef(self->writer_cached[slot]);
  }
  PyObject* v = PyDict_GetItemWithError(self->writer_dict, names[n]);
  if (v != nullptr) {
    if (slot >= 0) self->writer_cached[slot] = v;  // (borrowed: its __dict__ holds it)
    return Py_NewRef(v);
  }
  return PyErr_Occurred() ? nullptr : PyObject_GetAttr(writer, names[n]);
}

// SpanLayouts.one or .by_call_key (borrowed; NULL, maybe with an exception, if unset): read at
// the slot's offset, as its member descriptor reads it, for the type last seen with both slots.
PyObject* layouts_dict(TracedCall* self, PyObject* holder, Name n) {
  PyTypeObject* type = Py_TYPE(holder);
  if (type != self->layouts_type) {
    Py_ssize_t offsets[2] = {-1, -1};
    Name which[2] = {kOne, kByCallKey};
    for (int i = 0; i < 2; ++i) {
      PyObject* d = _PyType_Lookup(type, names[which[i]]);  // borrowed
      if (d != nullptr && Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY)) offsets[i] = m->offset;
      }
    }
    if (offsets[0] < 0 || offsets[1] < 0) {  // (not SpanLayouts: the attribute look-up)
      PyObject* v = PyObject_GetAttr(holder, names[n]);
      Py_XDECREF(v);  // (the holder keeps it)
      return v;
    }
    Py_XSETREF(self->layouts_type, reinterpret_cast<PyTypeObject*>(Py_NewRef(type)));
    self->one_offset = offsets[0];
    self->by_call_key_offset = offsets[1];
  }
  PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(holder) +
                                              (n == kOne ? self->one_offset : self->by_call_key_offset));
  if (v == nullptr) PyErr_SetString(PyExc_AttributeError, n == kOne ? "one" : "by_call_key");
  return v;
}

// PyLong_AsLongLong without its detour through a byte array for ints of two or more digits
// (a monotonic_ns time): -1 with OverflowError (or TypeError) as it raises.
inline long long as_long_long(PyObject* v) {
  int overflow = 0;
  long long r = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (overflow != 0) {
    PyErr_SetString(PyExc_OverflowError, "int too big to convert");
    return -1;
  }
  return r;
}

inline int64_t now_ns() {  // time.monotonic_ns's clock
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// The frame a call opened (references held until the call is done).
struct OpenCall {
  PyObject* module = nullptr;  // borrowed (the caller's argument)
  PyObject* stack = nullptr;
  PyObject* frame = nullptr;
  PyObject* args = nullptr;    // the positional arguments as a tuple (the frame's slots)
  PyObject* index = nullptr;
  PyObject* parent = nullptr;
  PyObject* path_id = nullptr;
  PyObject* call = nullptr;
  PyObject* fp_pre = nullptr;  // its inputs' fingerprint index (-1: none)
  PyObject* pre = nullptr;     // with fingerprints, the tensors add takes of its arguments (a list)
  PyObject* counters = nullptr;  // the tracer's StepCounters it was counted in; index, call, path_id:
  long long index_v = 0, call_v = 0, path_v = 0;
  bool fp = false;             // a step with fingerprints
  int64_t t0 = 0;
  Py_ssize_t slot = -1;        // the module's slot in self->modules, while its epoch is `epoch`
  uint64_t epoch = 0;
  ~OpenCall() {
    Py_XDECREF(stack); Py_XDECREF(frame); Py_XDECREF(args); Py_XDECREF(index);
    Py_XDECREF(parent); Py_XDECREF(path_id); Py_XDECREF(call); Py_XDECREF(fp_pre); Py_XDECREF(counters);
    Py_XDECREF(pre);
  }
};

// tracer/native_modules.py: a module's entry in ids as a call reads it (module_entry), kept in C
// with the layout of its last one-tensor call (module_layout, keep_layout).
struct ModuleInfo {
  PyObject *path_id, *generation;  // entry[4], entry[3] (borrowed: the entry holds them)
  long long path_v;                // the path id's value
  int selected;                    // entry[2] is true
};
bool module_entry(TracedCall* self, PyObject* ids, PyObject* module, ModuleInfo* info, Py_ssize_t* slot, uint64_t* epoch);
bool module_layout(TracedCall* self, Py_ssize_t slot, uint64_t epoch, PyObject* one, long long* layout_v);
void keep_layout(TracedCall* self, Py_ssize_t slot, uint64_t epoch, PyObject* one, PyObject* layout);
PyObject* writer_kept(TracedCall* self, PyObject* writer, Name n);  // writer_attr's, borrowed
bool compiling(TracedCall* self);  // torch.compiler's _is_compiling_flag is True
bool state_int(TracedCall* self, Name n, long long* v);  // an int attribute of the tracer's, as a C int

// The input's fingerprint index, as the Python wrapper's inline path takes it: the previous
// call's output, deferred, is its index; else StepFingerprints.add_one(a, False), its CPU case in C
// (add_one_host). New reference, or NULL with an exception.
PyObject* fingerprint_input(TracedCall* self, PyObject* a) {
  PyObject* fps = state_item(self, kFps);
  if (fps == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "fps");
    return nullptr;
  }
  PyObject* last = PyObject_GetAttr(fps, names[kLast]);
  if (last == nullptr) return nullptr;
  Py_DECREF(last);  // (only its identity is compared)
  if (last == a) {
    PyObject* version = PyObject_GetAttr(fps, names[kLastVersion]);
    if (version == nullptr) return nullptr;
    Py_DECREF(version);
    if (version == Py_True) return PyObject_GetAttr(fps, names[kLastIdx]);
  }
  PyObject* index = add_one_host(fps, a, false);  // (tracer/native_host.py: add_one's CPU case)
  if (index != nullptr || PyErr_Occurred()) return index;
  PyObject* argv[3] = {fps, a, Py_False};
  return PyObject_VectorcallMethod(names[kAddOne], argv, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
}

// The output's: StepFingerprints.add_one(result), fps read after the call as spans.py reads it.
PyObject* fingerprint_output(TracedCall* self, PyObject* result) {
  PyObject* fps = state_item(self, kFps);
  if (fps == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "fps");
    return nullptr;
  }
  PyObject* index = add_one_host(fps, result, true);
  if (index != nullptr || PyErr_Occurred()) return index;
  PyObject* argv[2] = {fps, result};
  return PyObject_VectorcallMethod(names[kAddOne], argv, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
}

// StepFingerprints.add(items, store): each plain CPU tensor from the first in C (add_host's case,
// tracer/native_host.py), the rest from the first it leaves through add itself, as add does:
// the first's index. New reference, or NULL with an exception.
PyObject* fingerprint_many(TracedCall* self, PyObject* const* items, Py_ssize_t n, bool store) {
  PyObject* fps = state_item(self, kFps);
  if (fps == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "fps");
    return nullptr;
  }
  PyObject* first = nullptr;
  Py_ssize_t done = 0;
  for (; done < n; ++done) {
    PyObject* index = add_one_host(fps, items[done], store, /*as_add=*/true);
    if (index == nullptr) {
      if (PyErr_Occurred()) { Py_XDECREF(first); return nullptr; }
      break;
    }
    if (first == nullptr) first = index;
    else Py_DECREF(index);
  }
  if (done == n) return first;
  PyObject* rest = PyList_New(n - done);
  for (Py_ssize_t i = done; rest != nullptr && i < n; ++i) PyList_SET_ITEM(rest, i - done, Py_NewRef(items[i]));
  PyObject* argv[3] = {fps, rest, store ? Py_True : Py_False};
  PyObject* index = rest == nullptr ? nullptr
      : PyObject_VectorcallMethod(names[kAdd], argv, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  Py_XDECREF(rest);
  if (index == nullptr) { Py_XDECREF(first); return nullptr; }
  if (first == nullptr) return index;
  Py_DECREF(index);
  return first;
}

// The tensors global_pre fingerprints of positional arguments other than one plain tensor, as
// spans.argument_tensors finds them: plain tensors, plain values (None, numbers, strings), a
// registered batch context, and tuples or lists of tensors and plain values one level down. A
// new list; NULL for any other call (a tensor subclass, another object, too many tensors: the
// Python wrapper's), with an exception on an error.
constexpr Py_ssize_t kMaxTensors = 64;  // tensor_slots.MAX_TENSORS

PyObject* fp_arguments(TracedCall* self, PyObject* const* args, Py_ssize_t n) {
  PyTypeObject* tensor = reinterpret_cast<PyTypeObject*>(self->tensor_type);
  PyObject* out = PyList_New(0);
  for (Py_ssize_t i = 0; out != nullptr && i < n; ++i) {
    PyObject* x = args[i];
    bool ok;
    if (Py_TYPE(x) == tensor) {
      ok = PyList_Append(out, x) == 0;
    } else if (PyObject_TypeCheck(x, tensor)) {
      ok = false;
    } else if (PyTuple_CheckExact(x) || PyList_CheckExact(x)) {
      Py_ssize_t m = PySequence_Fast_GET_SIZE(x);
      ok = m <= kMaxNested;
      for (Py_ssize_t j = 0; ok && j < m; ++j) {
        PyObject* y = PySequence_Fast_GET_ITEM(x, j);
        if (Py_TYPE(y) == tensor) ok = PyList_Append(out, y) == 0;
        else ok = y == Py_None || PyLong_Check(y) || PyFloat_Check(y) || PyUnicode_Check(y);
      }
    } else {
      ok = plain(x, self->context) == 1;
    }
    if (!ok || PyList_GET_SIZE(out) > kMaxTensors) Py_CLEAR(out);
  }
  return out;
}

// The frame the Python wrapper opens for this call (its inline path for one tensor in; else
// global_pre's), opened here: 1 opened, 0 the call is not one this handles (or an error: the
// Python wrapper then redoes it), -1 an exception fingerprinting its input (the caller reports
// it and makes the call untraced, as the Python wrapper does). With fingerprints, calls whose
// arguments fp_arguments takes.
int open_call(TracedCall* self, PyObject* module, PyObject* const* args, Py_ssize_t n, bool keywords,
              PyObject* arg_tuple, OpenCall& c) {
  if (compiling(self)) return 0;
  long long at;  // (an ident past 2**63: no C int, never the step's thread here)
  if (!state_int(self, kActiveThread, &at) || static_cast<unsigned long>(at) != PyThread_get_thread_ident())
    return 0;
  PyObject* fp_now = state_item(self, kFpNow);
  if (state_item(self, kQuietHooks) != Py_False || (fp_now != Py_False && fp_now != Py_True) ||
      state_item(self, kStepRoot) == module)
    return 0;
  c.fp = fp_now == Py_True;
  // With fingerprints, the inputs global_pre fingerprints: one plain tensor (add_one), else the
  // tensors of fp_arguments (add); a call of other arguments is the Python wrapper's.
  bool single = n == 1 && Py_TYPE(args[0]) == reinterpret_cast<PyTypeObject*>(self->tensor_type);
  if (c.fp && !single && (c.pre = fp_arguments(self, args, n)) == nullptr) return 0;
  PyObject *ids = state_item(self, kIds), *writer = state_item(self, kWriter);
  PyObject *most = state_item(self, kMaxSpans), *stack = state_item(self, kStack);
  PyObject* counters = state_item(self, kCounters);  // (the Python ones: the Python wrapper's calls)
  if (ids == nullptr || writer == nullptr || most == nullptr || stack == nullptr || counters == nullptr ||
      !PyDict_CheckExact(ids) || !PyList_CheckExact(stack) || !Py_IS_TYPE(counters, &StepCountersType))
    return 0;
  c.counters = Py_NewRef(counters);  // (held: a __del__ run by an allocation below may replace it)
  auto* count = reinterpret_cast<StepCounters*>(counters);
  ModuleInfo m;
  if (!module_entry(self, ids, module, &m, &c.slot, &c.epoch) || m.selected != 1) return 0;  // (not recorded: Python drops it)
  PyObject* generation = writer_kept(self, writer, kGeneration);  // (only its identity is compared)
  if (generation == nullptr || m.generation != generation) return 0;
  long long index = count->span_count, bound;
  if (!state_int(self, kMaxSpans, &bound) || index >= bound) return 0;
  Py_ssize_t depth = PyList_GET_SIZE(stack);
  if (depth == 0) return 0;
  PyObject* top = PyList_GET_ITEM(stack, depth - 1);
  if (!PyList_CheckExact(top) || PyList_GET_SIZE(top) != 9) return 0;
  PyObject* top_flag = PyList_GET_ITEM(top, 8);
  int top_selected = top_flag == Py_True ? 1 : top_flag == Py_False ? 0 : PyObject_IsTrue(top_flag);
  if (top_selected < 0) return 0;
  // Owned before the allocations below (a collection's __del__ may change the tracer's containers or
  // the module table, which holds the path id) and fingerprint_input's Python (may drop the GIL).
  c.stack = Py_NewRef(stack);
  c.parent = Py_NewRef(PyList_GET_ITEM(top, top_selected ? 1 : 2));
  c.path_id = Py_NewRef(m.path_id);
  // StepCounters.open: this path's call number in the step, and the span's index
  long long id = m.path_v, call = peek_call(count, id);
  c.call = PyLong_FromLongLong(call);
  c.index = index_int(index);
  c.args = arg_tuple != nullptr ? Py_NewRef(arg_tuple) : PyTuple_New(n);  // (the caller's, where it has one)
  if (self->n_spare > 0) {
    c.frame = self->spare[--self->n_spare];
    PyObject_GC_Track(c.frame);
  } else {
    c.frame = PyList_New(9);
  }
  if (c.call == nullptr || c.index == nullptr || c.args == nullptr || c.frame == nullptr) return 0;
  // Opened: counted where the Python wrapper counts (allocations may run a __del__, which may
  // open calls too: their numbers came first)
  if (peek_call(count, id) != call || count->span_count != index) return 0;
  commit_call(count, id, call);
  c.index_v = index, c.call_v = call, c.path_v = id;
  // (one tensor: add_one(a, False); else add(tensors, store=False), as global_pre takes them)
  if (!c.fp || (!single && PyList_GET_SIZE(c.pre) == 0)) c.fp_pre = PyLong_FromLong(-1);
  else if (single) c.fp_pre = fingerprint_input(self, args[0]);
  else c.fp_pre = fingerprint_many(self, PySequence_Fast_ITEMS(c.pre), PyList_GET_SIZE(c.pre), false);
  if (c.fp_pre == nullptr) return -1;
  if (arg_tuple == nullptr)
    for (Py_ssize_t i = 0; i < n; ++i) PyTuple_SET_ITEM(c.args, i, Py_NewRef(args[i]));
  c.module = module;
  c.t0 = now_ns();
  PyObject* t0 = PyLong_FromLongLong(c.t0);
  if (t0 == nullptr) return 0;
  PyObject* items[9] = {module, c.index, c.parent, c.path_id, c.call, t0, c.args, c.fp_pre, Py_True};
  for (int i = 0; i < 9; ++i) PyList_SET_ITEM(c.frame, i, i == 5 ? items[i] : Py_NewRef(items[i]));  // (its items are NULL)
  if (PyList_Append(stack, c.frame) < 0) return 0;
  return 1;
}

// The SPAN record appended to the writer's queue: tracer/native_spans.py (layout NULL: layout_v;
// fp_post NULL: -1). 0, or -1 with an exception.
int append_span(TracedCall* self, OpenCall& c, int64_t t1, PyObject* layout, long long layout_v, PyObject* fp_post, long long n_pre);

// The call's frame off the top of the stack (list.pop's work: the list keeps its allocation),
// then kept to open a later call with when nothing else holds it: its items let go of now.
inline int pop_frame(TracedCall* self, OpenCall& c) {
  Py_ssize_t depth = PyList_GET_SIZE(c.stack);
  PyObject* top = PyList_GET_ITEM(c.stack, depth - 1);  // (the caller checked: c.frame)
  Py_SET_SIZE(c.stack, depth - 1);
  Py_DECREF(top);
  if (Py_REFCNT(c.frame) == 1 && self->n_spare < kSpareFrames && PyList_GET_SIZE(c.frame) == 9) {
    PyObject* frame = c.frame;
    c.frame = nullptr;
    for (int i = 0; i < 9; ++i) {
      PyObject* item = PyList_GET_ITEM(frame, i);
      PyList_SET_ITEM(frame, i, nullptr);
      Py_XDECREF(item);
    }
    PyObject_GC_UnTrack(frame);  // (NULL items: nothing may see it, gc.get_objects() included)
    self->spare[self->n_spare++] = frame;
  }
  return 0;
}

// After the call, its span where this records it (tracer/native_spans.py): record_one, one plain
// tensor in and one out (0, or -1 with an exception); record_known, a call whose layout this
// rank file knows by call_key (1 recorded, 0 not such a call, -1 an exception).
int record_one(TracedCall* self, OpenCall& c, PyObject* a, PyObject* result);
int record_known(TracedCall* self, OpenCall& c, PyObject* kwargs, PyObject* result);

// An exception in the recording: Tracer.on_error, as the Python wrapper's except clauses; false
// (the exception left raised) for a BaseException that is no Exception, which they let through.
bool report_error(TracedCall* self, const char* where) {
  if (!PyErr_ExceptionMatches(PyExc_Exception)) return false;
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  PyObject* r = PyObject_CallMethod(self->tracer, "on_error", "sO", where, value ? value : Py_None);
  if (r == nullptr) PyErr_Clear();
  Py_XDECREF(r);
  Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
  return true;
}

// The call raised: the post hook body with that exception as sys.exc_info(), as the Python
// wrapper calls it from its except clause; then the exception goes on.
void call_failed(TracedCall* self, OpenCall& c) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr && value != nullptr) PyException_SetTraceback(value, tb);
  PyObject* handled = PyErr_GetHandledException();
  PyErr_SetHandledException(value);
  PyObject* post = state_item(self, kPostFn);
  if (post != nullptr) {
    PyObject* argv[3] = {c.module, c.args, Py_None};
    PyObject* r = PyObject_Vectorcall(post, argv, 3, nullptr);
    Py_XDECREF(r);
  }
  PyErr_Clear();
  PyErr_SetHandledException(handled);
  Py_XDECREF(handled);
  PyErr_Restore(type, value, tb);
}

// A module call: args[0] the module, then its arguments; arg_tuple, where the caller has one, the
// positional ones after the module as a tuple (the class slot's), else NULL.
PyObject* traced_call(PyObject* self_, PyObject* const* args, size_t nargsf, PyObject* kwnames, PyObject* arg_tuple) {
  auto* self = reinterpret_cast<TracedCall*>(self_);
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  OpenCall c;
  int opened = n >= 1 && self->active ? open_call(self, args[0], args + 1, n - 1, kwnames != nullptr, arg_tuple, c) : 0;
  if (opened == -1) {  // this call untraced; its children still are
    if (!report_error(self, "forward pre-hook")) return nullptr;
    return PyObject_Vectorcall(self->inner, args, nargsf, kwnames);
  }
  if (opened != 1) {
    if (PyErr_Occurred()) PyErr_Clear();  // (the Python wrapper meets it again, and reports it)
    return PyObject_Vectorcall(self->python_call, args, nargsf, kwnames);
  }
  PyObject* result = PyObject_Vectorcall(self->inner, args, nargsf, kwnames);
  if (result == nullptr) {
    call_failed(self, c);
    return nullptr;
  }
  Py_ssize_t depth = PyList_GET_SIZE(c.stack);
  bool on_top = depth > 1 && PyList_GET_ITEM(c.stack, depth - 1) == c.frame &&
                state_item(self, kQuietHooks) == Py_False;
  PyTypeObject* tensor = reinterpret_cast<PyTypeObject*>(self->tensor_type);
  if (on_top && n == 2 && kwnames == nullptr && Py_TYPE(args[1]) == tensor && Py_TYPE(result) == tensor) {
    if (record_one(self, c, args[1], result) < 0 && !report_error(self, "forward hook")) {
      Py_DECREF(result);
      return nullptr;
    }
    return result;
  }
  // The keyword arguments as a dict, made where there are some (record_known takes None for
  // none, as call_key keys an empty dict) or finish_call is called (the Python wrapper's kwargs).
  PyObject* kwargs = nullptr;
  Py_ssize_t nk = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  if (nk > 0) {
    kwargs = PyDict_New();
    if (kwargs == nullptr) { Py_DECREF(result); return nullptr; }
    for (Py_ssize_t i = 0; i < nk; ++i) {
      if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[n + i]) < 0) {
        Py_DECREF(kwargs); Py_DECREF(result);
        return nullptr;
      }
    }
  }
  int done = on_top ? record_known(self, c, kwargs != nullptr ? kwargs : Py_None, result) : 0;
  if (done < 0) {
    if (!report_error(self, "forward hook")) { Py_XDECREF(kwargs); Py_DECREF(result); return nullptr; }
  } else if (done == 0) {  // intercept.finish_call: as the Python wrapper ends such a call
    if (kwargs == nullptr) kwargs = PyDict_New();
    if (kwargs == nullptr) { Py_DECREF(result); return nullptr; }
    PyObject* argv[5] = {self->tracer, c.module, c.args, kwargs, result};
    PyObject* r = PyObject_Vectorcall(self->finish, argv, 5, nullptr);
    if (r == nullptr) { Py_DECREF(kwargs); Py_DECREF(result); return nullptr; }
    Py_DECREF(r);
  }
  Py_XDECREF(kwargs);
  return result;
}

PyObject* traced_call_vector(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  return traced_call(self, args, nargsf, kwnames, nullptr);
}
"""
