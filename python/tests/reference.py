"""DCMHA written plainly in PyTorch from the spec (dcmha-spec.md, section 1), for the tests: every
B x H x T x S tensor materialized, autograd through torch's own ops."""
import math

import torch

SIDE_ENTRIES = ("sw", "qw1", "qw2", "kw1", "kw2", "qdd", "kdd")


def _grouped(entry, index, heads):
    """An entry in the grouped layout: sw (G, M, M), qw/kw (B, L, G, R, M), dd (B, L, G, M)."""
    if entry is None:
        return None
    if index == 0:
        return entry.unsqueeze(0) if entry.dim() == 2 else entry
    grouped_rank = 5 if index <= 4 else 4
    return entry.unsqueeze(2) if entry.dim() == grouped_rank - 1 else entry


def compose(a, side):
    """Compose on a (B, H, T, S), side = (sw, qw1, qw2, kw1, kw2, qdd, kdd) or None."""
    if side is None or all(e is None for e in side):
        return a
    B, H, T, S = a.shape
    sw, qw1, qw2, kw1, kw2, qdd, kdd = (_grouped(e, i, H) for i, e in enumerate(side))
    G = next(e for e in (sw, qw1, kw1, qdd, kdd) if e is not None)
    G = G.shape[0] if sw is not None and G is sw else G.shape[2]
    M = H // G
    x = a.reshape(B, G, M, T, S)
    out = x.clone()
    if sw is not None:
        out = out + torch.einsum("bgmts,gmn->bgnts", x, sw)
    if qw1 is not None:
        hidden = torch.einsum("bgmts,btgrm->bgrts", x, qw1)
        out = out + torch.einsum("bgrts,btgrn->bgnts", hidden, qw2)
    if kw1 is not None:
        hidden = torch.einsum("bgmts,bsgrm->bgrts", x, kw1)
        out = out + torch.einsum("bgrts,bsgrn->bgnts", hidden, kw2)
    if qdd is not None:
        out = out + x * qdd.permute(0, 2, 3, 1).unsqueeze(-1)
    if kdd is not None:
        out = out + x * kdd.permute(0, 2, 3, 1).unsqueeze(-2)
    return out.reshape(B, H, T, S)


def visible(B, T, S, causal, window, query_lengths, key_lengths, device):
    """(B, 1, T, S) bool: which keys each query sees."""
    t = torch.arange(T, device=device).view(1, T, 1)
    s = torch.arange(S, device=device).view(1, 1, S)
    ql = torch.full((B,), T) if query_lengths is None else query_lengths
    kl = torch.full((B,), S) if key_lengths is None else key_lengths
    ql = ql.view(B, 1, 1)
    kl = kl.view(B, 1, 1)
    ok = (t < ql) & (s < kl)
    diagonal = t + kl - ql
    if causal:
        ok = ok & (s <= diagonal)
    if window:
        ok = ok & (diagonal - s < window)
    return ok.unsqueeze(1)


def attention(q, k, v, compose_weights=None, causal=True, window=None, scale=None,
              query_lengths=None, key_lengths=None):
    B, H, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hk, dim=1)
    v = v.repeat_interleave(H // Hk, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    pre, post = compose_weights if compose_weights is not None else (None, None)
    logits = compose(scale * q @ k.transpose(-2, -1), pre)
    mask = visible(B, T, S, causal, window, query_lengths, key_lengths, q.device)
    logits = logits.masked_fill(~mask, float("-inf"))
    # Rows that see no key: zero probabilities (and zero output), not NaN.
    seen = mask.any(-1, keepdim=True)
    probs = torch.where(seen, torch.softmax(torch.where(seen, logits, torch.zeros_like(logits)), -1)
                        .masked_fill(~mask, 0.0), torch.zeros_like(logits))
    probs = compose(probs, post)
    return probs @ v
