"""The four serving recipes of the README ("Serving"), each answered for real beyond L.

SmolLM2-135M-Instruct (L = 8192), a prompt of ~8,600 tokens of real text (Areopagitica, from
ggufrope.corpus), n_ctx 12288, one chat completion per server through the real ``openai``
client on 127.0.0.1 (a free port per server, max_tokens 8, temperature 0):

a. ``python -m llama_cpp.server --model OUT.gguf --n_ctx 12288`` on the file written by
   ``ggufrope set MODEL --method mixed --b 0.625 --logn -o OUT.gguf`` (the CLI);
b. the same server on the PLAIN model with ``--kv_overrides ...`` as printed by
   ``ggufrope show --override-kv-format python OUT.gguf``;
c. the patched ``llama-server -m OUT.gguf -c 12288 -np 1`` (``make tools``, build/tools/bin);
d. ``llama-server`` on the PLAIN model with the ``--override-kv`` flags printed by
   ``ggufrope show --override-kv OUT.gguf``.

Each asserts that the answer arrives with usage.prompt_tokens > 8192 and that the server's log
names the method (the library's / llama-server's ggufrope line: also the proof that the patched
library is the one the server process loaded); llama-server's slot holds 12288 tokens, not the
8192 an unpatched one caps it at (its log, /props and /slots). Every server is terminated in a
``finally``; its log is written to a file in the test's tmp dir. Prefill of ~8.6k tokens takes
~45-60 s on 2 CPU cores, so one request per server.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, stop_process

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = ROOT / "build" / "tools" / "bin" / "llama-server"
L = 8192
N_CTX = 12288
PROMPT_TOKENS = 8600  # the document part of the prompt, about
PROMPT_CHARS = 36_000  # ~4.2 characters a token of this text under SmolLM2's tokenizer
LOAD_TIMEOUT = 120  # s, model load until the server answers
REQUEST_TIMEOUT = 300  # s, one chat completion (prefill ~45-60 s when the cores are free)

#: the line each server's log has for OUT.gguf's method (dynamic k, ratio 2, b 0.625, log-n)
PY_METHOD = re.compile(r"rope_ntk_init: ggufrope: rope method = ntk-mixed, k dynamic \(.*\), b = 0\.6250, "
                       r"log-n = on \(n_ctx_orig = 8192\)")
#: llama_cpp.server's log once the prompt passes L: dynamic k steps from 1 to 2
PY_DYNAMIC = re.compile(r"rope_ntk_dynamic_update: ggufrope: dynamic k 1 -> 2 at n = \d+: KV cache re-rotated")
SRV_METHOD = re.compile(r"load_model: ggufrope: rope method = ntk-mixed, k dynamic \(ratio 2\), b = 0\.625, "
                        r"log-n on \(n_ctx_orig = 8192\); n_ctx_train = 16384")


def _ggufrope(*args: str) -> str:
    exe = Path(sys.executable).parent / "ggufrope"
    r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def model() -> Path:
    from ggufrope.models import default_model_path

    return Path(default_model_path())


@pytest.fixture(scope="module")
def out_gguf(tmp_path_factory, model: Path) -> Path:
    """``ggufrope set MODEL --method mixed --b 0.625 --logn -o OUT.gguf``, the CLI."""
    out = tmp_path_factory.mktemp("servers") / "out.gguf"
    _ggufrope("set", model, "--method", "mixed", "--b", "0.625", "--logn", "-o", out)
    return out


@pytest.fixture(scope="module")
def prompt(model: Path) -> str:
    """A question after ~8,600 tokens of Areopagitica (more than L = 8192 tokens in all)."""
    from ggufrope.corpus import demo_text
    from ggufrope.generate import count_tokens

    text = demo_text(PROMPT_CHARS)
    n = count_tokens(model, text)
    assert L + 200 < n < N_CTX - 1000, n
    return text + "\n\nIn one sentence: what is this text about?"


class Server:
    """A server process on 127.0.0.1:port, its stdout and stderr in ``log``."""

    def __init__(self, argv: list[str], log: Path, ready_path: str, port: int):
        self.argv, self.log, self.port = argv, log, port
        self.base = f"http://127.0.0.1:{port}"
        self._f = open(log, "w")
        self._f.write("$ " + shlex.join(argv) + "\n")
        self._f.flush()
        self.proc = subprocess.Popen(argv, stdout=self._f, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + LOAD_TIMEOUT
        while True:
            assert self.proc.poll() is None, f"{argv[0]} exited ({self.proc.returncode}):\n{self.text()[-4000:]}"
            try:
                with urllib.request.urlopen(self.base + ready_path, timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            assert time.monotonic() < deadline, f"{argv[0]} not ready after {LOAD_TIMEOUT} s:\n{self.text()[-4000:]}"
            time.sleep(0.5)

    def get_json(self, path: str):
        import json

        with urllib.request.urlopen(self.base + path, timeout=30) as r:
            return json.loads(r.read())

    def text(self) -> str:
        if not self._f.closed:
            self._f.flush()
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.proc, timeout=20)
        self._f.close()


def _serve(argv_of_port, log: Path, ready_path: str, prompt: str):
    """Start the server, ask one chat completion with the real openai client, stop the server.
    Returns (completion, server, seconds of the request); the server is stopped in any case."""
    from openai import OpenAI

    port = free_port()
    srv = Server(argv_of_port(port), log, ready_path, port)
    try:
        client = OpenAI(base_url=srv.base + "/v1", api_key="none", timeout=REQUEST_TIMEOUT, max_retries=0)
        t = time.monotonic()
        resp = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0)
        dt = time.monotonic() - t
        extra = {}
        if ready_path == "/health":  # llama-server: what the slot holds
            extra = {"props": srv.get_json("/props"), "slots": srv.get_json("/slots")}
        return resp, srv, dt, extra
    finally:
        srv.stop()


def _check_answer(resp, dt: float, log: Path) -> None:
    assert resp.choices and resp.choices[0].message.content is not None
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.usage.prompt_tokens > L, resp.usage
    assert resp.usage.prompt_tokens + resp.usage.completion_tokens <= N_CTX
    print(f"\n{log.name}: prompt_tokens {resp.usage.prompt_tokens}, answer {resp.choices[0].message.content!r}, "
          f"{dt:.1f} s")


def _python_server(model: Path, *more: str):
    return lambda port: [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--n_ctx", str(N_CTX),
                         "--flash_attn", "true", *more, "--host", "127.0.0.1", "--port", str(port)]


def _llama_server(model: Path, *more: str):
    assert LLAMA_SERVER.is_file(), f"{LLAMA_SERVER} is missing: run make tools"
    return lambda port: [str(LLAMA_SERVER), "-m", str(model), "-c", str(N_CTX), *more, "-np", "1",
                         "--host", "127.0.0.1", "--port", str(port)]


# ----------------------------------------------------------------------------- llama-cpp-python's server

def test_python_server_with_set_file(out_gguf: Path, prompt: str, tmp_path: Path) -> None:
    # the server extra left the patched library in place
    r = subprocess.run([sys.executable, "-c", "import llama_cpp.llama_cpp as l; l._lib.llama_ggufrope_version"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    log = tmp_path / "python-server-set.log"
    resp, srv, dt, _ = _serve(_python_server(out_gguf), log, "/v1/models", prompt)
    _check_answer(resp, dt, log)
    assert PY_METHOD.search(srv.text()), srv.text()[-4000:]
    assert PY_DYNAMIC.search(srv.text()), srv.text()[-4000:]


def test_python_server_plain_file_with_kv_overrides(model: Path, out_gguf: Path, prompt: str, tmp_path: Path) -> None:
    from ggufrope.rope_metadata import read_rope_metadata

    assert read_rope_metadata(model)["ggufrope_keys"] == {}  # plain: the method comes from the overrides
    flags = shlex.split(_ggufrope("show", "--override-kv-format", "python", out_gguf))
    assert flags[0] == "--kv_overrides" and len(flags) == 4, flags
    log = tmp_path / "python-server-plain.log"
    resp, srv, dt, _ = _serve(_python_server(model, *flags), log, "/v1/models", prompt)
    _check_answer(resp, dt, log)
    text = srv.text()
    assert PY_METHOD.search(text), text[-4000:]
    assert PY_DYNAMIC.search(text), text[-4000:]
    for f in flags[1:]:  # llama.cpp took every override
        key, value = f.split("=", 1)[0], f.split(":", 1)[1]
        assert re.search(rf"validate_override: Using metadata override \(\s*\w+\) '{re.escape(key)}' = {re.escape(value)}",
                         text), (f, text[:6000])


# ----------------------------------------------------------------------------- the patched llama-server

def _check_slot(srv: Server, extra: dict) -> None:
    text = srv.text()
    assert SRV_METHOD.search(text), text[-4000:]
    assert re.search(rf"n_ctx_slot = {N_CTX}\b", text), text[-4000:]  # not capped at L = 8192
    assert extra["props"]["default_generation_settings"]["n_ctx"] == N_CTX
    assert [s["n_ctx"] for s in extra["slots"]] == [N_CTX]


def test_llama_server_with_set_file(out_gguf: Path, prompt: str, tmp_path: Path) -> None:
    log = tmp_path / "llama-server-set.log"
    resp, srv, dt, extra = _serve(_llama_server(out_gguf), log, "/health", prompt)
    _check_answer(resp, dt, log)
    _check_slot(srv, extra)


def test_llama_server_plain_file_with_override_kv(model: Path, out_gguf: Path, prompt: str, tmp_path: Path) -> None:
    from ggufrope.rope_metadata import read_rope_metadata

    assert read_rope_metadata(model)["ggufrope_keys"] == {}  # plain: the method comes from the overrides
    flags = shlex.split(_ggufrope("show", "--override-kv", out_gguf))
    assert flags[0::2] == ["--override-kv"] * 3, flags
    log = tmp_path / "llama-server-plain.log"
    resp, srv, dt, extra = _serve(_llama_server(model, *flags), log, "/health", prompt)
    _check_answer(resp, dt, log)
    _check_slot(srv, extra)
