"""Run the official DCFormer PyTorch model's attention on dcmha.

    import dcmha_torch.dcformer
    n = dcmha_torch.dcformer.patch(model)      # every DCMHAttention now uses dcmha
    dcmha_torch.dcformer.unpatch(model)        # back to the official forward

`patch(model)` finds the official `DCMHAttention` modules by class name and attributes (the
model file may have been loaded under any module name, as `trust_remote_code` does) and gives
each one an instance-level `forward` with the official signature
`(x, freqs_cis, mask, input_pos=None, fast_infer=True, gen_mask=None, batch_indexes=None,
count=None)` (`count` is unused, as officially). The rest of the model (embeddings, norms,
feed-forward, the mask and rotary tables DCFormer.forward builds, its serving loop) is
untouched. The patched forward uses the module's own parameters and buffers: `wqkv`, `wo`,
`q_norm` / `k_norm`, the model file's rotary function (`apply_rotary_emb`, looked up per call in
the globals of the module's class, as the official forward does), the dynamic weight
parameters, and in inference the module's `kv_cache` (KVKWCache). It reproduces what each
official path computes, quirks included, so that logits, loss, every parameter gradient and
greedy tokens match the unpatched model. The attention core of every path is one
`dcmha_torch.attention` call (one per chunk where the official chunking cuts keys); the masks
the model passes are checked to be the official ones (once per mask tensor, not per layer), and
anything else raises ValueError rather than computing something different.

Training (`is_training`; the official chunked loop over `q_chunk_size` query blocks):
  * q, k, v as the official code makes them; the dynamic weights from the *merged* copies
    `dyn_w_proj.dw_m` / `qkw_m` (the parameters the official training path differentiates;
    `dw1` / `qkw` / `dd` get no gradient there, nor here) through `dcmha_torch.dynamic_weights`
    (views of dw_m / qkw_m in the op's (E, G, 4, K), (G, 4, K, 2R, M), (E, G, 4M) layout; the
    module's own torch code instead where the op cannot compute it: bf16, a non-CPU tensor, or a
    module whose activation or norm is not erf/tanh GELU and the no-scale RMS norm).
  * The window is read from the mask the model passes (and the mask checked to be causal with
    that window): the official training mask (`make_window_mask(T, window_size)`) lets a query
    see window_size + 1 keys, so local layers run dcmha with window = window_size + 1; global
    layers with no window. The layer's own window_size only sets the chunk key range below.
  * The official key range of each chunk, `kv_start = stop - q_chunk_size - window_size` with
    `window_size = x.shape[-1]` (the model width E, not T) on global layers, is reproduced:
    where it cuts keys the mask would allow (global layers with T > E + q_chunk_size), each chunk
    is a separate dcmha call on exactly the official key range; otherwise the whole sequence is
    one call.
  * `use_sw` (not reachable through DCFormerBlock, which builds use_sw=False): the official
    training path passes `dyn_w_proj.sw` = W + I to `_cross_head_proj`, which adds it on top of
    the residual (2a + aW); reproduced by giving dcmha W + I as its residual-free static weight.
  * `use_dcmha=False` (plain MHA branch): no compose, q is *not* scaled by 1/sqrt(D) (the
    official branch never scales it), and the rows of the last partial chunk are 0 (its loop
    runs T // q_chunk_size chunks); all reproduced.
  * The output is cast to the module's `torch_dtype` as the official `y` buffer is.
  * Not reproduced: `_atten_context` rounds the probabilities to bfloat16 before the post
    compose; dcmha keeps the inputs' dtype (float32 accumulation for bf16/fp16/float32, float64
    for float64). A float32/float64 model therefore matches the official one with that cast
    removed, and a bf16 model differs by that rounding.

Prefill (inference, L > 1 tokens) and decode (inference, one token):
  * `input_pos` must be (B, L) per-sequence positions, consecutive within a row, and
    `batch_indexes` the (B,) cache rows, as the official KVKWCache.update needs (the official
    `generate()` passes a 1-D input_pos, which its own cache update cannot take).
  * The caches are written exactly as the official update writes them, in place (slot =
    position % cache length, rows batch_indexes): k_cache, v_cache; kw_cache with the merged
    key-wise matrices kw1^T kw2 + diag(kdd) + dyn_w_proj.sw; and, in prefill only, kw_sub_cache
    with the key-wise factors (kw1, kw2 of pre and post, and the two kdd). Values are written
    detached: this path is for inference (no gradients flow through the caches).
  * The mask the model passes is checked to be the official one (global: causal over the cache
    slots; local: the ring mask of window_size keys over 2 * window_size slots); each row then
    reads, in position order, the cache slots that mask selects (a view of the cache where the
    slots are already in order, a gather otherwise), and dcmha runs with per-sequence
    query_lengths / key_lengths, bottom-right causal, window = window_size on local layers
    (the official decode mask lets a query see window_size keys, one fewer than training).
  * Prefill: the query-wise weights from `dw1` / `qkw` / `dd` (what DynamicWeightProjection's
    forward uses) through `dcmha_torch.dynamic_weights`; the key-wise factors read back from
    kw_sub_cache, as the official prefill does (so where a position was decoded before, and
    the official decode never writes kw_sub_cache, the stale factors are read as officially).
    With use_sw the official CrossHeadProjection applies aW without the residual: reproduced
    with static weight W - I.
  * Decode (fast_infer=True, what DCFormerBlock passes): the query-wise weights from the merged
    `dw_m` / `qkw_m` (fast_infer=False: from dw1 / qkw / dd, as the official slow path); the
    key-wise part is the official kw_cache itself, given to dcmha as a rank-N key-wise term
    (kw1 = I, kw2 = the cached N x N matrix, kdd = -1 cancelling dcmha's residual, which the
    cache already holds through dyn_w_proj.sw). That term costs N^2 per key and side, reading
    the memory the official decode reads; it keeps the caches exactly the official ones (no
    factor cache of the patch's own, and kw_sub_cache stays as stale as officially).
    `query_wise=True`: only the query-wise terms
    and dyn_w_proj.sw, as the official fast decode (training and prefill ignore query_wise,
    here too).
  * GQA (n_local_heads < n_head) is refused in inference: the official KVKWCache sizes its
    key-wise caches by n_local_heads and cannot run it. Training takes it (dcmha's kv head
    h // (H / Hk), which is the official broadcast for Hk = 1).
"""
import types
import weakref

import torch

import dcmha_torch as _dcmha

__all__ = ["patch", "unpatch", "is_patched"]

_ATTRIBUTES = ("wqkv", "wo", "dyn_w_proj", "n_head", "n_local_heads", "head_dim", "dim",
               "scale_factor", "q_chunk_size", "is_training", "use_dcmha", "window_size")


def _is_dcmha_attention(module):
    return type(module).__name__ == "DCMHAttention" and all(hasattr(module, a) for a in _ATTRIBUTES)


def is_patched(module):
    """Whether this DCMHAttention module runs on dcmha."""
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) is _forward


def patch(model):
    """Make every official DCMHAttention in `model` run on dcmha (see the module docstring).
    Idempotent: modules already patched are left as they are. Returns the number of
    DCMHAttention modules, all of which use dcmha afterwards; raises ValueError when `model` has
    none."""
    modules = [m for m in model.modules() if _is_dcmha_attention(m)]
    if not modules:
        raise ValueError(f"dcmha_torch.dcformer.patch: {type(model).__name__} has no DCMHAttention "
                         "module (expected the official DCFormer model)")
    for m in modules:
        if is_patched(m):
            continue
        official = getattr(type(m).forward, "__globals__", {})
        if "apply_rotary_emb" not in official:
            raise ValueError("dcmha_torch.dcformer.patch: the model file of "
                             f"{type(m).__module__}.DCMHAttention has no apply_rotary_emb")
        groups = getattr(m.dyn_w_proj, "num_groups", 1)
        if groups != 1:
            raise ValueError(f"dcmha_torch.dcformer.patch: dyn_w_proj.num_groups = {groups}; the "
                             "official DCMHAttention paths support 1 only")
        if "forward" in m.__dict__:  # an instance-level forward someone set before: kept
            m._dcmha_saved_forward = m.__dict__["forward"]
        m.forward = types.MethodType(_forward, m)
    return len(modules)


def unpatch(model):
    """Give every patched DCMHAttention in `model` its previous forward back; returns how many."""
    n = 0
    for m in model.modules():
        if _is_dcmha_attention(m) and is_patched(m):
            del m.forward
            if "_dcmha_saved_forward" in m.__dict__:
                m.forward = m.__dict__.pop("_dcmha_saved_forward")
            n += 1
    return n


# ---------------------------------------------------------------------------------------------
# The patched forward


def _forward(self, x, freqs_cis, mask, input_pos=None, fast_infer=True, gen_mask=None,
             batch_indexes=None, count=None):
    B, T, _ = x.shape
    kv_size = self.n_local_heads * self.head_dim
    q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
    q = q.view(B, T, self.n_head, self.head_dim)
    k = k.view(B, T, self.n_local_heads, self.head_dim)
    v = v.view(B, T, self.n_local_heads, self.head_dim)
    if getattr(self, "use_qk_norm", False):
        q, k = self.q_norm(q), self.k_norm(k)
    rotary = type(self).forward.__globals__["apply_rotary_emb"]  # as the official forward finds it
    q, k = rotary(q, freqs_cis), rotary(k, freqs_cis)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D) views, unit stride along D
    if self.is_training:
        y = _training(self, x, q, k, v, mask)
    elif T == 1:
        y = _decode(self, x, q, k, v, mask, gen_mask, input_pos, batch_indexes, fast_infer)
    else:
        y = _prefill(self, x, q, k, v, mask, input_pos, batch_indexes)
    return self.wo(y.transpose(1, 2).reshape(B, T, self.dim))


# ---------------------------------------------------------------------------------------------
# The dynamic weight projection


def _op_settings(p, gate):
    """(gelu, eps) where the module computes what dcmha_torch.dynamic_weights does, else None."""
    act, norm = p.dw_hidden_activation, p.dw1_norm
    if type(act) is not torch.nn.GELU:
        return None
    gelu = {"none": "erf", "tanh": "tanh"}.get(getattr(act, "approximate", "none"))
    if (gelu is None or type(norm).__name__ != "RMSnormNoscale" or getattr(norm, "dim", -1) != -1
            or not hasattr(norm, "epsilon")):
        return None
    if gate is not torch.tanh and type(gate) is not torch.nn.Tanh:
        return None
    return gelu, float(norm.epsilon)


def _merged_parameters(p):
    """The merged copies dw_m (E, 4K + 4N) and qkw_m (4, K, 2R N) as dw1 (E, 1, 4, K), qkw
    (1, 4, K, 2R, N) and dd (E, 1, 4N) views (the training and fast decode paths' parameters)."""
    K = p.qkw_m.shape[1]
    dw1 = p.dw_m[:, :4 * K].reshape(p.dw_m.shape[0], 1, 4, K)
    dd = p.dw_m[:, 4 * K:].reshape(p.dw_m.shape[0], 1, -1)
    qkw = p.qkw_m.reshape(1, 4, K, -1, p.num_heads)
    return dw1, qkw, dd


def _project(p, x, dw1, qkw, dd, gate):
    """(pre, post), each (qw1, qw2, kw1, kw2, qdd, kdd) in the official layouts (B, L, R, N),
    (B, L, N): through the op where it applies, else in torch with the module's own
    activation, norm and gate."""
    settings = _op_settings(p, gate)
    tensors = (x, dw1, qkw, dd)
    if (settings is not None and x.dtype in (torch.float32, torch.float64)
            and all(t.dtype == x.dtype and t.device.type == "cpu" for t in tensors)):
        pre, post = _dcmha.dynamic_weights(x, dw1, qkw, dd, gelu=settings[0], eps=settings[1])
        return tuple(tuple(t.squeeze(2) for t in side[1:]) for side in (pre, post))
    R = qkw.shape[3] // 2
    hidden = p.dw_hidden_activation(torch.einsum("ble,egck->blgck", x, dw1))
    w = torch.einsum("blgck,gckim->blgcim", hidden, qkw)[:, :, 0]  # (B, L, 4, 2R, N)
    w1, w2 = p.dw1_norm(w[..., :R, :]), w[..., R:, :]
    gates = gate(torch.einsum("ble,egn->blgn", x, dd)[:, :, 0]).unflatten(-1, (4, -1))
    return tuple((w1[:, :, c], w2[:, :, c], w1[:, :, c + 1], w2[:, :, c + 1], gates[:, :, c],
                  gates[:, :, c + 1]) for c in (0, 2))


def _merged_key(side, sw):
    """The official kw_cache entry of one side: kw1^T kw2 + diag(kdd) + sw, (B, L, N, N) indexed
    [input head, output head]."""
    _, _, kw1, kw2, _, kdd = side
    return torch.einsum("blim,blin->blmn", kw1, kw2) + torch.diag_embed(kdd) + sw


# ---------------------------------------------------------------------------------------------
# Training


class _Checked:
    """The masks already checked, by identity and version (DCFormer.forward hands every layer of
    a kind the same mask tensor, so a forward checks each mask once, not once per layer)."""

    def __init__(self, size=8):
        self.entries, self.size = [], size

    @staticmethod
    def _key(tensors):
        return tuple((id(t), t._version) for t in tensors)

    def get(self, tensors, settings):
        key = self._key(tensors)
        for refs, k, s, result in self.entries:
            if k == key and s == settings and all(r() is t for r, t in zip(refs, tensors)):
                return True, result
        return False, None

    def put(self, tensors, settings, result):
        refs = tuple(weakref.ref(t) for t in tensors)
        self.entries = [(refs, self._key(tensors), settings, result)] + self.entries[:self.size - 1]


_checked = _Checked()
_BLOCK = 1 << 22  # elements of the temporaries of one step of a mask check


def _training_window(mask, T):
    """The window (None: none) of the training mask, checked to be causal with that window."""
    if mask is None or mask.dim() != 4 or mask.shape[-2] < T or mask.shape[-1] < T:
        raise ValueError("dcmha_torch.dcformer: training: expected the model's (1, 1, T, S) mask, "
                         f"got {None if mask is None else tuple(mask.shape)}")
    found, window = _checked.get((mask,), ("training", T))
    if found:
        return window
    m = mask[..., :T, :T]
    seen = int(m.reshape(-1, T, T)[0, T - 1].sum())
    window = None if seen >= T else seen
    ok = seen > 0
    rows = max(1, _BLOCK // T)
    for start in range(0, T, rows) if ok else ():
        stop = min(T, start + rows)
        t = torch.arange(start, stop, device=m.device)[:, None]
        s = torch.arange(T, device=m.device)[None, :]
        expected = (s <= t) if window is None else (s <= t) & (t - s < window)
        block = m[..., start:stop, :].bool()
        if not torch.equal(block, expected.expand_as(block)):
            ok = False
            break
    if not ok:
        raise ValueError("dcmha_torch.dcformer: training: the mask is not causal with a sliding "
                         "window (the official DCFormer masks are); unpatch the model to run it")
    _checked.put((mask,), ("training", T), window)
    return window


def _slice_side(side, start, stop, kv_start):
    sw, qw1, qw2, kw1, kw2, qdd, kdd = side
    return (sw, qw1[:, start:stop], qw2[:, start:stop], kw1[:, kv_start:stop],
            kw2[:, kv_start:stop], qdd[:, start:stop], kdd[:, kv_start:stop])


def _out_dtype(module):
    dtype = module.torch_dtype
    return dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()


def _training(self, x, q, k, v, mask):
    B, H, T, D = q.shape
    C = self.q_chunk_size
    window = _training_window(mask, T)
    span = x.shape[-1] if self.window_size is None else self.window_size  # official quirk: E
    if self.use_dcmha:
        p = self.dyn_w_proj
        pre, post = _project(p, x, *_merged_parameters(p), torch.tanh)
        sw = p.sw.unbind(0) if self.use_sw else (None, None)  # W + I, as officially passed
        compose = ((sw[0],) + pre, (sw[1],) + post)
        chunks, rows, scale = range(T // C + 1), T, self.scale_factor
    else:  # the official MHA branch: T // C chunks, q not scaled
        compose, chunks, rows, scale = None, range(T // C), (T // C) * C, 1.0
    spans = []
    for i in chunks:
        start, stop = i * C, min((i + 1) * C, T)
        if start < stop:
            spans.append((start, stop, max(0, stop - C - span)))
    # Does the official chunk key range cut keys the mask lets in?
    cuts = any(kv_start > (0 if window is None else max(0, start - window + 1))
               for start, _, kv_start in spans)
    if not cuts:
        spans = [(0, rows, 0)] if rows > 0 else []
    outs = []
    for start, stop, kv_start in spans:
        c = None if compose is None else tuple(_slice_side(s, start, stop, kv_start)
                                               for s in compose)
        outs.append(_dcmha.attention(q[:, :, start:stop], k[:, :, kv_start:stop],
                                     v[:, :, kv_start:stop], c, causal=True, window=window,
                                     scale=scale))
    if rows < T:
        outs.append(q.new_zeros(B, H, T - rows, v.shape[-1]))
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return y.to(_out_dtype(self))


# ---------------------------------------------------------------------------------------------
# Inference: the official KVKWCache


class _Step:
    """One inference call's positions, cache rows and the cache geometry."""

    def __init__(self, module, q, input_pos, batch_indexes):
        B, _, L, _ = q.shape
        self.cache = module.kv_cache
        if self.cache is None:
            raise RuntimeError("dcmha_torch.dcformer: inference needs the model's caches "
                               "(DCFormer.setup_caches)")
        if module.n_local_heads != module.n_head:
            raise NotImplementedError("dcmha_torch.dcformer: inference with n_local_heads != "
                                      "n_head: the official KVKWCache cannot hold it either")
        if input_pos is None or input_pos.dim() != 2 or tuple(input_pos.shape) != (B, L):
            raise ValueError("dcmha_torch.dcformer: inference: expected input_pos (B, L) = "
                             f"({B}, {L}) of per-sequence positions, got "
                             f"{None if input_pos is None else tuple(input_pos.shape)}")
        if batch_indexes is None or batch_indexes.numel() != B:
            raise ValueError("dcmha_torch.dcformer: inference: expected batch_indexes, the (B,) "
                             "cache rows of the sequences (the official cache update needs them)")
        pos = input_pos.to(torch.long)
        self.first = pos[:, 0]
        if not torch.equal(pos, self.first[:, None] + torch.arange(L, device=pos.device)):
            raise ValueError("dcmha_torch.dcformer: inference: the positions of each row must be "
                             "consecutive")
        self.input_pos, self.pos, self.B, self.L = input_pos, pos, B, L
        self.rows = batch_indexes.to(torch.long).reshape(B)
        self.Sc = self.cache.seq_length
        self.slots = pos % self.Sc
        self.window = module.window_size if module.window_size is not None else self.Sc

    def write(self, k, v, kw=None, kw_sub=None):
        """The official update, in place: rows `rows`, slots position % cache length."""
        c, rows, slots = self.cache, self.rows, self.slots
        heads = torch.arange(c.k_cache.shape[1], device=rows.device)
        index = (rows[:, None, None], heads[None, :, None], slots[:, None, :])
        c.k_cache[index] = k.detach().to(c.k_cache.dtype)
        c.v_cache[index] = v.detach().to(c.v_cache.dtype)
        if kw is not None:
            c.kw_cache[rows[:, None], slots] = kw.detach().to(c.kw_cache.dtype)
        if kw_sub is not None:
            c.kw_sub_cache[rows[:, None], slots] = kw_sub.detach().to(c.kw_sub_cache.dtype)

    def check_mask(self, mask):
        """The official mask must select, for the query at position p, the slots of the positions
        [p - window + 1, p] (global layers: window = cache length, i.e. causal). `mask` is the
        model's, before the official slice to the cache length."""
        B, L, Sc = self.B, self.L, self.Sc
        if (mask is None or mask.dim() != 4 or mask.shape[-1] < Sc or mask.shape[-2] != L
                or mask.shape[0] not in (1, B)):
            raise ValueError(f"dcmha_torch.dcformer: inference: expected the model's (B, 1, {L}, "
                             f"{Sc}) mask, got {None if mask is None else tuple(mask.shape)}")
        settings = ("inference", self.window, Sc)
        if self._checked_before(mask, settings):
            return
        k_mask = mask[..., :Sc]
        rows = max(1, _BLOCK // (B * Sc))
        slots = torch.arange(Sc, device=self.pos.device)
        for start in range(0, L, rows):
            p = self.pos[:, start:start + rows, None]
            d = torch.remainder(p - slots, Sc)
            expected = ((d <= p) & (d < self.window))[:, None]
            block = k_mask[:, :, start:start + rows].bool()
            shape = torch.broadcast_shapes(block.shape, expected.shape)
            if not torch.equal(block.expand(shape), expected.expand(shape)):
                raise ValueError("dcmha_torch.dcformer: inference: the mask is not the official "
                                 f"{'window ' + str(self.window) if self.window < Sc else 'causal'}"
                                 " mask over the cache; unpatch the model to run it")
        _checked.put((mask, self.input_pos), settings, None)

    def _checked_before(self, mask, settings):
        return _checked.get((mask, self.input_pos), settings)[0]

    def reader(self):
        """Per row, the slots of positions [lo, last] in position order (lo = max(0, first -
        window + 1)): (take(cache, slot_axis), key_lengths)."""
        last = self.first + self.L - 1
        lo = (self.first - self.window + 1).clamp_min(0)
        lengths = last - lo + 1
        S = int(lengths.max())
        b0 = int(self.rows[0])
        in_order = (int(lo.max()) == 0 and S <= self.Sc and torch.equal(
            self.rows, torch.arange(b0, b0 + self.B, device=self.rows.device)))
        if in_order:  # slots are positions: views of the caches
            def take(t, axis):
                return t[b0:b0 + self.B, :, :S] if axis == 2 else t[b0:b0 + self.B, :S]
        else:
            positions = lo[:, None] + torch.arange(S, device=lo.device)
            positions = torch.minimum(positions, last[:, None])
            slots = positions % self.Sc  # padding keys read the last slot; key_lengths hide them

            def take(t, axis):
                if axis == 2:
                    return t[self.rows[:, None], :, slots].transpose(1, 2)
                return t[self.rows[:, None], slots]
        return take, lengths, S

    def attend(self, module, q, k, v, compose, S, key_lengths):
        window = self.window if self.window < S else None
        return _dcmha.attention(q, k.to(q.dtype), v.to(q.dtype), compose, causal=True,
                                window=window, scale=module.scale_factor,
                                query_lengths=torch.full((self.B,), self.L, dtype=torch.long),
                                key_lengths=key_lengths.cpu())


def _identity_residual_free(w):
    """W - I for a CrossHeadProjection weight (G, M, M) that the official code applies without
    the residual."""
    return w[0] - torch.eye(w.shape[-1], dtype=w.dtype, device=w.device)


def _prefill(self, x, q, k, v, mask, input_pos, batch_indexes):
    step = _Step(self, q, input_pos, batch_indexes)
    p = self.dyn_w_proj
    pre, post = _project(p, x, p.dw1, p.qkw, p.dd, p.dw_activation)
    sw = p.sw
    kw = torch.stack([_merged_key(pre, sw[0]), _merged_key(post, sw[1])], dim=2)
    kw_sub = torch.stack([pre[2], pre[3], post[2], post[3], torch.stack([pre[5], post[5]], 2)], 2)
    step.write(k, v, kw, kw_sub)
    step.check_mask(mask)
    take, lengths, S = step.reader()
    sub = take(step.cache.kw_sub_cache, 1).to(q.dtype)  # (B, S, 5, 2, N)
    static = [_identity_residual_free(proj.w).to(q.dtype) if proj.use_sw else None
              for proj in (p.pre_proj, p.post_proj)]
    compose = ((static[0], pre[0], pre[1], sub[:, :, 0], sub[:, :, 1], pre[4], sub[:, :, 4, 0]),
               (static[1], post[0], post[1], sub[:, :, 2], sub[:, :, 3], post[4], sub[:, :, 4, 1]))
    return step.attend(self, q, take(step.cache.k_cache, 2), take(step.cache.v_cache, 2), compose,
                       S, lengths)


def _decode(self, x, q, k, v, mask, gen_mask, input_pos, batch_indexes, fast_infer):
    step = _Step(self, q, input_pos, batch_indexes)
    p = self.dyn_w_proj
    if fast_infer:
        params = _merged_parameters(p)
    else:
        if self.query_wise:
            raise AssertionError("dcmha_torch.dcformer: the official slow decode "
                                 "(fast_infer=False) asserts not query_wise")
        params = (p.dw1, p.qkw, p.dd)
    pre, post = _project(p, x, *params, p.dw_activation)
    query_wise = fast_infer and self.query_wise
    sw = p.sw
    if query_wise:  # the official fast decode writes no key-wise state
        step.write(k, v)
    else:
        step.write(k, v, torch.stack([_merged_key(pre, sw[0]), _merged_key(post, sw[1])], dim=2))
    k_mask = mask if self.window_size is None else gen_mask
    step.check_mask(k_mask)
    take, lengths, S = step.reader()
    B, N = step.B, self.n_head
    if query_wise:  # a (Q + sw): dcmha's residual plus static sw - I
        static = [(sw[i] - torch.eye(N, dtype=sw.dtype, device=sw.device)).to(q.dtype)
                  if self.use_sw else None for i in (0, 1)]
        compose = tuple((static[i], side[0], side[1], None, None, side[4], None)
                        for i, side in enumerate((pre, post)))
    else:  # a (Q + kw_cache): the cached N x N matrix as a rank-N key-wise term
        kw = take(step.cache.kw_cache, 1).to(q.dtype)  # (B, S, 2, N, N)
        eye = torch.eye(N, dtype=q.dtype, device=q.device).expand(B, S, N, N)
        minus_one = torch.full((), -1.0, dtype=q.dtype, device=q.device).expand(B, S, N)
        compose = tuple((None, side[0], side[1], eye, kw[:, :, i], side[4], minus_one)
                        for i, side in enumerate((pre, post)))
    return step.attend(self, q, take(step.cache.k_cache, 2), take(step.cache.v_cache, 2), compose,
                       S, lengths)
