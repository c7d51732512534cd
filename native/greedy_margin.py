"""The top logits where two greedy runs part (native/gpu-check.sh step 4: GPU against CPU).

    .venv/bin/python native/greedy_margin.py MODEL PROMPT_FILE TEXT_FILE CHAR [--n-ctx 16384] [-ngl 0]

Loads MODEL as ``ggufrope generate`` does (``ggufrope.runtime.load``, the file's method), evaluates
the prompt (BOS added) and the generated tokens of TEXT_FILE (one run's output) that make up its
first CHAR characters (where gpu-check says the runs differ), and prints the five largest next-token
logits: a gap of a few hundredths between the top two is a near-tie that a backend's rounding
can flip. Exit status 2 with a one-line error on bad input.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("prompt_file")
    ap.add_argument("text_file")
    ap.add_argument("char", type=int)
    ap.add_argument("--n-ctx", type=int, default=16384)
    ap.add_argument("-ngl", "--gpu-layers", type=int, default=0)
    a = ap.parse_args()
    try:
        prompt, text = open(a.prompt_file, encoding="utf-8").read(), open(a.text_file, encoding="utf-8").read()
    except OSError as e:
        sys.exit(f"greedy_margin: error: {e.filename}: {e.strerror}")
    if not 0 < a.char <= len(text):
        sys.exit(f"greedy_margin: error: CHAR must be in 1..{len(text)}")

    import llama_cpp

    from ggufrope import runtime
    from ggufrope.errors import GGUFRopeError

    try:
        llm = runtime.load(a.model, n_ctx=a.n_ctx, n_batch=512, n_ubatch=512, n_gpu_layers=a.gpu_layers, verbose=False)
    except GGUFRopeError as e:
        sys.exit(f"greedy_margin: error: {e}")
    toks = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
    prefix: list[int] = []
    for t in llm.tokenize(text.encode("utf-8"), add_bos=False, special=False):
        if len(llm.detokenize(prefix + [t]).decode("utf-8", "ignore")) > a.char:
            break
        prefix.append(t)
    if len(toks) + len(prefix) >= a.n_ctx:
        sys.exit(f"greedy_margin: error: {len(toks) + len(prefix)} tokens do not fit n_ctx {a.n_ctx}")
    llm.eval(toks + prefix)
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
    print(f"after {llm.detokenize(prefix).decode('utf-8', 'replace')!r}:")
    for t in np.argsort(logits)[::-1][:5]:
        print(f"  {llm.detokenize([int(t)]).decode('utf-8', 'replace')!r:>16} {float(logits[t]):.4f}")


if __name__ == "__main__":
    main()
