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

The store reads are lineage_records.py, the walk from a slot to its sources lineage_walk.py;
contracts (``contract save/check``, ``query diff``) live in exporters/analysis/contracts.py.
"""

from __future__ import annotations

import json

from tensor_trace.errors import NoAnswer
from tensor_trace.exporters.store.points import find_point
from tensor_trace.format.points import is_input
from tensor_trace.exporters.analysis.contracts import (CONTRACT_FORMAT, compare, load_contract,  # noqa: F401
                                             make_contract)
from tensor_trace.exporters.analysis.lineage_records import Resolver, read_shared
from tensor_trace.exporters.analysis.lineage_walk import enter, follow, sources

MAX_STEPS = 16


def _slot_index(res, proc, step, module_id, call, slot):
    row = res.con.execute(
        "SELECT s.idx, s.layout_id FROM steps st JOIN spans s ON s.rowid BETWEEN st.span_first AND st.span_last "
        "WHERE st.proc=? AND st.step=? AND s.proc=st.proc AND s.step=st.step AND s.module_id=? AND s.call=? "
        "LIMIT 1", (proc, step, module_id, call)).fetchone()
    if row is None:
        return None
    names = [s[0] for s in res.slots(row[1])]
    return (row[0], names.index(slot)) if slot in names else None


def _procs(con) -> list:
    return [r[0] for r in con.execute("SELECT proc FROM processes ORDER BY rank IS NULL, rank, proc")]


def _find(con, mid, call, slot, procs=None):
    """(resolver, (span, slot index), ref or None) on the first process (of ``procs``, else of
    all) and step that recorded the slot, preferring one where a node built it; None if no step
    has it."""
    procs = _procs(con) if procs is None else procs
    found = None
    shared = read_shared(con)
    for proc in procs:
        steps = [r[0] for r in con.execute(
            "SELECT step FROM steps WHERE proc=? AND span_first IS NOT NULL ORDER BY step LIMIT ?", (proc, MAX_STEPS))]
        for step in steps:
            res = Resolver(con, proc, step, shared)
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
    out = _answer(p, found)
    if found is not None:
        _ranks_that_differ(con, p, row[0], found[0].proc, out)
    return out


def _ranks_that_differ(con, p, mid, first_proc, out) -> None:
    """Where another rank's recorded ops built the point from other sources (a rank that
    concatenated another layer's hidden state), ``ranks_differ`` lists each such rank's own
    answer: the first rank's alone would hide the very divergence lineage is asked about."""
    names = _source_names(out)
    rank_of = dict(con.execute("SELECT proc, rank FROM processes"))
    differ = []
    for proc in _procs(con):
        if proc == first_proc:
            continue
        found = _find(con, mid, p["call"], p["slot"], [proc])
        if found is None or found[2] is None and not names:
            continue
        other = _answer(p, found)
        if _source_names(other) != names:
            differ.append(dict(rank=rank_of.get(proc), op=other["op"], sources=other["sources"]))
    if differ:
        out["ranks_differ"] = differ


def _source_names(out) -> tuple:
    return (out["op"],) + tuple(s["point"] for s in out["sources"])


def _answer(p, found) -> dict:
    """The lineage answer from one process's records (``_find``'s)."""
    module, slot = p["module"], p["slot"]
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
        inner = enter(res, hit["at"], 0)
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
        kind, payload, via, inside = follow(res, ref)
    out["via"] = list(reversed(via))
    if inside:
        out["inside"] = inside
    if kind == "node":
        out["op"] = payload.text
        out["sources"] = sources(res, payload)
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
    res = Resolver(con, row[0], row[1])
    outs = con.execute("SELECT span, slot FROM slot_sources WHERE proc=? AND step=?", row).fetchall()
    laid = [(span, slot) for span, slot in outs if enter(res, (row[1], span, slot), 0) is not None]
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
