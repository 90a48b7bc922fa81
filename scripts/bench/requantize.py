"""Makes a llama.cpp preset mix (Q4_K_M by default) of a GGUF with llama.cpp's own quantizer
(llama-cpp-python's `llama_model_quantize`), to benchmark the types such files hold:

    .venv-bench/bin/python scripts/bench/requantize.py models/SmolLM2-135M-Instruct.Q4_1.gguf \
        models/SmolLM2-135M-Instruct.Q4_K_M.gguf [--ftype Q4_K_M]
    scripts/bench/vs-llamacpp.sh models/SmolLM2-135M-Instruct.Q4_K_M.gguf

The input here is already quantized (the demo file is the only SmolLM2 GGUF the package
registries carry), so the output is requantized: its types are those of the preset (rows
that are not a multiple of 256 values fall back to Q5_0, Q5_1 or Q8_0 as the preset says),
but its weights are worse than a preset made from the f16 model. Use it for speed, not for
quality.
"""
import argparse
import ctypes
import sys

import llama_cpp


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input")
    parser.add_argument("output")
    parser.add_argument("--ftype", default="Q4_K_M", help="a llama.cpp preset: Q4_K_M, Q5_K_M, Q6_K, ...")
    args = parser.parse_args()
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.ftype}", None)
    if ftype is None:
        sys.exit(f"error: llama.cpp has no preset {args.ftype}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(args.input.encode(), args.output.encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"error: llama.cpp's quantizer failed ({rc})")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
