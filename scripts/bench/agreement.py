"""How far Tessera's greedy tokens agree with llama.cpp's (llama-cpp-python) and with
transformers' on the committed SmolLM2 prompts (fixtures/smollm2/expected.json) and on the
prompt of scripts/bench/vs-llamacpp.sh. Prints a Markdown table: for each prompt, the index
of the first token where two runs part (all of them when they never do).

llama.cpp runs twice, with flash attention on (its own tools' default) and off
(llama-cpp-python's default): the two differ in how attention rounds (f16 K/V products),
and where the model has two tokens within a few thousandths of a logit, that decides the
token on its own, so llama.cpp's two runs are compared with each other too.

Run with the bench environment (llama-cpp-python, see vs-llamacpp.sh):
    .venv-bench/bin/python scripts/bench/agreement.py [--tokens 32]
"""
import argparse
import json
import os
import subprocess

from llama_cpp import Llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
TESSERA = os.path.join(ROOT, "target", "release", "tessera")
BENCH_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def tessera(args):
    out = subprocess.run([TESSERA, "generate", "--json", "--model", MODEL, "--threads", "1"] + args,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def llamacpp(prompt, tokens, flash_attn):
    llm = Llama(model_path=MODEL, n_threads=1, n_ctx=len(prompt) + tokens + 8, n_batch=512,
                verbose=False, flash_attn=flash_attn)
    llm.eval(prompt)
    out = []
    for _ in range(tokens):
        out.append(int(llm.sample(temp=0.0)))
        llm.eval([out[-1]])
    return out


def parts_at(a, b):
    """The first index where a and b differ; the shorter length when one is a prefix."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "tessera-cli"], cwd=ROOT, check=True)
    with open(os.path.join(ROOT, "fixtures", "smollm2", "expected.json")) as f:
        fixtures = json.load(f)["prompts"]
    prompts = [(p["user_message"], p["prompt_token_ids"], p["generated_token_ids"]) for p in fixtures]
    bench = tessera(["--max-tokens", "1", "--chat", BENCH_PROMPT])["prompt_token_ids"]
    prompts.append((BENCH_PROMPT, bench, None))
    print(f"SmolLM2-135M-Instruct Q4_1, greedy, {args.tokens} tokens (no stop at EOS): the index of "
          "the first token where two runs part ('all' when they never do; transformers' "
          "reference stops at its EOS)\n")
    print("| prompt | fast vs llama.cpp FA on | fast vs llama.cpp FA off | exact vs llama.cpp FA on "
          "| llama.cpp FA on vs off | fast vs transformers | exact vs transformers "
          "| llama.cpp FA on vs transformers |")
    print("|---|---|---|---|---|---|---|---|")
    for message, ids, reference in prompts:
        run = lambda precision: tessera(["--prompt-tokens", ",".join(map(str, ids)), "--ignore-eos",
                                         "--max-tokens", str(args.tokens), "--precision", precision])["tokens"]
        fast, exact = run("fast"), run("exact")
        on, off = llamacpp(ids, args.tokens, True), llamacpp(ids, args.tokens, False)

        def cell(a, b):
            if b is None:
                return "-"
            i = parts_at(a, b)
            return "all" if i == min(len(a), len(b)) else str(i)
        print(f"| {message[:40]} | {cell(fast, on)} | {cell(fast, off)} | {cell(exact, on)} "
              f"| {cell(on, off)} | {cell(fast, reference)} | {cell(exact, reference)} "
              f"| {cell(on, reference)} |")


if __name__ == "__main__":
    main()
