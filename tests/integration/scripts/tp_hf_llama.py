"""A HuggingFace transformers Llama loaded with its own tensor-parallel plan (``tp_plan="auto"``).

Nobody here wrote the parallelism: transformers shards the checkpoint's weights and installs its
ParallelStyles (``model.config.base_model_tp_plan`` and the model's ``_tp_plan``) itself. Run
under torchrun on gloo:

    torchrun --nproc-per-node 2 tp_hf_llama.py --ckpt DIR --steps 2 [--dump DIR] [--plan-out FILE]

Rank 0 writes a small seeded checkpoint into ``--ckpt`` first when it holds none (so two runs
share one); every rank then loads it with ``tp_plan="auto"``. ``--plan-out`` writes the TP plan
the model was loaded with (module pattern -> style name), as the model itself reports it.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import clean_exit

SIZES = dict(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=64)
BATCH, SEQ = 2, 12


def save_seeded(path, config_cls, model_cls, sizes):
    """A seeded random ``model_cls`` of ``sizes`` in ``path`` (safetensors + config), written once
    (the other tp_hf_*.py programs save theirs with it)."""
    torch.manual_seed(0)
    config = config_cls(**sizes, tie_word_embeddings=False, dtype="float32")
    model = model_cls(config).eval()
    tmp = path + ".tmp"
    model.save_pretrained(tmp)
    os.replace(tmp, path)


def write_checkpoint(path):
    """A seeded random Llama in ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    save_seeded(path, LlamaConfig, LlamaForCausalLM, SIZES)


def tokens_for_step(step):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=g)


def main(write=None):
    """``write``: how rank 0 writes the checkpoint (another model's script passes its own)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dump", default=None, help="folder for DUMP/rank<R>.pt, each rank's logits")
    ap.add_argument("--probe", action="store_true",
                    help="also write DUMP/shapes<R>.json, every point's local shape (point_probe.py)")
    ap.add_argument("--plan-out", default=None)
    a = ap.parse_args()
    if a.probe:
        import point_probe

        point_probe.install()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0 and not os.path.exists(os.path.join(a.ckpt, "config.json")):
        (write or write_checkpoint)(a.ckpt)
    dist.barrier()

    import transformers
    from transformers import AutoModelForCausalLM

    try:  # transformers 5: the plan goes in a DistributedConfig (tp_plan= is deprecated there)
        from transformers import DistributedConfig

        parallel = {"distributed_config": DistributedConfig(tp_plan="auto")}
    except ImportError:
        parallel = {"tp_plan": "auto"}
    model = AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=torch.float32, **parallel).eval()
    if a.plan_out and rank == 0:
        # The plan the model was parallelised with (the instance's, which is what
        # from_pretrained applies; it can differ from the class attribute).
        os.makedirs(os.path.dirname(os.path.abspath(a.plan_out)), exist_ok=True)
        with open(a.plan_out, "w") as f:
            json.dump({"plan": dict(model.tp_plan), "transformers": transformers.__version__},
                      f, indent=1, sort_keys=True)
    logits = []
    with torch.no_grad():
        for step in range(a.steps):
            out = model(input_ids=tokens_for_step(step), use_cache=False).logits
            logits.append(out.clone())
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        torch.save(logits, os.path.join(a.dump, f"rank{rank}.pt"))
        if a.probe:
            point_probe.dump(os.path.join(a.dump, f"shapes{rank}.json"))
    if rank == 0:
        print("ok hf", type(out).__name__, tuple(out.shape), flush=True)
    clean_exit.destroy_process_group()  # (clean_exit.py: a race in torch at exit)


if __name__ == "__main__":
    main()
