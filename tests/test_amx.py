"""Intel AMX (patches/0004, issue 12 part 1): on a host with AMX the Q4_1 weights of the real
model go to llama.cpp's AMX buffer type, whose matmul crashed at ``ldtilecfg`` in the first
prefill batch. The patch keeps the tile configuration in static storage, requests the XTILEDATA
permission on every thread that runs tile instructions, and offers no AMX buffer type (with a
warning) when the kernel refuses.

- On a host with AMX (``amx_tile`` and ``amx_int8`` in /proc/cpuinfo): llama.cpp logs
  ``AMX model buffer size`` and the perplexity of 512 tokens of real text is within 1 % of the
  plain CPU path (extra buffer types off). Elsewhere this test skips, saying the host has no AMX.
- On any x86-64 host: the patched ``amx/mmq.cpp`` compiled with the AMX flags loads the tile
  configuration from a 64-byte constant holding the kernel's tile shapes (the unpatched one, at
  -O3, loads a stack slot whose row/column stores GCC dropped), and the patched ``amx/amx.cpp``
  linked into ``native/test_amx_perm.cpp`` makes one request per thread and falls back when refused
  (kernel answer, and the answers "granted" / "refused" given by the harness).
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PATCHED_SRC

ROOT = Path(__file__).resolve().parents[1]
GGML_SRC = PATCHED_SRC / "ggml" / "src"

N_TOKENS = 512

# what ggml-cpu's CMakeLists passes for an AMX build (GGML_NATIVE=OFF, GGML_AVX512*=ON,
# GGML_AMX_TILE/INT8=ON; release flags as in the build): -mamx-int8 and -mavx512vnni define
# __AMX_INT8__ and __AVX512VNNI__, which compile the AMX code in
AMX_DEFINES = ["-DGGML_AMX_INT8", "-DGGML_AMX_TILE", "-DGGML_AVX", "-DGGML_AVX2", "-DGGML_AVX512",
               "-DGGML_AVX512_BF16", "-DGGML_AVX512_VBMI", "-DGGML_AVX512_VNNI", "-DGGML_BMI2", "-DGGML_F16C",
               "-DGGML_FMA", "-DGGML_SSE42", "-DGGML_USE_CPU_REPACK", "-DGGML_USE_LLAMAFILE", "-D_GNU_SOURCE",
               "-DNDEBUG"]
AMX_ARCH = ["-msse4.2", "-mf16c", "-mfma", "-mbmi2", "-mavx", "-mavx2", "-mavx512f", "-mavx512cd", "-mavx512vl",
            "-mavx512dq", "-mavx512bw", "-mavx512vbmi", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8"]
# the /proc/cpuinfo flags a host needs to run code built with AMX_ARCH, tile instructions aside
HOST_FLAGS_FOR_HARNESS = {"sse4_2", "f16c", "fma", "bmi2", "avx", "avx2", "avx512f", "avx512cd", "avx512vl",
                          "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni", "avx512_bf16"}

# the configuration the kernels expect (mmq.cpp's notes): B in TMM0-1 (8 rows x 64 bytes),
# A in TMM2-3 (16 x 32), C in TMM4-7 (16 x 64)
TILE_ROWS = [8, 8, 16, 16, 16, 16, 16, 16] + [0] * 8
TILE_COLSB = [64, 64, 32, 32, 64, 64, 64, 64] + [0] * 8


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    m = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(m.group(1).split()) if m else set()


HOST_HAS_AMX = {"amx_tile", "amx_int8"} <= cpu_flags()
NO_AMX_REASON = ("this host's CPU has no AMX (/proc/cpuinfo lacks amx_tile/amx_int8), so llama.cpp's AMX "
                 "buffer type cannot be exercised here")

x86_64_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="AMX is x86-64 only")


def _cxx() -> str:
    cxx = shutil.which("c++") or shutil.which("g++")
    assert cxx, "no C++ compiler"
    return cxx


def _compile(args: list[str]) -> None:
    r = subprocess.run([_cxx(), *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, "compile failed (is the patched tree built? run: make build)\n" + r.stderr[-4000:]


@pytest.fixture(scope="module")
def mmq_object(tmp_path_factory) -> Path:
    """The patched amx/mmq.cpp compiled as an AMX build compiles it (-O3, the explicit flags)."""
    out = tmp_path_factory.mktemp("amx") / "mmq.o"
    _compile([*AMX_DEFINES, *AMX_ARCH, "-O3", "-std=gnu++17", "-fPIC", f"-I{GGML_SRC}", f"-I{GGML_SRC / 'ggml-cpu'}",
              f"-I{PATCHED_SRC / 'ggml' / 'include'}", "-c", str(GGML_SRC / "ggml-cpu" / "amx" / "mmq.cpp"),
              "-o", str(out)])
    return out


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} (binutils) is not installed")
    return path


@x86_64_only
def test_ldtilecfg_loads_the_tile_shapes_from_a_constant(mmq_object, tmp_path):
    """Every ldtilecfg in the compiled matmul reads a RIP-relative 64-byte object in a read-only
    section (not a stack slot the optimiser may leave half-written) whose bytes are palette 1
    and the rows/colsb of the kernels' tiles."""
    dis = subprocess.run([_tool("objdump"), "-dr", "--no-show-raw-insn", str(mmq_object)],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    sites = [i for i, line in enumerate(dis) if re.search(r"\sldtilecfg\s", line)]
    assert sites, "no ldtilecfg in the compiled AMX matmul: the AMX code was compiled out"

    # symbol table: (section, value, size) of every data object
    syms = subprocess.run([_tool("objdump"), "-t", str(mmq_object)], capture_output=True, text=True, check=True).stdout
    objects = {}
    for m in re.finditer(r"^([0-9a-f]+) \S+\s+O (\S+)\s+([0-9a-f]+) (.+)$", syms, re.M):
        objects[(m.group(2), int(m.group(1), 16))] = (int(m.group(3), 16), m.group(4))

    for i in sites:
        insn = dis[i]
        assert "(%rip)" in insn, f"ldtilecfg reads a non-constant operand (stack or register-relative): {insn.strip()}"
        reloc = re.search(r"R_X86_64_PC32\s+(\S+?)([+-]0x[0-9a-f]+)?$", dis[i + 1].strip())
        assert reloc, f"no PC32 relocation for {insn.strip()}: {dis[i + 1].strip()}"
        target, addend = reloc.group(1), int(reloc.group(2) or "0", 16)
        # the displacement is the instruction's last 4 bytes: the target is symbol + addend + 4
        if target.startswith("."):
            section, addr = target, addend + 4
        else:
            hits = [(sec, val) for (sec, val), (_, name) in objects.items() if name == target]
            assert len(hits) == 1, f"ldtilecfg's operand {target} is not a data object of this file"
            section, addr = hits[0][0], hits[0][1] + addend + 4
        assert section.startswith(".rodata"), f"the tile configuration is in {section}, not in read-only data"
        size, name = objects.get((section, addr), (None, None))
        assert size == 64, f"ldtilecfg's operand {section}+{addr:#x} is not a 64-byte object ({name}, size {size})"

        raw = tmp_path / "section.bin"
        subprocess.run([_tool("objcopy"), "-O", "binary", f"--only-section={section}", str(mmq_object), str(raw)],
                       check=True, capture_output=True)
        cfg = raw.read_bytes()[addr : addr + 64]
        assert cfg[0] == 1, f"palette {cfg[0]} (the kernels use palette 1)"
        assert cfg[1] == 0 and cfg[2:16] == bytes(14), "start_row and the reserved bytes must be 0"
        colsb = [int.from_bytes(cfg[16 + 2 * t : 18 + 2 * t], "little") for t in range(16)]
        rows = list(cfg[48:64])
        assert (rows, colsb) == (TILE_ROWS, TILE_COLSB), f"tile shapes rows={rows} colsb={colsb}"


@pytest.fixture(scope="module")
def perm_harness(mmq_object, patched_lib, tmp_path_factory) -> Path:
    """native/test_amx_perm.cpp with the patched amx/amx.cpp and amx/mmq.o, against the installed
    libggml-base / libggml-cpu."""
    import llama_cpp

    missing = HOST_FLAGS_FOR_HARNESS - cpu_flags()
    if missing:
        pytest.skip(f"this host lacks {sorted(missing)}: code built with the AMX build's flags cannot run here")
    lib = Path(llama_cpp.__file__).parent / "lib"
    exe = tmp_path_factory.mktemp("amx") / "test_amx_perm"
    _compile([*AMX_DEFINES, *AMX_ARCH, "-O1", "-std=gnu++17", "-Wall", "-Wextra", "-Wno-unused-function",
              f"-I{GGML_SRC}", f"-I{GGML_SRC / 'ggml-cpu'}", f"-I{PATCHED_SRC / 'ggml' / 'include'}",
              str(ROOT / "native" / "test_amx_perm.cpp"), str(GGML_SRC / "ggml-cpu" / "amx" / "amx.cpp"),
              str(mmq_object),
              f"-L{lib}", "-lggml-base", "-lggml-cpu", "-ldl", "-pthread", f"-Wl,-rpath,{lib}", "-o", str(exe)])
    return exe


def _run_harness(exe: Path, mode: str) -> str:
    r = subprocess.run([str(exe), mode], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"test_amx_perm {mode} (rc {r.returncode}):\n{r.stdout}{r.stderr}"
    assert r.stdout.rstrip().endswith("result: ok"), r.stdout
    return r.stdout


# the patch's warning (GGML_LOG_WARN) when the kernel refuses; group 1: strerror of the refusal
REFUSAL = re.compile(r"ggml_amx_init: the kernel refused the AMX tile data permission \(XTILEDATA: ([^)]+)\), "
                     r"the AMX buffer type is disabled and weights use the CPU buffer type$", re.M)


@x86_64_only
def test_amx_permission_granted_once_per_thread(perm_harness):
    out = _run_harness(perm_harness, "grant")
    assert "amx buffer type: offered" in out
    assert "main thread requests: 1" in out and "warnings: 0" in out
    assert len(re.findall(r"^thread \d: answer 0 \(granted\), requests 1$", out, re.M)) == 4, out


@x86_64_only
def test_amx_permission_refused_falls_back_with_a_warning(perm_harness):
    out = _run_harness(perm_harness, "refuse")
    assert "amx buffer type: not offered" in out
    assert "main thread requests: 1" in out and "warnings: 1" in out
    assert REFUSAL.search(out).group(1) == "Operation not permitted", out
    assert len(re.findall(r"^thread \d: answer 1 \(Operation not permitted\), requests 1$", out, re.M)) == 4, out


@x86_64_only
def test_amx_permission_from_this_kernel(perm_harness):
    """The real kernel's answer: granted where the CPU has AMX, refused (and the fallback taken)
    where it has none, as on the development host (an AMD EPYC)."""
    out = _run_harness(perm_harness, "kernel")
    if HOST_HAS_AMX:
        assert "amx buffer type: offered" in out and "warnings: 0" in out, out
    else:
        assert "amx buffer type: not offered" in out, out
        assert REFUSAL.search(out), out


# --- the real model on an AMX host ---------------------------------------------------------------

_PPL_SCRIPT = r"""
import json, math, os, sys
import numpy as np
import llama_cpp
import llama_cpp.llama_cpp as lc

model, extra, n = sys.argv[1], sys.argv[2] == "on", int(sys.argv[3])
_default = lc.llama_model_default_params
def _params():
    p = _default()
    p.use_extra_bufts = extra  # off: every weight in the plain CPU buffer type
    return p
lc.llama_model_default_params = _params  # Llama() takes its model params from here

from ggufrope.corpus import demo_text
from ggufrope.evaluation.decoder import Decoder, token_nll

threads = max(2, os.cpu_count() or 2)  # at least one worker thread of the ggml threadpool
llm = llama_cpp.Llama(model, n_ctx=n, n_batch=n, n_ubatch=n, n_threads=threads, n_threads_batch=threads,
                      flash_attn=True, verbose=True)
with Decoder(llm) as dec:
    tokens = dec.tokenize(demo_text())[:n]
    assert len(tokens) == n, len(tokens)
    nll = []
    dec.decode(tokens, 0, range(n - 1), lambda rows, logits: nll.extend(
        token_nll(logits, np.asarray([tokens[j + 1] for j in rows])).tolist()))
print(json.dumps({"ppl": math.exp(sum(nll) / len(nll)), "n_scored": len(nll), "threads": threads,
                  "use_extra_bufts": bool(llm.model_params.use_extra_bufts)}))
"""


def _perplexity(model: Path, extra_bufts: bool) -> tuple[dict, str]:
    r = subprocess.run([sys.executable, "-c", _PPL_SCRIPT, str(model), "on" if extra_bufts else "off", str(N_TOKENS)],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"rc {r.returncode} (a negative rc is a signal: -11 SIGSEGV)\n{r.stderr[-4000:]}"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["use_extra_bufts"] is extra_bufts and res["n_scored"] == N_TOKENS - 1, res
    return res, r.stderr


@pytest.mark.real_model
@pytest.mark.skipif(not HOST_HAS_AMX, reason=NO_AMX_REASON)
def test_real_model_uses_amx_and_matches_the_cpu_path(patched_lib):
    from ggufrope.models import default_model_path

    model = default_model_path()
    amx, log_amx = _perplexity(model, extra_bufts=True)
    cpu, log_cpu = _perplexity(model, extra_bufts=False)
    assert "AMX model buffer size" not in log_cpu, "extra buffer types off, yet the AMX buffer type was used"
    assert 1.0 < cpu["ppl"] < 200.0, f"the plain CPU path does not read the text (ppl {cpu['ppl']:.2f})"
    refused = REFUSAL.search(log_amx)
    if "AMX model buffer size" not in log_amx and refused:
        # the fallback: the run completed on the CPU buffer types, but AMX was not exercised
        assert abs(amx["ppl"] / cpu["ppl"] - 1.0) < 0.01
        pytest.skip(f"the CPU has AMX but this kernel refused XTILEDATA ({refused.group(1)}): "
                    "the fallback ran, AMX was not exercised")
    assert re.search(r"AMX model buffer size\s*=\s*[0-9.]+ MiB", log_amx), log_amx[-4000:]
    # the two paths round differently (other kernels, other summation orders): compare
    # perplexities, never logits bit for bit
    assert abs(amx["ppl"] / cpu["ppl"] - 1.0) < 0.01, f"AMX ppl {amx['ppl']:.4f} vs CPU {cpu['ppl']:.4f}"
