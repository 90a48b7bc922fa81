#!/usr/bin/env python3
"""A random Llama checkpoint made with transformers, for serving benchmarks without a download.

By default the shape is Llama-3.2-1B's, as its config.json gives it (hidden 2048, MLP 8192,
16 layers, 32 query heads and 8 KV heads of 64, vocabulary 128256, tied embeddings,
rope_theta 500000 with llama3 RoPE scaling; the same shape as
crates/model/benches/cuda_decode.rs); `--tiny` makes the same architecture small enough
for a CPU shard. Weights are bf16, drawn from N(0, 0.02²) with a fixed seed (norms 1), on
the GPU when there is one: transformers' own initialisation is skipped, because filling
1.2 billion values on the CPU takes minutes. No tokenizer is written (none is at hand
offline): the server takes and returns token ids (`tessera bench --prompt-token-ids`).

Usage: scripts/gpu/make_random_llama.py OUT_DIR [--tiny] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# Llama-3.2-1B's config.json, less what describes the tokenizer's special tokens.
LLAMA_3_2_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
}
# The same architecture, small: a CPU shard serves it in milliseconds per step.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
}
ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--tiny", action="store_true", help="a small model of the same kind")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    started = time.monotonic()
    shape = TINY if args.tiny else LLAMA_3_2_1B
    config = LlamaConfig(
        **shape,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(ROPE_SCALING),
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        bos_token_id=128000 if not args.tiny else 1,
        eos_token_id=128001 if not args.tiny else 2,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Built on the meta device (no memory, no initialisation), then given empty storage
    # where the values go and filled below (RoPE's buffers too, which are not saved).
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(dtype=torch.bfloat16).to_empty(device=device)
    model.tie_weights()
    generator = torch.Generator(device=device).manual_seed(args.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(args.out_dir, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    with open(f"{args.out_dir}/config.json", encoding="utf-8") as f:
        saved = json.load(f)
    print(
        f"make_random_llama: {params / 1e6:.1f} M parameters (bf16, seed {args.seed}, "
        f"filled on {device}) in {args.out_dir}, {time.monotonic() - started:.1f} s; "
        f"vocab {saved['vocab_size']}, layers {saved['num_hidden_layers']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
