"""Lineage answers over a merged store.

``lineage(con, point)`` says what a point's tensor was built from: the ops recorded by the
tracer (tracer/lineage.py) are followed from the point's slot back to recorded module tensors
(by identity), through single-input ops (clone, view, reshape, split...) which are reported as
``via``, down to the op that combined several tensors (cat, stack, add, writes into slices of a
buffer), whose inputs are the ordered ``sources``. A tensor the tracer met only as a copy is
matched by its fingerprint to a recorded tensor of the same step ("matched by values").

Module boundaries: a source that is a module's output which that module built by laying
tensors side by side (cat, stack, copies into slices of a buffer) is followed inside, and the
boundaries crossed are listed as ``inside``; one computed otherwise (an add, a leaf module's
body, a compiled region: nothing recorded there) stays the source. Concatenations nested along
the same dim are flattened: the sources are the pieces in their place in the result.

Writes into a buffer (``buf[:, a:b].copy_(x)``, ``buf[..., a:b] = x``, ``index_copy_``,
``slice_scatter``) are ordered by where they land, not when; a write overwritten whole by a
later one is dropped, and a region no recorded write filled is named as such.

Contracts (``contract save/check``, ``query diff``) live in exporters/analysis/contracts.py.
"""

from __future__ import annotations

import json

from tensor_trace.errors import NoAnswer
from tensor_trace.exporters.store.points import capture_info, find_point
from tensor_trace.format.fingerprints import decode_fingerprints
from tensor_trace.format.lineage_refs import REF_NODE, REF_SLOT, REF_UNKNOWN, REF_VALUES, with_step
from tensor_trace.format.points import CAPTURE_PREFIX, is_input, is_output, parse_point
from tensor_trace.exporters.analysis.contracts import (CONTRACT_FORMAT, compare, load_contract,  # noqa: F401
                                             make_contract)

MAX_DEPTH = 64
MAX_STEPS = 16
MAX_WRITES = 4096  # writes into one buffer followed back
MAX_NEST = 4  # combining ops nested inside a source
_SIDE_BY_SIDE = ("cat", "slices")  # concatenations along a dim: flattened when nested
_LAID_OUT = ("cat", "stack", "slices")  # module outputs built so are followed inside


def _shared(con) -> tuple:
    """What every resolver of one store reads: module paths, points, a layout cache."""
    modules = dict(con.execute("SELECT module_id, path FROM modules"))
    points = {}
    for point, module, call, slot, placement, shapes, dtype in con.execute(
            "SELECT point, module, call, slot, placement, shapes, dtype FROM points"):
        points[(module, call, slot)] = dict(point=point, module=module, placement=placement,
                                            shapes={int(k): v for k, v in json.loads(shapes).items()},
                                            dtype=dtype)
    return modules, points, {}


class _Resolver:
    """Reads one process's lineage records of one step and names what refs point at."""

    def __init__(self, con, proc: int, step: int, shared=None):
        self.con, self.proc, self.step = con, proc, step
        if shared is None:
            shared = _shared(con)
        self.shared = shared
        self.modules, self.points, self.layouts = shared
        self._view = None
        self._steps = {step: self}

    def at_step(self, step) -> "_Resolver":
        """The resolver of another step of this process (a ref into an earlier step: the
        target's step, for a draft step that consumes its captures)."""
        hit = self._steps.get(step)
        if hit is None:
            hit = self._steps[step] = _Resolver(self.con, self.proc, step, self.shared)
            hit._steps = self._steps
        return hit

    def slots(self, layout_id) -> list:
        hit = self.layouts.get(layout_id)
        if hit is None:
            row = self.con.execute("SELECT slots FROM layouts WHERE layout_id=?", (layout_id,)).fetchone()
            hit = self.layouts[layout_id] = json.loads(row[0]) if row else []
        return hit

    def span(self, step, idx):
        # A step's spans are a rowid range (steps.span_first/last): no scan of the whole table.
        return self.con.execute(
            "SELECT s.module_id, s.call, s.layout_id FROM steps st JOIN spans s ON s.rowid BETWEEN "
            "st.span_first AND st.span_last WHERE st.proc=? AND st.step=? AND s.proc=st.proc AND s.step=st.step "
            "AND s.idx=? LIMIT 1", (self.proc, step, idx)).fetchone()

    def leaf(self, step, idx, slot_i) -> dict:
        row = self.span(step, idx)
        if row is None:
            return dict(point=f"<span {idx} of step {step}>", placement="unknown", shapes={}, dtype=None)
        mid, call, lay = row
        slots = self.slots(lay)
        slot = slots[slot_i][0] if slot_i < len(slots) else "?"
        module = self.modules.get(mid, "?")
        hit = self.points.get((module, call, slot))
        if hit is not None:
            return dict(hit)
        shape = slots[slot_i][1] if slot_i < len(slots) else None
        return dict(point=f"{module}:{slot}", module=module, placement="unknown",
                    shapes={0: shape} if shape else {}, dtype=slots[slot_i][2] if slot_i < len(slots) else None)

    def node(self, step, node):
        row = self.con.execute("SELECT op, attrs, inputs, shape FROM lineage WHERE proc=? AND step=? AND node=?",
                               (self.proc, step, node)).fetchone()
        if row is None:
            return None
        op, attrs, inputs, shape = row
        # A fingerprint index is one of the node's step: the step goes with it.
        inputs = [with_step(r, step) for r in json.loads(inputs)]
        return op, json.loads(attrs) if attrs else {}, inputs, json.loads(shape)

    def slot_src(self, step, span, slot_i):
        """The node ref a module call's slot was built by, if any (a SLOT_SRC record)."""
        row = self.con.execute("SELECT ref FROM slot_sources WHERE proc=? AND step=? AND span=? AND slot=?",
                               (self.proc, step, span, slot_i)).fetchone()
        return json.loads(row[0]) if row else None

    def view(self):
        """This process's view of the step (step_view.StepView) and its fingerprints by index."""
        from tensor_trace.exporters.analysis import step_view as sv

        if self._view is None:
            layouts = {lid: json.loads(s) for lid, s in self.con.execute("SELECT layout_id, slots FROM layouts")}
            rank_of = {p: (r if r is not None else 0) for p, r in self.con.execute("SELECT proc, rank FROM processes")}
            self._view = sv.StepView(self.con, self.step, [self.proc], layouts, self.modules, rank_of)
            self._fps = {}
            for first, data, indices in self.con.execute(
                    "SELECT first, data, indices FROM fingerprints WHERE proc=? AND step=?", (self.proc, self.step)):
                decode_fingerprints(first, data, indices, self._fps)
        return self._view

    def by_values(self, fp_index, shape, before=None) -> dict | None:
        """The latest recorded output of this step (ending by ``before``, ns from the step's
        start, if given) whose fingerprint equals fingerprint ``fp_index``."""
        from tensor_trace.exporters.analysis import tolerance as tol

        view = self.view()
        fp = self._fps.get(fp_index)
        if fp is None:
            return None
        best = None
        for key, obs in view.points.items():
            t = obs.get(self.proc)
            if t is None or t.fp is None or not is_output(key[2]):
                continue
            probe = tol.Observed(shape, t.dtype, fp)
            if t.numel == probe.numel and tol.fp_equal(t, probe):
                order = view.times.get(key, (0, 0, 0))
                if before is not None and order[0] > before:
                    continue
                # The call entered last (highest span index) made it: outer modules that
                # pass the same tensor on entered earlier.
                if best is None or order[1] > best[0][1]:
                    best = (order, key)
        if best is None:
            return None
        module, call, slot = best[1]
        out = dict(self.points.get((module, call, slot)) or dict(point=f"{module}:{slot}", placement="unknown",
                                                                shapes={}, dtype=None))
        out["at"] = (self.step, best[0][1], best[0][2])  # (step, span, slot): where it was recorded
        return out


def _op_text(op, attrs) -> str:
    if op in ("cat", "stack", "split", "chunk", "unbind") and "dim" in attrs:
        extra = f", part {attrs['index']} of {attrs['of']}" if "index" in attrs else ""
        return f"{op}(dim={attrs['dim']}{extra})"
    if op in ("view", "reshape", "flatten") and "shape" in attrs:
        return f"{op}({attrs['shape']})"
    if op == "to" and "dtype" in attrs:
        return f"to({attrs['dtype']})"
    return op


class _Node:
    """A combining op as the answer shows it: its text, its family (``cat``, ``stack``,
    ``slices``, or the op's own name), the dim it lays tensors along (normalized, or None) and
    its ordered inputs ``[(ref or None, op text for that input, placeholder point)]``."""

    __slots__ = ("text", "family", "dim", "items")

    def __init__(self, text, family, dim, items):
        self.text, self.family, self.dim, self.items = text, family, dim, items


def _placeholder(point) -> dict:
    return dict(point=point, placement="unknown", shapes={}, dtype=None)


def _follow(res: _Resolver, ref, depth=0):
    """Follow single-input ops (and module outputs laid out inside their module) from ``ref``.
    Returns (kind, payload, via, inside): kind "leaf" with a point dict, "node" with a _Node,
    or "unknown" with a placeholder point; ``via`` the ops met (from the point toward the
    source) and ``inside`` the module outputs passed through."""
    via, inside = [], []
    while depth < MAX_DEPTH:
        depth += 1
        kind = ref[0]
        if kind == REF_SLOT:
            leaf = res.leaf(ref[1], ref[2], ref[3])
            leaf["at"] = (ref[1], ref[2], ref[3])
            inner = _enter(res, (ref[1], ref[2], ref[3]), depth)
            if inner is not None:
                return inner[0], inner[1], via + inner[2], inside + [leaf["point"]] + inner[3]
            return "leaf", leaf, via, inside
        if kind == REF_VALUES:
            hit = (res.at_step(ref[3]) if len(ref) > 3 else res).by_values(ref[1], ref[2])
            if hit is None:
                return "unknown", _placeholder(f"<unrecorded tensor {ref[2]}>"), via, inside
            via.append("copy (matched by values)")
            inner = _enter(res, hit["at"], depth)
            if inner is not None:
                return inner[0], inner[1], via + inner[2], inside + [hit["point"]] + inner[3]
            return "leaf", hit, via, inside
        if kind == REF_UNKNOWN:
            return "unknown", _placeholder(f"<unrecorded tensor {ref[1]}>"), via, inside
        node = res.node(ref[1], ref[2])
        if node is None:
            return "unknown", _placeholder("<lost lineage record>"), via, inside
        op, attrs, inputs, shape = node
        if "into" in attrs:  # a write into a buffer
            packed = _pack(res, ref)
            if isinstance(packed, _Node):
                return "node", packed, via, inside
            via.append(packed[0])
            ref = packed[1]
            continue
        if len(inputs) == 1:
            via.append(_op_text(op, attrs))
            ref = inputs[0]
            continue
        text = _op_text(op, attrs)
        dim = attrs.get("dim")
        if op in ("cat", "stack") and isinstance(dim, int) and shape:
            dim %= len(shape)
        return "node", _Node(text, op, dim, [(r, text, None) for r in inputs]), via, inside
    return "unknown", _placeholder("<lineage too deep>"), via, inside


def _enter(res, at, depth):
    """The answer inside a module output (``at`` = (step, span, slot)) that its module laid out
    from other tensors, or None where it computed it (or nothing inside was recorded)."""
    ref = res.slot_src(*at)
    if ref is None or depth >= MAX_DEPTH:
        return None
    inner = _follow(res, ref, depth)
    if inner[0] == "node" and inner[1].family in _LAID_OUT:
        return inner
    if inner[0] == "leaf" and str(inner[1].get("module", "")).startswith(CAPTURE_PREFIX):
        # A module output that is a named capture passed on (cloned, viewed): SGLang's model
        # returns its EAGLE-3 captures as a list of copies. The capture names it better.
        return inner
    return None


def _pack(res, ref):
    """The writes into one buffer that made ``ref``, as a _Node ordered by place, or
    (op text, source ref) where one write replaced the whole buffer (a copy)."""
    writes = []  # newest first: (op, attrs, source ref)
    base = None
    r = ref
    while len(writes) < MAX_WRITES:
        node = res.node(r[1], r[2]) if r[0] == REF_NODE else None
        if node is None or "into" not in node[1]:
            base = r
            break
        op, attrs, inputs, _shape = node
        writes.append((op, attrs, inputs[0]))
        if len(inputs) < 2:
            break
        r = inputs[1]
    into = writes[0][1]["into"]
    nd = len(into)
    live, seen = [], set()
    for op, attrs, src in writes:  # newest first: a region written again keeps its last write
        box = (tuple(attrs["at"]), tuple(attrs["len"])) if "at" in attrs else None
        if box is not None:
            if box in seen:
                continue
            seen.add(box)
        live.append((op, box, src))
        if box is not None and box[0] == (0,) * nd and list(box[1]) == into:
            base = None  # this write replaced the whole buffer: nothing before it shows
            break
    live.reverse()  # time order
    if len(live) == 1 and base is None and live[0][1] is not None and list(live[0][1][1]) == into:
        return live[0][0], live[0][2]  # a copy of the whole: followed through
    if any(b is None for _, b, _ in live):
        items = [(src, op, None) for op, _, src in live]  # no place known: in time order
        if base is not None:
            items.insert(0, (base, "written into", None))
        return _Node("slices", "slices", None, items)
    dims = {d for _, (at, ln), _ in live for d in range(nd) if (at[d], ln[d]) != (0, into[d])}
    live.sort(key=lambda w: w[1][0])
    if len(dims) != 1:
        items = [(src, f"{op}(at={list(b[0])}, len={list(b[1])})", None) for op, b, src in live]
        if base is not None:
            items.insert(0, (base, "written into", None))
        return _Node("slices", "slices", None, items)
    (d,) = dims
    items, end = [], 0
    for op, (at, ln), src in live:
        a, b = at[d], at[d] + ln[d]
        if a > end:
            items.append(_gap(base, d, end, a))
        items.append((src, f"{op}(dim={d}, {a}:{b})", None))
        end = max(end, b)
    if end < into[d]:
        items.append(_gap(base, d, end, into[d]))
    return _Node(f"slices(dim={d})", "slices", d, items)


def _gap(base, d, a, b):
    """A region of a buffer no recorded write filled: what it held before, where that is known."""
    if base is not None:
        return base, f"written into (dim={d}, {a}:{b})", None
    return None, f"slices(dim={d}, {a}:{b})", f"<no recorded write: dim {d} [{a}:{b}]>"


def _sources(res, node: _Node, depth=0) -> list[dict]:
    """A combining op's inputs as sources, in order. An input that is itself laid out along
    the same dim (directly, or inside a module output) is replaced by its own sources."""
    out = []
    for ref, op_text, placeholder in node.items:
        if ref is None:
            out.append(dict(_placeholder(placeholder), op=op_text, via=[]))
            continue
        kind, payload, via, inside = _follow(res, ref)
        if kind == "node":
            inner = _sources(res, payload, depth + 1) if depth < MAX_NEST else []
            if (not via and depth < MAX_NEST and payload.family in _SIDE_BY_SIDE and node.family in _SIDE_BY_SIDE
                    and payload.dim is not None and payload.dim == node.dim):
                for s in inner:
                    s["inside"] = inside + s.get("inside", [])
                out += inner
                continue
            s = dict(point=f"{payload.text} of [{', '.join(s['point'] for s in inner)}]", op=op_text,
                     shapes={}, placement="unknown", dtype=None, via=list(reversed(via)), sources=inner)
        else:
            s = dict(point=payload["point"], op=op_text, shapes=payload.get("shapes", {}),
                     placement=payload.get("placement", "unknown"), dtype=payload.get("dtype"),
                     via=list(reversed(via)))
            if payload.get("module"):
                s["module"] = payload["module"]
            captured = _captured(res, payload)
            if captured is not None:
                s["captured"] = captured
        if inside:
            s["inside"] = inside
        out.append(s)
    return out


def _captured(res, leaf: dict) -> dict | None:
    """What a named capture point (``capture:NAME``) captured, from the tracer's record of the
    tensor it was handed (tracer/lineage.py ``link_capture``): ``{"op", "points"}``, the points
    in order (one for a module output captured as is, e.g. ``model.embed_tokens:output``; the
    inputs of the op that made it otherwise, e.g. a decoder layer's two outputs summed into the
    residual stream). None for another point, or where nothing recorded made the tensor."""
    module = leaf.get("module") or parse_point(leaf.get("point", "")).module
    at = leaf.get("at")
    if not str(module).startswith(CAPTURE_PREFIX) or at is None:
        return None
    ref = res.slot_src(*at)
    if ref is None:
        return None
    kind, payload, via, _inside = _follow(res, ref)
    if kind == "leaf":
        out = dict(op="identity", points=[payload["point"]], via=list(reversed(via)))
    elif kind == "node":
        out = dict(op=payload.text, points=[s["point"] for s in _sources(res, payload, MAX_NEST)],
                   via=list(reversed(via)))
    else:
        return None

    info = capture_info(res.con, module) or {}
    if info.get("what"):
        out["what"] = info["what"]  # the framework integration's words (e.g. which layer's residual)
    return out


def _slot_index(res, proc, step, module_id, call, slot):
    row = res.con.execute(
        "SELECT s.idx, s.layout_id FROM steps st JOIN spans s ON s.rowid BETWEEN st.span_first AND st.span_last "
        "WHERE st.proc=? AND st.step=? AND s.proc=st.proc AND s.step=st.step AND s.module_id=? AND s.call=? "
        "LIMIT 1", (proc, step, module_id, call)).fetchone()
    if row is None:
        return None
    names = [s[0] for s in res.slots(row[1])]
    return (row[0], names.index(slot)) if slot in names else None


def _find(con, mid, call, slot):
    """(resolver, (span, slot index), ref or None) on the first process and step that recorded
    the slot, preferring one where a node built it; None if no step has it."""
    procs = [r[0] for r in con.execute("SELECT proc FROM processes ORDER BY rank IS NULL, rank, proc")]
    found = None
    shared = _shared(con)
    for proc in procs:
        steps = [r[0] for r in con.execute(
            "SELECT step FROM steps WHERE proc=? AND span_first IS NOT NULL ORDER BY step LIMIT ?", (proc, MAX_STEPS))]
        for step in steps:
            res = _Resolver(con, proc, step, shared)
            where = _slot_index(res, proc, step, mid, call, slot)
            if where is None:
                continue
            ref = res.slot_src(step, *where)
            found = found or (res, where, None)
            if ref is not None:
                return res, where, ref
    return found


def lineage(con, point: str) -> dict:
    """What ``point``'s tensor was built from (see the module docstring)."""
    p = find_point(con, point)[0]
    module, call, slot = p["module"], p["call"], p["slot"]
    row = con.execute("SELECT module_id FROM modules WHERE path=?", (module,)).fetchone()
    if row is None:
        raise NoAnswer(f"no module {module!r} in this trace")
    found = _find(con, row[0], call, slot)
    out = dict(point=p["point"], module=module, shapes=p["shapes"], dtype=p.get("dtype"),
               placement=p["placement"], op=None, via=[], sources=[])
    if found is None:
        return out
    res, (span, slot_i), ref = found
    if ref is None and is_input(slot):
        # A module input that no watched op built is, as a rule, an earlier call's output: found
        # by its values (same fingerprint), since identity is only written where ops combine.
        hit = _same_values(res, span, slot_i, p)
        if hit is None:
            return out
        inner = _enter(res, hit["at"], 0)
        if inner is None:
            out.update(op="identity", via=["same values"])
            out["sources"] = [dict(point=hit["point"], op="identity", shapes=hit.get("shapes", {}),
                                   placement=hit.get("placement", "unknown"), dtype=hit.get("dtype"),
                                   via=["same values"])]
            return out
        kind, payload, via, inside = inner
        via, inside = ["same values"] + via, [hit["point"]] + inside
    elif ref is None:
        return out  # nothing recorded built it: a module computed it
    else:
        kind, payload, via, inside = _follow(res, ref)
    out["via"] = list(reversed(via))
    if inside:
        out["inside"] = inside
    if kind == "node":
        out["op"] = payload.text
        out["sources"] = _sources(res, payload)
    else:
        out["op"] = "identity"
        out["sources"] = [dict(point=payload["point"], op="identity", shapes=payload.get("shapes", {}),
                               placement=payload.get("placement", "unknown"), dtype=payload.get("dtype"),
                               via=out["via"])]
    return out


def _same_values(res, span, slot_i, p):
    """The recorded output (ended before this call began) whose values a module input has."""
    row = res.con.execute("SELECT s.fp_pre, s.n_pre, s.t0 FROM steps st JOIN spans s ON s.rowid BETWEEN "
                          "st.span_first AND st.span_last WHERE st.proc=? AND st.step=? AND s.proc=st.proc "
                          "AND s.step=st.step AND s.idx=? LIMIT 1", (res.proc, res.step, span)).fetchone()
    if row is None or row[0] < 0 or slot_i >= row[1]:
        return None
    shape = (p["shapes"].get(min(p["shapes"])) or []) if p["shapes"] else []
    return res.by_values(row[0] + slot_i, shape, before=row[2])


def points_with_lineage(con) -> list[str]:
    """Points whose tensor some recorded op built (on the first process that has any), and the
    module inputs that have the values of a module output laid out inside its module."""
    modules = dict(con.execute("SELECT module_id, path FROM modules"))
    names = {}
    # The span of each slot source is found in its step's run of rowids (spans has no index:
    # joined on (proc, step, idx) alone, SQLite reads every span of the trace).
    rows = con.execute(
        "SELECT DISTINCT s.module_id, s.call, s.layout_id, ss.slot FROM slot_sources ss "
        "JOIN steps st ON st.proc = ss.proc AND st.step = ss.step "
        "JOIN spans s ON s.rowid BETWEEN st.span_first AND st.span_last AND s.proc = ss.proc "
        "AND s.step = ss.step AND s.idx = ss.span WHERE ss.proc = (SELECT MIN(proc) FROM slot_sources)").fetchall()
    layouts = {}
    for mid, call, lay, slot_i in rows:
        if lay not in layouts:
            r = con.execute("SELECT slots FROM layouts WHERE layout_id=?", (lay,)).fetchone()
            layouts[lay] = json.loads(r[0]) if r else []
        slots = layouts[lay]
        if slot_i < len(slots):
            key = (modules.get(mid), call, slots[slot_i][0])
            hit = con.execute("SELECT point FROM points WHERE module=? AND call=? AND slot=?", key).fetchone()
            if hit:
                names[hit[0]] = True
    for name in _consumers_of_laid_out(con):
        names[name] = True
    return sorted(names)


def _consumers_of_laid_out(con) -> list[str]:
    """Module inputs whose values are those of a module output laid out inside its module (a
    target returning its captures concatenated): their lineage goes through it."""
    from tensor_trace.exporters.analysis import tolerance as tol

    row = con.execute("SELECT proc, step FROM slot_sources ORDER BY proc, step LIMIT 1").fetchone()
    if row is None:
        return []
    res = _Resolver(con, row[0], row[1])
    outs = con.execute("SELECT span, slot FROM slot_sources WHERE proc=? AND step=?", row).fetchall()
    laid = [(span, slot) for span, slot in outs if _enter(res, (row[1], span, slot), 0) is not None]
    if not laid:
        return []
    view = res.view()
    by_place = {(t[1], t[2]): key for key, t in view.times.items()}
    targets = [view.points[by_place[w]].get(res.proc) for w in laid if w in by_place]
    targets = [t for t in targets if t is not None and t.fp is not None]
    out = []
    for key, obs in view.points.items():
        t = obs.get(res.proc)
        if t is None or t.fp is None or not is_input(key[2]):
            continue
        if any(t.numel == u.numel and tol.fp_equal(t, u) for u in targets):
            hit = res.points.get(key)
            if hit is not None:
                out.append(hit["point"])
    return out
