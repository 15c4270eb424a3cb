#!/usr/bin/env python3
"""Times dcmha's DCMHA (the official configuration, through dcmha_torch) against PyTorch's
scaled_dot_product_attention MHA in the same dtype, in interleaved pairs: the comparison a user
weighing DCMHA against the attention they run today makes. Needs torch >= 2.0 (SDPA); not part of
the test command.

    PYTHONPATH=DIR python3 bench/sdpa_compare.py [--dtype bfloat16] [--threads 2] [--pairs 8]
        [--lengths 2048]

Each pair times one dcmha call and one SDPA call on fresh inputs (the order alternates from pair
to pair); the table shows the medians of each side and of the per-pair ratios dcmha / SDPA, with
their range. B1/H32/D128, causal; forward, and forward+backward (autograd.grad of every input).
"""
import argparse
import statistics
import sys
import time

import torch

import torch_bench  # the same inputs, the op and SDPA as bench/torch_bench.py times them

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def time_pair(T, backward, dtype, flip):
    calls = [("dcmha", torch_bench.dcmha_op, True), ("sdpa", torch_bench.sdpa, False)]
    if flip:
        calls.reverse()
    times = {}
    for name, fn, dcmha in calls:
        q, k, v, compose, leaves = torch_bench.inputs(T, dcmha, backward, dtype)
        start = time.perf_counter()
        out = fn(q, k, v, compose)
        if backward:
            torch.autograd.grad(out, leaves, torch.ones_like(out))
        times[name] = time.perf_counter() - start
    return times["dcmha"], times["sdpa"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    args = parser.parse_args()
    if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        sys.exit(f"sdpa_compare.py: torch {torch.__version__} has no "
                 "scaled_dot_product_attention (install a torch >= 2.0)")
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    print(f"torch {torch.__version__}, {args.threads} threads, {args.pairs} interleaved pairs, "
          f"{args.dtype}, B1/H32/D128 causal; dcmha DCMHA (official configuration) against SDPA "
          "MHA, medians (ms)")
    print("| case | dcmha DCMHA | SDPA MHA | dcmha / SDPA (median of pairs) | range |")
    print("|---|---|---|---|---|")
    for T in args.lengths:
        for backward in (False, True):
            time_pair(T, backward, dtype, False)  # warm-up
            pairs = [time_pair(T, backward, dtype, i % 2 == 1) for i in range(args.pairs)]
            ratios = [a / b for a, b in pairs]
            print(f"| {'fwdbwd' if backward else 'fwd'} T{T} | "
                  f"{1e3 * statistics.median(a for a, _ in pairs):.1f} | "
                  f"{1e3 * statistics.median(b for _, b in pairs):.1f} | "
                  f"{statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x |")


if __name__ == "__main__":
    main()
