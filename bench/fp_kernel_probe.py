"""The multi-tensor fingerprint kernel's throughput and its tile sizes, on a GPU.

    python bench/fp_kernel_probe.py

385 bf16 tensors shaped like a Llama-8B decode step's activations at batch 64 (392 MiB). Prints
the library's ``multi_tensor.sum_l2`` (zeroing, launches by size class, square root), one
``torch.sum`` over the same number of bytes (the bandwidth yardstick), then the bare kernel with
several (CHUNK, BLOCK, warps) choices, with and without alignment hints on the addresses; every
variant is checked against torch's values.
"""
import torch
import triton
import triton.language as tl

from tensor_trace.tracer import multi_tensor


@triton.jit(do_not_specialize=["first"])
def k_probe(table, out, first, CHUNK: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
            HINT: tl.constexpr):
    t = first + tl.program_id(0)
    n = tl.load(table + 2 * t + 1)
    start = tl.program_id(1).to(tl.int64) * CHUNK
    if start < n:
        addr = tl.load(table + 2 * t)
        if HINT:
            n = tl.multiple_of(n, 16)
            addr = tl.multiple_of(addr, 16)
        base = addr.to(tl.pointer_type(DTYPE))
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            if HINT:
                offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
            x = tl.load(base + offs, mask=offs < n, other=0.0).to(tl.float32)
            acc += x
            acc2 += x * x
        tl.atomic_add(out + 2 * t, tl.sum(acc, axis=0))
        tl.atomic_add(out + 2 * t + 1, tl.sum(acc2, axis=0))


def timeit(fn, n=20):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1000


def main():
    dev = torch.device("cuda")
    multi_tensor.warm_up(dev)
    shapes = ([(64, 4096)] * 8 * 32 + [(64, 28672)] * 32 + [(64, 14336)] * 64 + [(64, 6144)] * 32
              + [(64, 128256)])
    ts = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in shapes]
    nbytes = sum(t.numel() * 2 for t in ts)
    k = timeit(lambda: multi_tensor.sum_l2(ts))
    big = torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16)
    r = timeit(lambda: big.sum(dtype=torch.float32))
    print(f"library sum_l2 (CHUNK {multi_tensor.CHUNK}, BLOCK {multi_tensor.BLOCK}, "
          f"{multi_tensor.NUM_WARPS} warps), {len(ts)} tensors, {nbytes / 2**20:.0f} MiB: {k:.0f} us "
          f"({nbytes / k / 1e3:.0f} GB/s); torch.sum over the same bytes {r:.0f} us")
    table = torch.tensor([v for t in ts for v in (t.data_ptr(), t.numel())], dtype=torch.int64, device=dev)
    ref = torch.tensor([[t.float().sum().item(), t.float().pow(2).sum().item()] for t in ts], device=dev)
    for hint in (0, 1):
        for chunk, block, warps in ((32768, 2048, 4), (32768, 4096, 8), (16384, 2048, 4),
                                    (65536, 4096, 8), (131072, 8192, 16)):
            out = torch.zeros(len(ts), 2, device=dev)
            grid = (len(ts), max(-(-t.numel() // chunk) for t in ts))

            def f():
                out.zero_()
                k_probe[grid](table, out, 0, CHUNK=chunk, BLOCK=block, DTYPE=tl.bfloat16, HINT=hint,
                              num_warps=warps)

            us = timeit(f)
            ok = torch.allclose(out, ref, rtol=1e-3, atol=1e-1)
            print(f"hint={hint} chunk={chunk} block={block} warps={warps}: {us:.0f} us "
                  f"({nbytes / us / 1e3:.0f} GB/s) ok={ok}")


if __name__ == "__main__":
    main()
