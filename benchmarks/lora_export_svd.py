"""The adapters' truncated decomposition: `export_task_adapters(svd="subspace")`'s subspace iteration (what "auto"
runs on a GPU) against the exact float64 SVD (`svd="exact"`) on one batch of same-shape deltas, per spectrum and rank:
time, iterations, the largest relative difference of the reconstructed delta `||B A - B* A*|| / ||B* A*||` and of the
truncation error `||delta - B A|| / ||delta - B* A*|| - 1` (0: as good as the optimum; the `*` factors are the exact
SVD's).

Spectra: `noise`: the delta of `benchmarks/routed_serving.py`'s model (experts = a random weight + Gaussian noise of
variance 1e-4, minus the mean base of four tasks on three experts: a flat, random-matrix spectrum); `power0.5`,
`power1`: random singular vectors with singular values `i^-0.5`, `i^-1` (decaying, as trained deltas do).

    python benchmarks/lora_export_svd.py --shape 1024 1024 --batch 4 --ranks 16 32 64

Last line JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_taskmoe.low_rank_svd import truncated_svds  # noqa: E402


def deltas(kind: str, batch: int, out_f: int, in_f: int, generator) -> torch.Tensor:
    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    if kind == "noise":
        weight = randn(batch, out_f, in_f) * 0.02
        experts = [weight + randn(batch, out_f, in_f) * 1e-2 for _ in range(3)]
        return experts[1] - (2 * experts[0] + experts[1] + experts[2]) / 4
    k = min(out_f, in_f)
    u, _ = torch.linalg.qr(randn(batch, out_f, k))
    v, _ = torch.linalg.qr(randn(batch, in_f, k))
    power = {"power0.5": 0.5, "power1": 1.0}[kind]
    s = torch.arange(1, k + 1, dtype=torch.float64) ** -power
    return (u * s) @ v.mT * 0.01


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=[256, 256], metavar=("OUT", "IN"))
    parser.add_argument("--batch", type=int, default=2, help="matrices of the shape, decomposed as one batch")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--spectra", nargs="+", default=["noise", "power0.5", "power1"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'spectrum':<9} {'rank':>4} {'exact s':>8} {'iter. s':>7} {'iters':>5} {'max rel diff B A':>16} "
          f"{'max trunc. excess':>17}")
    for kind in args.spectra:
        batch = list(deltas(kind, args.batch, *args.shape, generator).to(args.device).unbind())
        for rank in args.ranks:
            timings = {}
            for method in ("exact", "subspace"):
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                began = time.perf_counter()
                timings[method] = truncated_svds(batch, rank, method)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                timings[method] = (*timings[method], time.perf_counter() - began)
            (exact, _, t_exact), (fast, iters, t_fast) = timings["exact"], timings["subspace"]
            diff = max(float((b @ a - bx @ ax).norm() / (bx @ ax).norm())
                       for (a, b, _), (ax, bx, _) in zip(fast, exact))
            excess = max(e / ex - 1 for (_, _, e), (_, _, ex) in zip(fast, exact))
            rows.append(dict(spectrum=kind, rank=rank, shape=args.shape, batch=args.batch, exact_s=round(t_exact, 3),
                             auto_s=round(t_fast, 3), iterations=iters, max_rel_diff=diff, max_trunc_excess=excess))
            print(f"{kind:<9} {rank:>4} {t_exact:8.2f} {t_fast:7.2f} {iters:>5} {diff:16.1e} {excess:17.1e}",
                  flush=True)
    print(json.dumps(dict(device=args.device, threads=args.threads, rows=rows)))


if __name__ == "__main__":
    main()
