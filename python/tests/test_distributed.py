"""Tensor parallelism over compose groups: two torch.distributed processes (gloo, loopback) each
hold one of G = 2 compose groups (half the heads), run dcmha_torch.attention on them, project with
their column block of Wo and all-reduce; outputs and every gradient must match the one-process
computation (all heads, G = 2 in one call, full Wo) in float64.

Compose groups mix heads only within a group, so splitting heads by group is exact: rank r holds
query heads [r H/2, (r+1) H/2), kv heads [r Hk/2, (r+1) Hk/2) (GQA stays consistent since query
head h reads kv head h // (H / Hk)), and group r of every compose entry."""
import multiprocessing.connection
import os
import socket
import sys
import tempfile
import time
import traceback
import unittest
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dcmha_torch  # noqa: F401  (the parent's reference; the children import it after their path)
from test_attention import max_relative, problem

WORLD = 2
JOIN_TIMEOUT_S = 120
COLLECTIVE_TIMEOUT_S = 60
SIDES = ("pre", "post")
ENTRIES = ("sw", "qw1", "qw2", "kw1", "kw2", "qdd", "kdd")
TERMS = ("sw", "qw", "kw")  # every term on both sides: static W, query-wise and key-wise

CASES = [
    # MHA heads; each rank passes its group in the grouped layout with G = 1 (contiguous copies).
    dict(spec=dict(B=2, H=4, T=6, D=8, R=2, seed=11), E=10, layout="grouped"),
    # GQA (H / Hk = 2) with S > T; each rank passes the official layout, as strided views of the
    # full tensors (the slices a fused projection would give).
    dict(spec=dict(B=2, H=8, Hk=4, T=5, S=7, D=4, R=2, seed=12), E=6, layout="official"),
]


def build(case):
    """The full problem: q, k, v, compose (G = 2, grouped layouts), Wo (E, H D), dy (B, T, E)."""
    q, k, v, compose = problem(groups=2, pre=TERMS, post=TERMS, **case["spec"])
    B, H, T, D = q.shape
    g = torch.Generator().manual_seed(1000 + case["spec"]["seed"])
    wo = torch.randn(case["E"], H * D, dtype=torch.float64, generator=g) / (H * D) ** 0.5
    dy = torch.randn(B, T, case["E"], dtype=torch.float64, generator=g)
    return q, k, v, compose, wo, dy


def named_leaves(q, k, v, compose, wo):
    named = [("q", q), ("k", k), ("v", v)]
    named += [(f"{s}.{n}", e) for s, side in zip(SIDES, compose) for n, e in zip(ENTRIES, side)]
    named.append(("wo", wo))
    return named


def shard(name, full, rank, H, Hk, D, layout):
    """Rank `rank`'s part of a full (single-process) tensor, in the rank's layout."""
    if name in ("q", "k", "v"):
        n = (H if name == "q" else Hk) // WORLD
        return full[:, rank * n:(rank + 1) * n]
    if name == "wo":
        n = H // WORLD * D
        return full[:, rank * n:(rank + 1) * n]
    entry = name.split(".")[1]
    if entry == "sw":  # (G, M, M)
        part = full[rank:rank + 1]
        return part.contiguous() if layout == "grouped" else part[0]
    part = full[:, :, rank:rank + 1]  # (B, L, G, R, M) or (B, L, G, M): group axis 2
    return part.contiguous() if layout == "grouped" else part[:, :, 0]


def merge_heads(o):
    """(B, h, T, D) -> (B, T, h D), as a model does before the output projection."""
    B, h, T, D = o.shape
    return o.transpose(1, 2).reshape(B, T, h * D)


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks in the forward, identity in the backward (Megatron's "g" operator).

    Every rank ends up with the same y = sum_r y_r and computes the same loss L(y) (same dy), so
    L is one replicated function, not a different loss per rank. Since dy / dy_r = I for each r,
    dL/dy_r = dL/dy, which every rank already holds: no communication is needed in the backward.
    torch.distributed.nn.functional.all_reduce (present in torch 1.13) instead all-reduces the
    incoming gradient too, i.e. it differentiates sum_r L_r = WORLD * L and would give WORLD
    times the gradients here, so it is not used."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


def _worker(rank, init_method, outdir, paths):
    # The parent's import path, explicitly (dcmha_torch and test_attention live on it).
    sys.path[:0] = [p for p in paths if p not in sys.path]
    try:
        import dcmha_torch as dt

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            results = []
            for case in CASES:
                q, k, v, compose, wo, dy = build(case)
                H, Hk, D = q.shape[1], k.shape[1], q.shape[3]
                named = [(n, shard(n, t, rank, H, Hk, D, case["layout"]).detach().requires_grad_())
                         for n, t in named_leaves(q, k, v, compose, wo)]
                local = dict(named)
                local_compose = tuple(tuple(local[f"{s}.{n}"] for n in ENTRIES) for s in SIDES)
                o = dt.attention(local["q"], local["k"], local["v"], local_compose, causal=True)
                y_partial = merge_heads(o) @ local["wo"].t()
                y = _AllReduceSum.apply(y_partial)
                loss = (y * dy).sum()
                grads = torch.autograd.grad(loss, [t for _, t in named])
                results.append(dict(y=y.detach(), grads={n: g for (n, _), g in zip(named, grads)}))
            torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(outdir):
    """Starts the ranks, waits for them (JOIN_TIMEOUT_S in all), returns a failure message or
    None. A rank that fails or hangs gets the others terminated."""
    paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    paths.insert(0, os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": os.pathsep.join(paths)}
    if "GLOO_SOCKET_IFNAME" not in os.environ and "lo" in dict(
            (name, i) for i, name in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo on loopback whatever the hostname resolves to
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # inherited by the spawned interpreters
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_worker, args=(r, init_method, outdir, paths), daemon=True)
             for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    failure = None
    while True:
        # Exit codes first: a rank's sentinel can fire before its exit code is readable, so the
        # check must come before each wait, not after it (else a failed rank is noticed late).
        codes = [p.exitcode for p in procs]
        if None not in codes or any(c not in (None, 0) for c in codes):
            break
        left = deadline - time.monotonic()
        if left <= 0:
            failure = f"ranks still running after {JOIN_TIMEOUT_S} s"
            break
        multiprocessing.connection.wait([p.sentinel for p, c in zip(procs, codes) if c is None],
                                        timeout=min(left, 1.0))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    codes = [p.exitcode for p in procs]
    if failure is None and codes != [0] * WORLD:
        failure = f"rank exit codes {codes}"
    if failure is not None:
        for r in range(WORLD):
            err = os.path.join(outdir, f"rank{r}.err")
            if os.path.exists(err):
                with open(err) as f:
                    failure += f"\n--- rank {r} ---\n{f.read()}"
    return failure


@unittest.skipUnless(dist.is_available() and dist.is_gloo_available(),
                     "torch.distributed with gloo is not available")
class TensorParallelGroups(unittest.TestCase):
    def test_two_ranks_match_one_process(self):
        with tempfile.TemporaryDirectory() as outdir:
            failure = _run_ranks(outdir)
            if failure is not None:
                self.fail(failure)
            ranks = [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(WORLD)]

        for i, case in enumerate(CASES):
            # The one-process computation: all heads, both groups in one call, full Wo.
            q, k, v, compose, wo, dy = build(case)
            H, Hk, D = q.shape[1], k.shape[1], q.shape[3]
            named = named_leaves(q, k, v, compose, wo)
            for _, t in named:
                t.requires_grad_(True)
            y = merge_heads(dcmha_torch.attention(q, k, v, compose, causal=True)) @ wo.t()
            grads = torch.autograd.grad((y * dy).sum(), [t for _, t in named])
            for r, results in enumerate(ranks):
                got = results[i]
                with self.subTest(case=i, rank=r, tensor="y"):
                    self.assertEqual(got["y"].shape, y.shape)
                    self.assertLess(max_relative(got["y"], y.detach()), 1e-12)
                for (name, _), grad in zip(named, grads):
                    with self.subTest(case=i, rank=r, tensor=f"grad {name}"):
                        expected = shard(name, grad, r, H, Hk, D, case["layout"])
                        self.assertEqual(got["grads"][name].shape, expected.shape)
                        self.assertLess(max_relative(got["grads"][name], expected), 1e-10)


if __name__ == "__main__":
    unittest.main()
