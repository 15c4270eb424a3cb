"""What rounding Compose's operands costs in accuracy: the CUDA kernels' bf16 and fp16 paths as
they are, and the same with 16-bit values crossing the cluster or with the low-rank projections
taken on the tensor cores, against float64 (docs/design.md, "What the targets need").

Each variant is DCMHA's forward and backward in float64 with the kernels' roundings inserted
where they happen (values in the forward, gradients in the backward):
  kernels     scores, Compose, softmax and every sum in float; P' rounded to the storage type
              before P'V and dL before dL.K and dL^T.Q (as the tensor-core products take them)
  exchange    the kernels' roundings, and every value that crosses the cluster in the storage
              type: the scores the composers read, the composed scores returned for the row
              statistics, dP'
  exchange16  as exchange, the crossing values in fp16 whatever the storage type (10 mantissa
              bits where bf16 has 7)
  projection  the kernels' roundings, and the low-rank projections sum_m x_m w1[r, m] taken
              from x rounded to the storage type (tf32 for float storage), as a tensor-core
              product would
  both        exchange and projection together
The official configuration's terms (pre and post, query- and key-wise, R = 2, no static W) with
weights drawn as the official layer makes them (w1 RMS-normalized over the heads, dd = tanh;
w2 of standard deviation 0.1), causal. Prints max |x - x64| / max |x64| per output; the
kernels' tests allow 3e-2 in bf16, 4e-3 in fp16, 2e-4 in float.

  /usr/bin/python3 tools/numerics/exchange_precision.py [--length 384] [--heads 32]
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python", "tests"))
import reference  # noqa: E402  (python/tests/reference.py: the spec's Compose, plainly)

STORAGE = {"bf16": torch.bfloat16, "fp16": torch.float16, "float": torch.float32}
VARIANTS = ("kernels", "exchange", "exchange16", "projection", "both")


def rounded(x, kind):
    """x (float64) rounded to kind: a torch dtype, 'tf32' (10 stored mantissa bits) or None."""
    if kind is None:
        return x
    if kind == "tf32":
        mantissa, exponent = torch.frexp(x)
        return torch.ldexp(torch.round(mantissa * 2048.0) / 2048.0, exponent)
    return x.to(kind).to(torch.float64)


class Round(torch.autograd.Function):
    """Rounds the value on the way forward and the gradient on the way back."""

    @staticmethod
    def forward(ctx, x, value_kind, grad_kind):
        ctx.grad_kind = grad_kind
        return rounded(x, value_kind)

    @staticmethod
    def backward(ctx, grad):
        return rounded(grad, ctx.grad_kind), None, None


def compose(x, side, projection_kind):
    """reference.compose, with the low-rank projections of x rounded to projection_kind."""
    if projection_kind is None:
        return reference.compose(x, side)
    _, qw1, qw2, kw1, kw2, qdd, kdd = side
    low = Round.apply(x, projection_kind, None)
    out = x + x * qdd.permute(0, 2, 1).unsqueeze(-1) + x * kdd.permute(0, 2, 1).unsqueeze(-2)
    out = out + torch.einsum("bhts,btrh,btrn->bnts", low, qw1, qw2)
    return out + torch.einsum("bhts,bsrh,bsrn->bnts", low, kw1, kw2)


def draw(shape, logit_std, storage, generator):
    """Inputs of shape (B, H, T, D, R) rounded to the storage type, as float64 leaves."""
    B, H, T, D, R = shape
    def normal(*shape, std=1.0):
        return torch.randn(*shape, generator=generator, dtype=torch.float64) * std

    def side():
        w1 = [normal(B, T, R, H) for _ in range(2)]
        w1 = [w / w.pow(2).mean(-1, keepdim=True).sqrt() for w in w1]  # the official dw1_norm
        return [None, w1[0], normal(B, T, R, H, std=0.1), w1[1], normal(B, T, R, H, std=0.1),
                torch.tanh(normal(B, T, H, std=0.5)), torch.tanh(normal(B, T, H, std=0.5))]

    tensors = {"q": normal(B, H, T, D, std=math.sqrt(logit_std)),
               "k": normal(B, H, T, D, std=math.sqrt(logit_std)), "v": normal(B, H, T, D),
               "dout": normal(B, H, T, D)}
    for name, s in (("pre", side()), ("post", side())):
        for entry, w in zip(reference.SIDE_ENTRIES, s):
            if w is not None:
                tensors[f"{name}_{entry}"] = w
    return {n: rounded(t, STORAGE[storage]).requires_grad_(n != "dout") for n, t in tensors.items()}


def forward_backward(inputs, storage, variant):
    """O and every input's gradient, with the roundings of `variant` (None: float64 throughout)."""
    kind = None if variant is None else STORAGE[storage]
    exchange = kind if variant in ("exchange", "both") else None
    if variant == "exchange16":
        exchange = torch.float16
    projection = None
    if variant in ("projection", "both"):
        projection = "tf32" if storage == "float" else kind
    f32 = None if variant is None else torch.float32
    side = {n: [inputs.get(f"{n}_{e}") for e in reference.SIDE_ENTRIES] for n in ("pre", "post")}
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    T = q.shape[2]
    scores = Round.apply((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[3]), f32, kind)
    scores = Round.apply(scores, exchange, None)  # read by the composers
    composed = Round.apply(compose(scores, side["pre"], projection), f32, None)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    composed = composed.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(composed, -1)
    if exchange is not None:  # the row statistics from the composed scores returned
        returned = rounded(composed.detach(), exchange)
        lse = torch.logsumexp(returned, -1, keepdim=True)
        probs = probs + (torch.exp(composed.detach() - lse) - probs.detach())
    probs = Round.apply(probs, f32, None)
    mixed = Round.apply(compose(probs, side["post"], projection), kind, exchange)  # P', dP'
    out = mixed @ v
    out.backward(inputs["dout"])
    grads = {n: t.grad.clone() for n, t in inputs.items() if t.grad is not None}
    for t in inputs.values():
        t.grad = None
    return out.detach(), grads


def relative_errors(storage, length, heads, logit_std, seed):
    generator = torch.Generator().manual_seed(seed)
    inputs = draw((1, heads, length, 128, 2), logit_std, storage, generator)
    exact_out, exact_grads = forward_backward(inputs, storage, None)
    rows = {}
    for variant in VARIANTS:
        out, grads = forward_backward(inputs, storage, variant)

        def error(a, b):
            return ((a - b).abs().max() / b.abs().max()).item()

        weight_names = [n for n in grads if n not in ("q", "k", "v")]
        rows[variant] = [error(out, exact_out)] + [error(grads[n], exact_grads[n])
                                                   for n in ("q", "k", "v")]
        rows[variant].append(max(error(grads[n], exact_grads[n]) for n in weight_names))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=384)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"B1 H{args.heads} T{args.length} D128 causal, one group, R = 2, pre and post; "
          "max |x - x64| / max |x64|")
    print("| storage | logit std | variant | O | dQ | dK | dV | compose weights' grads |")
    print("|---|---|---|---|---|---|---|---|")
    for storage in ("bf16", "fp16", "float"):
        for logit_std in (1.0, 4.0):
            rows = relative_errors(storage, args.length, args.heads, logit_std, args.seed)
            for variant, errors in rows.items():
                cells = " | ".join(f"{e:.2e}" for e in errors)
                print(f"| {storage} | {logit_std:g} | {variant} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
