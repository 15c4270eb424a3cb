"""dcmha_torch.DecodeCache: prefill and decode steps equal the full causal attention's rows."""
import unittest

import torch

import dcmha_torch
from test_attention import max_relative, problem


def slice_compose(compose, start, stop):
    if compose is None:
        return None
    return tuple(None if side is None else
                 tuple(e if e is None or i == 0 else e[:, start:stop] for i, e in enumerate(side))
                 for side in compose)


class Decode(unittest.TestCase):
    def run_steps(self, steps, window=None, dtype=torch.float64, cast_from=None, **spec):
        """cast_from: the problem made in that dtype, then converted to dtype."""
        q, k, v, compose = problem(dtype=cast_from or dtype, **spec)
        if cast_from is not None:
            q, k, v = (x.to(dtype) for x in (q, k, v))
            compose = tuple(None if side is None else
                            tuple(None if e is None else e.to(dtype) for e in side)
                            for side in compose)
        B, H, T, D = q.shape
        key_wise = [side is not None and side[3] is not None for side in (compose or (None, None))]
        kw1 = compose[0][3] if key_wise[0] else None
        rank = 0 if kw1 is None else kw1.shape[-2]
        groups = 1 if kw1 is None or kw1.dim() == 4 else kw1.shape[2]
        cache = dcmha_torch.DecodeCache(batch=B, heads=H, kv_heads=k.shape[1], head_dim=D,
                                        rank=rank, groups=groups, pre_key_wise=key_wise[0],
                                        post_key_wise=key_wise[1], capacity=0 if window else T,
                                        window=window, max_step=max(b - a for a, b in steps),
                                        dtype=dtype)
        outs = [cache.step(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], slice_compose(compose, a, b))
                for a, b in steps]
        full = dcmha_torch.attention(q, k, v, compose, window=window)
        return torch.cat(outs, 2), full, cache

    def test_prefill_then_decode_equals_the_full_forward(self):
        steps = [(0, 5), (5, 6), (6, 7), (7, 10), (10, 11)]
        for name, spec in [("mha", dict(pre=(), post=())),
                           ("dcmha", dict(pre=("sw", "qw", "kw"), post=("qw", "kw"))),
                           ("query-wise only", dict(pre=("qw",), post=())),
                           ("gqa", dict(H=8, Hk=2)),
                           ("two groups", dict(H=8, groups=2))]:
            with self.subTest(name):
                out, full, cache = self.run_steps(steps, T=11, **spec)
                self.assertLess(max_relative(out, full), 1e-12)
                self.assertEqual(cache.length(0), 11)

    def test_window_layer_ring(self):
        steps = [(0, 3)] + [(t, t + 1) for t in range(3, 12)]
        out, full, cache = self.run_steps(steps, window=4, T=12)
        self.assertLess(max_relative(out, full), 1e-12)
        self.assertEqual(cache.capacity, 4 + 3 - 1)
        self.assertEqual(cache.kept(0), cache.capacity)

    def test_float32(self):
        out, full, _ = self.run_steps([(0, 4), (4, 5), (5, 6)], T=6, dtype=torch.float32)
        self.assertLess(max_relative(out, full), 1e-5)

    def test_half_precision_caches_are_the_rounded_float_decode(self):
        # bf16 / fp16 caches: the float kernels on the stored values, each output rounded once.
        steps = [(0, 4), (4, 5), (5, 6), (6, 9)]
        spec = dict(pre=("sw", "qw", "kw"), post=("qw", "kw"), T=9)
        for dtype in (torch.bfloat16, torch.float16):
            with self.subTest(dtype=dtype):
                out, _, cache = self.run_steps(steps, dtype=dtype, **spec)
                out32, _, _ = self.run_steps(steps, dtype=torch.float32, cast_from=dtype, **spec)
                self.assertEqual(out.dtype, dtype)
                self.assertTrue(torch.equal(out, out32.to(dtype)))
                self.assertEqual(cache.length(0), 9)

    def test_padded_step_counts(self):
        q, k, v, _ = problem(B=2, T=4, pre=(), post=())
        cache = dcmha_torch.DecodeCache(batch=2, heads=4, head_dim=8, capacity=8, max_step=4,
                                        dtype=torch.float64)
        out = cache.step(q, k, v, counts=torch.tensor([4, 2]))
        self.assertEqual((cache.length(0), cache.length(1)), (4, 2))
        self.assertEqual(out[1, :, 2:].abs().max().item(), 0.0)
        expected = dcmha_torch.attention(q[1:, :, :2], k[1:, :, :2], v[1:, :, :2])
        self.assertLess(max_relative(out[1:, :, :2], expected), 1e-12)

    def test_errors(self):
        cache = dcmha_torch.DecodeCache(batch=1, heads=2, head_dim=4, capacity=2, max_step=2,
                                        dtype=torch.float64)
        x = torch.zeros(1, 2, 2, 4, dtype=torch.float64)
        with self.assertRaisesRegex(RuntimeError, "k_new has dtype Float, expected the cache's"):
            cache.append(x.float(), x.float())
        cache.append(x, x)
        with self.assertRaisesRegex(RuntimeError, "capacity"):
            cache.append(x[:, :, :1], x[:, :, :1])
        self.assertEqual(cache.length(0), 2)  # a refused append changes nothing
        with self.assertRaisesRegex(RuntimeError, "sequence 1: expected 0 <= b < 1"):
            cache.length(1)
        with self.assertRaisesRegex(ValueError, "dtype: expected torch.float32, torch.float64, "
                                                "torch.bfloat16 or torch.float16"):
            dcmha_torch.DecodeCache(batch=1, heads=2, head_dim=4, capacity=2,
                                    dtype=torch.int32)
        with self.assertRaisesRegex(RuntimeError, "max_step"):
            dcmha_torch.DecodeCache(batch=1, heads=2, head_dim=4, capacity=2, max_step=0)


if __name__ == "__main__":
    unittest.main()
