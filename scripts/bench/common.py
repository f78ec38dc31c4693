"""Shared helpers of the benchmark scripts: machine description, repeated timing, JSON output.

Timings on a shared machine are noisy, so every figure is a median over repeats, reported both as wall-clock
seconds and as this process's CPU seconds (``time.process_time``, all threads), and the JSON records the load
average before and after. Compare ratios taken in the same run; re-run on a quiet machine for final numbers.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without installing rlspmd
    sys.path.insert(0, str(ROOT))


def machine() -> dict:
    from rlspmd.distributed.runtime import machine_info

    return machine_info()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> dict:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times; medians and all samples of wall and CPU seconds, and
    the fastest repeat (``wall_s_min``: a machine's peak rates are read from it)."""
    for _ in range(warmup):
        fn()
    sync()
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        sync()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return {
        "wall_s_median": statistics.median(wall),
        "wall_s_min": min(wall),
        "cpu_s_median": statistics.median(cpu),
        "wall_s": [round(x, 4) for x in wall],
        "cpu_s": [round(x, 4) for x in cpu],
    }


def emit(result: dict, out: str | None = None) -> None:
    """Print the result as one JSON line (the last line of the output) and optionally write it to a file."""
    result.setdefault("machine", machine())
    result["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(result)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(text, flush=True)


def last_json(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd`` from the repository root; its last stdout line, parsed as JSON (a trainer run with
    ``trainer.print_summary_json`` ends with its summary there). A failed run exits with its output."""
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_quickstart(args, out: Path, extra: list[str], *, what: str) -> tuple[str, list[dict], dict]:
    """One ``configs/quickstart.py`` run on 2 local ranks (torchrun, one thread each, jsonl metrics, no checkpoints)
    from ``args.model`` / ``args.data`` with ``args.val_samples`` validation prompts, ``extra`` overrides on top.
    Returns its stdout, its ``metrics.jsonl`` rows and its ``summary.json``; a failed run exits naming ``what``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "rlspmd.train",
        "--config",
        "configs/quickstart.py",
        "--actor.model.path",
        args.model,
        "--data.train-files",
        str(Path(args.data) / "train.parquet"),
        "--data.val-files",
        str(Path(args.data) / "test.parquet"),
        "--data.max-val-samples",
        str(args.val_samples),
        "--trainer.output-dir",
        str(out),
        "--trainer.loggers",
        "jsonl",
        "--checkpoint.save-every",
        "0",
        "--checkpoint.no-save-final",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run {what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc.stdout, rows, json.loads((out / "summary.json").read_text())


def ensure_model(path: str | None, *, preset: str) -> str:
    """``path`` if given, else build the named benchmark model (deterministic) under ``models/`` once and reuse it."""
    if path:
        return path
    sys.path.insert(0, str(ROOT / "scripts" / "models"))
    import build_tiny

    presets = {
        "bench-tiny": dict(
            hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_size=512
        ),
        "bench-256": dict(
            hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=688, vocab_size=8192
        ),
        "bench-512": dict(
            hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=4, intermediate_size=1376, vocab_size=8192
        ),
        # GPU workloads: Qwen2.5-0.5B's and Qwen2.5-1.5B's bodies (tied embeddings) with the bench vocabulary
        "bench-q05": dict(
            hidden_size=896,
            num_layers=24,
            num_heads=14,
            num_kv_heads=2,
            intermediate_size=4864,
            vocab_size=8192,
            max_position=1024,
        ),
        "bench-q15": dict(
            hidden_size=1536,
            num_layers=28,
            num_heads=12,
            num_kv_heads=2,
            intermediate_size=8960,
            vocab_size=8192,
            max_position=1024,
        ),
    }
    out = ROOT / "models" / preset
    if not (out / "model.safetensors").is_file():
        build_tiny.build(out, **presets[preset])
    return str(out)


DENSE_BF16_TFLOPS = (  # (substring of torch.cuda.get_device_name(), dense bf16 tensor TFLOP/s), most specific first
    ("GH200", 989.4),
    ("H200 NVL", 835.0),
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)
"""NVIDIA's datasheet peaks without sparsity (H100/H200 SXM: 989.4). MFU is measured against these."""


def dense_bf16_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name, None for one not in ``DENSE_BF16_TFLOPS``."""
    return next((tflops for key, tflops in DENSE_BF16_TFLOPS if key in device_name), None)


def top_kernels(prof, n: int = 12) -> list[dict]:
    """The ``n`` CUDA kernels (or copies) with the most device time in a ``torch.profiler.profile``: name (cut to 80
    characters), total milliseconds and calls: where a stage's GPU time goes."""
    from torch.autograd import DeviceType

    totals: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            t = totals.setdefault(e.name[:80], [0.0, 0])
            t[0] += (e.time_range.end - e.time_range.start) / 1e3
            t[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"kernel": k, "ms": round(ms, 3), "calls": c} for k, (ms, c) in ranked]


def top_cpu_ops(prof, n: int = 15) -> list[dict]:
    """The ``n`` operators with the most self CPU time in a ``torch.profiler.profile`` (on a CPU, where a stage's time
    goes): name (cut to 80 characters), total milliseconds and calls."""
    ranked = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n]
    return [{"op": e.key[:80], "ms": round(e.self_cpu_time_total / 1e3, 2), "calls": e.count} for e in ranked]


def kernel_busy_seconds(prof) -> float:
    """Seconds during which at least one CUDA kernel (or copy) ran, from a ``torch.profiler.profile``: the union of
    the device events' intervals, so overlapping streams are not counted twice."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy_us, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop <= end:
            continue
        busy_us += stop - max(start, end)
        end = stop
    return busy_us / 1e6
