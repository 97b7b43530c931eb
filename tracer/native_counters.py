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
path's count by moving one number (``calls = {}``).

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
  uint64_t step;  // moved when calls is assigned (from 1: a zeroed CallCount counts in no step)
  std::vector<CallCount> dense;  // by path id (in the object: a call reads no pointer to it first)
  std::unordered_map<long long, CallCount>* sparse;  // ids outside [0, kDenseIds)
};

PyTypeObject StepCountersType = {PyVarObject_HEAD_INIT(nullptr, 0)};

inline CallCount& path_count(StepCounters* s, long long id) {
  if (id >= 0 && id < kDenseIds) {
    std::vector<CallCount>& v = s->dense;
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

// calls: the paths' last call numbers in this step, as a dict (for tests and hand-overs: a copy).
PyObject* counters_get_calls(PyObject* self_, void*) {
  auto* self = reinterpret_cast<StepCounters*>(self_);
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  auto put = [&](long long id, const CallCount& c) {
    if (c.step != self->step) return true;
    PyObject* k = PyLong_FromLongLong(id);
    PyObject* v = PyLong_FromLongLong(c.last);
    bool ok = k != nullptr && v != nullptr && PyDict_SetItem(d, k, v) == 0;
    Py_XDECREF(k); Py_XDECREF(v);
    return ok;
  };
  for (size_t i = 0; i < self->dense.size(); ++i)
    if (!put(static_cast<long long>(i), self->dense[i])) { Py_DECREF(d); return nullptr; }
  for (const auto& kv : *self->sparse)
    if (!put(kv.first, kv.second)) { Py_DECREF(d); return nullptr; }
  return d;
}

// calls = {path_id: call, ...}: the step starts over from these counts (a new step: {}; its
// root: {root's path id: 0}), every other path at no call yet. As assigning the Python
// StepCounters' dict does, without a Python call on either path.
int counters_set_calls(PyObject* self_, PyObject* value, void*) {
  auto* self = reinterpret_cast<StepCounters*>(self_);
  if (value == nullptr || !PyDict_Check(value)) {
    PyErr_SetString(PyExc_TypeError, "calls = a dict of path id: call number");
    return -1;
  }
  ++self->step;
  PyObject *k, *v;
  Py_ssize_t pos = 0;
  while (PyDict_Next(value, &pos, &k, &v)) {
    long long id, call = PyLong_AsLongLong(v);
    if ((call == -1 && PyErr_Occurred()) || !path_id_of(k, &id)) return -1;
    CallCount& c = path_count(self, id);
    c.step = self->step;
    c.last = call;
  }
  return 0;
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
  new (&self->dense) std::vector<CallCount>();  // (tp_alloc zeroed the object: constructed here)
  self->sparse = new std::unordered_map<long long, CallCount>();
  return reinterpret_cast<PyObject*>(self);
}

void counters_dealloc(PyObject* self_) {
  auto* self = reinterpret_cast<StepCounters*>(self_);
  self->dense.~vector();
  delete self->sparse;
  Py_TYPE(self_)->tp_free(self_);
}

PyMethodDef counters_methods[] = {
    {"open", counters_open, METH_O, "open(path_id) -> (call, index): a call of the path opened"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef counters_getset[] = {
    {"calls", counters_get_calls, counters_set_calls,
     "this step's calls: path id -> its last call's number (assigned: the step starts over from them)", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

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
  t.tp_getset = counters_getset;
  t.tp_doc = "a traced step's span and call counters: see tracer/native_counters.py";
  return PyType_Ready(&t) == 0;
}
"""
