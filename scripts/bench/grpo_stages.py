"""rlspmd's GRPO step, stage by stage: synchronised seconds, peak device memory, MFU and how busy the GPU is.

    python scripts/bench/grpo_stages.py --config configs/bench/grpo_q05.py            # GPU (what gpu_suite.py runs)
    python scripts/bench/grpo_stages.py --config configs/bench/grpo_q05.py:smoke      # CPU smoke run

Runs the trainer of ``--config`` in this process (a world of one, as ``python -m rlspmd.train`` does) for its
``trainer.total_steps`` steps and times its stages with ``rlspmd.trainer.timing.StageProbe``: the rollout's
``generate`` (``gen``), the reference forward (``ref``), the actor update (``update``) and the whole step (``step``),
each between two device synchronisations, with its own peak allocated memory. (The harness wraps those three role
methods of the built trainer, so that it can profile them; the trainer's own ``timing/*`` metrics, also synchronised,
are reported as ``trainer_timing_last``.) On the step given by
``--profile-step`` (default: the last) the update and the reference forward also run under the torch profiler; the
GPU-busy fraction is the union of the CUDA kernels' intervals over the stage's wall time (the profiler adds host
overhead, so ``busy`` is also given against the unprofiled median: ``busy_vs_unprofiled``). On CPU the profiled
stages (generation too) report their ``top_cpu_ops`` instead.

``--split-update`` also splits the update into ``update_fwd`` (the actor's forwards with gradients, timed by hooks on
its module), ``optim`` (the optimiser's step) and ``update_bwd`` (the rest of the update: backward, loss, clipping),
each between device synchronisations (a few more per step).

MFU: ``6 N tokens / update seconds`` (forward + backward of every token of the step) and ``2 N tokens / ref seconds``
over the GPU's dense bf16 peak (``common.DENSE_BF16_TFLOPS``, by device name); N counts every parameter once (tied
embeddings once). ``--partial FILE`` rewrites the JSON after every step, so a run cut short still leaves its figures.
Prints one JSON line (``bench: grpo_stages``); medians over the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import ROOT, dense_bf16_peak_tflops, emit, kernel_busy_seconds, top_cpu_ops, top_kernels


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="config file[:name]")
    p.add_argument("--steps", type=int, default=None, help="override trainer.total_steps")
    p.add_argument("--profile-step", type=int, default=None, help="step to profile (default: the last; 0: none)")
    p.add_argument("--partial", default=None, help="rewrite the JSON here after every step")
    p.add_argument("--output-dir", default=None, help="override trainer.output_dir")
    p.add_argument("--split-update", action="store_true", help="time the update's forward, backward and optimiser")
    p.add_argument(
        "--build", default=None, help="build this grpo_workload.py preset (model + prompts) first, e.g. grpo_q15"
    )
    a = p.parse_args(argv)
    if a.build:
        from grpo_workload import build

        build([a.build], data=ROOT / "data" / "bench" / "prompts.jsonl", num_prompts=256, prompt_tokens=27)

    import dataclasses

    import torch

    from rlspmd.config import load_config_file
    from rlspmd.distributed.mesh import ParallelDims, RoleMeshes
    from rlspmd.distributed.runtime import init_distributed, quiet_libraries, seed_everything, shutdown
    from rlspmd.models.attn_kernels import check_attn_kernel
    from rlspmd.trainer.timing import StageProbe, device_synchronize

    cfg = load_config_file(a.config)
    trainer_cfg = dataclasses.replace(
        cfg.trainer, total_steps=a.steps or cfg.trainer.total_steps, output_dir=a.output_dir or cfg.trainer.output_dir
    )
    cfg = dataclasses.replace(cfg, trainer=trainer_cfg)
    steps = cfg.trainer.total_steps
    profile_step = steps if a.profile_step is None else a.profile_step
    rt = init_distributed(cfg.dist)
    quiet_libraries()
    seed_everything(cfg.trainer.seed)
    meshes = RoleMeshes(ParallelDims.from_config(cfg.mesh, rt.world_size), rt.device.type, rt.rank)
    model_cfg = cfg.actor.model
    attn_kernel = check_attn_kernel(
        model_cfg.attn_kernel,
        attn_implementation=model_cfg.attn_implementation,
        packing=model_cfg.packing,
        device=rt.device,
        dtype=cfg.actor.engine.compute_dtype(rt.device),
        field_name="actor.model.attn_kernel",
    )
    from rlspmd.trainer.build import build_trainer

    t_build = time.perf_counter()
    trainer = build_trainer(cfg, rt, meshes)
    roles = trainer.roles
    build_s = time.perf_counter() - t_build
    n_params = sum(p.numel() for p in roles.actor.engine.module.parameters())  # DTensor numel is the global size

    probe = StageProbe(rt.device)
    profiled: dict[str, dict] = {}
    current_step = [0]

    def staged(name, fn):
        def run(*args, **kwargs):
            with probe(name):
                cuda = rt.device.type == "cuda"
                if current_step[0] != profile_step or (name == "gen" and cuda):  # CUDA graphs hide from the profiler
                    return fn(*args, **kwargs)
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                    t0 = time.perf_counter()
                    out = fn(*args, **kwargs)
                    device_synchronize(rt.device)
                    wall = time.perf_counter() - t0
                profiled[name] = {
                    "wall_s": wall,
                    "kernel_s": kernel_busy_seconds(prof),
                    "top_kernels": top_kernels(prof) if cuda else None,
                    "top_cpu_ops": None if cuda else top_cpu_ops(prof),
                }
                return out

        return run

    # the stage methods of the built trainer, wrapped in place (see the docstring)
    roles.rollout.generate = staged("gen", roles.rollout.generate)
    roles.ref.log_prob = staged("ref", roles.ref.log_prob)
    roles.actor.update = staged("update", roles.actor.update)

    if a.split_update:
        split_update(roles.actor.engine, probe, rt.device)

    per_step: list[dict] = []
    peak_tflops = dense_bf16_peak_tflops(torch.cuda.get_device_name(rt.device)) if rt.device.type == "cuda" else None
    result: dict = {}
    for step in range(1, steps + 1):
        current_step[0] = step
        probe.seconds.clear()
        probe.peak_bytes.clear()
        with probe("step"):
            metrics = trainer.step(step)
        per_step.append(
            {
                "seconds": dict(probe.seconds),
                "peak_gib": {k: v / 2**30 for k, v in probe.peak_bytes.items()},
                "tokens": metrics["tokens/total"],
                "response_tokens": metrics["tokens/response"],
                "trainer_timing": {k.removeprefix("timing/"): v for k, v in metrics.items() if k.startswith("timing/")},
            }
        )
        result = {
            "bench": "grpo_stages",
            "config": a.config,
            "steps_done": step,
            "device": torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "cpu",
            "attn_kernel": attn_kernel,
            "compute_dtype": str(cfg.actor.engine.compute_dtype(rt.device)).removeprefix("torch."),
            "build_s": build_s,
            **summarize(
                per_step, n_params=n_params, peak_tflops=peak_tflops, profiled=profiled, cuda=rt.device.type == "cuda"
            ),
        }
        if a.partial:
            Path(a.partial).parent.mkdir(parents=True, exist_ok=True)
            Path(a.partial).write_text(json.dumps(result) + "\n")
    roles.reward.close()
    emit(result)
    shutdown()


def split_update(engine, probe, device) -> None:
    """Time the actor's forwards with gradients (``update_fwd``) and its optimiser steps (``optim``) inside ``update``,
    which then also reports ``update_bwd``: the update's remaining seconds."""
    import torch

    from rlspmd.trainer.timing import device_synchronize

    started: list[float] = []

    def before(module, args, kwargs):
        if torch.is_grad_enabled():
            device_synchronize(device)
            started.append(time.perf_counter())

    def after(module, args, kwargs, out):
        if started:
            device_synchronize(device)
            probe.seconds["update_fwd"] = probe.seconds.get("update_fwd", 0.0) + time.perf_counter() - started.pop()

    engine.module.register_forward_pre_hook(before, prepend=True, with_kwargs=True)
    engine.module.register_forward_hook(after, with_kwargs=True, always_call=True)
    step = engine.optim.step

    def timed_step(*args, **kwargs):
        with probe("optim"):
            return step(*args, **kwargs)

    engine.optim.step = timed_step


def summarize(per_step: list[dict], *, n_params: int, peak_tflops: float | None, profiled: dict, cuda: bool) -> dict:
    steady = per_step[1:] or per_step  # the first step pays one-off costs (allocator, cuBLAS, compilation)
    for s in per_step:
        sec = s["seconds"]
        if "update_fwd" in sec:
            sec["update_bwd"] = sec["update"] - sec["update_fwd"] - sec.get("optim", 0.0)
    stages = sorted({k for s in steady for k in s["seconds"]})
    median = {k: statistics.median(s["seconds"].get(k, 0.0) for s in steady) for k in stages}
    tokens = steady[-1]["tokens"]
    flop = {"update": 6 * n_params * tokens, "ref": 2 * n_params * tokens}
    out = {
        "n_params": n_params,
        "tokens_per_step": tokens,
        "sec_per_step": median.get("step"),
        "stages_s": median,
        "stages_s_all": [s["seconds"] for s in per_step],
        "peak_mem_gib": {k: max(s["peak_gib"].get(k, 0.0) for s in per_step) for k in stages}
        if per_step[0]["peak_gib"]
        else None,
        "gen_tokens_per_s": steady[-1]["response_tokens"] / median["gen"] if median.get("gen") else None,
        "tflops": {k: flop[k] / median[k] / 1e12 for k in flop if median.get(k)},
        "trainer_timing_last": per_step[-1]["trainer_timing"],
        "peak_bf16_tflops": peak_tflops,
    }
    out["mfu"] = {k: v / peak_tflops for k, v in out["tflops"].items()} if peak_tflops else None
    out["gpu_busy"] = {  # on CPU the profiler runs too (the code path is tested) but there are no kernels to count
        k: {
            "kernel_s": v["kernel_s"],
            "profiled_wall_s": v["wall_s"],
            "busy": v["kernel_s"] / v["wall_s"] if cuda else None,
            "busy_vs_unprofiled": min(1.0, v["kernel_s"] / median[k]) if cuda and median.get(k) else None,
            "top_kernels": v["top_kernels"],
            "top_cpu_ops": v["top_cpu_ops"],
        }
        for k, v in profiled.items()
    } or None
    return out


if __name__ == "__main__":
    main()
