#!/usr/bin/env python3
"""PyTorch fp16 baseline for bench/gpu/run.sh: decode attention with
torch.nn.functional.scaled_dot_product_attention over unpaged fp16 K/V of
the same shapes gpu_bench times (docs/gpu-notes.md).

GQA decode is run as SDPA of the group's query heads as rows against their
KV head: q [B, Hk, Hq/Hk, D], K/V [B, Hk, ctx, D], non-causal. That is the
same arithmetic as expanding K/V to Hq heads, without the copy, and lets
PyTorch pick its flash / memory-efficient kernel.

Prints one CSV line per shape:
    sdpa,fp16,batch,ctx,ms,bytes_read,GBps
(median of --iters timed calls after --warmup, CUDA events per call).
"""
import argparse
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--ctxs", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hk", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if args.hq % args.hk:
        print("sdpa_baseline: --hq must be a multiple of --hk", file=sys.stderr)
        return 2

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("sdpa_baseline: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    gs = args.hq // args.hk
    for b in args.batches:
        for c in args.ctxs:
            q = torch.randn(b, args.hk, gs, args.d, device=dev, dtype=torch.float16)
            k = torch.randn(b, args.hk, c, args.d, device=dev, dtype=torch.float16)
            v = torch.randn(b, args.hk, c, args.d, device=dev, dtype=torch.float16)
            times = []
            for i in range(args.warmup + args.iters):
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                out = F.scaled_dot_product_attention(q, k, v)
                e1.record()
                e1.synchronize()
                if i >= args.warmup:
                    times.append(e0.elapsed_time(e1))
            assert torch.isfinite(out).all()
            ms = statistics.median(times)
            nbytes = 2 * b * args.hk * c * args.d * 2 + 2 * b * args.hq * args.d * 2
            print(f"sdpa,fp16,{b},{c},{ms:.4f},{nbytes},{nbytes / (ms * 1e-3) / 1e9:.1f}", flush=True)
            del q, k, v, out
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
