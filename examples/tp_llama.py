"""Tensor-parallel mini Llama with an EAGLE-3 draft head, in plain PyTorch.

The layers mirror SGLang's parallel layers (VocabParallelEmbedding, QKVParallelLinear,
MergedColumnParallelLinear, RowParallelLinear, ParallelLMHead) so that module paths and
collective patterns look like a real TP serving stack, at toy size.  Per step with tp > 1:
1 all_reduce (embedding) + 2 per layer (o_proj, down_proj) + 1 all_gather (logits).

Every rank builds the FULL weights from one seeded generator and keeps its slice, so the
outputs agree for any tp up to float rounding.

    python examples/tp_llama.py --out /tmp/tp1.json                # world size 1, no process group
    torchrun --nproc-per-node 2 examples/tp_llama.py               # gloo on cpu, nccl with --device cuda
    python examples/tp_llama.py --spawn 3                          # starts 3 ranks itself
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TinyLlamaConfig:
    """Model shape and build options; `from_any` accepts this, a dict or an argparse Namespace."""
    layers: int = 6
    hidden: int = 96
    heads: int = 6
    kv_heads: int = 6
    head_dim: int = 16
    ffn: int = 192
    vocab: int = 384
    seed: int = 0
    aux_layer_ids: tuple = (0, 2, 4)
    deferred_reduction: bool = False
    # Planted bugs (off by default), for `tensor-trace compare` and `check` to find:
    bug_double_reduce: int = -1        # this layer's o_proj all_reduces its output twice
    bug_aux_before_reduce: bool = False  # aux hidden states captured before the MLP's all_reduce
    rope_theta: float = 10000.0
    eps: float = 1e-6
    device: str = "cpu"
    dtype: str = "float32"

    @classmethod
    def from_any(cls, obj) -> "TinyLlamaConfig":
        if isinstance(obj, cls):
            return obj
        src = obj if isinstance(obj, dict) else vars(obj)
        kw = {f.name: src[f.name] for f in fields(cls) if f.name in src}
        if isinstance(kw.get("aux_layer_ids"), str):
            kw["aux_layer_ids"] = kw["aux_layer_ids"].split(",")
        if "aux_layer_ids" in kw:
            kw["aux_layer_ids"] = tuple(int(i) for i in kw["aux_layer_ids"])
        return cls(**kw)

    def validate(self, tp_size: int) -> None:
        """Raise ValueError with a readable message if this shape cannot be split tp_size ways."""
        sizes = {"heads": self.heads, "kv-heads": self.kv_heads, "ffn": self.ffn, "vocab": self.vocab}
        bad = [f"--{name} {v}" for name, v in sizes.items() if v % tp_size]
        if bad:
            raise ValueError(f"tensor-parallel size {tp_size} must divide {', '.join(bad)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"--head-dim {self.head_dim} must be even (rotary embedding)")
        if not self.aux_layer_ids or any(not -1 <= i < self.layers for i in self.aux_layer_ids):
            raise ValueError(f"--aux-layer-ids {list(self.aux_layer_ids)} must be non-empty, "
                             f"each in [-1, {self.layers - 1}]")


# ---------------------------------------------------------------- collectives
# Both helpers look up dist.* at call time, so a test can wrap torch.distributed functions to
# count calls.  They are skipped for tp == 1 so single-process runs need no process group.

def tp_all_reduce(x: torch.Tensor, tp_size: int, group) -> torch.Tensor:
    """In-place SUM all_reduce over the TP group (no-op for tp == 1)."""
    if tp_size > 1:
        dist.all_reduce(x, group=group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor, tp_size: int, group) -> torch.Tensor:
    """Concatenate every rank's shard along the last dim with ONE dist.all_gather (list form).

    Why the list form: it works the same on gloo and nccl across torch versions, while in
    torch 2.13 all_gather_into_tensor is deprecated and gloo rejects its stacked output layout.
    """
    if tp_size == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(shards, x.contiguous(), group=group)
    return torch.cat(shards, dim=-1)


# ---------------------------------------------------------------- layers

class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32; replicated on every rank."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def init_from(self, gen: torch.Generator) -> None:
        self.weight.data.copy_(1 + 0.02 * torch.randn(self.weight.shape, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class _TPModule(nn.Module):
    def __init__(self, tp_rank: int, tp_size: int, group):
        super().__init__()
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group


class VocabParallelEmbedding(_TPModule):
    """Rank r owns vocab rows [r*V/tp, (r+1)*V/tp); masked lookup, then all_reduce(SUM)."""

    def __init__(self, vocab: int, hidden: int, tp_rank: int, tp_size: int, group):
        super().__init__(tp_rank, tp_size, group)
        self.vocab, self.hidden = vocab, hidden
        self.shard = vocab // tp_size
        self.start, self.end = tp_rank * self.shard, (tp_rank + 1) * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden))

    def init_from(self, gen: torch.Generator) -> None:
        self.weight_loader(0.02 * torch.randn(self.vocab, self.hidden, generator=gen))

    def weight_loader(self, full: torch.Tensor) -> None:
        self.weight.data.copy_(full[self.start:self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = (input_ids >= self.start) & (input_ids < self.end)
        local_ids = (input_ids - self.start).masked_fill(~mask, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(~mask.unsqueeze(-1), 0)
        return tp_all_reduce(out, self.tp_size, self.group)   # each id is owned by one rank


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection (untied); returns local logits [B, S, V/tp], no gather."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


class ColumnParallelLinear(_TPModule):
    """Output dim sharded; `output_sizes` lists the full widths of the stacked sub-matrices
    (q, k, v or gate, up) so each rank keeps its slice of EACH part, as SGLang's loaders do.
    No gather: the output stays sharded for the following row-parallel layer."""

    def __init__(self, input_size: int, output_sizes, tp_rank: int, tp_size: int, group):
        super().__init__(tp_rank, tp_size, group)
        self.input_size, self.output_sizes = input_size, list(output_sizes)
        self.weight = nn.Parameter(torch.empty(sum(s // tp_size for s in output_sizes), input_size))

    def init_from(self, gen: torch.Generator) -> None:
        self.weight_loader(0.02 * torch.randn(sum(self.output_sizes), self.input_size, generator=gen))

    def weight_loader(self, full: torch.Tensor) -> None:
        parts, offset = [], 0
        for size in self.output_sizes:
            n = size // self.tp_size
            parts.append(full[offset + self.tp_rank * n: offset + (self.tp_rank + 1) * n])
            offset += size
        self.weight.data.copy_(torch.cat(parts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection: heads/tp query heads and kv_heads/tp KV heads per rank."""

    def __init__(self, hidden, head_dim, heads, kv_heads, tp_rank, tp_size, group):
        super().__init__(hidden, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim],
                         tp_rank, tp_size, group)
        self.num_heads, self.num_kv_heads = heads // tp_size, kv_heads // tp_size
        self.head_dim = head_dim


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Fused gate/up projection: local output is [gate shard | up shard], 2*ffn/tp wide."""


class RowParallelLinear(_TPModule):
    """Input dim sharded (input_is_parallel=True).  Each rank produces a partial sum; with
    reduce_results=True it is all_reduced in place here, else the caller must reduce it."""

    def __init__(self, input_size, output_size, tp_rank, tp_size, group, reduce_results=True,
                 reductions=1):
        super().__init__(tp_rank, tp_size, group)
        self.input_size, self.output_size = input_size, output_size
        self.reduce_results = reduce_results
        self.reductions = reductions   # 2 only for the planted double-reduction bug
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp_size))

    def init_from(self, gen: torch.Generator) -> None:
        self.weight_loader(0.02 * torch.randn(self.output_size, self.input_size, generator=gen))

    def weight_loader(self, full: torch.Tensor) -> None:
        n = self.input_size // self.tp_size
        self.weight.data.copy_(full[:, self.tp_rank * n:(self.tp_rank + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)   # no bias: a bias would be added once, after the reduction
        if self.reduce_results:
            for _ in range(self.reductions):
                tp_all_reduce(out, self.tp_size, self.group)
        return out


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) on [B, n, S, hd] at positions 0..S-1."""
    hd, seq = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    angles = torch.arange(seq, device=x.device, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class CoreAttention(nn.Module):
    """Causal softmax attention over this rank's heads (no KV cache); GQA by repeat_interleave.
    Local query head j uses local KV head j // (heads/kv_heads), the same grouping as the full
    model because both head counts are split tp ways."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rope_theta: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta, self.scale = rope_theta, head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s, _ = q.shape
        q = q.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, self.rope_theta), _rope(k, self.rope_theta)
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)).float() * self.scale
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1).to(v.dtype)
        return (probs @ v).transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)


class LlamaAttention(nn.Module):
    """qkv_proj (column parallel) -> attn (local heads) -> o_proj (row parallel)."""

    def __init__(self, cfg: TinyLlamaConfig, tp_rank, tp_size, group, layer_id: int = 0):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads,
                                          tp_rank, tp_size, group)
        nh, nkv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.split = [nh * cfg.head_dim, nkv * cfg.head_dim, nkv * cfg.head_dim]
        self.attn = CoreAttention(nh, nkv, cfg.head_dim, cfg.rope_theta)
        self.o_proj = RowParallelLinear(cfg.heads * cfg.head_dim, cfg.hidden, tp_rank, tp_size,
                                        group, reduce_results=not cfg.deferred_reduction,
                                        reductions=2 if layer_id == cfg.bug_double_reduce else 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        return self.o_proj(self.attn(q, k, v))


class SiluAndMul(nn.Module):
    """silu(gate) * up on the local [gate | up] layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class LlamaMLP(nn.Module):
    """gate_up_proj (merged column parallel) -> act_fn -> down_proj (row parallel)."""

    def __init__(self, cfg: TinyLlamaConfig, tp_rank, tp_size, group, reduce_results=None):
        super().__init__()
        if reduce_results is None:
            reduce_results = not cfg.deferred_reduction
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden, [cfg.ffn, cfg.ffn],
                                                       tp_rank, tp_size, group)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(cfg.ffn, cfg.hidden, tp_rank, tp_size, group,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block.  With deferred_reduction, o_proj/down_proj return partial sums and the
    reduction happens here at the layer boundary (as SGLang's layer communicator does), so hooks
    on self_attn / mlp / o_proj / down_proj see unreduced per-rank partials.

    Planted bug ``bug_aux_before_reduce`` (an aux layer only): the MLP's reduction moves here
    and the residual stream is captured for the draft (``self.aux``) before it, as a fused
    all-reduce + residual-add kernel does when the capture is not moved with it: each rank's
    capture holds its partial sum."""

    def __init__(self, cfg: TinyLlamaConfig, layer_id: int, tp_rank, tp_size, group):
        super().__init__()
        self.layer_id, self.deferred = layer_id, cfg.deferred_reduction
        self.aux_before_reduce = cfg.bug_aux_before_reduce and layer_id in cfg.aux_layer_ids
        self.tp_size, self.group = tp_size, group
        self.aux = None
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = LlamaAttention(cfg, tp_rank, tp_size, group, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = LlamaMLP(cfg, tp_rank, tp_size, group,
                            reduce_results=not (cfg.deferred_reduction or self.aux_before_reduce))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x))
        if self.deferred:
            tp_all_reduce(h, self.tp_size, self.group)
        x = x + h
        h = self.mlp(self.post_attention_layernorm(x))
        if self.aux_before_reduce:
            self.aux = x + h   # the bug: h is this rank's partial sum until the all_reduce below
        if self.deferred or self.aux_before_reduce:
            tp_all_reduce(h, self.tp_size, self.group)
        return x + h


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm; also returns the EAGLE-3 aux hidden states
    (residual stream after layer i, -1 = embedding output) in aux_layer_ids order."""

    def __init__(self, cfg: TinyLlamaConfig, tp_rank, tp_size, group):
        super().__init__()
        self.aux_layer_ids = list(cfg.aux_layer_ids)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab, cfg.hidden, tp_rank, tp_size, group)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp_rank, tp_size, group)
                                    for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)

    def forward(self, input_ids: torch.Tensor):
        h = self.embed_tokens(input_ids)
        captured = {-1: h}
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i in self.aux_layer_ids:
                captured[i] = h if layer.aux is None else layer.aux
        return self.norm(h), [captured[i] for i in self.aux_layer_ids]


class Eagle3Draft(nn.Module):
    """EAGLE-3 style draft input head: fc(cat(aux_hidden_states)) -> norm, replicated per rank."""

    def __init__(self, num_aux: int, hidden: int, eps: float):
        super().__init__()
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)   # SGLang's llama_eagle3 default
        self.norm = RMSNorm(hidden, eps)

    def init_from(self, gen: torch.Generator) -> None:
        self.fc.weight.data.copy_(0.02 * torch.randn(self.fc.weight.shape, generator=gen))

    def forward(self, aux_hidden_states) -> torch.Tensor:
        return self.norm(self.fc(torch.cat(aux_hidden_states, dim=-1)))


class TinyLlamaForCausalLM(nn.Module):
    """Root module: returns (full logits [B, S, V], draft output [B, S, H])."""

    def __init__(self, cfg: TinyLlamaConfig, tp_rank: int, tp_size: int, group):
        super().__init__()
        self.cfg, self.tp_size, self.group = cfg, tp_size, group
        self.model = LlamaModel(cfg, tp_rank, tp_size, group)
        self.lm_head = ParallelLMHead(cfg.vocab, cfg.hidden, tp_rank, tp_size, group)
        self.draft = Eagle3Draft(len(cfg.aux_layer_ids), cfg.hidden, cfg.eps)

    def forward(self, input_ids: torch.Tensor):
        hidden, aux = self.model(input_ids)
        local_logits = self.lm_head(hidden)                       # [B, S, V/tp]
        logits = tp_all_gather_last_dim(local_logits, self.tp_size, self.group)
        return logits, self.draft(aux)


def build_model(args_or_config, tp_rank: int, tp_size: int, group, *, device=None, dtype=None):
    """Build the TP model for one rank.  `group` is the TP process group (None = default group,
    unused when tp_size == 1).  device/dtype default to the config's."""
    cfg = TinyLlamaConfig.from_any(args_or_config)
    cfg.validate(tp_size)
    model = TinyLlamaForCausalLM(cfg, tp_rank, tp_size, group)
    # modules() follows registration order, identical on every rank and for every tp, so one
    # generator draws the same full tensors everywhere; each module keeps its own slice.
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "init_from"):
                module.init_from(gen)
    device = torch.device(device if device is not None else cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype or cfg.dtype)
    return model.to(device=device, dtype=dtype).eval()


# ---------------------------------------------------------------- driver

def make_input_ids(args, step: int) -> torch.Tensor:
    """Step inputs, identical on every rank (CPU generator seeded with seed*1000+step)."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)


class CudaGraphStep:
    """First call: warm up on a side stream (lazy NCCL/cuBLAS init must not happen during
    capture), return that eager result, then capture one step.  Later calls copy the new ids
    into the static input buffer and replay."""

    def __init__(self, model: nn.Module, stale_input: bool = False):
        self.model, self.graph, self.stale_input = model, None, stale_input

    def __call__(self, input_ids: torch.Tensor):
        if self.graph is not None:
            if not self.stale_input:  # the planted bug: every replay reuses the captured ids
                self.static_ids.copy_(input_ids)
            self.graph.replay()
            return self.static_out
        self.static_ids = input_ids.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.model(self.static_ids)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # With NCCL in the graph, ProcessGroupNCCL's watchdog thread keeps querying events while
        # this thread captures: "thread_local" confines the capture's restrictions to this thread.
        mode = "thread_local" if dist.is_initialized() and dist.get_world_size() > 1 else "global"
        with torch.cuda.graph(self.graph, capture_error_mode=mode):
            self.static_out = self.model(self.static_ids)
        return out


def run(args) -> list:
    """Run args.steps steps on this rank (RANK/WORLD_SIZE/LOCAL_RANK from the environment,
    world size 1 without them).  Returns the per-step records; rank 0 prints and writes --out."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    group = None
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                rank=rank, world_size=world)
        group = dist.group.WORLD
    try:
        model = build_model(args, rank, world, group, device=device)
        step_fn = CudaGraphStep(model, args.bug_stale_graph_input) if args.cuda_graph else model
        records, wall_s, cpu_s = [], [], []
        with torch.inference_mode():
            for step in range(args.steps):
                ids = make_input_ids(args, step).to(device)
                forbid = args.forbid_sync_from is not None and step >= args.forbid_sync_from
                if forbid:  # any host-device synchronisation inside the step now raises
                    torch.cuda.set_sync_debug_mode("error")
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    logits, draft_out = step_fn(ids)
                finally:
                    wall_s.append(time.perf_counter() - t0)
                    cpu_s.append(time.process_time() - c0)
                    if forbid:
                        torch.cuda.set_sync_debug_mode("default")
                argmax = logits.argmax(-1).tolist()
                rec = {"step": step, "logits_sum": logits.float().sum().item(),
                       "argmax": argmax, "draft_sum": draft_out.float().sum().item(),
                       "logits_sha256": _sha256(logits), "draft_sha256": _sha256(draft_out)}
                records.append(rec)
                if rank == 0:
                    print(f"step {step} logits_sum={rec['logits_sum']:.6f} argmax0={argmax[0]}",
                          flush=True)
        if rank == 0 and args.out:
            with open(args.out, "w") as f:
                # The forward call's wall time and this process's CPU time per step on rank 0 (on
                # CUDA the host's time until it returns: no synchronisation is added), for
                # bench/record_cpu.py
                json.dump({"tp": world, "steps": records, "step_wall_s": wall_s, "step_cpu_s": cpu_s},
                          f, indent=1)
        return records
    finally:
        if args.cuda_graph and device.type == "cuda":
            # A graph holding NCCL kernels must go before its communicator: tearing the process
            # group down under a live graph hung at exit at TP=2 on the H200s.
            step_fn = None
            torch.cuda.synchronize()
        if dist.is_initialized():
            dist.destroy_process_group()


def _sha256(t: torch.Tensor) -> str:
    """Hash of a tensor's bytes (bitwise comparison of runs; no numpy needed)."""
    raw = t.detach().contiguous().cpu().view(-1).view(torch.uint8)
    # the bytes where they are (bytes(raw.tolist()), the same bytes, took seconds per step for
    # a [2, 64, 32000] logits tensor)
    data = ctypes.string_at(raw.data_ptr(), raw.numel()) if raw.numel() else b""
    return hashlib.sha256(data).hexdigest()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_worker(rank: int, world: int, port: int, args) -> None:
    # Same environment torchrun would give, so run() has one code path.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run(args)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in [("layers", 6), ("hidden", 96), ("heads", 6), ("kv-heads", 6),
                          ("head-dim", 16), ("ffn", 192), ("vocab", 384), ("batch", 2),
                          ("seq", 8), ("steps", 4), ("seed", 0)]:
        p.add_argument(f"--{name}", type=int, default=default, help=f"(default {default})")
    p.add_argument("--aux-layer-ids", default=None,
                   help="comma list of layers whose output feeds the EAGLE-3 draft (-1 = embedding "
                        "output); the default, 0,n//2-1,n-2 (0,2,4 for 6 layers), mirrors SGLang's "
                        "[2, n//2, n-3] scaled down (write --aux-layer-ids=-1,... when the list "
                        "starts with -1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--deferred-reduction", action="store_true",
                   help="o_proj/down_proj return partial sums; the decoder layer all_reduces them")
    p.add_argument("--bug-double-reduce", type=int, default=-1, metavar="LAYER",
                   help="planted bug: this layer's o_proj all_reduces its output twice (tp times the "
                        "values from there on)")
    p.add_argument("--bug-aux-before-reduce", action="store_true",
                   help="planted bug: the aux hidden states of the EAGLE-3 layers are captured "
                        "before their MLP's all_reduce (partial sums reach the draft)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture one step into a CUDA graph and replay it (needs --device cuda)")
    p.add_argument("--bug-stale-graph-input", action="store_true",
                   help="planted bug (with --cuda-graph): replays do not refresh the graph's static "
                        "input buffer, so every replay recomputes the captured step's inputs")
    p.add_argument("--forbid-sync-from", type=int, default=None, metavar="STEP",
                   help="from this step on, run each forward under torch.cuda.set_sync_debug_mode"
                        "('error'): a synchronising call inside the step (the model's or a "
                        "tracer hook's) raises (needs --device cuda)")
    p.add_argument("--spawn", type=int, default=0, metavar="N",
                   help="start N ranks with torch.multiprocessing.spawn instead of torchrun")
    p.add_argument("--out", metavar="FILE", help="rank 0 writes per-step results here as JSON")
    args = p.parse_args(argv)
    if args.cuda_graph and args.device != "cuda":
        p.error("--cuda-graph requires --device cuda")
    if args.forbid_sync_from is not None and args.device != "cuda":
        p.error("--forbid-sync-from requires --device cuda")
    try:
        if args.aux_layer_ids is None:
            n = args.layers
            args.aux_layer_ids = ",".join(str(i) for i in sorted({0, max(0, n // 2 - 1), max(0, n - 2)}))
        args.aux_layer_ids = [int(i) for i in args.aux_layer_ids.split(",")]
        world = args.spawn or int(os.environ.get("WORLD_SIZE", "1"))
        TinyLlamaConfig.from_any(args).validate(world)   # fail once, before any rank starts
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.spawn:
        import torch.multiprocessing as mp
        mp.start_processes(_spawn_worker, args=(args.spawn, _free_port(), args),
                           nprocs=args.spawn, join=True, start_method="spawn")
    else:
        run(args)


if __name__ == "__main__":
    main()
