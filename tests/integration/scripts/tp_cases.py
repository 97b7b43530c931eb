"""Tensor-parallel patterns nobody described to tensor-trace, for placement tests.

Run under torchrun (gloo). Each module below produces one kind of tensor; the test checks the
verdict of its output point.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import clean_exit


def world():
    return dist.get_world_size(), dist.get_rank()


class Replicated(nn.Module):
    """Same weights on every rank: output replicate, no reduction before it."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w = nn.Parameter(torch.randn(16, 16, generator=g))

    def forward(self, x):
        return x @ self.w


class ScaledPartial(nn.Module):
    """Each rank's contribution divided by tp, then summed: a partial sum behind a scaling."""

    def forward(self, x):
        tp, rank = world()
        return x * (rank + 1.0)


class Averaged(nn.Module):
    def forward(self, partial):
        tp, _ = world()
        y = partial.clone() / tp  # a clone and a scaling between the partial and the reduction
        dist.all_reduce(y)
        return y


class RowShard(nn.Module):
    """Sequence-parallel style: reduce_scatter along dim 0 gives each rank a reduced slice."""

    def forward(self, x):
        tp, rank = world()
        out = torch.empty(x.shape[0] // tp, *x.shape[1:])
        dist.reduce_scatter_tensor(out, x.contiguous())
        return out


class Gather0(nn.Module):
    def forward(self, shard):
        tp, _ = world()
        out = torch.empty(shard.shape[0] * tp, *shard.shape[1:])
        dist.all_gather_into_tensor(out, shard.contiguous())
        return out


class GatherByAllReduce(nn.Module):
    """A gather done as a sum (SGLang's DP attention, `_dp_gather_via_all_reduce`): each rank
    writes its own rows into a zero buffer of the whole size, then all_reduce. Uneven: rank r
    holds r + 1 rows."""

    def forward(self, x):
        tp, rank = world()
        sizes = [r + 1 for r in range(tp)]
        buf = torch.zeros(sum(sizes), x.shape[1])
        start = sum(sizes[:rank])
        buf[start:start + sizes[rank]] = x[:sizes[rank]] * (rank + 1.0)
        dist.all_reduce(buf)
        return buf


class Noisy(nn.Module):
    """A bug: rank-dependent noise after everything agreed. The ranks diverge."""

    def forward(self, x):
        _, rank = world()
        g = torch.Generator().manual_seed(100 + rank)
        return x + 0.01 * torch.randn(x.shape, generator=g)


class RowParallelLinear(nn.Module):
    """Claims to be SGLang's RowParallelLinear with reduce_results=True, but returns its partial
    sum unreduced (the caller reduces it): the layer semantics must be reported as disagreeing
    with the evidence, not trusted."""

    reduce_results = True
    input_is_parallel = True

    def forward(self, x):
        _, rank = world()
        return x * (rank + 1.0)


RowParallelLinear.__module__ = "sglang.srt.layers.linear"

HEAD_DIM = 4


class ColumnSlice(nn.Module):
    """A column-parallel projection: rank r computes output features [r*4, r*4+4) of tp*4, one
    key/value head per rank (GQA with as many KV heads as ranks: Llama-70B's 8 at TP=8); with
    ``heads``, that many heads per rank."""

    def __init__(self, heads=1, seed=7):
        super().__init__()
        tp, rank = world()
        g = torch.Generator().manual_seed(seed)
        width = heads * HEAD_DIM
        full = torch.randn(tp * width, 16, generator=g)
        self.w = nn.Parameter(full[rank * width:(rank + 1) * width].clone())

    def forward(self, x):
        return x @ self.w.t()


class HeadNorm(nn.Module):
    """A per-head norm (Qwen3's k_norm) of the heads split out of the projection by a view."""

    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


class OneHeadPerRank(nn.Module):
    def __init__(self):
        super().__init__()
        self.k_proj = ColumnSlice()
        self.k_norm = HeadNorm()

    def forward(self, x):
        k = self.k_proj(x)  # [tokens, HEAD_DIM] locally, [tokens, tp*HEAD_DIM] whole
        return self.k_norm(k.view(*k.shape[:-1], -1, HEAD_DIM))  # [tokens, 1, HEAD_DIM]: the head dim is split


class Rope(nn.Module):
    """Where the normed heads go next, viewed back to [tokens, heads * head_dim]."""

    def forward(self, q, k):
        return q * 2, k * 2


class FlatHeadNorms(nn.Module):
    """SGLang's per-head q and k norms (Qwen3's apply_qk_norm): the heads of each rank's column
    shard viewed as rows, ``reshape(-1, head_dim)``, normed, and viewed back. Two q heads per
    rank; one KV head per rank, whose reshape leaves the local shape as it was."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = ColumnSlice(heads=2, seed=11), ColumnSlice()
        self.q_norm, self.k_norm = HeadNorm(), HeadNorm()
        self.rope = Rope()

    def forward(self, x):
        q, k = self.q_proj(x), self.k_proj(x)
        qn = self.q_norm(q.reshape(-1, HEAD_DIM))  # [tokens * 2, HEAD_DIM]: rows of every token
        kn = self.k_norm(k.reshape(-1, HEAD_DIM))  # [tokens, HEAD_DIM] here, [tokens * tp, ...] whole
        return self.rope(qn.view(q.shape), kn.view(k.shape))


class Attend(nn.Module):
    """Stands for the attention: takes the normed q and k heads, returns q's shape; with
    ``flat_for_one``, [1, heads * head_dim] for one token (SGLang's torch_native decode)."""

    def __init__(self, flat_for_one=False):
        super().__init__()
        self.flat_for_one = flat_for_one

    def forward(self, q, k):
        out = q + k.mean(dim=1, keepdim=True)
        return out.flatten(1) if self.flat_for_one and out.shape[0] == 1 else out


class Out(nn.Module):
    def forward(self, x):
        return x * 1.0


class UnflattenedHeadNorms(nn.Module):
    """Gemma3's attention in SGLang: ``q.unflatten(-1, (heads, head_dim))`` of the column shard
    (two heads per rank; k one), per-head norms of the 3-D tensors, the attention's output
    reshaped back to ``(-1, heads * head_dim)``. Run on 8 tokens and on one (a decode step)."""

    def __init__(self, flat_for_one=False):
        super().__init__()
        self.q_proj, self.k_proj = ColumnSlice(heads=2, seed=13), ColumnSlice(seed=17)
        self.q_norm, self.k_norm = HeadNorm(), HeadNorm()
        self.attn, self.o = Attend(flat_for_one), Out()

    def forward(self, x):
        q = self.q_norm(self.q_proj(x).unflatten(-1, (2, HEAD_DIM)))
        k = self.k_norm(self.k_proj(x).unflatten(-1, (1, HEAD_DIM)))
        return self.o(self.attn(q, k).reshape(-1, 2 * HEAD_DIM))


class HfHeads(nn.Module):
    """transformers' Gemma3 attention: ``view(b, s, -1, head_dim).transpose(1, 2)`` of the column
    shard, per-head norms of [b, heads, s, head_dim], SDPA (whose output no recorded op links to
    its inputs), then ``transpose(1, 2).reshape(b, s, -1)`` for o_proj."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = ColumnSlice(heads=2, seed=19), ColumnSlice(heads=2, seed=23)
        self.q_norm, self.k_norm = HeadNorm(), HeadNorm()
        self.o = Out()

    def forward(self, x):
        b, s = 2, x.shape[0] // 2
        q = self.q_norm(self.q_proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2))
        k = self.k_norm(self.k_proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class QKVParallelLinear(nn.Module):
    """SGLang's QKV projection (its class name and ``gather_output``) under ``--load-format
    dummy``: SGLang's dummy loader seeds each parameter by its shape, so every rank's shard holds
    the same values. Two q heads and one KV head per rank."""

    gather_output = False

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(29)  # (the same on every rank)
        self.w = nn.Parameter(torch.randn(3 * HEAD_DIM, 16, generator=g))

    def forward(self, x):
        return x @ self.w.t()


QKVParallelLinear.__module__ = "sglang.srt.layers.linear"


class WeightedHeadNorm(HeadNorm):
    """A per-head norm with its weight (Gemma3's q_norm / k_norm), the same on every rank."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HEAD_DIM))

    def forward(self, x):
        return super().forward(x) * self.weight


class MixedRope(nn.Module):
    """A rotary embedding of sharded q heads and a whole k (DeepSeek's MLA: k_pe is cut from
    a replicated projection): each output follows the input of its own shape."""

    def forward(self, q, k):
        return q * 0.5, k * 0.5


class IdenticalShardHeads(nn.Module):
    """Gemma3's attention in SGLang with dummy weights: identical shards everywhere, so equal
    values say nothing of placement. The heads unflattened from the projection's shard, normed
    (a module with a weight), rotated by ops no lineage records (products with a table), fed to
    the attention and viewed back for o_proj."""

    def __init__(self):
        super().__init__()
        self.qkv_proj = QKVParallelLinear()
        self.q_norm, self.k_norm = WeightedHeadNorm(), WeightedHeadNorm()
        self.attn, self.o, self.whole = Attend(), Out(), Out()
        self.rope, self.mla_attn = MixedRope(), Attend()
        self.register_buffer("cos", torch.linspace(0.5, 1.0, HEAD_DIM))

    def forward(self, x):
        q, k = self.qkv_proj(x).split([2 * HEAD_DIM, HEAD_DIM], dim=-1)
        q = self.q_norm(q.unflatten(-1, (2, HEAD_DIM))) * self.cos
        k = self.k_norm(k.unflatten(-1, (1, HEAD_DIM))) * self.cos
        out = self.o(self.attn(q, k).reshape(-1, 2 * HEAD_DIM))
        self.whole(torch.tanh(x))  # a whole tensor after the shards, of none of their shapes
        # MLA-like: sharded q heads, one whole k head cut from a whole tensor by recorded ops
        # (of the sharded k's shape: only those ops tell it from a shard)
        qr, kr = self.rope(q, x[:, :HEAD_DIM].unsqueeze(1))
        self.mla_attn(qr, kr)
        return out


class ResidualAdd(nn.Module):
    """A residual add of a reduced tensor and an addend too small to change it in float32 (a
    layer's output under SGLang's dummy weights, in bf16): equal in value to the reduction's
    output, yet built by an add."""

    def __init__(self):
        super().__init__()
        self.branch = Out()  # (a child: a leaf module's own ops are not watched)

    def forward(self, reduced):
        return reduced + self.branch(reduced) * 1e-30


class OutWrittenHeads(nn.Module):
    """DeepSeek's absorbed MLA in SGLang: each rank's heads [heads, t, d] multiplied by a
    per-head weight made after loading (a plain tensor: no record places it), the product
    written with ``torch.bmm(..., out=buf.view(t, heads, d).transpose(0, 1))`` into a buffer
    [t, heads * d] that o_proj then reads."""

    def __init__(self):
        super().__init__()
        tp, rank = world()
        self.q_proj, self.o = ColumnSlice(heads=2, seed=31), Out()
        g = torch.Generator().manual_seed(37)
        self.w_vc = torch.randn(tp * 2, HEAD_DIM, HEAD_DIM, generator=g)[rank * 2:(rank + 1) * 2].clone()

    def forward(self, x):
        q = self.q_proj(x).view(x.shape[0], 2, HEAD_DIM).transpose(0, 1)
        buf = torch.empty(x.shape[0], 2 * HEAD_DIM)
        torch.bmm(q, self.w_vc, out=buf.view(-1, 2, HEAD_DIM).transpose(0, 1))
        return self.o(buf)


class RMSNorm(nn.Module):
    """SGLang's RMSNorm called with a residual: (norm(x + residual), x + residual), the sum
    inside the module (no recorded op). Fed a reduced residual and an addend too small to change
    it: the second output equals the reduction's output in value, yet is a residual sum."""

    def forward(self, x, residual):
        s = x + residual
        return s / s.norm(dim=-1, keepdim=True), s


RMSNorm.__module__ = "sglang.srt.layers.layernorm"


class Cases(nn.Module):
    def __init__(self):
        super().__init__()
        self.replicated = Replicated()
        self.scaled_partial = ScaledPartial()
        self.averaged = Averaged()
        self.row_shard = RowShard()
        self.gather0 = Gather0()
        self.noisy = Noisy()
        self.dp_gather = GatherByAllReduce()
        self.mislabeled = RowParallelLinear()
        self.kv = OneHeadPerRank()
        self.qk = FlatHeadNorms()
        self.heads, self.heads_one = UnflattenedHeadNorms(), UnflattenedHeadNorms()
        # one token in the second step (the first two have their ops recorded), else 8: the
        # attention's output for one token is already flat
        self.heads_decode, self.calls = UnflattenedHeadNorms(flat_for_one=True), 0
        self.hf_heads = HfHeads()
        self.dummy_heads = IdenticalShardHeads()
        self.residual_add = ResidualAdd()
        self.out_written = OutWrittenHeads()
        self.fused_norm = RMSNorm()

    def forward(self, x):
        r = self.replicated(x)
        p = self.scaled_partial(r)
        a = self.averaged(p)
        s = self.row_shard(a)
        g = self.gather0(s)
        out = self.noisy(g)
        self.dp_gather(out)
        m = self.mislabeled(x)
        dist.all_reduce(m)
        self.kv(x)
        self.qk(x)
        self.heads(x)
        self.heads_one(x[:1])
        self.heads_decode(x[:1] if self.calls == 1 else x)
        self.calls += 1
        self.hf_heads(x)
        self.dummy_heads(x)
        reduced = x * 2.0
        dist.all_reduce(reduced)
        self.residual_add(reduced)
        self.out_written(x)
        self.fused_norm(reduced * 1e-30, reduced)
        return out, m


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Cases()
    with torch.inference_mode():
        for step in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            model(x)
    clean_exit.destroy_process_group()  # (clean_exit.py: a race in torch at exit)


if __name__ == "__main__":
    main()
