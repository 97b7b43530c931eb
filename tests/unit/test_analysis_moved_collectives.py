"""torchtitan's default backend (spmd_types, plain tensors and c10d collectives; from a held-out
real torchtitan 0.3.0 Llama3 at tp 2 with sequence parallel, not written here) moves a
sequence-parallel tensor's dims around the collectives, which always work along dim 0:
reduce_scatter of ``x.movedim(1, 0)`` then ``.movedim(0, 1)`` back; all_gather along dim 0 of
``[b, s / n, h]``, then its chunks concatenated along dim 1. The shard is the sequence dim (1) of
the module boundaries, not dim 2 (the reduce_scatter's dim was "not seen") nor the gather
buffer's dim 0."""

import numpy as np

from synthetic_trace import SyntheticTrace, arrays, check, fingerprint, fps, gen, point, pos, same

R = [0, 1]


def test_a_reduce_scatter_output_with_its_dims_moved_back_is_a_shard_of_the_sequence(tmp_path):
    rng = gen(5)
    x = pos(rng, 2, 8, 5)  # [b, s, in / n] on each rank: row-parallel input
    parts = {r: pos(rng, 2, 8, 6) for r in R}  # [b, s, h] partial sums
    total = parts[0] + parts[1]
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("wo", arrays({r: x + r for r in R})) as c:
            moved = {r: np.ascontiguousarray(np.moveaxis(parts[r], 1, 0)) for r in R}  # [s, b, h]
            mine = {r: np.moveaxis(total, 1, 0)[4 * r:4 * (r + 1)] for r in R}  # [s / n, b, h]
            tr.coll("reduce_scatter_tensor", [arrays(moved)], [arrays(mine)])
            c.returns(arrays({r: np.moveaxis(mine[r], 0, 1) for r in R}))  # [b, s / n, h]
    p = point(tr.merge(tmp_path), "wo:output")
    check(p, "shard(1)", "post-reduction", "reduce-scatter-output")
    assert any("its dims moved" in e for e in p["evidence"]), p["evidence"]


def test_an_all_gather_input_is_sharded_as_the_whole_the_program_makes_of_it(tmp_path):
    rng = gen(6)
    whole = pos(rng, 2, 8, 4)  # [b, s, h]
    mine = {r: whole[:, 4 * r:4 * (r + 1)] for r in R}
    # the gather's own output, along dim 0, its sum a rounding below the whole's (summed in
    # another order): found first among the tensors of that sum
    s, q = fingerprint(whole)
    buffer = fps((4, 4, 4), {r: (s - 1e-6 * s, q) for r in R})
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("norm", arrays(mine)) as c:
            c.returns(arrays(mine))
        with tr.call("ffn", arrays(mine)) as c:
            tr.coll("all_gather_into_tensor", [arrays(mine)], [buffer])
            with tr.call("ffn.w1", same(whole, R)) as w1:
                w1.returns(same(whole[..., :2], R))
            c.returns(same(whole[..., :2], R))
    con = tr.merge(tmp_path)
    for name in ("norm:output", "ffn:input.0"):
        p = point(con, name)
        assert p["placement"] == "shard(1)", p["evidence"]
