#!/usr/bin/env python3
"""Summarise dcmha_bench JSON output: a table on stdout, plus gnuplot data and script.

    python3 scripts/bench_summary.py OUT_DIR results.json [more.json ...]

Writes OUT_DIR/summary.txt (the table), OUT_DIR/plot.dat and OUT_DIR/plot.gp; running
`gnuplot OUT_DIR/plot.gp` makes OUT_DIR/dcmha_bench.png. Standard library only, so that the
bench command needs nothing beyond Debian's python3.
"""
import json
import os
import re
import statistics
import sys

# <dir>/<op>/bf16/...: bf16 storage, keyed with mask "<mask>/bf16" so that its DCMHA/MHA ratio
# pairs bf16 with bf16.
NAME = re.compile(
    r"^(?P<dir>fwd|bwd|fwdbwd)/(?P<op>mha|dcmha)(?P<storage>/bf16)?/B(?P<B>\d+)/H(?P<H>\d+)/T(?P<T>\d+)"
    r"/D(?P<D>\d+)/(?P<mask>causal|full|window\d+)")
# decode/<op>/B<b>/H<h>/S<s>/D<d>: one new token against s cached ones. Keyed like the rows above
# with dir "decode", T = s and mask "cache", so ratios, sorting and plotting need no special case.
DECODE_NAME = re.compile(
    r"^(?P<dir>decode)/(?P<op>mha|dcmha)/B(?P<B>\d+)/H(?P<H>\d+)/S(?P<T>\d+)/D(?P<D>\d+)")
# {fwd,bwd}/dynw/B<b>/H<h>/T<t>/D<d>: the dynamic weight projection for a model of width H·D,
# keyed with op "dynw" and mask "proj"; reported in a section of its own, next to DCMHA's core.
DYNW_NAME = re.compile(
    r"^(?P<dir>fwd|bwd)/(?P<op>dynw)/B(?P<B>\d+)/H(?P<H>\d+)/T(?P<T>\d+)/D(?P<D>\d+)")
TO_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
DIR_ORDER = {"fwd": 0, "bwd": 1, "fwdbwd": 2, "decode": 3}


def load(paths):
    """One row per benchmark: the median aggregate when repetitions ran, else the median of
    the plain iteration entries (a run with --benchmark_repetitions=1 has no aggregates)."""
    medians, iterations, errors, context = {}, {}, {}, None
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        context = context or doc.get("context", {})
        for b in doc.get("benchmarks", []):
            name = b.get("run_name", b["name"])
            m = NAME.match(name) or DECODE_NAME.match(name) or DYNW_NAME.match(name)
            if not m:
                continue
            mask = "cache" if m["dir"] == "decode" else "proj" if m["op"] == "dynw" else m["mask"]
            if m.re is NAME and m["storage"]:
                mask += "/bf16"
            key = (m["dir"], m["op"], int(m["B"]), int(m["H"]), int(m["T"]), int(m["D"]), mask)
            if b.get("error_occurred"):
                errors[key] = b.get("error_message", "error")
            elif b.get("run_type") == "aggregate":
                if b.get("aggregate_name") == "median":
                    medians[key] = b
            else:
                iterations.setdefault(key, []).append(b)
    rows = {}
    for key, runs in iterations.items():
        if key not in medians:
            runs = sorted(runs, key=lambda r: r["real_time"] * TO_MS[r.get("time_unit", "ns")])
            rows[key] = runs[len(runs) // 2]
    rows.update(medians)
    return rows, errors, context or {}


def ms(b):
    return b["real_time"] * TO_MS[b.get("time_unit", "ns")]


def shape_of(key):
    d, _, B, H, T, D, mask = key
    if d == "decode":
        return f"B{B}/H{H}/S{T}/D{D}/cache"
    return f"B{B}/H{H}/T{T}/D{D}/{mask}"


def sort_key(key):
    d, op, B, H, T, D, mask = key
    return (H, D, mask, B, T, DIR_ORDER[d], op != "mha")


def ratio(rows, key):
    if key[1] != "dcmha":
        return None
    mha = rows.get((key[0], "mha") + key[2:])
    return ms(rows[key]) / ms(mha) if mha else None


def table(rows, errors):
    header = ["shape", "op", "dir", "median ms", "GFLOP/s", "DCMHA/MHA", "threads"]
    lines = []
    for key in sorted(set(rows) | set(errors), key=sort_key):
        d, op = key[0], key[1]
        if op == "dynw":
            continue
        if key in errors and key not in rows:
            lines.append([shape_of(key), op, d, "ERROR", "-", "-", "-"])
            continue
        b = rows[key]
        r = ratio(rows, key)
        lines.append([
            shape_of(key), op, d, f"{ms(b):.3f}",
            f"{b['FLOPS'] * 1e-9:.1f}" if "FLOPS" in b else "-",
            f"{r:.3f}" if r is not None else "-",
            f"{int(b['threads'])}" if "threads" in b else "-",
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    fmt = lambda cells: "  ".join(
        str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [fmt(header), fmt(["-" * w for w in widths])] + [fmt(l) for l in lines]

    cache = [(k, rows[k]) for k in sorted(rows, key=sort_key) if "cache_bytes_per_token" in rows[k]]
    if cache:
        out += ["", "decode cache per cached token (K + V + key-wise compose state, all B):"]
        for k, b in cache:
            mha = rows.get((k[0], "mha") + k[2:])
            rel = (f"  ({b['cache_bytes_per_token'] / mha['cache_bytes_per_token']:.3f} x MHA)"
                   if k[1] == "dcmha" and mha and "cache_bytes_per_token" in mha else "")
            out.append(f"  {shape_of(k)} {k[1]:5}  {b['cache_bytes_per_token']:10.0f} bytes{rel}")

    proj = [k for k in sorted(set(rows) | set(errors), key=sort_key) if k[1] == "dynw"]
    if proj:
        out += ["", "dynamic weight projection for a model of width E = H·D (G = 1, R = 2, K = 4M);"
                    " bwd from the forward's kept activations; share = its time / DCMHA's causal"
                    " attention core, same direction and shape:"]
        for k in proj:
            if k not in rows:
                out.append(f"  B{k[2]}/H{k[3]}/T{k[4]}/D{k[5]} E{k[3] * k[5]} {k[0]:3}  ERROR (see below)")
                continue
            b = rows[k]
            core = rows.get((k[0], "dcmha") + k[2:6] + ("causal",))
            share = f"  share {ms(b) / ms(core):.3f}" if core else ""
            gflops = f"  {b['FLOPS'] * 1e-9:6.1f} GFLOP/s" if "FLOPS" in b else ""
            out.append(f"  B{k[2]}/H{k[3]}/T{k[4]}/D{k[5]} E{k[3] * k[5]} {k[0]:3}  {ms(b):9.3f} ms{gflops}{share}")

    mem = [(k, rows[k]) for k in sorted(rows, key=sort_key) if "peak_rss_MiB" in rows[k]]
    if mem:
        out += ["", "memory (peak RSS is the whole process's high-water mark):"]
        for k, b in mem:
            out.append(f"  {shape_of(k)} {k[1]:5} {k[0]:6}  peak_rss {b['peak_rss_MiB']:9.1f} MiB"
                       f"  io {b.get('io_MiB', float('nan')):9.1f} MiB")
    for k in sorted(errors, key=sort_key):
        out.append(f"ERROR {k[0]}/{k[1]}/{shape_of(k)}: {errors[k]}")
    return "\n".join(out)


def write_plot(rows, out_dir):
    """plot.dat holds one gnuplot data block per series (T, value); plot.gp draws median time
    (log-log) and the DCMHA/MHA time ratio against T side by side."""
    series_time, series_ratio = {}, {}
    for key in rows:
        d, op, B, H, T, D, mask = key
        if op == "dynw":
            continue
        fam = f"H{H}/D{D} {mask}" + (f" B{B}" if B != 1 else "")
        series_time.setdefault(f"{fam} {d} {op}", []).append((T, ms(rows[key])))
        r = ratio(rows, key)
        if r is not None:
            series_ratio.setdefault(f"{fam} {d}", []).append((T, r))

    blocks, time_plots, ratio_plots = [], [], []
    dat = os.path.join(out_dir, "plot.dat")
    for title, pts in sorted(series_time.items()):
        if len(pts) < 2:  # a lone point (the T16384 memory case) is not a curve against T
            continue
        time_plots.append((len(blocks), title))
        blocks.append(sorted(pts))
    for title, pts in sorted(series_ratio.items()):
        if len(pts) < 2:
            continue
        ratio_plots.append((len(blocks), title))
        blocks.append(sorted(pts))
    if not blocks:
        return False
    with open(dat, "w") as f:
        for pts in blocks:
            f.write("\n".join(f"{t} {v:.6g}" for t, v in pts) + "\n\n\n")

    # One colour per (heads, dir) family; DCMHA dashed next to its solid MHA baseline.
    def plot_cmd(items, extra=""):
        families = sorted({t.rsplit(" ", 1)[0] if t.endswith(("mha", "dcmha")) else t
                           for _, t in items})
        parts = []
        for i, t in items:
            fam = t.rsplit(" ", 1)[0] if t.endswith(("mha", "dcmha")) else t
            dash = 2 if t.endswith("dcmha") else 1
            parts.append(f"'{dat}' index {i} using 1:2 with linespoints "
                         f"linecolor {families.index(fam) + 1} dashtype {dash} title '{t}'")
        return "plot " + ", \\\n     ".join(parts + ([extra] if extra else []))

    png = os.path.join(out_dir, "dcmha_bench.png")
    gp = f"""# generated by scripts/bench_summary.py
if (strstrt(GPVAL_TERMINALS, "pngcairo") > 0) {{
  set terminal pngcairo size 1600,700 noenhanced font ",10"
}} else {{
  set terminal png size 1600,700 noenhanced
}}
set output '{png}'
set multiplot layout 1,2
set grid
set key top left font ",8"
set logscale xy 2
set xlabel 'T (query = key length; decode: S cached keys)'
set ylabel 'median time (ms)'
set title 'dcmha: median time'
{plot_cmd(time_plots)}
unset logscale y
set logscale x 2
set ylabel 'DCMHA time / MHA time'
set title 'DCMHA overhead over MHA'
set key top right
{plot_cmd(ratio_plots, "1 with lines linecolor 'gray' dashtype 3 notitle") if ratio_plots else "plot 1 notitle"}
unset multiplot
"""
    with open(os.path.join(out_dir, "plot.gp"), "w") as f:
        f.write(gp)
    return True


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    out_dir, paths = argv[1], argv[2:]
    rows, errors, ctx = load(paths)
    if not rows and not errors:
        sys.exit("bench_summary: no dcmha benchmark results in " + ", ".join(paths))
    head = (f"host: {ctx.get('host_name', '?')}, {ctx.get('num_cpus', '?')} CPUs @ "
            f"{ctx.get('mhz_per_cpu', '?')} MHz, {ctx.get('date', '')}")
    text = head + "\n\n" + table(rows, errors)
    print(text)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(text + "\n")
    if not write_plot(rows, out_dir):
        print("(nothing to plot: need at least two T values per series)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
