"""The store's points (``points`` and ``captures`` tables) read back: by name, by glob, with the
nearest names for one that is not there. The analysis and the queries both read points here."""

from __future__ import annotations

import difflib
import json

from tensor_trace.errors import NoAnswer
from tensor_trace.format.points import OUTPUTS_SQL, PointGlob, is_output, parse_point

_POINT_COLS = ("point, module, call, slot, placement, reduction, shapes, dtype, dtypes, steps, evidence, "
               "collective, fingerprint, semantics, rule, evidence_items, grouping")


def _point_row(row) -> dict:
    (point, module, call, slot, placement, reduction, shapes, dtype, dtypes, steps, evidence,
     collective, fingerprint, semantics, rule, items, grouping) = row
    out = dict(point=point, module=module, call=call, slot=slot, placement=placement, reduction=reduction,
               rule=rule, evidence_items=json.loads(items) if items else [],
               shapes={int(k): v for k, v in json.loads(shapes).items()}, dtype=dtype, steps=steps,
               evidence=json.loads(evidence), collective=json.loads(collective) if collective else None,
               fingerprint=json.loads(fingerprint) if fingerprint else None)
    if semantics:
        out["layer_semantics"] = json.loads(semantics)
    if dtypes:
        out["dtypes"] = {int(k): v for k, v in json.loads(dtypes).items()}
    out.update(_grouping(json.loads(grouping) if grouping else None))
    return out


def _grouping(g: dict | None) -> dict:
    """``group`` (the parallel group a point was judged across: name, size, the ranks of each
    such group) and ``data_split`` (null, or how its data is split across those groups: ``over``
    the group dimension, along ``dim``, ``rows`` per rank), where the processes declared their
    groups."""
    if not g:
        return {}
    split = g.get("data_split")
    if split and "rows" in split:
        split = dict(split, rows={int(k): v for k, v in split["rows"].items()})
    return dict(group=g.get("group"), data_split=split)


def capture_info(con, module: str) -> dict | None:
    row = con.execute("SELECT info FROM captures WHERE point=?", (module,)).fetchone()
    return json.loads(row[0]) if row else None


def all_points(con) -> list[str]:
    return [r[0] for r in con.execute("SELECT point FROM points ORDER BY sort_key")]


def nearest_names(con, name: str) -> str:
    names = all_points(con)
    modules = sorted({n.split(":")[0] for n in names})
    near = difflib.get_close_matches(name, names + modules, n=5, cutoff=0.5)
    if not near:
        near = [n for n in names if name.split(":")[0].split(".")[-1] in n][:5]
    return ", ".join(near) if near else "(no similar names)"


def match_points(con, pattern: str | None) -> list[dict]:
    """Points matching a glob (``format.points.PointGlob``); without a pattern, every output."""
    rows = con.execute(f"SELECT {_POINT_COLS} FROM points ORDER BY sort_key").fetchall()
    if not pattern:
        return [_point_row(r) for r in rows if is_output(r[3])]
    glob = PointGlob(pattern)
    return [_point_row(r) for r in rows if glob.matches(r[0], r[1], r[2], r[3])]


def find_point(con, point: str) -> list[dict]:
    """The point(s) a name designates: an exact point, ``MODULE`` (its outputs), ``MODULE#K``,
    or ``capture:NAME``; raises NoAnswer with the nearest names."""
    rows = con.execute(f"SELECT {_POINT_COLS} FROM points WHERE point=?", (point,)).fetchall()
    if not rows:
        name = parse_point(point)
        if name.slot is not None:
            q, args = f"SELECT {_POINT_COLS} FROM points WHERE module=? AND slot=?", [name.module, name.slot]
            order = " ORDER BY call"
        else:
            q, args = f"SELECT {_POINT_COLS} FROM points WHERE module=? AND {OUTPUTS_SQL}", [name.module]
            order = " ORDER BY call, sort_key"
        if name.call is not None:
            q += " AND call=?"
            args.append(name.call)
        rows = con.execute(q + order, args).fetchall()
    if not rows:
        raise NoAnswer(f"no point {point!r} in this trace; nearest: {nearest_names(con, point)}")
    return [_point_row(r) for r in rows]
