"""The multi-tensor fingerprint kernel on a real GPU: eager values equal torch's, and a captured
kernel whose table is filled after the capture gives fresh values at every replay."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU; tests/unit/test_multi_tensor.py runs the "
                                       "kernel under Triton's interpreter on a CPU")


def _expect(ts):
    return [(t.double().sum().item(), t.double().pow(2).sum().item()) for t in ts]


def _check(values, ts):
    for (s, l2), (es, eq), t in zip(values.tolist(), _expect(ts), ts):
        assert abs(s - es) <= 1e-5 * (eq * max(t.numel(), 1)) ** 0.5 + 1e-6, (t.shape, s, es)
        assert abs(l2 * l2 - eq) <= 1e-5 * max(eq, 1e-6), (t.shape, l2 * l2, eq)


def test_eager_values():
    from tensor_trace.tracer import multi_tensor

    dev = torch.device("cuda")
    assert multi_tensor.usable(torch.ones(1, device=dev))
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ts = [torch.randn(s, device=dev).to(dtype) for s in ((8, 4096), (64, 14336), (48,), (1 << 20,))]
        ts.append(torch.empty(0, device=dev, dtype=dtype))
        order, values, fill = multi_tensor.sum_l2(ts)
        assert fill is None
        _check(values, [ts[i] for i in order])


def test_row_strided_views_read_in_place():
    """q, k and v split from one projection: rows of contiguous elements at a stride; the kernel
    reads them where they are (no stacked copy), eagerly and under a capture."""
    from tensor_trace.tracer import multi_tensor

    dev = torch.device("cuda")
    multi_tensor.warm_up(dev)
    torch.manual_seed(1)
    qkv = torch.randn(64, 1, 6144, device=dev, dtype=torch.bfloat16)
    ts = list(qkv.split([4096, 1024, 1024], dim=-1))
    layouts = [multi_tensor.row_layout(t) for t in ts]
    assert layouts == [(4096, 6144), (1024, 6144), (1024, 6144)]
    order, values, _ = multi_tensor.sum_l2(ts, layouts=layouts)
    _check(values, [ts[i] for i in order])
    wide = [torch.randn(3, 200000, device=dev)[:, 7:150007]]  # one dtype per launch
    assert multi_tensor.row_layout(wide[0]) == (150000, 200000)
    order2, values2, _ = multi_tensor.sum_l2(wide, layouts=[(150000, 200000)])
    _check(values2, wide)
    g = torch.cuda.CUDAGraph()
    multi_tensor.begin_capture(dev)
    with torch.cuda.graph(g):
        order, values, fill = multi_tensor.sum_l2(ts, capturing=True, layouts=layouts)
    multi_tensor.end_capture()
    fill.run()
    fill.before_replay()
    for _ in range(2):
        qkv.normal_()
        g.replay()
        torch.cuda.synchronize()
        _check(values, [ts[i] for i in order])


def test_captured_kernel_reads_each_replays_values():
    """Intermediates freed during the capture leave graph-pool memory that later kernels of the
    same graph rewrite at each replay: the tables live in an arena outside that pool (a table
    placed there was overwritten on the H200: an illegal address at the first replay)."""
    from tensor_trace.tracer import multi_tensor

    dev = torch.device("cuda")
    multi_tensor.warm_up(dev)
    static_in = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    multi_tensor.begin_capture(dev)
    with torch.cuda.graph(g):
        a = static_in * 2
        for _ in range(3):
            tmp = torch.relu(a) + 1  # freed: its memory goes back to the graph's pool
            del tmp
        b = torch.relu(static_in)
        order, values, fill = multi_tensor.sum_l2([a, b, static_in], capturing=True)
        scratch = torch.empty(1 << 20, device=dev)  # may reuse freed memory, rewritten at replay
        scratch.fill_(3.0)
    multi_tensor.end_capture()
    assert fill is not None
    fill.run()
    fill.before_replay()
    for seed in range(3):
        torch.manual_seed(seed)
        static_in.copy_(torch.randn(64, 4096, device=dev))
        g.replay()
        torch.cuda.synchronize()
        _check(values, [[a, b, static_in][i] for i in order])


def test_deferred_step_fingerprints_equal_immediate_ones():
    """A step's deferred CUDA tensors (contiguous, row-strided splits, large ones, a mid-step
    flush) through the one-launch table, against immediate torch reductions of the same tensors."""
    import math

    from tensor_trace.format.fingerprints import fingerprint_pairs
    from tensor_trace.tracer.fingerprint import StepFingerprints

    dev = torch.device("cuda")
    torch.manual_seed(1)
    qkv = torch.randn(64, 1, 6144, device=dev, dtype=torch.bfloat16)
    q, k, v = qkv.split([4096, 1024, 1024], dim=-1)
    ts = [torch.randn(64, 1, 4096, device=dev, dtype=torch.bfloat16), qkv, q, k, v,
          torch.randn(64, 28672, device=dev, dtype=torch.bfloat16),  # above 1 Mi elements
          torch.randn(8, 4096, device=dev), torch.randn(3, 5, device=dev, dtype=torch.float16),
          torch.randn(16, 16, device=dev).t(),  # columns strided: stacked
          torch.arange(12, device=dev)]  # integers: immediate
    got = {}
    for mode in ("immediate", "deferred", "deferred-mid-step"):
        fps = StepFingerprints(defer_cuda=mode != "immediate")
        if mode == "deferred-mid-step":
            fps.defer_bytes = 1 << 20
        refs = []
        for t in ts:
            # the tensor as a module's output, then as the next module's input (a repeat: the
            # same index when deferred, a copied value when reduced at once)
            refs.append((fps.add_one(t), fps.add_one(t, False)))
        fps.finish_step(0)
        out = {}
        for _, _, first, data, indices in fps.collect(wait=True):
            out.update({i: (s, q) for i, s, q in fingerprint_pairs(first, data, indices)})
        got[mode] = [(out[a], out[b]) for a, b in refs]  # KeyError: a value missing
        if mode == "deferred":  # (a mid-step flush ends the run of repeats: a new index)
            # deferred: a repeat is the same index (integers are reduced at once: a copy)
            assert all(a == b for (a, b), t in zip(refs, ts) if t.is_floating_point())
    for mode in ("deferred", "deferred-mid-step"):
        for j, ((first, repeat), pair) in enumerate(zip(got["immediate"], got[mode])):
            assert first == repeat  # immediate: the repeat is a copy of the value
            # (after a mid-step flush the repeat is a second reduction: equal within rounding,
            # the kernel's chunks of one tensor being summed in no fixed order)
            s, q2 = first
            for s2, q3 in pair:
                assert math.isclose(s, s2, rel_tol=1e-3, abs_tol=1e-2) and math.isclose(q2, q3, rel_tol=1e-4), \
                    (mode, j, s, s2, q2, q3)
