"""A HuggingFace transformers Phi-3 loaded with its own tensor-parallel plan (``tp_plan="auto"``):
its attention's q, k and v come out of one projection (``qkv_proj``) and its MLP's gate and up out
of another (``gate_up_proj``), both column-parallel with the output gathered
(``colwise_gather_output``), so the activation chunks a whole tensor; ``o_proj`` and
``down_proj`` slice their replicated input inside the call (``rowwise_split_input``). Same
command line as tp_hf_llama.py, whose main it runs:

    torchrun --nproc-per-node 2 tp_hf_phi3.py --ckpt DIR --steps 2 [--dump DIR] [--plan-out FILE]
"""

import tp_hf_llama

# tp_hf_llama's sizes; Phi3Config's default token ids (32000...) lie outside this vocabulary
SIZES = dict(tp_hf_llama.SIZES, pad_token_id=0, bos_token_id=1, eos_token_id=2)
BATCH, SEQ = tp_hf_llama.BATCH, tp_hf_llama.SEQ


def write_checkpoint(path):
    """A seeded random Phi-3 in ``path``."""
    from transformers import Phi3Config, Phi3ForCausalLM

    tp_hf_llama.save_seeded(path, Phi3Config, Phi3ForCausalLM, SIZES)


if __name__ == "__main__":
    tp_hf_llama.main(write_checkpoint)
