"""The models the benchmarks share: a Llama-3-8B-shaped decode step (plain nn.Modules with
SGLang's module layout, optionally tensor-parallel), the example of examples/tp_llama.py, and a
chain of tiny Linear modules, with a counter of module calls per step.

Used by overhead.py, fp_ab.py, cuda_graph_replay.py and tests/gpu/scripts/sync_check.py."""
from __future__ import annotations

import importlib.util
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example():
    """examples/tp_llama.py, by file path (examples/ is not an installed package)."""
    path = os.path.join(ROOT, "examples", "tp_llama.py")
    spec = importlib.util.spec_from_file_location("_bench_tp_llama", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod




def count_module_calls(step_fn) -> int:
    """Module calls of one step, counted by a temporary global forward pre-hook."""
    from torch.nn.modules import module as nn_module

    n = [0]

    def pre(mod, args):
        n[0] += 1

    h = nn_module.register_module_forward_pre_hook(pre)
    try:
        step_fn()
    finally:
        h.remove()
    return n[0]




# ---------------------------------------------------------------- Llama-8B-shaped decode model
# Plain nn.Modules with SGLang's module layout, so the module-call count per step is realistic.

LLAMA_SHAPES = {
    # Llama-3-8B
    "8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256),
    # for a smoke test of the code path on a CPU
    "tiny": dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=1024),
}


# Tensor parallelism of the llama8b-decode model (set from torchrun's environment, --tp runs):
# SGLang's layout at toy cost: vocab-parallel embedding + all_reduce, column-parallel qkv and
# gate_up, row-parallel o_proj and down_proj each followed by an all_reduce inside the module,
# a vocab-parallel lm_head whose logits are all-gathered. Same module calls per step as tp=1.
TP = dict(size=1, rank=0, group=None)


def _linear(n_in, n_out, device, dtype, cls=nn.Linear):
    lin = cls(n_in, n_out, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.02)  # = torch.randn * 0.02, drawn on the device
    return lin


class RowParallelLinear(nn.Linear):
    """A linear layer over this rank's slice of the input features; the partial sums are
    all-reduced inside the module, as SGLang's RowParallelLinear does (reduce_results=True)."""

    def forward(self, x):
        out = F.linear(x, self.weight)
        if TP["size"] > 1:
            torch.distributed.all_reduce(out, group=TP["group"])
        return out


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding: masked lookup, then all_reduce (SGLang's layout)."""

    def __init__(self, vocab, hidden, device, dtype):
        super().__init__()
        per = vocab // TP["size"]
        self.start, self.end = TP["rank"] * per, (TP["rank"] + 1) * per
        self.weight = nn.Parameter(torch.empty(per, hidden, device=device, dtype=dtype).normal_(0.0, 0.02))

    def forward(self, ids):
        mask = (ids >= self.start) & (ids < self.end)
        out = F.embedding((ids - self.start) * mask, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        torch.distributed.all_reduce(out, group=TP["group"])
        return out


class ParallelLMHead(nn.Linear):
    """This rank's vocabulary slice of the logits, all-gathered along the vocabulary."""

    def forward(self, x):
        local = F.linear(x, self.weight)
        if TP["size"] == 1:
            return local
        n = TP["size"]
        parts = torch.empty((n * local.shape[0], *local.shape[1:]), device=local.device, dtype=local.dtype)
        torch.distributed.all_gather_into_tensor(parts, local.contiguous(), group=TP["group"])
        return torch.cat(list(parts.view(n, *local.shape).unbind(0)), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, device, dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE of q and k at one fixed decode position (the slot after the cache)."""

    def __init__(self, head_dim, position, theta, device, dtype):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
        ang = position * inv_freq
        self.register_buffer("cos", torch.cat([ang.cos()] * 2).to(dtype), persistent=False)
        self.register_buffer("sin", torch.cat([ang.sin()] * 2).to(dtype), persistent=False)
        self.head_dim = head_dim

    def rope(self, x):
        b, s, width = x.shape
        x = x.view(b, s, width // self.head_dim, self.head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        return (x * self.cos + torch.cat([-x2, x1], -1) * self.sin).view(b, s, width)

    def forward(self, q, k):
        return self.rope(q), self.rope(k)


class DecodeAttention(nn.Module):
    """One query token per sequence attends to a fixed KV cache through SDPA (GQA)."""

    def __init__(self, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.k_cache = self.v_cache = None

    def set_cache(self, batch, length, device, dtype):
        shape = (batch, self.kv_heads, length, self.head_dim)
        self.k_cache = torch.randn(shape, device=device, dtype=dtype)
        self.v_cache = torch.randn(shape, device=device, dtype=dtype)

    def forward(self, q, k, v):
        # k, v (the new token's) are not written into the cache: the step reads a fixed cache.
        b, s, _ = q.shape
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache,
                                           enable_gqa=self.heads != self.kv_heads)
        return o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)


class LlamaAttention(nn.Module):
    def __init__(self, c, device, dtype):
        super().__init__()
        hd, tp = c["head_dim"], TP["size"]
        heads, kv_heads = c["heads"] // tp, c["kv_heads"] // tp
        self.split = [heads * hd, kv_heads * hd, kv_heads * hd]
        self.qkv_proj = _linear(c["hidden"], sum(self.split), device, dtype)
        self.rotary_emb = RotaryEmbedding(hd, c["kv_len"], 500000.0, device, dtype)
        self.attn = DecodeAttention(heads, kv_heads, hd)
        self.o_proj = _linear(heads * hd, c["hidden"], device, dtype, RowParallelLinear)

    def forward(self, x):
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q, k = self.rotary_emb(q, k)
        return self.o_proj(self.attn(q, k, v))


class SiluAndMul(nn.Module):
    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class LlamaMLP(nn.Module):
    def __init__(self, c, device, dtype):
        super().__init__()
        ffn = c["ffn"] // TP["size"]
        self.gate_up_proj = _linear(c["hidden"], 2 * ffn, device, dtype)
        self.act_fn = SiluAndMul()
        self.down_proj = _linear(ffn, c["hidden"], device, dtype, RowParallelLinear)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c, device, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden"], 1e-5, device, dtype)
        self.self_attn = LlamaAttention(c, device, dtype)
        self.post_attention_layernorm = RMSNorm(c["hidden"], 1e-5, device, dtype)
        self.mlp = LlamaMLP(c, device, dtype)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c, device, dtype):
        super().__init__()
        if TP["size"] > 1:
            self.embed_tokens = VocabParallelEmbedding(c["vocab"], c["hidden"], device, dtype)
        else:
            self.embed_tokens = nn.Embedding(c["vocab"], c["hidden"], device=device, dtype=dtype)
            with torch.no_grad():
                self.embed_tokens.weight.normal_(0.0, 0.02)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, device, dtype) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"], 1e-5, device, dtype)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    def __init__(self, c, device, dtype):
        super().__init__()
        self.c = c
        self.model = LlamaModel(c, device, dtype)
        self.lm_head = _linear(c["hidden"], c["vocab"] // TP["size"], device, dtype, ParallelLMHead)

    def set_batch(self, batch):
        """(Re)allocate every layer's KV cache for ``batch`` sequences of kv_len tokens."""
        w = self.lm_head.weight
        for layer in self.model.layers:
            layer.self_attn.attn.k_cache = layer.self_attn.attn.v_cache = None
        if w.is_cuda:
            torch.cuda.empty_cache()
        for layer in self.model.layers:
            layer.self_attn.attn.set_cache(batch, self.c["kv_len"], w.device, w.dtype)

    def forward(self, input_ids):  # [B, 1] -> logits [B, 1, V]
        return self.lm_head(self.model(input_ids))


class LinearChain(nn.Module):
    """N tiny Linear(64, 64) modules called one after another: a step whose modules do almost no
    work, so what a tracer adds per module call stands out (on a [4, 64] input)."""

    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
