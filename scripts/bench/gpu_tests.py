"""The ``gpu``-marked tests of the CUDA paths (packed-attention kernels, CUDA-graph decoding, stage timing, MoE grouped
GEMM, the distillation kernels, megatron at TP=PP=1 against FSDP, vLLM on CUDA where installed), as one JSON line, so
that the GPU suite checks correctness in the same run that measures speed.

    python scripts/bench/gpu_tests.py          # pytest -m gpu on the files below; where pytest is absent, says so

Without CUDA every selected test is skipped (with its reason), which is what a CPU smoke run shows.
"""

from __future__ import annotations

import importlib.util
import sys

from common import ROOT, emit

FILES = [
    "tests/test_packing.py",
    "tests/test_native_engine.py",
    "tests/test_timing.py",
    "tests/test_moe.py",
    "tests/test_distill_algorithms.py",
    "tests/test_vision.py",
    "tests/test_megatron_engine.py",
    "tests/test_vllm_gpu.py",
]


def main() -> None:
    if importlib.util.find_spec("pytest") is None:
        emit({"bench": "gpu_tests", "skipped": "pytest is not installed", "files": FILES})
        return
    import pytest

    class Outcomes:
        def __init__(self):
            self.counts = {"passed": 0, "failed": 0, "skipped": 0}
            self.failed: list[str] = []

        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                self.counts[report.outcome] = self.counts.get(report.outcome, 0) + 1
                if report.outcome == "failed":
                    self.failed.append(report.nodeid)

    outcomes = Outcomes()
    rc = pytest.main(
        ["-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *[str(ROOT / f) for f in FILES]],
        plugins=[outcomes],
    )
    emit(
        {
            "bench": "gpu_tests",
            "returncode": int(rc),
            **outcomes.counts,
            "failed_tests": outcomes.failed,
            "files": FILES,
        }
    )
    sys.exit(0 if int(rc) in (0, 5) else 1)  # 5: nothing collected


if __name__ == "__main__":
    main()
