"""Long-context generation with a loaded ``llama_cpp.Llama``: chunked prefill with a progress
bar, then token-by-token decoding streamed as text; and the terminal chat (:class:`Chat`):
the model's chat template rendered here, the KV cache reused across turns, turns that would
overflow the context refused before anything runs."""

from __future__ import annotations

import codecs
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .errors import GGUFRopeError

#: n_ctx when nothing sizes it (chat without a document); what -c defaulted to before
N_CTX_DEFAULT = 4096
#: a fitted n_ctx is a multiple of this (llama.cpp allocates contexts in multiples of 256)
N_CTX_MULTIPLE = 256
#: the smallest fitted n_ctx
N_CTX_MIN = 512
#: tokens a chat with a document gets beyond the document when -c is left out
CHAT_BUDGET = 4096


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


def fit_n_ctx(n_tokens: int, extra: int) -> int:
    """The n_ctx that holds ``n_tokens`` plus ``extra``: their sum rounded up to a multiple
    of :data:`N_CTX_MULTIPLE`, at least :data:`N_CTX_MIN`."""
    n = n_tokens + extra
    return max(N_CTX_MIN, -(-n // N_CTX_MULTIPLE) * N_CTX_MULTIPLE)


def count_tokens(model_path: str | os.PathLike, text: str, *, add_bos: bool = True, verbose: bool = False) -> int:
    """The number of tokens of ``text`` in the vocabulary of ``model_path`` (BOS included when
    ``add_bos`` and the vocabulary adds one; special tokens as text), as :func:`generate`
    tokenizes a prompt; for sizing a context before it is created. Loads the vocabulary only
    (no weights, no context; ~0.2 s). Raises :class:`GGUFRopeError` when llama.cpp cannot."""
    import llama_cpp
    from llama_cpp import _logger

    from .rope_metadata import read_rope_metadata

    read_rope_metadata(model_path)  # a missing or malformed file: the same message as with --n-ctx
    _logger.set_verbose(verbose)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(os.fspath(model_path).encode("utf-8"), params)
    if not model:
        raise GGUFRopeError(f"llama.cpp could not read the vocabulary of {os.fspath(model_path)} (to size the "
                            "context); run with --verbose for its log, or give --n-ctx")
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        raw = text.encode("utf-8")
        # no buffer: llama_tokenize returns the count negated (llama.h), or INT32_MIN on overflow
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), None, 0, add_bos, False)
        if n == -(2**31):
            raise GGUFRopeError("llama.cpp could not tokenize the text (more than 2^31 tokens)")
        return -n
    finally:
        llama_cpp.llama_model_free(model)


def _show_bar(llm: Any, n_new: int, progress: bool) -> bool:
    """A prefill bar is shown when asked for and the part to evaluate is longer than one batch."""
    return progress and n_new > llm.n_batch


def prefill(llm: Any, tokens: list[int], *, progress: bool = False, keep: int = 0) -> float:
    """Evaluate ``tokens`` in ``llm.n_batch`` chunks; returns seconds. ``keep``: the first
    ``keep`` tokens are already in the KV cache (a common prefix, ``llm.input_ids``) and are
    kept; 0 starts from an empty context. A progress bar with an ETA goes to stderr when
    ``progress`` is set and more than one batch is to be evaluated."""
    from tqdm import tqdm

    if keep <= 0:
        llm.reset()
        keep = 0
    else:
        llm.n_tokens = keep  # llm.eval removes the cells from keep on (llama_memory_seq_rm)
    new = tokens[keep:]
    t0 = time.perf_counter()
    with tqdm(total=len(new), unit="tok", desc="prefill", disable=not _show_bar(llm, len(new), progress),
              file=sys.stderr, dynamic_ncols=True) as bar:
        for i in range(0, len(new), llm.n_batch):
            chunk = new[i : i + llm.n_batch]
            llm.eval(chunk)
            bar.update(len(chunk))
    return time.perf_counter() - t0


def _decode(llm: Any, n_predict: int, temp: float, seed: int) -> Iterator[str]:
    """Sample up to ``n_predict`` tokens after what the context holds (greedy when ``temp`` is
    0), evaluating each, and yield their text; stops at an end-of-generation token (not
    evaluated). ``llm.n_tokens`` counts what the context holds after each piece."""
    import llama_cpp

    llm.set_seed(seed)
    vocab = llm._model.vocab
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for _ in range(n_predict):
        tok = llm.sample(temp=temp, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0)
        if llama_cpp.llama_vocab_is_eog(vocab, tok):
            break
        text = decoder.decode(llm.detokenize([tok]))
        if text:
            yield text
        llm.eval([tok])
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail


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
    token. With ``progress``, a prompt longer than one batch shows a progress bar, and the
    timings and n_ctx are printed to stderr at the end.
    """
    tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=add_bos, special=False)
    n_ctx = llm.n_ctx()
    if len(tokens) + n_predict > n_ctx:
        raise GGUFRopeError(
            f"the prompt has {len(tokens)} tokens: with -n {n_predict} it needs n_ctx >= {len(tokens) + n_predict}, "
            f"got {n_ctx} (raise --n-ctx)"
        )
    t_prefill = prefill(llm, tokens, progress=progress)
    n_start = llm.n_tokens
    t0 = time.perf_counter()
    yield from _decode(llm, n_predict, temp, seed)
    if progress:
        n_gen = llm.n_tokens - n_start
        t_dec = time.perf_counter() - t0
        print(
            f"\n[ggufrope] prompt {len(tokens)} tokens in {t_prefill:.1f} s ({len(tokens) / max(t_prefill, 1e-9):.1f} "
            f"tok/s); generated {n_gen} tokens in {t_dec:.1f} s ({n_gen / max(t_dec, 1e-9):.1f} tok/s); n_ctx {n_ctx}",
            file=sys.stderr,
        )


# --- chat --------------------------------------------------------------------------------


class ContextFull(GGUFRopeError):
    """A chat turn that would overflow the context: ``needed`` tokens (the conversation with
    the new message, as the template renders it, plus -n), the context holds ``n_ctx``.
    Raised before anything is evaluated; the conversation is unchanged."""

    def __init__(self, message: str, needed: int, n_ctx: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.n_ctx = n_ctx


#: markers of well-known chat formats, for the line that names the template in use
_TEMPLATE_FAMILIES = (
    ("<|im_start|>", "ChatML"),
    ("<|start_header_id|>", "Llama 3"),
    ("<start_of_turn>", "Gemma"),
    ("[INST]", "[INST] (Llama 2 / Mistral)"),
    ("<|user|>", "<|user|> (Zephyr / Phi-3)"),
)


def template_family(template: str) -> str | None:
    """The well-known chat format whose markers ``template`` uses (ChatML, Llama 3, ...), or None."""
    for marker, name in _TEMPLATE_FAMILIES:
        if marker in template:
            return name
    return None


@dataclass(frozen=True)
class ChatTemplate:
    """The chat template a :class:`Chat` renders: ``source`` (Jinja2), whether it comes
    ``from_gguf`` (``tokenizer.chat_template``) or is the ChatML fallback, and ``line()``, one
    honest line saying which."""

    source: str
    from_gguf: bool

    def line(self) -> str:
        if self.from_gguf:
            fam = template_family(self.source)
            what = f"{fam} markers" if fam else "a format ggufrope does not name"
            return f"chat template: from the GGUF (tokenizer.chat_template, {what})"
        return ("chat template: none in the GGUF (no tokenizer.chat_template): ChatML, llama-cpp-python's "
                "CHATML_CHAT_TEMPLATE, which this model may not know")


def chat_template(llm: Any) -> ChatTemplate:
    """The chat template of a loaded model: the GGUF's ``tokenizer.chat_template``, else ChatML."""
    from llama_cpp.llama_chat_format import CHATML_CHAT_TEMPLATE

    t = (getattr(llm, "metadata", None) or {}).get("tokenizer.chat_template")
    if t:
        return ChatTemplate(t, True)
    return ChatTemplate(CHATML_CHAT_TEMPLATE, False)


class TemplateRenderer:
    """A loaded model's chat template (:func:`chat_template`, or ``template``) rendered with
    llama-cpp-python's Jinja2 formatter (the model's BOS and EOS texts as ``bos_token`` and
    ``eos_token``), and text tokenized as llama.cpp's server tokenizes a rendered prompt:
    special tokens parsed, BOS added when the vocabulary asks for one and the text does not
    already begin with it (a template that writes ``{{ bos_token }}`` gets no second BOS)."""

    def __init__(self, llm: Any, template: ChatTemplate | None = None) -> None:
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.llm = llm
        self.template = template or chat_template(llm)
        model = llm._model
        bos, eos = llm.token_bos(), llm.token_eos()
        self.bos_text = model.token_get_text(bos) if bos != -1 else ""
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(model.vocab))
        self._formatter = Jinja2ChatFormatter(self.template.source, bos_token=self.bos_text,
                                              eos_token=model.token_get_text(eos) if eos != -1 else "")

    def render(self, messages: list[dict[str, str]], what: str = "this conversation") -> str:
        """The prompt text of ``messages``, ending with the generation prompt. Raises
        :class:`GGUFRopeError` naming ``what`` when the template cannot render them."""
        try:
            return self._formatter(messages=messages).prompt
        except Exception as e:  # jinja2 errors, the template's raise_exception (ValueError)
            raise GGUFRopeError(f"the chat template cannot render {what}: {e}") from None

    def tokenize(self, text: str) -> list[int]:
        """``text``'s tokens, special tokens parsed, BOS as the class docstring says."""
        add_bos = self.add_bos and not (self.bos_text and text.startswith(self.bos_text))
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)


class Chat:
    """A conversation with a loaded model, in its chat template (:func:`chat_template`).

    ``system``: a system prompt; ``document``: a text put before the first question of the
    conversation (in the first user message, and again after :meth:`reset`). Each turn renders
    the whole conversation, tokenizes it, evaluates only the tokens after the longest prefix
    already in the KV cache (so a document is prefilled once), then decodes up to
    ``n_predict`` tokens. :meth:`ask` refuses a turn that would not fit (:class:`ContextFull`)
    before evaluating anything, leaving the conversation as it was. ``progress``: a bar on
    stderr when more than one batch is to be prefilled.

    Raises :class:`GGUFRopeError` when the template cannot be rendered, or when the document
    alone, with ``n_predict``, does not fit the context."""

    def __init__(self, llm: Any, *, system: str | None = None, document: str | None = None, n_predict: int = 256,
                 temp: float = 0.0, seed: int = 0, progress: bool = False) -> None:
        self.llm = llm
        self.system = system
        self.document = document
        self.n_predict = n_predict
        self.temp = temp
        self.seed = seed
        self.progress = progress
        self.turns: list[tuple[str, str]] = []
        self._renderer = TemplateRenderer(llm)
        self.template = self._renderer.template
        self.n_ctx = llm.n_ctx()
        self.document_tokens = 0
        if document is not None:
            pre = self._document_prefix()
            self.document_tokens = len(pre)
            if len(pre) + n_predict > self.n_ctx:
                raise GGUFRopeError(
                    f"the document takes {len(pre)} tokens in the chat template: with -n {n_predict} a first turn "
                    f"needs n_ctx > {len(pre) + n_predict}, got {self.n_ctx} (raise --n-ctx, or leave it out to fit "
                    "the document)")
        else:
            self._render(self._messages("?"))  # a template that cannot render fails here, not at the first turn

    # rendering

    def _messages(self, user: str) -> list[dict[str, str]]:
        msgs: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []
        for i, (q, a) in enumerate(self.turns):
            msgs.append({"role": "user", "content": self._with_document(q, i == 0)})
            msgs.append({"role": "assistant", "content": a})
        msgs.append({"role": "user", "content": self._with_document(user, not self.turns)})
        return msgs

    def _with_document(self, text: str, first: bool) -> str:
        return f"{self.document}\n\n{text}" if first and self.document is not None else text

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self._renderer.render(messages)

    def _tokenize(self, text: str) -> list[int]:
        return self._renderer.tokenize(text)

    def _document_prefix(self) -> list[int]:
        """The tokens of the conversation up to the end of the document (system prompt,
        template, document), what every first question shares."""
        mark = "\x00ggufrope-question\x00"
        text = self._render(self._messages(mark))
        return self._tokenize(text[: text.index(mark)])

    def tokens(self, user: str) -> list[int]:
        """The conversation with ``user`` as the next message, rendered and tokenized, ending
        with the template's generation prompt."""
        return self._tokenize(self._render(self._messages(user)))

    # the context

    def check(self, user: str) -> list[int]:
        """:meth:`tokens`, or :class:`ContextFull` when they and ``n_predict`` exceed the context."""
        toks = self.tokens(user)
        need = len(toks) + self.n_predict
        if need > self.n_ctx:
            ways = ["send a shorter message"]
            if self.turns:
                ways.append("/reset to drop the earlier turns" + (" (the document stays)" if self.document else ""))
            ways.append("or restart with a larger --n-ctx (or a smaller -n)")
            raise ContextFull(
                f"this turn needs {need} tokens ({len(toks)} of conversation + -n {self.n_predict}), the context holds "
                f"{self.n_ctx}: {', '.join(ways)}", need, self.n_ctx)
        return toks

    def cached_prefix(self, tokens: list[int], *, leave_one: bool = True) -> int:
        """How many of ``tokens`` the KV cache holds already (the common prefix with
        ``llm.input_ids``); with ``leave_one`` at most all but one (a turn evaluates its last
        token for the logits of the answer's first)."""
        import numpy as np

        n = min(self.llm.n_tokens, len(tokens) - (1 if leave_one else 0))
        if n <= 0:
            return 0
        diff = np.nonzero(self.llm.input_ids[:n] != np.asarray(tokens[:n], dtype=self.llm.input_ids.dtype))[0]
        return int(diff[0]) if len(diff) else n

    def _prefill(self, tokens: list[int], leave_one: bool = True) -> None:
        keep = self.cached_prefix(tokens, leave_one=leave_one)
        if keep and not self.llm._ctx.kv_cache_seq_rm(-1, keep, -1):
            keep = 0  # a memory that cannot drop a tail (recurrent models): start over
        prefill(self.llm, tokens, progress=self.progress, keep=keep)

    def prefill_document(self) -> None:
        """Evaluate the system prompt and the document now (what every first question shares),
        so that the first answer starts without the long prefill."""
        if self.document is not None:
            self._prefill(self._document_prefix(), leave_one=False)

    def ask(self, user: str) -> Iterator[str]:
        """Check the turn (:class:`ContextFull` leaves everything as it was), prefill what the
        KV cache lacks, then return an iterator of the answer's pieces. The turn joins the
        conversation when the iterator ends, or is closed or interrupted after some text."""
        toks = self.check(user)
        self._prefill(toks)
        return self._answer(user)

    def _answer(self, user: str) -> Iterator[str]:
        parts: list[str] = []
        done = False
        try:
            for piece in _decode(self.llm, self.n_predict, self.temp, self.seed):
                parts.append(piece)
                yield piece
            done = True
        finally:
            if done or parts:
                self.turns.append((user, "".join(parts)))

    def reset(self) -> None:
        """Forget the turns; the system prompt and the document stay (and stay in the KV cache)."""
        self.turns.clear()
