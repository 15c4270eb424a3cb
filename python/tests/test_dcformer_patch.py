"""dcmha_torch.dcformer.patch against the official DCFormer PyTorch model itself: training logits,
loss and every parameter gradient, prefill and decode through the model's own forward (greedy
tokens, logits and the caches), patched vs unpatched.

The official model file (shared/official/modeling_dcformer.py beside the repository, MIT) is
loaded under a generated module name, as `trust_remote_code` does, and only here, in the tests.
Without the `transformers` package a minimal stand-in for the two base classes it imports is put
in sys.modules while the file loads (and removed afterwards).

The official `_atten_context` (training path) casts the logits to float32 and the probabilities
to bfloat16. That cast is not a setting (torch_dtype only picks the masking value), so for the
float64 / float32 comparisons the unpatched reference runs with the loaded module's
`_atten_context` replaced, for the duration of the reference run only, by the same computation
without the two casts (its `_cross_head_proj` is the official one). The prefill and decode paths
have no such cast and run unmodified. The models are built with `torch_dtype` = the test dtype, so
that the official y buffers, caches and masking values are in that dtype.

The official RMSNorm and apply_rotary_emb compute in float32 whatever the model's dtype. Left so,
a float64 model rounds its hidden states to float32 at every norm, and float64 logits of the two
runs come out bitwise equal, which says little about 1e-9 agreement. The float64 comparisons
therefore run both models (unpatched and patched alike: the patch calls the model file's
apply_rotary_emb) with these two replaced by the same computations in the model's dtype. The
float32 comparisons run the model file as it is; their agreement is bounded by the official
model's own float32 rounding, which the test measures against float64 too.
"""
import contextlib
import copy
import importlib.util
import logging
import os
import sys
import types
import unittest
import uuid

import torch

import dcmha_torch
import dcmha_torch.dcformer as dcformer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OFFICIAL = os.path.join(ROOT, "..", "shared", "official")

# 4 layers: 0 and 2 local (window 8), 1 and 3 global; q chunks of 8 with a partial last chunk.
CONFIG = dict(block_size=64, vocab_size=50, n_layer=4, n_head=4, dim=64, q_chunk_size=8,
              window_size=8, window_type=None, use_qk_norm=True, norm_eps=1e-6)
# Width 16 < T - q_chunk_size, so the official global-layer key range (x.shape[-1] = E keys
# before each chunk) cuts keys the causal mask allows.
NARROW = dict(block_size=32, vocab_size=50, n_layer=2, n_head=4, dim=16, q_chunk_size=4,
              window_size=3, window_type=None, use_qk_norm=True, norm_eps=1e-6)

_official = None
ERRORS = {}  # measured max relative errors, printed at the end


def max_relative(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def note(name, value):
    ERRORS[name] = max(ERRORS.get(name, 0.0), value)


def tearDownModule():
    if ERRORS:
        width = max(len(k) for k in ERRORS)
        print("\ndcformer patch, max relative errors (patched vs official):", file=sys.stderr)
        for k, v in ERRORS.items():
            print(f"  {k:<{width}}  {v:.2e}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Loading the official model file


def _transformers_stand_in():
    class PretrainedConfig:
        def __init__(self, **kwargs):
            self.torch_dtype = kwargs.pop("torch_dtype", None)
            for key, value in kwargs.items():
                setattr(self, key, value)

    class PreTrainedModel(torch.nn.Module):
        config_class = None

        def __init__(self, config, *args, **kwargs):
            super().__init__()
            self.config = config

        def init_weights(self):
            self.apply(self._init_weights)

        def post_init(self):
            self.init_weights()

        @property
        def device(self):
            return next(self.parameters()).device

    modules = {name: types.ModuleType(name) for name in (
        "transformers", "transformers.modeling_utils", "transformers.configuration_utils",
        "transformers.utils")}
    modules["transformers.modeling_utils"].PreTrainedModel = PreTrainedModel
    modules["transformers.configuration_utils"].PretrainedConfig = PretrainedConfig
    modules["transformers.utils"].logging = types.SimpleNamespace(get_logger=logging.getLogger)
    return modules


@contextlib.contextmanager
def _transformers_importable():
    if importlib.util.find_spec("transformers") is not None:
        yield
        return
    modules = _transformers_stand_in()
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in modules:
            sys.modules.pop(name, None)


def official():
    """The official modeling module, loaded once under a generated package name."""
    global _official
    if _official is None:
        package = f"dcformer_remote_{uuid.uuid4().hex[:12]}"
        pkg = types.ModuleType(package)
        pkg.__path__ = [OFFICIAL]
        sys.modules[package] = pkg
        spec = importlib.util.spec_from_file_location(
            f"{package}.modeling_dcformer", os.path.join(OFFICIAL, "modeling_dcformer.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        with _transformers_importable():
            spec.loader.exec_module(module)
        _official = module
    return _official


@contextlib.contextmanager
def keeping_dtype(mod):
    """The official `_atten_context` without its float32 / bfloat16 casts (see the docstring)."""
    original = mod._atten_context

    def atten_context(query, key, value, atten_mask, pre_proj_dw_args, post_proj_dw_args,
                      dtype=torch.bfloat16):
        logits = query @ key.transpose(-2, -1)
        if pre_proj_dw_args is not None:
            logits = mod._cross_head_proj(logits, *pre_proj_dw_args)
        probs = torch.where(atten_mask, logits, torch.finfo(dtype).min).softmax(-1)
        if post_proj_dw_args is not None:
            probs = mod._cross_head_proj(probs, *post_proj_dw_args)
        return probs @ value

    mod._atten_context = atten_context
    try:
        yield
    finally:
        mod._atten_context = original


def _rotary_keeping_dtype(x, freqs_cis, mode="half"):
    """The official "half" rotary embedding, in x's dtype."""
    pairs = x.reshape(*x.shape[:-1], 2, -1).transpose(-1, -2)  # (B, T, H, D/2, 2): (d, d + D/2)
    f = freqs_cis.view(-1, pairs.size(1), 1, pairs.size(3), 2)
    a, b, cos, sin = pairs[..., 0], pairs[..., 1], f[..., 0], f[..., 1]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(3)


@contextlib.contextmanager
def float64_throughout(mod, enabled=True):
    """RMSNorm and apply_rotary_emb without their float32 casts (see the docstring)."""
    if not enabled:
        yield
        return
    norm_forward, rotary = mod.RMSNorm.forward, mod.apply_rotary_emb
    mod.RMSNorm.forward = lambda self, x: self._norm(x) * self.weight
    mod.apply_rotary_emb = _rotary_keeping_dtype
    try:
        yield
    finally:
        mod.RMSNorm.forward, mod.apply_rotary_emb = norm_forward, rotary


def attentions(model):
    return [m for m in model.modules() if type(m).__name__ == "DCMHAttention"]


def build(dtype, is_training, config=CONFIG, sw_layers=(), max_batch=3, seed=1, **overrides):
    """A random DCFormer in `dtype`, caches set up. Its dynamic weight parameters are drawn larger
    than the official init, so that compose changes the attention noticeably."""
    mod = official()
    torch.manual_seed(seed)
    cfg = mod.DCFormerConfig(is_training=is_training, torch_dtype=dtype, **{**config, **overrides})
    model = mod.DCFormer(cfg)
    for i in sw_layers:  # DCFormerBlock builds use_sw=False; the static-W variant by hand
        model.layers[i].attention = mod.DCMHAttention(cfg, i, use_sw=True)
    model.to(dtype)
    g = torch.Generator().manual_seed(seed + 1)

    def fill_(t, mean, std):
        t.copy_(mean + std * torch.randn(t.shape, generator=g, dtype=torch.float64))

    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm.scale"):
                fill_(t, 1.0, 0.1)
        for att in attentions(model):
            p = att.dyn_w_proj
            fill_(p.dw1, 0.0, 0.2)
            fill_(p.qkw, 0.0, 0.08)
            fill_(p.dd, 0.0, 0.1)
            if p.use_sw:
                fill_(p.pre_proj.w, 0.0, 0.2)
                fill_(p.post_proj.w, 0.0, 0.2)
            p.merge_weights()
    model.setup_caches(max_batch)
    return model


@contextlib.contextmanager
def counting(name):
    """Counts the calls of dcmha_torch.<name> (which dcformer calls through the package)."""
    original = getattr(dcmha_torch, name)
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(dcmha_torch, name, wrapper)
    try:
        yield calls
    finally:
        setattr(dcmha_torch, name, original)


@contextlib.contextmanager
def projection_in_torch():
    """dcformer's torch code for the dynamic weights instead of dcmha_torch.dynamic_weights (what
    it runs where the op cannot: bf16, a device, another activation or norm)."""
    original = dcformer._op_settings
    dcformer._op_settings = lambda p, gate: None
    try:
        yield
    finally:
        dcformer._op_settings = original


class OfficialModel(unittest.TestCase):
    told = False

    def setUp(self):
        if not os.path.isdir(OFFICIAL):
            reason = f"the official DCFormer model file is absent ({os.path.normpath(OFFICIAL)})"
            if not OfficialModel.told:
                print(f"test_dcformer_patch skipped: {reason}", file=sys.stderr)
                OfficialModel.told = True
            self.skipTest(reason)


# ---------------------------------------------------------------------------------------------
# Training


def tokens(config, B, T, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config["vocab_size"], (B, T), generator=g)


def train_step(model, idx):
    """One forward and backward. input_pos is passed as int64: the model's default
    (torch.arange(T, dtype=torch.int)) cannot index its mask on torch < 2."""
    model.zero_grad(set_to_none=True)
    out = model(idx, labels=idx, input_pos=torch.arange(idx.shape[1]))
    out.loss.backward()
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


class Training(OfficialModel):
    def compare(self, label, dtype, tol, config=CONFIG, T=37, B=2, sw_layers=(), **overrides):
        mod = official()
        model = build(dtype, True, config, sw_layers, **overrides)
        idx = tokens(config, B, T)
        with float64_throughout(mod, dtype == torch.float64):
            with keeping_dtype(mod):
                reference = train_step(model, idx)
            self.assertEqual(dcformer.patch(model), config["n_layer"])
            try:
                with counting("attention") as calls:
                    ours = train_step(model, idx)
            finally:
                dcformer.unpatch(model)
        logits, loss, grads = ours
        self.assertEqual(logits.dtype, dtype)
        note(f"{label}: logits", max_relative(logits, reference[0]))
        note(f"{label}: loss", max_relative(loss, reference[1]))
        self.assertLess(max_relative(logits, reference[0]), tol)
        self.assertLess(max_relative(loss, reference[1]), tol)
        self.assertEqual(grads.keys(), reference[2].keys())
        with_grad = 0
        for name, g in grads.items():
            r = reference[2][name]
            self.assertEqual(g is None, r is None, name)
            if g is not None:
                with_grad += 1
                note(f"{label}: parameter gradients", max_relative(g, r))
                self.assertLess(max_relative(g, r), tol, name)
        self.assertGreater(with_grad, 0)
        return model, calls, ours

    def test_float64(self):
        model, calls, _ = self.compare("training float64", torch.float64, 1e-9)
        self.assertEqual(len(calls), 4)  # one call per layer: no chunk key range cuts the mask
        # The training path's dynamic weights come from the merged copies, as officially.
        p = attentions(model)[0].dyn_w_proj
        model.zero_grad(set_to_none=True)
        dcformer.patch(model)
        train_step(model, torch.zeros(1, 9, dtype=torch.long))
        dcformer.unpatch(model)
        self.assertIsNotNone(p.dw_m.grad)
        self.assertIsNone(p.dw1.grad)

    def test_float32(self):
        model, calls, ours = self.compare("training float32", torch.float32, 1e-4)
        self.assertEqual(len(calls), 4)
        # Against the same weights in float64: the patched model is no further from it than the
        # official float32 model is (both bounded by float32 rounding).
        mod = official()
        m64 = build(torch.float64, True)
        m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
        idx = tokens(CONFIG, 2, 37)
        with keeping_dtype(mod):
            exact = train_step(m64, idx)
            official32 = train_step(model, idx)
        names = [name for name, g in exact[2].items() if g is not None]
        ours_error = max(max_relative(ours[2][n], exact[2][n]) for n in names)
        official_error = max(max_relative(official32[2][n], exact[2][n]) for n in names)
        note("training float32: official float32 vs float64, gradients", official_error)
        note("training float32: patched float32 vs float64, gradients", ours_error)
        self.assertLess(ours_error, 2 * official_error + 1e-6)

    def test_chunk_key_range_of_global_layers(self):
        # T = 30 > E + q_chunk = 20: the official global layer drops the keys before each chunk's
        # kv_start; the patch makes one call per chunk there.
        _, calls, _ = self.compare("training quirks float64", torch.float64, 1e-9, NARROW, T=30)
        self.assertEqual(len(calls), 1 + 30 // 4 + 1)  # local layer: one call; global: per chunk

    def test_mha_branch(self):
        # use_dcmha=False: no compose, no 1/sqrt(D), the last partial chunk's rows are zero.
        _, calls, ours = self.compare("training quirks float64", torch.float64, 1e-9, NARROW, T=30,
                                      use_dcmha=False)
        self.assertEqual(len(calls), 1 + 30 // 4)
        _, calls, _ = self.compare("training quirks float64", torch.float64, 1e-9, NARROW, T=3,
                                   use_dcmha=False)
        self.assertEqual(len(calls), 0)  # T < q_chunk_size: the official branch attends nothing

    def test_static_w_and_mqa(self):
        self.compare("training quirks float64", torch.float64, 1e-9, T=21, sw_layers=(0, 1))
        self.compare("training quirks float64", torch.float64, 1e-9, NARROW, T=14, n_local_heads=1)

    def test_projection_in_torch(self):
        with projection_in_torch(), counting("dynamic_weights") as projections:
            self.compare("projection in torch float64", torch.float64, 1e-9)
            self.compare("projection in torch float64", torch.float64, 1e-9, T=21, sw_layers=(0, 1))
        self.assertEqual(len(projections), 0)

    def test_unexpected_mask_is_refused(self):
        model = build(torch.float64, True, NARROW)
        dcformer.patch(model)
        att = attentions(model)[0]
        x = torch.randn(1, 6, NARROW["dim"], dtype=torch.float64)
        mask = torch.rand(1, 1, 6, 6) > 0.5
        mask[..., 5, :] = True
        with self.assertRaisesRegex(ValueError, "not causal with a sliding window"):
            att(x, model.freqs_cis[:6], mask, torch.arange(6))


# ---------------------------------------------------------------------------------------------
# Prefill and decode through the model's own forward


@contextlib.contextmanager
def slow_decode(model):
    """Every attention called with fast_infer=False (DCFormerBlock always passes True)."""
    saved = [(m, m.__dict__.get("forward")) for m in attentions(model)]
    for m, _ in saved:
        forward = m.forward

        def wrapper(*args, _forward=forward, **kwargs):
            kwargs["fast_infer"] = False
            return _forward(*args, **kwargs)

        m.forward = wrapper
    try:
        yield
    finally:
        for m, forward in saved:
            del m.forward
            if forward is not None:
                m.forward = forward


def serve(model, prompts, rows, steps=(6, 5), turn=4, seed=3):
    """Greedy decoding as a serving loop drives the model: a right-padded prefill of prompts of
    different lengths with input_pos (B, L) and batch_indexes, decode steps (each row at its own
    position), a second prefill (a new turn of `turn` tokens per row, after decoded positions),
    more decode steps. Returns the logits of every generated token, the tokens and the caches."""
    g = torch.Generator().manual_seed(seed)
    B, L = len(prompts), max(len(p) for p in prompts)
    idx = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        idx[b, :len(p)] = torch.tensor(p)
    nxt = torch.tensor([len(p) for p in prompts])  # next position of each row
    logits_seen, tokens = [], []
    with torch.no_grad():
        logits = model(idx, input_pos=torch.arange(L).expand(B, L), return_tensor=True,
                       batch_indexes=rows)
        last = logits[torch.arange(B), nxt - 1]
        for phase, n in enumerate(steps):
            if phase:
                new = torch.randint(0, model.config.vocab_size, (B, turn), generator=g)
                new[:, 0] = tokens[-1]
                pos = nxt[:, None] + torch.arange(turn)
                last = model(new, input_pos=pos, return_tensor=True, batch_indexes=rows)[:, -1]
                nxt = nxt + turn
            for _ in range(n):
                logits_seen.append(last)
                tokens.append(last.argmax(-1))
                last = model(tokens[-1][:, None], input_pos=nxt[:, None], return_tensor=True,
                             batch_indexes=rows)[:, -1]
                nxt = nxt + 1
        logits_seen.append(last)
        tokens.append(last.argmax(-1))
    caches = {f"{i}.{name}": getattr(m.kv_cache, name).clone()
              for i, m in enumerate(attentions(model))
              for name in ("k_cache", "v_cache", "kw_cache", "kw_sub_cache")}
    return torch.stack(logits_seen, 1), torch.stack(tokens, 1), caches


class Inference(OfficialModel):
    PROMPTS = ([7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 1, 9, 3], [2, 8, 8, 1, 5, 7])
    ROWS = torch.tensor([2, 0])  # cache rows of the two sequences, in a batch of 3

    def compare(self, label, dtype=torch.float64, tol=1e-9, sw_layers=(), slow=False,
                diverged=False, op=True, **overrides):
        mod = official()
        model = build(dtype, False, CONFIG, sw_layers, **overrides)
        if diverged:  # merged copies unlike dw1 / qkw / dd: each path must read its own
            with torch.no_grad():
                for att in attentions(model):
                    att.dyn_w_proj.dw_m.mul_(1.1)
                    att.dyn_w_proj.qkw_m.mul_(0.9)
        context = slow_decode if slow else (lambda m: contextlib.nullcontext())
        with float64_throughout(mod, dtype == torch.float64):
            with context(model):
                reference = serve(model, self.PROMPTS, self.ROWS)
            for att in attentions(model):  # fresh caches, the same weights
                for buffer in att.kv_cache.buffers():
                    buffer.zero_()
            self.assertEqual(dcformer.patch(model), CONFIG["n_layer"])
            try:
                with counting("attention") as calls, counting("dynamic_weights") as projections:
                    with context(model):
                        ours = serve(model, self.PROMPTS, self.ROWS)
            finally:
                dcformer.unpatch(model)
        forwards = 2 + sum((6, 5))  # two prefills, the decode steps
        self.assertEqual(len(calls), CONFIG["n_layer"] * forwards)
        if op:
            self.assertEqual(len(projections), CONFIG["n_layer"] * forwards)
        self.assertTrue(torch.equal(ours[1], reference[1]), f"{label}: greedy tokens")
        note(f"{label}: logits", max_relative(ours[0], reference[0]))
        self.assertLess(max_relative(ours[0], reference[0]), tol)
        for name, cache in reference[2].items():
            note(f"{label}: caches", max_relative(ours[2][name], cache) if cache.abs().max() > 0
                 else ours[2][name].abs().max().item())
            self.assertTrue(torch.allclose(ours[2][name], cache, rtol=tol,
                                           atol=tol * cache.abs().max()), f"{label}: cache {name}")
        return ours

    def test_greedy_decoding_float64(self):
        _, tokens, _ = self.compare("prefill+decode float64")
        self.assertGreater(len(set(tokens.flatten().tolist())), 1)

    def test_greedy_decoding_float32(self):
        self.compare("prefill+decode float32", torch.float32, 1e-4)

    def test_query_wise_decode(self):
        self.compare("prefill+decode variants float64", query_wise=True)
        self.compare("prefill+decode variants float64", query_wise=True, sw_layers=(1, 2))

    def test_projection_in_torch(self):
        with projection_in_torch():
            self.compare("projection in torch float64", op=False, diverged=True)
            self.compare("projection in torch float64", op=False, query_wise=True, sw_layers=(1,))

    def test_each_path_reads_its_own_parameters(self):
        # Prefill: dw1 / qkw / dd; fast decode: the merged dw_m / qkw_m; slow decode: dw1 / ...
        self.compare("prefill+decode variants float64", diverged=True)
        self.compare("prefill+decode variants float64", diverged=True, slow=True)

    def test_static_w(self):
        self.compare("prefill+decode variants float64", sw_layers=(1, 2))

    def test_slow_decode(self):
        self.compare("prefill+decode variants float64", slow=True)

    def test_errors(self):
        model = build(torch.float64, False, CONFIG)
        dcformer.patch(model)
        idx = torch.zeros(2, 5, dtype=torch.long)
        with self.assertRaisesRegex(ValueError, "consecutive"):
            model(idx, input_pos=torch.tensor([[0, 1, 2, 4, 5]] * 2), batch_indexes=self.ROWS)
        with self.assertRaisesRegex(ValueError, "batch_indexes"):
            model(idx, input_pos=torch.arange(5).expand(2, 5))


# ---------------------------------------------------------------------------------------------
# The patch itself


class Patch(OfficialModel):
    def test_idempotent_reversible_and_found_by_class_name(self):
        model = build(torch.float64, True, NARROW)
        self.assertNotEqual(type(attentions(model)[0]).__module__, "modeling_dcformer")
        wrapped = torch.nn.Sequential(model)
        self.assertEqual(dcformer.patch(wrapped), 2)
        forwards = [m.__dict__["forward"] for m in attentions(model)]
        self.assertEqual(dcformer.patch(model), 2)  # harmless the second time
        self.assertEqual([m.__dict__["forward"] for m in attentions(model)], forwards)
        self.assertTrue(all(dcformer.is_patched(m) for m in attentions(model)))
        idx = torch.arange(10)[None] % NARROW["vocab_size"]
        pos = torch.arange(10)
        patched = model(idx, input_pos=pos).logits
        self.assertEqual(dcformer.unpatch(model), 2)
        self.assertFalse(any("forward" in m.__dict__ for m in attentions(model)))
        self.assertEqual(dcformer.unpatch(model), 0)
        with keeping_dtype(official()):
            self.assertLess(max_relative(patched, model(idx, input_pos=pos).logits), 1e-6)
        # A patched model can be copied, and the copy runs patched.
        dcformer.patch(model)
        clone = copy.deepcopy(model)
        self.assertTrue(all(dcformer.is_patched(m) for m in attentions(clone)))
        self.assertTrue(torch.equal(clone(idx, input_pos=pos).logits, patched))
        self.assertEqual(dcformer.unpatch(clone), 2)
        self.assertFalse(any("forward" in m.__dict__ for m in attentions(clone)))

    def test_no_dcmha_attention(self):
        with self.assertRaisesRegex(ValueError, "no DCMHAttention"):
            dcformer.patch(torch.nn.Linear(2, 2))


if __name__ == "__main__":
    unittest.main()
