"""dcmha for PyTorch: DCMHA and MHA attention cores as `torch.ops.dcmha` operators.

    out = dcmha_torch.attention(q, k, v, compose=(pre, post), causal=True)

q is (B, H, T, D), k and v (B, Hk, S, D) in logical shape (any strides with unit stride along
D: the views a fused qkv projection and `.transpose(1, 2)` give are read in place). `compose`
is None (multi-head attention) or (pre, post) as the official DCFormer code passes them to
`_atten_context`: each None or (sw, qw1, qw2, kw1, kw2, qdd, kdd), any entry None where the
configuration lacks it, in the official layouts (qw1, qw2 (B, T, R, N); kw1, kw2 (B, S, R, N);
qdd (B, T, N); kdd (B, S, N); sw (N, N) without the identity) or with a group axis (B, L, G, R, M),
(B, L, G, M), (G, M, M). Differentiable in q, k, v and every compose tensor.
"""
import os as _os

import torch

torch.ops.load_library(_os.path.join(_os.path.dirname(__file__), "libdcmha_torch_ops.so"))

_SIDE_ENTRIES = ("sw", "qw1", "qw2", "kw1", "kw2", "qdd", "kdd")


def _compose_entries(compose):
    """The 14 optional tensors of the ops (pre, then post), or [] for MHA."""
    if compose is None:
        return []
    if not isinstance(compose, (tuple, list)) or len(compose) != 2:
        raise ValueError("dcmha_torch.attention: compose: expected None or (pre, post), got "
                         f"{type(compose).__name__}" +
                         (f" of {len(compose)}" if isinstance(compose, (tuple, list)) else ""))
    entries = []
    for name, side in zip(("pre", "post"), compose):
        if side is None:
            entries += [None] * len(_SIDE_ENTRIES)
            continue
        if not isinstance(side, (tuple, list)) or len(side) != len(_SIDE_ENTRIES):
            raise ValueError(f"dcmha_torch.attention: compose {name}: expected None or "
                             f"(sw, qw1, qw2, kw1, kw2, qdd, kdd)")
        entries += list(side)
    return [] if all(e is None for e in entries) else entries


def _settings(fn, causal, window, scale):
    if window is not None and window < 1:
        raise ValueError(f"dcmha_torch.{fn}: window: expected None or >= 1, got {window}")
    if scale is not None and not scale > 0:
        raise ValueError(f"dcmha_torch.{fn}: scale: expected None or > 0, got {scale}")
    return bool(causal), 0 if window is None else int(window), 0.0 if scale is None else float(scale)


_PRODUCTS = ("exact", "storage_type")


def _storage_type_products(fn, products):
    if products not in _PRODUCTS:
        raise ValueError(f"dcmha_torch.{fn}: products: expected 'exact' or 'storage_type', "
                         f"got {products!r}")
    return products == "storage_type"


def attention(q, k, v, compose=None, *, causal=True, window=None, scale=None,
              query_lengths=None, key_lengths=None, products="exact"):
    """The attention core: softmax(Compose_pre(scale q k^T) masked), Compose_post, times v.

    causal: query t sees key s iff s <= t + S - T (bottom-right aligned, per sequence with
    lengths); window: W >= 1 also requires (t + S - T) - s < W, i.e. W keys up to the query's
    own position (None: no window); scale: None for 1/sqrt(D); query_lengths, key_lengths:
    int64 (B) tensors of a right-padded batch (padding rows get zero output and gradients).
    products: "exact" (float products on widened values: a bfloat16 or float16 result is the
    float32 result rounded once) or "storage_type" (bfloat16 products with float accumulation on
    the CPU's AVX512_BF16 where it has it, P' and dS rounded to bfloat16 first; every other dtype
    and CPU computes as "exact"; dcmha's docs/performance.md has both modes' errors).
    Returns the output (B, H, T, Dv); the softmax statistics are kept for the backward.
    """
    return torch.ops.dcmha.attention(q, k, v, _compose_entries(compose),
                                     *_settings("attention", causal, window, scale),
                                     query_lengths, key_lengths,
                                     _storage_type_products("attention", products))


def attention_forward(q, k, v, compose=None, *, causal=True, window=None, scale=None,
                      query_lengths=None, key_lengths=None, products="exact"):
    """attention's forward alone, without autograd: (out, lse), lse (B, H, T) in float32
    (float64 for float64 inputs)."""
    return torch.ops.dcmha.attention_forward(q, k, v, _compose_entries(compose),
                                             *_settings("attention_forward", causal, window, scale),
                                             query_lengths, key_lengths,
                                             _storage_type_products("attention_forward", products))


def dynamic_weights(x, dw1, qkw, dd, *, gelu="erf", eps=1e-6):
    """The dynamic weight projection (float32, float64, bfloat16, float16): x (B, L, E) and the official parameters
    `dyn_w_proj.dw1` (E, G, 4, K), `.qkw` (G, 4, K, 2R, M), `.dd` (E, G, 4M) -> compose weights
    (pre, post), each (None, qw1, qw2, kw1, kw2, qdd, kdd) with w1/w2 (B, L, G, R, M) and dd
    (B, L, G, M): the `compose` argument of attention for self-attention (replace the None by a
    static W where the model has one). gelu: "erf" (official PyTorch) or "tanh" (JAX training).
    Differentiable in x and the three parameters."""
    out = torch.ops.dcmha.dynamic_weights(x, dw1, qkw, dd, gelu, float(eps))
    return (None, *out[:6]), (None, *out[6:])


_KEY_ENTRIES = (3, 4, 6)       # kw1, kw2, kdd: kept by the cache
_QUERY_ENTRIES = (0, 1, 2, 5)  # sw, qw1, qw2, qdd: given with each step's queries


def _side_entries(compose, keep):
    """The 14 entries of compose with only the entries `keep` of each side ([] if none)."""
    entries = _compose_entries(compose)
    if not entries:
        return []
    picked = [e if i % 7 in keep else None for i, e in enumerate(entries)]
    return [] if all(e is None for e in picked) else picked


class DecodeCache:
    """A layer's decode cache held by the operator side (torch.classes.dcmha.DecodeCache):
    keys, values and the key-wise compose terms of every token appended, in float32, float64,
    bfloat16 or float16.

        cache = DecodeCache(batch=B, heads=H, head_dim=D, rank=2, pre_key_wise=True,
                            post_key_wise=True, capacity=4096, max_step=prompt_length)
        out = cache.step(q, k, v, compose)   # prefill (n tokens), then decode (1 token) ...

    `compose` is the step's (pre, post) as attention takes it, over the new tokens only (e.g.
    dynamic_weights of their hidden states): the cache keeps its key-wise terms, the queries use
    the static and query-wise ones. window: a sliding-window layer of W keys (then capacity is
    derived: W + max_step - 1 slots). counts (int64 (B)): a right-padded step, sequence b
    appending only its first counts[b] tokens; its rows past counts[b] are zero.
    """

    def __init__(self, batch, heads, head_dim, *, kv_heads=None, value_dim=None, groups=1,
                 rank=0, pre_key_wise=False, post_key_wise=False, capacity=0, window=None,
                 max_step=1, dtype=torch.float32):
        names = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
                 torch.float16: "float16"}
        if dtype not in names:
            raise ValueError(f"dcmha_torch.DecodeCache: dtype: expected torch.float32, "
                             f"torch.float64, torch.bfloat16 or torch.float16, got {dtype}")
        self.dtype = dtype
        self._cache = torch.classes.dcmha.DecodeCache(
            batch, heads, heads if kv_heads is None else kv_heads, head_dim,
            head_dim if value_dim is None else value_dim, groups, rank, pre_key_wise,
            post_key_wise, capacity, 0 if window is None else window, max_step, names[dtype])

    def append(self, k_new, v_new, compose=None, counts=None):
        """Appends the new tokens' keys, values and key-wise terms (B, Hk, n, D)."""
        self._cache.append(k_new, v_new, _side_entries(compose, _KEY_ENTRIES), counts)

    def decode(self, q_new, compose=None, *, scale=None):
        """The new tokens' queries (B, H, n, D) against everything kept -> (B, H, n, Dv)."""
        if scale is not None and not scale > 0:
            raise ValueError(f"dcmha_torch.DecodeCache.decode: scale: expected None or > 0, "
                             f"got {scale}")
        return self._cache.decode(q_new, _side_entries(compose, _QUERY_ENTRIES),
                                  0.0 if scale is None else float(scale))

    def step(self, q_new, k_new, v_new, compose=None, *, counts=None, scale=None):
        """append, then decode: one prefill or decode step of the layer."""
        self.append(k_new, v_new, compose, counts)
        return self.decode(q_new, compose, scale=scale)

    def reset(self):
        """Forgets every token (memory is kept)."""
        self._cache.reset()

    def length(self, b):
        """Tokens appended to sequence b since the last reset."""
        return self._cache.length(b)

    def kept(self, b):
        """Keys of sequence b still held (a window layer holds at most its ring)."""
        return self._cache.kept(b)

    @property
    def capacity(self):
        return self._cache.capacity()
