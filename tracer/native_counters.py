"""C++ for a traced step's counters: ``StepCounters``, the spans opened in the step
(``span_count``, the next span's index) and each module path's calls in it (a call's number is
how many calls of its path the step opened before it). tracer/spans.py's ``StepCounters`` is the
same in Python, for a process without the extension; ``Tracer.counters`` holds one or the other
(``Tracer.span_count`` reads and sets its count).

Why in C: a GPU step is host-bound, and tracer/native_call.py's ``TracedCall`` opened every
call with three dict operations (the path's last call number read from the tracer's ``calls``
dict and written back, ``span_count`` written into the tracer's ``__dict__``) and an int made for
the next count. Here a call's number is a slot in a vector indexed by the path id (an int the
writer interned: small, dense), stamped with the step it counts in, so a new step empties every
path's count by moving one number (``reset``).

The Python wrapper (tracer/intercept.py) opens its calls through the same object (``open``), so
the C path and the Python path number a step's calls as one sequence, whichever path each call
takes.
"""

SOURCE = r"""
// ---------------------------------------------------------------- StepCounters: see tracer/native_counters.py
struct CallCount {
  uint64_t step;   // the step (StepCounters.step) `last` counts in; another: no call yet
  long long last;  // the number of the path's last call opened
};
constexpr long long kDenseIds = 1 << 20;  // path ids kept in the vector (others: the map)

struct StepCounters {
  PyObject_HEAD
  long long span_count;
  uint64_t step;  // moved by reset (from 1: a zeroed CallCount counts in no step)
  std::vector<CallCount>* dense;                     // by path id
  std::unordered_map<long long, CallCount>* sparse;  // ids outside [0, kDenseIds)
};

PyTypeObject StepCountersType = {PyVarObject_HEAD_INIT(nullptr, 0)};

inline CallCount& path_count(StepCounters* s, long long id) {
  if (id >= 0 && id < kDenseIds) {
    std::vector<CallCount>& v = *s->dense;
    size_t i = static_cast<size_t>(id);
    if (i >= v.size()) v.resize(std::max<size_t>(i + 1, 2 * v.size()), CallCount{0, -1});
    return v[i];
  }
  return (*s->sparse)[id];  // (value-initialized: step 0)
}

// The number the next call of path `id` gets in this step (nothing changed).
inline long long peek_call(StepCounters* s, long long id) {
  CallCount& c = path_count(s, id);
  return c.step == s->step ? c.last + 1 : 0;
}

// That call opened: `call` its number, span_count its span's index.
inline void commit_call(StepCounters* s, long long id, long long call) {
  CallCount& c = path_count(s, id);
  c.step = s->step;
  c.last = call;
  ++s->span_count;
}

// Span indices as ints, made once for the process (ints are immutable: any holder may share
// them): a call's frame holds its index, which most calls of a step would allocate and free.
constexpr long long kIndexInts = 4096;
PyObject* index_ints[kIndexInts];

// The int `i` (a new reference, or NULL with an exception).
inline PyObject* index_int(long long i) {
  if (i < 0 || i >= kIndexInts) return PyLong_FromLongLong(i);
  PyObject*& v = index_ints[i];
  if (v == nullptr) v = PyLong_FromLongLong(i);  // (kept for the process)
  return Py_XNewRef(v);
}

// A path id as a long long (false with an exception where it is no int, or too big).
inline bool path_id_of(PyObject* v, long long* id) {
  if (!PyLong_Check(v)) {
    PyErr_SetString(PyExc_TypeError, "a path id is an int");
    return false;
  }
  int overflow = 0;
  *id = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (overflow != 0) PyErr_SetString(PyExc_OverflowError, "path id too big");
  return overflow == 0 && !(*id == -1 && PyErr_Occurred());
}

// open(path_id) -> (call, index): a call of the path opened (tracer/spans.py's open_span).
PyObject* counters_open(PyObject* self_, PyObject* path_id) {
  auto* self = reinterpret_cast<StepCounters*>(self_);
  long long id;
  if (!path_id_of(path_id, &id)) return nullptr;
  long long call = peek_call(self, id), index = self->span_count;
  PyObject* r = PyTuple_New(2);
  PyObject* c = PyLong_FromLongLong(call);
  PyObject* i = index_int(index);
  if (r == nullptr || c == nullptr || i == nullptr) {
    Py_XDECREF(r); Py_XDECREF(c); Py_XDECREF(i);
    return nullptr;
  }
  PyTuple_SET_ITEM(r, 0, c);
  PyTuple_SET_ITEM(r, 1, i);
  commit_call(self, id, call);
  return r;
}

PyObject* counters_reset(PyObject* self_, PyObject*) {  // a new step: no span, no call yet
  auto* self = reinterpret_cast<StepCounters*>(self_);
  self->span_count = 0;
  ++self->step;
  Py_RETURN_NONE;
}

// set_call(path_id, call): the path's last call in this step is `call` (the root's, 0).
PyObject* counters_set_call(PyObject* self_, PyObject* const* a, Py_ssize_t n) {
  auto* self = reinterpret_cast<StepCounters*>(self_);
  long long id;
  if (n != 2) {
    PyErr_SetString(PyExc_TypeError, "set_call(path_id, call)");
    return nullptr;
  }
  if (!path_id_of(a[0], &id)) return nullptr;
  long long call = PyLong_AsLongLong(a[1]);
  if (call == -1 && PyErr_Occurred()) return nullptr;
  CallCount& c = path_count(self, id);
  c.step = self->step;
  c.last = call;
  Py_RETURN_NONE;
}

// last_call(path_id): the number of the path's last call in this step, -1 for none.
PyObject* counters_last_call(PyObject* self_, PyObject* path_id) {
  auto* self = reinterpret_cast<StepCounters*>(self_);
  long long id;
  if (!path_id_of(path_id, &id)) return nullptr;
  return PyLong_FromLongLong(peek_call(self, id) - 1);
}

PyObject* counters_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (PyTuple_GET_SIZE(args) != 0 || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
    PyErr_SetString(PyExc_TypeError, "StepCounters()");
    return nullptr;
  }
  auto* self = reinterpret_cast<StepCounters*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->span_count = 0;
  self->step = 1;
  self->dense = new std::vector<CallCount>();
  self->sparse = new std::unordered_map<long long, CallCount>();
  return reinterpret_cast<PyObject*>(self);
}

void counters_dealloc(PyObject* self_) {
  auto* self = reinterpret_cast<StepCounters*>(self_);
  delete self->dense;
  delete self->sparse;
  Py_TYPE(self_)->tp_free(self_);
}

PyMethodDef counters_methods[] = {
    {"open", counters_open, METH_O, "open(path_id) -> (call, index): a call of the path opened"},
    {"reset", counters_reset, METH_NOARGS, "a new step: no span and no call yet"},
    {"set_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(counters_set_call)),
     METH_FASTCALL, "set_call(path_id, call): the path's last call in this step"},
    {"last_call", counters_last_call, METH_O, "last_call(path_id): its last call's number in this step, -1: none"},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef counters_members[] = {
    {"span_count", T_LONGLONG, offsetof(StepCounters, span_count), 0, "spans opened in this step"},
    {nullptr, 0, 0, 0, nullptr}};

bool ready_step_counters() {
  PyTypeObject& t = StepCountersType;
  t.tp_name = "tensor_trace_native.StepCounters";
  t.tp_basicsize = sizeof(StepCounters);
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_new = counters_new;
  t.tp_dealloc = counters_dealloc;
  t.tp_methods = counters_methods;
  t.tp_members = counters_members;
  t.tp_doc = "a traced step's span and call counters: see tracer/native_counters.py";
  return PyType_Ready(&t) == 0;
}
"""
