#!/usr/bin/env python3
"""Errors of bf16 DCMHA against the float64 result, per tensor: dcmha's two product modes
(products="exact" and "storage_type", through dcmha_torch) beside the official DCFormer function's
own bf16 arithmetic (`_atten_context` from shared/official/, where present: bf16 logits and
compose, float32 softmax, bf16 probabilities and P V), all on the same bf16 inputs. Also the
distance of each dcmha mode from the official bf16 result: which one the official arithmetic is
closer to. Not part of the test command.

    PYTHONPATH=DIR python3 bench/precision_compare.py [--lengths 256 1024] [--heads 32] [--dim 128]

The float64 result is the project's einsum formulation (python/tests/reference.py, written from the
spec) on the same bf16 values widened. Errors are max |x - x64| / max |x64| per tensor, out and
the gradients of q, k, v for one upstream gradient (autograd through each implementation).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                "tests"))
import dcmha_torch  # noqa: E402
import reference  # noqa: E402
import torch_bench  # its loader of the official function  # noqa: E402


def inputs(B, H, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(3))

    def side():
        w = lambda: (0.1 * torch.randn(B, T, 2, H, generator=g)).bfloat16()
        d = lambda: (0.1 * torch.randn(B, T, H, generator=g)).bfloat16()
        return (None, w(), w(), w(), w(), d(), d())
    return q, k, v, (side(), side())


def outputs(fn, q, k, v, compose, dout, dtype):
    """out and the gradients of q, k, v, as float64."""
    qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    cc = tuple(tuple(None if e is None else e.to(dtype) for e in side) for side in compose)
    out = fn(qq, kk, vv, cc)
    grads = torch.autograd.grad(out, (qq, kk, vv), dout.to(out.dtype))
    return [x.detach().double() for x in (out,) + tuple(grads)]


def relative(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    official = torch_bench.official_atten_context()
    impls = [("dcmha exact", lambda q, k, v, c: dcmha_torch.attention(q, k, v, c)),
             ("dcmha storage_type",
              lambda q, k, v, c: dcmha_torch.attention(q, k, v, c, products="storage_type"))]
    if official:
        impls.append(("official bf16", official))
    names = ["out", "dq", "dk", "dv"]
    print(f"torch {torch.__version__}, B1/H{args.heads}/D{args.dim} causal, official DCMHA "
          "configuration, bf16 inputs; max |x - x64| / max |x64|"
          + ("" if official else "; no official model file"))
    print("| T | tensor | " + " | ".join(n for n, _ in impls)
          + (" | exact vs official | storage_type vs official |" if official else " |"))
    print("|---" * (2 + len(impls) + (2 if official else 0)) + "|")
    for T in args.lengths:
        q, k, v, compose = inputs(1, args.heads, T, args.dim, T)
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).bfloat16()
        want = outputs(lambda q, k, v, c: reference.attention(q, k, v, c, causal=True),
                       q, k, v, compose, dout, torch.float64)
        got = {name: outputs(fn, q, k, v, compose, dout, torch.bfloat16) for name, fn in impls}
        for i, tensor in enumerate(names):
            row = [f"{relative(got[n][i], want[i]):.2e}" for n, _ in impls]
            if official:
                ref = got["official bf16"][i]
                row += [f"{relative(got[n][i], ref):.2e}"
                        for n in ("dcmha exact", "dcmha storage_type")]
            print(f"| {T} | {tensor} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
