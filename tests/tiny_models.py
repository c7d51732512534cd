"""Tiny random GGUF models for the reference-forward tests.

Each ``write_tiny_*`` function writes a small F32 model with gguf-py's ``GGUFWriter`` that
stock llama.cpp loads, and returns a :class:`TinyModel`: the configuration plus every
weight as a float32 numpy array, so that ``tests/torch_reference.py`` can run the same
network independently.

Layout conventions (checked against ``vendor/llama.cpp/src/llama-arch.cpp`` and
``src/models/{llama,qwen2,qwen2vl,gemma3}.cpp`` of llama-cpp-python 0.3.36):

- A linear layer ``y = W x`` is stored as the numpy array ``W`` of shape ``(n_out, n_in)``;
  gguf-py writes the reversed shape, so ggml sees ``ne = [n_in, n_out]``, which is what
  ``create_tensor(..., {n_in, n_out})`` expects.
- The q/k weights are used as stored: llama.cpp's ``llama`` graph applies NORMAL rope
  (adjacent pairs (2i, 2i+1)) to ``W_q x`` directly, ``qwen2`` applies NEOX rope (pairs
  (i, i + d/2)). Since these files are written directly (no HF checkpoint, no
  ``convert_hf_to_gguf`` permutation), the reference uses the same convention on the same
  stored weights.
- Tokenizer: the smallest SPM (``tokenizer.ggml.model = "llama"``) vocabulary the loader
  accepts without warnings: ``<unk>``, ``<s>``, ``</s>``, the newline byte token
  ``<0x0A>`` (the loader looks it up for ``linefeed_id``) and unique plain ASCII pieces
  (non-ASCII pieces make llama-cpp-python's verbose log callback raise UnicodeDecodeError
  when llama.cpp cuts the printed token list mid-character).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from ggufrope import keys as gkeys

#: rope layout of each architecture, as llama.cpp applies it (``llama_model_rope_type``)
ROPE_MODE = {"llama": "normal", "qwen2": "neox", "qwen2vl": "neox", "gemma3": "neox"}

N_SPECIAL = 4  # <unk>, <s>, </s>, <0x0A>
UNK_ID, BOS_ID, EOS_ID, NL_ID = 0, 1, 2, 3

# token types (gguf TokenType / llama_token_type)
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_BYTE = 1, 2, 3, 6


@dataclass
class TinyLayer:
    """One transformer block; linear weights are ``(n_out, n_in)`` float32 arrays."""

    attn_norm: np.ndarray  # (n_embd,)
    wq: np.ndarray  # (n_head * head_dim, n_embd)
    wk: np.ndarray  # (n_head_kv * head_dim, n_embd)
    wv: np.ndarray  # (n_head_kv * head_dim, n_embd)
    wo: np.ndarray  # (n_embd, n_head * head_dim)
    ffn_norm: np.ndarray  # (n_embd,)
    ffn_gate: np.ndarray  # (n_ff, n_embd)
    ffn_up: np.ndarray  # (n_ff, n_embd)
    ffn_down: np.ndarray  # (n_embd, n_ff)
    bq: np.ndarray | None = None  # (n_head * head_dim,) qwen2 only
    bk: np.ndarray | None = None  # (n_head_kv * head_dim,)
    bv: np.ndarray | None = None  # (n_head_kv * head_dim,)
    # gemma3 only
    attn_q_norm: np.ndarray | None = None  # (head_dim,) RMSNorm of each query head
    attn_k_norm: np.ndarray | None = None  # (head_dim,) RMSNorm of each key head
    attn_post_norm: np.ndarray | None = None  # (n_embd,) RMSNorm of the attention output
    ffn_post_norm: np.ndarray | None = None  # (n_embd,) RMSNorm of the FFN output


@dataclass
class TinyModel:
    """Configuration and weights of a tiny model written to ``path``."""

    path: Path
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    freq_base: float
    rms_eps: float
    tok_embd: np.ndarray  # (n_vocab, n_embd)
    output_norm: np.ndarray  # (n_embd,)
    output: np.ndarray  # (n_vocab, n_embd)
    layers: list[TinyLayer]
    rope_freqs: np.ndarray | None = None  # (n_rot // 2,) llama only: divides theta_i
    rope_sections: tuple[int, int, int, int] | None = None  # qwen2vl only
    extra_kv: dict[str, Any] = field(default_factory=dict)
    # gemma3 only: the sliding window, which layers use it, and their rope base
    n_swa: int = 0
    swa_layers: tuple[bool, ...] = ()
    freq_base_swa: float | None = None

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_rot(self) -> int:
        return self.head_dim

    @property
    def rope_mode(self) -> str:
        """``"normal"`` (adjacent pairs) or ``"neox"`` (split halves)."""
        return ROPE_MODE[self.arch]

    def key(self, template: str) -> str:
        """Expand a ``{arch}`` key template for this model (``"{arch}.rope.ntk.method"``)."""
        return gkeys.key(template, self.arch)


# ----------------------------------------------------------------------------- helpers


def _vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    if n_vocab < N_SPECIAL + 1:
        raise ValueError(f"n_vocab must be >= {N_SPECIAL + 1}, got {n_vocab}")
    tokens = ["<unk>", "<s>", "</s>", "<0x0A>"] + [f"t{i}" for i in range(N_SPECIAL, n_vocab)]
    scores = [0.0] * N_SPECIAL + [-float(i) for i in range(N_SPECIAL, n_vocab)]
    types = [_TT_UNKNOWN, _TT_CONTROL, _TT_CONTROL, _TT_BYTE] + [_TT_NORMAL] * (n_vocab - N_SPECIAL)
    return tokens, scores, types


def _value_type(k: str, v: Any, arch: str) -> GGUFValueType:
    """GGUF type of an ``extra_kv`` value: the contract's type for a ggufrope key, else inferred."""
    for template, vtype in gkeys.KEY_TYPES.items():
        if gkeys.key(template, arch) == k:
            return vtype
    if isinstance(v, bool):
        return GGUFValueType.BOOL
    if isinstance(v, str):
        return GGUFValueType.STRING
    if isinstance(v, (int, np.integer)):
        return GGUFValueType.UINT32 if v >= 0 else GGUFValueType.INT32
    if isinstance(v, (float, np.floating)):
        return GGUFValueType.FLOAT32
    raise TypeError(f"cannot infer the GGUF type of {k}={v!r}; pass (value, GGUFValueType)")


def _add_extra_kv(w: GGUFWriter, arch: str, extra_kv: dict[str, Any] | None) -> dict[str, Any]:
    """Write ``extra_kv`` (keys may contain ``{arch}``; a value may be ``(value, GGUFValueType)``)."""
    out: dict[str, Any] = {}
    for k, v in (extra_kv or {}).items():
        k = k.format(arch=arch)
        if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], GGUFValueType):
            v, vtype = v
        else:
            vtype = _value_type(k, v, arch)
        if vtype == GGUFValueType.FLOAT32:
            v = float(v)
        elif vtype == GGUFValueType.BOOL:
            v = bool(v)
        w.add_key_value(k, v, vtype)
        out[k] = v
    return out


def _random_model(
    rng: np.random.Generator,
    *,
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int,
    n_vocab: int,
    qkv_bias: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[TinyLayer]]:
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must be a multiple of n_head and n_head of n_head_kv")
    if n_layer < 1:
        raise ValueError("n_layer must be >= 1")
    hd = n_embd // n_head

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_w(n):
        return (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)

    # q/k std: q, k entries have std ~ 8*s after the RMSNorm (n_embd=64), so the attention
    # logits q.k/sqrt(hd) have std ~ 64 s^2 (hd=16): s = 0.2 gives ~2.5, position-sensitive
    # but not saturated.
    qk_std = 1.6 / np.sqrt(n_embd)
    layers = []
    for _ in range(n_layer):
        layers.append(
            TinyLayer(
                attn_norm=norm_w(n_embd),
                wq=normal((n_head * hd, n_embd), qk_std),
                wk=normal((n_head_kv * hd, n_embd), qk_std),
                wv=normal((n_head_kv * hd, n_embd), 1.0 / np.sqrt(n_embd)),
                wo=normal((n_embd, n_head * hd), 0.5 / np.sqrt(n_head * hd)),
                ffn_norm=norm_w(n_embd),
                ffn_gate=normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd)),
                ffn_up=normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd)),
                ffn_down=normal((n_embd, n_ff), 0.5 / np.sqrt(n_ff)),
                bq=normal(n_head * hd, 0.1) if qkv_bias else None,
                bk=normal(n_head_kv * hd, 0.1) if qkv_bias else None,
                bv=normal(n_head_kv * hd, 0.1) if qkv_bias else None,
            )
        )
    tok_embd = normal((n_vocab, n_embd), 1.0)
    output_norm = norm_w(n_embd)
    output = normal((n_vocab, n_embd), 1.0 / np.sqrt(n_embd))
    return tok_embd, output_norm, output, layers


def _begin(path: Path, arch: str, *, seed: int, n_layer: int, n_embd: int, n_head: int, n_head_kv: int,
           n_ff: int, n_vocab: int, n_ctx_train: int, freq_base: float, rms_eps: float) -> GGUFWriter:
    """A ``GGUFWriter`` with the hyperparameters every tiny model shares (F32, rope over the
    whole head); the caller adds its own keys, then :func:`_add_vocab`."""
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{seed}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_rope_freq_base(float(freq_base))
    w.add_layer_norm_rms_eps(float(rms_eps))
    w.add_vocab_size(n_vocab)
    w.add_file_type(0)  # ALL_F32
    return w


def _add_vocab(w: GGUFWriter, arch: str, n_vocab: int, extra_kv: dict[str, Any] | None) -> dict[str, Any]:
    """The SPM vocabulary of :func:`_vocab` and its special ids, then ``extra_kv``
    (:func:`_add_extra_kv`, whose result is returned)."""
    tokens, scores, types = _vocab(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(UNK_ID)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    return _add_extra_kv(w, arch, extra_kv)


#: per-layer tensors of every tiny model: GGUF name suffix -> TinyLayer attribute
_LAYER_TENSORS = (
    ("attn_norm.weight", "attn_norm"), ("attn_q.weight", "wq"), ("attn_k.weight", "wk"), ("attn_v.weight", "wv"),
    ("attn_output.weight", "wo"), ("ffn_norm.weight", "ffn_norm"), ("ffn_gate.weight", "ffn_gate"),
    ("ffn_up.weight", "ffn_up"), ("ffn_down.weight", "ffn_down"),
)


def _add_tensors_and_close(w: GGUFWriter, tok_embd: np.ndarray, output_norm: np.ndarray, output: np.ndarray,
                           layers: list[TinyLayer], layer_tensors: tuple[tuple[str, str], ...],
                           extra: dict[str, np.ndarray] | None = None) -> None:
    """Write the global tensors, ``extra`` (name -> array, e.g. ``rope_freqs.weight``), then
    ``blk.{i}.<suffix>`` = ``getattr(layer, attr)`` for each (suffix, attr) of
    ``layer_tensors``; write the file and close it."""
    w.add_tensor("token_embd.weight", tok_embd)
    w.add_tensor("output_norm.weight", output_norm)
    w.add_tensor("output.weight", output)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    for i, layer in enumerate(layers):
        for suffix, attr in layer_tensors:
            w.add_tensor(f"blk.{i}.{suffix}", getattr(layer, attr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write(
    path: str | Path,
    arch: str,
    *,
    seed: int,
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int,
    n_vocab: int,
    n_ctx_train: int,
    freq_base: float,
    rms_eps: float,
    qkv_bias: bool,
    rope_freqs: np.ndarray | None = None,
    rope_sections: tuple[int, int, int, int] | None = None,
    extra_kv: dict[str, Any] | None = None,
) -> TinyModel:
    path = Path(path)
    rng = np.random.default_rng(seed)
    tok_embd, output_norm, output, layers = _random_model(
        rng, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        n_ff=n_ff, n_vocab=n_vocab, qkv_bias=qkv_bias,
    )
    hd = n_embd // n_head
    if rope_freqs is not None:
        rope_freqs = np.asarray(rope_freqs, dtype=np.float32)
        if rope_freqs.shape != (hd // 2,):
            raise ValueError(f"rope_freqs must have shape ({hd // 2},), got {rope_freqs.shape}")

    w = _begin(path, arch, seed=seed, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
               n_ff=n_ff, n_vocab=n_vocab, n_ctx_train=n_ctx_train, freq_base=freq_base, rms_eps=rms_eps)
    if rope_sections is not None:
        w.add_rope_dimension_sections([int(s) for s in rope_sections])
    extra = _add_vocab(w, arch, n_vocab, extra_kv)
    bias = (("attn_q.bias", "bq"), ("attn_k.bias", "bk"), ("attn_v.bias", "bv")) if qkv_bias else ()
    _add_tensors_and_close(w, tok_embd, output_norm, output, layers, _LAYER_TENSORS + bias,
                           {"rope_freqs.weight": rope_freqs} if rope_freqs is not None else None)

    return TinyModel(
        path=path, arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=n_head_kv, n_ff=n_ff, n_vocab=n_vocab, n_ctx_train=n_ctx_train,
        freq_base=float(freq_base), rms_eps=float(np.float32(rms_eps)), tok_embd=tok_embd,
        output_norm=output_norm, output=output, layers=layers, rope_freqs=rope_freqs,
        rope_sections=tuple(rope_sections) if rope_sections is not None else None,
        extra_kv=extra,
    )


# ----------------------------------------------------------------------------- writers


def write_tiny_llama(
    path: str | Path,
    *,
    seed: int,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 96,
    n_ctx_train: int = 64,
    freq_base: float = 10000.0,
    rms_eps: float = 1e-5,
    rope_freqs: np.ndarray | None = None,
    extra_kv: dict[str, Any] | None = None,
) -> TinyModel:
    """Write a tiny ``llama`` (NORMAL rope, GQA, F32) model to ``path``; return its weights.

    ``rope_freqs`` (shape ``(n_rot/2,)``) is written as the ``rope_freqs.weight`` tensor, the
    per-pair divisor Llama-3.1 files carry. ``extra_kv`` adds metadata: keys may contain
    ``{arch}``; the ggufrope keys get their contract types from :mod:`ggufrope.keys`, other
    values are typed from Python (bool, str, float -> FLOAT32, int -> UINT32) or given as
    ``(value, GGUFValueType)``.
    """
    return _write(
        path, "llama", seed=seed, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=n_head_kv, n_ff=n_ff, n_vocab=n_vocab, n_ctx_train=n_ctx_train,
        freq_base=freq_base, rms_eps=rms_eps, qkv_bias=False, rope_freqs=rope_freqs,
        extra_kv=extra_kv,
    )


def write_tiny_qwen2(
    path: str | Path,
    *,
    seed: int,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 96,
    n_ctx_train: int = 64,
    freq_base: float = 10000.0,
    rms_eps: float = 1e-6,
    extra_kv: dict[str, Any] | None = None,
) -> TinyModel:
    """Write a tiny ``qwen2`` (NEOX rope, q/k/v biases, GQA, F32) model; return its weights.

    No ``rope_freqs``: llama.cpp's qwen2 graph passes no rope factors.
    """
    return _write(
        path, "qwen2", seed=seed, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=n_head_kv, n_ff=n_ff, n_vocab=n_vocab, n_ctx_train=n_ctx_train,
        freq_base=freq_base, rms_eps=rms_eps, qkv_bias=True, extra_kv=extra_kv,
    )


def write_tiny_qwen2vl(
    path: str | Path,
    *,
    seed: int,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 96,
    n_ctx_train: int = 64,
    freq_base: float = 10000.0,
    rms_eps: float = 1e-6,
    rope_sections: tuple[int, int, int, int] | None = None,
    extra_kv: dict[str, Any] | None = None,
) -> TinyModel:
    """Write a tiny ``qwen2vl`` model: qwen2's layout, multi-section rope (``ggml_rope_multi``).

    ``{arch}.rope.dimension_sections`` (INT32 x 4, required by the loader) defaults to the
    proportions of Qwen2-VL ([16, 24, 24, 0] of 64 pairs): for head_dim 16, [2, 3, 3, 0].
    For text tokens llama.cpp gives the three first sections the token position and the
    fourth position 0, so with section 3 empty the rope equals NEOX rope.
    """
    half = (n_embd // n_head) // 2
    if rope_sections is None:
        s1 = (3 * half) // 8
        rope_sections = (half - 2 * s1, s1, s1, 0)
    return _write(
        path, "qwen2vl", seed=seed, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=n_head_kv, n_ff=n_ff, n_vocab=n_vocab, n_ctx_train=n_ctx_train,
        freq_base=freq_base, rms_eps=rms_eps, qkv_bias=True, rope_sections=rope_sections,
        extra_kv=extra_kv,
    )


def write_tiny_gemma3(
    path: str | Path,
    *,
    seed: int,
    n_layer: int = 6,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 96,
    n_ctx_train: int = 64,
    freq_base: float = 10000.0,
    freq_base_swa: float | None = 1000.0,
    n_swa: int = 24,
    swa_pattern: int | None = 3,
    rms_eps: float = 1e-6,
    extra_kv: dict[str, Any] | None = None,
) -> TinyModel:
    """Write a tiny ``gemma3`` model (NEOX rope, GQA, F32, sliding-window layers); return it.

    What llama.cpp's gemma3 graph (``src/models/gemma3.cpp``) reads: ``token_embd`` (scaled
    by sqrt(n_embd) in the graph), per layer ``attn_norm``, ``attn_q/k/v``, ``attn_q_norm`` and
    ``attn_k_norm`` (per-head RMSNorm, shape ``(head_dim,)``), ``attn_output``,
    ``post_attention_norm``, ``ffn_norm``, ``ffn_gate/up/down`` (GELU-gated) and
    ``post_ffw_norm``; ``output_norm``, ``output``. Queries are scaled by 1/sqrt(head_dim)
    (``f_attention_scale`` for every size but 27B); no final logit soft-capping key is written.

    Sliding window: ``{arch}.attention.sliding_window`` = ``n_swa`` turns SWA on; layer il is a
    sliding-window layer when ``il % p < p - 1`` with p = ``swa_pattern``
    (``llama_hparams::set_swa_pattern``), written as ``{arch}.attention.sliding_window_pattern``;
    ``None`` writes no pattern key and llama.cpp takes gemma3's default p = 6. The SWA layers'
    rope base is ``{arch}.rope.freq_base_swa`` = ``freq_base_swa`` (``None``: no key, the
    global base). ``n_swa`` = 0 writes no window: every layer is global.
    """
    path = Path(path)
    arch = "gemma3"
    rng = np.random.default_rng(seed)
    tok_embd, output_norm, output, layers = _random_model(
        rng, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        n_ff=n_ff, n_vocab=n_vocab, qkv_bias=False,
    )
    hd = n_embd // n_head
    # the graph multiplies the embeddings by sqrt(n_embd): entries of std 1/sqrt(n_embd) give
    # a residual stream of RMS ~1, the scale of the post-norm outputs added to it
    tok_embd = (tok_embd / np.sqrt(n_embd)).astype(np.float32)

    def norm_w(n, mean):
        return (mean + rng.standard_normal(n) * 0.1).astype(np.float32)

    for layer in layers:
        # q, k are RMS-normalised per head: weights ~1.6 give attention logits of std ~2.5
        # (q.k / sqrt(hd) with entries of RMS 1.6), position-sensitive but not saturated
        layer.attn_q_norm = norm_w(hd, 1.6)
        layer.attn_k_norm = norm_w(hd, 1.6)
        layer.attn_post_norm = norm_w(n_embd, 1.0)
        # a smaller FFN share of the residual: ggml's CPU GELU rounds through a float16 table,
        # whose occasional off-by-one-f16 cells (float32 vs float64 inputs) are the tiny
        # gemma3's main difference from the reference (max rel err ~6e-4 here, 1e-3 at 1.0)
        layer.ffn_post_norm = norm_w(n_embd, 0.5)

    if n_swa > 0:
        p = 6 if swa_pattern is None else int(swa_pattern)
        swa_layers = tuple(p == 0 or (il % p < p - 1) for il in range(n_layer))
    else:
        swa_layers = (False,) * n_layer

    w = _begin(path, arch, seed=seed, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
               n_ff=n_ff, n_vocab=n_vocab, n_ctx_train=n_ctx_train, freq_base=freq_base, rms_eps=rms_eps)
    w.add_key_length(hd)
    w.add_value_length(hd)
    if n_swa > 0:
        w.add_sliding_window(int(n_swa))
        if swa_pattern is not None:
            w.add_sliding_window_pattern(int(swa_pattern))
        if freq_base_swa is not None:
            w.add_rope_freq_base_swa(float(freq_base_swa))
    extra = _add_vocab(w, arch, n_vocab, extra_kv)
    _add_tensors_and_close(w, tok_embd, output_norm, output, layers, _LAYER_TENSORS + (
        ("attn_q_norm.weight", "attn_q_norm"), ("attn_k_norm.weight", "attn_k_norm"),
        ("post_attention_norm.weight", "attn_post_norm"), ("post_ffw_norm.weight", "ffn_post_norm"),
    ))

    return TinyModel(
        path=path, arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=n_head_kv, n_ff=n_ff, n_vocab=n_vocab, n_ctx_train=n_ctx_train,
        freq_base=float(freq_base), rms_eps=float(np.float32(rms_eps)), tok_embd=tok_embd,
        output_norm=output_norm, output=output, layers=layers, extra_kv=extra,
        n_swa=int(n_swa) if n_swa > 0 else 0, swa_layers=swa_layers,
        freq_base_swa=float(freq_base_swa) if (n_swa > 0 and freq_base_swa is not None) else None,
    )


# ----------------------------------------------------------------------------- loading


def assert_refused_to_load(path: str | Path, message: str, *, timeout: float = 120, **llama_kwargs: Any) -> None:
    """Load ``path`` with ``llama_cpp.Llama(model_path=path, verbose=True, **llama_kwargs)``
    (``n_ctx`` 64 unless given) in a child process, so that an abort cannot take the test run
    with it: the library must refuse the model (``ValueError``, the process does not abort) and
    its log (stderr) must contain ``message``. Raises AssertionError otherwise, and
    subprocess.TimeoutExpired after ``timeout`` seconds."""
    kw = {"n_ctx": 64} | llama_kwargs
    code = (
        "import llama_cpp, sys\n"
        f"try:\n    llama_cpp.Llama(model_path={str(path)!r}, verbose=True, **{kw!r})\n"
        "except ValueError:\n    print('REFUSED'); sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and "REFUSED" in r.stdout, r.stderr[-2000:]
    assert message in r.stderr, r.stderr[-2000:]


def assert_dynamic_k_steps_after(llm: Any, toks: list[int], n_orig: int) -> None:
    """Dynamic k on a fresh ``llm``: k = 1 when created and after the first ``n_orig`` tokens of
    ``toks`` (n_orig = the file's L), k = 2 once token n_orig + 1 is in the cache (seed 002's
    consistent dynamic mode at the default ratio 2: k = 1 while n <= L, else the smallest power
    of two 2^e with 2^e · L >= n). ``toks`` has n_orig + 1 to 2 · n_orig tokens."""
    from ggufrope import runtime

    assert runtime.dynamic_in_use(llm) is True and runtime.factor_in_use(llm) == 1.0
    llm.eval(toks[:n_orig])
    assert runtime.factor_in_use(llm) == 1.0
    llm.eval(toks[n_orig:])
    assert runtime.factor_in_use(llm) == 2.0
