"""C++ for the spans that tracer/native_call.py's ``TracedCall`` records: ``record_one`` and
``record_known``, the span of a call after it returned; ``SpanRun``, a run of packed span
records queued as one item of the writer's ``pending`` list, and ``append_span``, which packs a
span and adds it there.

Why a run: a GPU step is host-bound, and the host's cost of a call is mostly memory touched. A
span queued as its own object (a tuple, then the bytes of one) was one allocation a call, a list
slot, and memory the model's own work has evicted from the caches by the next call. A run is
one growing byte buffer: a span is its msgpack bytes copied to the buffer's end and one offset.

The queue stays one list in the order records were added, whoever added them: a span goes into
the run that is the list's last item, or into a new run appended to it (after any record the
Python code queued since). So the rank file is byte for byte what the Python path writes:
``RankWriter.flush`` (tracer/writer.py) counts a run by its records when it cuts the queue
into chunks, writes the run's bytes as they are, and hands listeners each record as a tuple.

The writer's bound (``max_buffered`` records queued) is kept here as the Python path keeps it,
a run counted by its records: ``run_extra`` counts the records queued in runs beyond one an item
(counted again from the queue when it was flushed since, or is another list). The Python
code's own checks count a run as one item: between two spans recorded here the queue may grow
past the bound by the records the Python code queued, which its own check bounds again.
"""

SOURCE = r"""
// ---------------------------------------------------------------- SpanRun: see tracer/native_spans.py
struct SpanRun {
  PyObject_HEAD
  uint8_t* data;        // the records' msgpack bytes, one after another
  size_t size, cap;
  uint32_t* ends;       // ends[i]: where record i's bytes end
  Py_ssize_t count, ends_cap;
};
constexpr Py_ssize_t kRunMax = 1 << 16;  // records a run (its offsets stay small)

PyTypeObject SpanRunType = {PyVarObject_HEAD_INIT(nullptr, 0)};

inline SpanRun* as_run(PyObject* o) { return reinterpret_cast<SpanRun*>(o); }

// One record's bytes at the run's end: 0, or -1 with MemoryError.
int run_add(SpanRun* r, const uint8_t* bytes, size_t n) {
  if (r->size + n > r->cap) {
    size_t cap = std::max<size_t>({r->cap * 2, r->size + n, 8192});
    void* d = PyMem_Realloc(r->data, cap);
    if (d == nullptr) { PyErr_NoMemory(); return -1; }
    r->data = static_cast<uint8_t*>(d);
    r->cap = cap;
  }
  if (r->count == r->ends_cap) {
    Py_ssize_t cap = std::max<Py_ssize_t>(r->ends_cap * 2, 256);
    void* e = PyMem_Realloc(r->ends, static_cast<size_t>(cap) * sizeof(uint32_t));
    if (e == nullptr) { PyErr_NoMemory(); return -1; }
    r->ends = static_cast<uint32_t*>(e);
    r->ends_cap = cap;
  }
  memcpy(r->data + r->size, bytes, n);
  r->size += n;
  r->ends[r->count++] = static_cast<uint32_t>(r->size);
  return 0;
}

inline size_t run_start(SpanRun* r, Py_ssize_t i) { return i == 0 ? 0 : r->ends[i - 1]; }

PyObject* span_run_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* r = reinterpret_cast<SpanRun*>(type->tp_alloc(type, 0));
  if (r == nullptr) return nullptr;
  r->data = nullptr; r->size = r->cap = 0;
  r->ends = nullptr; r->count = r->ends_cap = 0;
  return reinterpret_cast<PyObject*>(r);
}

void span_run_dealloc(PyObject* self) {
  PyMem_Free(as_run(self)->data);
  PyMem_Free(as_run(self)->ends);
  Py_TYPE(self)->tp_free(self);
}

Py_ssize_t span_run_len(PyObject* self) { return as_run(self)->count; }

// append(b): one record's msgpack bytes (what this file's append_span adds; for tests).
PyObject* span_run_append(PyObject* self, PyObject* b) {
  if (!PyBytes_Check(b)) { PyErr_SetString(PyExc_TypeError, "append(bytes)"); return nullptr; }
  if (as_run(self)->count >= kRunMax) { PyErr_SetString(PyExc_OverflowError, "run full"); return nullptr; }
  if (run_add(as_run(self), reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(b)),
              static_cast<size_t>(PyBytes_GET_SIZE(b))) < 0) return nullptr;
  Py_RETURN_NONE;
}

// pack(i, j): the bytes of records i to j (j excluded), one after another.
PyObject* span_run_pack(PyObject* self, PyObject* const* a, Py_ssize_t n) {
  SpanRun* r = as_run(self);
  Py_ssize_t i = n > 0 ? PyLong_AsSsize_t(a[0]) : 0;
  Py_ssize_t j = n > 1 ? PyLong_AsSsize_t(a[1]) : r->count;
  if (PyErr_Occurred()) return nullptr;
  if (n > 2 || i < 0 || j > r->count || i > j) { PyErr_SetString(PyExc_IndexError, "pack(i, j)"); return nullptr; }
  size_t s = run_start(r, i), e = run_start(r, j);
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(r->data + s), static_cast<Py_ssize_t>(e - s));
}

// records(): each record's bytes (listeners unpack them).
PyObject* span_run_records(PyObject* self, PyObject*) {
  SpanRun* r = as_run(self);
  PyObject* out = PyList_New(r->count);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < r->count; ++i) {
    size_t s = run_start(r, i);
    PyObject* b = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(r->data + s),
                                            static_cast<Py_ssize_t>(r->ends[i] - s));
    if (b == nullptr) { Py_DECREF(out); return nullptr; }
    PyList_SET_ITEM(out, i, b);
  }
  return out;
}

PyMethodDef span_run_methods[] = {
    {"append", span_run_append, METH_O, "append(b): one record's msgpack bytes at the end"},
    {"pack", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(span_run_pack)), METH_FASTCALL,
     "pack(i=0, j=len): the bytes of records i to j"},
    {"records", span_run_records, METH_NOARGS, "records(): each record's bytes"},
    {nullptr, nullptr, 0, nullptr}};

PySequenceMethods span_run_sequence = {};

bool ready_span_run() {
  PyTypeObject& t = SpanRunType;
  t.tp_name = "tensor_trace_native.SpanRun";
  t.tp_basicsize = sizeof(SpanRun);
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_new = span_run_new;
  t.tp_dealloc = span_run_dealloc;
  span_run_sequence.sq_length = span_run_len;
  t.tp_as_sequence = &span_run_sequence;
  t.tp_methods = span_run_methods;
  t.tp_doc = "packed span records queued as one item of a RankWriter's pending list: see tracer/native_spans.py";
  return PyType_Ready(&t) == 0;
}

// The records queued in runs beyond one an item of `pending` (the writer's queue), as
// RankWriter's bound counts them: kept as runs are added to, counted again from the queue where
// it is another list or was flushed since (its `taken` moved). -1 with an exception.
Py_ssize_t run_extra(TracedCall* self, PyObject* writer, PyObject* pending) {
  PyObject* taken = writer_attr(self, writer, kTaken);
  long long now = taken == nullptr ? -1 : as_long_long(taken);
  Py_XDECREF(taken);
  if (PyErr_Occurred()) return -1;
  if (pending != self->run_pending || now != self->run_taken) {
    Py_ssize_t extra = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pending); ++i) {
      PyObject* item = PyList_GET_ITEM(pending, i);
      if (Py_IS_TYPE(item, &SpanRunType)) extra += std::max<Py_ssize_t>(as_run(item)->count - 1, 0);
    }
    Py_XSETREF(self->run_pending, Py_NewRef(pending));
    self->run_taken = now;
    self->run_extra = extra;
  }
  return self->run_extra;
}

// A span queued: `bytes` added to the run at the queue's end (a new run where the last item is
// another), or `item` (a tuple) appended; then the writer flushed at its bound. 0, or -1 with an
// exception.
int queue_span(TracedCall* self, PyObject* writer, const uint8_t* bytes, size_t n, PyObject* item) {
  PyObject* pending = writer_attr(self, writer, kPending);
  if (pending == nullptr) return -1;
  int r = 0;
  Py_ssize_t size = PyList_Check(pending) ? PyList_GET_SIZE(pending) : -1;
  PyObject* run = self->run;
  if (size < 0) {
    PyErr_SetString(PyExc_TypeError, "the writer's pending is no list");
    r = -1;
  } else if (item == nullptr && run != nullptr && size > 0 && PyList_GET_ITEM(pending, size - 1) == run &&
             as_run(run)->count < kRunMax) {
    r = run_add(as_run(run), bytes, n);
    if (r == 0 && pending == self->run_pending) ++self->run_extra;
  } else if (run_extra(self, writer, pending) < 0) {
    r = -1;
  } else if (item != nullptr) {
    r = PyList_Append(pending, item);
  } else {
    PyObject* fresh = span_run_new(&SpanRunType, nullptr, nullptr);
    r = fresh == nullptr || run_add(as_run(fresh), bytes, n) < 0 || PyList_Append(pending, fresh) < 0 ? -1 : 0;
    if (r == 0) Py_XSETREF(self->run, fresh);
    else Py_XDECREF(fresh);
  }
  if (r == 0) {
    long long most;
    if (writer == self->writer && self->most_seen == state_version) {
      most = self->writer_most;  // (its int object not read: a cache line a call)
    } else {
      PyObject* max_buffered = writer_attr(self, writer, kMaxBuffered);
      most = max_buffered == nullptr ? -1 : as_long_long(max_buffered);
      Py_XDECREF(max_buffered);
      // kept as writer_cached keeps it: found in the __dict__ of a writer whose class counts assignments
      if (!PyErr_Occurred() && writer == self->writer && self->writer_counts && self->writer_seen == state_version &&
          self->writer_cached[writer_slot(kMaxBuffered)] == max_buffered) {
        self->writer_most = most;
        self->most_seen = state_version;
      }
    }
    Py_ssize_t queued = PyList_GET_SIZE(pending) + (pending == self->run_pending ? self->run_extra : 0);
    if (PyErr_Occurred()) {
      r = -1;
    } else if (queued >= most) {
      PyObject* done = PyObject_CallMethodNoArgs(writer, names[kFlush]);
      if (done == nullptr) r = -1;
      Py_XDECREF(done);
    }
  }
  Py_DECREF(pending);
  return r;
}

// One int as msgpack-python's Packer writes it (the shortest form): where p points; the end.
inline uint8_t* pack_int(uint8_t* p, long long v) {
  auto be = [&p](unsigned long long u, int bytes) {
    for (int i = bytes - 1; i >= 0; --i) *p++ = static_cast<uint8_t>(u >> (8 * i));
  };
  if (v >= 0) {
    if (v < 0x80) { *p++ = static_cast<uint8_t>(v); }
    else if (v < 0x100) { *p++ = 0xcc; be(v, 1); }
    else if (v < 0x10000) { *p++ = 0xcd; be(v, 2); }
    else if (v < 0x100000000LL) { *p++ = 0xce; be(v, 4); }
    else { *p++ = 0xcf; be(v, 8); }
  } else {
    unsigned long long u = static_cast<unsigned long long>(v);
    if (v >= -32) { *p++ = static_cast<uint8_t>(v); }
    else if (v >= -128) { *p++ = 0xd0; be(u, 1); }
    else if (v >= -32768) { *p++ = 0xd1; be(u, 2); }
    else if (v >= -2147483648LL) { *p++ = 0xd2; be(u, 4); }
    else { *p++ = 0xd3; be(u, 8); }
  }
  return p;
}

// `n` ints packed after p: items[i] where it is given (nullptr: fixed[i]). nullptr where an item
// is no int of 64 bits (the caller then queues the tuple, as msgpack-python would pack it).
uint8_t* pack_ints(uint8_t* p, PyObject* const* items, const long long* fixed, int n) {
  for (int i = 0; i < n; ++i) {
    long long v = fixed[i];
    if (items[i] != nullptr) {
      int overflow = 0;
      v = PyLong_CheckExact(items[i]) ? PyLong_AsLongLongAndOverflow(items[i], &overflow) : 0;
      if (!PyLong_CheckExact(items[i]) || overflow != 0 || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return nullptr;
      }
    }
    p = pack_int(p, v);
  }
  return p;
}

// The SPAN record of spans.py, item for item, queued in the writer's pending list as the bytes
// msgpack makes of its tuple, added to the SpanRun at the queue's end; the writer flushed at
// its bound as spans.py does. 0, or -1 with an exception. A value that is no int of 64 bits
// takes the tuple.
int append_span(TracedCall* self, OpenCall& c, int64_t t1, PyObject* layout, long long layout_v,
                PyObject* fp_post, long long n_pre) {
  // (the tracer's ints as C ints where state_int holds them, packed from `fixed`: items has NULL)
  long long t0_raw, step_v = 0, flags_v = 0;
  bool step_c = state_int(self, kStep, &step_v), flags_c = state_int(self, kSpanFlags, &flags_v);
  PyObject* step = step_c ? nullptr : state_item(self, kStep);
  PyObject* flags = flags_c ? nullptr : state_item(self, kSpanFlags);
  PyObject* writer = state_item(self, kWriter);
  PyObject* raw = state_int(self, kStepT0Raw, &t0_raw) ? Py_None : state_item(self, kStepT0Raw);
  if ((!step_c && step == nullptr) || (!flags_c && flags == nullptr) || writer == nullptr || raw == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "tracer state");
    return -1;
  }
  if (raw != Py_None) {
    t0_raw = as_long_long(raw);
    if (t0_raw == -1 && PyErr_Occurred()) return -1;
  }
  PyObject* items[13] = {self->span_tag, step, nullptr, c.parent, nullptr, nullptr, nullptr,
                         nullptr, layout, c.fp ? c.fp_pre : nullptr, fp_post, nullptr, flags};
  long long fixed[13] = {0, step_v, c.index_v, 0, c.path_v, c.call_v, c.t0 - t0_raw, t1 - c.t0, layout_v, -1, -1,
                         n_pre, flags_v};
  uint8_t packed[1 + 13 * 9];
  packed[0] = 0x9d;  // an array of 13
  uint8_t* p = pack_ints(packed + 1, items, fixed, 13);
  if (p != nullptr) return queue_span(self, writer, packed, static_cast<size_t>(p - packed), nullptr);
  // The tuple: its items (and the writer) owned first, since its allocation may run a collection,
  // whose __del__ may assign the tracer's attributes that held them.
  PyObject* owned[13];
  for (int i = 0; i < 13; ++i) owned[i] = items[i] != nullptr ? Py_NewRef(items[i]) : PyLong_FromLongLong(fixed[i]);
  Py_INCREF(writer);
  PyObject* rec = PyTuple_New(13);
  int r = rec == nullptr ? -1 : 0;
  for (int i = 0; i < 13 && rec != nullptr; ++i) {
    if (owned[i] == nullptr) r = -1;
    PyTuple_SET_ITEM(rec, i, owned[i]);  // (NULL items: a tuple's dealloc skips them)
    owned[i] = nullptr;
  }
  for (PyObject* v : owned) Py_XDECREF(v);
  if (rec != nullptr && r == 0) {
    PyObject_GC_UnTrack(rec);  // (ints only: never in a cycle, nothing for the collector to visit)
    r = queue_span(self, writer, nullptr, 0, rec);
  }
  Py_XDECREF(rec);
  Py_DECREF(writer);
  return r;
}

// One plain tensor in and one out: spans.span_one_tensor, here while the layout is known to
// this rank file by tracer/native.py's pair_key; there otherwise. 0, or -1 with an exception.
int record_one(TracedCall* self, OpenCall& c, PyObject* a, PyObject* result) {
  int64_t t1 = now_ns();
  if (pop_frame(self, c) < 0) return -1;
  key_buf.clear();  // (pair_id's key: the module's slot keeps the layout it was found for)
  PyObject* layout = nullptr;  // (or, kept: its value in layout_v)
  long long layout_v = 0;
  bool kept = false;
  if (put_meta(a) && put_meta(result)) {
    PyObject* holder = state_item(self, kLayouts);
    PyObject* layouts = holder == nullptr ? nullptr : layouts_dict(self, holder, kOne);
    kept = layouts != nullptr && module_layout(self, c.slot, c.epoch, layouts, &layout_v);
    if (kept) {
      ++self->kept_layouts;
    } else if (layouts != nullptr) {
      PyObject* key = PyLong_FromLongLong(id_of(pair_ids));
      layout = key == nullptr ? nullptr : PyDict_GetItemWithError(layouts, key);
      Py_XDECREF(key);  // (layout borrowed: the tracer's dict keeps it)
      if (layout != nullptr) keep_layout(self, c.slot, c.epoch, layouts, layout);
    }
    if (PyErr_Occurred()) return -1;
  }
  if (kept || layout != nullptr) {  // (else: span_one_tensor keys it in Python, and interns its layout)
    Py_XINCREF(layout);  // (add_one is Python code)
    PyObject* fp_post = c.fp ? fingerprint_output(self, result) : nullptr;
    int r = c.fp && fp_post == nullptr ? -1 : append_span(self, c, t1, layout, layout_v, fp_post, 1);
    Py_XDECREF(fp_post);
    Py_XDECREF(layout);
    if (r == 0) ++self->recorded;
    return r;
  }
  PyObject* t0 = PyLong_FromLongLong(c.t0);
  PyObject* t1_ = PyLong_FromLongLong(t1);
  PyObject* r = nullptr;
  if (t0 != nullptr && t1_ != nullptr) {
    PyObject* argv[11] = {self->tracer, c.index, c.parent, c.path_id, c.call, t0, t1_, a, result,
                          c.fp_pre, c.fp ? Py_True : Py_False};
    r = PyObject_Vectorcall(self->span_one, argv, 11, nullptr);
  }
  Py_XDECREF(t0); Py_XDECREF(t1_);
  if (r == nullptr) return -1;
  Py_DECREF(r);
  return 0;
}

// A call of tensors and plain values whose layout this rank file knows by call_key
// (spans.record_tensors' first branch): 1 recorded, 0 not such a call, -1 an exception.
// On a fingerprinted step, the outputs record_tensors fingerprints after such a call (keyword
// arguments' tensors, then the result's, one level down): the first's index as fingerprint_many
// takes them, or -1 for none. New reference, or NULL with an exception.
PyObject* fingerprint_post(TracedCall* self, PyObject* kwargs, PyObject* result) {
  PyTypeObject* tensor = reinterpret_cast<PyTypeObject*>(self->tensor_type);
  PyObject* post = PyList_New(0);
  if (post == nullptr) return nullptr;
  bool ok = true;
  if (kwargs != Py_None && PyDict_Check(kwargs)) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (ok && PyDict_Next(kwargs, &pos, &k, &v))
      if (PyObject_TypeCheck(v, tensor)) ok = PyList_Append(post, v) == 0;
  }
  if (ok && PyObject_TypeCheck(result, tensor)) {
    ok = PyList_Append(post, result) == 0;
  } else if (ok && (PyTuple_CheckExact(result) || PyList_CheckExact(result))) {
    PyObject* seq = PySequence_Fast(result, "result");  // (a new reference: a list may change)
    ok = seq != nullptr;
    for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(seq); ++i) {
      PyObject* r = PySequence_Fast_GET_ITEM(seq, i);
      if (PyObject_TypeCheck(r, tensor)) {
        ok = PyList_Append(post, r) == 0;
      } else if (PyTuple_CheckExact(r) || PyList_CheckExact(r)) {
        PyObject* inner = PySequence_Fast(r, "result item");
        ok = inner != nullptr;
        for (Py_ssize_t j = 0; ok && j < PySequence_Fast_GET_SIZE(inner); ++j)
          if (PyObject_TypeCheck(PySequence_Fast_GET_ITEM(inner, j), tensor))
            ok = PyList_Append(post, PySequence_Fast_GET_ITEM(inner, j)) == 0;
        Py_XDECREF(inner);
      }
    }
    Py_XDECREF(seq);
  }
  PyObject* index = !ok ? nullptr : PyList_GET_SIZE(post) == 0 ? PyLong_FromLong(-1)
      : fingerprint_many(self, PySequence_Fast_ITEMS(post), PyList_GET_SIZE(post), true);
  Py_DECREF(post);
  return index;
}

int record_known(TracedCall* self, OpenCall& c, PyObject* kwargs, PyObject* result) {
  int64_t id = call_id(c.args, kwargs, result, self->context);
  if (id == -2) return -1;
  if (id < 0) return 0;
  PyObject* holder = state_item(self, kLayouts);
  PyObject* layouts = holder == nullptr ? nullptr : layouts_dict(self, holder, kByCallKey);
  if (layouts == nullptr) return PyErr_Occurred() ? -1 : 0;
  PyObject* key = PyLong_FromLongLong(id);
  PyObject* known = key == nullptr ? nullptr : PyDict_GetItemWithError(layouts, key);
  Py_XDECREF(key);
  if (known == nullptr) return PyErr_Occurred() ? -1 : 0;
  if (!PyTuple_CheckExact(known) || PyTuple_GET_SIZE(known) != 2) return 0;
  PyObject* n_pre = PyTuple_GET_ITEM(known, 1);  // (the inputs' count: a small int)
  int overflow = 0;
  long long n = PyLong_CheckExact(n_pre) ? PyLong_AsLongLongAndOverflow(n_pre, &overflow) : -1;
  if (n < 0 || overflow != 0) return 0;  // (never: spans.record_tensors then records it)
  Py_INCREF(known);  // (the dict may be cleared by a flush below)
  ++self->recorded;
  int64_t t1 = now_ns();
  int r = pop_frame(self, c);
  PyObject* fp_post = r == 0 && c.fp ? fingerprint_post(self, kwargs, result) : nullptr;  // (after t1, as record_tensors)
  if (c.fp && fp_post == nullptr) r = -1;
  if (r == 0) r = append_span(self, c, t1, PyTuple_GET_ITEM(known, 0), 0, fp_post, n);
  Py_XDECREF(fp_post);
  Py_DECREF(known);
  return r < 0 ? -1 : 1;
}
"""
