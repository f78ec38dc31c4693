"""vLLM on a GPU (torchrun, NCCL): what only CUDA has. Sleep/wake memory accounting via ``torch.cuda.mem_get_info``
(sleep mode is a CUDA allocator feature), CUDA graphs kept valid across weight reloads, no memory drift over repeated
cycles, LoRA merges and TP=2 over two GPUs. Parity, log-probs, updates, the agent loop and resume run on every
device in ``tests/test_vllm_cpu.py`` (CPU in CI).

Skipped where CUDA or vLLM is absent (the development machines have no GPU, so these have not been run). On a GPU
box: ``pip install -e ".[vllm]"`` and ``python -m pytest -m vllm``.
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
