"""What the python tool's isolation costs per call: ``run_python`` on a trivial program, the old audit-hook runner
(``audit-hook-unsafe``) against bubblewrap (``bwrap``, the default), in the same run.

    python scripts/bench/sandbox_calls.py                  # 40 calls per mode, one at a time and 4 at once
    python scripts/bench/sandbox_calls.py --calls 200 --threads 1 4 16

Modes alternate in blocks of ten calls so that a load change on a shared machine hits both alike. Each call runs
``print(6 * 7)`` and its output is checked; ``bare`` is the floor, the same interpreter (``-I -S``) started with no
isolation. Sequential: the median wall time of one call and its inverse, calls per
second; concurrent: calls per second with N threads calling at once (the agent loop runs up to
``rollout.agent.max_parallel_tools`` tool calls at once). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from common import emit

from rlspmd.agent.sandbox import check_sandbox, interpreter, run_python

LIMITS = dict(timeout_s=30.0, memory_mb=512, cpu_s=5, max_output_chars=2000)
CODE = "print(6 * 7)"


def one(mode: str) -> float:
    t0 = time.perf_counter()
    if mode == "bare":  # the floor: the same interpreter started with no isolation at all
        out = subprocess.run([interpreter().executable, "-I", "-S", "-c", CODE], capture_output=True, text=True).stdout
    else:
        out = run_python(CODE, **LIMITS, sandbox=mode).output
    assert out.strip() == "42", (mode, out)  # the call really ran the program
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=40, help="sequential calls per mode")
    p.add_argument("--threads", type=int, nargs="+", default=[4], help="concurrency levels to measure")
    args = p.parse_args(argv)

    modes = ("bare", "audit-hook-unsafe", "bwrap")
    for mode in modes:
        if mode != "bare":
            check_sandbox(mode)
        one(mode)  # warm-up: the bwrap probe, the unshare check, page cache
    seconds = {m: [] for m in modes}
    for _ in range(max(1, args.calls // 10)):
        for mode in modes:
            seconds[mode] += [one(mode) for _ in range(10)]
    out = {}
    for mode in modes:
        med = statistics.median(seconds[mode])
        out[mode] = {
            "calls": len(seconds[mode]),
            "ms_per_call_median": round(1000 * med, 1),
            "ms_per_call_p90": round(1000 * statistics.quantiles(seconds[mode], n=10)[-1], 1),
            "calls_per_s": round(1 / med, 2),
        }
    for n in args.threads:
        for mode in modes:
            calls = max(n * 4, 20)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda _: one(mode), range(calls)))
            out[mode][f"calls_per_s_{n}_threads"] = round(calls / (time.perf_counter() - t0), 2)
    out["bwrap_over_audit_hook_ms"] = round(
        out["bwrap"]["ms_per_call_median"] - out["audit-hook-unsafe"]["ms_per_call_median"], 1
    )
    emit({"benchmark": "sandbox_calls", "program": CODE, **out})


if __name__ == "__main__":
    main()
