"""tracer/native_coll.py's ``TracedCollective``: ``attach``, which gives one to each c10d wrapper of
tracer/collectives.py, and in C++ its Python type (constructor ``traced_collective``, reference
keeping, ``close``, ``recorded``)."""


def attach(ic, make, key) -> int:
    """Give each c10d wrapper of ``ic`` (a CollectiveInterceptor) of a collective with tensor
    arguments in and out its TracedCollective (``make``: tracer/native.py's
    ``traced_collective``), once that is built and spans.py keys layouts with its ``call_key``
    (``key``: the keys of ``layouts.coll``, which both paths fill and read). How many wrappers
    have one."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    from tensor_trace import schema
    from tensor_trace.tracer import spans
    from tensor_trace.tracer.collective_specs import ALWAYS_ASYNC, C10D_SPECS, REDUCING, ROW_CHECKED, reduce_op_name

    if make is None or key is None or spans.call_key is not key:
        return len(ic.native_calls)
    for name, (use, python_path, orig) in ic.native_paths.items():
        params, in_arg, out_arg, _ = C10D_SPECS[name]
        if name in ic.native_calls or not in_arg or not out_arg or name in ALWAYS_ASYNC:
            continue
        c = make(python_path, orig, ic.tracer, ic, name, tuple(params), in_arg, out_arg, name in REDUCING,
                 torch.Tensor, c10d._get_default_group, reduce_op_name, vars(spans), key, schema.COLLECTIVE,
                 name in ROW_CHECKED)
        ic.native_calls[name] = c
        use(c)
    return len(ic.native_calls)


def detach(ic) -> None:
    """The wrappers of ``ic`` back to their Python path alone, their C paths closed (for good:
    the interceptor is uninstalled)."""
    for use, _, _ in ic.native_paths.values():
        use(None)
    for c in ic.native_calls.values():
        c.close()
    ic.native_calls = {}
    ic.native_paths = {}


SOURCE = r"""
int traced_collective_traverse(PyObject* self_, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<TracedCollective*>(self_);
  Py_VISIT(self->python_path); Py_VISIT(self->inner); Py_VISIT(self->tracer); Py_VISIT(self->state);
  Py_VISIT(self->ic_state); Py_VISIT(self->finish); Py_VISIT(self->fp_inputs); Py_VISIT(self->fp_outputs);
  Py_VISIT(self->spans_dict);
  for (int i = 0; i < self->n_ops; ++i) Py_VISIT(self->op_objs[i]);
  return 0;
}

int traced_collective_clear(PyObject* self_) {
  auto* self = reinterpret_cast<TracedCollective*>(self_);
  Py_CLEAR(self->python_path); Py_CLEAR(self->inner); Py_CLEAR(self->tracer); Py_CLEAR(self->state);
  Py_CLEAR(self->ic_state); Py_CLEAR(self->op); Py_CLEAR(self->params); Py_CLEAR(self->tensor_type);
  Py_CLEAR(self->default_group); Py_CLEAR(self->reduce_op_name); Py_CLEAR(self->finish);
  Py_CLEAR(self->fp_inputs); Py_CLEAR(self->fp_outputs);
  Py_CLEAR(self->spans_dict); Py_CLEAR(self->call_key); Py_CLEAR(self->coll_tag);
  while (self->n_ops > 0) {
    --self->n_ops;
    Py_CLEAR(self->op_objs[self->n_ops]);
    Py_CLEAR(self->op_texts[self->n_ops]);
  }
  self->active = 0;
  return 0;
}

void traced_collective_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  traced_collective_clear(self);
  PyObject_GC_Del(self);
}

PyObject* traced_collective_close(PyObject* self, PyObject*) {
  reinterpret_cast<TracedCollective*>(self)->active = 0;
  Py_RETURN_NONE;
}

PyMethodDef traced_collective_methods[] = {
    {"close", traced_collective_close, METH_NOARGS, "Pass every call to the Python wrapper from now on."},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef traced_collective_members[] = {
    {"python_path", T_OBJECT, offsetof(TracedCollective, python_path), READONLY, "the Python wrapper"},
    {"recorded", T_LONGLONG, offsetof(TracedCollective, recorded), READONLY, "records written in C"},
    {nullptr, 0, 0, 0, nullptr}};

Py_ssize_t param_at(PyObject* params, const char* name) {
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(params); ++i)
    if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(params, i), name) == 0) return i;
  return -1;
}

// traced_collective(python_path, inner, tracer, interceptor, op, params, in_arg, out_arg,
// reducing, tensor_type, default_group, reduce_op_name, spans_dict, call_key, coll_tag, row_checked)
PyObject* traced_collective_new(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (nargs != 16 || !PyUnicode_CheckExact(a[4]) || !PyTuple_CheckExact(a[5]) ||
      PyTuple_GET_SIZE(a[5]) > kMaxParams || !PyDict_Check(a[12])) {
    PyErr_SetString(PyExc_TypeError, "traced_collective(python_path, inner, tracer, interceptor, op, params, "
                    "in_arg, out_arg, reducing, tensor_type, default_group, reduce_op_name, spans_dict, "
                    "call_key, coll_tag, row_checked)");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(a[5]); ++i)
    if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(a[5], i))) {
      PyErr_SetString(PyExc_TypeError, "params: names");
      return nullptr;
    }
  PyObject* state = PyObject_GenericGetDict(a[2], nullptr);
  if (state == nullptr) return nullptr;
  PyObject* ic_state = PyObject_GenericGetDict(a[3], nullptr);
  PyObject* finish = ic_state == nullptr ? nullptr : PyObject_GetAttrString(a[3], "finish");
  PyObject* fp_inputs = finish == nullptr ? nullptr : PyObject_GetAttrString(a[3], "fp_inputs");
  PyObject* fp_outputs = fp_inputs == nullptr ? nullptr : PyObject_GetAttrString(a[3], "fp_outputs");
  if (fp_outputs == nullptr) {
    Py_DECREF(state); Py_XDECREF(ic_state); Py_XDECREF(finish); Py_XDECREF(fp_inputs);
    return nullptr;
  }
  auto* self = PyObject_GC_New(TracedCollective, &TracedCollectiveType);
  if (self == nullptr) {
    Py_DECREF(state); Py_DECREF(ic_state); Py_DECREF(finish); Py_DECREF(fp_inputs); Py_DECREF(fp_outputs);
    return nullptr;
  }
  self->vectorcall = traced_collective;
  self->python_path = Py_NewRef(a[0]);
  self->inner = Py_NewRef(a[1]);
  self->tracer = Py_NewRef(a[2]);
  self->state = state;
  self->ic_state = ic_state;
  self->finish = finish;
  self->fp_inputs = fp_inputs;
  self->fp_outputs = fp_outputs;
  self->row_checked = PyObject_IsTrue(a[15]) == 1;
  self->op = Py_NewRef(a[4]);
  PyUnicode_InternInPlace(&self->op);
  self->params = Py_NewRef(a[5]);
  self->group_at = param_at(a[5], "group");
  const char* in_arg = PyUnicode_Check(a[6]) ? PyUnicode_AsUTF8(a[6]) : nullptr;
  const char* out_arg = PyUnicode_Check(a[7]) ? PyUnicode_AsUTF8(a[7]) : nullptr;
  if (PyErr_Occurred()) PyErr_Clear();
  self->in_at = in_arg != nullptr ? param_at(a[5], in_arg) : -1;
  self->out_at = out_arg != nullptr ? param_at(a[5], out_arg) : -1;
  self->op_at = param_at(a[5], "op");
  self->async_at = param_at(a[5], "async_op");
  self->reducing = PyObject_IsTrue(a[8]) == 1;
  self->tensor_type = Py_NewRef(a[9]);
  self->default_group = Py_NewRef(a[10]);
  self->reduce_op_name = Py_NewRef(a[11]);
  self->spans_dict = Py_NewRef(a[12]);
  self->call_key = Py_NewRef(a[13]);
  self->coll_tag = Py_NewRef(a[14]);
  self->n_ops = 0;
  self->recorded = 0;
  // (a collective without one tensor argument in and one out: never its own)
  self->active = self->in_at >= 0 && self->out_at >= 0;
  PyObject_GC_Track(reinterpret_cast<PyObject*>(self));
  return reinterpret_cast<PyObject*>(self);
}

PyMethodDef traced_collective_def = {
    "traced_collective", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(traced_collective_new)),
    METH_FASTCALL, "traced_collective(...) -> TracedCollective: see tracer/native_coll.py"};

bool ready_traced_collective() {
  for (int i = 0; i < cNames; ++i) {
    cnames[i] = PyUnicode_InternFromString(cNameText[i]);
    if (cnames[i] == nullptr) return false;
  }
  PyTypeObject& t = TracedCollectiveType;
  t.tp_name = "tensor_trace_native.TracedCollective";
  t.tp_basicsize = sizeof(TracedCollective);
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  t.tp_vectorcall_offset = offsetof(TracedCollective, vectorcall);
  t.tp_call = PyVectorcall_Call;
  t.tp_traverse = traced_collective_traverse;
  t.tp_clear = traced_collective_clear;
  t.tp_dealloc = traced_collective_dealloc;
  t.tp_methods = traced_collective_methods;
  t.tp_members = traced_collective_members;
  t.tp_doc = "a traced c10d collective's common case in C: see tracer/native_coll.py";
  return PyType_Ready(&t) == 0;
}
"""
