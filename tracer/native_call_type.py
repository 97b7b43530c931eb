"""C++ for tracer/native_call.py's ``TracedCall``: the Python type itself (its constructor
``traced_call``, reference keeping, ``close``, ``recorded``) and ``patch_call_slots``, which points
the call slot of the modules' classes at it (tracer/native_call.py says how calls reach it)."""

SOURCE = r"""
// The class slot: the modules' classes whose __call__ is the Python wrapper (patch_call_slots)
// are called here, with torch's tuple and dict of arguments, by the TracedCall installed last.
PyObject* active_call = nullptr;
ternaryfunc lookup_slot = nullptr;  // the slot that looks __call__ up (CPython's), as first seen

PyObject* traced_tp_call(PyObject* module, PyObject* args, PyObject* kwargs) {
  if (active_call == nullptr) return lookup_slot(module, args, kwargs);  // closed: CPython's own
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  Py_ssize_t nk = kwargs == nullptr ? 0 : PyDict_GET_SIZE(kwargs);
  PyObject* small[8];
  std::vector<PyObject*> big;
  PyObject** stack = small;
  if (1 + n + nk > 8) {
    big.resize(1 + n + nk);
    stack = big.data();
  }
  stack[0] = module;
  for (Py_ssize_t i = 0; i < n; ++i) stack[1 + i] = PyTuple_GET_ITEM(args, i);
  PyObject* kwnames = nullptr;
  if (nk > 0) {
    kwnames = PyTuple_New(nk);
    if (kwnames == nullptr) return nullptr;
    PyObject *k, *v;
    Py_ssize_t pos = 0, j = 0;
    while (PyDict_Next(kwargs, &pos, &k, &v) && j < nk) {
      PyTuple_SET_ITEM(kwnames, j, Py_NewRef(k));
      stack[1 + n + j] = v;
      ++j;
    }
  }
  // A strong reference for the call: the tracer may close (and drop) it from inside this call.
  PyObject* handle = Py_NewRef(active_call);
  PyObject* r = traced_call(handle, stack, static_cast<size_t>(1 + n), kwnames, args);
  Py_DECREF(handle);
  Py_XDECREF(kwnames);
  return r;
}

// patch_call_slots(traced_call, base, classes): each class in the list whose call slot is
// base's (CPython's, which looks __call__ up: tracer/intercept.py lists the classes whose
// __call__ is the Python wrapper) is called through traced_call from now on; the number
// patched. Assigning __call__ on a class or a base puts CPython's slot back (it updates the
// slots of the class and its subclasses), so does removing the wrapper.
PyObject* patch_call_slots(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (nargs != 3 || Py_TYPE(a[0]) != &TracedCallType || !PyType_Check(a[1]) || !PyList_Check(a[2])) {
    PyErr_SetString(PyExc_TypeError, "patch_call_slots(traced_call, base, classes)");
    return nullptr;
  }
  ternaryfunc base = reinterpret_cast<PyTypeObject*>(a[1])->tp_call;
  if (base != traced_tp_call) lookup_slot = base;
  if (lookup_slot == nullptr) return PyLong_FromLong(0);
  Py_XSETREF(active_call, Py_NewRef(a[0]));
  long patched = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(a[2]); ++i) {
    PyObject* cls = PyList_GET_ITEM(a[2], i);
    if (!PyType_Check(cls)) continue;
    auto* type = reinterpret_cast<PyTypeObject*>(cls);
    if (type->tp_call == lookup_slot || type->tp_call == traced_tp_call) {
      type->tp_call = traced_tp_call;
      ++patched;
    }
  }
  return PyLong_FromLong(patched);
}

PyMethodDef patch_call_slots_def = {
    "patch_call_slots", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(patch_call_slots)),
    METH_FASTCALL, "patch_call_slots(traced_call, base, classes) -> int: see tracer/native_call.py"};

int traced_call_traverse(PyObject* self_, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<TracedCall*>(self_);
  Py_VISIT(self->python_call); Py_VISIT(self->inner); Py_VISIT(self->tracer); Py_VISIT(self->state);
  Py_VISIT(self->tensor_type); Py_VISIT(self->compiler); Py_VISIT(self->span_one);
  Py_VISIT(self->finish); Py_VISIT(self->context); Py_VISIT(self->span_tag);
  Py_VISIT(self->writer); Py_VISIT(self->writer_dict); Py_VISIT(self->layouts_type);
  Py_VISIT(self->run_pending);
  return 0;
}

// What a TracedCall keeps besides the tracer's references (tracer/native_call.py): let go.
void drop_caches(TracedCall* self) {
  Py_CLEAR(self->writer); Py_CLEAR(self->writer_dict);
  Py_CLEAR(self->run); Py_CLEAR(self->run_pending);
  table_drop(self->modules);
  PyObject* type = reinterpret_cast<PyObject*>(self->layouts_type);
  self->layouts_type = nullptr;
  Py_XDECREF(type);
  while (self->n_spare > 0) Py_DECREF(self->spare[--self->n_spare]);
}

int traced_call_clear(PyObject* self_) {
  auto* self = reinterpret_cast<TracedCall*>(self_);
  Py_CLEAR(self->python_call); Py_CLEAR(self->inner); Py_CLEAR(self->tracer); Py_CLEAR(self->state);
  Py_CLEAR(self->tensor_type); Py_CLEAR(self->compiler); Py_CLEAR(self->span_one);
  Py_CLEAR(self->finish); Py_CLEAR(self->context); Py_CLEAR(self->span_tag);
  self->active = 0;
  drop_caches(self);
  return 0;
}

void traced_call_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  traced_call_clear(self);
  delete reinterpret_cast<TracedCall*>(self)->modules;
  PyObject_GC_Del(self);
}

PyObject* traced_call_close(PyObject* self, PyObject*) {
  reinterpret_cast<TracedCall*>(self)->active = 0;
  drop_caches(reinterpret_cast<TracedCall*>(self));  // (the writer: no longer kept alive here)
  // Classes whose slot is still patched call CPython's own slot from now on, so the module
  // global no longer keeps this object, and through it the tracer, alive for the process.
  if (active_call == self) Py_CLEAR(active_call);
  Py_RETURN_NONE;
}

PyMethodDef traced_call_methods[] = {
    {"close", traced_call_close, METH_NOARGS, "Pass every call to the Python wrapper from now on."},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef traced_call_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(TracedCall, inner), READONLY, "torch's own Module.__call__"},
    {"python_call", T_OBJECT, offsetof(TracedCall, python_call), READONLY, "the Python wrapper"},
    {"recorded", T_LONGLONG, offsetof(TracedCall, recorded), READONLY, "spans recorded in C"},
    {"kept_layouts", T_LONGLONG, offsetof(TracedCall, kept_layouts), READONLY,
     "of them, one-tensor calls whose layout was kept in C (tracer/native_modules.py)"},
    {nullptr, 0, 0, 0, nullptr}};


// The tracer's class gets these as __setattr__ and __delattr__ (count_assignments): object's own,
// plus state_version moved, so that a TracedCall knows whether what it read of the tracer's
// __dict__ is still there.
PyObject* tracer_setattr(PyObject* self, PyObject* const* a, Py_ssize_t n) {
  if (n != 2) {
    PyErr_SetString(PyExc_TypeError, "__setattr__(name, value)");
    return nullptr;
  }
  // Moved first: the value replaced may die inside the assignment and run Python (a __del__)
  // that reaches a TracedCall, which must not find its borrowed pointer current then.
  ++state_version;
  if (PyObject_GenericSetAttr(self, a[0], a[1]) < 0) return nullptr;
  Py_RETURN_NONE;
}

PyObject* tracer_delattr(PyObject* self, PyObject* name) {
  ++state_version;
  if (PyObject_GenericSetAttr(self, name, nullptr) < 0) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef tracer_setattr_def = {"__setattr__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(tracer_setattr)),
                                  METH_FASTCALL, "object.__setattr__, counted (tracer/native_call.py)"};
PyMethodDef tracer_delattr_def = {"__delattr__", tracer_delattr, METH_O,
                                  "object.__delattr__, counted (tracer/native_call.py)"};

bool is_method(PyObject* d, PyMethodDef* def) {
  return d != nullptr && Py_IS_TYPE(d, &PyMethodDescr_Type) &&
         reinterpret_cast<PyMethodDescrObject*>(d)->d_method == def;
}

// Whether `type` counts its instances' assignments: made so here where its __setattr__ and
// __delattr__ are object's own (the tracer's class, once per process); else false (some class
// of its own: the TracedCall then reads the tracer's __dict__ at every call).
bool count_assignments(PyTypeObject* type) {
  PyObject* set_name = PyUnicode_InternFromString("__setattr__");
  PyObject* del_name = PyUnicode_InternFromString("__delattr__");
  if (set_name == nullptr || del_name == nullptr) {
    Py_XDECREF(set_name); Py_XDECREF(del_name);
    PyErr_Clear();
    return false;
  }
  bool ok = false;
  PyObject* object_set = _PyType_Lookup(&PyBaseObject_Type, set_name);  // (3.12: no tp_dict to read)
  PyObject* object_del = _PyType_Lookup(&PyBaseObject_Type, del_name);
  PyObject* set = _PyType_Lookup(type, set_name);
  PyObject* del = _PyType_Lookup(type, del_name);
  if (is_method(set, &tracer_setattr_def) && is_method(del, &tracer_delattr_def)) {
    ok = true;
  } else if (set != nullptr && set == object_set && del != nullptr && del == object_del) {
    PyObject* s = PyDescr_NewMethod(type, &tracer_setattr_def);
    PyObject* d = PyDescr_NewMethod(type, &tracer_delattr_def);
    ok = s != nullptr && d != nullptr && PyObject_SetAttr(reinterpret_cast<PyObject*>(type), set_name, s) == 0 &&
         PyObject_SetAttr(reinterpret_cast<PyObject*>(type), del_name, d) == 0;
    Py_XDECREF(s); Py_XDECREF(d);
  }
  if (PyErr_Occurred()) PyErr_Clear();
  Py_DECREF(set_name); Py_DECREF(del_name);
  return ok;
}

// traced_call(python_call, inner, tracer, tensor_type, compiler_dict, span_one, finish,
// context, span_tag): a new TracedCall (see tracer/native_call.py).
PyObject* traced_call_new(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (nargs != 9 || !PySet_Check(a[7]) || !PyDict_Check(a[4]) || !PyType_Check(a[3])) {
    PyErr_SetString(PyExc_TypeError, "traced_call(python_call, inner, tracer, tensor_type, "
                    "compiler_dict, span_one, finish, context, span_tag)");
    return nullptr;
  }
  PyObject* state = PyObject_GenericGetDict(a[2], nullptr);
  if (state == nullptr) return nullptr;
  auto* self = PyObject_GC_New(TracedCall, &TracedCallType);
  if (self == nullptr) { Py_DECREF(state); return nullptr; }
  self->vectorcall = traced_call_vector;
  self->python_call = Py_NewRef(a[0]);
  self->inner = Py_NewRef(a[1]);
  self->tracer = Py_NewRef(a[2]);
  self->state = state;
  self->tensor_type = Py_NewRef(a[3]);
  self->compiler = Py_NewRef(a[4]);
  self->span_one = Py_NewRef(a[5]);
  self->finish = Py_NewRef(a[6]);
  self->context = Py_NewRef(a[7]);
  self->span_tag = Py_NewRef(a[8]);
  self->active = 1;
  self->recorded = self->kept_layouts = 0;
  self->writer = self->writer_dict = nullptr;
  self->writer_counts = false;
  self->writer_seen = self->most_seen = 0;
  self->writer_most = -1;
  for (PyObject*& v : self->writer_cached) v = nullptr;
  self->layouts_type = nullptr;
  self->one_offset = self->by_call_key_offset = -1;
  self->n_spare = 0;
  self->modules = nullptr;
  self->compiler_version = 0;
  self->compiling_now = false;
  self->run = self->run_pending = nullptr;
  self->run_taken = -1;
  self->run_extra = 0;
  self->cache_state = count_assignments(Py_TYPE(a[2]));
  self->seen_version = 0;  // (state_version starts at 1: read at the first call)
  self->ints_seen = 0;
  self->ints_ok = 0;
  for (int i = 0; i < kNames; ++i) self->cached[i] = nullptr;
  PyObject_GC_Track(reinterpret_cast<PyObject*>(self));
  return reinterpret_cast<PyObject*>(self);
}

PyMethodDef traced_call_def = {
    "traced_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(traced_call_new)),
    METH_FASTCALL, "traced_call(...) -> TracedCall: see tracer/native_call.py"};

bool ready_traced_call() {
  if (!intern_names()) return false;
  PyTypeObject& t = TracedCallType;
  t.tp_name = "tensor_trace_native.TracedCall";
  t.tp_basicsize = sizeof(TracedCall);
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  t.tp_vectorcall_offset = offsetof(TracedCall, vectorcall);
  t.tp_call = PyVectorcall_Call;
  t.tp_traverse = traced_call_traverse;
  t.tp_clear = traced_call_clear;
  t.tp_dealloc = traced_call_dealloc;
  t.tp_methods = traced_call_methods;
  t.tp_members = traced_call_members;
  t.tp_doc = "torch.nn.Module.__call__ while a step is traced: see tracer/native_call.py";
  return PyType_Ready(&t) == 0;
}
"""
