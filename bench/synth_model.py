"""The synthetic trace's model (``synth.py``): the module tree of one decode step of a
DeepSeek/Llama-sized TP decoder, its logical tensors and their per-rank fingerprints, and the
weights' fingerprints."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

BF16 = "bfloat16"
I64 = "int64"

# ---------------------------------------------------------------------------- model shape


@dataclasses.dataclass
class Shape:
    layers: int = 61
    hidden: int = 7168
    heads: int = 56
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 18432
    vocab: int = 129280
    batch: int = 8
    tokens: int = 1

    def check(self, tp: int) -> None:
        bad = [f"{n} {v}" for n, v in (("heads", self.heads), ("ffn", self.ffn), ("vocab", self.vocab))
               if v % tp]
        if bad:
            raise SystemExit(f"--ranks {tp} must divide {', '.join(bad)}")

    def spans_per_step(self) -> int:
        return 11 * self.layers + 5  # root, model, embed_tokens, norm, lm_head + 11 per layer

    def collectives_per_step(self) -> int:
        return 2 * self.layers + 2


def steps_for(total_span_records: int, ranks: int, shape: Shape | None = None) -> int:
    """Steps giving about ``total_span_records`` span records (module spans + collectives)."""
    shape = shape or Shape()
    per = shape.spans_per_step() + shape.collectives_per_step()
    return max(1, round(total_span_records / (ranks * per)))


# ---------------------------------------------------------------------------- values
# Kinds of logical tensors; the fingerprint of each is drawn per step (per rank where it differs).
REP, SHARD, PARTIAL, GATHERED, CONCAT, TOKENS, EMB, EMB_PART = range(8)


class Values:
    """Logical tensors of one step and their fingerprints on every rank."""

    def __init__(self, ranks: int, vocab: int, hidden: int, spread: str):
        self.ranks = ranks
        self.vocab = vocab
        self.hidden = hidden
        self.wide = spread == "wide"
        self.items: list = []  # (kind, numel, rms, arg)

    def _new(self, kind, numel, rms, arg=None) -> int:
        self.items.append((kind, numel, rms, arg))
        return len(self.items) - 1

    def rep(self, numel, rms):
        return self._new(REP, numel, rms)

    def shard(self, numel, rms):
        return self._new(SHARD, numel, rms)

    def partial(self, out):
        return self._new(PARTIAL, self.items[out][1], self.items[out][2], out)

    def gathered(self, src, j):
        return self._new(GATHERED, self.items[src][1], self.items[src][2], (src, j))

    def concat(self, src):
        return self._new(CONCAT, self.items[src][1] * self.ranks, self.items[src][2], src)

    def tokens(self, numel):
        return self._new(TOKENS, numel, 0.0)

    def embedding(self, tokens, rms):
        out = self._new(EMB, self.items[tokens][1] * self.hidden, rms, tokens)
        part = self._new(EMB_PART, self.items[out][1], rms, out)
        return out, part

    def draw(self, seed: int) -> np.ndarray:
        """Fingerprints [n logical, ranks, 2] (float32) of one step."""
        rng = np.random.default_rng(seed)
        R = self.ranks
        V = np.zeros((len(self.items), R, 2), dtype=np.float64)
        token_rows: dict = {}
        for i, (kind, n, rms, arg) in enumerate(self.items):
            if kind == REP:
                V[i, :, 0] = rng.normal() * math.sqrt(n) * rms
                V[i, :, 1] = n * rms * rms * (1 + rng.normal() * math.sqrt(2 / n))
            elif kind == SHARD:
                V[i, :, 0] = rng.normal(size=R) * math.sqrt(n) * rms * (4 if self.wide else 1)
                q = n * rms * rms * (1 + rng.normal(size=R) * math.sqrt(2 / n))
                if self.wide:
                    q *= rng.uniform(0.6, 1.4, size=R)
                V[i, :, 1] = q
            elif kind == PARTIAL:
                S, Q = V[arg, 0]
                s = rng.normal(size=R) * math.sqrt(n / R) * rms
                V[i, :, 0] = s + (S - s.sum()) / R
                q = Q / R * (1 + rng.normal(size=R) * math.sqrt(2 / n))
                if self.wide:
                    q *= rng.uniform(0.6, 1.4, size=R)
                V[i, :, 1] = q
            elif kind == GATHERED:
                src, j = arg
                V[i, :, :] = V[src, j, :]
            elif kind == CONCAT:
                V[i, :, 0] = V[arg, :, 0].sum()
                V[i, :, 1] = V[arg, :, 1].sum()
            elif kind == TOKENS:
                ids = rng.integers(0, self.vocab, size=n)
                token_rows[i] = ids
                V[i, :, 0] = float(ids.sum())
                V[i, :, 1] = float((ids.astype(np.float64) ** 2).sum())
            elif kind == EMB:
                ids = token_rows[arg]
                H = self.hidden
                s_t = rng.normal(size=len(ids)) * math.sqrt(H) * rms
                q_t = H * rms * rms * (1 + rng.normal(size=len(ids)) * math.sqrt(2 / H))
                owner = ids // (self.vocab // R)
                token_rows[i] = (owner, s_t, q_t)
                V[i, :, 0] = s_t.sum()
                V[i, :, 1] = q_t.sum()
            elif kind == EMB_PART:
                owner, s_t, q_t = token_rows[arg]
                for r in range(R):
                    m = owner == r
                    V[i, r, 0] = s_t[m].sum()
                    V[i, r, 1] = q_t[m].sum()
        return V.astype("<f4")


# ---------------------------------------------------------------------------- structure


@dataclasses.dataclass
class Coll:
    op: str
    inputs: list  # [(slot, shape, dtype, logical id)]
    outputs: list
    dur_us: float
    reducing: bool


@dataclasses.dataclass
class Node:
    path: str
    cls: str
    inputs: list  # [(slot, shape, dtype, logical id)]
    outputs: list
    body: list  # Node | Coll | float (host time in µs spent in the module's own code)


def build(shape: Shape, tp: int, spread: str):
    """The module tree of one step (identical on every rank) and its logical tensors."""
    V = Values(tp, shape.vocab, shape.hidden, spread)
    B, T, H = shape.batch, shape.tokens, shape.hidden
    nq = shape.heads // tp * shape.head_dim
    nkv = max(1, shape.kv_heads // tp) * shape.head_dim
    f = shape.ffn // tp
    vl = shape.vocab // tp
    n = B * T
    act = (B, T, H)

    ids = V.tokens(n)
    emb, emb_part = V.embedding(ids, 0.02)
    embed = Node("model.embed_tokens", "VocabParallelEmbedding", [("input.0", (B, T), I64, ids)],
                 [("output", act, BF16, emb)],
                 [18.0, Coll("all_reduce", [("input.0", act, BF16, emb_part)],
                             [("output.0", act, BF16, emb)], 25.0, True)])
    layers = []
    h = emb
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        rms_h = 0.5 + 0.05 * i
        n1 = V.rep(n * H, 1.0)
        qkv = V.shard(n * (nq + 2 * nkv), 1.7)
        q, k, v = V.shard(n * nq, 1.7), V.shard(n * nkv, 1.7), V.shard(n * nkv, 1.7)
        a = V.shard(n * nq, 0.5)
        o = V.rep(n * H, 0.3)
        o_part = V.partial(o)
        h2 = V.rep(n * H, rms_h)
        n2 = V.rep(n * H, 1.0)
        gu = V.shard(n * 2 * f, 1.7)
        ac = V.shard(n * f, 0.5)
        d = V.rep(n * H, 0.3)
        d_part = V.partial(d)
        h3 = V.rep(n * H, rms_h + 0.02)
        X = lambda lid, shp=act: [("input.0", shp, BF16, lid)]  # noqa: E731
        Y = lambda lid, shp=act: [("output", shp, BF16, lid)]  # noqa: E731
        attn = Node(f"{p}.self_attn", "LlamaAttention", X(n1), Y(o), [
            Node(f"{p}.self_attn.qkv_proj", "QKVParallelLinear", X(n1), Y(qkv, (B, T, nq + 2 * nkv)), [20.0]),
            4.0,
            Node(f"{p}.self_attn.attn", "CoreAttention",
                 [("input.0", (B, T, nq), BF16, q), ("input.1", (B, T, nkv), BF16, k),
                  ("input.2", (B, T, nkv), BF16, v)], Y(a, (B, T, nq)), [60.0]),
            Node(f"{p}.self_attn.o_proj", "RowParallelLinear", X(a, (B, T, nq)), Y(o), [
                18.0, Coll("all_reduce", [("input.0", act, BF16, o_part)], [("output.0", act, BF16, o)],
                           25.0, True)]),
        ])
        mlp = Node(f"{p}.mlp", "LlamaMLP", X(n2), Y(d), [
            Node(f"{p}.mlp.gate_up_proj", "MergedColumnParallelLinear", X(n2), Y(gu, (B, T, 2 * f)), [20.0]),
            Node(f"{p}.mlp.act_fn", "SiluAndMul", X(gu, (B, T, 2 * f)), Y(ac, (B, T, f)), [10.0]),
            Node(f"{p}.mlp.down_proj", "RowParallelLinear", X(ac, (B, T, f)), Y(d), [
                18.0, Coll("all_reduce", [("input.0", act, BF16, d_part)], [("output.0", act, BF16, d)],
                           25.0, True)]),
        ])
        layers.append(Node(p, "LlamaDecoderLayer", X(h), Y(h3), [
            Node(f"{p}.input_layernorm", "RMSNorm", X(h), Y(n1), [15.0]),
            attn, 3.0,
            Node(f"{p}.post_attention_layernorm", "RMSNorm", X(h2), Y(n2), [15.0]),
            mlp, 3.0,
        ]))
        h = h3
    nf = V.rep(n * H, 1.0)
    logits_local = V.shard(n * vl, 2.0)
    gathered = [V.gathered(logits_local, j) for j in range(tp)]
    logits = V.concat(logits_local)
    model = Node("model", "LlamaModel", [("input.0", (B, T), I64, ids)], [("output", act, BF16, nf)],
                 [embed, *layers, Node("model.norm", "RMSNorm", [("input.0", act, BF16, h)],
                                       [("output", act, BF16, nf)], [15.0])])
    lm_head = Node("lm_head", "ParallelLMHead", [("input.0", act, BF16, nf)],
                   [("output", (B, T, vl), BF16, logits_local)], [25.0])
    root = Node("", "TinyLlamaForCausalLM", [("input.0", (B, T), I64, ids)],
                [("output", (B, T, vl * tp), BF16, logits)], [
                    model, lm_head,
                    Coll("all_gather", [("input.0", (B, T, vl), BF16, logits_local)],
                         [(f"output.{j}", (B, T, vl), BF16, gathered[j]) for j in range(tp)], 40.0, False),
                    12.0])
    # Weights: (module path, class, [(name, shape, sharded)]), in root.modules() order.
    params = [("model.embed_tokens", "VocabParallelEmbedding", [("weight", (vl, H), True)])]
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        params += [(f"{p}.input_layernorm", "RMSNorm", [("weight", (H,), False)]),
                   (f"{p}.self_attn.qkv_proj", "QKVParallelLinear", [("weight", (nq + 2 * nkv, H), True)]),
                   (f"{p}.self_attn.o_proj", "RowParallelLinear", [("weight", (H, nq), True)]),
                   (f"{p}.post_attention_layernorm", "RMSNorm", [("weight", (H,), False)]),
                   (f"{p}.mlp.gate_up_proj", "MergedColumnParallelLinear", [("weight", (2 * f, H), True)]),
                   (f"{p}.mlp.down_proj", "RowParallelLinear", [("weight", (H, f), True)])]
    params += [("model.norm", "RMSNorm", [("weight", (H,), False)]),
               ("lm_head", "ParallelLMHead", [("weight", (vl, H), True)])]
    return root, V, params


def param_fingerprints(params, tp: int, seed: int) -> np.ndarray:
    """[n params, ranks, 2]: norm weights (1 + 0.02 N) equal on every rank, slices (0.02 N) not."""
    rng = np.random.default_rng(seed)
    rows = []
    for _path, _cls, plist in params:
        for _name, shp, sharded in plist:
            n = math.prod(shp)
            if sharded:
                s = rng.normal(size=tp) * 0.02 * math.sqrt(n)
                q = n * 4e-4 * (1 + rng.normal(size=tp) * math.sqrt(2 / n))
            else:
                s = np.full(tp, n + rng.normal() * 0.02 * math.sqrt(n))
                q = np.full(tp, n * (1 + 4e-4) + rng.normal() * 0.04 * math.sqrt(n))
            rows.append(np.stack([s, q], axis=-1))
    return np.stack(rows).astype("<f4")
