"""Shared helpers of the benchmark scripts: machine description, repeated timing, JSON output.

Timings on a shared machine are noisy, so every figure is a median over repeats, reported both as wall-clock
seconds and as this process's CPU seconds (``time.process_time``, all threads), and the JSON records the load
average before and after. Compare ratios taken in the same run; re-run on a quiet machine for final numbers.
"""

from __future__ import annotations

import json
import os
import statistics
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
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times; medians and all samples of wall and CPU seconds."""
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


def ensure_model(path: str | None, *, preset: str) -> str:
    """``path`` if given, else build the named benchmark model (deterministic) under ``models/`` once and reuse it."""
    if path:
        return path
    sys.path.insert(0, str(ROOT / "scripts" / "models"))
    import build_tiny

    presets = {
        "bench-tiny": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_size=512),
        "bench-256": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=688, vocab_size=8192),
        "bench-512": dict(hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=4, intermediate_size=1376, vocab_size=8192),
    }
    out = ROOT / "models" / preset
    if not (out / "model.safetensors").is_file():
        build_tiny.build(out, **presets[preset])
    return str(out)
