"""A torchtitan-style Llama parallelised with PyTorch's own TP API (torch.distributed.tensor.parallel).

Nobody here wrote the parallelism: the ParallelStyles insert the collectives (through DTensor
redistributes, i.e. functional collectives) in their module hooks. Run under torchrun on gloo:

    torchrun --nproc-per-node 2 tp_api_llama.py --plan sp --steps 2 [--dump DIR]

Plans (``--plan``):
- ``plain``: ColwiseParallel q/k/v/w1/w3, RowwiseParallel wo/w2 (all_reduce), vocab-parallel
  embedding (RowwiseParallel, all_reduce), a column-parallel head whose logits stay sharded.
- ``gathered``: as plain, but the embedding is column-parallel (embedding dim sharded) and both
  it and the head all-gather their outputs (``output_layouts=Replicate()``).
- ``sp``: sequence parallel: SequenceParallel norms, PrepareModuleInput all-gathers attention's and
  feed_forward's inputs, RowwiseParallel(output_layouts=Shard(1)) reduce-scatters wo/w2 and the
  embedding, the head gathers its input along the sequence and its logits along the vocab.
- ``dtensor``: as sp, but the embedding, wo, w2 and the head keep ``use_local_output=False``, so
  DTensors flow through the whole residual stream and out of the model.

The sizes divide by 2 and by 3 (heads, kv heads, hidden, vocab, sequence), so TP 2 and TP 3 work.
The model and plans are also imported by dtensor_sp.py and funcol_tp.py (``rotary="real"``: cos/sin
tables instead of the complex ``freqs_cis``; ``parallelize``'s overrides replace a plan's styles).
``--dump DIR`` saves each rank's local logits of every step (to compare a traced run with an
untraced one); ``--probe`` adds every point's local shape, measured without tensor-trace.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
import clean_exit

PLANS = ("plain", "gathered", "sp", "dtensor")
SIZES = dict(vocab=96, dim=48, layers=2, heads=6, kv_heads=6, hidden=96, seq=12, batch=2)
# rotary kind -> the buffers every block (and attention) takes after the hidden state
ROTARY_BUFFERS = {"complex": ("freqs_cis",), "real": ("cos", "sin")}


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs).float())


def apply_rotary(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return (torch.view_as_real(xq_ * fc).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * fc).flatten(3).type_as(xk))


def rotary_tables(head_dim, seq):
    """Real-valued rotary tables (cos, sin), for programs that keep complex tensors out."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), inv)
    return torch.cat([angles.cos(), angles.cos()], -1), torch.cat([angles.sin(), angles.sin()], -1)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


def apply_rotary_real(xq, xk, cos, sin):
    return _rotate(xq, cos, sin), _rotate(xk, cos, sin)


ROTARY = {"complex": apply_rotary, "real": apply_rotary_real}


class Attention(nn.Module):
    def __init__(self, dim, nh, nkv, rotary="complex"):
        super().__init__()
        self.hd = dim // nh
        self.rotary = ROTARY[rotary]
        self.wq = nn.Linear(dim, nh * self.hd, bias=False)
        self.wk = nn.Linear(dim, nkv * self.hd, bias=False)
        self.wv = nn.Linear(dim, nkv * self.hd, bias=False)
        self.wo = nn.Linear(nh * self.hd, dim, bias=False)

    def forward(self, x, *rope):
        b, l, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # -1: the local head count, as torchtitan does, so the same code runs at any TP.
        q, k, v = (t.view(b, l, -1, self.hd) for t in (q, k, v))
        q, k = self.rotary(q, k, *rope)
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, l, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, nh, nkv, hidden, rotary="complex"):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, nh, nkv, rotary)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, *rope):
        h = x + self.attention(self.attention_norm(x), *rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab, dim, layers, heads, kv_heads, hidden, seq, rotary="complex", **_):
        super().__init__()
        self.rotary = rotary
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, kv_heads, hidden, rotary) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        tables = ((precompute_freqs_cis(dim // heads, seq),) if rotary == "complex"
                  else rotary_tables(dim // heads, seq))
        for name, table in zip(ROTARY_BUFFERS[rotary], tables):
            self.register_buffer(name, table, persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        rope = [getattr(self, name) for name in ROTARY_BUFFERS[self.rotary]]
        for layer in self.layers.values():
            h = layer(h, *rope)
        return self.output(self.norm(h))


def plan_styles(plan, layers=SIZES["layers"], rotary="complex"):
    """The ParallelStyle of every parallelised module under ``plan``, by module path (``rotary``:
    the model's, whose buffers attention takes after the hidden state)."""
    sp = plan in ("sp", "dtensor")
    local = plan != "dtensor"  # use_local_output of the modules that feed the residual stream
    if plan == "plain":
        styles = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                  "output": ColwiseParallel()}
    elif plan == "gathered":
        styles = {"tok_embeddings": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                  "output": ColwiseParallel(output_layouts=Replicate())}
    elif sp:
        styles = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                    use_local_output=local),
                  "norm": SequenceParallel(),
                  "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(),
                                            use_local_output=local)}
    else:
        raise ValueError(f"unknown plan {plan!r}")
    for i in range(layers):
        row = (lambda: RowwiseParallel(output_layouts=Shard(1), use_local_output=local)) if sp else RowwiseParallel
        p = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
             "attention.wv": ColwiseParallel(), "attention.wo": row(),
             "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": row(),
             "feed_forward.w3": ColwiseParallel()}
        if sp:
            rope = (None,) * len(ROTARY_BUFFERS[rotary])
            p.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                      "attention": PrepareModuleInput(input_layouts=(Shard(1), *rope),
                                                      desired_input_layouts=(Replicate(), *rope)),
                      "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                         desired_input_layouts=(Replicate(),))})
        styles.update({f"layers.{i}.{k}": v for k, v in p.items()})
    return styles


def parallelize(model, mesh, plan, **overrides):
    """Apply one of PLANS to ``model`` on the 1-D ``mesh``; ``overrides`` (module path:
    ParallelStyle, e.g. ``output=...``) replace or add styles of the plan."""
    styles = plan_styles(plan, len(model.layers), model.rotary)
    styles.update(overrides)
    return parallelize_module(model, mesh, styles)


def tokens_for_step(step):
    """Different, seeded token ids each step (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, SIZES["vocab"], (SIZES["batch"], SIZES["seq"]), generator=g)


def run_plan(plan, mesh, steps):
    """Build, parallelise and run the model under ``plan``; each step's local logits."""
    torch.manual_seed(0)
    model = parallelize(Transformer(**SIZES).eval(), mesh, plan)
    logits = []
    with torch.no_grad():
        for step in range(steps):
            out = model(tokens_for_step(step))
            logits.append((out.to_local() if isinstance(out, DTensor) else out).clone())
    return type(out).__name__, logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", choices=PLANS + ("all",), default="plain",
                    help="'all' runs every plan in turn (one process start for an untraced reference)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dump", default=None, help="folder for DUMP/PLAN/rank<R>.pt, each rank's logits")
    ap.add_argument("--probe", action="store_true",
                    help="also write DUMP/PLAN/shapes<R>.json, every point's local shape (point_probe.py)")
    a = ap.parse_args()
    if a.probe:
        import point_probe

        point_probe.install()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for plan in PLANS if a.plan == "all" else (a.plan,):
        kind, logits = run_plan(plan, mesh, a.steps)
        if a.dump:
            folder = os.path.join(a.dump, plan)
            os.makedirs(folder, exist_ok=True)
            torch.save(logits, os.path.join(folder, f"rank{rank}.pt"))
            if a.probe:
                point_probe.dump(os.path.join(folder, f"shapes{rank}.json"))
                point_probe.reset()
        if rank == 0:
            print("ok", plan, kind, tuple(logits[-1].shape), flush=True)
    clean_exit.destroy_process_group()  # (clean_exit.py: a race in torch at exit)


if __name__ == "__main__":
    main()
