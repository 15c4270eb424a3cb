"""dcmha_torch's attention against the plain PyTorch formulation (reference.py), finite
differences, the official conformance files, and the C++ library's contracts (bf16 storage,
views, errors, threads)."""
import itertools
import os
import unittest

import torch

import dcmha_torch
import reference

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONFORMANCE = os.path.join(ROOT, "tests", "data", "conformance")
SWITCHES = ("sw", "qw", "kw", "qdd", "kdd")  # which compose entries a side gets


def make_side(B, T, S, H, R, dtype, terms, groups=1, generator=None, scale=0.3):
    """One side's entries (sw, qw1, qw2, kw1, kw2, qdd, kdd) with the terms in `terms`; official
    layouts for one group, grouped layouts otherwise."""
    M = H // groups

    def rand(*shape):
        return scale * torch.randn(*shape, dtype=dtype, generator=generator)

    def low_rank(L):
        return rand(B, L, R, H) if groups == 1 else rand(B, L, groups, R, M)

    def gate(L):
        return rand(B, L, H) if groups == 1 else rand(B, L, groups, M)

    sw = (rand(H, H) if groups == 1 else rand(groups, M, M)) if "sw" in terms else None
    qw1, qw2 = (low_rank(T), low_rank(T)) if "qw" in terms else (None, None)
    kw1, kw2 = (low_rank(S), low_rank(S)) if "kw" in terms else (None, None)
    qdd = gate(T) if "qw" in terms else None
    kdd = gate(S) if "kw" in terms else None
    return (sw, qw1, qw2, kw1, kw2, qdd, kdd)


def problem(B=2, H=4, Hk=None, T=6, S=None, D=8, R=2, dtype=torch.float64, pre=("qw", "kw"),
            post=("qw", "kw"), groups=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    Hk = H if Hk is None else Hk
    q = torch.randn(B, H, T, D, dtype=dtype, generator=g)
    k = torch.randn(B, Hk, S, D, dtype=dtype, generator=g)
    v = torch.randn(B, Hk, S, D, dtype=dtype, generator=g)
    sides = tuple(make_side(B, T, S, H, R, dtype, terms, groups, g) if terms else None
                  for terms in (pre, post))
    return q, k, v, (None if sides == (None, None) else sides)


def leaves(q, k, v, compose):
    inputs = [q, k, v] + [e for side in (compose or ()) if side for e in side if e is not None]
    for x in inputs:
        x.requires_grad_(True)
    return inputs


def max_relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


class AgainstReference(unittest.TestCase):
    """Outputs and every gradient in float64 against reference.py, to 1e-10 relative."""

    def check(self, tol=1e-10, settings=None, **spec):
        settings = settings or {}
        q, k, v, compose = problem(**spec)
        inputs = leaves(q, k, v, compose)
        out = dcmha_torch.attention(q, k, v, compose, **settings)
        ref = reference.attention(q, k, v, compose, **settings)
        self.assertLess(max_relative(out, ref), tol)
        dout = torch.randn_like(out)
        ours = torch.autograd.grad(out, inputs, dout)
        theirs = torch.autograd.grad(ref, inputs, dout)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            self.assertEqual(a.shape, inputs[i].shape)
            self.assertLess(max_relative(a, b), tol, f"gradient of input {i}")

    def test_every_switch_of_each_side(self):
        # Every subset of the terms on each side (the other side with all terms), MHA included.
        subsets = [tuple(c) for n in range(4) for c in itertools.combinations(("sw", "qw", "kw"), n)]
        for pre in subsets:
            with self.subTest(pre=pre):
                self.check(pre=pre, post=("sw", "qw", "kw"), seed=len(pre))
        for post in subsets:
            with self.subTest(post=post):
                self.check(pre=(), post=post, seed=7 + len(post))

    def test_masks_windows_lengths_and_shapes(self):
        cases = [
            dict(settings=dict(causal=False), S=9),
            dict(settings=dict(causal=True), T=5, S=9),
            dict(settings=dict(window=3)),
            dict(settings=dict(causal=False, window=2), T=5, S=7),
            dict(settings=dict(scale=0.37)),
            dict(settings=dict(query_lengths=torch.tensor([6, 3]), key_lengths=torch.tensor([6, 4]))),
            dict(H=8, Hk=2),                       # GQA
            dict(H=8, groups=2, pre=("sw", "qw", "kw")),  # two compose groups, grouped layouts
            dict(R=3, D=16),
            dict(B=1, T=1, S=1),
        ]
        for i, case in enumerate(cases):
            with self.subTest(case=i):
                self.check(seed=20 + i, **case)

    def test_rows_that_see_no_key_get_zero(self):
        q, k, v, compose = problem(T=5, S=3)  # causal, T > S: the first two rows see nothing
        out = dcmha_torch.attention(q, k, v, compose)
        self.assertEqual(out[:, :, :2].abs().max().item(), 0.0)
        self.assertGreater(out[:, :, 2:].abs().min().item(), 0.0)


class FiniteDifferences(unittest.TestCase):
    def test_gradcheck_all_terms(self):
        q, k, v, compose = problem(B=1, H=4, T=4, S=5, D=4, pre=("sw", "qw", "kw"),
                                   post=("sw", "qw", "kw"))
        inputs = leaves(q, k, v, compose)
        n = len(inputs)

        def fn(*xs):
            c = ((xs[3:10]), (xs[10:17]))
            return dcmha_torch.attention(xs[0], xs[1], xs[2], c, causal=False)

        self.assertEqual(n, 17)
        self.assertTrue(torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6))

    def test_gradcheck_mha_window_lengths(self):
        q, k, v, _ = problem(B=2, H=2, T=5, D=4, pre=(), post=())
        inputs = leaves(q, k, v, None)
        lengths = torch.tensor([5, 3])
        self.assertTrue(torch.autograd.gradcheck(
            lambda a, b, c: dcmha_torch.attention(a, b, c, window=2, query_lengths=lengths,
                                                  key_lengths=lengths), inputs))


def read_case(path):
    """A conformance file (spec section 4): meta settings and float64 tensors."""
    meta, tensors, name, shape, values = {}, {}, None, None, []

    def close():
        if name is not None:
            tensors[name] = torch.tensor(values, dtype=torch.float64).reshape(shape)

    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            words = line.split()
            if words[0] == "meta":
                meta[words[1]] = " ".join(words[2:])
            elif words[0] == "tensor":
                close()
                name, shape, values = words[1], [int(w) for w in words[2:]], []
            else:
                values.extend(float(w) for w in words)
    close()
    return meta, tensors


class Conformance(unittest.TestCase):
    """The official implementation's float64 cases through the op, to 1e-9 relative."""

    def test_core_cases(self):
        files = sorted(f for f in os.listdir(CONFORMANCE) if f.startswith("core_"))
        self.assertGreater(len(files), 0)
        for file in files:
            with self.subTest(file=file):
                meta, t = read_case(os.path.join(CONFORMANCE, file))
                names = ("w", "qw1", "qw2", "kw1", "kw2", "qdd", "kdd")
                sides = tuple(tuple(t.get(f"{side}_{n}") for n in names)
                              if meta.get(side) == "1" else None for side in ("pre", "post"))
                compose = None if sides == (None, None) else sides
                inputs = leaves(t["q"], t["k"], t["v"], compose)
                out = dcmha_torch.attention(t["q"], t["k"], t["v"], compose,
                                            causal=meta["causal"] == "1", scale=float(meta["scale"]))
                self.assertLess(max_relative(out, t["out"]), 1e-9)
                grads = torch.autograd.grad(out, inputs, t["dout"])
                expected = ["grad_q", "grad_k", "grad_v"] + [
                    f"grad_{side}_{n}" for side, entries in zip(("pre", "post"), sides) if entries
                    for n, e in zip(names, entries) if e is not None]
                for grad, name in zip(grads, expected):
                    self.assertLess(max_relative(grad, t[name]), 1e-9, name)


class StorageTypes(unittest.TestCase):
    def check_rounded_float(self, dtype):
        # The library's contract for bf16 and fp16: float arithmetic on the stored values, each
        # result rounded once; through the op that must hold bitwise.
        q, k, v, compose = problem(dtype=dtype, pre=("sw", "qw", "kw"), seed=3)
        out = dcmha_torch.attention(q, k, v, compose)
        f = lambda x: None if x is None else x.float()
        compose32 = tuple(tuple(f(e) for e in side) for side in compose)
        out32 = dcmha_torch.attention(q.float(), k.float(), v.float(), compose32)
        self.assertEqual(out.dtype, dtype)
        self.assertTrue(torch.equal(out, out32.to(dtype)))
        inputs = leaves(q, k, v, compose)
        inputs32 = leaves(q.float(), k.float(), v.float(), compose32)
        dout = torch.randn(out.shape).to(dtype)
        grads = torch.autograd.grad(dcmha_torch.attention(q, k, v, compose), inputs, dout)
        grads32 = torch.autograd.grad(
            dcmha_torch.attention(*inputs32[:3], compose32), inputs32, dout.float())
        for i, (a, b) in enumerate(zip(grads, grads32)):
            self.assertEqual(a.dtype, dtype)
            self.assertTrue(torch.equal(a, b.to(dtype)), f"gradient of input {i}")

    def test_bf16_is_the_float_result_rounded_once(self):
        self.check_rounded_float(torch.bfloat16)

    def test_fp16_is_the_float_result_rounded_once(self):
        self.check_rounded_float(torch.float16)

    def test_float32_against_reference(self):
        q, k, v, compose = problem(dtype=torch.float32)
        out = dcmha_torch.attention(q, k, v, compose)
        self.assertLess(max_relative(out.double(), reference.attention(
            q.double(), k.double(), v.double(),
            tuple(tuple(e.double() if e is not None else None for e in s) for s in compose))), 1e-5)

    def test_forward_returns_lse(self):
        q, k, v, compose = problem(pre=(), post=())
        out, lse = dcmha_torch.attention_forward(q, k, v, causal=False)
        expected = torch.logsumexp(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, -1)
        self.assertEqual(lse.dtype, torch.float64)
        self.assertLess(max_relative(lse, expected), 1e-12)
        for dtype in (torch.bfloat16, torch.float16):
            _, lse32 = dcmha_torch.attention_forward(q.to(dtype), k.to(dtype), v.to(dtype))
            self.assertEqual(lse32.dtype, torch.float32)


class StorageTypeProducts(unittest.TestCase):
    def grads_of(self, q, k, v, compose, dout, products):
        inputs = leaves(q, k, v, compose)
        out = dcmha_torch.attention(q, k, v, compose, products=products)
        return [out] + list(torch.autograd.grad(out, inputs, dout))

    def test_bf16_against_the_float64_result(self):
        # storage_type rounds P' and dS to bf16 where the CPU has AVX512_BF16 (and computes as
        # exact elsewhere): every output within a few bf16 roundings of the float64 result.
        q, k, v, compose = problem(H=4, T=40, D=32, dtype=torch.bfloat16, seed=5)
        dout = torch.randn(q.shape[:3] + (v.shape[-1],)).to(torch.bfloat16)
        got = self.grads_of(q, k, v, compose, dout, "storage_type")
        d = lambda x: None if x is None else x.detach().double()
        compose64 = tuple(tuple(d(e) for e in side) for side in compose)
        want = self.grads_of(d(q), d(k), d(v), compose64, dout.double(), "exact")
        for i, (a, b) in enumerate(zip(got, want)):
            self.assertEqual(a.dtype, torch.bfloat16)
            self.assertLess(max_relative(a.double(), b), 3e-2, f"output {i}")

    def test_other_dtypes_compute_as_exact(self):
        for dtype in (torch.float32, torch.float64, torch.float16):
            q, k, v, compose = problem(dtype=dtype, seed=6)
            dout = torch.randn(q.shape[:3] + (v.shape[-1],)).to(dtype)
            exact = self.grads_of(q, k, v, compose, dout, "exact")
            storage = self.grads_of(q, k, v, compose, dout, "storage_type")
            for i, (a, b) in enumerate(zip(exact, storage)):
                self.assertTrue(torch.equal(a, b), f"{dtype} output {i}")

    def test_unknown_products_are_refused(self):
        q, k, v, compose = problem()
        with self.assertRaisesRegex(ValueError, "products: expected 'exact' or 'storage_type'"):
            dcmha_torch.attention(q, k, v, compose, products="bf16")


class Views(unittest.TestCase):
    def test_fused_qkv_views_are_read_in_place(self):
        B, T, H, D = 2, 6, 4, 8
        qkv = torch.randn(B, T, 3 * H * D, dtype=torch.float64)
        q, k, v = qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, T, D) views
        self.assertFalse(q.is_contiguous())
        _, _, _, compose = problem(B=B, H=H, T=T, D=D)
        # Official compose entries are views too (unbind of one projection output).
        out = dcmha_torch.attention(q, k, v, compose)
        expected = dcmha_torch.attention(q.contiguous(), k.contiguous(), v.contiguous(), compose)
        self.assertTrue(torch.equal(out, expected))
        # A view the kernels cannot read in place is refused, not copied.
        with self.assertRaisesRegex(RuntimeError, "stride"):
            every_other = torch.randn(B, H, T, 2 * D, dtype=torch.float64)[..., ::2]
            dcmha_torch.attention(every_other, k, v, compose)

    def test_views_reach_the_kernels_without_a_copy(self):
        # The profiler records every operator the dcmha ops call: the forward creates its out and
        # lse and nothing else, the backward its three gradients, so no input view (the
        # fused-QKV permutes here, whose q.contiguous() would be a clone, or an empty and a copy_)
        # was copied on the way to the kernels.
        from torch.profiler import ProfilerActivity, profile
        B, T, H, D = 1, 256, 4, 32
        qkv = torch.randn(B, T, 3 * H * D, requires_grad=True)
        q, k, v = qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = dcmha_torch.attention(q, k, v)
            torch.autograd.grad(out, (q, k, v), torch.randn(B, H, T, D))
        calls = {e.name: e.cpu_children for e in prof.events() if e.name.startswith("dcmha::")}
        for op, results in (("forward", 2), ("backward", 3)):
            children = [c.name for c in calls[f"dcmha::attention_{op}"]]
            self.assertEqual(children, ["aten::empty"] * results, op)

    def test_expanded_compose_entries(self):
        q, k, v, compose = problem(B=2, pre=("qw",), post=None)
        pre = list(compose[0])
        pre[1] = pre[1][:1].expand_as(pre[1])  # zero batch stride
        expected = dcmha_torch.attention(q, k, v, (tuple(e if e is None else e.contiguous()
                                                         for e in pre), None))
        self.assertTrue(torch.equal(dcmha_torch.attention(q, k, v, (tuple(pre), None)), expected))


class Errors(unittest.TestCase):
    def test_library_messages_reach_python(self):
        q, k, v, compose = problem()
        with self.assertRaisesRegex(RuntimeError, r"k.shape\[3\] \(D\): expected 8"):
            dcmha_torch.attention(q, k[..., :4], v, compose)
        pre = list(compose[0])
        pre[5] = None  # qw1 and qw2 without qdd
        with self.assertRaisesRegex(RuntimeError, "qdd"):
            dcmha_torch.attention(q, k, v, (tuple(pre), compose[1]))
        with self.assertRaisesRegex(RuntimeError, "query_lengths"):
            dcmha_torch.attention(q, k, v, query_lengths=torch.tensor([7, 1]))

    def test_binding_checks(self):
        q, k, v, compose = problem()
        with self.assertRaisesRegex(RuntimeError, "k has dtype Float, expected Double"):
            dcmha_torch.attention(q, k.float(), v)
        with self.assertRaisesRegex(RuntimeError, "expected float32, float64, bfloat16 or float16"):
            dcmha_torch.attention(q.int(), k.int(), v.int())
        with self.assertRaisesRegex(RuntimeError, r"compose pre qw1: expected 4 dims \(B, L, R, N\)"):
            pre = list(compose[0])
            pre[1] = pre[1][0]
            dcmha_torch.attention(q, k, v, (tuple(pre), None))
        with self.assertRaisesRegex(RuntimeError, "query_lengths: expected a 1-d int64"):
            dcmha_torch.attention(q, k, v, query_lengths=torch.tensor([6.0, 6.0]))
        with self.assertRaisesRegex(RuntimeError, "q: expected 4 dims"):
            dcmha_torch.attention(q[0], k, v)
        with self.assertRaisesRegex(ValueError, "window: expected None or >= 1, got 0"):
            dcmha_torch.attention(q, k, v, window=0)
        with self.assertRaisesRegex(ValueError, "scale: expected None or > 0"):
            dcmha_torch.attention(q, k, v, scale=-1.0)
        with self.assertRaisesRegex(ValueError, "compose: expected None or"):
            dcmha_torch.attention(q, k, v, compose[0])


class Threads(unittest.TestCase):
    def test_results_do_not_depend_on_the_thread_count(self):
        q, k, v, compose = problem(B=2, H=4, T=40, D=16, dtype=torch.float32)
        inputs = leaves(q, k, v, compose)
        dout = torch.randn(2, 4, 40, 16)
        results = []
        before = torch.get_num_threads()
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out = dcmha_torch.attention(q, k, v, compose)
                results.append([out] + list(torch.autograd.grad(out, inputs, dout)))
        finally:
            torch.set_num_threads(before)
        for a, b in zip(*results):
            self.assertTrue(torch.equal(a, b))


TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


@unittest.skipUnless(hasattr(torch.library, "opcheck"),
                     f"torch.library.opcheck needs torch >= 2.4 (this is {torch.__version__})")
class OpCheck(unittest.TestCase):
    """torch's own checks of a custom op: schema, autograd registration, fake (Meta) kernels."""

    def test_attention_ops(self):
        q, k, v, compose = problem(B=1, H=4, T=5, D=8, pre=("sw", "qw", "kw"))
        entries = dcmha_torch._compose_entries(compose)
        leaves(q, k, v, compose)
        args = (q, k, v, entries, True, 0, 0.0, None, None)
        torch.library.opcheck(torch.ops.dcmha.attention.default, args)
        plain = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args[:3])
        plain_entries = [None if e is None else e.detach() for e in entries]
        torch.library.opcheck(torch.ops.dcmha.attention_forward.default,
                              plain + (plain_entries,) + args[4:])


@unittest.skipUnless(TORCH_VERSION >= (2, 0),
                     f"torch.compile needs torch >= 2.0 (this is {torch.__version__})")
class Compile(unittest.TestCase):
    def test_compiled_function_matches_eager(self):
        q, k, v, compose = problem(B=1, H=4, T=6, D=8)
        inputs = leaves(q, k, v, compose)

        def layer(q, k, v, compose):
            return (dcmha_torch.attention(q * 1.5, k, v, compose) * 2.0).sum()

        compiled = torch.compile(layer, fullgraph=True)
        eager_loss = layer(q, k, v, compose)
        compiled_loss = compiled(q, k, v, compose)
        self.assertEqual(compiled_loss.item(), eager_loss.item())
        eager = torch.autograd.grad(eager_loss, inputs)
        ours = torch.autograd.grad(compiled_loss, inputs)
        for a, b in zip(ours, eager):
            self.assertTrue(torch.equal(a, b))


if __name__ == "__main__":
    unittest.main()
