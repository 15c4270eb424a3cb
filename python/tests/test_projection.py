"""dcmha_torch.dynamic_weights against the spec's formulas written in PyTorch (section 2), finite
differences and the official conformance file."""
import os
import unittest

import torch

import dcmha_torch
from test_attention import CONFORMANCE, max_relative, read_case


def reference_projection(x, dw1, qkw, dd, gelu="erf", eps=1e-6):
    """Spec section 2: (pre, post), each (None, qw1, qw2, kw1, kw2, qdd, kdd)."""
    G, C, K, R2, M = qkw.shape
    R = R2 // 2
    hidden = torch.nn.functional.gelu(torch.einsum("ble,egck->blgck", x, dw1),
                                      approximate="none" if gelu == "erf" else "tanh")
    w = torch.einsum("blgck,gckim->blgcim", hidden, qkw)
    w1, w2 = w[..., :R, :], w[..., R:, :]
    w1 = w1 / torch.sqrt((w1 * w1).mean(-1, keepdim=True) + eps)
    B, L = x.shape[:2]
    gates = torch.tanh(torch.einsum("ble,egn->blgn", x, dd)).reshape(B, L, G, C, M)
    split = lambda c: (w1[:, :, :, c], w2[:, :, :, c], gates[:, :, :, c])
    sides = []
    for query, key in ((0, 1), (2, 3)):
        qw1, qw2, qdd = split(query)
        kw1, kw2, kdd = split(key)
        sides.append((None, qw1, qw2, kw1, kw2, qdd, kdd))
    return tuple(sides)


def parameters(B=2, L=5, E=12, G=2, K=3, R=2, M=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, E, dtype=dtype, generator=g)
    dw1 = 0.4 * torch.randn(E, G, 4, K, dtype=dtype, generator=g)
    qkw = 0.4 * torch.randn(G, 4, K, 2 * R, M, dtype=dtype, generator=g)
    dd = 0.3 * torch.randn(E, G, 4 * M, dtype=dtype, generator=g)
    return [t.requires_grad_() for t in (x, dw1, qkw, dd)]


def flat(sides):
    return [e for side in sides for e in side if e is not None]


class Projection(unittest.TestCase):
    def test_against_reference_both_gelus(self):
        for gelu in ("erf", "tanh"):
            with self.subTest(gelu=gelu):
                inputs = parameters()
                ours = flat(dcmha_torch.dynamic_weights(*inputs, gelu=gelu))
                theirs = flat(reference_projection(*inputs, gelu=gelu))
                self.assertEqual(len(ours), 12)
                for a, b in zip(ours, theirs):
                    self.assertEqual(a.shape, b.shape)
                    self.assertLess(max_relative(a, b), 1e-12)
                upstream = [torch.randn_like(a) for a in ours]
                grads = torch.autograd.grad(ours, inputs, upstream)
                expected = torch.autograd.grad(theirs, inputs, upstream)
                for a, b in zip(grads, expected):
                    self.assertLess(max_relative(a, b), 1e-10)

    def test_unused_outputs_and_gradcheck(self):
        inputs = parameters(B=1, L=3, E=5, G=1, K=2, R=1, M=2)
        # Only some outputs reach the loss: the others' gradients are zeros.
        fn = lambda *xs: dcmha_torch.dynamic_weights(*xs)[0][1].sum() + \
            dcmha_torch.dynamic_weights(*xs)[1][6].square().sum()
        self.assertTrue(torch.autograd.gradcheck(fn, inputs))

    def test_half_precision_is_the_rounded_float_result(self):
        # bf16 / fp16: the float kernels on the stored values, each output and gradient rounded
        # once (activations kept in float between forward and backward).
        for dtype in (torch.bfloat16, torch.float16):
            with self.subTest(dtype=dtype):
                narrow = [t.detach().to(dtype).requires_grad_() for t in parameters(seed=4)]
                wide = [t.detach().float().requires_grad_() for t in narrow]
                outs = [e for side in dcmha_torch.dynamic_weights(*narrow) for e in side[1:]]
                outs32 = [e for side in dcmha_torch.dynamic_weights(*wide) for e in side[1:]]
                for a, b in zip(outs, outs32):
                    self.assertEqual(a.dtype, dtype)
                    self.assertTrue(torch.equal(a, b.to(dtype)))
                upstream = [torch.randn(o.shape).to(dtype) for o in outs]
                grads = torch.autograd.grad(outs, narrow, upstream)
                grads32 = torch.autograd.grad(outs32, wide, [u.float() for u in upstream])
                for a, b, name in zip(grads, grads32, ("x", "dw1", "qkw", "dd")):
                    self.assertTrue(torch.equal(a, b.to(dtype)), name)

    def test_feeds_attention(self):
        inputs = parameters(B=2, L=6, E=8, G=1, K=2, R=2, M=4)
        pre, post = dcmha_torch.dynamic_weights(*inputs)
        q = torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True)
        out = dcmha_torch.attention(q, q, q, (pre, post))
        out.square().sum().backward()
        self.assertTrue(all(t.grad is not None and t.grad.abs().sum() > 0 for t in inputs))

    def test_conformance(self):
        meta, t = read_case(os.path.join(CONFORMANCE, "proj_b2_t5_e16_n4.txt"))
        x, dw1, qkw, dd = (t[n].requires_grad_() for n in ("x", "dw1", "qkw", "dd"))
        pre, post = dcmha_torch.dynamic_weights(x, dw1, qkw, dd)
        names = ("qw1", "qw2", "kw1", "kw2", "qdd", "kdd")
        outputs, upstream = [], []
        for side_name, side in (("pre", pre), ("post", post)):
            for name, value in zip(names, side[1:]):
                expected = t[f"{side_name}_{name}"]
                got = value.reshape(expected.shape)  # files hold G = 1 without the group axis
                self.assertLess(max_relative(got, expected), 1e-9, f"{side_name}_{name}")
                outputs.append(got)
                upstream.append(t[f"d{side_name}_{name}"])
        grads = torch.autograd.grad(outputs, (x, dw1, qkw, dd), upstream)
        for grad, name in zip(grads, ("grad_x", "grad_dw1", "grad_qkw", "grad_dd")):
            self.assertLess(max_relative(grad, t[name].reshape(grad.shape)), 1e-9, name)

    def test_errors(self):
        x, dw1, qkw, dd = parameters()
        with self.assertRaisesRegex(RuntimeError, "gelu: expected \"erf\" or \"tanh\""):
            dcmha_torch.dynamic_weights(x, dw1, qkw, dd, gelu="relu")
        with self.assertRaisesRegex(RuntimeError, r"qkw: expected 5 dims \(G, 4, K, 2R, M\)"):
            dcmha_torch.dynamic_weights(x, dw1, qkw[0], dd)
        with self.assertRaisesRegex(RuntimeError, "expected float32, float64, bfloat16 or float16"):
            dcmha_torch.dynamic_weights(*(t.detach().int() for t in (x, dw1, qkw, dd)))
        with self.assertRaisesRegex(RuntimeError, "dcmha::dynamic_weights_forward"):
            dcmha_torch.dynamic_weights(x[..., :5], dw1, qkw, dd)


if __name__ == "__main__":
    unittest.main()
