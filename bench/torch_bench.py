#!/usr/bin/env python3
"""Times dcmha_torch's attention op against the official DCFormer `_atten_context` itself (from
shared/official/ beside the repository, where present: the unfused formulation that materializes
every B x H x T x S tensor), the project's einsum formulation of the same math (written from the
spec in python/tests/reference.py; it also serves MHA) and, with torch >= 2.0, PyTorch's
scaled_dot_product_attention (MHA), forward and forward+backward, on the CPU; and, given
--cpp-bench, the C++ benchmark's time for the same problems (dcmha_bench), so that the binding's
own cost shows as a ratio.

    PYTHONPATH=DIR python3 bench/torch_bench.py [--cpp-bench build/bench/dcmha_bench]
        [--threads 2] [--rounds 5] [--lengths 1024 2048] [--no-einsum] [--no-official]

Rounds interleave every case (and the C++ process) in turn; the table shows medians. DCMHA is
the official configuration: pre and post compose, query- and key-wise rank-2 terms with gates,
no static W, G = 1; B = 1, H = 32, D = 128, causal, float32.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                "tests"))
import dcmha_torch  # noqa: E402
import reference  # noqa: E402

H, D, R = 32, 128, 2


def inputs(T, dcmha, grad, dtype=torch.float32):
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, H, T, D, generator=g).to(dtype) for _ in range(3))
    compose = None
    if dcmha:
        def side():
            w = lambda: (0.1 * torch.randn(1, T, R, H, generator=g)).to(dtype)
            d = lambda: (0.1 * torch.randn(1, T, H, generator=g)).to(dtype)
            return (None, w(), w(), w(), w(), d(), d())
        compose = (side(), side())
    leaves = [q, k, v] + [e for s in (compose or ()) for e in s if e is not None]
    for x in leaves:
        x.requires_grad_(grad)
    return q, k, v, compose, leaves


def dcmha_op(q, k, v, compose):
    return dcmha_torch.attention(q, k, v, compose, causal=True)


def einsum(q, k, v, compose):
    return reference.attention(q, k, v, compose, causal=True)


def official_atten_context():
    """The official `_atten_context`, or None where shared/official/ is absent."""
    import test_dcformer_patch  # its loader of the official model file (a stand-in transformers)
    if not os.path.isdir(test_dcformer_patch.OFFICIAL):
        return None
    atten_context = test_dcformer_patch.official()._atten_context

    def run(q, k, v, compose):
        # The official caller scales q by 1/sqrt(D) and passes a boolean causal mask; the
        # function casts the logits to float32 and the probabilities to bfloat16 on the way.
        T, S = q.shape[-2], k.shape[-2]
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
        return atten_context(q * q.shape[-1] ** -0.5, k, v, mask, compose[0], compose[1])
    return run


def sdpa(q, k, v, compose):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def time_once(fn, T, dcmha, backward):
    q, k, v, compose, leaves = inputs(T, dcmha, backward)
    start = time.perf_counter()
    out = fn(q, k, v, compose)
    if backward:
        torch.autograd.grad(out, leaves, torch.ones_like(out))
    return time.perf_counter() - start


def cpp_times(binary, lengths, threads):
    names = "|".join(str(T) for T in lengths)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    result = subprocess.run(
        [binary, f"--benchmark_filter=^(fwd|fwdbwd)/(mha|dcmha)/B1/H32/T({names})/D128/causal/",
         "--benchmark_format=json", "--benchmark_min_time=0.5"],
        env=env, check=True, capture_output=True, text=True)
    times = {}
    for b in json.loads(result.stdout)["benchmarks"]:
        direction, op, _, _, length = b["name"].split("/")[:5]
        times[(op, int(length[1:]), direction)] = b["real_time"] / 1e3  # ms -> s
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpp-bench", help="dcmha_bench binary, for the C++ time of each case")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--no-einsum", action="store_true", help="skip the einsum formulation")
    parser.add_argument("--no-official", action="store_true", help="skip the official function")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    impls = [("dcmha", dcmha_op)]
    official = None if args.no_official else official_atten_context()
    if official:
        impls.append(("official", official))
    if not args.no_einsum:
        impls.append(("einsum", einsum))
    has_sdpa = hasattr(torch.nn.functional, "scaled_dot_product_attention")
    if has_sdpa:
        impls.append(("sdpa", sdpa))
    cases = [(name, fn, op, T, direction)
             for T in args.lengths for op in ("mha", "dcmha") for direction in ("fwd", "fwdbwd")
             for name, fn in impls
             if not (name == "sdpa" and op == "dcmha") and not (name == "official" and op == "mha")]
    samples = {c[:1] + c[2:]: [] for c in cases}
    cpp = {}
    for name, fn, op, T, direction in cases:  # warm-up
        time_once(fn, T, op == "dcmha", direction == "fwdbwd")
    for _ in range(args.rounds):
        for name, fn, op, T, direction in cases:
            samples[(name, op, T, direction)].append(
                time_once(fn, T, op == "dcmha", direction == "fwdbwd"))
        if args.cpp_bench:
            for key, t in cpp_times(args.cpp_bench, args.lengths, args.threads).items():
                cpp.setdefault(key, []).append(t)

    median = {k: statistics.median(v) for k, v in samples.items()}
    print(f"torch {torch.__version__}, {args.threads} threads, {args.rounds} interleaved rounds, "
          f"medians (ms); B1/H32/D128 causal float32"
          + ("" if has_sdpa else "; no scaled_dot_product_attention in this torch")
          + ("" if official else "; no official model file"))
    print("| case | dcmha op | C++ (dcmha_bench) | op / C++ | official | official / op | einsum "
          "| einsum / op | SDPA MHA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in args.lengths:
        for op in ("mha", "dcmha"):
            for direction in ("fwd", "fwdbwd"):
                ours = median[("dcmha", op, T, direction)]
                c = statistics.median(cpp[(op, T, direction)]) if cpp else None
                o = median.get(("official", op, T, direction))
                e = median.get(("einsum", op, T, direction))
                s = median.get(("sdpa", "mha", T, direction))
                cell = lambda x: "" if x is None else f"{1e3 * x:.1f}"
                ratio = lambda x, y, f: "" if x is None or y is None else f"{x / y:{f}}x"
                print(f"| {direction} {op} T{T} | {cell(ours)} | {cell(c)} | "
                      f"{ratio(ours, c, '.2f')} | {cell(o)} | {ratio(o, ours, '.1f')} | "
                      f"{cell(e)} | {ratio(e, ours, '.1f')} | {cell(s)} |")


if __name__ == "__main__":
    main()
