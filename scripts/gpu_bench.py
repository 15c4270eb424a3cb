#!/usr/bin/env python3
"""The comparison table of scripts/gpu_check.sh.

Times PyTorch's scaled_dot_product_attention with the flash backend (MHA) and the official,
unfused formulation of DCMHA (einsums over B*H*T*S tensors, as the DCFormer code writes it) on
the shapes of bench/cuda_bench.cu (B4/H32/D128 causal, T = 2048 and 4096, decode B8/S4096; with
DCMHA_BENCH_LONG=1 also T = 8192), in each storage type dcmha's benchmark has (bf16, fp16 where
it has fp16 cases), then prints one markdown table next to dcmha's numbers (the benchmark's
JSON) with the targets marked:

  DCMHA forward <= 2.0x SDPA flash MHA; forward+backward <= 2.5x; forward+backward >= 10x
  faster than the einsum formulation at T = 4096; and dcmha runs where the einsum formulation
  runs out of memory.

Each case runs once to warm up and once timed (decode, microseconds: the mean of ten), the
policy of bench/cuda_bench.cu, so that the device check fits its time budget. A missing or
partial JSON (a failed or killed benchmark step) still gives the PyTorch columns.

  python3 scripts/gpu_bench.py --ours bench.json [--table table.md]
"""
import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, D, R = 4, 32, 128, 2
LENGTHS = (2048, 4096, 8192) if os.environ.get("DCMHA_BENCH_LONG") == "1" else (2048, 4096)
DECODE_B, DECODE_S = 8, 4096
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FORWARD_LIMIT, FORWARD_BACKWARD_LIMIT, EINSUM_SPEEDUP, EINSUM_AT = 2.0, 2.5, 10.0, 4096
# torch.OutOfMemoryError is new (PyTorch 2.4/2.5); older versions have only the torch.cuda one.
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def timed(fn, iterations=1, warmup=1):
    """Mean milliseconds of fn() (as Google Benchmark reports them) and the peak memory (MiB)
    it allocated beyond what was allocated before (the inputs), or (None, 'OOM') /
    (None, 'error: ...')."""
    failure = None
    try:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(iterations):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        return sum(times) / len(times), (torch.cuda.max_memory_allocated() - before) / 2**20
    except OUT_OF_MEMORY:
        failure = "OOM"
    except RuntimeError as e:  # e.g. no flash kernel for a dtype: one cell, not the whole table
        failure = "error: " + (str(e).splitlines() or [type(e).__name__])[0][:60]
    torch.cuda.empty_cache()  # outside the handler, so that the traceback's tensors are gone
    return None, failure


def compose(x, qw1, qw2, kw1, kw2, qdd, kdd):
    """The official Compose on x (B, N, T, S): the residual, the query-wise and key-wise
    low-rank terms and the two gates, each an einsum over the whole tensor."""
    out = x
    hidden = torch.einsum("BNTS,BTRN->BRTS", x, qw1)
    out = out + torch.einsum("BRTS,BTRN->BNTS", hidden, qw2)
    hidden = torch.einsum("BNTS,BSRN->BRTS", x, kw1)
    out = out + torch.einsum("BRTS,BSRN->BNTS", hidden, kw2)
    out = out + torch.einsum("BNTS,BTN->BNTS", x, qdd)
    out = out + torch.einsum("BNTS,BSN->BNTS", x, kdd)
    return out


def dynamic_weights(T, S, dtype, requires_grad):
    def rand(*shape, scale):
        x = torch.randn(*shape, device="cuda", dtype=dtype) * scale
        return x.requires_grad_(requires_grad)

    side = lambda: (rand(B, T, R, H, scale=0.1), rand(B, T, R, H, scale=0.1),
                    rand(B, S, R, H, scale=0.1), rand(B, S, R, H, scale=0.1),
                    rand(B, T, H, scale=0.3), rand(B, S, H, scale=0.3))
    return side(), side()


def einsum_dcmha(q, k, v, pre, post):
    T, S = q.shape[2], k.shape[2]
    logits = torch.einsum("BNTD,BNSD->BNTS", q, k) / math.sqrt(q.shape[-1])
    logits = compose(logits, *pre)
    mask = torch.ones(T, S, device="cuda", dtype=torch.bool).tril(S - T)
    logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits.float(), dim=-1).to(q.dtype)
    probs = compose(probs, *post)
    return torch.einsum("BNTS,BNSD->BNTD", probs, v)


def flash_mha(q, k, v, causal=True):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def attention_rows(dtype, T, backward):
    """SDPA flash MHA and the einsum DCMHA on one (T, direction) shape."""
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=backward)
               for _ in range(3))
    dout = torch.randn(B, H, T, D, device="cuda", dtype=dtype)

    def run(f):
        def call():
            out = f()
            if backward:
                out.backward(dout)
        return call

    with torch.enable_grad() if backward else torch.no_grad():
        flash = timed(run(lambda: flash_mha(q, k, v)))
        pre, post = dynamic_weights(T, T, dtype, backward)
        einsum = timed(run(lambda: einsum_dcmha(q, k, v, pre, post)))
    del q, k, v, dout, pre, post
    torch.cuda.empty_cache()
    return {"flash": flash, "einsum": einsum}


def torch_rows(storage):
    dtype = DTYPES[storage]
    rows = {(T, backward): attention_rows(dtype, T, backward)
            for T in LENGTHS for backward in (False, True)}
    q = torch.randn(DECODE_B, H, 1, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(DECODE_B, H, DECODE_S, D, device="cuda", dtype=dtype) for _ in range(2))
    with torch.no_grad():
        rows["decode"] = {"flash": timed(lambda: flash_mha(q, k, v, causal=False), iterations=10)}
    return rows


def benchmark_entries(text):
    """The "benchmarks" array of Google Benchmark's JSON, also from a file cut short (a killed
    run): every complete entry before the cut."""
    try:
        return json.loads(text)["benchmarks"]
    except (ValueError, KeyError):
        pass
    start = text.find('"benchmarks"')
    start = text.find("[", start) + 1 if start >= 0 else 0
    if start <= 0:
        return []
    decoder, entries = json.JSONDecoder(), []
    while True:
        while start < len(text) and text[start] in " \t\r\n,":
            start += 1
        try:
            entry, start = decoder.raw_decode(text, start)
        except ValueError:
            return entries
        entries.append(entry)


def ours(path):
    """dcmha's benchmark results: name -> (milliseconds, peak MiB); (None, why) for a failed
    case; {} without a file."""
    try:
        with open(path) as f:
            entries = benchmark_entries(f.read())
    except OSError:
        return {}
    result = {}
    for b in entries:
        name = b.get("name", "").split("/manual_time")[0].split("/iterations:")[0]
        if b.get("error_occurred") or b.get("skipped") or "real_time" not in b:
            result[name] = (None, b.get("error_message") or b.get("skip_message") or "error")
            continue
        scale = {"ms": 1.0, "us": 1e-3, "ns": 1e-6, "s": 1e3}[b["time_unit"]]
        result[name] = (b["real_time"] * scale, b.get("peak_MiB"))
    return result


def storages(mine):
    """The storage types to compare: those of dcmha's results, bf16 without any."""
    found = {name.split("/")[2] for name in mine if name.count("/") >= 2}
    return [s for s in DTYPES if s in found] or ["bf16"]


def fmt(x):
    """A table cell: the time (microseconds below 1 ms) and the peak, or why there is none."""
    ms, peak = x
    if ms is None:
        return str(peak).replace("|", "/")[:60]
    time = f"{ms:.2f} ms" if ms >= 1 else f"{ms * 1000:.1f} us"
    return f"{time} ({peak:.0f} MiB)" if isinstance(peak, (int, float)) else time


MISSING = (None, "missing")  # a case dcmha's JSON does not have (its step failed or was cut)


def ratio(a, b):
    return a[0] / b[0] if a[0] is not None and b[0] is not None else None


def shown(r, digits):
    return "-" if r is None else f"{r:.{digits}f}x"


def judged(ours_, reference, test):
    """A target on ours_ / reference: True or False, None where it was not measured (dcmha's
    case missing, or the reference failed). A dcmha case that failed misses it."""
    if ours_ is MISSING or reference[0] is None:
        return None
    return ours_[0] is not None and test(ours_[0] / reference[0])


def verdict(label, ok):
    return f"{label}: " + {True: "met", False: "MISSED", None: "not measured"}[ok]


def attention_line(storage, T, backward, mine, theirs):
    """One table line and its targets missed."""
    d = "fwdbwd" if backward else "fwd"
    mha = mine.get(f"{d}/mha/{storage}/B{B}/H{H}/T{T}/D{D}/causal", MISSING)
    dc = mine.get(f"{d}/dcmha/{storage}/B{B}/H{H}/T{T}/D{D}/causal", MISSING)
    unordered = mine.get(f"{d}/mha_unordered/{storage}/B{B}/H{H}/T{T}/D{D}/causal", MISSING)
    two_sided = mine.get(f"{d}/mha_two_sided/{storage}/B{B}/H{H}/T{T}/D{D}/causal", MISSING)
    flash, einsum = theirs["flash"], theirs["einsum"]
    limit = FORWARD_BACKWARD_LIMIT if backward else FORWARD_LIMIT
    targets = [verdict(f"<= {limit}x flash", judged(dc, flash, lambda r: r <= limit))]
    if backward and T == EINSUM_AT:
        ok = judged(dc, einsum, lambda r: r <= 1 / EINSUM_SPEEDUP)
        targets.append(verdict(f">= {EINSUM_SPEEDUP:.0f}x faster than einsum", ok))
    if einsum == (None, "OOM"):
        ok = None if dc is MISSING else dc[0] is not None
        targets.append(verdict("runs where einsum is OOM", ok))
    others = f"{fmt(unordered)} | {fmt(two_sided)}" if backward else "- | -"
    line = (f"| {d} T{T} {storage} | {fmt(mha)} | {others} | "
            f"{fmt(dc)} | {fmt(flash)} | {fmt(einsum)} | "
            f"{shown(ratio(dc, flash), 2)} | {shown(ratio(einsum, dc), 1)} | "
            f"{'; '.join(targets)} |")
    return line, [f"{d} T{T} {storage}: {t}" for t in targets if not t.endswith(": met")]


def decode_line(storage, mine, theirs):
    """Decode has no target of its own; DCMHA / MHA is shown for the record."""
    shape = f"B{DECODE_B}/H{H}/S{DECODE_S}/D{D}"
    mha = mine.get(f"decode/mha/{storage}/{shape}", MISSING)
    dc = mine.get(f"decode/dcmha/{storage}/{shape}", MISSING)
    return (f"| decode B{DECODE_B}/S{DECODE_S} {storage} | {fmt(mha)} | - | - | {fmt(dc)} | "
            f"{fmt(theirs['decode']['flash'])} | - | - | - | none (DCMHA / MHA "
            f"{shown(ratio(dc, mha), 2)}) |")


def table(mine, results):
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B{B}/H{H}/D{D} causal; "
             "one timed call after one warm-up (decode: the mean of 10); peak memory beyond the "
             "inputs in parentheses (dcmha: outputs, gradients and workspace; PyTorch: its "
             "allocations)" + ("" if mine else "; dcmha's results: none (no bench.json)"), "",
             "| case | dcmha MHA | dcmha MHA unordered | dcmha MHA two-sided | dcmha DCMHA | "
             "SDPA flash MHA | einsum DCMHA "
             "| DCMHA / flash | einsum / DCMHA | target |", "|---|---|---|---|---|---|---|---|---|---|"]
    missed = []  # missed or not measured
    for storage, theirs in results.items():
        for T in LENGTHS:
            for backward in (False, True):
                line, not_met = attention_line(storage, T, backward, mine, theirs[(T, backward)])
                lines.append(line)
                missed += not_met
        lines.append(decode_line(storage, mine, theirs))
    lines += ["", "targets missed or not measured: " + ("; ".join(missed) if missed else "none")]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ours", required=True)
    parser.add_argument("--table")
    args = parser.parse_args()
    mine = ours(args.ours)
    results = {storage: torch_rows(storage) for storage in storages(mine)}
    text = table(mine, results)
    print(text)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
