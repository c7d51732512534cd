"""llama.cpp's RPC backend with the patched op: log-n rope computed on remote devices.

Two ``ggml-rpc-server`` processes on 127.0.0.1 (built from the patched tree by ``make tools``)
hold the layers of a tiny random llama model running ntk-mixed + log-n beyond L. The logits must
equal the local run's, and the ropes that carry log-n must run on the RPC devices: their
servers announce the feature in the HELLO answer (patches/0007). An UNPATCHED server (``make stock``
builds one from the same sdist) does not announce it: the client logs why, declines the op on its
device, and the scheduler runs those ropes on the local CPU, so the logits are still right.

Each run happens in a subprocess (registering RPC devices is process-wide) with
GGML_SCHED_DEBUG=2, whose node listing names the backend of every op.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import free_port, stop_process
from ggufrope import keys as Kk
from test_reference_forward import K, N_CTX, tokens_for
from tiny_models import write_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
PATCHED_RPC = ROOT / "build" / "tools" / "bin" / "ggml-rpc-server"
STOCK_RPC = ROOT / "build" / "stock-bin" / "ggml-rpc-server"

# the logits of one run, through the given RPC servers (none: local), with the scheduler's node listing
_RUN = r"""
import ctypes, json, sys
from pathlib import Path
import numpy as np
import llama_cpp

model, tokens_file, out, servers, kv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
if servers:
    lib = Path(llama_cpp.__file__).parent / "lib"
    # the sonames libllama links (pip installs copies, not symlinks: another name would load a second registry)
    rpc = ctypes.CDLL(str(lib / "libggml-rpc.so.0"))
    ggml = ctypes.CDLL(str(lib / "libggml.so.0"))
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    for s in servers.split(","):
        reg = rpc.ggml_backend_rpc_add_server(s.encode())
        assert reg, f"no RPC server at {s}"
        ggml.ggml_backend_register(reg)
tokens = json.loads(Path(tokens_file).read_text())
llm = llama_cpp.Llama(model_path=model, n_ctx=len(tokens), n_batch=len(tokens), n_ubatch=len(tokens), logits_all=True,
                      type_k=0, type_v=0, n_threads=1, n_threads_batch=1, n_gpu_layers=-1 if servers else 0,
                      kv_overrides=kv, verbose=True)
llm.eval(tokens)
np.save(out, np.array(llm.scores[: len(tokens)], dtype=np.float64))
llm.close()
"""

# "node # 41 (      ROPE):               Qcur-0 (  16K) [RPC0[    ...": the op's name and its backend
_NODE = re.compile(r"node #\s*\d+ \(\s*ROPE\):\s+(\S+) \([^)]*\) \[\s*(\S+)")


class _Server:
    """One ggml-rpc-server on 127.0.0.1, stopped by the test."""

    def __init__(self, exe: Path, log: Path):
        assert exe.is_file(), f"{exe} is missing: run make tools (patched) / make stock (unpatched)"
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = log
        self._f = open(log, "w")
        self.proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(self.port), "-t", "1"],
                                     stdout=self._f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"{exe} exited: {log.read_text()}"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break  # the server serves one client at a time: this probe connection ends at once
            except OSError:
                assert time.monotonic() < deadline, f"{exe} did not listen on {self.endpoint}: {log.read_text()}"
                time.sleep(0.1)

    def stop(self) -> None:
        stop_process(self.proc, timeout=10)
        self._f.close()


@pytest.fixture
def servers(tmp_path):
    started: list[_Server] = []

    def start(exe: Path) -> _Server:
        s = _Server(exe, tmp_path / f"rpc-{len(started)}.log")
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def _run(tmp_path: Path, model: Path, tokens: list[int], kv: dict, endpoints: list[str]) -> tuple[np.ndarray, str]:
    tag = "rpc" if endpoints else "local"
    tok_file = tmp_path / "tokens.json"
    tok_file.write_text(json.dumps(tokens))
    out = tmp_path / f"{tag}-{len(list(tmp_path.glob('*.npy')))}.npy"
    env = dict(os.environ, GGML_SCHED_DEBUG="2")
    r = subprocess.run([sys.executable, "-c", _RUN, str(model), str(tok_file), str(out), ",".join(endpoints),
                        json.dumps(kv)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return np.load(out), r.stderr


def _rope_backends(log: str) -> dict[str, set[str]]:
    """rope op name -> the backends it was scheduled on (every graph of the run)."""
    seen: dict[str, set[str]] = {}
    for name, backend in _NODE.findall(log):
        seen.setdefault(name, set()).add(backend)
    return seen


def _case(tmp_path: Path):
    m = write_tiny_llama(tmp_path / "m.gguf", seed=11, n_layer=4)
    kv = {Kk.key(Kk.KEY_METHOD, "llama"): "ntk-mixed", Kk.key(Kk.KEY_FACTOR, "llama"): K,
          Kk.key(Kk.KEY_EXPONENT, "llama"): 0.625, Kk.key(Kk.KEY_LOGN, "llama"): True}
    return m, kv, tokens_for(m, N_CTX)


def test_logn_rope_runs_on_patched_rpc_servers(tmp_path, patched_lib, servers):
    m, kv, toks = _case(tmp_path)
    local, local_log = _run(tmp_path, m.path, toks, kv, [])
    a, b = servers(PATCHED_RPC), servers(PATCHED_RPC)
    remote, log = _run(tmp_path, m.path, toks, kv, [a.endpoint, b.endpoint])

    ropes = _rope_backends(log)
    assert ropes, "no ROPE node in the scheduler's listing (GGML_SCHED_DEBUG=2)"
    on_rpc = {n for n, bs in ropes.items() if all(x.startswith("RPC") for x in bs)}
    print(f"\nrope ops: {len(ropes)}, on RPC devices: {len(on_rpc)}; backends {sorted(set().union(*ropes.values()))}")
    # every layer's Q and K ropes (4 layers x 2) ran remotely, on both servers' devices
    assert len(on_rpc) == 2 * m.n_layer, ropes
    # the layers are spread over both servers' devices (RPC0, RPC1; each server's backend is named
    # "RPC0[host:port]" after its device index, hence the device names from the loader)
    assert set(re.findall(r"layer +\d+ assigned to device (RPC\d)", log)) == {"RPC0", "RPC1"}
    assert "does not announce log-n" not in log
    # and computed log-n, not plain RoPE: the logits are the local run's
    np.testing.assert_allclose(remote, local, rtol=0, atol=1e-5)
    print(f"max |remote - local| = {np.abs(remote - local).max():.3e}")


def test_unpatched_rpc_server_is_declined_and_the_result_stays_right(tmp_path, patched_lib, servers):
    m, kv, toks = _case(tmp_path)
    local, _ = _run(tmp_path, m.path, toks, kv, [])
    stock = servers(STOCK_RPC)
    remote, log = _run(tmp_path, m.path, toks, kv, [stock.endpoint])

    assert f"RPC server {stock.endpoint} does not announce log-n rope scaling" in log, log[-3000:]
    ropes = _rope_backends(log)
    # log-n scales the queries only: the Q ropes (with log-n) are kept on the local CPU, the K ropes
    # (the NTK-family table alone, a stock rope) run on the server's device like the rest of the layer
    q = {n: bs for n, bs in ropes.items() if n.startswith("Qcur")}
    k = {n: bs for n, bs in ropes.items() if n.startswith("Kcur")}
    assert len(q) == len(k) == m.n_layer, ropes
    assert all(bs == {"CPU"} for bs in q.values()), ropes
    assert all(all(x.startswith("RPC0") for x in bs) for bs in k.values()), ropes
    assert re.search(r"node #\s*\d+ \(\s*MUL_MAT\):\s+\S+ \([^)]*\) \[RPC0", log), "nothing ran on the RPC device"
    np.testing.assert_allclose(remote, local, rtol=0, atol=1e-5)

    # without log-n the unpatched server computes the NTK-family rope itself (a freq_factors tensor: stock op)
    kv_plain = dict(kv, **{Kk.key(Kk.KEY_LOGN, "llama"): False})
    local2, _ = _run(tmp_path, m.path, toks, kv_plain, [])
    remote2, log2 = _run(tmp_path, m.path, toks, kv_plain, [stock.endpoint])
    ropes2 = _rope_backends(log2)
    assert len(ropes2) == 2 * m.n_layer and all(all(x.startswith("RPC0") for x in bs) for bs in ropes2.values()), ropes2
    assert "does not announce" in log2  # logged at connection, whatever the model
    np.testing.assert_allclose(remote2, local2, rtol=0, atol=1e-5)
