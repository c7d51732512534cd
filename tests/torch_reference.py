"""An independent float64 torch forward pass of the tiny models of ``tests/tiny_models.py``.

It implements the math directly (no llama.cpp, no ``methods.rope_reference``) so that the
patched llama.cpp can be compared with a second implementation:

embeddings -> per layer [RMSNorm -> q, k, v (+ bias for qwen2) -> RoPE with
θ_i(p) = p · inv_freq_i (``methods.inv_freq`` with the method's divisors) -> log-n:
q · s(p) after RoPE -> causal GQA attention, scale 1/sqrt(head_dim) -> o proj -> residual
-> RMSNorm -> SwiGLU -> residual] -> final RMSNorm -> lm head.

RoPE layout is llama.cpp's on the stored weights: ``llama`` NORMAL (pairs (2i, 2i+1)),
``qwen2`` / ``qwen2vl`` NEOX (pairs (i, i + d/2)); for text tokens qwen2vl's multi-section
rope gives every section the same position, which is NEOX rope when section 3 is empty.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from ggufrope import methods

if TYPE_CHECKING:  # only for annotations: any object with TinyModel's fields will do
    from tiny_models import TinyModel

DT = torch.float64


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.float64), dtype=DT)


def apply_rope(
    x: torch.Tensor,
    pos: torch.Tensor,
    inv_freq: torch.Tensor,
    mode: str,
    logn: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate ``x`` of shape ``(n_tokens, n_heads, head_dim)`` in place-free torch float64.

    ``pos``: ``(n_tokens,)`` positions; ``inv_freq``: ``(n_dims/2,)`` radians per token
    (already divided by the method's factors); ``mode``: ``"normal"`` or ``"neox"``.
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


def effective_factors(model: TinyModel, factors: np.ndarray | None) -> np.ndarray | None:
    """Per-pair divisors llama.cpp applies: the method's ``factors`` times the file's
    ``rope_freqs`` (llama only; qwen2's graph passes no rope factors)."""
    ff = None if factors is None else np.asarray(factors, dtype=np.float64)
    if model.rope_freqs is not None and model.arch == "llama":
        rf = np.asarray(model.rope_freqs, dtype=np.float64)
        ff = rf if ff is None else ff * rf
    return ff


def forward(
    model: TinyModel,
    tokens: Sequence[int],
    positions: Sequence[int] | None = None,
    *,
    factors: np.ndarray | None = None,
    logn_ctx: int = 0,
    freq_base: float | None = None,
) -> np.ndarray:
    """Logits ``(n_tokens, n_vocab)`` float64 of ``model`` on ``tokens``.

    ``positions`` default to ``0 .. n_tokens-1``; attention is causal in token order.
    ``factors``: per-pair divisors ``(n_rot/2,)`` of the context-extension method
    (``methods.freq_factors``), composed with the file's ``rope_freqs``; ``None`` is plain
    RoPE. ``logn_ctx`` = L > 0 multiplies each query by ``methods.logn_scale(p, L)`` after
    RoPE. ``freq_base`` overrides the file's β (stock ``rope_freq_base``).
    """
    tok = torch.as_tensor(list(tokens), dtype=torch.long)
    n = tok.shape[0]
    pos_np = np.arange(n) if positions is None else np.asarray(positions, dtype=np.int64)
    if pos_np.shape != (n,):
        raise ValueError("positions must have one entry per token")
    pos = torch.as_tensor(pos_np, dtype=DT)

    hd, nh, nkv = model.head_dim, model.n_head, model.n_head_kv
    group = nh // nkv
    base = model.freq_base if freq_base is None else float(freq_base)
    inv = _t(methods.inv_freq(model.n_rot, base, effective_factors(model, factors)))
    logn = _t(methods.logn_scale(pos_np, logn_ctx)) if logn_ctx else None
    mode = model.rope_mode
    eps = model.rms_eps

    x = _t(model.tok_embd)[tok]  # (T, n_embd)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for L in model.layers:
        h = _rms_norm(x, _t(L.attn_norm), eps)
        q = h @ _t(L.wq).T
        k = h @ _t(L.wk).T
        v = h @ _t(L.wv).T
        if L.bq is not None:
            q, k, v = q + _t(L.bq), k + _t(L.bk), v + _t(L.bv)
        q = apply_rope(q.view(n, nh, hd), pos, inv, mode, logn)
        k = apply_rope(k.view(n, nkv, hd), pos, inv, mode)
        v = v.view(n, nkv, hd)
        # GQA: query head j reads kv head j // group (ggml's broadcast, HF's repeat_kv)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        att = torch.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, nh * hd)
        x = x + o @ _t(L.wo).T
        h = _rms_norm(x, _t(L.ffn_norm), eps)
        g = torch.nn.functional.silu(h @ _t(L.ffn_gate).T) * (h @ _t(L.ffn_up).T)
        x = x + g @ _t(L.ffn_down).T
    x = _rms_norm(x, _t(model.output_norm), eps)
    return (x @ _t(model.output).T).numpy()
