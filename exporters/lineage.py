"""Lineage answers and capture contracts over a merged store.

``lineage(con, point)`` says what a point's tensor was built from: the ops recorded by the
tracer (tracer/lineage.py) are followed from the point's slot back to recorded module tensors
(by identity), through single-input ops (clone, view, reshape, split...) which are reported as
``via``, down to the op that combined several tensors (cat, stack, add), whose inputs are the
ordered ``sources``. A tensor the tracer met only as a copy is matched by its fingerprint to a
recorded tensor of the same step ("matched by values").

A *contract* is a saved lineage (``contract save``); ``compare`` lists how a trace's lineage
departs from it: another source at a position, a missing or extra source, another order, or a
change of shape, dtype or placement of the point or of a source. ``contract check`` and
``query diff`` both use it.
"""

from __future__ import annotations

import json

from tensor_trace.errors import BadInput, NoAnswer

CONTRACT_FORMAT = 1
MAX_DEPTH = 64
MAX_STEPS = 16


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
        self.modules, self.points, self.layouts = shared
        self._view = None

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
        return op, json.loads(attrs) if attrs else {}, json.loads(inputs), json.loads(shape)

    def by_values(self, fp_index, shape, before=None) -> dict | None:
        """The latest recorded output of this step (ending by ``before``, ns from the step's
        start, if given) whose fingerprint equals fingerprint ``fp_index``."""
        from tensor_trace.exporters import placement as pl

        if self._view is None:
            layouts = {lid: json.loads(s) for lid, s in self.con.execute("SELECT layout_id, slots FROM layouts")}
            rank_of = {p: (r if r is not None else 0) for p, r in self.con.execute("SELECT proc, rank FROM processes")}
            self._view = pl.StepView(self.con, self.step, [self.proc], layouts, self.modules, rank_of)
            self._fps = {}
            for first, data, indices in self.con.execute(
                    "SELECT first, data, indices FROM fingerprints WHERE proc=? AND step=?", (self.proc, self.step)):
                import struct

                n = len(data) // 8
                idx = range(first, first + n) if indices is None else struct.unpack(f"<{n}I", indices[:4 * n])
                for i, pair in zip(idx, struct.iter_unpack("<ff", data[:8 * n])):
                    self._fps[i] = pair
        fp = self._fps.get(fp_index)
        if fp is None:
            return None
        view = self._view
        best = None
        for key, obs in view.points.items():
            t = obs.get(self.proc)
            if t is None or t.fp is None or not key[2].startswith("output"):
                continue
            probe = pl.T(shape, t.dtype, fp)
            if t.numel == probe.numel and pl.fp_equal(t, probe):
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
        return dict(self.points.get((module, call, slot)) or dict(point=f"{module}:{slot}", placement="unknown",
                                                                 shapes={}, dtype=None))


def _op_text(op, attrs) -> str:
    if op in ("cat", "stack", "split", "chunk", "unbind") and "dim" in attrs:
        extra = f", part {attrs['index']} of {attrs['of']}" if "index" in attrs else ""
        return f"{op}(dim={attrs['dim']}{extra})"
    if op in ("view", "reshape", "flatten") and "shape" in attrs:
        return f"{op}({attrs['shape']})"
    if op == "to" and "dtype" in attrs:
        return f"to({attrs['dtype']})"
    return op


def _follow(res: _Resolver, ref, depth=0):
    """Follow single-input ops from ``ref``. Returns (kind, payload, via): kind "leaf" with a
    point dict, "node" with (op text, input refs, shape) of a combining op, or "unknown"."""
    via = []
    while depth < MAX_DEPTH:
        depth += 1
        kind = ref[0]
        if kind == 0:
            return "leaf", res.leaf(ref[1], ref[2], ref[3]), via
        if kind == 2:
            hit = res.by_values(ref[1], ref[2])
            if hit is None:
                return "unknown", dict(point=f"<unrecorded tensor {ref[2]}>", placement="unknown",
                                       shapes={}, dtype=None), via
            via.append("copy (matched by values)")
            return "leaf", hit, via
        if kind == 3:
            return "unknown", dict(point=f"<unrecorded tensor {ref[1]}>", placement="unknown",
                                   shapes={}, dtype=None), via
        node = res.node(ref[1], ref[2])
        if node is None:
            return "unknown", dict(point="<lost lineage record>", placement="unknown", shapes={}, dtype=None), via
        op, attrs, inputs, shape = node
        if len(inputs) == 1:
            via.append(_op_text(op, attrs))
            ref = inputs[0]
            continue
        return "node", (_op_text(op, attrs), inputs, shape), via
    return "unknown", dict(point="<lineage too deep>", placement="unknown", shapes={}, dtype=None), via


def _source(res, ref, op_text, depth=0) -> dict:
    kind, payload, via = _follow(res, ref)
    if kind == "node":
        inner_op, inputs, shape = payload
        inner = [_source(res, r, inner_op, depth + 1) for r in inputs] if depth < 4 else []
        return dict(point=f"{inner_op} of [{', '.join(s['point'] for s in inner)}]", op=op_text,
                    shapes={}, placement="unknown", dtype=None, via=list(reversed(via)), sources=inner)
    out = dict(point=payload["point"], op=op_text, shapes=payload.get("shapes", {}),
               placement=payload.get("placement", "unknown"), dtype=payload.get("dtype"),
               via=list(reversed(via)))
    if payload.get("module"):
        out["module"] = payload["module"]
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


def lineage(con, point: str) -> dict:
    """What ``point``'s tensor was built from (see the module docstring)."""
    from tensor_trace.exporters.query import find_point

    p = find_point(con, point)[0]
    module, call, slot = p["module"], p["call"], p["slot"]
    row = con.execute("SELECT module_id FROM modules WHERE path=?", (module,)).fetchone()
    if row is None:
        raise NoAnswer(f"no module {module!r} in this trace")
    mid = row[0]
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
            ref = con.execute("SELECT ref FROM slot_sources WHERE proc=? AND step=? AND span=? AND slot=?",
                              (proc, step, *where)).fetchone()
            found = found or (res, where, None)
            if ref is not None:
                found = (res, where, json.loads(ref[0]))
                break
        if found is not None and found[2] is not None:
            break
    out = dict(point=p["point"], module=module, shapes=p["shapes"], dtype=p.get("dtype"),
               placement=p["placement"], op=None, via=[], sources=[])
    if found is None:
        return out
    res, (span, slot_i), ref = found
    if ref is None and slot.startswith("input"):
        # A module input that no watched op built is, as a rule, an earlier call's output: found
        # by its values (same fingerprint), since identity is only written where ops combine.
        row = con.execute("SELECT s.fp_pre, s.n_pre, s.t0 FROM steps st JOIN spans s ON s.rowid BETWEEN "
                          "st.span_first AND st.span_last WHERE st.proc=? AND st.step=? AND s.proc=st.proc "
                          "AND s.step=st.step AND s.idx=? LIMIT 1", (res.proc, res.step, span)).fetchone()
        if row is not None and row[0] >= 0 and slot_i < row[1]:
            hit = res.by_values(row[0] + slot_i, (p["shapes"].get(min(p["shapes"])) or []) if p["shapes"] else [],
                                before=row[2])
            if hit is not None:
                out.update(op="identity", via=["same values"])
                out["sources"] = [dict(point=hit["point"], op="identity", shapes=hit.get("shapes", {}),
                                       placement=hit.get("placement", "unknown"), dtype=hit.get("dtype"),
                                       via=["same values"])]
        return out
    if ref is None:
        return out  # nothing recorded built it: a module computed it
    kind, payload, via = _follow(res, ref)
    out["via"] = list(reversed(via))
    if kind == "node":
        op_text, inputs, _shape = payload
        out["op"] = op_text
        out["sources"] = [_source(res, r, op_text) for r in inputs]
    else:
        out["op"] = "identity"
        out["sources"] = [dict(point=payload["point"], op="identity", shapes=payload.get("shapes", {}),
                               placement=payload.get("placement", "unknown"), dtype=payload.get("dtype"),
                               via=out["via"])]
    return out


def points_with_lineage(con) -> list[str]:
    """Points whose tensor some recorded op built (on the first process that has any)."""
    modules = dict(con.execute("SELECT module_id, path FROM modules"))
    names = {}
    rows = con.execute(
        "SELECT DISTINCT s.module_id, s.call, s.layout_id, ss.slot FROM slot_sources ss JOIN spans s "
        "ON s.proc = ss.proc AND s.step = ss.step AND s.idx = ss.span WHERE ss.proc = "
        "(SELECT MIN(proc) FROM slot_sources)").fetchall()
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
    return sorted(names)


# ---------------------------------------------------------------- contracts

def make_contract(lin: dict) -> dict:
    """A lineage answer as a contract: what a check expects of another trace."""
    return dict(
        tensor_trace_contract=CONTRACT_FORMAT, point=lin["point"], op=lin["op"],
        shapes=lin["shapes"], dtype=lin["dtype"], placement=lin["placement"],
        sources=[dict(position=i, point=s["point"], module=s.get("module"),
                      role=f"input {i} of {s['op']}", op=s["op"], via=s.get("via", []),
                      shapes=s["shapes"], dtype=s.get("dtype"), placement=s["placement"])
                 for i, s in enumerate(lin["sources"])])


def load_contract(path: str) -> dict:
    try:
        with open(path) as f:
            c = json.load(f)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read the contract ({exc.strerror})")
    except ValueError:
        raise BadInput(f"{path}: not a JSON contract")
    if not isinstance(c, dict) or c.get("tensor_trace_contract") != CONTRACT_FORMAT or "sources" not in c:
        raise BadInput(f"{path}: not a tensor-trace contract (format {CONTRACT_FORMAT})")
    return c


def _norm_shapes(shapes) -> dict:
    return {int(k): list(v) for k, v in (shapes or {}).items()}


def compare(expected: dict, actual: dict) -> list[dict]:
    """How ``actual`` (a lineage answer) departs from ``expected`` (a contract or another
    lineage answer): a list of {kind, message, ...}; empty when they agree."""
    out = []
    exp = [s["point"] for s in expected["sources"]]
    act = [s["point"] for s in actual["sources"]]
    name = expected["point"]
    if (expected.get("op") or None) != (actual.get("op") or None):
        out.append(dict(kind="op", expected=expected.get("op"), actual=actual.get("op"),
                        message=f"{name} is built by {actual.get('op') or 'no recorded op'}, "
                                f"not {expected.get('op') or 'no recorded op'}"))
    for i, p in enumerate(act):
        if p not in exp:
            there = f" (the contract has {exp[i]} there)" if i < len(exp) else ""
            out.append(dict(kind="extra", source=p, position=i,
                            message=f"unexpected source {p} at position {i}{there}"))
    for i, p in enumerate(exp):
        if p not in act:
            out.append(dict(kind="missing", source=p, position=i,
                            message=f"missing source {p} (position {i} in the contract)"))
    common_e = [p for p in exp if p in act]
    common_a = [p for p in act if p in exp]
    if common_e != common_a:
        out.append(dict(kind="order", expected=common_e, actual=common_a,
                        message=f"sources in another order: contract {common_e}, trace {common_a}"))
    for p in common_e:
        i, j = exp.index(p), act.index(p)
        if i != j:
            out.append(dict(kind="moved", source=p, expected=i, actual=j,
                            message=f"source {p} moved from position {i} to {j}"))
        es, as_ = expected["sources"][i], actual["sources"][j]
        out += _fields(f"source {p}", es, as_)
    out += _fields(name, expected, actual)
    return out


def _fields(what, e, a) -> list:
    out = []
    if _norm_shapes(e.get("shapes")) != _norm_shapes(a.get("shapes")) and e.get("shapes") and a.get("shapes"):
        out.append(dict(kind="shape", what=what, expected=e.get("shapes"), actual=a.get("shapes"),
                        message=f"{what}: shape {_shape_text(a.get('shapes'))}, contract {_shape_text(e.get('shapes'))}"))
    if e.get("dtype") and a.get("dtype") and e["dtype"] != a["dtype"]:
        out.append(dict(kind="dtype", what=what, expected=e["dtype"], actual=a["dtype"],
                        message=f"{what}: dtype {a['dtype']}, contract {e['dtype']}"))
    if e.get("placement") and a.get("placement") and e["placement"] != a["placement"]:
        out.append(dict(kind="placement", what=what, expected=e["placement"], actual=a["placement"],
                        message=f"{what}: placement {a['placement']}, contract {e['placement']}"))
    return out


def _shape_text(shapes) -> str:
    vals = {json.dumps(v) for v in (shapes or {}).values()}
    return vals.pop() if len(vals) == 1 else json.dumps(shapes)
