"""The contract between file, library and tool: the keys `ggufrope set` writes are exactly
those README.md lists, the patched llama.cpp reads exactly those, and none of them is a key
stock llama.cpp reads (so an unpatched build loads a file that carries them)."""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest

from conftest import PATCHED_SRC, PINNED_SDIST, PINNED_VERSION, mapped_llama_libs, stock_child_setup
from ggufrope import keys as K

ROOT = Path(__file__).resolve().parents[1]
PATCHED_ARCH = PATCHED_SRC / "src" / "llama-arch.cpp"
_KV_RE = re.compile(r'\{\s*(LLM_KV_\w+)\s*,\s*"([^"]+)"\s*\}')


def _kv_table(text: str) -> dict[str, str]:
    return dict(_KV_RE.findall(text))


@pytest.fixture(scope="module")
def stock_table() -> dict[str, str]:
    assert PINNED_SDIST.exists(), "the pinned sdist is missing: run make build"
    with tarfile.open(PINNED_SDIST) as tf:
        member = tf.extractfile(f"llama_cpp_python-{PINNED_VERSION}/vendor/llama.cpp/src/llama-arch.cpp")
        return _kv_table(member.read().decode())


def _readme_keys() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Metadata keys", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([^`]+)` \| (?:STRING|FLOAT32|BOOL|ARRAY[^|]*) \|", section, flags=re.M))


def _written_keys(tmp_path, arch: str) -> set[str]:
    from conftest import write_test_gguf

    from ggufrope.gguf_reader import read_header
    from ggufrope.rope_metadata import write_rope_metadata

    src = write_test_gguf(tmp_path / "m.gguf", arch)
    before = {kv.key for kv in read_header(src).kvs}
    seen: set[str] = set()
    for kw in (dict(method="ntk-mixed", exponent=0.5, factor=4.0, logn=True), dict(method="ntk"), dict(method="none", logn=True),
               dict(method="ntk", dynamic=True, dynamic_ratio=1.5)):
        out = tmp_path / "out.gguf"
        write_rope_metadata(src, out, **kw)
        seen |= {kv.key for kv in read_header(out).kvs} - before
    return seen


def test_written_keys_are_those_readme_lists(tmp_path):
    written = _written_keys(tmp_path, "llama")
    documented = {k.replace("{arch}", "llama") for k in _readme_keys()}
    assert written == documented, f"written {sorted(written)} vs README {sorted(documented)}"
    assert {K.key(t, "llama") for t in K.KEY_TYPES} <= written


def test_stock_llama_cpp_reads_none_of_the_keys(stock_table, tmp_path):
    stock_keys = {pattern % "llama" if "%s" in pattern else pattern for pattern in stock_table.values()}
    assert "llama.rope.scaling.type" in stock_keys  # the table was parsed
    written = _written_keys(tmp_path, "llama")
    assert not written & stock_keys, f"stock llama.cpp reads {sorted(written & stock_keys)}"


def test_patched_library_reads_exactly_the_ggufrope_keys(stock_table):
    assert PATCHED_ARCH.exists(), "the patched tree is missing: run make build"
    patched = _kv_table(PATCHED_ARCH.read_text())
    added = {patched[name] for name in set(patched) - set(stock_table)}
    assert added == {t.replace("{arch}", "%s") for t in K.KEY_TYPES}


# --------------------------------------------------------------------------- the stock contract, run


STOCK_LIB = ROOT / "build" / "stock-lib"
STOCK_K = 4.0  # the tiny models' factor: positions 0 .. 4L-1 (L = 64), far beyond L
STOCK_TOL = 1e-3  # per-position relative logit error against the torch reference (test_reference_forward's)
SMOLLM2_PROMPT_CHARS = 2000


def _tiny_keys(arch: str) -> dict:
    """The ggufrope keys of ntk-mixed (k 4, b 0.625) + log-n, as file keys and as kv overrides."""
    return {K.key(K.KEY_METHOD, arch): "ntk-mixed", K.key(K.KEY_FACTOR, arch): STOCK_K,
            K.key(K.KEY_EXPONENT, arch): 0.625, K.key(K.KEY_LOGN, arch): True}


def _tiny_dynamic_keys(arch: str) -> dict:
    """The ggufrope keys of ntk-mixed with dynamic k (ratio 1.5, no factor) + log-n."""
    return {K.key(K.KEY_METHOD, arch): "ntk-mixed", K.key(K.KEY_EXPONENT, arch): 0.625,
            K.key(K.KEY_DYNAMIC, arch): True, K.key(K.KEY_DYNAMIC_RATIO, arch): 1.5, K.key(K.KEY_LOGN, arch): True}


def _stock_child(job_path: str) -> None:
    """Runs in a subprocess whose llama-cpp-python loads build/stock-lib (LLAMA_CPP_LIB_PATH).

    ``job_path`` is a JSON file: ``tiny`` (list of {keyed, plain, arch, tokens, overrides, out}),
    ``smollm2`` ({set_file, plain_file, prompt, n_predict}), ``out`` (where the report goes). Writes the
    tiny models' logits as .npy files and a JSON report: the library the process loaded (patch
    version, the mapped libllama/libggml files) and the SmolLM2 generations."""
    import json
    import os

    import numpy as np

    job = json.loads(Path(job_path).read_text())
    import llama_cpp

    stock_child_setup()
    from ggufrope import runtime

    report: dict = {"library_version": runtime.library_version(), "is_patched": runtime.is_patched(),
                    "llama_cpp_lib_path": os.environ.get("LLAMA_CPP_LIB_PATH")}
    report["mapped"] = mapped_llama_libs()

    def run(path, tokens, kv_overrides=None):
        llm = llama_cpp.Llama(model_path=path, n_ctx=len(tokens), n_batch=len(tokens), n_ubatch=len(tokens),
                              logits_all=True, type_k=0, type_v=0, flash_attn=False, n_threads=2,
                              n_threads_batch=2, verbose=False, kv_overrides=kv_overrides)
        try:
            llm.eval(tokens)
            return np.array(llm.scores[: len(tokens)], dtype=np.float64)
        finally:
            llm.close()

    for t in job["tiny"]:
        np.save(t["out"] + ".keyed.npy", run(t["keyed"], t["tokens"]))
        np.save(t["out"] + ".overrides.npy", run(t["keyed"], t["tokens"], t["overrides"]))
        np.save(t["out"] + ".plain.npy", run(t["plain"], t["tokens"]))

    s = job["smollm2"]
    gens = {}
    for name in ("set_file", "plain_file"):
        llm = llama_cpp.Llama(model_path=s[name], n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False)
        try:
            out = llm.create_completion(s["prompt"], max_tokens=s["n_predict"], temperature=0.0, top_k=1)
            gens[name] = {"text": out["choices"][0]["text"], "tokens": out["usage"]["completion_tokens"],
                          "prompt_tokens": out["usage"]["prompt_tokens"]}
        finally:
            llm.close()
    report["smollm2"] = gens
    Path(job["out"]).write_text(json.dumps(report))


def _rel_err(a, b):
    import numpy as np

    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def test_stock_build_ignores_ggufrope_keys(patched_lib, tmp_path):
    """The contract, run: the UNPATCHED llama.cpp of the same pinned tree (build/stock-lib, built by
    ``make stock``, part of ``make test``), loaded by llama-cpp-python in a subprocess through
    LLAMA_CPP_LIB_PATH, (1) runs tiny llama/qwen2 files that carry ntk-mixed (k 4, b 0.625) + log-n
    keys (and a llama file with dynamic k, ratio 1.5), and the same keys as kv overrides, as plain RoPE: logits equal to the same file without the
    keys and to the torch plain-RoPE reference (rel. err <= 1e-3) over positions 0 .. 4L-1, while
    the patched library on the same keyed file is far from plain (so the comparison has power); and
    (2) loads a ``ggufrope set`` SmolLM2 file (ntk-mixed + log-n) and generates greedily, the
    same non-empty tokens as from the original file. The subprocess must have loaded no patched
    library (``runtime.library_version()`` None, every mapped libllama/libggml from the stock build)."""
    import json
    import os
    import subprocess
    import sys

    import numpy as np

    from ggufrope import corpus
    from ggufrope.rope_metadata import write_rope_metadata
    from ggufrope.models import default_model_path
    from tiny_models import N_SPECIAL, write_tiny_llama, write_tiny_qwen2
    from torch_reference import forward

    assert (STOCK_LIB / "libllama.so").exists(), f"{STOCK_LIB} has no libllama.so: run make stock (make test builds it)"
    writers = {"llama": ("llama", write_tiny_llama, _tiny_keys), "qwen2": ("qwen2", write_tiny_qwen2, _tiny_keys),
               "llama-dynamic": ("llama", write_tiny_llama, _tiny_dynamic_keys)}
    tiny, models = [], {}
    for i, (name, (arch, writer, keys)) in enumerate(writers.items()):
        keyed = writer(tmp_path / f"{name}-keyed.gguf", seed=31 + i, extra_kv=keys(arch))
        plain = writer(tmp_path / f"{name}-plain.gguf", seed=31 + i)
        L = keyed.n_ctx_train
        toks = np.random.default_rng(i).integers(N_SPECIAL, keyed.n_vocab, size=int(STOCK_K) * L).tolist()
        models[name] = (keyed, plain, toks)
        tiny.append({"arch": arch, "keyed": str(keyed.path), "plain": str(plain.path), "tokens": toks,
                     "overrides": keys(arch), "out": str(tmp_path / name)})

    smollm2 = default_model_path()
    set_file = tmp_path / "smollm2-mixed-logn.gguf"
    write_rope_metadata(smollm2, set_file, method="ntk-mixed", exponent=0.625, logn=True)
    text = corpus.demo_text()
    prompt = text[: text.rfind(" ", 0, SMOLLM2_PROMPT_CHARS)]
    job = {"tiny": tiny, "smollm2": {"set_file": str(set_file), "plain_file": str(smollm2), "prompt": prompt,
                                     "n_predict": 8},
           "out": str(tmp_path / "report.json")}
    (tmp_path / "job.json").write_text(json.dumps(job))

    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(STOCK_LIB))
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_contract; test_contract._stock_child(sys.argv[1])"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.json")], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, f"stock subprocess failed ({r.returncode}): {r.stderr[-3000:]}"
    rep = json.loads((tmp_path / "report.json").read_text())

    # the subprocess ran the unpatched build, and only it
    assert rep["library_version"] is None and rep["is_patched"] is False, rep
    venv_lib = Path(__import__("llama_cpp").__file__).resolve().parent / "lib"
    stock_dirs = (STOCK_LIB.resolve(), (ROOT / "build" / "cmake-stock" / "bin").resolve())
    mapped = [Path(p).resolve() for p in rep["mapped"]]
    assert any(p.name.startswith("libllama") for p in mapped), rep["mapped"]
    assert all(p.parent in stock_dirs for p in mapped), f"not the stock build: {rep['mapped']} (venv lib {venv_lib})"

    import llama_cpp

    for name, (keyed, plain, toks) in models.items():
        ref = forward(plain, toks)
        got = {v: np.load(tmp_path / f"{name}.{v}.npy") for v in ("keyed", "overrides", "plain")}
        for v, logits in got.items():
            assert logits.shape == ref.shape and np.all(np.isfinite(logits)), (name, v)
            err = _rel_err(logits, ref)
            print(f"\nstock {name} {v}: max rel err vs torch plain RoPE {err.max():.2e}")
            assert err.max() <= STOCK_TOL, f"stock {name} {v}: max rel err {err.max():.2e} > {STOCK_TOL}"
        # the keys change nothing at all: the same numbers as the file without them
        assert np.array_equal(got["keyed"], got["plain"]) and np.array_equal(got["overrides"], got["plain"]), name
        # power: the patched library applies the same keys, far from plain RoPE
        llm = llama_cpp.Llama(model_path=str(keyed.path), n_ctx=len(toks), n_batch=len(toks), n_ubatch=len(toks),
                              logits_all=True, type_k=0, type_v=0, flash_attn=False, n_threads=2, verbose=False)
        try:
            llm.eval(toks)
            patched = np.array(llm.scores[: len(toks)], dtype=np.float64)
        finally:
            llm.close()
        far = _rel_err(patched, ref).max()
        print(f"patched {name} keyed: max rel err vs plain {far:.2e}")
        assert far > 100 * STOCK_TOL, f"patched {name}: the keys barely change the logits ({far:.2e})"

    gens = rep["smollm2"]
    print(f"stock SmolLM2, {gens['set_file']['prompt_tokens']}-token prompt: set file {gens['set_file']['text']!r}, "
          f"original {gens['plain_file']['text']!r}")
    assert gens["set_file"]["tokens"] > 0 and gens["set_file"]["text"].strip()
    assert gens["set_file"] == gens["plain_file"]
