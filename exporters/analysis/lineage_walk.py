"""Following lineage refs back from a slot to what built it (the rules are in lineage.py's
docstring): single-input ops become ``via``, module outputs laid out inside their module are
entered (``inside``), writes into a buffer are ordered by where they land, and a combining op's
inputs become the ordered ``sources``, nested concatenations along the same dim flattened.
"""

from __future__ import annotations

from tensor_trace.exporters.analysis.lineage_records import Resolver
from tensor_trace.exporters.store.points import capture_info
from tensor_trace.format.lineage_refs import REF_NODE, REF_PARAM, REF_SLOT, REF_UNKNOWN, REF_VALUES
from tensor_trace.format.points import CAPTURE_PREFIX, parse_point

MAX_DEPTH = 64
MAX_WRITES = 4096  # writes into one buffer followed back
MAX_NEST = 4  # combining ops nested inside a source
_SIDE_BY_SIDE = ("cat", "slices")  # concatenations along a dim: flattened when nested
_LAID_OUT = ("cat", "stack", "slices")  # module outputs built so are followed inside


def _op_text(op, attrs) -> str:
    if op in ("cat", "stack", "split", "chunk", "unbind") and "dim" in attrs:
        extra = f", part {attrs['index']} of {attrs['of']}" if "index" in attrs else ""
        return f"{op}(dim={attrs['dim']}{extra})"
    if op in ("view", "reshape", "flatten", "unflatten") and "shape" in attrs:
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


def follow(res: Resolver, ref, depth=0):
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
            inner = enter(res, (ref[1], ref[2], ref[3]), depth)
            if inner is not None:
                return inner[0], inner[1], via + inner[2], inside + [leaf["point"]] + inner[3]
            return "leaf", leaf, via, inside
        if kind == REF_VALUES:
            hit = (res.at_step(ref[3]) if len(ref) > 3 else res).by_values(ref[1], ref[2])
            if hit is None:
                return "unknown", _placeholder(f"<unrecorded tensor {ref[2]}>"), via, inside
            via.append("copy (matched by values)")
            inner = enter(res, hit["at"], depth)
            if inner is not None:
                return inner[0], inner[1], via + inner[2], inside + [hit["point"]] + inner[3]
            return "leaf", hit, via, inside
        if kind == REF_PARAM:
            return "leaf", res.param(ref[1], ref[2]), via, inside
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


def enter(res, at, depth):
    """The answer inside a module output (``at`` = (step, span, slot)) that its module laid out
    from other tensors, or None where it computed it (or nothing inside was recorded)."""
    ref = res.slot_src(*at)
    if ref is None or depth >= MAX_DEPTH:
        return None
    inner = follow(res, ref, depth)
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


def sources(res, node: _Node, depth=0) -> list[dict]:
    """A combining op's inputs as sources, in order. An input that is itself laid out along
    the same dim (directly, or inside a module output) is replaced by its own sources."""
    out = []
    for ref, op_text, placeholder in node.items:
        if ref is None:
            out.append(dict(_placeholder(placeholder), op=op_text, via=[]))
            continue
        kind, payload, via, inside = follow(res, ref)
        if kind == "node":
            inner = sources(res, payload, depth + 1) if depth < MAX_NEST else []
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
    kind, payload, via, _inside = follow(res, ref)
    if kind == "leaf":
        out = dict(op="identity", points=[payload["point"]], via=list(reversed(via)))
    elif kind == "node":
        out = dict(op=payload.text, points=[s["point"] for s in sources(res, payload, MAX_NEST)],
                   via=list(reversed(via)))
    else:
        return None

    info = capture_info(res.con, module) or {}
    if info.get("what"):
        out["what"] = info["what"]  # the framework integration's words (e.g. which layer's residual)
    return out
