"""The packed-attention kernels against each other: one layer's attention, forward + backward.

    python scripts/bench/attn_kernels.py                 # q05's shapes: 256 samples of 150-283 tokens, 14 / 2 heads,
                                                         # head dim 64, bf16 (CUDA)
    python scripts/bench/attn_kernels.py --smoke         # tiny shapes, float32, any device (seconds)

For every kernel of ``rlspmd.models.packing`` (``sdpa_loop``, ``varlen``, ``flex``, ``flash_attn``) it prints one JSON
line: the median milliseconds of forward + backward over ``--repeats`` runs after a first call (which compiles
FlexAttention; its seconds are ``first_call_s``), the ratio to ``sdpa_loop``, and the relative error of the output and
of the q/k/v gradients against ``sdpa_loop`` (the same inputs). A kernel that cannot run here (not installed, no GPU,
no CPU backward) gets a line with ``skipped`` and the reason. The sample lengths are drawn with a fixed seed.
These figures are what ``auto``'s order (flash_attn, varlen, flex) should be revised from.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import emit, sync

KERNEL_ORDER = ("sdpa_loop", "varlen", "flex", "flash_attn")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--min-len", type=int, default=150)
    p.add_argument("--max-len", type=int, default=283)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--kernels", default=",".join(KERNEL_ORDER))
    p.add_argument(
        "--smoke", action="store_true", help="8 samples of 10-40 tokens, 4 / 2 heads of 16, float32, 2 repeats"
    )
    a = p.parse_args(argv)
    if a.smoke:
        a.samples, a.min_len, a.max_len, a.heads, a.kv_heads, a.head_dim, a.dtype, a.repeats = (
            8,
            10,
            40,
            4,
            2,
            16,
            "float32",
            2,
        )

    import torch

    from rlspmd.models.packing import KERNELS, PackedAttention, document_causal_block_mask
    from rlspmd.models.attn_kernels import kernel_problem

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(a.min_len, a.max_len + 1, (a.samples,), generator=g).tolist()
    T = sum(lengths)
    lens = torch.tensor(lengths, device=dev)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=dev)
    cu[1:] = lens.cumsum(0)
    shape = {
        "samples": a.samples,
        "tokens": T,
        "lengths": [min(lengths), max(lengths)],
        "heads": a.heads,
        "kv_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "dtype": a.dtype,
        "device": str(dev),
    }
    gen = torch.Generator(device=dev).manual_seed(1)
    q, k, v = (
        torch.randn(T, h, a.head_dim, device=dev, dtype=dtype, generator=gen).requires_grad_()
        for h in (a.heads, a.kv_heads, a.kv_heads)
    )
    grad_out = torch.randn(T, a.heads, a.head_dim, device=dev, dtype=dtype, generator=gen)
    scale = a.head_dim**-0.5

    def fwd_bwd(kernel: str, meta):
        out = KERNELS[kernel](q, k, v, meta, scale, 0.0)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        return out.detach(), grads

    def rel_err(x, ref):
        return float((x.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12))

    reference, ref_ms = None, None
    for kernel in a.kernels.split(","):
        problem = kernel_problem(kernel, device=dev, dtype=dtype, backward=True)
        if problem is not None:
            emit({"bench": "attn_kernel", "kernel": kernel, "skipped": problem, "shape": shape})
            continue
        block_mask = document_causal_block_mask(lens, T) if kernel == "flex" else None
        meta = PackedAttention(kernel, cu, max(lengths), tuple(lengths), block_mask)
        sync()
        t0 = time.perf_counter()
        out, grads = fwd_bwd(kernel, meta)
        sync()
        first_call_s = time.perf_counter() - t0
        times = []
        for _ in range(a.repeats):
            sync()
            t0 = time.perf_counter()
            fwd_bwd(kernel, meta)
            sync()
            times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        result = {
            "bench": "attn_kernel",
            "kernel": kernel,
            "fwd_bwd_ms": ms,
            "fwd_bwd_ms_all": [round(1e3 * t, 3) for t in times],
            "first_call_s": first_call_s,
            "shape": shape,
        }
        if kernel == "sdpa_loop":
            reference, ref_ms = (out, grads), ms
        elif reference is not None:
            result["speedup_vs_sdpa_loop"] = ref_ms / ms
            result["rel_err_vs_sdpa_loop"] = {
                "out": rel_err(out, reference[0]),
                **{f"d{n}": rel_err(x, y) for n, x, y in zip("qkv", grads, reference[1])},
            }
        emit(result)


if __name__ == "__main__":
    main()
