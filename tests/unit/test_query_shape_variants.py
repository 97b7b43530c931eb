"""`query shapes` of a point whose shape changes from step to step (a prefill step's [1, 6] then
decode steps' [1, 1], gpt-fast held out, not written here): `shapes` is one step's, and said
alone it read as the shape of all 5 steps; `variants` gives each local shape with its steps."""

import json

from click.testing import CliRunner

from synthetic_trace import SyntheticTrace, gen, pos, same
from tensor_trace.cli import main as cli_main

R = [0, 1]


def _trace(tmp_path, lengths):
    rng = gen(3)
    tr = SyntheticTrace(2, root="run")
    for n in lengths:
        with tr.step():
            x = pos(rng, 1, n, 4)
            with tr.call("run", same(x, R)) as root:
                with tr.call("proj", same(x, R)) as c:
                    c.returns(same(x * 2, R))
                root.returns(same(x * 2, R))
    tr.merge(tmp_path)
    return tmp_path


def _shapes(trace, point, *opts):
    r = CliRunner().invoke(cli_main, ["query", "shapes", point, "--trace", str(trace), *opts])
    assert r.exit_code == 0, r.output
    return r.output


def test_a_shape_that_changes_between_steps_is_given_with_its_steps(tmp_path):
    trace = _trace(tmp_path, [6, 1, 1, 1, 1])
    (row,) = json.loads(_shapes(trace, "proj:input.0", "--json"))
    assert row["steps"] == 5
    assert row["variants"] == [dict(shape=[1, 6, 4], steps=1, first_step=0),
                               dict(shape=[1, 1, 4], steps=4, first_step=1)]
    text = _shapes(trace, "proj:*")
    assert "[1, 6, 4] in 1 step (from step 0); [1, 1, 4] in 4 steps (from step 1)" in text, text


def test_a_shape_the_same_in_every_step_has_no_variants(tmp_path):
    (row,) = json.loads(_shapes(_trace(tmp_path, [3, 3, 3]), "proj:output", "--json"))
    assert row["shapes"] == {"0": [1, 3, 4], "1": [1, 3, 4]} and "variants" not in row


def test_a_slot_passed_in_some_steps_counts_those_steps(tmp_path):
    """A causal mask passed in prefill and None in decode steps (Meta's reference Llama, held
    out): its steps were those of its module's calls (4), not the one step that held it."""
    rng = gen(4)
    tr = SyntheticTrace(2, root="run")
    for n in (6, 1, 1, 1):
        with tr.step():
            x = pos(rng, 1, n, 4)
            ins = [same(x, R)] + ([same(pos(rng, n, n), R)] if n > 1 else [])
            with tr.call("run", same(x, R)) as root:
                with tr.call("layer", *ins) as c:
                    c.returns(same(x * 2, R))
                root.returns(same(x * 2, R))
    tr.merge(tmp_path)
    (mask,) = json.loads(_shapes(tmp_path, "layer:input.1", "--json"))
    (hidden,) = json.loads(_shapes(tmp_path, "layer:input.0", "--json"))
    assert (mask["steps"], hidden["steps"]) == (1, 4)
