"""Decode and prefill tokens/s of llama.cpp (llama-cpp-python) on a GGUF, greedy, for
scripts/bench/vs-llamacpp.sh. Prints one JSON object like `tessera generate --json`."""
import argparse
import json
import time

from llama_cpp import Llama, llama_cpp

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--prompt-tokens", required=True, help="comma-separated token ids")
parser.add_argument("--max-tokens", type=int, default=128)
parser.add_argument("--threads", type=int, default=1)
args = parser.parse_args()

prompt = [int(t) for t in args.prompt_tokens.split(",")]
# Flash attention on, as llama.cpp's own tools default to (`-fa auto` turns it on for the CPU);
# llama-cpp-python defaults to off. On the development machine it is the faster of the two.
llm = Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads,
            n_ctx=len(prompt) + args.max_tokens + 8, n_batch=512, verbose=False, logits_all=False,
            flash_attn=True)

start = time.perf_counter()
llm.eval(prompt)
prefill_s = time.perf_counter() - start
tokens = []
decode_start = time.perf_counter()
for _ in range(args.max_tokens):
    token = int(llm.sample(temp=0.0))  # greedy
    tokens.append(token)
    if len(tokens) == args.max_tokens:
        break
    llm.eval([token])
decode_s = time.perf_counter() - decode_start
print(json.dumps({
    "engine": "llama.cpp (llama-cpp-python)",
    "prompt_tokens": len(prompt),
    "tokens": tokens,
    "prefill_tokens_per_s": len(prompt) / prefill_s,
    # The first token comes from prefill's logits; count the evals after it, as tessera does.
    "decode_tokens_per_s": (len(tokens) - 1) / decode_s,
    "threads": args.threads,
}))
