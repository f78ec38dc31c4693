"""vLLM on a GPU (torchrun, NCCL): greedy parity with the trainer's numerics, sleep/wake memory accounting via
``torch.cuda.mem_get_info``, weight-update effectiveness, no memory drift over repeated cycles.

Skipped where CUDA or vLLM is absent (every development machine of this project so far: the vLLM path was
written against vLLM 0.32.0 and has not been run). On a GPU box: ``pip install -e ".[vllm]"`` and
``python -m pytest -m vllm``.
"""

import importlib.util

import pytest
import torch

from conftest import dist_script, torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'rlspmd[vllm]')"),
]


def test_vllm_colocated_parity_memory_and_updates(tiny_model):
    proc = torchrun([dist_script("vllm_gpu_check.py"), str(tiny_model)], 1, timeout=1200)
    assert "VLLM GPU OK" in proc.stdout, proc.stdout[-3000:]


def test_vllm_receives_merged_lora_weights(tiny_model):
    """A LoRA actor: vLLM generates from the merged weights (the trainer's LoRA log-probs of its tokens agree)."""
    proc = torchrun([dist_script("vllm_gpu_check.py"), str(tiny_model), "--lora"], 1, timeout=1200)
    assert "VLLM GPU OK" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_vllm_tp2_ranks_agree(tiny_model):
    proc = torchrun([dist_script("vllm_gpu_check.py"), str(tiny_model), "--tp", "2"], 2, timeout=1200)
    assert "VLLM GPU OK" in proc.stdout, proc.stdout[-3000:]


def test_vllm_serves_the_agent_loop(tiny_tools_model, tmp_path):
    """Multi-turn rollouts on vLLM: each turn a request of its own on vLLM's running engine (``VllmEngine.serve``)."""
    from conftest import load_script

    load_script("scripts/data/agent_arithmetic.py").main(["--out-dir", str(tmp_path), "--num-train", "20", "--num-test", "10",
                                                          "--num-sft", "0"])
    proc = torchrun([dist_script("vllm_agent_check.py"), str(tiny_tools_model), str(tmp_path / "test.parquet")], 1, timeout=1200)
    assert "VLLM AGENT OK" in proc.stdout, proc.stdout[-3000:]
