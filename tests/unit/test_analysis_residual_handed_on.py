"""With dummy weights (a held-out real SGLang Qwen3 run at tp 2, not written here) a layer's
addend is tiny, so the residual sum ``x + residual`` that an SGLang norm returns (its output.1,
declared a sum) nearly equals the embedding's all_reduce output. The next norm receives that
very tensor: a sum too, not the reduction's output."""

from synthetic_trace import SyntheticTrace, arrays, check, gen, point, pos, same

R = [0, 1]


def _embed_then_two_norms(tmp_path, seed, addend):
    """The embedding's all_reduce output ``x``, layer 0's norm returning ``x + addend(x)`` as its
    declared residual sum, layer 1's norm receiving it; the store, opened."""
    x = pos(gen(seed), 3, 4)
    tr = SyntheticTrace(2, root="run")
    for norm in ("layers.0.post_norm", "layers.1.input_norm"):
        tr.layer(norm, {"sglang_class": "RMSNorm", "residual_sum_output": "output.1"})
    summed = x + addend(x)
    with tr.step():
        with tr.call("model", same(x, R)) as outer:
            with tr.call("embed", same(x, R)) as c:
                tr.coll("all_reduce", [arrays({0: x * 0.5, 1: x * 0.5})], [same(x, R)])
                c.returns(same(x, R))
            with tr.call("layers.0.post_norm", same(x * 1e-6, R), same(x, R)) as c:
                c.returns(same(x * 2, R), same(summed, R))
            with tr.call("layers.1.input_norm", same(x * 2e-6, R), same(summed, R)) as c:
                c.returns(same(x * 3, R), same(x * 1.5, R))
            outer.returns(same(x, R))
    return tr.merge(tmp_path)


def _is_the_norms_sum(con):
    p = point(con, "layers.1.input_norm:input.1")
    check(p, "replicate", "no-reduction", "equal-values")
    assert any("the values of layers.0.post_norm:output.1" in t for t in p["evidence"]), p["evidence"]


def test_the_residual_sum_a_norm_returns_is_a_sum_where_the_next_norm_receives_it(tmp_path):
    con = _embed_then_two_norms(tmp_path, 53, lambda x: x * 1e-6)  # a dummy-weight layer's addend
    check(point(con, "layers.0.post_norm:output.1"), "replicate", "no-reduction", "equal-values")
    _is_the_norms_sum(con)


def test_a_residual_sum_whose_addend_vanishes_in_the_fingerprint_is_still_a_sum(tmp_path):
    """A held-out real SGLang DeepSeek-V2 run with dummy weights (not written here): the
    attention's addend (1e-8 relative) vanishes in the fingerprint, so the norm's x + residual
    has the embedding output's very fingerprint. The next norm's residual input was taken for
    the embedding's all_reduce output carried on (post-reduction); what handed it on is the
    latest module output of those values, the norm's declared sum."""
    _is_the_norms_sum(_embed_then_two_norms(tmp_path, 54, lambda x: x * 0.0))
