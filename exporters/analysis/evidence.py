"""Evidence as structured items, rendered to text only at the edge.

An item is ``{kind, text, refs}``: ``kind`` says what was observed (``rule``, ``shape``,
``values``, ``collective``, ``concat``, ``weights``, ``dataflow``, ``declared``, ``semantics``,
``missing``, ``sampling``, ``capture``, ``group``: the parallel group a point was judged
across and how its data is split across such groups), ``text`` is the sentence a person reads, ``refs`` names
what it points at (points, collectives, parameters). Queries choose items by kind, never by the
wording of their text.
"""

from __future__ import annotations

# Kinds that say why a verdict is what it is, strongest first: the one-line summary of a point
# shows the first of these it has.
DECISIVE = ("collective", "concat", "weights", "dataflow", "declared", "semantics", "capture", "missing", "group")


# the kind of the item that says a shard was placed by a local no-op reshape's -1 alone, which
# verdicts.vote counts only where no step's shapes placed the point
READ_FROM_ASKED = "read-from-asked"
# the kind of the item that says a one-row tensor is a scaled copy of a sum-reduction's output,
# which a norm of that row would also be: verdicts.vote lets steps of more rows decide
ONE_ROW_SCALE = "one-row-scale"
# ... and the kind of the item that says the sums of squares fit a scaled copy of one, but the
# sums are too near zero to confirm it (verdicts.vote treats both alike)
UNCONFIRMED_SCALE = "unconfirmed-scale"


def item(kind: str, text: str, **refs) -> dict:
    return dict(kind=kind, text=text, refs={k: v for k, v in refs.items() if v is not None})


def texts(items: list) -> list:
    return [i["text"] for i in items]


def key_item(items: list) -> dict | None:
    """The item a one-line summary shows: the decisive observation, else the rule."""
    for kind in DECISIVE:
        for i in items:
            if i["kind"] == kind:
                return i
    values = [i for i in items if i["kind"] == "values"]
    if values:
        return values[-1]
    return next((i for i in items if i["kind"] == "rule"), items[0] if items else None)


class Verdict:
    """A point's placement and reduction in one step, the rule that decided them and the
    evidence it saw."""

    __slots__ = ("placement", "reduction", "rule", "items", "collective", "block")

    def __init__(self, placement, reduction, rule, items, collective=None, block=None):
        self.placement, self.reduction, self.rule = placement, reduction, rule
        self.items, self.collective = items, collective
        # a shard that is an interleaved slice of its dim: dataflow.reshape_shard's block,
        # which the ops built from it need (None: a contiguous slice, or not a shard)
        self.block = block

    def as_dict(self) -> dict:
        return dict(placement=self.placement, reduction=self.reduction, rule=self.rule,
                    items=self.items, collective=self.collective)


def decide(pt, placement, reduction, rule, collective=None, *extra) -> Verdict:
    """The verdict of ``rule`` on point ``pt``: what was observed of it so far (``pt.items``),
    the rule, then ``extra`` items."""
    return Verdict(placement, reduction, rule, pt.items + [item("rule", f"rule: {rule}")] + list(extra),
                   collective)


def coll_item(c, text) -> dict:
    """An item about collective ``c`` (referenced by its group, sequence number and op)."""
    return item("collective", text, collective=dict(group=c.group_name, seq=c.seq, op=c.op))
