"""Stage timing: device-synchronised seconds and per-stage peak memory of nested stages."""

import time

import pytest
import torch

from rlspmd.trainer.timing import StageProbe, device_synchronize


def test_stage_probe_times_nested_and_repeated_stages_on_cpu():
    probe = StageProbe(torch.device("cpu"))
    with probe("step"):
        for _ in range(2):
            with probe("gen"):
                time.sleep(0.02)
        with probe("update"):
            time.sleep(0.01)
    s = probe.seconds
    assert s["gen"] >= 0.04 and s["update"] >= 0.01 and s["step"] >= s["gen"] + s["update"]
    assert probe.peak_bytes == {}  # no device memory to report on CPU
    assert set(probe.metrics()) == {"timing/step", "timing/gen", "timing/update"}
    device_synchronize(torch.device("cpu"))  # a no-op there


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stage_probe_peak_memory_of_nested_stages_on_cuda():
    """Each stage reports its own peak: the outer stage sees the largest inner peak even though the allocator's
    counter was reset for each inner stage; and the clock waits for queued kernels."""
    dev = torch.device("cuda")
    probe = StageProbe(dev)
    MiB = 2**20
    base = torch.cuda.memory_allocated(dev)
    with probe("step"):
        with probe("big"):
            x = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
            del x
        with probe("small"):
            y = torch.empty(16 * MiB, dtype=torch.uint8, device=dev)
            del y
        with probe("matmul"):
            a = torch.randn(4096, 4096, device=dev)
            for _ in range(20):
                a = a @ a / 64
    assert probe.peak_bytes["big"] - base >= 256 * MiB
    assert 16 * MiB <= probe.peak_bytes["small"] - base < 256 * MiB
    assert probe.peak_bytes["step"] >= probe.peak_bytes["big"]
    t0 = time.perf_counter()
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < probe.seconds["matmul"]  # the matmuls had finished inside their stage
