"""A module that applies several matrices split across ranks in one call (torchtitan 0.3.0's
GroupedExperts, held out, not written here: w1 and w3 [E, F/n, D] Shard(1), w2 [E, D, F/n]
Shard(2)): its output [T, D] was judged shard(1) from w1 alone ("split along its output
dimension"), though the ranks' outputs are partial sums of the whole [T, D]. Several split
matrices are read together: an output as wide as the input's last dim, which no split dim is,
had the split dim contracted away."""

from synthetic_trace import SyntheticTrace, arrays, check, gen, point, pos, same

R = [0, 1]


def _meta(dim, global_shape):
    return {"kind": "DTensor", "placements": [f"Shard({dim})"], "mesh_dim_names": ["tp"], "mesh_shape": [2],
            "mesh_ranks": [0, 1], "global_shape": global_shape}


def _trace(tmp_path, out_width, declared=True):
    rng = gen(31)
    x = pos(rng, 6, 8)
    tr = SyntheticTrace(2, root="run")
    for name, shape, dim, whole in (("w1", (4, 16, 8), 1, [4, 32, 8]), ("w2", (4, 8, 16), 2, [4, 8, 32]),
                                    ("w3", (4, 16, 8), 1, [4, 32, 8])):
        tr.param("experts", name, arrays({r: pos(rng, *shape) for r in R}), _meta(dim, whole) if declared else None)
    with tr.step():
        with tr.call("run", same(x, R)) as root:
            with tr.call("experts", same(x, R)) as c:
                c.returns(arrays({r: pos(rng, 6, out_width) for r in R}))
            root.returns(same(x, R))
    return point(tr.merge(tmp_path), "experts:output")


def test_an_output_as_wide_as_the_input_is_a_partial_sum(tmp_path):
    p = _trace(tmp_path, 8)
    check(p, "partial", "unknown", "sharded-weight")
    assert any("3 matrices split across ranks" in e for e in p["evidence"]), p["evidence"]


def test_an_output_as_wide_as_a_split_dim_is_a_shard(tmp_path):
    check(_trace(tmp_path, 16), "shard(1)", "no-reduction", "sharded-weight")


def test_several_matrices_split_by_values_alone_do_not_place_it_by_the_first(tmp_path):
    p = _trace(tmp_path, 8, declared=False)
    assert p["rule"] != "sharded-weight", p
