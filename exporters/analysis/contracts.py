"""Capture contracts: a saved lineage answer (``contract save``) and how a trace departs from it.

``compare`` lists another source at a position, a missing or extra source, another order, or a
change of shape, dtype or placement of the point or of a source. ``contract check`` and
``query diff`` both use it.
"""

from __future__ import annotations

import json

from tensor_trace.errors import BadInput

CONTRACT_FORMAT = 1

def make_contract(lin: dict) -> dict:
    """A lineage answer as a contract: what a check expects of another trace."""
    return dict(
        tensor_trace_contract=CONTRACT_FORMAT, point=lin["point"], op=lin["op"],
        shapes=lin["shapes"], dtype=lin["dtype"], placement=lin["placement"],
        **({"inside": lin["inside"]} if lin.get("inside") else {}),
        sources=[dict(position=i, point=s["point"], module=s.get("module"),
                      role=f"input {i} of {s['op']}", op=s["op"], via=s.get("via", []),
                      shapes=s["shapes"], dtype=s.get("dtype"), placement=s["placement"],
                      **({"inside": s["inside"]} if s.get("inside") else {}),
                      **({"captured": s["captured"]} if s.get("captured") else {}))
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
        out += _captured(p, es.get("captured"), as_.get("captured"))
    out += _captures_moved(expected["sources"], actual["sources"])
    out += _fields(name, expected, actual)
    return out


def _captured_text(c) -> str:
    pts = c.get("points") or []
    text = pts[0] if c.get("op") == "identity" and len(pts) == 1 else f"{c.get('op')} of [{', '.join(pts)}]"
    return f"{text}: the {c['what']}" if c.get("what") else text


def _captured(p, e, a) -> list:
    """A named capture point that captured something else than in the contract (its name, a
    capture's running number, stays the same when the layers it is handed change)."""
    if not e or not a or e.get("points") == a.get("points"):
        return []
    return [dict(kind="captured", source=p, expected=e.get("points"), actual=a.get("points"),
                 message=f"source {p} captured {_captured_text(a)}, contract: {_captured_text(e)}")]


def _captures_moved(exp_sources, act_sources) -> list:
    """Over all sources that are captures: the tensors the contract's captures were made of
    that no capture of the trace has (a layer no longer captured), and the reverse."""
    def made_of(sources):
        out = {}
        for s in sources:
            c = s.get("captured") or {}
            for q in c.get("points") or []:
                out.setdefault(q, (s["point"], f" ({c['what']})" if c.get("what") else ""))
        return out

    exp, act = made_of(exp_sources), made_of(act_sources)
    if not exp or not act:
        return []
    out = []
    for q, (src, what) in exp.items():
        if q not in act:
            out.append(dict(kind="capture_missing", point=q, source=src,
                            message=f"{q}{what} is captured by no source (the contract captures it at {src})"))
    for q, (src, what) in act.items():
        if q not in exp:
            out.append(dict(kind="capture_extra", point=q, source=src,
                            message=f"{q}{what} is captured at {src}; the contract captures no such tensor"))
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
