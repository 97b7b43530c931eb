"""The multi-tensor fingerprint kernel as a CUDA graph replays it, against its alternatives.

    python bench/fp_kernel_probe.py [--batches 8 64]        # needs a GPU

Tensors shaped like a Llama-8B decode step's module outputs at each batch (per layer eight
[B, 4096], one [B, 6144] with its q/k/v row-strided split views, one [B, 28672], two [B, 14336];
the [B, 128256] logits once). Each variant is captured into a CUDA graph ten times over and
replayed; the time per fingerprint pass (device time from events) is printed with the bytes read
per microsecond:

- ``torch.sum``: one reduction over as many bytes, the bandwidth yardstick;
- ``size-classes``: the kernel before (one program per (tensor, 64 Ki chunk), one launch per
  class of similar size, contiguous tensors only: the views are stacked copies there);
- ``library``: ``multi_tensor.sum_l2(capturing=True)`` as the tracer calls it (chunk table);
- ``chunks c=.. b=.. w=..``: the chunk kernel with other chunk and block sizes and warps.

Every variant's values are checked against torch's.
"""
import argparse

import torch
import triton
import triton.language as tl

from tensor_trace.tracer import multi_tensor

from gpu_timing import replays_device_us  # bench/ is this script's folder, first on sys.path


@triton.jit(do_not_specialize=["first"])
def k_classes(table, out, first, CHUNK: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    t = first + tl.program_id(0)
    n = tl.load(table + 2 * t + 1)
    start = tl.program_id(1).to(tl.int64) * CHUNK
    if start < n:
        base = tl.load(table + 2 * t).to(tl.pointer_type(DTYPE))
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < n, other=0.0).to(tl.float32)
            acc += x
            acc2 += x * x
        tl.atomic_add(out + 2 * t, tl.sum(acc, axis=0))
        tl.atomic_add(out + 2 * t + 1, tl.sum(acc2, axis=0))


def step_tensors(batch, dev):
    ts = []
    for _ in range(32):
        ts += [torch.randn(batch, 4096, device=dev, dtype=torch.bfloat16) for _ in range(8)]
        qkv = torch.randn(batch, 6144, device=dev, dtype=torch.bfloat16)
        ts += [qkv, *qkv.split([4096, 1024, 1024], dim=-1)]
        ts.append(torch.randn(batch, 28672, device=dev, dtype=torch.bfloat16))
        ts += [torch.randn(batch, 14336, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    ts.append(torch.randn(batch, 128256, device=dev, dtype=torch.bfloat16))
    return ts


def graph_time(body, reps=10, replays=20):
    """Device µs per call of ``body`` captured ``reps`` times into one graph."""
    body()  # warm (compile outside the capture)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            body()
    g.replay()
    torch.cuda.synchronize()
    return replays_device_us(g, replays) / reps, g


def chunk_table(ts, chunk):
    layouts = [None if t.is_contiguous() else multi_tensor.row_layout(t) for t in ts]
    saved = multi_tensor.CAPTURE_CHUNK
    multi_tensor.CAPTURE_CHUNK = chunk
    try:
        values = multi_tensor.capture_chunks(ts, layouts, 1 << 30)
    finally:
        multi_tensor.CAPTURE_CHUNK = saved
    return torch.tensor(values, dtype=torch.int64, device=ts[0].device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    args = ap.parse_args()
    dev = torch.device("cuda")
    assert multi_tensor.warm_up(dev)
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    for batch in args.batches:
        ts = step_tensors(batch, dev)
        nbytes = sum(t.numel() * 2 for t in ts)
        ref = torch.tensor([[t.double().sum().item(), t.double().pow(2).sum().item()] for t in ts])
        tol = lambda got: bool(((got[:, 0] - ref[:, 0]).abs() <= 1e-3 * ref[:, 1].sqrt() * 10 + 1e-2).all()
                               and ((got[:, 1] - ref[:, 1]).abs() <= 2e-3 * ref[:, 1]).all())
        print(f"== batch {batch}: {len(ts)} tensors, {nbytes / 2**20:.1f} MiB")
        rows = []

        def library():
            # the library's capture path, as the tracer calls it: one call in one capture
            layouts = [None if t.is_contiguous() else multi_tensor.row_layout(t) for t in ts]
            multi_tensor.begin_capture(dev)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                _, vals, fill = multi_tensor.sum_l2(ts, capturing=True, layouts=layouts)
            multi_tensor.end_capture()
            fill.run()
            fill.before_replay()
            g.replay()
            torch.cuda.synchronize()
            us = replays_device_us(g, 50)
            got = vals.cpu().clone()
            got[:, 1] = got[:, 1] ** 2
            rows.append((f"library sum_l2(capturing) (chunk {multi_tensor.CAPTURE_CHUNK}, block "
                         f"{multi_tensor.BLOCK}, {multi_tensor.NUM_WARPS} warps, {fill.table.numel() // 4} "
                         f"programs; one per graph)", us, tol(got)))


        try:  # first, before any other capture of this process
            library()
        except Exception as exc:
            import traceback
            traceback.print_exc()
            rows.append((f"library sum_l2(capturing) FAILED: {exc!r:.200}", float("nan"), False))

        big = torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16)
        us, _ = graph_time(lambda: big.sum(dtype=torch.float32))
        rows.append(("torch.sum over the same bytes", us, True))

        # the kernel before: size classes over contiguous tensors, views stacked
        contig = [t for t in ts if t.is_contiguous()]
        view_groups = {}
        for t in ts:
            if not t.is_contiguous():
                view_groups.setdefault(t.shape, []).append(t)
        view_groups = list(view_groups.values())
        classes = {}
        for i, t in enumerate(contig):
            c = -(-t.numel() // 65536)
            classes.setdefault(c.bit_length(), []).append(i)
        order = [i for m in classes.values() for i in m]
        table = torch.tensor([v for i in order for v in (contig[i].data_ptr(), contig[i].numel())],
                             dtype=torch.int64, device=dev)
        launches, pos = [], 0
        for m in classes.values():
            launches.append((pos, len(m), max(-(-contig[i].numel() // 65536) for i in m)))
            pos += len(m)
        out_old = torch.zeros(len(contig), 2, device=dev)

        def old():
            out_old.zero_()
            for first, count, chunks in launches:
                k_classes[(count, chunks)](table, out_old, first, CHUNK=65536, BLOCK=4096,
                                           DTYPE=tl.bfloat16, num_warps=8)
            out_old[:, 1].sqrt_()
            for group in view_groups:  # views stacked by shape, as that path did
                flat = torch.stack(group).view(len(group), -1)
                torch.sum(flat, dim=1, dtype=torch.float32)
                torch.linalg.vector_norm(flat, dim=1, dtype=torch.float32)

        us, _ = graph_time(old)
        got = torch.empty(len(contig), 2)
        got[order] = out_old.cpu()
        got[:, 1] = got[:, 1] ** 2
        cref = ref[[i for i, t in enumerate(ts) if t.is_contiguous()]]
        ok = bool(((got[:, 1] - cref[:, 1]).abs() <= 2e-3 * cref[:, 1]).all())
        rows.append((f"size-classes ({len(launches)} launches) + stacked views", us, ok))

        # (a ``range`` loop instead of ``while`` measured 146.3 against 147.0 us at batch 64 on
        # 2026-11-29 21:37 UTC, with this probe as of commit 3adbcc5: the same; ``while`` stays,
        # since Triton's interpreter in CI cannot take a loaded bound in ``range``)
        kern = multi_tensor._state["chunks"]
        for chunk, block, warps in ((32768, 4096, 8), (65536, 4096, 8), (131072, 4096, 8),
                                    (65536, 2048, 4), (65536, 8192, 8), (65536, 4096, 4),
                                    (131072, 8192, 16), (262144, 8192, 8)):
            tab = chunk_table(ts, chunk)
            out = torch.zeros(len(ts), 2, device=dev)

            def body():
                out.zero_()
                kern[(tab.numel() // 4,)](tab, out, BLOCK=block, DTYPE=tl.bfloat16, num_warps=warps)

            us, _ = graph_time(body)
            rows.append((f"chunks c={chunk} b={block} w={warps} ({tab.numel() // 4} programs)",
                         us, tol(out.cpu())))
        for name, us, ok in rows:
            print(f"  {us:8.1f} us  {nbytes / us / 1e3:6.0f} GB/s  ok={ok}  {name}")


if __name__ == "__main__":
    main()
