"""Module naming, call sites and parameters: what a module call is called in the trace.

A module's path is its ``named_modules()`` name under the first root that contains it, kept in
a ``WeakKeyDictionary`` (``Tracer.names``, as PyTorch's ModTracker does), so modules die
normally. A module held under several paths (SGLang's one rotary embedding in every layer) is
named per call by its call site: the path whose parent is the innermost running module
(``Tracer.shared``). Only such modules pay for it: their cached entry never matches the
writer's generation, so their calls take ``entry_slow``.

Every function takes the tracer first.
"""

from __future__ import annotations

import sys
import weakref

from tensor_trace import schema
from tensor_trace.tracer import kinds
from tensor_trace.tracer.fingerprint import StepFingerprints
from tensor_trace.tracer.spans import F_MODULE, F_PATH

PER_CALL = object()  # the writer generation of a shared module's cached entry: never current


def name_root(t, module) -> None:
    """Name a newly seen outermost module's submodules, and record their attributes and
    parameters. The first root's modules get their plain ``named_modules()`` paths
    (``model.layers.0``); a later, different root is prefixed with its class name, so that
    two models in one process (a sampler, a draft model) never share point names."""
    names = t.names
    prefix = _root_prefix(t, module)
    at: dict = {}  # named_modules name -> module, for the holder of each path
    sites: dict = {}  # id(module named now) -> (module, [(holder, holder path, entry)])
    for name, sub in module.named_modules(remove_duplicate=False):
        at[name] = sub
        path = f"{prefix}.{name}" if prefix and name else (prefix or name)
        if sub not in names:
            names[sub] = module_entry(t, path, sub)
            sites[id(sub)] = (sub, [])
        if name and id(sub) in sites:
            holder = name.rpartition(".")[0]
            holder_path = f"{prefix}.{holder}" if prefix and holder else (prefix or holder)
            sites[id(sub)][1].append((at[holder], holder_path, module_entry(t, path, sub)))
    for sub, held in sites.values():
        if len(held) > 1:
            by_holder: dict = {}  # id(holder) -> its sites (one holder may hold it twice)
            for h, hp, e in held:
                by_holder.setdefault(id(h), []).append((weakref.ref(h), hp, e))
            t.shared[sub] = (held[0][2], tuple(e for _, _, e in held), by_holder)


def entries_of(t, module) -> list:
    """The entries of every path of a named module (one, unless it is shared)."""
    sites = t.shared.get(module)
    if sites is not None:
        return list(sites[1])
    entry = t.names.get(module)
    return [] if entry is None else [entry]


def record_parameters(t, root) -> None:
    """Fingerprint every module's own parameters once: weights that differ across ranks
    with equal shapes are what tells a column-parallel output (a slice) from divergence."""
    writer = t.ensure_writer()
    fps = StepFingerprints()
    # every root's parameters are step PARAMS_STEP's fingerprints of the rank file: a second
    # root's numbered from 0 again took the first's indices (the reader kept one of each)
    last_writer, fps.count = t.params_fp_next
    if last_writer is not writer:
        fps.count = 0
    for sub in root.modules():
        entries = [e for e in entries_of(t, sub) if e[2]]
        if not entries:
            continue
        params = [(n, p) for n, p in sub.named_parameters(recurse=False) if p is not None]
        if not params:
            continue
        base = fps.add([p.detach() for _, p in params], store=False)
        for entry in entries:  # a shared module's weights, under each of its paths
            writer.add((schema.PARAMS, writer.module(entry[0], entry[1]), [
                [writer.string(n), writer.meta(*kinds.meta_args(p)), base + i]
                for i, (n, p) in enumerate(params)]))
    t.params_fp_next = (writer, fps.count)
    fps.finish_step(schema.PARAMS_STEP)
    t.fps.adopt_pending(fps)  # written with the next step's fingerprints


def _root_prefix(t, module) -> str:
    if module in t.names:  # already named under an earlier root
        return t.names[module][0]
    root_classes = t.root_classes
    if not root_classes:
        root_classes.append(type(module).__name__)
        return ""
    base = type(module).__name__
    name, k = base, 1
    while name in root_classes:
        k += 1
        name = f"{base}{k}"
    root_classes.append(name)
    return name


def module_entry(t, path: str, module):
    """(path, class name, selected); the root ("") is always recorded: it delimits the step."""
    selected = t.selector is None or not path or t.selector(path)
    return (path, type(module).__qualname__, selected)


def entry_slow(t, module):
    """(path, class, selected, writer generation, path id) of a module, made on first use
    in this rank file; kept by id with a weak reference that removes it when the module dies."""
    key = id(module)
    ids = t.ids
    writer = t.writer
    cached = ids.get(key)
    if cached is not None and cached[3] is PER_CALL:  # shared: its sites ride in the entry
        path, cls, selected = call_site(t, cached[5])
        path_id = writer.module(path, cls)
        t.site_paths[path_id] = path
        return (path, cls, selected, writer.generation, path_id)
    sites = t.shared.get(module)
    if sites is not None:
        path, cls, selected = call_site(t, sites)
        path_id = writer.module(path, cls)
        t.site_paths[path_id] = path
        full = (path, cls, selected, writer.generation, path_id)
        cached = (path, cls, selected, PER_CALL, path_id, sites)  # never current: per call
    else:
        entry = t.names.get(module)
        if entry is None:
            t.names[module] = entry = _child_entry(t, module)
        path, cls, selected = entry
        full = cached = (path, cls, selected, writer.generation, writer.module(path, cls))
    ids[key] = cached
    id_refs = t.id_refs
    if key not in id_refs:
        id_refs[key] = weakref.ref(module, lambda _r, k=key: (ids.pop(k, None), id_refs.pop(k, None)))
    return full


def call_site(t, sites):
    """The entry of a shared module's path for this call: the site whose holder is the
    innermost running module (the holder's own current path decides between sites of a
    holder that is itself shared); the first path when no holder is running. One dict
    look-up per open call walked, whatever the number of sites (a rotary module in each of
    80 layers is found at the top frame)."""
    first, _, by_holder = sites
    for frame in reversed(t.stack):
        running = frame[F_MODULE]
        held = by_holder.get(id(running))
        if held is None:
            continue
        if len(held) == 1:  # the common case: one attribute of one holder
            if held[0][0]() is running:
                return held[0][2]
            continue
        held = [site for site in held if site[0]() is running]
        if not held:
            continue
        if len(held) > 1:
            here = frame_path(t, frame)
            for _, holder_path, entry in held:
                if holder_path == here:
                    return entry
        return held[0][2]
    return first


def frame_path(t, frame) -> str:
    """The path of an open call (a shared module's: the path of this call's site)."""
    module = frame[F_MODULE]
    if module in t.shared:
        path = t.site_paths.get(frame[F_PATH])
        if path is not None:
            return path
    entry = t.names.get(module)
    return "" if entry is None else entry[0]


def _child_entry(t, module):
    # A module that is not under any root's named_modules (created or attached later):
    # named after the innermost open call, the way ModTracker names such modules.
    parent = ""
    for frame in reversed(t.stack):
        if frame[F_MODULE] in t.names:
            parent = frame_path(t, frame)
            break
    name = type(module).__name__
    path, cls, selected = module_entry(t, f"{parent}.{name}" if parent else name, module)
    if _is_graph_module(module):
        # the graph a torch.compile'd call runs (aot_eager's, named ``<lambda>``), one object
        # for every call of the same code: a part of the compiled module's call, not a module
        # of the program (what runs in it, its collectives, belongs to that call)
        selected = False
    return path, cls, selected


def _is_graph_module(module) -> bool:
    fx = sys.modules.get("torch.fx")
    return fx is not None and isinstance(module, fx.GraphModule)


def enclosing_module(t, pattern) -> str | None:
    """Path of the innermost open call whose path matches the compiled regex ``pattern``."""
    for frame in reversed(t.stack):
        if frame[F_MODULE] in t.names:
            path = frame_path(t, frame)
            if pattern.fullmatch(path):
                return path
    return None
