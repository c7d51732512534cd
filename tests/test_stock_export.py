"""The stock-readable export, ``ggufrope set MODEL -m METHOD -k K --stock -o OUT`` (issue 14, item 4).

The acceptance test: the export, loaded by the UNPATCHED llama.cpp of the same pinned tree
(build/stock-lib, through LLAMA_CPP_LIB_PATH in a subprocess, as tests/test_contract.py does),
gives the logits of the PATCHED library running the same method with the same fixed k (no log-n)
on the original file, at every position of a context 3L long (L = 64, 192 tokens); the unpatched
build on the original file gives different logits (so the comparison can fail). The patched
library is independent C code (patch 0002's table and its composition with rope_freqs); the
export's numbers come from ggufrope.methods. Cases: ntk, ntk-fixed, ntk-mixed through
rope_freqs.weight on a tiny llama (appended), ntk-mixed on a tiny llama that has its own
rope_freqs (composed, replaced), and NTK-aware through {arch}.rope.freq_base on a tiny qwen2 and
two tiny gemma3 (sliding-window layers with and without their own base key).

Besides: the export's bytes (every original tensor's data equal to the source's, the source
unchanged, the new header keys, the table against the seed formulas transcribed here), the
refusals (one line on stderr, exit status != 0, no output file) and the note of ``set``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import host_has_amx, mapped_llama_libs, plain_cpu_model_params, stock_child_setup
from test_reference_forward import _overrides, rel_err, require_patched, run_llama_cpp, tokens_for
from tiny_models import write_tiny_gemma3, write_tiny_llama, write_tiny_qwen2, write_tiny_qwen2vl

ROOT = Path(__file__).resolve().parents[1]
STOCK_LIB = ROOT / "build" / "stock-lib"
L = 64
K = 3.0  # the exported factor: context k*L = 192 tokens, positions 0 .. 3L-1
N = int(K * L)
B = 0.625
TOL = 1e-4  # per-position relative logit error, export in the stock build vs the patched library
# gemma3 through the base: the rope angles differ from the patched table's by float32 rounding
# (base^(-2i/d) of a rounded base vs a divisor), ~1e-6 relative (qwen2: 1e-6 in the logits);
# gemma3's GELU reads a float16 table on the CPU, whose cells such a change can flip (see
# tests/tiny_models.py): measured 5e-5 and 1.5e-4. Scaling its sliding-window layers too would
# give ~1 (test_gemma3_sliding_window_layers_keep_their_base).
TOL_GEMMA3 = 5e-4
OWN_FREQS = np.array([1.0, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 8.0], dtype=np.float32)  # a Llama-3-like own table

#: name -> (writer, writer options, method, b, route)
CASES = {
    "llama-ntk": (write_tiny_llama, {}, "ntk", None, "rope_freqs"),
    "llama-ntk-fixed": (write_tiny_llama, {}, "ntk-fixed", None, "rope_freqs"),
    "llama-ntk-mixed": (write_tiny_llama, {}, "ntk-mixed", B, "rope_freqs"),
    "llama-own-freqs-ntk-mixed": (write_tiny_llama, {"rope_freqs": OWN_FREQS}, "ntk-mixed", B, "rope_freqs"),
    "qwen2-ntk": (write_tiny_qwen2, {}, "ntk", None, "freq_base"),
    "gemma3-ntk": (write_tiny_gemma3, {}, "ntk", None, "freq_base"),
    "gemma3-no-swa-base-ntk": (write_tiny_gemma3, {"freq_base_swa": None}, "ntk", None, "freq_base"),
}


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """The real command line, in a subprocess."""
    return subprocess.run([sys.executable, "-m", "ggufrope", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def logits_at(llm, tokens: list[int], p0: int) -> np.ndarray:
    """Logits of ``tokens`` decoded as one batch at positions p0 .. p0+n-1 of sequence 0 into an
    empty context (llama.cpp's low-level API: an empty KV cache may start at any position). The
    rope angles are those of a context p0+n long, at the cost of n tokens."""
    import llama_cpp as lc

    n = len(tokens)
    batch = lc.llama_batch_init(n, 0, 1)
    try:
        batch.n_tokens = n
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p0 + i, 1, True
            batch.seq_id[i][0] = 0
        rc = lc.llama_decode(llm._ctx.ctx, batch)
        assert rc == 0, f"llama_decode returned {rc}"
        ptr = lc.llama_get_logits(llm._ctx.ctx)
        return np.ctypeslib.as_array(ptr, shape=(n, llm.n_vocab())).astype(np.float64)
    finally:
        lc.llama_batch_free(batch)


def _stock_child(job_path: str) -> None:
    """Runs in a subprocess whose llama-cpp-python loads build/stock-lib (LLAMA_CPP_LIB_PATH).
    ``job_path``: JSON {runs: [{path, tokens, n_ctx, out, p0}], report}. Saves the logits of
    every run (.npy) and a report: the patch version the process sees and the libraries it mapped."""
    job = json.loads(Path(job_path).read_text())
    import llama_cpp

    stock_child_setup()
    from ggufrope import runtime

    for r in job["runs"]:
        n = len(r["tokens"])
        llm = llama_cpp.Llama(model_path=r["path"], n_ctx=r["n_ctx"], n_batch=512, n_ubatch=512, logits_all=True,
                              type_k=0, type_v=0, flash_attn=False, n_threads=2, n_threads_batch=2, verbose=False)
        try:
            if r["p0"]:
                np.save(r["out"], logits_at(llm, r["tokens"], r["p0"]))
            else:
                llm.eval(r["tokens"])
                np.save(r["out"], np.array(llm.scores[:n], dtype=np.float64))
        finally:
            llm.close()
    Path(job["report"]).write_text(json.dumps({
        "library_version": runtime.library_version(),
        "mapped": mapped_llama_libs(),
    }))


def run_stock(tmp_path: Path, runs: list[dict]) -> list[np.ndarray]:
    """Logits of the unpatched build (one subprocess for all ``runs``: path, tokens, n_ctx, and
    p0: the position of the first token, see :func:`logits_at`; 0 or absent: a prefill from
    position 0); checks that the subprocess loaded the stock build only."""
    assert (STOCK_LIB / "libllama.so").exists(), f"{STOCK_LIB} has no libllama.so: run make stock"
    for i, r in enumerate(runs):
        r.setdefault("p0", 0)
        r["path"] = str(r["path"])
        r["out"] = str(tmp_path / f"stock-{i}.npy")
    job = tmp_path / "stock-job.json"
    job.write_text(json.dumps({"runs": runs, "report": str(tmp_path / "stock-report.json")}))
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(STOCK_LIB))
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_stock_export as t; "
            "t._stock_child(sys.argv[1])")
    p = subprocess.run([sys.executable, "-c", code, str(job)], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"stock subprocess failed ({p.returncode}): {p.stderr[-3000:]}"
    rep = json.loads((tmp_path / "stock-report.json").read_text())
    assert rep["library_version"] is None, rep  # not the patched library
    stock_dirs = (STOCK_LIB.resolve(), (ROOT / "build" / "cmake-stock" / "bin").resolve())  # its rpath
    assert any("libllama" in m for m in rep["mapped"]), rep
    assert all(Path(m).resolve().parent in stock_dirs for m in rep["mapped"]), rep
    return [np.load(r["out"]) for r in runs]


@pytest.fixture(scope="module")
def stock_runs(tmp_path_factory):
    """Every case's original file, its export (the real CLI), and the unpatched build's logits
    on both, from one subprocess: name -> (model, export path, tokens, stock on export, stock on
    the original)."""
    tmp = tmp_path_factory.mktemp("stock")
    cases, runs = {}, []
    for i, (name, (writer, opts, method, b, _route)) in enumerate(CASES.items()):
        m = writer(tmp / f"{name}.gguf", seed=70 + i, n_ctx_train=L, **opts)
        out = tmp / f"{name}-stock.gguf"
        args = ["set", m.path, "-m", method, "-k", K, "--stock", "-o", out] + (["--b", b] if b is not None else [])
        r = cli(*args)
        assert r.returncode == 0, r.stderr
        toks = tokens_for(m, N, seed=i)
        cases[name] = (m, out, toks, r)
        runs += [{"path": out, "tokens": toks, "n_ctx": N}, {"path": m.path, "tokens": toks, "n_ctx": N}]
    # a wrong export for the power of the gemma3 case: its sliding-window layers scaled as well
    from ggufrope import gguf_writer as GW
    from ggufrope.gguf_constants import GGUFValueType

    m, out, toks, _r = cases["gemma3-no-swa-base-ntk"]
    wrong = tmp / "gemma3-swa-scaled-too.gguf"
    GW.set_keys(out, wrong, {"gemma3.rope.freq_base_swa": (GGUFValueType.FLOAT32, 10000.0 * K ** (m.n_rot / (m.n_rot - 2)))})
    got = run_stock(tmp, runs + [{"path": wrong, "tokens": toks, "n_ctx": N}])
    res = {name: (*cases[name], got[2 * i], got[2 * i + 1]) for i, name in enumerate(cases)}
    res["gemma3-swa-scaled-too"] = got[-1]
    return res


@pytest.mark.parametrize("name", list(CASES))
def test_stock_export_equals_patched_method(stock_runs, name):
    """The export in the UNPATCHED build == the patched library with the method and fixed k on the
    original file (no log-n), at every position 0 .. 3L-1; the unpatched build on the original
    file (plain RoPE) is far from it."""
    require_patched()
    _writer, _opts, method, b, route = CASES[name]
    m, out, toks, r, stock_export, stock_plain = stock_runs[name]
    assert f"stock export: {method}" in r.stdout and route.split("_")[0] in r.stdout
    patched = run_llama_cpp(m, toks, n_ctx=N, kv_overrides=_overrides(m.arch, method, K, b, False))
    assert stock_export.shape == patched.shape == (N, m.n_vocab) and np.all(np.isfinite(stock_export))
    err = rel_err(stock_export, patched)
    far = rel_err(stock_plain, patched)
    print(f"\n{name}: stock export vs patched max rel err {err.max():.2e} (beyond L {err[L:].max():.2e}); "
          f"stock original vs patched {far.max():.2e}")
    tol = TOL_GEMMA3 if m.arch == "gemma3" else TOL
    assert err.max() <= tol, f"{name}: max rel err {err.max():.2e} > {tol}"
    assert far[L:].max() > 100 * tol, f"{name}: the method barely changes the logits ({far[L:].max():.2e})"


def test_gemma3_sliding_window_layers_keep_their_base(stock_runs):
    """Power of the gemma3 case without {arch}.rope.freq_base_swa (its sliding-window layers at the
    default 10000 = the global base): the export changes the global base only, as the patched
    library scales global layers only; the same export with the sliding-window base scaled too is
    far from the patched library."""
    require_patched()
    m, out, toks, *_ = stock_runs["gemma3-no-swa-base-ntk"]
    patched = run_llama_cpp(m, toks, n_ctx=N, kv_overrides=_overrides(m.arch, "ntk", K, None, False))
    far = rel_err(stock_runs["gemma3-swa-scaled-too"], patched).max()
    print(f"\ngemma3 with the sliding-window base scaled too: max rel err {far:.2e}")
    assert far > 100 * TOL_GEMMA3


def test_stock_export_loads_unchanged_in_the_patched_library(stock_runs):
    """The export carries no ggufrope method: the patched library runs it as the stock build does."""
    require_patched()
    m, out, toks, _r, stock_export, _plain = stock_runs["llama-own-freqs-ntk-mixed"]
    got = run_llama_cpp(SimpleNamespace(path=out), toks, n_ctx=N)
    assert rel_err(got, stock_export).max() <= TOL


# --------------------------------------------------------------------------- the file


def _seed_table(method: str, d: int, k: float, b: float | None) -> np.ndarray:
    """The divisors ff_i transcribed from the seeds (not from ggufrope.methods): NTK-aware
    k^(2i/(d-2)) (seed 001), NTK-RoPE-fixed λ^(i+1) with λ = k^(2/d) (seed 000 eq. 5),
    NTK-RoPE-mixed exp(a (i+1)^b) with a (d/2)^b = ln k (seed 000 eq. 7)."""
    out = []
    for i in range(d // 2):
        if method == "ntk":
            out.append(k ** (2 * i / (d - 2)))
        elif method == "ntk-fixed":
            out.append((k ** (2 / d)) ** (i + 1))
        else:
            a = math.log(k) / (d / 2) ** b
            out.append(math.exp(a * (i + 1) ** b))
    return np.array(out)


@pytest.mark.parametrize("name", ["llama-ntk-mixed", "llama-own-freqs-ntk-mixed", "llama-ntk-fixed", "gemma3-ntk"])
def test_export_bytes_and_header(tmp_path, name):
    """Every original tensor's data in the export equals the source's (the replaced rope_freqs
    excepted), the source is unchanged (bytes and mtime), and the header holds the new keys:
    context_length = k*L, original_context_length = L, the table (or the base), no ggufrope
    method keys."""
    from gguf import GGUFReader

    writer, opts, method, b, route = CASES[name]
    m = writer(tmp_path / "src.gguf", seed=5, n_ctx_train=L, **opts)
    before = (sha256(m.path), os.stat(m.path).st_mtime_ns)
    out = tmp_path / "out.gguf"
    r = cli("set", m.path, "-m", method, "-k", K, "--stock", "-o", out, *(["--b", b] if b is not None else []))
    assert r.returncode == 0, r.stderr
    assert "lost in a stock file: log-n, dynamic k" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert (sha256(m.path), os.stat(m.path).st_mtime_ns) == before
    assert not [p for p in tmp_path.iterdir() if "ggufrope-tmp" in p.name]

    src, dst = GGUFReader(str(m.path)), GGUFReader(str(out))
    new = {t.name: t for t in dst.tensors}
    for t in src.tensors:
        if t.name == "rope_freqs.weight":
            continue
        assert new[t.name].data.tobytes() == t.data.tobytes(), t.name
        assert list(new[t.name].shape) == list(t.shape) and new[t.name].tensor_type == t.tensor_type
    f = {k: v.contents() for k, v in dst.fields.items()}
    arch = m.arch
    assert f[f"{arch}.context_length"] == round(K * L)
    assert f[f"{arch}.rope.scaling.original_context_length"] == L
    assert not [k for k in f if ".rope.ntk." in k or k.endswith("logn_scaling")]
    assert method in f["ggufrope.stock_export"]
    d = m.n_rot
    if route == "rope_freqs":
        want = _seed_table(method, d, K, b)
        if "rope_freqs" in opts:
            want = want * OWN_FREQS
            assert len(dst.tensors) == len(src.tensors)
        else:
            assert len(dst.tensors) == len(src.tensors) + 1
        t = new["rope_freqs.weight"]
        assert t.tensor_type == 0 and list(t.shape) == [d // 2]  # F32
        assert t.data_offset % 32 == 0  # aligned (general.alignment absent: 32)
        np.testing.assert_allclose(t.data.astype(np.float64), want, rtol=1e-6)
        assert f[f"{arch}.rope.freq_base"] == pytest.approx(m.freq_base)
    else:
        assert len(dst.tensors) == len(src.tensors)
        want = m.freq_base * K ** (d / (d - 2))  # seed 001: base * k^(d/(d-2))
        assert f[f"{arch}.rope.freq_base"] == pytest.approx(want, rel=1e-6)
        if m.freq_base_swa is not None:
            assert f[f"{arch}.rope.freq_base_swa"] == m.freq_base_swa


# --------------------------------------------------------------------------- refusals and notes


def _refused(r: subprocess.CompletedProcess, out: Path, *words: str) -> None:
    assert r.returncode != 0, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ggufrope: error: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if "ggufrope-tmp" in p.name]


def test_unsupported_architecture_refused(tmp_path):
    """ntk-mixed on gemma3 (no rope_freqs in its stock graph): one line naming the architectures
    that take a table and suggesting --method ntk; exit status != 0; no output file."""
    g = write_tiny_gemma3(tmp_path / "g.gguf", seed=3)
    out = tmp_path / "g-stock.gguf"
    for method in ("ntk-mixed", "ntk-fixed"):
        _refused(cli("set", g.path, "-m", method, "-k", 2, "--stock", "-o", out), out,
                 f"'{method}'", "'gemma3'", "llama", "--method ntk")


def test_base_route_refusals(make_gguf, tmp_path):
    """NTK-aware through the base: refused for an architecture the patched library does not serve
    (qwen2vl's multi-section rope) and for one whose sliding-window layers may share the base
    (gemma2); accepted for a served one without sliding windows (qwen3)."""
    require_patched()
    out = tmp_path / "o.gguf"
    vl = write_tiny_qwen2vl(tmp_path / "vl.gguf", seed=1)
    _refused(cli("set", vl.path, "-m", "ntk", "-k", 2, "--stock", "-o", out), out, "'qwen2vl'", "not served")
    _refused(cli("set", make_gguf("g2.gguf", arch="gemma2"), "-m", "ntk", "-k", 2, "--stock", "-o", out), out,
             "'gemma2'", "sliding-window", "gemma3")
    r = cli("set", make_gguf("q3.gguf", arch="qwen3"), "-m", "ntk", "-k", 2, "--stock", "-o", out)
    assert r.returncode == 0 and "qwen3.rope.freq_base 100000.0 -> 220817.9" in r.stdout, r.stderr


def test_stock_refusals(tmp_path):
    """Everything a stock file cannot hold, or that would scale twice, is refused in one line."""
    m = write_tiny_llama(tmp_path / "l.gguf", seed=4)
    out = tmp_path / "o.gguf"
    _refused(cli("set", m.path, "-m", "ntk-mixed", "--stock", "-o", out), out, "-k K")
    _refused(cli("set", m.path, "-m", "ntk-mixed", "--dynamic", "--stock", "-o", out), out, "dynamic")
    _refused(cli("set", m.path, "-m", "ntk-mixed", "-k", 2, "--logn", "--stock", "-o", out), out, "log-n")
    _refused(cli("set", m.path, "-m", "none", "--stock", "-o", out), out, "NTK-family")
    _refused(cli("set", m.path, "-m", "yarn", "-k", 2, "--stock", "-o", out), out, "NTK-family")
    _refused(cli("set", m.path, "-m", "ntk", "-k", 0.5, "--stock", "-o", out), out, ">= 1")
    before = sha256(m.path)
    r = cli("set", m.path, "-m", "ntk", "-k", 2, "--stock", "--in-place")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "-o OUT" in r.stderr
    assert sha256(m.path) == before
    # an export again, or set on an export: twice scaled
    x = tmp_path / "x.gguf"
    assert cli("set", m.path, "-m", "ntk", "-k", 2, "--stock", "-o", x).returncode == 0
    _refused(cli("set", x, "-m", "ntk", "-k", 2, "--stock", "-o", out), out, "already a stock export")
    _refused(cli("set", x, "-m", "ntk-mixed", "-k", 2, "-o", out), out, "stock export")
    # stock rope scaling in the file: a stock engine would stack it on the export
    y = write_tiny_llama(tmp_path / "y.gguf", seed=4, n_ctx_train=256, extra_kv={
        "{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0,
        "{arch}.rope.scaling.original_context_length": 64})
    _refused(cli("set", y.path, "-m", "ntk", "-k", 2, "--stock", "-o", out), out, "yarn")


def test_set_says_stock_engines_ignore_the_keys(tmp_path):
    """``set`` (keys for the patched library) says, in at most two lines on stderr, that stock
    engines ignore them and points to --stock."""
    require_patched()
    m = write_tiny_llama(tmp_path / "l.gguf", seed=6)
    r = cli("set", m.path, "-m", "ntk-mixed", "-k", 2, "-o", tmp_path / "s.gguf")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "stock" in ln]
    assert 1 <= len(lines) <= 2 and "ollama" in lines[0] and "plain RoPE beyond L" in lines[0]
    assert "--stock" in " ".join(lines)


# --------------------------------------------------------------------------- the real model


@pytest.mark.real_model
def test_smollm2_stock_export_equals_patched(tmp_path, monkeypatch):
    """SmolLM2-135M (llama, L = 8192), ntk-mixed with k = 2: 128 tokens of real text decoded at
    positions 9000 .. 9127 (beyond L; an empty context starting there, see :func:`logits_at`,
    so that the check costs 128 tokens instead of a 9128-token prefill: about 7 minutes on 2
    cores): the export in the unpatched build gives the patched library's logits on the
    original file, and the unpatched build on the original file does not. On an AMX host both
    sides keep the weights in the plain CPU buffer type (:func:`conftest.stock_child_setup`): the
    stock child cannot use AMX, and the AMX matmul rounds otherwise than the plain one (on
    2026-12-01 the patched library's logits here differed by up to 0.19 relative, AMX against
    plain CPU, far above TOL)."""
    require_patched()
    import llama_cpp
    import llama_cpp.llama_cpp as lc

    if host_has_amx():
        monkeypatch.setattr(lc, "llama_model_default_params", plain_cpu_model_params())

    from ggufrope import corpus
    from ggufrope.models import default_model_path

    src = default_model_path()
    out = tmp_path / "smollm2-stock.gguf"
    r = cli("set", src, "-m", "ntk-mixed", "-k", 2, "--stock", "-o", out)
    assert r.returncode == 0, r.stderr
    p0, n = 9000, 128
    llm = llama_cpp.Llama(model_path=str(src), n_ctx=512, n_batch=512, n_ubatch=512, logits_all=True, type_k=0,
                          type_v=0, flash_attn=False, n_threads=2, n_threads_batch=2, verbose=False,
                          kv_overrides=_overrides("llama", "ntk-mixed", 2.0, B, False))  # as the stock child runs it
    try:
        assert llm.model_params.use_extra_bufts is not host_has_amx()
        toks = llm.tokenize(corpus.demo_text().encode("utf-8"), add_bos=False)[:n]
        patched = logits_at(llm, toks, p0)
    finally:
        llm.close()
    stock, plain = run_stock(tmp_path, [{"path": out, "tokens": toks, "n_ctx": 512, "p0": p0},
                                        {"path": src, "tokens": toks, "n_ctx": 512, "p0": p0}])
    err, far = rel_err(stock, patched).max(), rel_err(plain, patched).max()
    print(f"\nSmolLM2 ntk-mixed k = 2, positions {p0}..{p0 + n - 1}: stock export vs patched max rel err {err:.2e}, "
          f"stock original vs patched {far:.2e}")
    assert err <= TOL
    assert far > 100 * TOL


@pytest.mark.parametrize("endian", ["little", "big"])
@pytest.mark.parametrize("alignment", [None, 64])
def test_append_in_other_layouts(make_gguf, tmp_path, endian, alignment):
    """The appended tensor in a big-endian file and with a custom general.alignment: gguf-py reads
    the export back (its table in the file's byte order, at an aligned offset after the source's
    data), every source tensor's bytes unchanged (F32, F16, Q8_0, I8, I32 of odd shapes)."""
    import gguf

    src = make_gguf(endian=gguf.GGUFEndian.BIG if endian == "big" else gguf.GGUFEndian.LITTLE, alignment=alignment)
    out = tmp_path / "x.gguf"
    r = cli("set", src, "-m", "ntk-fixed", "-k", 4, "--stock", "-o", out)
    assert r.returncode == 0, r.stderr
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(out))
    new = {t.name: t for t in b.tensors}
    assert set(new) == {t.name for t in a.tensors} | {"rope_freqs.weight"}
    for t in a.tensors:
        assert new[t.name].data.tobytes() == t.data.tobytes(), t.name
    t = new["rope_freqs.weight"]
    assert t.data_offset % (alignment or 32) == 0
    assert t.data_offset >= max(x.data_offset + x.n_bytes for x in b.tensors if x.name != t.name)
    np.testing.assert_allclose(np.asarray(t.data, dtype=np.float64), _seed_table("ntk-fixed", 16, 4.0, None), rtol=1e-6)
    assert b.fields["llama.context_length"].contents() == 4 * 8192
