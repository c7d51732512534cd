"""ggufrope/generate.py: generate's default n_ctx (fit the prompt and -n) and the chat's library
(ggufrope.generate.Chat): the template in use, the KV cache reused across turns, a turn that
would overflow the context refused with the conversation unchanged, /reset, and the chat command
driven through its stdin. The terminal itself is tests/test_chat_tmux.py.

generate runs on tiny random models (tests/tiny_models.py, a 4,400-token prompt in ~3 s); the
chat runs on the real SmolLM2-135M-Instruct (its chat template, a few short turns)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from ggufrope.cli import main
from ggufrope.errors import GGUFRopeError
from ggufrope.generate import N_CTX_MIN, N_CTX_MULTIPLE, fit_n_ctx

TINY_L = 64
LONG = "t5t6t7t8" * 1100  # 4,400 tokens of the tiny vocabulary: more than the old default 4096
N_LONG = 4400


def _tiny(tmp_path, name: str = "tiny.gguf", **kv):
    from tiny_models import write_tiny_llama

    extra = {f"{{arch}}.{k}": v for k, v in kv.items()}
    extra["tokenizer.ggml.add_space_prefix"] = False  # "t5t6" tokenizes without the byte fallback it lacks
    return write_tiny_llama(tmp_path / name, seed=5, n_ctx_train=TINY_L, extra_kv=extra).path


def test_fit_n_ctx() -> None:
    assert fit_n_ctx(4400, 8) == 4608 and fit_n_ctx(4400, 8) % N_CTX_MULTIPLE == 0
    assert fit_n_ctx(4600, 8) == 4608 and fit_n_ctx(4601, 8) == 4864
    assert fit_n_ctx(3, 10) == N_CTX_MIN == 512
    assert fit_n_ctx(4861, 4096) == 8960  # 8957 rounded up


def test_count_tokens_is_what_generate_evaluates(tmp_path, small_gguf, patched_lib) -> None:
    from ggufrope import runtime
    from ggufrope.generate import count_tokens

    m = _tiny(tmp_path)
    assert count_tokens(m, LONG) == N_LONG
    llm = runtime.load(m, n_ctx=512, n_threads=2)
    assert len(llm.tokenize(LONG.encode(), add_bos=True, special=False)) == N_LONG
    with pytest.raises(GGUFRopeError, match="no such file"):
        count_tokens(tmp_path / "missing.gguf", "x")
    with pytest.raises(GGUFRopeError, match="llama.cpp could not read the vocabulary of .*; run with --verbose"):
        count_tokens(small_gguf, "x")  # a valid GGUF header whose tensors llama.cpp rejects


def test_generate_without_n_ctx_fits_a_prompt_longer_than_4096(tmp_path, patched_lib) -> None:
    """No -c and a 4,400-token prompt (the old default 4096 refused it): n_ctx is the prompt +
    -n rounded up, said before loading and in the summary line, and the static auto k of a
    method chosen at load time follows it (4608 / L 64 = 72)."""
    m = _tiny(tmp_path)
    r = CliRunner().invoke(main, ["generate", str(m), "-p", LONG, "-n", "8", "-t", "1", "-m", "mixed", "--static"])
    assert r.exit_code == 0, r.output
    want = fit_n_ctx(N_LONG, 8)
    assert want == 4608 >= N_LONG + 8
    assert f"[ggufrope] n_ctx {want}: the prompt's {N_LONG} tokens + -n 8, rounded up (-c N to choose)" in r.stderr
    summary = [x for x in r.stderr.splitlines() if x.startswith("[ggufrope] prompt ")]
    assert len(summary) == 1 and summary[0].startswith(f"[ggufrope] prompt {N_LONG} tokens in ")
    assert summary[0].endswith(f"n_ctx {want}")
    assert f"k = 72 (auto, resolved by llama.cpp at n_ctx_seq {want}, L {TINY_L})" in r.stderr
    assert re.search(rf"prefill: 100%\|.*\| {N_LONG}/{N_LONG} ", r.stderr)  # the bar: longer than one batch
    assert r.stdout.strip()


def test_generate_explicit_n_ctx_wins(tmp_path, patched_lib) -> None:
    m = _tiny(tmp_path)
    r = CliRunner().invoke(main, ["generate", str(m), "-p", LONG, "-n", "8", "-t", "1", "-c", "4096"])
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert r.stderr.splitlines()[-1] == (f"ggufrope: error: the prompt has {N_LONG} tokens: with -n 8 it needs "
                                         f"n_ctx >= {N_LONG + 8}, got 4096 (raise --n-ctx)")
    assert "Traceback" not in r.output and "[ggufrope] n_ctx" not in r.stderr


def test_generate_short_prompt_gets_the_minimum_and_no_bar(tmp_path, patched_lib) -> None:
    m = _tiny(tmp_path)
    r = CliRunner().invoke(main, ["generate", str(m), "-p", "t5t6t7t8", "-n", "4", "-t", "1"])
    assert r.exit_code == 0, r.output
    assert f"[ggufrope] n_ctx {N_CTX_MIN}: the prompt's 4 tokens + -n 4" in r.stderr
    assert r.stderr.rstrip().endswith(f"n_ctx {N_CTX_MIN}") and "prefill:" not in r.stderr


@pytest.mark.parametrize("cmd", ["generate", "chat"])
def test_unreadable_model_without_n_ctx_is_one_line(tmp_path, cmd) -> None:
    """Sizing the context reads the file first: the same one-line error as with -c."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    doc = tmp_path / "doc.txt"
    doc.write_text("hello", encoding="utf-8")
    args = ["-p", "hello"] if cmd == "generate" else ["-f", str(doc)]
    for extra in ([], ["-c", "512"]):
        r = CliRunner().invoke(main, [cmd, str(bad), *args, "-n", "4", *extra])
        assert r.exit_code == 2 and r.stderr == f"ggufrope: error: {bad}: unsupported GGUF version 0; ggufrope reads " \
            "versions 2 and 3\n", r.output


def test_template_line_is_honest() -> None:
    from ggufrope.generate import chat_template, template_family

    fallback = chat_template(SimpleNamespace(metadata={}))
    assert not fallback.from_gguf and "<|im_start|>" in fallback.source
    assert fallback.line().startswith("chat template: none in the GGUF (no tokenizer.chat_template): ChatML")
    own = chat_template(SimpleNamespace(metadata={"tokenizer.chat_template": "{{ messages }}"}))
    assert own.from_gguf and own.line() == ("chat template: from the GGUF (tokenizer.chat_template, a format "
                                            "ggufrope does not name)")
    assert template_family("<|start_header_id|>user<|end_header_id|>") == "Llama 3"


# --- the chat on the real model ------------------------------------------------------------

DOC = ("The capital of Freedonia is Sylvania City. Sylvania City has a population of twelve thousand people, "
       "and a river called the Blue Snake runs through it.")


def _counting(llm) -> list[int]:
    """Record how many tokens each call of ``llm.eval`` evaluates (it still evaluates them)."""
    seen: list[int] = []
    real = llm.eval

    def counted(tokens):
        seen.append(len(tokens))
        return real(tokens)

    llm.eval = counted
    return seen


@pytest.mark.real_model
def test_chat_reuses_the_cache_and_refuses_an_overflowing_turn(smollm2, patched_lib) -> None:
    from ggufrope import runtime
    from ggufrope.generate import Chat, ContextFull

    llm = runtime.load(smollm2, n_ctx=512, n_threads=1, n_threads_batch=1)
    chat = Chat(llm, document=DOC, n_predict=24)
    assert chat.template.from_gguf and "ChatML" in chat.template.line()
    seen = _counting(llm)
    chat.prefill_document()
    assert sum(seen) == chat.document_tokens == llm.n_tokens > 40
    seen.clear()
    a1 = "".join(chat.ask("What is the capital of Freedonia?"))
    assert "Sylvania" in a1 and chat.turns == [("What is the capital of Freedonia?", a1)]
    assert seen[0] < 20  # the question only: the document was in the cache

    # the overflowing turn: refused before anything runs, the conversation and cache unchanged
    n_before, ids_before = llm.n_tokens, llm.input_ids[: llm.n_tokens].copy()
    seen.clear()
    with pytest.raises(ContextFull) as e:
        chat.ask("word " * 500)
    assert e.value.n_ctx == 512 and e.value.needed > 512
    msg = str(e.value)
    assert msg.startswith(f"this turn needs {e.value.needed} tokens (") and "the context holds 512: " in msg
    assert "/reset to drop the earlier turns (the document stays)" in msg and "--n-ctx" in msg
    assert seen == [] and llm.n_tokens == n_before and (llm.input_ids[:n_before] == ids_before).all()
    assert len(chat.turns) == 1

    # the next turn re-evaluates only what follows the cached prefix (no document)
    t2 = chat.tokens("How many people live there?")
    keep = chat.cached_prefix(t2)
    assert keep > chat.document_tokens
    seen.clear()
    a2 = "".join(chat.ask("How many people live there?"))
    assert a2.strip() and sum(seen[:1]) == len(t2) - keep and len(chat.turns) == 2

    # /reset: the turns go, the document stays, in the conversation and in the cache
    chat.reset()
    assert chat.turns == []
    t3 = chat.tokens("Which river runs through Sylvania City?")
    assert chat.cached_prefix(t3) >= chat.document_tokens - 2  # the question may merge with the last tokens
    a3 = "".join(chat.ask("Which river runs through Sylvania City?"))
    assert a3.strip() and len(chat.turns) == 1


@pytest.mark.real_model
def test_chat_document_larger_than_the_context_is_one_line(smollm2, tmp_path, patched_lib) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC * 20, encoding="utf-8")
    r = CliRunner().invoke(main, ["chat", str(smollm2), "-f", str(doc), "-c", "256", "-t", "2"], input="hi\n")
    assert r.exit_code == 2 and r.stdout == "", r.output
    last = r.stderr.splitlines()[-1]
    assert re.fullmatch(r"ggufrope: error: the document takes \d+ tokens in the chat template: with -n 256 a first "
                        r"turn needs n_ctx > \d+, got 256 \(raise --n-ctx, or leave it out to fit the document\)",
                        last), r.stderr


@pytest.mark.real_model
def test_chat_command_goes_on_after_a_refusal(smollm2, tmp_path, patched_lib) -> None:
    """The chat command on piped stdin: default n_ctx from the document, the template named,
    an overflowing turn refused on one line, the next turn answered, /reset, EOF ends it
    with status 0."""
    from ggufrope.generate import CHAT_BUDGET, count_tokens

    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    n_doc = count_tokens(smollm2, DOC)
    n_ctx = fit_n_ctx(n_doc, CHAT_BUDGET)
    turns = ["What is the capital of Freedonia?", "word " * (n_ctx + 10), "/reset", "/nope",
             "How many people live in Sylvania City?"]
    r = CliRunner().invoke(main, ["chat", str(smollm2), "-f", str(doc), "-n", "24", "-t", "1"],
                           input="".join(t + "\n" for t in turns))
    assert r.exit_code == 0, r.output
    err = r.stderr
    assert f"[ggufrope] n_ctx {n_ctx}: the document's {n_doc} tokens + {CHAT_BUDGET} for the conversation" in err
    assert "[ggufrope] chat template: from the GGUF (tokenizer.chat_template, ChatML markers)" in err
    refusals = [x for x in err.splitlines() if x.startswith("ggufrope: this turn needs ")]
    assert len(refusals) == 1 and f"the context holds {n_ctx}: " in refusals[0], err
    assert "[ggufrope] conversation cleared (the document stays)" in err
    assert err.count("/exit or Ctrl-D ends it") == 2  # on start, and the hint for /nope
    answers = re.findall(r"model> (.*)", r.stdout)
    assert len(answers) == 2 and "Sylvania" in answers[0] and answers[1].strip(), r.stdout
    assert "prefill:" not in err  # stdin and stderr are not a terminal: no bar
    assert "Traceback" not in r.output
