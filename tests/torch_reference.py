"""An independent float64 torch forward pass of the tiny models of ``tests/tiny_models.py``.

It is independent of the code under test: nothing here comes from ``ggufrope`` (no
``methods.freq_factors``, ``inv_freq``, ``logn_scale`` or ``rope_reference``). The
frequencies and the log-n scale are transcribed from the seeds (``../shared/seeds/``):

- ``none``: ``inv_freq = base ** (-arange(0, d, 2) / d)`` (RoPE; seed 001 eq. 2);
- ``linear`` (PI): ``inv_freq / k`` (seed 004);
- ``ntk`` (NTK-aware, seed 001): the same with ``base' = base * k ** (d / (d - 2))``;
- ``ntk-mixed`` (seed 000 eq. 7, Su's own code): ``inv_freq *= exp(-a * arange(1, d/2 + 1) ** b)``
  with ``a = ln(k) / (d/2) ** b`` (from the constraint ``a (d/2)^b = log k``);
- ``ntk-fixed`` (seed 000 eq. 5): ``ntk-mixed`` with ``b = 1``;
- log-n (seed 000, Table 2, "only applied beyond the pretraining max length"):
  ``s(p) = max(1, log_L(n))`` with ``n = p + 1`` tokens seen by the query at 0-based position p.

Network (llama, qwen2, qwen2vl): embeddings -> per layer [RMSNorm -> q, k, v (+ bias for
qwen2) -> RoPE with θ_i(p) = p · inv_freq_i -> log-n: q · s(p) after RoPE -> causal GQA
attention, scale 1/sqrt(head_dim) -> o proj -> residual -> RMSNorm -> SwiGLU -> residual]
-> final RMSNorm -> lm head.

gemma3 (:func:`forward_gemma3`): embeddings · sqrt(n_embd) -> per layer [RMSNorm -> q, k, v ->
per-head RMSNorm of q and k -> RoPE (NEOX) -> q · 1/sqrt(head_dim) -> causal attention (SWA
layers: also only keys at distance < n_swa) -> o proj -> RMSNorm (post-attention) ->
residual -> RMSNorm -> GELU(tanh)-gated FFN (through ggml's float16 GELU table by default, as
llama.cpp's CPU backend computes it) -> RMSNorm (post-FFN) -> residual] -> final
RMSNorm -> lm head. Global layers use the file's base with the method's frequencies and
log-n; sliding-window layers use the SWA base, plain RoPE and no log-n (stock llama.cpp and
transformers scale global layers only).

RoPE layout is llama.cpp's on the stored weights: ``llama`` NORMAL (pairs (2i, 2i+1)),
``qwen2`` / ``qwen2vl`` / ``gemma3`` NEOX (pairs (i, i + d/2)); for text tokens qwen2vl's
multi-section rope gives every section the same position, which is NEOX rope when section 3
is empty.

Dynamic NTK (issue 13, seed 002): :func:`dynamic_factor` (k from the number of positions seen),
:func:`rerotate_keys` (a change of table as one rotation of cached keys) and
:func:`forward_dynamic` (chunk by chunk with per-layer KV caches, consistent or inconsistent).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

if TYPE_CHECKING:  # only for annotations: any object with TinyModel's fields will do
    from tiny_models import TinyModel

DT = torch.float64

#: seed 000: "b = 0.625 is an empirical value" for NTK-RoPE-mixed
SEED_B = 0.625

#: the methods :func:`seed_inv_freq` knows
SEED_METHODS = ("none", "linear", "ntk", "ntk-fixed", "ntk-mixed")


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.float64), dtype=DT)


def _arange(*args) -> torch.Tensor:
    return torch.arange(*args, dtype=DT)


# ----------------------------------------------------------------------------- the seeds' formulas


def seed_inv_freq(method: str, d: int, base: float, k: float = 1.0, b: float = SEED_B) -> torch.Tensor:
    """θ_i / p in radians per token for pairs i = 0 .. d/2-1, transcribed from the seeds.

    ``method``: one of :data:`SEED_METHODS`; ``d``: rotary dims; ``base``: β; ``k``: the
    extension factor; ``b``: NTK-RoPE-mixed's exponent (ignored by the other methods).
    """
    if method not in SEED_METHODS:
        raise ValueError(f"unknown method {method!r} (known: {', '.join(SEED_METHODS)})")
    if method == "ntk":  # seed 001: a factor λ = k^(2/(d-2)) on the per-digit base, base' = base·k^(d/(d-2))
        base = base * k ** (d / (d - 2))
    inv_freq = base ** (-_arange(0, d, 2) / d)
    if method == "linear":  # position interpolation: n -> n/k
        inv_freq = inv_freq / k
    elif method in ("ntk-fixed", "ntk-mixed"):
        if method == "ntk-fixed":  # seed 000: "When b = 1 ... we denote as NTK-RoPE-fixed"
            b = 1.0
        a = math.log(k) / (d / 2) ** b  # a (d/2)^b = log k
        inv_freq = inv_freq * torch.exp(-a * _arange(1, d / 2 + 1) ** b)  # λ_1···λ_m = exp(a m^b)
    return inv_freq


def seed_freq_factors(method: str, d: int, k: float, b: float = SEED_B) -> np.ndarray:
    """The per-pair divisors ff_i = θ_i(plain) / θ_i(method) implied by :func:`seed_inv_freq`
    (independent of the base), float64, shape ``(d/2,)``."""
    base = 10000.0
    return (seed_inv_freq("none", d, base) / seed_inv_freq(method, d, base, k, b)).numpy()


def seed_logn_scale(pos: torch.Tensor | Sequence[int] | np.ndarray, L: int) -> torch.Tensor:
    """s(p) = max(1, log_L(p + 1)) for 0-based positions (seed 000, Table 2)."""
    n = torch.as_tensor(np.asarray(pos, dtype=np.float64), dtype=DT) + 1.0
    return torch.clamp(torch.log(n) / math.log(L), min=1.0)


# ----------------------------------------------------------------------------- building blocks


def apply_rope(
    x: torch.Tensor,
    pos: torch.Tensor,
    inv_freq: torch.Tensor,
    mode: str,
    logn: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate ``x`` of shape ``(n_tokens, n_heads, head_dim)`` in place-free torch float64.

    ``pos``: ``(n_tokens,)`` positions; ``inv_freq``: ``(n_dims/2,)`` radians per token
    (:func:`seed_inv_freq`); ``mode``: ``"normal"`` or ``"neox"``.
    Channels >= n_dims pass through. ``logn``: optional ``(n_tokens,)`` multiplier applied
    to every channel after the rotation.
    """
    half = inv_freq.shape[0]
    n_dims = 2 * half
    theta = pos.to(DT)[:, None] * inv_freq.to(DT)[None, :]  # (T, half)
    c = torch.cos(theta)[:, None, :]
    s = torch.sin(theta)[:, None, :]
    if mode == "normal":
        a, b = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        ra, rb = a * c - b * s, a * s + b * c
        rot = torch.stack((ra, rb), dim=-1).flatten(-2)  # interleave back
    elif mode == "neox":
        a, b = x[..., :half], x[..., half:n_dims]
        rot = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    else:
        raise ValueError(f"mode must be 'normal' or 'neox', got {mode!r}")
    y = torch.cat((rot, x[..., n_dims:]), dim=-1)
    if logn is not None:
        y = y * logn.to(DT)[:, None, None]
    return y


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def rope_inv_freq(
    model: TinyModel, method: str = "none", k: float = 1.0, b: float = SEED_B, freq_base: float | None = None
) -> torch.Tensor:
    """The radians per token llama.cpp uses for ``model``'s (global) layers: the seed's
    frequencies of ``method`` at the file's β (or ``freq_base``), divided by the file's
    ``rope_freqs`` tensor where the graph passes it (llama only; qwen2's and gemma3's graphs
    pass no rope factors)."""
    base = model.freq_base if freq_base is None else float(freq_base)
    inv = seed_inv_freq(method, model.n_rot, base, k, b)
    if model.rope_freqs is not None and model.arch == "llama":
        inv = inv / _t(model.rope_freqs)
    return inv


def _positions(tokens: Sequence[int], positions: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.as_tensor(list(tokens), dtype=torch.long)
    n = tok.shape[0]
    pos_np = np.arange(n, dtype=np.float64) if positions is None else np.asarray(positions, dtype=np.float64)
    if pos_np.shape != (n,):
        raise ValueError("positions must have one entry per token")
    return tok, torch.as_tensor(pos_np, dtype=DT)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """GQA attention: ``q`` (T, nh, hd), ``k``/``v`` (T, nkv, hd), ``visible`` (T_q, T_k) bool.
    Query head j reads kv head j // (nh / nkv) (ggml's broadcast, HF's repeat_kv)."""
    n, nh, hd = q.shape
    group = nh // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    att = torch.einsum("qhd,khd->hqk", q, k) * scale
    att = att.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", att, v).reshape(n, nh * hd)


def forward(
    model: TinyModel,
    tokens: Sequence[int],
    positions: Sequence[int] | None = None,
    *,
    method: str = "none",
    k: float = 1.0,
    b: float = SEED_B,
    logn_ctx: int = 0,
    freq_base: float | None = None,
    attn_logit_scale: float = 1.0,
    **kw,
) -> np.ndarray:
    """Logits ``(n_tokens, n_vocab)`` float64 of ``model`` on ``tokens``.

    ``positions`` default to ``0 .. n_tokens-1``; attention is causal in position order.
    ``method``, ``k``, ``b``: the context-extension method (:func:`seed_inv_freq`), composed
    with the file's ``rope_freqs``; ``none`` is plain RoPE. ``logn_ctx`` = L > 0 multiplies
    each query by s(p) = max(1, log_L(p+1)) after RoPE. ``freq_base`` overrides the file's β
    (stock ``rope_freq_base``). ``attn_logit_scale`` multiplies every attention logit
    (q·k / sqrt(head_dim)) before the softmax (llama/qwen2 only). A ``gemma3`` model goes to
    :func:`forward_gemma3` (``kw``).
    """
    if model.arch == "gemma3":
        if attn_logit_scale != 1.0:
            raise TypeError("attn_logit_scale: not for gemma3")
        return forward_gemma3(model, tokens, positions, method=method, k=k, b=b, logn_ctx=logn_ctx,
                              freq_base=freq_base, **kw)
    if kw:
        raise TypeError(f"unexpected arguments {sorted(kw)}")
    tok, pos = _positions(tokens, positions)
    n = tok.shape[0]
    hd, nh, nkv = model.head_dim, model.n_head, model.n_head_kv
    inv = rope_inv_freq(model, method, k, b, freq_base)
    logn = seed_logn_scale(pos, logn_ctx) if logn_ctx else None
    mode = model.rope_mode
    eps = model.rms_eps

    x = _t(model.tok_embd)[tok]  # (T, n_embd)
    causal = pos[None, :] <= pos[:, None]
    for L in model.layers:
        h = _rms_norm(x, _t(L.attn_norm), eps)
        q = h @ _t(L.wq).T
        kk = h @ _t(L.wk).T
        v = h @ _t(L.wv).T
        if L.bq is not None:
            q, kk, v = q + _t(L.bq), kk + _t(L.bk), v + _t(L.bv)
        q = apply_rope(q.view(n, nh, hd), pos, inv, mode, logn)
        kk = apply_rope(kk.view(n, nkv, hd), pos, inv, mode)
        o = _attend(q, kk, v.view(n, nkv, hd), causal, attn_logit_scale / math.sqrt(hd))
        x = x + o @ _t(L.wo).T
        h = _rms_norm(x, _t(L.ffn_norm), eps)
        g = torch.nn.functional.silu(h @ _t(L.ffn_gate).T) * (h @ _t(L.ffn_up).T)
        x = x + g @ _t(L.ffn_down).T
    x = _rms_norm(x, _t(model.output_norm), eps)
    return (x @ _t(model.output).T).numpy()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (gemma's ``gelu_pytorch_tanh``; ggml's ``ggml_gelu``)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def gelu_tanh_f16_table(x: torch.Tensor) -> torch.Tensor:
    """GELU as ggml's CPU backend computes it (``GGML_GELU_FP16``, ``ggml-cpu/vec.h``): the input
    rounded to float16 indexes a table of float16 results; x <= -10 gives 0, x >= 10 gives x.
    The table's rounding is a relative 2^-11 per element, about 2.6e-3 relative on the tiny
    gemma3's logits against the exact GELU; modelled here it leaves about 3e-4 (inputs that
    round to the neighbouring float16 in float32 and float64)."""
    h = torch.float16
    y = gelu_tanh(x.to(h).to(DT)).to(h).to(DT)
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, y))


def forward_gemma3(
    model: TinyModel,
    tokens: Sequence[int],
    positions: Sequence[int] | None = None,
    *,
    method: str = "none",
    k: float = 1.0,
    b: float = SEED_B,
    logn_ctx: int = 0,
    freq_base: float | None = None,
    scale_swa: bool = False,
    gelu_f16: bool = True,
) -> np.ndarray:
    """Logits ``(n_tokens, n_vocab)`` float64 of a tiny ``gemma3`` model (module docstring).

    Global layers (``not model.swa_layers[il]``): base β (``freq_base`` overrides it), the
    method's frequencies, log-n when ``logn_ctx`` > 0. Sliding-window layers: the SWA base,
    plain RoPE, no log-n, and a query at position p sees keys at p' with 0 <= p - p' < n_swa
    (llama.cpp's ``LLAMA_SWA_TYPE_STANDARD``). ``scale_swa=True`` is the wrong rule (the
    method and log-n applied to the SWA layers too, at the SWA base), for tests that need
    to tell the two apart. ``gelu_f16``: GELU through ggml's CPU float16 table
    (:func:`gelu_tanh_f16_table`), else the exact GELU (other backends).
    """
    tok, pos = _positions(tokens, positions)
    n = tok.shape[0]
    hd, nh, nkv = model.head_dim, model.n_head, model.n_head_kv
    eps = model.rms_eps
    mode = model.rope_mode
    base = model.freq_base if freq_base is None else float(freq_base)
    base_swa = model.freq_base_swa if model.freq_base_swa is not None else base
    logn = seed_logn_scale(pos, logn_ctx) if logn_ctx else None
    inv_global = seed_inv_freq(method, model.n_rot, base, k, b)
    if scale_swa:
        inv_swa, logn_swa = seed_inv_freq(method, model.n_rot, base_swa, k, b), logn
    else:
        inv_swa, logn_swa = seed_inv_freq("none", model.n_rot, base_swa), None
    dist = pos[:, None] - pos[None, :]  # query position - key position
    causal = dist >= 0
    window = causal & (dist < model.n_swa)

    gelu = gelu_tanh_f16_table if gelu_f16 else gelu_tanh

    x = _t(model.tok_embd)[tok] * math.sqrt(model.n_embd)
    for il, L in enumerate(model.layers):
        swa = model.swa_layers[il]
        inv, ln, visible = (inv_swa, logn_swa, window) if swa else (inv_global, logn, causal)
        h = _rms_norm(x, _t(L.attn_norm), eps)
        q = _rms_norm((h @ _t(L.wq).T).view(n, nh, hd), _t(L.attn_q_norm), eps)
        kk = _rms_norm((h @ _t(L.wk).T).view(n, nkv, hd), _t(L.attn_k_norm), eps)
        v = (h @ _t(L.wv).T).view(n, nkv, hd)
        q = apply_rope(q, pos, inv, mode, ln)
        kk = apply_rope(kk, pos, inv, mode)
        q = q * (1.0 / math.sqrt(hd))  # query_pre_attn_scalar = head_dim (llama.cpp: f_attention_scale)
        o = _attend(q, kk, v, visible, 1.0)
        x = x + _rms_norm(o @ _t(L.wo).T, _t(L.attn_post_norm), eps)
        h = _rms_norm(x, _t(L.ffn_norm), eps)
        g = gelu(h @ _t(L.ffn_gate).T) * (h @ _t(L.ffn_up).T)
        x = x + _rms_norm(g @ _t(L.ffn_down).T, _t(L.ffn_post_norm), eps)
    x = _rms_norm(x, _t(model.output_norm), eps)
    return (x @ _t(model.output).T).numpy()


# ----------------------------------------------------------------------------- dynamic NTK (issue 13)
#
# Seed 002 (``../shared/seeds/002_*.txt``, "A Potential Rotation Inconsistency of Dynamic Scaled
# RoPE"): dynamic NTK lets k grow with the current length. With a KV cache, Hugging Face's version
# is *inconsistent*: a cached key keeps the rotation it was written with, so one query meets keys
# of several tables (seed 002 eq. 1, QK^T = [r(k_0, α_0), r(k_1, α_1), r(k_2, α_2)] · r(q, α_2)).
# The *consistent* version rotates every key with the query's table (eq. 3,
# [r(k_0, α_2), r(k_1, α_2), r(k_2, α_2)] · r(q, α_2)). ggufrope's design (design notes §5) gets
# eq. 3 without an un-roped cache: going from table A to table B rotates a cached key at position
# p by p·θ_i·(1/ff_B,i − 1/ff_A,i) = p·(inv_B,i − inv_A,i) (:func:`rerotate_keys`), one rope op
# per layer per step of k, like llama.cpp's K-shift.

#: the named schedules of :func:`dynamic_factor` (a float r > 1 is a geometric grid)
DYNAMIC_SCHEDULES = ("pow2", "exact")


def dynamic_factor(n: int, L: int, schedule: str | float = "pow2") -> float:
    """The factor k of dynamic NTK for a context that has seen ``n`` positions (its largest
    position + 1) with trained context ``L``.

    k = 1 while n <= L (the unmodified model). Beyond L, k >= n/L always, so that no position
    exceeds k·L (positions 0 .. n-1 < k·L):

    - ``"pow2"``: k = 2^ceil(log2(n/L)), the smallest power of two with k·L >= n. Hand values
      for L = 64: n = 65 -> 2, 128 -> 2, 129 -> 4, 256 -> 4, 300 -> 8. At n = 2L exactly k = 2
      (positions 0 .. 2L-1 all lie below k·L; the same k as the static auto rule k = n_ctx/L at
      n_ctx = 2L). Computed in integers, no log2 rounding at the boundaries.
    - ``"exact"``: k = n/L, continuous (a new k at every new position; seed 002's
      α_dynamicNTK = α·(max_seq + scale·(seq − max_seq))/max_seq with α = scale = 1, which is
      also Hugging Face's ``dynamic`` rope at factor 1). For reference, not for an engine.
    - a float r > 1: the geometric grid k = r^e with e the smallest integer such that
      r^e·L >= n (``"pow2"`` is r = 2). For L = 64, r = 1.5: n = 96 -> 1.5, n = 97 -> 2.25.
    """
    n, L = int(n), int(L)
    if L <= 0 or n < 0:
        raise ValueError(f"need L > 0 and n >= 0, got n={n}, L={L}")
    if n <= L:
        return 1.0
    if schedule == "exact":
        return n / L
    if schedule == "pow2":
        k = 1
        while k * L < n:
            k *= 2
        return float(k)
    if isinstance(schedule, (int, float)) and not isinstance(schedule, bool) and schedule > 1:
        r = float(schedule)
        e = max(1, math.ceil(math.log(n / L) / math.log(r)))
        while r**e * L < n:  # repair a log rounded down
            e += 1
        while e > 1 and r ** (e - 1) * L >= n:  # or rounded up
            e -= 1
        return r**e
    raise ValueError(f"schedule must be one of {DYNAMIC_SCHEDULES} or a float > 1, got {schedule!r}")


def chunk_factors(chunks: Sequence[int], L: int, schedule: str | float = "pow2") -> list[float]:
    """The k each chunk of :func:`forward_dynamic` runs with: ``dynamic_factor`` of the number of
    positions seen once the chunk is in (chunk sizes ``chunks``, positions from 0)."""
    out, n = [], 0
    for c in chunks:
        n += int(c)
        out.append(dynamic_factor(n, L, schedule))
    return out


def rerotate_keys(
    k: torch.Tensor, pos: torch.Tensor, inv_old: torch.Tensor, inv_new: torch.Tensor, mode: str
) -> torch.Tensor:
    """Change the table of keys already roped with ``inv_old`` to ``inv_new``.

    ``k``: ``(n_tokens, n_heads, head_dim)`` roped keys; ``pos``: ``(n_tokens,)`` their positions;
    ``inv_old``/``inv_new``: ``(n_dims/2,)`` radians per token (one table for all rows, as a
    layer's cache has). RoPE rotates pair i by p·inv_i, rotations of a pair compose by adding
    angles, so the change is a rope by p·(inv_new − inv_old) = p·θ_i·(1/ff_new,i − 1/ff_old,i):
    the design notes' table ff' = 1/(1/ff_new − 1/ff_old), negative entries allowed. Not valid
    for log-n (keys are never scaled, so it never arises)."""
    return apply_rope(k, pos, inv_new.to(DT) - inv_old.to(DT), mode)


class DynamicLayerCache:
    """One layer's KV cache in :func:`forward_dynamic`, rows in position order.

    ``k``: ``(n, n_head_kv, head_dim)`` keys as the attention reads them (after RoPE);
    ``k_inv``: ``(n, n_rot/2)`` the table each row is currently roped with; ``v``:
    ``(n, n_head_kv, head_dim)``; ``pos``: ``(n,)`` positions."""

    def __init__(self, n_kv: int, head_dim: int, half: int):
        self.k = torch.zeros((0, n_kv, head_dim), dtype=DT)
        self.v = torch.zeros((0, n_kv, head_dim), dtype=DT)
        self.k_inv = torch.zeros((0, half), dtype=DT)
        self.pos = torch.zeros((0,), dtype=DT)

    def retable(self, inv_new: torch.Tensor, mode: str) -> None:
        """Consistent mode, before a chunk: re-rotate every cached key to ``inv_new``
        (:func:`rerotate_keys`). Every row carries one table then (the previous chunk's)."""
        if self.k.shape[0] == 0:
            return
        old = self.k_inv[0]
        assert torch.equal(self.k_inv, old.expand_as(self.k_inv)), "consistent cache rows with mixed tables"
        if not torch.equal(old, inv_new):  # a zero rotation is exact anyway; skip the work
            self.k = rerotate_keys(self.k, self.pos, old, inv_new, mode)
            self.k_inv = inv_new.expand_as(self.k_inv).clone()

    def append(self, k: torch.Tensor, v: torch.Tensor, inv: torch.Tensor, pos: torch.Tensor) -> None:
        self.k = torch.cat((self.k, k))
        self.v = torch.cat((self.v, v))
        self.k_inv = torch.cat((self.k_inv, inv.expand(k.shape[0], -1)))
        self.pos = torch.cat((self.pos, pos))


def forward_dynamic(
    model: TinyModel,
    tokens: Sequence[int],
    *,
    method: str = "ntk-mixed",
    b: float = SEED_B,
    logn_ctx: int = 0,
    schedule: str | float = "pow2",
    chunks: Sequence[int] | None = None,
    L: int | None = None,
    consistent: bool = True,
    gelu_f16: bool = True,
    return_cache: bool = False,
):
    """Logits ``(n_tokens, n_vocab)`` float64 of dynamic NTK, processed chunk by chunk with a KV
    cache, positions ``0 .. n_tokens-1``.

    ``chunks``: chunk sizes summing to ``len(tokens)`` (``None``: one chunk = prefill in one call;
    several = ubatches; all ones = token-by-token decode). Chunk j runs with
    k_j = ``dynamic_factor(n_j, L, schedule)``, n_j = the number of positions once chunk j is in
    (so no position of the chunk lies beyond k_j·L); ``L`` defaults to ``model.n_ctx_train``.
    The chunk's queries and keys are roped with the table of ``method`` at k_j (and ``b``,
    composed with the file's ``rope_freqs`` as :func:`rope_inv_freq`); log-n (``logn_ctx`` > 0)
    scales each query by s(p) as in :func:`forward`, independent of k.

    ``consistent=True`` (seed 002 eq. 3): before the chunk, every cached key of every layer is
    re-rotated to the table of k_j (:func:`rerotate_keys`), so queries and keys share one table.
    ``consistent=False`` (seed 002 eq. 1, Hugging Face's dynamic NTK): cached keys keep the
    table they were written with. Either way cached keys and values are never recomputed: a
    token's layer-l key and value come from its hidden state as computed when its chunk ran,
    with that chunk's k (an engine caches them; it does not re-run earlier tokens).

    gemma3: sliding-window layers keep plain RoPE at the SWA base and no log-n (their table never
    changes, so nothing is re-rotated there), global layers as above (:func:`forward_gemma3`;
    ``gelu_f16`` as there).

    ``return_cache=True`` returns ``(logits, caches)`` with one :class:`DynamicLayerCache` per
    layer as it stands after the last chunk.
    """
    tok, pos_all = _positions(tokens, None)
    n_tok = tok.shape[0]
    chunks = [n_tok] if chunks is None else [int(c) for c in chunks]
    if any(c <= 0 for c in chunks) or sum(chunks) != n_tok:
        raise ValueError(f"chunks must be positive sizes summing to {n_tok}, got sum {sum(chunks)}")
    L = model.n_ctx_train if L is None else int(L)
    gemma = model.arch == "gemma3"
    hd, nh, nkv = model.head_dim, model.n_head, model.n_head_kv
    eps, mode = model.rms_eps, model.rope_mode
    swa = model.swa_layers if gemma else (False,) * model.n_layer
    if gemma:
        base_swa = model.freq_base_swa if model.freq_base_swa is not None else model.freq_base
        inv_swa = seed_inv_freq("none", model.n_rot, base_swa)
    gelu = gelu_tanh_f16_table if gelu_f16 else gelu_tanh

    caches = [DynamicLayerCache(nkv, hd, model.n_rot // 2) for _ in model.layers]
    out = []
    start = 0
    for size, kf in zip(chunks, chunk_factors(chunks, L, schedule)):
        sl = slice(start, start + size)
        start += size
        pos = pos_all[sl]
        inv_global = rope_inv_freq(model, method, kf, b)
        logn = seed_logn_scale(pos, logn_ctx) if logn_ctx else None

        x = _t(model.tok_embd)[tok[sl]]
        if gemma:
            x = x * math.sqrt(model.n_embd)
        for il, (Lw, cache) in enumerate(zip(model.layers, caches)):
            inv, ln = (inv_swa, None) if swa[il] else (inv_global, logn)
            if consistent:
                cache.retable(inv, mode)
            h = _rms_norm(x, _t(Lw.attn_norm), eps)
            q, kk, v = h @ _t(Lw.wq).T, h @ _t(Lw.wk).T, h @ _t(Lw.wv).T
            if Lw.bq is not None:
                q, kk, v = q + _t(Lw.bq), kk + _t(Lw.bk), v + _t(Lw.bv)
            q, kk, v = q.view(size, nh, hd), kk.view(size, nkv, hd), v.view(size, nkv, hd)
            if gemma:
                q, kk = _rms_norm(q, _t(Lw.attn_q_norm), eps), _rms_norm(kk, _t(Lw.attn_k_norm), eps)
            q = apply_rope(q, pos, inv, mode, ln)
            cache.append(apply_rope(kk, pos, inv, mode), v, inv, pos)
            dist = pos[:, None] - cache.pos[None, :]  # (chunk, cached incl. this chunk)
            visible = dist >= 0
            if swa[il]:
                visible = visible & (dist < model.n_swa)
            if gemma:
                o = _attend(q * (1.0 / math.sqrt(hd)), cache.k, cache.v, visible, 1.0)
                x = x + _rms_norm(o @ _t(Lw.wo).T, _t(Lw.attn_post_norm), eps)
                h = _rms_norm(x, _t(Lw.ffn_norm), eps)
                g = gelu(h @ _t(Lw.ffn_gate).T) * (h @ _t(Lw.ffn_up).T)
                x = x + _rms_norm(g @ _t(Lw.ffn_down).T, _t(Lw.ffn_post_norm), eps)
            else:
                o = _attend(q, cache.k, cache.v, visible, 1.0 / math.sqrt(hd))
                x = x + o @ _t(Lw.wo).T
                h = _rms_norm(x, _t(Lw.ffn_norm), eps)
                g = torch.nn.functional.silu(h @ _t(Lw.ffn_gate).T) * (h @ _t(Lw.ffn_up).T)
                x = x + g @ _t(Lw.ffn_down).T
        x = _rms_norm(x, _t(model.output_norm), eps)
        out.append(x @ _t(model.output).T)
    logits = torch.cat(out).numpy()
    return (logits, caches) if return_cache else logits
