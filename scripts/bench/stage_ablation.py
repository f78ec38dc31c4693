"""What one part of a GRPO stage costs where it runs: the actor update (or the reference forward) timed with that part
swapped out, the variants alternated in one process; prints one JSON line.

    python scripts/bench/stage_ablation.py --config configs/bench/grpo_smollm2.py
    python scripts/bench/stage_ablation.py --config configs/bench/grpo_smollm2.py --stage ref

Runs step 1 of the trainer of ``--config`` as ``python -m rlspmd.train`` would (a world of one). In step 2 the stage
(``update``: the actor's ``update``; ``ref``: the reference's ``log_prob``) is called ``--rounds`` times per variant
on that step's batch, the variants in turn and every other round in reverse order, then step 2 goes on as usual. Each
variant is applied around its call only:

- ``baseline``: the run as built;
- ``no_attention``: the packed-attention kernel replaced by a token-wise stand-in of the same shapes (``q / 2`` plus
  each query head's ``v``): what attention costs in the stage, with everything around it;
- ``no_attention_kernel``: the same, keeping what ``sdpa_loop`` does around its SDPA calls (on CPU in bfloat16 with
  gradients: the float32 casts, the per-sample split and the concatenation): the kernel calls alone;
- ``eager_norms``: the RMSNorm layers that ``actor.engine.compile_norms`` compiled run eagerly (the actor's and the
  reference's modules);
- ``whole_prompts``: every row packed whole, its prompt included, instead of each group's prompt once
  (``model.share_prompts``, the actor's and the reference's modules);
- ``prefix_loop``: with shared prompts, one SDPA call per prompt and per response (``packing.prefix_loop_attention``)
  instead of the two batched calls of ``packing.prefix_batched_attention``;
- ``sdpa_loop``: where the run's packs use the ``cpu_fused`` attention kernel (``model.attn_kernel=auto`` on CPU in
  bfloat16 with gradients), ``sdpa_loop``'s calls instead (float32 casts around torch's flash kernel);
- ``torch_logprobs``: the chunked log-prob's elementwise passes as torch ops instead of the C++ row kernels
  (``models/logprobs.py: CPU_KERNELS``);
- ``heap_malloc``: glibc serves every block below 1 GiB from the heap (mmap threshold 1 GiB, trim threshold 2 GiB - 1)
  instead of ``runtime.keep_freed_memory``'s 32 MiB, so that FSDP2's per-step gradient buffers of hundreds of MiB are
  not mapped afresh (page-faulted) each step.

The stand-ins compute nonsense: the losses and gradients of an ablated update are not the run's, and the parameters it
updates differ from a real run's (by one step at the workload's learning rate). This is a measuring tool, not a run.

Why one process: this 2-core VM's step times move by 10-15 % between runs, more than most single changes. Alternating
the variants in one process on one batch compares them under the same load, allocator state and compiled code. The
torch profiler is no help here (on this CPU it inflated an update 3x, small kernels the most: docs/performance.md).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

CALLS = {"kernel": 0, "stand_in": 0}
"""Packed-attention calls so far: of the run's kernels, and of the stand-ins (each variant's are reported)."""


def _counted(fn):
    def kernel(*args, **kwargs):
        CALLS["kernel"] += 1
        return fn(*args, **kwargs)

    return kernel


def _stand_in(q_THD, k_TKD, v_TKD):
    """Token-wise, the shapes of attention's output: ``q / 2`` plus each query head's ``v``."""
    CALLS["stand_in"] += 1
    return q_THD * 0.5 + v_TKD.repeat_interleave(q_THD.shape[1] // v_TKD.shape[1], 1)


def _no_attention(q, k, v, meta, scale, dropout):
    return _stand_in(q, k, v) + 0 * k.sum()  # k stays in the graph, as attention's


def _no_attention_kernel(q, k, v, meta, scale, dropout):
    """``packing.sdpa_loop_attention``'s work around its SDPA calls (float32 casts on CPU for half-precision inputs with
    gradients, per-sample split, concatenation), the calls replaced by the stand-in."""
    import torch

    from rlspmd.models.packing import cpu_backward_in_float32

    dtype = q.dtype
    if cpu_backward_in_float32(q, k, v):
        q, k, v = q.float(), k.float(), v.float()
    outs = [
        _stand_in(qs, ks, vs) for qs, ks, vs in zip(q.split(meta.lengths), k.split(meta.lengths), v.split(meta.lengths))
    ]
    CALLS["stand_in"] -= len(outs) - 1  # counted as one call, as the kernel it stands in for
    return (torch.cat(outs) + 0 * k.sum()).to(dtype)


@contextmanager
def _kernel(fn):
    from rlspmd.models import packing

    kept = dict(packing.KERNELS)
    packing.KERNELS.update({name: fn for name in packing.KERNELS})
    try:
        yield
    finally:
        packing.KERNELS.update(kept)


@contextmanager
def _eager_norms(trainer):
    from rlspmd.engines.fsdp.engine import rms_norms

    compiled = []
    for role in (trainer.roles.actor, trainer.roles.ref):
        engine = getattr(role, "engine", None)
        for m in rms_norms(engine.hf_model) if engine is not None else ():
            if getattr(m, "_compiled_call_impl", None) is not None:
                compiled.append((m, m._compiled_call_impl))
                m._compiled_call_impl = None
    if not compiled:
        raise SystemExit("eager_norms: no compiled norms in this run (actor.engine.compile_norms resolved off)")
    try:
        yield
    finally:
        for m, impl in compiled:
            m._compiled_call_impl = impl


@contextmanager
def _whole_prompts(trainer):
    modules = []
    for role in (trainer.roles.actor, trainer.roles.ref):
        engine = getattr(role, "engine", None)
        module = getattr(engine, "module", None)
        if getattr(module, "share_prompts", False):
            modules.append(module)
            module.share_prompts = False
    if not modules:
        raise SystemExit("whole_prompts: no module shares prompts in this run (model.share_prompts off)")
    try:
        yield
    finally:
        for module in modules:
            module.share_prompts = True


@contextmanager
def _swapped(owner, name: str, value):
    """``owner[name]`` (a dict) or ``owner.name`` set to ``value`` around the block, then restored."""
    is_dict = isinstance(owner, dict)
    kept = owner[name] if is_dict else getattr(owner, name)
    if is_dict:
        owner[name] = value
    else:
        setattr(owner, name, value)
    try:
        yield
    finally:
        if is_dict:
            owner[name] = kept
        else:
            setattr(owner, name, kept)


def _prefix_loop(trainer):
    from rlspmd.models import packing

    return _swapped(packing, "prefix_batch", lambda groups, device: None)


def _sdpa_loop(trainer):
    from rlspmd.models import packing

    return _swapped(packing.KERNELS, "cpu_fused", packing.KERNELS["sdpa_loop"])


def _torch_logprobs(trainer):
    from rlspmd.models import logprobs

    return _swapped(logprobs, "CPU_KERNELS", False)


@contextmanager
def _heap_malloc(trainer):
    from rlspmd.distributed.runtime import keep_freed_memory

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, (1 << 31) - 1)):
        raise SystemExit("heap_malloc: glibc refused the mallopt settings")
    try:
        yield
    finally:
        keep_freed_memory()  # the run's settings again


VARIANTS = {
    "baseline": lambda trainer: nullcontext(),
    "no_attention": lambda trainer: _kernel(_no_attention),
    "no_attention_kernel": lambda trainer: _kernel(_no_attention_kernel),
    "eager_norms": _eager_norms,
    "heap_malloc": _heap_malloc,
    "whole_prompts": _whole_prompts,
    "prefix_loop": _prefix_loop,
    "sdpa_loop": _sdpa_loop,
    "torch_logprobs": _torch_logprobs,
}
"""Each variant's context manager, given the built trainer (see the module docstring)."""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="config file[:name]")
    p.add_argument("--stage", choices=("update", "ref"), default="update")
    p.add_argument("--variants", default="baseline,no_attention,no_attention_kernel", help="comma-separated")
    p.add_argument("--rounds", type=int, default=6, help="calls per variant (the first round is reported apart)")
    p.add_argument("--output-dir", default="outputs/bench/stage_ablation")
    a = p.parse_args(argv)
    names = a.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"--variants: unknown {name!r}; one of {list(VARIANTS)}")

    import torch

    from rlspmd.config import load_config_file
    from rlspmd.distributed.mesh import ParallelDims, RoleMeshes
    from rlspmd.distributed.runtime import init_distributed, quiet_libraries, seed_everything, shutdown
    from rlspmd.models import packing
    from rlspmd.trainer.build import build_trainer
    from rlspmd.trainer.timing import device_synchronize

    cfg = load_config_file(a.config)
    cfg = dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, total_steps=2, output_dir=a.output_dir, print_summary_json=False)
    )
    rt = init_distributed(cfg.dist)
    quiet_libraries()
    seed_everything(cfg.trainer.seed)
    trainer = build_trainer(
        cfg, rt, RoleMeshes(ParallelDims.from_config(cfg.mesh, rt.world_size), rt.device.type, rt.rank)
    )
    packing.KERNELS.update({name: _counted(fn) for name, fn in packing.KERNELS.items()})
    owner, method = (trainer.roles.actor, "update") if a.stage == "update" else (trainer.roles.ref, "log_prob")
    stage = getattr(owner, method)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    attention_calls = {n: {"kernel": 0, "stand_in": 0} for n in names}
    calls = [0]

    def ablated(*args, **kwargs):
        calls[0] += 1
        if calls[0] != 2:  # step 1 runs as built (first-step costs: allocator, compilation)
            return stage(*args, **kwargs)
        for r in range(a.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                before = dict(CALLS)
                with VARIANTS[name](trainer):
                    device_synchronize(rt.device)
                    t0 = time.perf_counter()
                    stage(*args, **kwargs)
                    device_synchronize(rt.device)
                    seconds[name].append(time.perf_counter() - t0)
                for k in CALLS:
                    attention_calls[name][k] += CALLS[k] - before[k]
        return stage(*args, **kwargs)  # the step goes on with a baseline call's outputs

    setattr(owner, method, ablated)
    trainer.step(1)
    trainer.step(2)
    trainer.roles.reward.close()
    steady = {n: s[1:] or s for n, s in seconds.items()}  # a variant's first call may compile or allocate
    median = {n: statistics.median(s) for n, s in steady.items()}
    base = median.get("baseline")
    emit(
        {
            "bench": "stage_ablation",
            "config": a.config,
            "stage": a.stage,
            "device": torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "cpu",
            "compute_dtype": str(cfg.actor.engine.compute_dtype(rt.device)).removeprefix("torch."),
            "rounds": a.rounds,
            "median_s": median,
            "min_s": {n: min(s) for n, s in steady.items()},
            "first_s": {n: s[0] for n, s in seconds.items()},
            "saving_s": {n: base - m for n, m in median.items() if n != "baseline"} if base is not None else None,
            "all_s": seconds,
            "attention_calls": attention_calls,
        }
    )
    shutdown()


if __name__ == "__main__":
    main()
