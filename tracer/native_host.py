"""C++ for what the tracer reads from a CPU tensor's memory: ``host_pair(t)`` (its fingerprint,
sum and sum of squares) and ``nonzero_rows(t)`` (the dim-0 rows a collective's input holds
nonzero values in), which tracer/host_values.py calls first once the extension is built.

Why in C: on a fingerprinted CPU step every module output and every collective's input and
output is read here. Through numpy a small tensor's pair cost about 1.6 us and its nonzero rows
3.5 us in a loop, and 8 and 20 us inside the traced model (the example at tp=2, where the
model's own ops between two reads evict numpy's code and data from the CPU's caches): most of
a fingerprinted step's extra cost at tp=2 (bench/RESULTS.md). Here each is one C call on the
tensor's memory.

Both read a plain ``torch.Tensor`` (exact type) on the CPU, strided, with storage, that does not
require grad and is not a conjugate or negative view; ``nonzero_rows`` a contiguous one only.
Anything else returns None and tracer/host_values.py takes its numpy path, then the caller its
torch one, as before.

- ``host_pair``: float32, float64, int64 and int32 (tracer/fingerprint_reduce.py's
  ``HOST_DTYPES``). float32 values are added in float32 lanes within blocks of 1024 elements and
  the blocks' sums in float64 (numpy's BLAS dot added a small tensor's all in float32), and
  again in float64 where the lanes overflowed (values near float32's limit: the writer keeps
  such sums as WIDE_FINGERPRINTS); float64 and integers are added in float64. Large tensors are read with the GIL released. A view (q, k
  and v split from a fused projection, a slice, a transpose) is read where it lies, run by run
  of its innermost dim, the runs' pairs added in float64: numpy copied it first (18 views a
  fingerprinted step of the example at tp=2, each about 8 us inside the model).
- ``nonzero_rows``: any real dtype whose zero is all zero bits (integers, bool) or all zero bits
  but the sign (float16, bfloat16, float32, float64): a value is nonzero when those bits are not
  all zero, so NaN counts as nonzero and -0.0 does not, as torch's ``ne(0)``. A row's scan stops
  at its first nonzero value.
- ``add_one_host(fps, t, store)``: ``StepFingerprints.add_one(t, store)`` (tracer/fingerprint.py)
  for its common case on a CPU step, the tensor's immediate fingerprint: the same reads and
  writes of the object's attributes (its last tensor, the cache of values by id, the host
  values), the pair read by ``host_pair``. The C call wrapper (tracer/native_call.py) asks it
  first for a call's input and output on a fingerprinted step. It returns None, having changed
  nothing, for everything else (a deferred or CUDA tensor, the C++ table, a capture, a tensor
  that requires grad, a value cached by id, a dtype ``host_pair`` does not read, values whose
  sums are not finite: NONFINITE_FINGERPRINTS), which
  ``add_one`` then takes, whole. On the example at tp=2 ``add_one`` cost about 2.5 us a tensor
  inside the model, 130 tensors on a fingerprinted step.
- ``add_host(fps, t, store)``: the same for ``StepFingerprints.add`` (its immediate case, one
  tensor; no test or update of the tensor added last), which ``add`` asks first for each tensor
  (a collective's inputs and outputs, a call of several tensors through the Python path). A
  collective's two ``add`` calls cost about 7 us each inside the example's step.
"""

SOURCE = r"""
// ---------------------------------------------------------------- host_pair, nonzero_rows: see tracer/native_host.py
constexpr int64_t kReleaseGilFrom = 1 << 20;  // elements: a read long enough to let other threads run
constexpr int64_t kPairBlock = 1024;          // float32 elements added in float32 lanes before float64

// The tensor `o` when its memory can be read here (see tracer/native_host.py), else nullptr.
// `views`: a non-contiguous view too (host_pair reads it by strides), not only contiguous memory.
const at::Tensor* readable_host_tensor(PyObject* o, bool views = false) {
  if (Py_TYPE(o) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(o);
  if (!t.defined() || !t.is_cpu() || t.layout() != at::kStrided || !t.has_storage()) return nullptr;
  if (t.requires_grad() || t.is_conj() || t.is_neg() || (!views && !t.is_contiguous())) return nullptr;
  if (t.unsafeGetTensorImpl()->is_python_dispatch()) return nullptr;
  if (t.numel() > 0 && t.const_data_ptr() == nullptr) return nullptr;
  return &t;
}

// 16-byte lanes: what SSE2 and NEON hold natively (a wider generic vector is split or scalarised
// without -mavx); two of each accumulator, so that consecutive adds do not wait on one another.
typedef float f32x4 __attribute__((vector_size(16)));

void pair_f32(const float* p, int64_t n, double& sum, double& sq) {
  int64_t i = 0;
  while (i + 8 <= n) {
    f32x4 s0 = {0, 0, 0, 0}, s1 = s0, q0 = s0, q1 = s0;
    int64_t end = std::min(n - n % 8, i + kPairBlock);
    for (; i < end; i += 8) {
      f32x4 a, b;
      std::memcpy(&a, p + i, sizeof a);
      std::memcpy(&b, p + i + 4, sizeof b);
      s0 += a;
      s1 += b;
      q0 += a * a;
      q1 += b * b;
    }
    for (int k = 0; k < 4; ++k) {
      sum += static_cast<double>(s0[k]) + static_cast<double>(s1[k]);
      sq += static_cast<double>(q0[k]) + static_cast<double>(q1[k]);
    }
  }
  for (; i < n; ++i) { double v = p[i]; sum += v; sq += v * v; }
}

template <typename T>
void pair_f64(const T* p, int64_t n, double& sum, double& sq) {
  double s[4] = {0, 0, 0, 0}, q[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) { double v = static_cast<double>(p[i + k]); s[k] += v; q[k] += v * v; }
  for (; i < n; ++i) { double v = static_cast<double>(p[i]); s[0] += v; q[0] += v * v; }
  sum = (s[0] + s[1]) + (s[2] + s[3]);
  sq = (q[0] + q[1]) + (q[2] + q[3]);
}

// The dtypes host_pair reads (tracer/fingerprint_reduce.py's HOST_DTYPES).
inline bool pair_dtype(at::ScalarType st) {
  return st == at::kFloat || st == at::kDouble || st == at::kLong || st == at::kInt;
}

// The pair of one contiguous run of n values of dtype st, added to sum and sq.
void pair_run(at::ScalarType st, const void* p, int64_t n, double& sum, double& sq) {
  double s = 0, q = 0;
  switch (st) {
    case at::kFloat:
      pair_f32(static_cast<const float*>(p), n, s, q);
      // float32 lanes overflow on values near float32's limit (an attention mask of
      // finfo.min) that float64 adds: such a run is read again in float64.
      if (!std::isfinite(s) || !std::isfinite(q)) pair_f64(static_cast<const float*>(p), n, s, q);
      break;
    case at::kDouble: pair_f64(static_cast<const double*>(p), n, s, q); break;
    case at::kLong: pair_f64(static_cast<const int64_t*>(p), n, s, q); break;
    default: pair_f64(static_cast<const int32_t*>(p), n, s, q); break;
  }
  sum += s;
  sq += q;
}

template <typename T>
void pair_scalar(const T* p, int64_t n, int64_t stride, double& sum, double& sq) {
  for (int64_t i = 0; i < n; ++i) { double v = static_cast<double>(p[i * stride]); sum += v; sq += v * v; }
}

// A view's pair (a fused projection's q, k and v; a slice; a transpose): its dims of size 1
// dropped and neighbours that step as one dim merged, each innermost run read as above when its
// stride is 1 (the runs' pairs added in float64), element by element in float64 otherwise.
void pair_view(const at::Tensor& t, double& sum, double& sq) {
  int64_t size[64], stride[64];
  int nd = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    int64_t n = t.size(d), s = t.stride(d);
    if (n == 1) continue;
    if (nd > 0 && stride[nd - 1] == s * n) {  // steps as one dim with the one before
      size[nd - 1] *= n;
      stride[nd - 1] = s;
      continue;
    }
    size[nd] = n;
    stride[nd++] = s;
  }
  at::ScalarType st = t.scalar_type();
  size_t item = t.element_size();
  const char* base = static_cast<const char*>(t.const_data_ptr());
  if (nd == 0) { pair_run(st, base, 1, sum, sq); return; }
  int64_t inner = size[nd - 1], inner_stride = stride[nd - 1];
  int64_t index[64] = {0};
  for (;;) {
    int64_t offset = 0;
    for (int d = 0; d < nd - 1; ++d) offset += index[d] * stride[d];
    const char* p = base + offset * static_cast<int64_t>(item);
    if (inner_stride == 1) {
      pair_run(st, p, inner, sum, sq);
    } else {
      switch (st) {
        case at::kFloat: pair_scalar(reinterpret_cast<const float*>(p), inner, inner_stride, sum, sq); break;
        case at::kDouble: pair_scalar(reinterpret_cast<const double*>(p), inner, inner_stride, sum, sq); break;
        case at::kLong: pair_scalar(reinterpret_cast<const int64_t*>(p), inner, inner_stride, sum, sq); break;
        default: pair_scalar(reinterpret_cast<const int32_t*>(p), inner, inner_stride, sum, sq); break;
      }
    }
    int d = nd - 2;
    for (; d >= 0; --d) {
      if (++index[d] < size[d]) break;
      index[d] = 0;
    }
    if (d < 0) return;
  }
}

// host_pair(t) -> (sum, sum of squares) as floats, or None
PyObject* host_pair(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1) { PyErr_SetString(PyExc_TypeError, "host_pair(t)"); return nullptr; }
  const at::Tensor* t = readable_host_tensor(args[0], /*views=*/true);
  if (t == nullptr || t->dim() > 64 || !pair_dtype(t->scalar_type())) Py_RETURN_NONE;
  at::ScalarType st = t->scalar_type();
  int64_t n = t->numel();
  double sum = 0, sq = 0;
  PyThreadState* released = n >= kReleaseGilFrom ? PyEval_SaveThread() : nullptr;
  if (n == 0) {
  } else if (t->is_contiguous()) {
    pair_run(st, t->const_data_ptr(), n, sum, sq);
  } else {
    pair_view(*t, sum, sq);
  }
  if (released != nullptr) PyEval_RestoreThread(released);
  return Py_BuildValue("(dd)", sum, sq);
}

// first, last and count of the `rows` rows of `row_bytes` bytes that hold a value whose bits,
// less `mask`, are not all zero; the row is read in words of U (whose size divides row_bytes), in
// which `mask` is each value's mask repeated. A row's scan stops at the first such word.
template <typename U>
void scan_rows(const unsigned char* p, int64_t rows, int64_t row_bytes, U mask, int64_t& first, int64_t& last,
               int64_t& count) {
  const int64_t width = row_bytes / static_cast<int64_t>(sizeof(U));
  for (int64_t r = 0; r < rows; ++r, p += row_bytes) {
    int64_t i = 0;
    for (; i < width; ++i) {
      U bits;
      std::memcpy(&bits, p + i * sizeof(U), sizeof bits);  // (the bits of whatever dtype it holds)
      if (bits & mask) break;
    }
    if (i < width) {
      if (first < 0) first = r;
      last = r;
      ++count;
    }
  }
}

// nonzero_rows(t) -> [first, last, count] of the dim-0 rows holding a nonzero value ([0, 0, 0]
// when none), or None
PyObject* nonzero_rows(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1) { PyErr_SetString(PyExc_TypeError, "nonzero_rows(t)"); return nullptr; }
  const at::Tensor* t = readable_host_tensor(args[0]);
  if (t == nullptr || t->dim() == 0 || t->numel() == 0) Py_RETURN_NONE;
  at::ScalarType st = t->scalar_type();
  bool is_float = st == at::kHalf || st == at::kBFloat16 || st == at::kFloat || st == at::kDouble;
  if (!is_float && !c10::isIntegralType(st, /*includeBool=*/true)) Py_RETURN_NONE;
  int64_t rows = t->size(0), width = t->numel() / rows;
  size_t size = t->element_size();
  const unsigned char* p = static_cast<const unsigned char*>(t->const_data_ptr());
  int64_t first = -1, last = -1, count = 0;
  PyThreadState* released = t->numel() >= kReleaseGilFrom ? PyEval_SaveThread() : nullptr;
  // a value's mask: all its bits, less a float's sign bit
  uint64_t mask = size == 8 ? ~0ull : (1ull << (8 * size)) - 1;
  if (is_float) mask >>= 1;
  int64_t row_bytes = width * static_cast<int64_t>(size);
  if (row_bytes % 8 == 0 && reinterpret_cast<uintptr_t>(p) % 8 == 0) {  // 8 bytes at a time
    uint64_t word_mask = 0;
    for (size_t k = 0; k < 8; k += size) word_mask |= mask << (8 * k);
    scan_rows<uint64_t>(p, rows, row_bytes, word_mask, first, last, count);
  } else {
    switch (size) {
      case 1: scan_rows<uint8_t>(p, rows, row_bytes, static_cast<uint8_t>(mask), first, last, count); break;
      case 2: scan_rows<uint16_t>(p, rows, row_bytes, static_cast<uint16_t>(mask), first, last, count); break;
      default: scan_rows<uint32_t>(p, rows, row_bytes, static_cast<uint32_t>(mask), first, last, count); break;
    }
  }
  if (released != nullptr) PyEval_RestoreThread(released);
  if (count == 0) first = last = 0;
  return Py_BuildValue("[LLL]", static_cast<long long>(first), static_cast<long long>(last),
                       static_cast<long long>(count));
}

// ---- add_one_host: StepFingerprints.add_one's immediate CPU case (see tracer/native_host.py)
enum FpName {
  fLast, fLastIdx, fLastVersion, fNt, fCapturing, fDeferCpu, fSeen, fCount, fHostPos, fHostIdx, fHostVals,
  fDups, fNames
};
const char* const fNameText[fNames] = {"last", "last_idx", "last_version", "_nt", "capturing", "defer_cpu",
                                       "_seen", "count", "_host_pos", "_host_idx", "_host_vals", "_dups"};
PyObject* fnames[fNames];

PyObject* kDefTs = nullptr;    // "_def_ts"   (StepFingerprints' deferred tensors held, and
PyObject* kLastOut = nullptr;  // "_last_out"  its outputs held last: what the collectives' read)

bool ready_host_values() {
  for (int i = 0; i < fNames; ++i) {
    fnames[i] = PyUnicode_InternFromString(fNameText[i]);
    if (fnames[i] == nullptr) return false;
  }
  kDefTs = PyUnicode_InternFromString("_def_ts");
  kLastOut = PyUnicode_InternFromString("_last_out");
  return kDefTs != nullptr && kLastOut != nullptr;
}

// The tensor's version counter as add_one reads it: None for an inference tensor (a new reference).
PyObject* tensor_version(const at::Tensor& t) {
  if (t.is_inference()) return Py_NewRef(Py_None);
  return PyLong_FromUnsignedLongLong(t._version());
}

// A repeat of value `src` (hit[2]) as the next index, as add_one's and _add's cache hit: an inference
// tensor's entry dropped (reused once), then StepFingerprints._repeat(idx, src). The index, or NULL
// with an exception.
PyObject* repeat_value(PyObject* d, PyObject** v, PyObject* key, PyObject* hit) {
  PyObject* src = PyTuple_GET_ITEM(hit, 2);
  Py_INCREF(src);  // (hit may go with its entry below)
  long long idx = PyLong_AsLongLong(v[fCount]);
  PyObject* index = idx == -1 && PyErr_Occurred() ? nullptr : PyLong_FromLongLong(idx);
  PyObject* next = index == nullptr ? nullptr : PyLong_FromLongLong(idx + 1);
  bool ok = next != nullptr && PyDict_SetItem(d, fnames[fCount], next) == 0;
  Py_XDECREF(next);
  if (ok && PyTuple_GET_ITEM(hit, 1) == Py_None) ok = PyDict_DelItem(v[fSeen], key) == 0;
  if (ok) {
    PyObject* p = PyDict_GetItemWithError(v[fHostPos], src);
    if (p == nullptr) {  // a value not computed on the host: resolved when the values are collected
      PyObject* pair = PyErr_Occurred() ? nullptr : PyTuple_Pack(2, index, src);
      ok = pair != nullptr && PyList_Append(v[fDups], pair) == 0;
      Py_XDECREF(pair);
    } else {  // copied at once
      Py_ssize_t at = PyLong_AsSsize_t(p);
      PyObject* vals = v[fHostVals];
      PyObject* pos = PyLong_FromSsize_t(PyList_GET_SIZE(v[fHostIdx]));
      ok = at >= 0 && 2 * at + 1 < PyList_GET_SIZE(vals) && pos != nullptr &&
           PyDict_SetItem(v[fHostPos], index, pos) == 0 && PyList_Append(v[fHostIdx], index) == 0;
      Py_XDECREF(pos);
      if (ok) {
        PyObject* s = Py_NewRef(PyList_GET_ITEM(vals, 2 * at));
        PyObject* q = Py_NewRef(PyList_GET_ITEM(vals, 2 * at + 1));
        ok = PyList_Append(vals, s) == 0 && PyList_Append(vals, q) == 0;
        Py_DECREF(s); Py_DECREF(q);
      }
      if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "add_one_host: host values");
    }
  }
  Py_DECREF(src);
  if (!ok) Py_CLEAR(index);
  return index;
}

// Whether cache hit `hit` repeats a value computed on the host whose sums are not finite.
bool repeats_nonfinite(PyObject** v, PyObject* hit) {
  PyObject* p = PyDict_GetItemWithError(v[fHostPos], PyTuple_GET_ITEM(hit, 2));
  if (p == nullptr) { PyErr_Clear(); return false; }
  Py_ssize_t at = PyLong_AsSsize_t(p);
  PyObject* vals = v[fHostVals];
  if (at < 0 || 2 * at + 1 >= PyList_GET_SIZE(vals)) { PyErr_Clear(); return false; }
  PyObject* s = PyList_GET_ITEM(vals, 2 * at);
  PyObject* q = PyList_GET_ITEM(vals, 2 * at + 1);
  return PyFloat_Check(s) && PyFloat_Check(q) &&
         (!std::isfinite(PyFloat_AS_DOUBLE(s)) || !std::isfinite(PyFloat_AS_DOUBLE(q)));
}

// add_one(t, store) for a plain CPU tensor fingerprinted at once: the index (a new reference);
// NULL without an exception where add_one's Python must take the call (nothing changed), with
// one on an error. `as_add`: add((t,), store)'s instead (_add's immediate case: no test of the
// tensor added last, which it does not set either).
PyObject* add_one_host(PyObject* fps, PyObject* o, bool store, bool as_add = false) {
  const at::Tensor* t = readable_host_tensor(o, /*views=*/true);
  if (t == nullptr) return nullptr;
  PyObject* d = PyObject_GenericGetDict(fps, nullptr);
  if (d == nullptr) return nullptr;
  PyObject* result = nullptr;
  PyObject* v[fNames];
  bool ok = true;
  for (int i = 0; i < fNames && ok; ++i) {
    v[i] = PyDict_GetItemWithError(d, fnames[i]);  // (borrowed: d holds them)
    ok = v[i] != nullptr;
  }
  if (!ok || v[fNt] != Py_None || v[fCapturing] != Py_False || v[fDeferCpu] != Py_False ||
      !PyDict_CheckExact(v[fSeen]) || !PyLong_CheckExact(v[fCount]) || !PyDict_CheckExact(v[fHostPos]) ||
      !PyList_CheckExact(v[fHostIdx]) || !PyList_CheckExact(v[fHostVals]) || !PyList_CheckExact(v[fDups])) {
    Py_DECREF(d);
    return nullptr;  // (an exception from a look-up stays: the caller reports it)
  }
  PyObject* version = tensor_version(*t);
  PyObject* key = PyLong_FromVoidPtr(o);
  if (version == nullptr || key == nullptr) goto done;
  if (!as_add && o == v[fLast]) {  // the tensor added last, as add_one's first test
    PyObject* last_version = v[fLastVersion];
    if (last_version == Py_True) { result = Py_NewRef(v[fLastIdx]); goto done; }
    if (last_version == Py_None) {  // an inference tensor: its value reused once
      result = Py_NewRef(v[fLastIdx]);
      if (PyDict_SetItem(d, fnames[fLast], Py_None) < 0 || PyDict_DelItem(v[fSeen], key) < 0) {
        if (PyErr_ExceptionMatches(PyExc_KeyError)) PyErr_Clear();
        else Py_CLEAR(result);
      }
      goto done;
    }
    int same = PyObject_RichCompareBool(last_version, version, Py_EQ);
    if (same < 0) goto done;
    if (same) { result = Py_NewRef(v[fLastIdx]); goto done; }
  }
  {
    PyObject* hit = PyDict_GetItemWithError(v[fSeen], key);
    if (hit != nullptr) {  // a value cached by id: a repeat while the tensor is unchanged
      if (!PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) != 3 || !PyWeakref_CheckRef(PyTuple_GET_ITEM(hit, 0)))
        goto done;  // (not add_one's entry: its Python takes it)
      if (PyWeakref_GET_OBJECT(PyTuple_GET_ITEM(hit, 0)) == o) {
        PyObject* held_version = PyTuple_GET_ITEM(hit, 1);
        int same = held_version == Py_None ? 1 : PyObject_RichCompareBool(held_version, version, Py_EQ);
        if (same < 0) goto done;
        if (same) {
          if (repeats_nonfinite(v, hit)) goto done;  // (its NONFINITE_FINGERPRINTS entry: add_one's Python)
          result = repeat_value(d, v, key, hit);
          goto done;
        }
      }
    } else if (PyErr_Occurred()) {
      goto done;
    }
    if (!pair_dtype(t->scalar_type())) goto done;
    PyObject* argv[1] = {o};
    PyObject* pair = host_pair(nullptr, argv, 1);
    if (pair == nullptr || pair == Py_None) { Py_XDECREF(pair); goto done; }
    if (!std::isfinite(PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(pair, 0))) ||
        !std::isfinite(PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(pair, 1)))) {
      Py_DECREF(pair);  // (an attention mask of -inf: add_one's Python reads its finite values too)
      goto done;
    }
    // From here on the call is this one's: add_one's writes, in its order.
    long long idx = PyLong_AsLongLong(v[fCount]);
    PyObject* index = idx == -1 && PyErr_Occurred() ? nullptr : PyLong_FromLongLong(idx);
    PyObject* next = index == nullptr ? nullptr : PyLong_FromLongLong(idx + 1);
    PyObject* pos = PyLong_FromSsize_t(PyList_GET_SIZE(v[fHostIdx]));
    bool wrote = next != nullptr && pos != nullptr && PyDict_SetItem(d, fnames[fCount], next) == 0 &&
                 PyDict_SetItem(v[fHostPos], index, pos) == 0 && PyList_Append(v[fHostIdx], index) == 0 &&
                 PyList_Append(v[fHostVals], PyTuple_GET_ITEM(pair, 0)) == 0 &&
                 PyList_Append(v[fHostVals], PyTuple_GET_ITEM(pair, 1)) == 0;
    Py_XDECREF(next); Py_XDECREF(pos); Py_DECREF(pair);
    if (wrote && (store || version != Py_None)) {
      PyObject* ref = PyWeakref_NewRef(o, nullptr);
      PyObject* entry = ref == nullptr ? nullptr : PyTuple_Pack(3, ref, version, index);
      if (entry != nullptr) wrote = PyDict_SetItem(v[fSeen], key, entry) == 0;
      else if (PyErr_ExceptionMatches(PyExc_TypeError)) PyErr_Clear();  // (as add_one's except)
      else wrote = false;
      Py_XDECREF(ref); Py_XDECREF(entry);
    }
    if (wrote && store && !as_add)
      wrote = PyDict_SetItem(d, fnames[fLast], o) == 0 && PyDict_SetItem(d, fnames[fLastIdx], index) == 0 &&
              PyDict_SetItem(d, fnames[fLastVersion], version) == 0;
    if (wrote) result = index;
    else Py_XDECREF(index);
    if (!wrote && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "add_one_host");
  }
done:
  Py_XDECREF(version); Py_XDECREF(key);
  Py_DECREF(d);
  return result;
}

// ---- a collective's fingerprints (CollectiveInterceptor.fp_inputs / fp_outputs' common case)
// fps' state lets a collective's tensors be fingerprinted here: immediate values only (no C++
// table, no capture, nothing deferred on the CPU) and nothing held that materialize would reduce.
bool coll_host_ready(PyObject* d) {
  PyObject* nt = PyDict_GetItemWithError(d, fnames[fNt]);
  PyObject* capturing = PyDict_GetItemWithError(d, fnames[fCapturing]);
  PyObject* defer = PyDict_GetItemWithError(d, fnames[fDeferCpu]);
  PyObject* held = PyDict_GetItemWithError(d, kDefTs);
  if (PyErr_Occurred()) { PyErr_Clear(); return false; }
  return nt == Py_None && capturing == Py_False && defer == Py_False && held != nullptr && PyList_CheckExact(held) &&
         PyList_GET_SIZE(held) == 0;
}

// A tensor host_pair reads.
bool pair_readable(PyObject* o) {
  const at::Tensor* t = readable_host_tensor(o, /*views=*/true);
  return t != nullptr && t->dim() <= 64 && pair_dtype(t->scalar_type());
}

// fp_inputs([t], rows_wanted) for one plain CPU tensor: ``materialize`` (nothing to do: checked),
// ``add([t], store=False, immediate=True)`` and, wanted, ``[nonzero_rows(t)]``, as tracer/collectives.py
// takes them, without its Python frames or the busy flag it sets (no torch op runs here). 1 with
// *index and *rows (new references: rows None when not wanted); 0 where fp_inputs must take it,
// nothing changed; -1 an exception.
int coll_fp_input_host(PyObject* fps, PyObject* t, bool rows_wanted, PyObject** index, PyObject** rows) {
  PyObject* d = PyObject_GenericGetDict(fps, nullptr);
  if (d == nullptr) { PyErr_Clear(); return 0; }
  bool ready = coll_host_ready(d);
  Py_DECREF(d);
  if (!ready) return 0;
  PyObject* r = Py_NewRef(Py_None);
  if (rows_wanted) {
    PyObject* argv[1] = {t};
    PyObject* one = nonzero_rows(nullptr, argv, 1);
    if (one == nullptr) { Py_DECREF(r); return -1; }
    if (one == Py_None) { Py_DECREF(one); Py_DECREF(r); return 0; }
    Py_DECREF(r);
    r = PyList_New(1);
    if (r == nullptr) { Py_DECREF(one); return -1; }
    PyList_SET_ITEM(r, 0, one);
  }
  PyObject* i = add_one_host(fps, t, false, /*as_add=*/true);
  if (i == nullptr) {
    Py_DECREF(r);
    return PyErr_Occurred() ? -1 : 0;
  }
  *index = i;
  *rows = r;
  return 1;
}

// fp_outputs(outs) for plain CPU tensors: ``forget`` (each one's cached value dropped, the tensor
// added last forgotten if it is one, _last_out emptied) then ``add(outs)``: the first index (a new
// reference); NULL without an exception where fp_outputs must take them, nothing changed; NULL
// with one on an error.
PyObject* coll_fp_outputs_host(PyObject* fps, PyObject* const* outs, Py_ssize_t n) {
  if (n < 1) return nullptr;
  for (Py_ssize_t j = 0; j < n; ++j)
    if (!pair_readable(outs[j])) return nullptr;
  PyObject* d = PyObject_GenericGetDict(fps, nullptr);
  if (d == nullptr) { PyErr_Clear(); return nullptr; }
  PyObject* first = nullptr;
  PyObject* seen = PyDict_GetItemWithError(d, fnames[fSeen]);
  PyObject* last = PyDict_GetItemWithError(d, fnames[fLast]);
  if (!coll_host_ready(d) || seen == nullptr || !PyDict_CheckExact(seen) || last == nullptr) {
    PyErr_Clear();
    Py_DECREF(d);
    return nullptr;
  }
  PyObject* empty = PyList_New(0);
  bool ok = empty != nullptr && PyDict_SetItem(d, kLastOut, empty) == 0;
  Py_XDECREF(empty);
  for (Py_ssize_t j = 0; ok && j < n; ++j) {
    PyObject* key = PyLong_FromVoidPtr(outs[j]);
    ok = key != nullptr && (PyDict_DelItem(seen, key) == 0 || PyErr_ExceptionMatches(PyExc_KeyError));
    PyErr_Clear();
    Py_XDECREF(key);
    if (ok && outs[j] == last) {
      ok = PyDict_SetItem(d, fnames[fLast], Py_None) == 0;
      last = Py_None;
    }
  }
  for (Py_ssize_t j = 0; ok && j < n; ++j) {
    PyObject* i = add_one_host(fps, outs[j], true, /*as_add=*/true);
    if (i == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "a collective's output not fingerprinted");
      ok = false;
    } else if (first == nullptr) {
      first = i;
    } else {
      Py_DECREF(i);
    }
  }
  if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "fp_outputs");
  if (!ok) Py_CLEAR(first);
  Py_DECREF(d);
  return first;
}

// coll_fp_inputs_host(fps, t, rows_wanted) -> (index, rows) or None;
// coll_fp_outputs_host(fps, outs) -> index or None: for tests (tracer/native_coll.py calls them in C)
PyObject* coll_fp_inputs_host_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "coll_fp_inputs_host(fps, t, rows_wanted)"); return nullptr; }
  PyObject *index = nullptr, *rows = nullptr;
  int r = coll_fp_input_host(args[0], args[1], PyObject_IsTrue(args[2]) == 1, &index, &rows);
  if (r < 0) return nullptr;
  if (r == 0) Py_RETURN_NONE;
  PyObject* pair = PyTuple_Pack(2, index, rows);
  Py_DECREF(index); Py_DECREF(rows);
  return pair;
}

PyObject* coll_fp_outputs_host_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, "coll_fp_outputs_host(fps, outs: list)");
    return nullptr;
  }
  PyObject* r = coll_fp_outputs_host(args[0], PySequence_Fast_ITEMS(args[1]), PyList_GET_SIZE(args[1]));
  if (r == nullptr && !PyErr_Occurred()) Py_RETURN_NONE;
  return r;
}

PyMethodDef coll_fp_inputs_host_def = {
    "coll_fp_inputs_host", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(coll_fp_inputs_host_py)),
    METH_FASTCALL, "coll_fp_inputs_host(fps, t, rows_wanted) -> (index, rows) or None: see tracer/native_host.py"};
PyMethodDef coll_fp_outputs_host_def = {
    "coll_fp_outputs_host", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(coll_fp_outputs_host_py)),
    METH_FASTCALL, "coll_fp_outputs_host(fps, outs) -> index or None: see tracer/native_host.py"};

// add_one_host(fps, t, store) -> index or None: for tests (tracer/native_call.py calls it in C)
PyObject* add_one_host_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "add_one_host(fps, t, store)"); return nullptr; }
  int store = PyObject_IsTrue(args[2]);
  if (store < 0) return nullptr;
  PyObject* r = add_one_host(args[0], args[1], store == 1);
  if (r == nullptr && !PyErr_Occurred()) Py_RETURN_NONE;
  return r;
}

// add_host(fps, t, store) -> index or None: StepFingerprints.add's, one tensor at a time
PyObject* add_host_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "add_host(fps, t, store)"); return nullptr; }
  int store = PyObject_IsTrue(args[2]);
  if (store < 0) return nullptr;
  PyObject* r = add_one_host(args[0], args[1], store == 1, true);
  if (r == nullptr && !PyErr_Occurred()) Py_RETURN_NONE;
  return r;
}

PyMethodDef add_host_def = {"add_host", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(add_host_py)),
                            METH_FASTCALL, "add_host(fps, t, store) -> index or None: see tracer/native_host.py"};

PyMethodDef add_one_host_def = {"add_one_host", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(add_one_host_py)),
                                METH_FASTCALL, "add_one_host(fps, t, store) -> index or None: see tracer/native_host.py"};
PyMethodDef host_pair_def = {"host_pair", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(host_pair)),
                             METH_FASTCALL, "host_pair(t) -> (sum, sum of squares) or None: see tracer/native_host.py"};
PyMethodDef nonzero_rows_def = {"nonzero_rows", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(nonzero_rows)),
                                METH_FASTCALL, "nonzero_rows(t) -> [first, last, count] or None: see tracer/native_host.py"};
"""
