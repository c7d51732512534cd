"""Long-context generation with a loaded ``llama_cpp.Llama``: chunked prefill with a progress
bar, then token-by-token decoding streamed as text."""

from __future__ import annotations

import codecs
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from .errors import GGUFRopeError


def read_prompt(prompt: str | None, path: str | os.PathLike | None) -> str:
    """The prompt: ``prompt``, then the UTF-8 text of ``path`` if given.

    Raises :class:`GGUFRopeError` when neither is given, or the file is unreadable or not UTF-8.
    """
    parts = [prompt] if prompt else []
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                parts.append(f.read())
        except FileNotFoundError:
            raise GGUFRopeError(f"{path}: no such file") from None
        except UnicodeDecodeError as e:
            raise GGUFRopeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise GGUFRopeError(f"{path}: {e.strerror}") from None
    if not parts:
        raise GGUFRopeError("give a prompt with -p TEXT or -f FILE")
    return "\n".join(parts)


def prefill(llm: Any, tokens: list[int], *, progress: bool = False) -> float:
    """Evaluate ``tokens`` from an empty context in ``llm.n_batch`` chunks; returns seconds."""
    from tqdm import tqdm

    llm.reset()
    t0 = time.perf_counter()
    with tqdm(total=len(tokens), unit="tok", desc="prefill", disable=not progress, file=sys.stderr,
              dynamic_ncols=True) as bar:
        for i in range(0, len(tokens), llm.n_batch):
            chunk = tokens[i : i + llm.n_batch]
            llm.eval(chunk)
            bar.update(len(chunk))
    return time.perf_counter() - t0


def generate(
    llm: Any,
    prompt: str,
    *,
    n_predict: int = 128,
    temp: float = 0.0,
    seed: int = 0,
    progress: bool = False,
    add_bos: bool = True,
) -> Iterator[str]:
    """Yield the continuation of ``prompt`` piece by piece (greedy when ``temp`` is 0).

    The prompt, BOS included, must fit with ``n_predict`` tokens in ``llm.n_ctx()``; otherwise
    :class:`GGUFRopeError` says how many tokens it has. Generation stops at an end-of-generation
    token. Timings are printed to stderr when ``progress`` is set.
    """
    import llama_cpp

    tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=add_bos, special=False)
    n_ctx = llm.n_ctx()
    if len(tokens) + n_predict > n_ctx:
        raise GGUFRopeError(
            f"the prompt has {len(tokens)} tokens: with -n {n_predict} it needs n_ctx >= {len(tokens) + n_predict}, "
            f"got {n_ctx} (raise --n-ctx)"
        )
    t_prefill = prefill(llm, tokens, progress=progress)
    llm.set_seed(seed)
    vocab = llm._model.vocab
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    n_gen = 0
    t0 = time.perf_counter()
    for _ in range(n_predict):
        tok = llm.sample(temp=temp, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0)
        if llama_cpp.llama_vocab_is_eog(vocab, tok):
            break
        n_gen += 1
        text = decoder.decode(llm.detokenize([tok], prev_tokens=llm.input_ids[: llm.n_tokens].tolist()))
        if text:
            yield text
        llm.eval([tok])
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail
    if progress:
        t_dec = time.perf_counter() - t0
        print(
            f"\n[ggufrope] prompt {len(tokens)} tokens in {t_prefill:.1f} s ({len(tokens) / t_prefill:.1f} tok/s); "
            f"generated {n_gen} tokens in {t_dec:.1f} s ({n_gen / max(t_dec, 1e-9):.1f} tok/s); n_ctx {n_ctx}",
            file=sys.stderr,
        )


def chat_turn(llm: Any, messages: list[dict[str, str]], *, n_predict: int = 256, temp: float = 0.0) -> Iterator[str]:
    """Stream the model's answer to ``messages`` (OpenAI-style dicts) with its chat template."""
    try:
        stream = llm.create_chat_completion(messages=messages, max_tokens=n_predict, temperature=temp, stream=True)
        for chunk in stream:
            piece = chunk["choices"][0]["delta"].get("content")
            if piece:
                yield piece
    except ValueError as e:  # llama-cpp-python: "Requested tokens (...) exceed context window"
        raise GGUFRopeError(str(e)) from None
