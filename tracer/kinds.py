"""Tensors that are not plain dense ones: what their slot records, and which values fingerprint them.

The hooks' fast paths take a plain ``torch.Tensor`` (exact type) at face value; anything else
comes here, off the hot path. The rule is that the tracer reads only memory that holds the
tensor's own values, runs no op that could communicate or wait, and never fails on a tensor
a legal program may pass:

- ``DTensor``: the slot is the LOCAL tensor (its shape; its values fingerprinted, read from
  ``_local_tensor``: no redistribution, no collective), with the global shape, placements and
  mesh as evidence in the slot's meta.
- ``AsyncCollectiveTensor`` (a functional collective's result): its ``elem`` holds the values
  once the program has waited on it. The tracer never waits: the fingerprint is taken at a
  mid-step flush or the end of the step if the program waited by then (``waited``), else there
  is none.
- Other subclasses with a ``__torch_dispatch__`` (FakeTensor, FunctionalTensor, a framework's
  own wrappers): their memory is not their values; no fingerprint, the class name in the meta.
  Jagged nested tensors are the exception: their packed ``values()`` are the values.
- Subclasses without one (``nn.Parameter``, ``__torch_function__``-only subclasses) are real
  tensors: read as the plain tensor they are (``__torch_function__`` off, so none of their code runs).
- Complex: the real view (``view_as_real``): sum of real and imaginary parts, sum of |z|^2.
- Sparse: its explicit values (a COO tensor's after coalescing, when it is already coalesced;
  else the sum alone, since coalescing would synchronise the device): the fingerprint of the
  dense tensor it stands for. Its slot is that dense tensor's (shape, dtype, device).
- Quantized: ``int_repr()`` (the stored integers, no dequantisation).
- Strided nested: its packed ``values()``; the slot's shape has -1 for ragged dimensions.
- Meta device: no fingerprint. Zero-size: the trivial (0, 0).

Meta is a ``Meta`` (a hashable tuple of (key, value) pairs, so that a layout holding it can be
interned like any other); the writer turns it into a dict (``as_dict``). Kinds that the slot's
(shape, dtype, device) already tell (complex, quantized, meta device, zero-size) get their meta
from ``implied`` when the META record is written: the hot paths never look at them.
"""

from __future__ import annotations

import sys

import torch

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_STRIDED = torch.strided
_NO_DISPATCH = torch.Tensor.__torch_dispatch__  # what a subclass without Python dispatch has
_DisableSubclass = torch._C.DisableTorchFunctionSubclass

# What source() says about a tensor's values.
NONE = 0  # no fingerprint
FULL = 1  # (sum, sum of squares) of the returned dense tensor
SUM = 2  # its sum only (the sum of squares of its values is not the tensor's)
AWAIT = 3  # an AsyncCollectiveTensor: its elem once the program has waited on it


class Meta(tuple):
    """A slot's kind evidence: (key, value) pairs, values ints, strings, bools, tuples or Metas."""

    __slots__ = ()


def from_dict(d: dict) -> Meta:
    """The ``Meta`` of a JSON-like dict (lists become tuples, dicts Metas): what
    ``RankWriter.meta`` and ``RankWriter.layout`` take, e.g. for a trace written by hand."""
    return Meta((k, _hashable(v)) for k, v in d.items())


def _hashable(v):
    if isinstance(v, dict):
        return from_dict(v)
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    return v


def as_dict(meta) -> dict:
    """The JSON-ready dict of a ``Meta`` (tuples become lists)."""
    return {k: _jsonable(v) for k, v in meta}


def _jsonable(v):
    if type(v) is Meta:
        return as_dict(v)
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v


_COMPLEX = Meta((("kind", "complex"), ("fp", "view_as_real")))
_QUANTIZED = Meta((("kind", "quantized"), ("fp", "int_repr")))
_META_DEVICE = Meta((("kind", "meta"), ("no_fingerprint", True)))
_EMPTY = Meta((("kind", "empty"), ("fp", "trivial")))
_QDTYPES = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}


def implied(shape, dtype: str, device: str):
    """The meta a slot's (shape, dtype string, device string) implies, or None: written with
    the META record, so the hot paths need not classify these kinds."""
    if dtype.startswith("complex"):
        return _COMPLEX
    if dtype in _QDTYPES:
        return _QUANTIZED
    if device == "meta":
        return _META_DEVICE
    if 0 in shape:
        return _EMPTY
    return None


# ------------------------------------------------------------------ classification by type
# type -> (info, values): info(t) -> (shape, dtype, device, meta or None); values(t) -> (source
# kind, tensor or None). Two functions, so that a slot never computes values (int_repr copies).
_HANDLERS: dict = {}


def _handler(cls):
    h = _HANDLERS.get(cls)
    if h is None:
        h = _HANDLERS[cls] = _pick(cls)
    return h


def _module_class(module: str, name: str):
    mod = sys.modules.get(module)  # only ever one the program imported: a tensor of it exists
    return getattr(mod, name, None) if mod is not None else None


def _pick(cls):
    if cls is _Tensor or cls is _Parameter:
        return (_plain_info, _plain_values)
    dt = _module_class("torch.distributed.tensor._api", "DTensor")
    if dt is not None and issubclass(cls, dt):
        return (_dtensor_info, _dtensor_values)
    act = _module_class("torch.distributed._functional_collectives", "AsyncCollectiveTensor")
    if act is not None and issubclass(cls, act):
        return (_async_info, _async_values)
    nested = _module_class("torch.nested._internal.nested_tensor", "NestedTensor")
    if nested is not None and issubclass(cls, nested):
        return (_jagged_info, _jagged_values)
    if getattr(cls, "__torch_dispatch__", _NO_DISPATCH) is _NO_DISPATCH:
        return (_subclass_info, _subclass_values)
    return (_opaque_info, _no_values)


def slot(name: str, t) -> tuple:
    """A layout entry for ``t``: (name, shape, dtype, device), plus its meta when it has one."""
    shape, dtype, device, meta = _handler(type(t))[0](t)
    return (name, shape, dtype, device) if meta is None else (name, shape, dtype, device, meta)


def meta_args(t) -> tuple:
    """The arguments of ``RankWriter.meta`` for ``t``: (shape, dtype, device, meta or None)."""
    return _handler(type(t))[0](t)


def source(t) -> tuple:
    """(source kind, tensor): which values fingerprint ``t`` (NONE, FULL, SUM, AWAIT). A FULL or
    SUM tensor is a plain, dense, strided tensor of a real dtype on a real device."""
    return _handler(type(t))[1](t)


_NO_VALUES = (NONE, None)


def _no_values(t):
    return _NO_VALUES


def _shape(t) -> tuple:
    """``t``'s sizes as ints: -1 for a symbolic one (never turned into an int: that would add a
    guard under torch.compile) or one that cannot be read."""
    try:
        return tuple(d if type(d) is int else -1 for d in t.shape)
    except Exception:
        return ()


# -- tensors with memory of their own (Tensor, Parameter, subclasses without dispatch)
def _plain_info(t):
    if t.is_nested:
        return (_nested_shape(t), t.dtype, t.device, _NESTED)
    # complex, quantized, meta and zero-size: implied by these three (``implied``); sparse: the
    # dense tensor it stands for
    return (tuple(t.shape), t.dtype, t.device, None)


def _plain_values(t):
    if t.is_nested:
        # contiguous: the packed buffer is exactly the components' values
        return _dense_source(FULL, t.values()) if t.is_contiguous() else _NO_VALUES
    if t.layout is not _STRIDED:
        return _sparse_values(t)
    if t.is_meta:
        return _NO_VALUES
    return _dense_source(FULL, t)


def _real_view(t):
    if t.is_conj():
        t = t.resolve_conj()  # (a copy: view_as_real refuses a lazily conjugated tensor)
    return torch.view_as_real(t)


def _dense_source(kind, values):
    """(kind, values) with complex values as their real view and quantized ones as their
    stored integers."""
    if values.is_complex():
        values = _real_view(values)
    elif values.is_quantized:
        values = values.int_repr()
    return (kind, values)


def _sparse_values(t):
    layout = t.layout
    if layout is torch.sparse_coo:
        # Duplicates of an uncoalesced tensor add up: the sum is right, the sum of squares is
        # not, and coalescing would synchronise the device.
        return _dense_source(FULL if t.is_coalesced() else SUM, t._values())
    if layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        return _dense_source(FULL, t.values())
    return _NO_VALUES  # (mkldnn and whatever else: memory we do not know how to read)


_NESTED = Meta((("kind", "nested"), ("layout", "strided"), ("fp", "values")))


def _nested_shape(t) -> tuple:
    """A strided nested tensor's shape: the number of components, then each dimension's size
    where the components agree, -1 where they differ."""
    try:
        sizes = t._nested_tensor_size().tolist()
        return (len(sizes), *[col[0] if len(set(col)) == 1 else -1 for col in zip(*sizes)])
    except Exception:
        return ()


def _subclass_base(t):
    """The plain tensor under a subclass that stores its own values, taken with
    ``__torch_function__`` off so that none of the subclass's code runs."""
    with _DisableSubclass():
        base = t.detach()
    return base if type(base) is _Tensor else base.as_subclass(_Tensor)


def _subclass_info(t):
    shape, dtype, device, meta = _plain_info(_subclass_base(t))
    return (shape, dtype, device, Meta((("kind", type(t).__name__), ("fp", "base"))) if meta is None
            else meta)


def _subclass_values(t):
    return _plain_values(_subclass_base(t))


# -- wrappers
def _opaque_info(t):
    """A wrapper whose memory is not its values (FakeTensor, FunctionalTensor, ...)."""
    return (_shape(t), t.dtype, t.device, Meta((("kind", type(t).__name__), ("no_fingerprint", True))))


def _jagged_readable(t) -> bool:
    # With lengths (holes, from a narrow) the buffer holds more than the tensor's values.
    return getattr(t, "_lengths", None) is None and type(getattr(t, "_values", None)) is _Tensor


def _jagged_info(t):
    meta = [("kind", "NestedTensor"), ("layout", "jagged")]
    try:
        meta.append(("ragged_dim", int(t._ragged_idx)))
    except Exception:
        pass
    meta.append(("fp", "values") if _jagged_readable(t) else ("no_fingerprint", True))
    return (_shape(t), t.dtype, t.device, Meta(meta))


def _jagged_values(t):
    return _dense_source(FULL, t._values) if _jagged_readable(t) else _NO_VALUES


_ASYNC_META = Meta((("kind", "AsyncCollectiveTensor"), ("fp", "elem_once_waited")))


def _async_info(t):
    return (_shape(t), t.dtype, t.device, _ASYNC_META)


def _async_values(t):
    return (AWAIT, t)


def waited(t, nothing_pending=None):
    """The (source kind, tensor) of an AsyncCollectiveTensor's values if the program has waited
    on it, else no values. Never waits. A wait through a view (``y.view(-1) + 1``: the view is a
    new wrapper, and only it is marked completed) is seen when no functional collective of the
    process is pending any more (``nothing_pending``, else asked of c10d's work registry)."""
    if not getattr(t, "completed", False):
        if nothing_pending is None:
            nothing_pending = no_work_pending()
        if not nothing_pending:
            return _NO_VALUES
    elem = getattr(t, "elem", None)
    if not isinstance(elem, _Tensor):
        return _NO_VALUES
    src = source(elem)
    return _NO_VALUES if src[0] == AWAIT else src


def no_work_pending() -> bool:
    """Whether c10d's registry of functional collectives' unwaited results is empty (False
    where it cannot be asked): every such result of this process has been waited on."""
    try:
        return torch._C._distributed_c10d._get_work_registry_size() == 0
    except Exception:
        return False


# ------------------------------------------------------------------ DTensor
_DT_META: dict = {}  # (spec, local meta) -> Meta: a step's DTensors share a few specs


def _dtensor_info(t):
    local = t._local_tensor  # the attribute itself: to_local() would be an autograd op
    shape, dtype, device, lmeta = meta_args(local)
    if lmeta is None:
        lmeta = implied(shape, str(dtype).removeprefix("torch."), str(device))
    spec = t._spec
    try:
        key = (spec, lmeta)
        meta = _DT_META.get(key)
    except Exception:  # an unhashable spec: built each time
        key = meta = None
    if meta is None:
        meta = _dtensor_meta(spec, lmeta)
        if key is not None:
            if len(_DT_META) >= 1024:
                _DT_META.clear()
            _DT_META[key] = meta
    return (shape, dtype, device, meta)


def _dtensor_values(t):
    return source(t._local_tensor)


def placement_name(p) -> str:
    """``Shard(1)``, ``Replicate()``, ``Partial(sum)`` (also for Partial's subclasses, e.g. the
    masked partial of a vocab-parallel embedding), else the placement's repr."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    cls = type(p)
    if cls is Shard:
        return f"Shard({p.dim})"
    if cls is Replicate:
        return "Replicate()"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    return repr(p)


def _dtensor_meta(spec, lmeta) -> Meta:
    mesh = spec.mesh
    items = [("kind", "DTensor"), ("fp", "local"),
             ("global_shape", tuple(int(d) for d in spec.shape)),
             ("placements", tuple(placement_name(p) for p in spec.placements))]
    try:
        ranks = mesh.mesh
        items.append(("mesh_shape", tuple(ranks.shape)))
        items.append(("mesh_dim_names", tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None))
        items.append(("mesh_ranks", tuple(ranks.flatten().tolist())))
        coord = mesh.get_coordinate()
        items.append(("coordinate", tuple(coord) if coord is not None else None))
    except Exception:
        pass
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(spec.shape, mesh, spec.placements)
        items.append(("global_offset", tuple(int(o) for o in offset)))
    except Exception:  # (a private helper: evidence, not needed)
        pass
    if lmeta is not None:
        items.append(("local", lmeta))
    return Meta(items)
