"""Shared fixtures: small but real GGUF files written with gguf-py's GGUFWriter."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import struct
import subprocess
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as VT

ROOT = Path(__file__).resolve().parents[1]


def _pinned_version() -> str:
    m = re.search(r"^VERSION=(\S+)$", (ROOT / "native" / "build.sh").read_text(), re.M)
    assert m, "native/build.sh sets no VERSION"
    return m.group(1)


#: the llama-cpp-python version pinned by native/build.sh (the one place it is set)
PINNED_VERSION = _pinned_version()
#: the pinned sdist that ``make build`` downloads
PINNED_SDIST = ROOT / "build" / "dl" / f"llama_cpp_python-{PINNED_VERSION}.tar.gz"
#: the patched llama.cpp tree that ``make build`` unpacks, patches and builds
PATCHED_SRC = ROOT / "build" / "src" / f"llama_cpp_python-{PINNED_VERSION}" / "vendor" / "llama.cpp"


def compile_c(source: str | Path, exe: Path, *flags: str, libs: tuple[str, ...] = ("ggml-base", "ggml", "ggml-cpu")) -> Path:
    """Compile the C program ``source`` (relative to the repository) into ``exe`` against the
    patched headers (``include``, ``ggml/include``) and the patched libraries that llama-cpp-python
    installed (``libs``, rpath set), with -Wall -Werror. ``flags`` go before the source (defines,
    more include dirs). Raises CalledProcessError (with the compiler's output) on failure."""
    import llama_cpp

    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler"
    lib = Path(llama_cpp.__file__).parent / "lib"
    subprocess.run([cc, "-O1", "-Wall", "-Werror", *flags, f"-I{PATCHED_SRC / 'include'}",
                    f"-I{PATCHED_SRC / 'ggml' / 'include'}", str(ROOT / source), f"-L{lib}",
                    *(f"-l{x}" for x in libs), f"-Wl,-rpath,{lib}", "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """Terminate ``proc`` (a server a test started), kill it after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def host_has_amx() -> bool:
    """The CPU has Intel AMX (an ``amx`` flag in /proc/cpuinfo)."""
    return "amx" in Path("/proc/cpuinfo").read_text()


def plain_cpu_model_params():
    """llama-cpp-python's ``llama_model_default_params`` with ``use_extra_bufts`` off: every weight
    in the plain CPU buffer type (no AMX, no repacked layouts). ``Llama()`` takes its model params
    from ``llama_cpp.llama_cpp.llama_model_default_params``; set this there to load that way."""
    import llama_cpp.llama_cpp as lc

    default_params = lc.llama_model_default_params

    def _params():
        p = default_params()
        p.use_extra_bufts = False
        return p

    return _params


def stock_child_setup() -> None:
    """In a subprocess that loads the UNPATCHED build (LLAMA_CPP_LIB_PATH=build/stock-lib), before
    any model is loaded: on AMX hosts keep the weights in the plain CPU buffer type, since stock
    llama.cpp crashes in its AMX buffer type there (upstream issue #20824, fixed in the patch
    series only); the tests that use it are about rope, not buffer types. A test that compares
    such a child's logits with the patched library's in its own process loads the patched side
    the same way (:func:`plain_cpu_model_params`): the AMX and plain CPU matmuls round differently."""
    if not host_has_amx():
        return
    import llama_cpp.llama_cpp as lc

    lc.llama_model_default_params = plain_cpu_model_params()


def mapped_llama_libs() -> list[str]:
    """The libllama / libggml files this process has mapped (which build it really loaded)."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return sorted({ln.split()[-1] for ln in maps if "/lib" in ln and ("libllama" in ln or "libggml" in ln)})


def write_test_gguf(
    path: str | Path,
    arch: str = "llama",
    *,
    rope: bool = True,
    context_length: int | None = 8192,
    orig_ctx: int | None = None,
    scaling: tuple[str, float] | None = None,
    vocab: int = 64,
    endian: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE,
    alignment: int | None = None,
    tensors: bool = True,
    extra: Callable[[gguf.GGUFWriter], Any] | None = None,
    seed: int = 0,
) -> Path:
    """Write a small GGUF: architecture ``arch``, rope keys (unless ``rope=False``), a
    vocabulary of ``vocab`` strings (some non-ASCII), a few numeric keys and arrays, and
    tensors of several dtypes with odd shapes (F32, F16, Q8_0, I8, I32) filled with random
    bytes. ``extra(writer)`` may add more keys. Returns the path."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch, endianess=endian)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_name("ggufrope test model")
    if context_length is not None:
        w.add_context_length(context_length)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    if rope:
        w.add_rope_freq_base(100000.0)
        w.add_rope_dimension_count(16)
    if orig_ctx is not None:
        w.add_rope_scaling_orig_ctx_len(orig_ctx)
    if scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(scaling[0]))
        w.add_rope_scaling_factor(scaling[1])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" if i % 3 else f"ţøķ{i}✓" for i in range(vocab)])
    w.add_token_scores([float(i) for i in range(vocab)])
    w.add_array("test.u8array", [1, 2, 3])
    w.add_uint64("test.u64", 2**40 + 3)
    w.add_bool("test.flag", True)
    w.add_string("test.template", "{% for m in messages %}{{ m }}{% endfor %}\n")
    if extra is not None:
        extra(w)
    if tensors:
        w.add_tensor("token_embd.weight", rng.standard_normal((7, 3)).astype(np.float32))
        w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(13).astype(np.float16))
        q8 = rng.integers(0, 256, size=(3, 2 * 34), dtype=np.uint8)  # 3 rows of 64 Q8_0 values
        w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor("blk.1.ffn_up.weight", rng.integers(-128, 127, size=(5,), dtype=np.int8))
        w.add_tensor("output.weight", rng.integers(0, 1000, size=(2, 1), dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --------------------------------------------------------------------------- GGUF helpers
# (of test_gguf_reader, test_gguf_writer, test_atomic_write, test_rope_metadata, test_cli)


def data_hash(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return hashlib.sha256(f.read()).hexdigest()


def reader_fields(path: Path) -> dict[str, tuple[int, object]]:
    """key -> (GGUF type, value) as gguf-py's reader sees them (arrays: element count)."""
    r = gguf.GGUFReader(str(path))
    out = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        t = f.types[0]
        out[name] = (t, len(f.data) if t == VT.ARRAY else f.contents())
    return out


def assert_same_tensors(a: Path, b: Path) -> None:
    ra, rb = gguf.GGUFReader(str(a)), gguf.GGUFReader(str(b))
    assert [t.name for t in ra.tensors] == [t.name for t in rb.tensors]
    for ta, tb in zip(ra.tensors, rb.tensors):
        assert ta.tensor_type == tb.tensor_type
        assert ta.shape.tolist() == tb.shape.tolist()
        assert ta.data.tobytes() == tb.data.tobytes(), ta.name


def assert_rewrite_ok(src: Path, dst: Path) -> None:
    """dst has the same tensors, byte for byte, and the same data section as src."""
    from ggufrope.gguf_reader import read_header

    hs, hd = read_header(src), read_header(dst)
    assert hs.tensors == hd.tensors
    assert data_hash(src, hs.data_offset) == data_hash(dst, hd.data_offset)
    assert hd.data_offset % hd.alignment == 0
    assert_same_tensors(src, dst)


def copy_committed_cache(dest: Path) -> Path:
    """A copy of the committed unit cache (docs/results/cache) at ``dest``, without its
    model-sha256.json (this machine's git-ignored memo of model hashes: the copy is the cache a
    clean clone has); returns ``dest``."""
    shutil.copytree(ROOT / "docs" / "results" / "cache", dest, ignore=shutil.ignore_patterns("model-sha256.json"))
    return dest


def no_temp_files(d: Path) -> bool:
    return not [p for p in os.listdir(d) if "ggufrope-tmp" in p or "ggufrope-probe" in p]


def pstr(s: bytes | str, e: str = "<") -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(e + "Q", len(b)) + b


def kv(key: bytes | str, vtype: int, payload: bytes) -> bytes:
    return pstr(key) + struct.pack("<I", vtype) + payload


def kv_str(key: str, value: bytes | str) -> bytes:
    return kv(key, VT.STRING, pstr(value))


def kv_u32(key: str, v: int) -> bytes:
    return kv(key, VT.UINT32, struct.pack("<I", v))


def raw_gguf(kvs: list[bytes], *, version: int = 3, n_kv: int | None = None, n_tensors: int = 0, tail: bytes = b"") -> bytes:
    """A hand-packed header (for cases GGUFWriter refuses to write)."""
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kvs) if n_kv is None else n_kv)
    return head + b"".join(kvs) + tail


LLAMA_KVS = [kv_str("general.architecture", "llama"), kv_u32("llama.context_length", 4096)]


def write(tmp_path: Path, data: bytes, name: str = "x.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def file_hash(p: Path) -> str:
    with open(p, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@pytest.fixture
def make_gguf(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``make_gguf(name="model.gguf", **write_test_gguf_options) -> Path``."""

    def make(name: str = "model.gguf", **kw: Any) -> Path:
        return write_test_gguf(tmp_path / name, **kw)

    return make


@pytest.fixture
def small_gguf(make_gguf: Callable[..., Path]) -> Path:
    """A default small LLaMA-architecture GGUF with rope keys."""
    return make_gguf()


@pytest.fixture(scope="session")
def patched_lib() -> str:
    """The patched llama.cpp library (``make build``), never skipped: a stock or missing
    library fails the tests that need it. Returns the patch version."""
    import llama_cpp  # noqa: F401  (an ImportError fails the test: run make build)

    from ggufrope import runtime

    v = runtime.library_version()
    assert v is not None, "llama-cpp-python's library is not the patched one: run make build"
    return v


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The default real model (SmolLM2-135M-Instruct Q4_1, L = 8192), fetched into the cache."""
    from ggufrope.models import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="session")
def gemma3() -> Path:
    """The second real model (Gemma 3 270M Q4_K_M, L = 32768), fetched and assembled into the cache."""
    from ggufrope.models import model_path

    return model_path("gemma3")


# --------------------------------------------------------------------------- shared test helpers
# (of test_corpus and test_models; of test_eval_tune and test_eval_cli)


def one_line(exc: BaseException) -> str:
    """The message of ``exc``, asserted to be one non-empty line."""
    msg = str(exc)
    assert msg and "\n" not in msg
    return msg


def tiny_logits(path, setting, plain=False):
    """The logits of 128 fixed tokens (t4..t9) at n_ctx 128 (F32 KV cache, no flash attention),
    flattened: through the evaluation's load_model with ``setting``, or with ``plain`` the file
    as it is, no override at all."""
    from ggufrope.evaluation import decoder as ED

    toks = np.random.default_rng(3).integers(4, 10, size=128).tolist()
    if plain:  # no override at all: what the file says
        from ggufrope.runtime import load

        llm = load(path, n_ctx=128, n_batch=128, n_ubatch=128, n_threads=2, n_threads_batch=2, verbose=False,
                   type_k=0, type_v=0, flash_attn=False)
    else:
        llm = ED.load_model(path, setting, 128, n_batch=128, threads=2, flash_attn=False, type_k=0, type_v=0)
    with ED.Decoder(llm) as dec:
        buf = np.empty((128, dec.n_vocab))

        def take(rows, logits):
            buf[rows] = logits

        dec.decode(toks, 0, range(128), take)
    return buf.ravel().tolist()


# --------------------------------------------------------------------------- evaluation fixtures
# (of the tests/test_eval_*.py files)


@pytest.fixture(scope="module")
def text_slice():
    """A tiny slice of a real corpus document (Hamlet, First Folio): ~2,800 tokens."""
    from ggufrope.corpus import load_text

    return load_text("hamlet")[20_000:30_000]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny LLaMA (tests/tiny_models.py, L = 64, seed 7) whose vocabulary's pieces t4..t9
    tokenize without a space prefix."""
    from tiny_models import write_tiny_llama

    extra = {"tokenizer.ggml.add_space_prefix": False}  # texts of the vocabulary's pieces t4..t9
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama.gguf", seed=7, extra_kv=extra)


@pytest.fixture(scope="session")
def smollm2_l512(smollm2, tmp_path_factory):
    """A copy of the real model whose llama.context_length says L = 512 (a context "beyond L" made
    cheap); session-scoped: a ~100 MB copy, the same for every test that reads it."""
    from ggufrope.gguf_writer import set_keys

    out = tmp_path_factory.mktemp("l512") / "smollm2-L512.gguf"
    set_keys(smollm2, out, {"llama.context_length": 512})
    return str(out)
