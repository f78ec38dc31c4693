"""The whole GPU picture in one command: rlspmd's GRPO step against TRL's, generation against HF ``generate``, the
packed-attention kernels against each other, MFU, GPU-busy fractions and peak memory per stage.

    bash scripts/bench/gpu_suite.sh                 # on the GPU box (installs carried wheels from .whl/ first)
    python scripts/bench/gpu_suite.py               # the same, where the packages are already installed
    python scripts/bench/gpu_suite.py --smoke       # a tiny version of every phase, on CPU too (how it is tested)

Phases, each a subprocess with its own time limit (killed with its whole process group when it runs over; rlspmd
traps SIGTERM to checkpoint, so the kill is SIGKILL), in this order:

  env         torch / CUDA / GPU / package versions, and which attention kernels can run
  build       the q05 model (``models/bench-q05``, 365 M) and the 27-token prompts (``grpo_workload.py``)
  attention   one layer's packed attention, forward + backward, at q05's shapes, every kernel (``attn_kernels.py``)
  rlspmd      the q05 GRPO step, stage by stage, with MFU, busy fractions and peak memory (``grpo_stages.py``)
  trl         TRL's GRPOTrainer on the same model and prompts (``trl_grpo.py``); says so when TRL is absent
  grpo_vs_trl the step-time ratio
  generation  native engine (eager and CUDA graphs) vs HF ``generate`` at 256 x 256 and 64 x 256 (``gen_vs_hf.py``)
  tests       the ``gpu``-marked tests of the CUDA paths (``gpu_tests.py``: kernels vs the per-sample path, CUDA-graph
              decoding vs eager, no host syncs, MoE grouped GEMM vs the loop), as one JSON line
  moe         one MoE layer's experts at Qwen3-30B-A3B's shapes, grouped GEMM vs per-expert loop (``moe_experts.py``)
  q15         the same GRPO step on the 1.3 B model, for MFU at a larger size (built in this phase)
  sequence_parallel  one actor update on a 16k / 32k-token response per rank, SP 1 vs 2 on 2 GPUs: device memory
              and step time (``sequence_parallel.py``); skipped with fewer than 2 GPUs
  summary     every target of issue 12 with its measured value

Every benchmark prints one JSON line; the suite re-prints them (plus one status line per phase: seconds, exit status,
timed out or skipped, and the output's tail when it failed) and writes them to ``$OUT/gpu_suite.jsonl``
(``--out-dir``, default ``$OUT`` or ``outputs/gpu_suite``), with each phase's full output in ``<phase>.log``. The
phase limits add up to ``--budget-s`` (510 s, under 9 minutes on one H100 with the models already built; a first run
also builds them); a phase starts only with at least 20 s of the budget left. ``--smoke`` runs the smoke configs
(``configs/bench/grpo_q05.py:smoke``, ``grpo_q15.py:smoke``) on ``models/bench-tiny`` with generous limits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, emit, machine

TARGETS = {  # issue 12
    "grpo_vs_trl": 4.0,
    "mfu_update": 0.35,
    "mfu_ref": 0.40,
    "gen_tokens_per_s_256x256": 50_000.0,
    "gen_ratio_vs_hf_64x256": 5.0,
    "busy_update": 0.8,
    "busy_ref": 0.8,
}


def phases(smoke: bool) -> list[tuple[str, list[str], float]]:
    """(name, command after ``python``, time limit in seconds)."""
    if smoke:
        data = "data/bench/smoke_prompts.jsonl"
        model = "models/bench-tiny"
        return [
            (
                "build",
                ["scripts/bench/grpo_workload.py", "--which", "smoke", "--data", data, "--num-prompts", "8"],
                300,
            ),
            ("attention", ["scripts/bench/attn_kernels.py", "--smoke"], 300),
            ("rlspmd", ["scripts/bench/grpo_stages.py", "--config", "configs/bench/grpo_q05.py:smoke"], 600),
            (
                "trl",
                [
                    "scripts/bench/trl_grpo.py",
                    "--model",
                    model,
                    "--data",
                    data,
                    "--prompts",
                    "4",
                    "--generations",
                    "2",
                    "--new-tokens",
                    "16",
                    "--per-device-batch",
                    "8",
                    "--grad-accum",
                    "1",
                    "--steps",
                    "2",
                ],
                600,
            ),
            (
                "generation",
                ["scripts/bench/gen_vs_hf.py", "--model", model, "--sizes", "8x8,4x8", "--repeats", "1"],
                300,
            ),
            ("tests", ["scripts/bench/gpu_tests.py"], 300),
            ("moe", ["scripts/bench/moe_experts.py", "--smoke"], 300),
            (
                "q15",
                ["scripts/bench/grpo_stages.py", "--config", "configs/bench/grpo_q15.py:smoke", "--profile-step", "0"],
                600,
            ),
            (
                "sequence_parallel",
                ["scripts/bench/sequence_parallel.py", "--lengths", "256", "--sp", "1", "2", "--nproc", "2"],
                300,
            ),
        ]
    return [
        ("build", ["scripts/bench/grpo_workload.py", "--which", "grpo_q05", "--num-prompts", "256"], 70),
        ("attention", ["scripts/bench/attn_kernels.py"], 50),
        ("rlspmd", ["scripts/bench/grpo_stages.py", "--config", "configs/bench/grpo_q05.py"], 110),
        (
            "trl",
            [
                "scripts/bench/trl_grpo.py",
                "--model",
                "models/bench-q05",
                "--prompts",
                "32",
                "--generations",
                "8",
                "--new-tokens",
                "256",
                "--per-device-batch",
                "32",
                "--grad-accum",
                "8",
                "--bf16",
                "--steps",
                "3",
            ],
            100,
        ),
        (
            "generation",
            [
                "scripts/bench/gen_vs_hf.py",
                "--model",
                "models/bench-q05",
                "--dtype",
                "bfloat16",
                "--sizes",
                "256x256,64x256",
                "--repeats",
                "1",
            ],
            80,
        ),
        ("tests", ["scripts/bench/gpu_tests.py"], 130),
        ("moe", ["scripts/bench/moe_experts.py"], 45),
        (
            "q15",
            [
                "scripts/bench/grpo_stages.py",
                "--config",
                "configs/bench/grpo_q15.py",
                "--profile-step",
                "0",
                "--build",
                "grpo_q15",
            ],
            120,
        ),  # its model is built inside its own time limit
        (  # 2 GPUs, one rank each; reports itself skipped on a 1-GPU machine
            "sequence_parallel",
            ["scripts/bench/sequence_parallel.py", "--lengths", "16384", "32768", "--sp", "1", "2", "--nproc", "2"],
            60,
        ),
    ]


def run_phase(name: str, cmd: list[str], limit_s: float, out_dir: Path) -> tuple[list[dict], dict]:
    """Run one phase; returns its JSON lines and a status record. Over ``limit_s`` the whole process group is killed."""
    t0 = time.perf_counter()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    log = out_dir / f"{name}.log"
    # The output goes to a file, not a pipe: a phase's leftover children (torch.compile's worker pool) keep a pipe
    # open after the phase itself has exited, and reading it to the end would wait for the time limit.
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [sys.executable, *cmd],
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # SIGKILL: rlspmd would checkpoint on SIGTERM; leftovers too
        except ProcessLookupError:
            pass
        proc.wait()
    output = log.read_text(errors="replace")
    seconds = time.perf_counter() - t0
    lines = []
    for line in output.splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    status = {
        "bench": f"gpu_suite/{name}",
        "command": " ".join(["python", *cmd]),
        "seconds": round(seconds, 2),
        "limit_s": round(limit_s, 1),
        "returncode": proc.returncode,
        "timed_out": timed_out,
    }
    if timed_out or proc.returncode != 0:
        status["output_tail"] = output[-3000:]
    return lines, status


def env_report() -> dict:
    import importlib.util

    import torch

    from rlspmd.models.attn_kernels import kernel_problem

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    kernels = {
        k: kernel_problem(k, device=dev, dtype=torch.bfloat16) or "ok"
        for k in ("varlen", "flex", "flash_attn", "sdpa_loop")
    }
    versions = {}
    for pkg in ("transformers", "trl", "datasets", "tyro", "flash_attn", "triton"):
        versions[pkg] = importlib.import_module(pkg).__version__ if importlib.util.find_spec(pkg) else None
    return {
        "bench": "gpu_suite/env",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "attn_kernels_bf16": kernels,
        "packages": versions,
        "machine": machine(),
    }


def summary(lines: list[dict]) -> dict:
    """Each target with its measured value (None: not measured in this run)."""

    def first(pred):
        return next((x for x in lines if pred(x)), None)

    ours = first(lambda x: x.get("bench") == "grpo_stages" and "q15" not in x.get("config", ""))
    trl = first(lambda x: x.get("bench") == "trl_grpo" and "sec_per_step" in x)
    gens = {
        (x["workload"]["batch"], x["workload"]["new_tokens"]): x for x in lines if x.get("benchmark") == "gen_vs_hf"
    }
    big = max(gens, default=None)
    small = min(gens, default=None)
    values = {
        "grpo_vs_trl": trl["sec_per_step"] / ours["sec_per_step"]
        if ours and trl and ours.get("sec_per_step")
        else None,
        "mfu_update": (ours.get("mfu") or {}).get("update") if ours else None,
        "mfu_ref": (ours.get("mfu") or {}).get("ref") if ours else None,
        "gen_tokens_per_s_256x256": gens[big]["native"]["tokens_per_s"] if big else None,
        "gen_ratio_vs_hf_64x256": gens[small]["ratio"] if small else None,
        "busy_update": ((ours.get("gpu_busy") or {}).get("update") or {}).get("busy_vs_unprofiled") if ours else None,
        "busy_ref": ((ours.get("gpu_busy") or {}).get("ref") or {}).get("busy_vs_unprofiled") if ours else None,
    }
    return {
        "bench": "gpu_suite/summary",
        "targets": {
            k: {"value": v, "target": TARGETS[k], "met": None if v is None else v >= TARGETS[k]}
            for k, v in values.items()
        },
        "gen_sizes": [f"{b}x{t}" for b, t in sorted(gens)],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny versions of every phase (CPU is fine)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or str(ROOT / "outputs" / "gpu_suite"))
    p.add_argument(
        "--budget-s", type=float, default=None, help="total seconds for all phases (default 510; smoke 3600)"
    )
    p.add_argument("--skip", default="", help="comma-separated phases to leave out")
    a = p.parse_args(argv)
    budget = a.budget_s or (3600.0 if a.smoke else 510.0)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sink = open(out_dir / "gpu_suite.jsonl", "w")

    def report(record: dict) -> None:
        emit(record)
        sink.write(json.dumps(record) + "\n")
        sink.flush()

    t0 = time.perf_counter()
    collected: list[dict] = []
    report(env_report())
    skip = set(filter(None, a.skip.split(",")))
    for name, cmd, limit in phases(a.smoke):
        left = budget - (time.perf_counter() - t0)
        if name in skip or left < 20:
            report({"bench": f"gpu_suite/{name}", "skipped": "--skip" if name in skip else "suite time budget spent"})
            continue
        if name == "rlspmd":
            cmd = [*cmd, "--partial", str(out_dir / "rlspmd.partial.json")]
        lines, status = run_phase(name, cmd, min(limit, left), out_dir)
        for line in lines:
            line.setdefault("phase", name)
            report(line)
        collected += lines
        if name == "rlspmd" and status["timed_out"] and (out_dir / "rlspmd.partial.json").is_file():
            partial = json.loads((out_dir / "rlspmd.partial.json").read_text())
            report({**partial, "phase": name, "partial": True})
            collected.append(partial)
        report(status)
        if name == "trl":
            s = summary(collected)["targets"]["grpo_vs_trl"]
            report({"bench": "grpo_vs_trl", "ratio": s["value"], "target": s["target"]})
    result = summary(collected)
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    result["budget_s"] = budget
    report(result)
    sink.close()


if __name__ == "__main__":
    main()
