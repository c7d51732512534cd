"""ggufrope/evaluation/ppl.py: the perplexity protocol and the summary of its windows.

a. Perplexity of method `none` at n_ctx <= L agrees within 1 % (in fact to ~1e-4) with
   llama.cpp's `llama-perplexity` protocol on the same tokens and windows. There is no
   llama-perplexity binary in this build, so the protocol of tools/perplexity/perplexity.cpp
   (tokenize the whole text once with the vocabulary's special prefix, windows of n_ctx tokens,
   first token -> BOS when the vocabulary adds BOS, score the second half: logits at p predict
   token p + 1 for n_ctx/2 <= p <= n_ctx - 2) is re-implemented here the straightforward way:
   stock `llama_cpp.Llama(logits_all=True)` (not through ggufrope.runtime; flash attention on,
   as llama-perplexity's "auto" resolves on the CPU; one n_ctx-sized batch) and `.eval()` on
   each window, then a float64 log-softmax over every row. The evaluation under test takes a
   different path (runtime.load, the low-level llama_batch with logits only at scored
   positions, 128-token batches). Note: flash attention itself moves this model's per-token
   NLL by up to ~0.36 nats and the perplexity by ~0.5 %, so compare like with like.
   Building the real llama-perplexity tool and comparing with its printed value is the
   stronger check.
b. Within-L perplexity: :func:`ggufrope.evaluation.ppl.summarize_windows` pools the tokens
   predicted from positions p < L (all scored tokens less those beyond L), numbers by hand.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from ggufrope.evaluation import decoder as ED, ppl as EP

THREADS = os.cpu_count() or 1


# --- a. perplexity against llama-perplexity's protocol ---------------------------------------------


def reference_llama_perplexity(model_path, text: str, n_ctx: int, n_chunks: int) -> tuple[float, np.ndarray]:
    """llama-perplexity's default mode, written out with stock llama_cpp.Llama(logits_all=True)."""
    import llama_cpp

    # llama-perplexity's defaults on the CPU: flash attention "auto" resolves to on; n_batch
    # 2048 >= n_ctx, so each window is one batch
    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                          flash_attn=True, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    add_bos = llama_cpp.llama_vocab_get_add_bos(vocab)
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)  # common_tokenize(.., true)
    assert len(tokens) >= n_chunks * n_ctx
    first = n_ctx // 2
    nlls = []
    for i in range(n_chunks):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if add_bos:
            chunk[0] = llama_cpp.llama_vocab_bos(vocab)
        llm.reset()
        llm.eval(chunk)
        logits = np.array(llm.scores[:n_ctx], dtype=np.float64)
        for j in range(first, n_ctx - 1):
            row = logits[j]
            m = row.max()
            nlls.append(m + math.log(np.exp(row - m).sum()) - row[chunk[j + 1]])
    nlls = np.array(nlls)
    return math.exp(nlls.mean()), nlls


@pytest.mark.real_model
def test_ppl_matches_llama_perplexity_protocol(patched_lib, smollm2, text_slice):
    n_ctx, n_chunks = 512, 2
    ref_ppl, ref_nll = reference_llama_perplexity(smollm2, text_slice, n_ctx, n_chunks)

    llm = ED.load_model(smollm2, ED.Setting("none"), n_ctx, n_batch=128, threads=THREADS)
    with ED.Decoder(llm) as dec:
        per_token: list = []
        ws = EP.perplexity(dec, dec.tokenize(text_slice), n_ctx, ED.n_ctx_orig_of(smollm2), max_windows=n_chunks,
                           per_token=per_token)
    ours = np.concatenate([nll for _, nll in per_token])
    assert all((pos == np.arange(n_ctx // 2, n_ctx - 1)).all() for pos, _ in per_token)
    s = EP.summarize_windows(ws)
    assert s["n_windows"] == n_chunks and s["count"] == n_chunks * (n_ctx - n_ctx // 2 - 1) == len(ref_nll)
    assert s["ppl_beyond"] is None and s["count_beyond"] == 0  # n_ctx <= L: nothing beyond L
    rel = abs(s["ppl"] - ref_ppl) / ref_ppl
    print(f"\nppl: batched {s['ppl']:.5f}, llama-perplexity protocol {ref_ppl:.5f}, rel. diff {rel:.2e}; "
          f"max |nll diff| per token {np.abs(ours - ref_nll).max():.2e}")
    assert rel < 0.01
    # same kernels, different batching (one batch vs 128-token batches, all logits vs scored only):
    # the same value token by token (measured: bit-identical)
    assert np.abs(ours - ref_nll).max() < 1e-4
    assert 5 < s["ppl"] < 500  # a real language model on real text


def test_progress_counts_every_decoded_token(patched_lib, tiny, capsys):
    """The perplexity bar counts tokens batch by batch (a long window is minutes on a CPU, so a bar
    in windows would sit at 0/1 without an ETA): on_batch gets each batch's size, scored or not."""
    n_ctx, n_batch = 48, 16
    llm = ED.load_model(tiny.path, ED.Setting("none"), n_ctx, n_batch=n_batch, threads=2)
    with ED.Decoder(llm) as dec:
        toks = [4 + i % 6 for i in range(2 * n_ctx + 5)]
        seen: list[int] = []
        pos, nll = EP.score_window(dec, toks[:n_ctx], 40, 64, on_batch=seen.append)
        assert seen == [16, 16, 16]  # batches 0-15 and 16-31 have no scored position
        assert list(pos) == list(range(40, 47)) and np.isfinite(nll).all()
        ws = EP.perplexity(dec, toks, n_ctx, 64, score_from=40, progress=True, desc="bar")
    assert len(ws) == 2
    err = capsys.readouterr().err
    assert "96.0/96.0" in err and "tok/s" in err and "window=2/2" in err


# --- b. within-L perplexity ---------------------------------------------------------------------


def test_summarize_windows_within_L_by_hand():
    ws = [
        {"nll": 10.0, "count": 8, "nll_beyond": 6.0, "count_beyond": 3, "seconds": 1.0},
        EP.WindowResult(1, 128, 5.0, 4, 5.0, 4, 0.5),  # every token beyond L
    ]
    s = EP.summarize_windows(ws)
    # all: 15 nats over 12 tokens; beyond: 11 over 7; within: 15 - 11 = 4 nats over 12 - 7 = 5
    assert (s["nll_within"], s["count_within"]) == (4.0, 5)
    assert s["ppl_within"] == pytest.approx(math.exp(0.8), rel=1e-15)
    assert s["ppl"] == pytest.approx(math.exp(1.25), rel=1e-15)
    assert s["ppl_beyond"] == pytest.approx(math.exp(11 / 7), rel=1e-15)
    only_beyond = EP.summarize_windows([ws[1]])
    assert only_beyond["ppl_within"] is None and only_beyond["count_within"] == 0
    only_within = EP.summarize_windows([{"nll": 3.0, "count": 2, "nll_beyond": 0.0, "count_beyond": 0, "seconds": 0}])
    assert only_within["ppl_within"] == only_within["ppl"] == pytest.approx(math.exp(1.5))
    assert only_within["ppl_beyond"] is None
