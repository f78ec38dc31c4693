"""One MoE layer's routed experts, forward + backward: the grouped GEMM against the per-expert loop.

    python scripts/bench/moe_experts.py              # Qwen3-30B-A3B's layer: 128 experts, top-8, hidden 2048,
                                                     # expert width 768, 8192 tokens, bf16 (CUDA)
    python scripts/bench/moe_experts.py --smoke      # 8 experts, top-2, tiny widths, float32, any device (seconds)

Routes ``--tokens`` random hidden states with a random router (``rlspmd.models.moe.route``) and times
``experts_forward`` (sort by expert, SwiGLU experts, weighted combine) forward + backward: ``grouped`` is the CUDA path
(``torch.nn.functional.grouped_mm``, one GEMM per projection for all experts; half precision), ``loop`` one pair of
matmuls per expert that received tokens (the CPU path; on CUDA the same loop on the GPU, same dtype). One JSON line per
path: median milliseconds over ``--repeats``, achieved TFLOP/s (3 matmuls of ``2 * tokens * top_k * H * I`` FLOPs
each in the forward, twice that in the backward), the output's relative error against the float32 loop, and for
``grouped`` its speed-up over ``loop``. A path that cannot run here gets a line with ``skipped`` and the reason.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import emit, sync


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="8 experts, top-2, 64 / 32 wide, 256 tokens, float32")
    a = p.parse_args(argv)
    if a.smoke:
        a.experts, a.top_k, a.hidden, a.inter, a.tokens, a.dtype, a.repeats = 8, 2, 64, 32, 256, "float32", 2

    import torch
    import torch.nn.functional as F

    from rlspmd.models.moe import can_group, experts_forward, route

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)

    class Experts(torch.nn.Module):  # the attributes experts_forward reads (transformers' experts module has them)
        def __init__(self, dtype):
            super().__init__()
            self.num_experts, self.act_fn = a.experts, F.silu
            self.gate_up_proj = torch.nn.Parameter((torch.randn(a.experts, 2 * a.inter, a.hidden, generator=g) * 0.02))
            self.down_proj = torch.nn.Parameter((torch.randn(a.experts, a.hidden, a.inter, generator=g) * 0.02))
            self.to(dev, dtype)

    x = torch.randn(a.tokens, a.hidden, generator=g).to(dev)
    logits = torch.randn(a.tokens, a.experts, generator=g).to(dev)
    weights, used, _ = route(logits, top_k=a.top_k, norm_topk_prob=True)
    flops = 3 * 2 * a.tokens * a.top_k * a.hidden * a.inter * 3  # forward + backward (twice the forward)
    workload = {k: getattr(a, k) for k in ("experts", "top_k", "hidden", "inter", "tokens", "dtype")}

    def run(module, x, w, *, grouped):
        def step():
            xx = x.detach().requires_grad_()
            experts_forward(module, xx, used, w, grouped=grouped).float().square().mean().backward()

        step()
        sync()
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        with torch.no_grad():
            out = experts_forward(module, x, used, w, grouped=grouped).float()
        return statistics.median(times) * 1e3, out

    def line(path, ms, **extra):
        emit(
            {
                "bench": "moe_experts",
                "path": path,
                "device": dev.type,
                "workload": workload,
                "ms": round(ms, 3),
                "tflops": round(flops / ms / 1e9, 3),
                **extra,
            }
        )

    ref_module = Experts(torch.float32)
    _, ref = run(ref_module, x.float(), weights.float(), grouped=False)  # the float32 loop: the reference output
    module = Experts(dtype)
    with torch.no_grad():
        module.gate_up_proj.copy_(ref_module.gate_up_proj)
        module.down_proj.copy_(ref_module.down_proj)
    xs, ws = x.to(dtype), weights.to(dtype)
    loop_ms, out = run(module, xs, ws, grouped=False)
    line("loop", loop_ms, rel_err=float((out - ref).norm() / ref.norm()))
    if not can_group(xs):
        why = "needs CUDA, half precision and torch.nn.functional.grouped_mm"
        emit({"bench": "moe_experts", "path": "grouped", "device": dev.type, "workload": workload, "skipped": why})
        return
    ms, out = run(module, xs, ws, grouped=True)
    line("grouped", ms, speedup_vs_loop=round(loop_ms / ms, 2), rel_err=float((out - ref).norm() / ref.norm()))


if __name__ == "__main__":
    main()
