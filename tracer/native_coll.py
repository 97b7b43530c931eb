"""C++ for a traced c10d collective: ``TracedCollective``, the C path of tracer/collectives.py's
wrapper (tracer/native.py builds it with the rest of the extension; tracer/native_coll_type.py holds its
Python type and ``attach``, which ``CollectiveInterceptor.use_native`` calls to hand one to each
wrapper of a collective of tensors: the wrapper calls it first).

On a CPU a traced collective of a small TP model cost about 26 us of the rank's main thread in
the Python wrapper (five Python calls of the tracer's: the wrapper, group_seq, begin, finish,
the layout key), on a step of 4.8 ms with fourteen of them (bench/example_tp2_ab.py). Here the
common case is one C call: the same checks, the group's sequence number, ``begin``'s token
values, the real call with ``in_collective`` set, and ``finish``'s COLLECTIVE record, appended
to the writer's ``pending`` list as the msgpack bytes of its tuple (as tracer/native_call.py
appends spans: ``RankWriter.flush`` writes such items as they are, so the rank file is the same).

The common case: the tracer enabled, not busy, not inside another collective; a process group
given as an object or None (the default group), known to the interceptor with its GROUP record
written to this rank file; no functional collective waiting to be written; and, in the --steps
window, a synchronous call (``async_op`` absent, None or False) of one plain CPU tensor in and
one plain CPU tensor or a list or tuple of them out, no lineage mode, not capturing a CUDA graph,
and tracer/native.py's ``call_key`` the layout key spans.py uses. On a fingerprinted step the
fingerprints (and the inputs' nonzero rows) are what ``CollectiveInterceptor.fp_inputs`` takes
before the call and ``fp_outputs`` after it, the Python functions that ``begin`` and ``finish``
call: their common case, immediate values of tensors tracer/native_host.py reads with nothing
deferred held, in C there (``coll_fp_input_host``, ``coll_fp_outputs_host``: the same reads and
writes of StepFingerprints' state, tested against them), everything else through those
functions. On the example at tp=2 a fingerprinted step's collectives went through the whole
Python wrapper at about 36 us each, of which those two calls were about 15.
Outside the window only the sequence number is advanced (what the Python wrapper does there).
Everything else goes to the Python wrapper, whole, before anything is changed: it stays the one
definition of every other case. After the call, a layout not cached yet in
``tracer.layouts.coll`` (the first call of its shapes in this rank file), a step that turned
fingerprints on or off or lineage on meanwhile, and an exception from the call go to
``CollectiveInterceptor.finish`` with the token the Python ``begin`` would have made (its
``fp_pre``, and its nonzero rows in ``rows_of``).
"""



SOURCE = r"""
// ---------------------------------------------------------------- TracedCollective: see tracer/native_coll.py
enum CollName {
  cEnabled, cInCollective, cBusy, cTracingStep, cFpNow, cCapturing, cWriter, cStack, cStep,
  cStepT0Raw, cCollCount, cLayouts, cLineage, cWrittenGroups, cGroups, cSeq, cFunctional, cReady,
  cMode, cGroupName, cColl, cPending, cMaxBuffered, cStringIds, cString, cFlush, cCallKey, cSum,
  cOnError, cRowsOf, cNonzeroRows, cFps, cNames
};
const char* const cNameText[cNames] = {
  "enabled", "in_collective", "_busy", "_tracing_step", "fp_now", "capturing", "writer", "stack",
  "step", "step_t0_raw", "coll_count", "layouts", "lineage", "written_groups", "groups", "seq",
  "functional", "ready", "mode", "group_name", "coll", "pending", "max_buffered", "string_ids",
  "string", "flush", "call_key", "sum", "on_error", "rows_of", "nonzero_rows", "fps"};
PyObject* cnames[cNames];
constexpr int kMaxParams = 8;
constexpr int kOpCache = 8;

struct TracedCollective {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* python_path;  // the Python wrapper without this C path: every other call
  PyObject* inner;        // torch's own function
  PyObject* tracer;
  PyObject* state;        // tracer.__dict__
  PyObject* ic_state;     // the CollectiveInterceptor's __dict__ (groups, seq, functional)
  PyObject* op;           // the collective's name, as written
  PyObject* params;       // its parameter names (a tuple)
  Py_ssize_t group_at, in_at, out_at, op_at, async_at;  // positions in params, -1 none
  int reducing;           // a reducing collective: its record names a reduce op ("sum" by default)
  PyObject* tensor_type;  // torch.Tensor
  PyObject* default_group;   // c10d._get_default_group
  PyObject* reduce_op_name;  // collective_specs.reduce_op_name
  PyObject* finish;       // CollectiveInterceptor.finish (bound)
  PyObject* fp_inputs;    // CollectiveInterceptor.fp_inputs (bound): a fingerprinted step's
  PyObject* fp_outputs;   // ... and fp_outputs, so that fingerprints have one definition
  int row_checked;        // a collective whose inputs' nonzero rows are recorded (ROW_CHECKED)
  PyObject* spans_dict;   // tracer/spans.py's module __dict__ ...
  PyObject* call_key;     // ... whose call_key must be this (the layout cache's keys)
  PyObject* coll_tag;     // schema.COLLECTIVE
  PyObject* op_objs[kOpCache];   // reduce ops seen (strong references: their ids stay theirs)
  PyObject* op_texts[kOpCache];  // ... and reduce_op_name of each
  int n_ops;
  int active;
  long long recorded;     // records written here (the rest: by the Python code)
};

PyTypeObject TracedCollectiveType = {PyVarObject_HEAD_INIT(nullptr, 0)};

inline PyObject* cstate(PyObject* d, CollName n) {  // borrowed, NULL if missing (str keys: no error)
  PyObject* v = PyDict_GetItemWithError(d, cnames[n]);
  if (v == nullptr) PyErr_Clear();
  return v;
}

// A plain tensor not on a CUDA device (a CUDA one is timed by events: the Python path).
inline bool host_tensor(TracedCollective* self, PyObject* o) {
  if (Py_TYPE(o) != reinterpret_cast<PyTypeObject*>(self->tensor_type)) return false;
  return !THPVariable_Unpack(o).is_cuda();
}

// The layout key that tracer/collectives.py's finish takes: call_key((input,), None, outputs,
// set()), built here from the tensors. -1 for a tensor it does not read.
int64_t coll_key(PyObject* in, PyObject* const* outs, Py_ssize_t n_out) {
  key_buf.clear();
  key_buf.push_back(0);
  if (!put_meta(in)) return -1;
  for (Py_ssize_t j = 0; j < n_out; ++j) {
    key_buf.push_back(-2 - j);
    if (!put_meta(outs[j])) return -1;
  }
  return id_of(call_ids);
}

// The string's id in the writer's table (writer.string_ids, else writer.string(text)): a new
// reference, or NULL with an exception.
PyObject* string_id(PyObject* writer, PyObject* ids, PyObject* text) {
  PyObject* v = PyDict_GetItemWithError(ids, text);
  if (v != nullptr) return Py_NewRef(v);
  if (PyErr_Occurred()) return nullptr;
  PyObject* argv[2] = {writer, text};
  return PyObject_VectorcallMethod(cnames[cString], argv, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
}

// reduce_op_name(op) (a new reference), remembered by the op's identity for the first few ops.
PyObject* op_text(TracedCollective* self, PyObject* op) {
  for (int i = 0; i < self->n_ops; ++i)
    if (self->op_objs[i] == op) return Py_NewRef(self->op_texts[i]);
  PyObject* text = PyObject_CallOneArg(self->reduce_op_name, op);
  if (text != nullptr && !PyUnicode_CheckExact(text)) {
    Py_DECREF(text);
    PyErr_SetString(PyExc_TypeError, "reduce_op_name");
    return nullptr;
  }
  if (text != nullptr && self->n_ops < kOpCache) {
    self->op_objs[self->n_ops] = Py_NewRef(op);
    self->op_texts[self->n_ops++] = Py_NewRef(text);
  }
  return text;
}

// The values of a call as begin made them (tracer/collectives.py's token, items 0-12).
struct CollCall {
  PyObject* group_owned = nullptr;  // the default group, when it was looked up
  PyObject* pg_name = nullptr;
  PyObject* gid = nullptr;
  PyObject* in = nullptr;           // borrowed (the caller's arguments)
  PyObject* out = nullptr;          // borrowed: the output argument as given
  PyObject* op = nullptr;           // borrowed: the reduce op argument, NULL or None for none
  PyObject* const* outs = nullptr;  // the output tensors
  Py_ssize_t n_out = 0;
  PyObject* index = nullptr;
  PyObject* seq = nullptr;
  PyObject* parent = nullptr;
  PyObject* step = nullptr;
  bool fp = false;                  // a fingerprinted step: fp_pre and rows from fp_inputs
  PyObject* fp_pre = nullptr;
  PyObject* rows = nullptr;         // the inputs' nonzero rows, or None
  int64_t t0 = 0;
  ~CollCall() {
    Py_XDECREF(group_owned); Py_XDECREF(pg_name); Py_XDECREF(gid); Py_XDECREF(index); Py_XDECREF(seq);
    Py_XDECREF(parent); Py_XDECREF(step); Py_XDECREF(fp_pre); Py_XDECREF(rows);
  }
};

// The token tracer/collectives.py's begin returns, with the output appended: a new list.
PyObject* coll_token(TracedCollective* self, CollCall& c) {
  PyObject* t0 = PyLong_FromLongLong(c.t0);
  PyObject* inputs = PyList_New(1);
  PyObject* fp_pre = c.fp_pre != nullptr ? Py_NewRef(c.fp_pre) : PyLong_FromLong(-1);
  PyObject* token = PyList_New(13);
  if (t0 == nullptr || inputs == nullptr || fp_pre == nullptr || token == nullptr) {
    Py_XDECREF(t0); Py_XDECREF(inputs); Py_XDECREF(fp_pre); Py_XDECREF(token);
    return nullptr;
  }
  PyList_SET_ITEM(inputs, 0, Py_NewRef(c.in));
  PyObject* items[13] = {self->op, c.op != nullptr ? c.op : Py_None, c.gid, c.seq, t0, c.index, c.parent,
                         inputs, fp_pre, Py_False, c.step, Py_None, c.out};
  for (int i = 0; i < 13; ++i) PyList_SET_ITEM(token, i, (i == 4 || i == 7 || i == 8) ? items[i] : Py_NewRef(items[i]));
  return token;
}

// interceptor.finish(token[, error=True]): the Python end of a call begun here (the inputs' nonzero
// rows where finish looks for them, in rows_of by the token's id, as begin leaves them). Keeps
// the exception being raised, if any.
void python_finish(TracedCollective* self, CollCall& c, bool error) {
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  if (error) PyErr_Fetch(&type, &value, &tb);
  PyObject* token = coll_token(self, c);
  PyObject* r = nullptr;
  if (token != nullptr && c.rows != nullptr && c.rows != Py_None) {
    PyObject* rows_of = cstate(self->ic_state, cRowsOf);
    PyObject* id = PyLong_FromVoidPtr(token);
    if (rows_of == nullptr || !PyDict_CheckExact(rows_of) || id == nullptr ||
        PyDict_SetItem(rows_of, id, c.rows) < 0)
      Py_CLEAR(token);  // (out of memory, or no dict: no record rather than one without its rows)
    Py_XDECREF(id);
  }
  if (token != nullptr) {
    PyObject* argv[2] = {token, Py_True};
    r = PyObject_Vectorcall(self->finish, argv, error ? 2 : 1, nullptr);
    Py_DECREF(token);
  }
  if (r == nullptr) PyErr_Clear();  // (finish reports its own errors: this is out of memory)
  Py_XDECREF(r);
  if (error) PyErr_Restore(type, value, tb);
}

// What the step records now: 0 no fingerprints and no lineage, 1 fingerprints without lineage
// (taken through the interceptor's fp_inputs and fp_outputs), -1 lineage (the Python path's).
inline int step_mode(PyObject* st) {
  PyObject* fp = cstate(st, cFpNow);
  if (fp != Py_False && fp != Py_True) return -1;
  PyObject* lineage = cstate(st, cLineage);
  if (lineage == nullptr) return -1;
  if (lineage != Py_None) {
    PyObject* mode = PyObject_GetAttr(lineage, cnames[cMode]);
    if (mode == nullptr) { PyErr_Clear(); return -1; }
    Py_DECREF(mode);  // (only compared with None)
    if (mode != Py_None) return -1;
  }
  return fp == Py_True ? 1 : 0;
}

// finish's COLLECTIVE record for a call begun here: 1 written, 0 for the Python finish (a layout
// not cached yet, a step that fingerprints now), -1 an exception (reported by the caller).
int coll_record(TracedCollective* self, CollCall& c) {
  PyObject* st = self->state;
  PyObject* writer = cstate(st, cWriter);
  if (writer == nullptr) return 0;
  if (writer == Py_None) return 1;  // (finish writes nothing then)
  int mode = step_mode(st);
  if (mode < 0 || (mode == 1) != c.fp) return 0;
  int64_t t1 = now_ns();
  // The outputs as finish reads them, after the call (a list could have changed meanwhile).
  if (Py_TYPE(c.out) == reinterpret_cast<PyTypeObject*>(self->tensor_type)) {
    c.outs = &c.out;
    c.n_out = 1;
  } else {
    c.outs = PySequence_Fast_ITEMS(c.out);
    c.n_out = PySequence_Fast_GET_SIZE(c.out);
    for (Py_ssize_t j = 0; j < c.n_out; ++j)
      if (Py_TYPE(c.outs[j]) != reinterpret_cast<PyTypeObject*>(self->tensor_type)) return 0;
  }
  int64_t key = coll_key(c.in, c.outs, c.n_out);
  if (key < 0) return 0;
  PyObject* layouts = cstate(st, cLayouts);
  if (layouts == nullptr) return 0;
  PyObject* coll = PyObject_GetAttr(layouts, cnames[cColl]);
  if (coll == nullptr) return -1;
  PyObject* k = PyLong_FromLongLong(key);
  PyObject* hit = k == nullptr || !PyDict_Check(coll) ? nullptr : PyDict_GetItemWithError(coll, k);
  Py_XDECREF(k);
  if (hit == nullptr || !PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) != 2) {
    Py_DECREF(coll);
    return PyErr_Occurred() ? -1 : 0;
  }
  Py_INCREF(hit);  // (string() below may forget the writer's ids, and clear the cache)
  Py_DECREF(coll);
  PyObject* fp_post = nullptr;  // (finish's fp_post: taken once the record is this one's to write)
  if (c.fp) {  // CPU tensors in C (tracer/native_host.py), else the interceptor's fp_outputs
    PyObject* fps = cstate(st, cFps);
    fp_post = fps == nullptr ? nullptr : coll_fp_outputs_host(fps, c.outs, c.n_out);
    if (fp_post == nullptr && !PyErr_Occurred()) {
      PyObject* outputs = PyList_New(c.n_out);
      for (Py_ssize_t j = 0; outputs != nullptr && j < c.n_out; ++j) PyList_SET_ITEM(outputs, j, Py_NewRef(c.outs[j]));
      fp_post = outputs == nullptr ? nullptr : PyObject_CallOneArg(self->fp_outputs, outputs);
      Py_XDECREF(outputs);
    }
    if (fp_post == nullptr) { Py_DECREF(hit); return -1; }
  }
  PyObject* ids = PyObject_GetAttr(writer, cnames[cStringIds]);
  PyObject *redop = nullptr, *op_id = nullptr;
  int r = -1;
  if (ids != nullptr && PyDict_Check(ids)) {
    bool named = c.op != nullptr && c.op != Py_None;
    if (named || self->reducing) {  // (in this order: the file's STRING records as finish writes them)
      PyObject* text = named ? op_text(self, c.op) : Py_NewRef(cnames[cSum]);
      redop = text == nullptr ? nullptr : string_id(writer, ids, text);
      Py_XDECREF(text);
    } else {
      redop = PyLong_FromLong(-1);
    }
    op_id = redop == nullptr ? nullptr : string_id(writer, ids, self->op);
    if (op_id != nullptr) r = 0;
  }
  PyObject* raw = cstate(st, cStepT0Raw);
  if (r == 0 && raw == nullptr) r = -1;
  long long t0_raw = r == 0 ? as_long_long(raw) : 0;
  if (r == 0 && t0_raw == -1 && PyErr_Occurred()) r = -1;
  PyObject* rec = nullptr;
  if (r == 0) {
    // (COLLECTIVE, step, index, parent, op, redop, group, seq, t0 - step start, duration, layout,
    //  fp_pre, fp_post, inputs, flags, bytes): flags 0 (synchronous, no error, not captured)
    PyObject* items[16] = {self->coll_tag, c.step, c.index, c.parent, op_id, redop, c.gid, c.seq,
                           nullptr, nullptr, PyTuple_GET_ITEM(hit, 0), c.fp_pre, fp_post, nullptr,
                           nullptr, PyTuple_GET_ITEM(hit, 1)};
    long long fixed[16] = {0};
    fixed[8] = c.t0 - t0_raw; fixed[9] = t1 - c.t0; fixed[11] = -1; fixed[12] = -1; fixed[13] = 1;
    // (finish's attributes: the inputs' nonzero rows, on a fingerprinted step of a collective
    // that records them)
    bool rows = c.rows != nullptr && c.rows != Py_None;
    uint8_t packed[3 + 16 * 9] = {0xdc, 0, 16};  // an array of 16 (msgpack's array 16: over 15 items)
    uint8_t* p = rows ? nullptr : pack_ints(packed + 3, items, fixed, 16);
    if (p != nullptr) {
      rec = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(packed), p - packed);
    } else {  // (attributes, or a value that is no int of 64 bits: the tuple, as finish appends it)
      rec = PyTuple_New(rows ? 17 : 16);
      for (int i = 0; rec != nullptr && i < 16; ++i) {
        PyObject* v = items[i] != nullptr ? Py_NewRef(items[i]) : PyLong_FromLongLong(fixed[i]);
        if (v == nullptr) { Py_CLEAR(rec); break; }
        PyTuple_SET_ITEM(rec, i, v);
      }
      if (rec != nullptr && rows) {
        PyObject* attrs = PyDict_New();
        if (attrs == nullptr || PyDict_SetItem(attrs, cnames[cNonzeroRows], c.rows) < 0) {
          Py_XDECREF(attrs);
          Py_CLEAR(rec);
        } else {
          PyTuple_SET_ITEM(rec, 16, attrs);
        }
      }
    }
    if (rec == nullptr) r = -1;
  }
  if (r == 0) {
    PyObject* pending = PyObject_GetAttr(writer, cnames[cPending]);
    r = pending == nullptr ? -1 : PyList_Append(pending, rec);
    if (r == 0) {
      PyObject* most = PyObject_GetAttr(writer, cnames[cMaxBuffered]);
      long long bound = most == nullptr ? -1 : as_long_long(most);
      Py_XDECREF(most);
      if (PyErr_Occurred()) {
        r = -1;
      } else if (PyList_GET_SIZE(pending) >= bound) {
        PyObject* done = PyObject_CallMethodNoArgs(writer, cnames[cFlush]);
        if (done == nullptr) r = -1;
        Py_XDECREF(done);
      }
    }
    Py_XDECREF(pending);
  }
  Py_XDECREF(rec); Py_XDECREF(ids); Py_XDECREF(redop); Py_XDECREF(op_id); Py_XDECREF(fp_post); Py_DECREF(hit);
  if (r == 0) ++self->recorded;
  return r < 0 ? -1 : 1;
}

// Tracer.on_error(f"collective {op}", exc) for the exception raised, as finish's except clause.
void coll_report(TracedCollective* self) {
  if (!PyErr_ExceptionMatches(PyExc_Exception)) { PyErr_Clear(); return; }
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  PyObject* where = PyUnicode_FromFormat("collective %U", self->op);
  PyObject* r = where == nullptr ? nullptr
      : PyObject_CallMethodObjArgs(self->tracer, cnames[cOnError], where, value ? value : Py_None, nullptr);
  if (r == nullptr) PyErr_Clear();
  Py_XDECREF(r); Py_XDECREF(where);
  Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
}

inline bool set_in_collective(PyObject* st, PyObject* v) {
  // (the tracer's __dict__ written as its __setattr__ would: no TracedCall keeps this attribute)
  return PyDict_SetItem(st, cnames[cInCollective], v) == 0;
}

// begin's fingerprint of the inputs and their nonzero rows, before the call, into c.fp_pre and
// c.rows: a CPU tensor's in C (tracer/native_host.py), else the interceptor's fp_inputs. 0, or -1
// with an exception.
int coll_fp_pre(TracedCollective* self, PyObject* st, CollCall& c) {
  PyObject* fps = cstate(st, cFps);
  int done = fps == nullptr ? 0 : coll_fp_input_host(fps, c.in, self->row_checked, &c.fp_pre, &c.rows);
  if (done != 0) return done > 0 ? 0 : -1;
  PyObject* inputs = PyList_New(1);
  if (inputs == nullptr) return -1;
  PyList_SET_ITEM(inputs, 0, Py_NewRef(c.in));
  PyObject* argv[2] = {inputs, self->row_checked ? Py_True : Py_False};
  PyObject* r = PyObject_Vectorcall(self->fp_inputs, argv, 2, nullptr);
  Py_DECREF(inputs);
  if (r != nullptr && (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 2)) {
    Py_CLEAR(r);
    PyErr_SetString(PyExc_TypeError, "fp_inputs");
  }
  if (r == nullptr) return -1;
  c.fp_pre = Py_NewRef(PyTuple_GET_ITEM(r, 0));
  c.rows = Py_NewRef(PyTuple_GET_ITEM(r, 1));
  Py_DECREF(r);
  return 0;
}

// 1 the call is one this does (c filled, the group's sequence and the collective count taken),
// 0 the Python wrapper's (nothing changed), -1 the call is made as is: outside the window (the
// sequence taken), or its inputs' fingerprint failed (reported).
int coll_begin(TracedCollective* self, PyObject* const* vals, CollCall& c) {
  PyObject *st = self->state, *ic = self->ic_state;
  if (cstate(st, cEnabled) != Py_True || cstate(st, cInCollective) != Py_False ||
      cstate(st, cBusy) != Py_False)
    return 0;
  // The call's tensors first: a CUDA step's collectives leave here at once.
  bool tracing = cstate(st, cTracingStep) == Py_True;
  if (tracing) {
    PyObject* a = self->async_at >= 0 ? vals[self->async_at] : nullptr;
    if (a != nullptr && a != Py_None && a != Py_False) return 0;
    c.in = self->in_at >= 0 ? vals[self->in_at] : nullptr;
    c.out = self->out_at >= 0 ? vals[self->out_at] : nullptr;
    if (c.in == nullptr || c.out == nullptr || !host_tensor(self, c.in)) return 0;
    if (Py_TYPE(c.out) == reinterpret_cast<PyTypeObject*>(self->tensor_type)) {
      c.outs = &c.out;
      c.n_out = 1;
    } else if (PyList_CheckExact(c.out) || PyTuple_CheckExact(c.out)) {
      c.outs = PySequence_Fast_ITEMS(c.out);
      c.n_out = PySequence_Fast_GET_SIZE(c.out);
      if (c.n_out == 0) return 0;
    } else {
      return 0;
    }
    for (Py_ssize_t j = 0; j < c.n_out; ++j)
      if (!host_tensor(self, c.outs[j])) return 0;
    c.op = self->op_at >= 0 ? vals[self->op_at] : nullptr;
    PyObject* writer = cstate(st, cWriter);
    int mode = step_mode(st);
    if (writer == nullptr || writer == Py_None || cstate(st, cCapturing) != Py_False || mode < 0 ||
        PyDict_GetItemWithError(self->spans_dict, cnames[cCallKey]) != self->call_key)
      return 0;
    c.fp = mode == 1;
    PyObject* functional = cstate(ic, cFunctional);
    PyObject* ready = functional == nullptr ? nullptr : PyObject_GetAttr(functional, cnames[cReady]);
    if (ready == nullptr) return 0;
    Py_DECREF(ready);  // (the functional collectives' object holds it)
    if (!PyList_CheckExact(ready) || PyList_GET_SIZE(ready) != 0) return 0;
  }
  PyObject* group = self->group_at >= 0 ? vals[self->group_at] : nullptr;
  if (group == nullptr || group == Py_None) {
    c.group_owned = PyObject_CallNoArgs(self->default_group);
    if (c.group_owned == nullptr) return 0;
    group = c.group_owned;
  } else if (PyUnicode_Check(group)) {
    return 0;
  }
  c.pg_name = PyObject_GetAttr(group, cnames[cGroupName]);
  if (c.pg_name == nullptr || !PyUnicode_CheckExact(c.pg_name) || PyUnicode_GET_LENGTH(c.pg_name) == 0)
    return 0;
  PyObject *groups = cstate(ic, cGroups), *seqs = cstate(ic, cSeq), *written = cstate(st, cWrittenGroups);
  if (groups == nullptr || seqs == nullptr || written == nullptr || !PyDict_CheckExact(groups) ||
      !PyDict_CheckExact(seqs) || !PyAnySet_CheckExact(written))
    return 0;
  PyObject* entry = PyDict_GetItemWithError(groups, c.pg_name);
  if (entry == nullptr || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) < 1) return 0;
  c.gid = Py_NewRef(PyTuple_GET_ITEM(entry, 0));
  // (a group not in this rank file yet: its GROUP record is the Python path's to write; before
  // the rank file exists, only the sequence counts)
  int known = PySet_Contains(written, c.gid);
  if (known != 1 && (known < 0 || cstate(st, cWriter) != Py_None)) return 0;
  PyObject* seq = PyDict_GetItemWithError(seqs, c.gid);
  if (seq == nullptr || !PyLong_CheckExact(seq)) return 0;
  PyObject *stack = nullptr, *count = nullptr;
  if (tracing) {
    stack = cstate(st, cStack);
    count = cstate(st, cCollCount);
    PyObject* step = cstate(st, cStep);
    if (stack == nullptr || !PyList_CheckExact(stack) || count == nullptr || !PyLong_CheckExact(count) ||
        step == nullptr)
      return 0;
    c.step = Py_NewRef(step);
    // The innermost recorded call's span index: spans.innermost_span, as begin inlines it.
    c.parent = nullptr;
    for (Py_ssize_t i = PyList_GET_SIZE(stack) - 1; i >= 0 && c.parent == nullptr; --i) {
      PyObject* frame = PyList_GET_ITEM(stack, i);
      if (!PyList_CheckExact(frame) || PyList_GET_SIZE(frame) < 9) return 0;
      int selected = PyObject_IsTrue(PyList_GET_ITEM(frame, 8));
      if (selected < 0) return 0;
      if (selected) c.parent = Py_NewRef(PyList_GET_ITEM(frame, 1));
    }
    if (c.parent == nullptr) c.parent = PyLong_FromLong(-1);
    c.index = Py_NewRef(count);
  }
  // From here on the call is this one's: the group's sequence (group_seq), the step's count.
  long long seq_now = as_long_long(seq);
  long long count_now = tracing ? as_long_long(count) : 0;
  if (PyErr_Occurred()) return 0;
  c.seq = Py_NewRef(seq);
  PyObject* next = PyLong_FromLongLong(seq_now + 1);
  if (next == nullptr || PyDict_SetItem(seqs, c.gid, next) < 0) { Py_XDECREF(next); return 0; }
  Py_DECREF(next);
  if (!tracing) return -1;
  next = PyLong_FromLongLong(count_now + 1);
  if (next == nullptr || PyDict_SetItem(st, cnames[cCollCount], next) < 0) { Py_XDECREF(next); return 0; }
  Py_DECREF(next);
  if (c.fp && coll_fp_pre(self, st, c) < 0) {  // as the Python wrapper's begin failing: reported,
    coll_report(self);                          // the call made unrecorded
    return -1;
  }
  c.t0 = now_ns();
  return 1;
}

PyObject* traced_collective(PyObject* self_, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<TracedCollective*>(self_);
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  Py_ssize_t np = PyTuple_GET_SIZE(self->params);
  Py_ssize_t nk = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  PyObject* vals[kMaxParams] = {nullptr};
  bool mine = self->active && n <= np;
  for (Py_ssize_t i = 0; mine && i < n; ++i) vals[i] = args[i];
  for (Py_ssize_t k = 0; mine && k < nk; ++k) {  // (a keyword it does not name: the Python wrapper's)
    PyObject* name = PyTuple_GET_ITEM(kwnames, k);
    Py_ssize_t at = -1;
    for (Py_ssize_t i = 0; i < np && at < 0; ++i) {
      PyObject* p = PyTuple_GET_ITEM(self->params, i);
      if (p == name || PyUnicode_Compare(p, name) == 0) at = i;
    }
    if (PyErr_Occurred()) PyErr_Clear();
    if (at < 0 || vals[at] != nullptr) mine = false;
    else vals[at] = args[n + k];
  }
  CollCall c;
  int begun = mine ? coll_begin(self, vals, c) : 0;
  if (begun == 0) {
    if (PyErr_Occurred()) PyErr_Clear();  // (the Python wrapper meets it again, and reports it)
    return PyObject_Vectorcall(self->python_path, args, nargsf, kwnames);
  }
  PyObject* st = self->state;
  set_in_collective(st, Py_True);
  PyObject* result = PyObject_Vectorcall(self->inner, args, nargsf, kwnames);
  if (!set_in_collective(st, Py_False)) PyErr_Clear();
  if (result == nullptr) {
    if (begun == 1) python_finish(self, c, true);
    return nullptr;
  }
  if (begun == 1) {
    int r = coll_record(self, c);
    if (r < 0) coll_report(self);
    else if (r == 0) python_finish(self, c, false);
  }
  return result;
}

"""
