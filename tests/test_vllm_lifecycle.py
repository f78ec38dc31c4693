"""The vLLM engine's lifecycle and per-step sequence, against a recording stand-in for vLLM's backend: it models what
the real engine only shows on CUDA (CPU has no sleep mode; ``tests/test_vllm_cpu.py`` runs the real engine).

The stand-in models what matters for correctness: a level-2 sleep turns the weights into garbage, a forward pass
needs both the weights and the KV cache awake, and prefix-cache entries go stale when the weights change.
"""

import os

import pytest
import torch

from rlspmd.config import RolloutConfig
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.roles.rollout import Rollout
from rlspmd.rollout.lifecycle import Lifecycle, LifecycleError, State
from rlspmd.rollout.sampling import SamplingParams
from rlspmd.rollout.vllm import VllmEngine


class RecordingBackend:
    """Same methods as ``third_party.vllm_adapter.VllmBackend``. Its 'model' emits token ``sum(weights) mod 97``."""

    def __init__(self, *, asleep: bool):
        self.calls: list[tuple] = []
        self.awake = set() if asleep else {"weights", "kv_cache"}
        self.weights: dict | None = None
        self.stale_cache = False

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))
        self.awake |= set(tags)

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.awake = set()
        if level == 2:
            self.weights = None  # discarded: garbage after the next wake

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        self.stale_cache = False

    def load_weights(self, weights, *, check_coverage):
        assert "weights" in self.awake, "loading into unmapped weight memory"
        self.weights = {name: t.clone() for name, t in weights}
        self.stale_cache = True
        self.calls.append(("load_weights", tuple(self.weights)))
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    def generate(self, token_ids, *, params, seeds, stop_token_ids):
        assert self.awake == {"weights", "kv_cache"}, f"forward pass with only {self.awake} awake"
        assert self.weights is not None and not self.stale_cache
        self.calls.append(("generate", len(token_ids), None if seeds is None else tuple(seeds)))
        tok = int(sum(float(t.sum()) for t in self.weights.values())) % 97
        return [([tok] * 3, [-0.5] * 3) for _ in token_ids]


class FakeSource:
    """A weight source like ``StreamedWeights``: a fixed little 'model' the test can change."""

    in_place = False

    def __init__(self):
        self.tensors = {"model.embed_tokens.weight": torch.ones(4, 2), "model.norm.weight": torch.ones(2)}

    def stream(self):
        return iter(list(self.tensors.items()))

    def stats(self):
        return {"weight_sync/gathered_bytes": 0.0}


def prompts(n=2) -> Batch:
    return Batch(
        {
            "prompts_BP": torch.tensor([[0, 5, 6], [7, 8, 9]])[:n],
            "prompt_mask_BP": torch.tensor([[0, 1, 1], [1, 1, 1]])[:n],
        }
    )


def names(calls):
    return [c[0] if c[0] not in ("wake_up", "sleep") else f"{c[0]}{c[1]}" for c in calls]


def colocated(mesh, *, sleep_level=2):
    backend = RecordingBackend(asleep=True)
    engine = VllmEngine(
        backend, sleeps=True, sleep_level=sleep_level, eos_ids=[1], pad_id=0, device=torch.device("cpu")
    )
    role = Rollout(
        RolloutConfig(n=2, max_response_length=3),
        engine=engine,
        weights=FakeSource(),
        mesh=mesh,
        seed=0,
        device=torch.device("cpu"),
    )
    return backend, engine, role


def test_per_step_sequence_colocated(mesh_of_one):
    backend, engine, role = colocated(mesh_of_one)
    role.sync_weights(MetricBuffer())  # the step's weight-sync stage
    assert names(backend.calls) == ["wake_up('weights',)", "load_weights", "reset_prefix_cache"]
    assert engine.lifecycle.state is State.WEIGHTS_READY
    backend.calls.clear()
    out = role.generate(prompts(), step=1)
    assert names(backend.calls) == ["wake_up('kv_cache',)", "generate", "reset_prefix_cache", "sleep2"]
    assert engine.lifecycle.state is State.ASLEEP and not engine.holds_weights
    assert out["responses_BR"].shape == (4, 3) and out["response_mask_BR"].sum() == 12  # n=2 samples per prompt
    # a second generation in the same step (validation, another round) finds the weights dropped: re-stream first
    backend.calls.clear()
    role.generate_validation(prompts(), step=1)
    assert names(backend.calls) == [
        "wake_up('weights',)",
        "load_weights",
        "reset_prefix_cache",
        "wake_up('kv_cache',)",
        "generate",
        "reset_prefix_cache",
        "sleep2",
    ]
    buffer = MetricBuffer()
    role.sync_weights(buffer)
    metrics = buffer.reduce(mesh=None)
    for key in (
        "timing/rollout/weight_sync",
        "weight_sync/loaded_bytes",
        "timing/rollout/wake",
        "timing/rollout/sleep",
        "timing/rollout/gen",
        "throughput/rollout/gen_tokens_per_s",
    ):
        assert key in metrics, key
    assert metrics["weight_sync/loaded_bytes"] == (8 + 2) * 4


def test_first_generate_syncs_and_level1_keeps_weights(mesh_of_one):
    backend, engine, role = colocated(mesh_of_one, sleep_level=1)
    role.generate(prompts(), step=1)  # never synced: the dummy weights must be replaced first (P1)
    assert names(backend.calls)[:3] == ["wake_up('weights',)", "load_weights", "reset_prefix_cache"]
    assert engine.holds_weights  # level 1: a CPU copy survives
    backend.calls.clear()
    role.generate(prompts(), step=2)  # no re-stream: wake the kept weights, then the KV cache
    assert names(backend.calls) == [
        "wake_up('weights',)",
        "wake_up('kv_cache',)",
        "generate",
        "reset_prefix_cache",
        "sleep1",
    ]


def test_update_changes_outputs(mesh_of_one):
    backend, engine, role = colocated(mesh_of_one)
    role.sync_weights(MetricBuffer())
    before = role.generate(prompts(), step=1)["responses_BR"]
    role.weights.tensors["model.norm.weight"] = torch.full((2,), 3.0)  # the actor moved
    role.sync_weights(MetricBuffer())
    after = role.generate(prompts(), step=2)["responses_BR"]
    assert not torch.equal(before, after)


def test_lifecycle_refuses_illegal_transitions():
    lc = Lifecycle()
    with pytest.raises(LifecycleError, match="asleep"):
        lc.apply("generate")  # generate while asleep
    lc.apply("wake_weights")
    with pytest.raises(LifecycleError, match="between the weights wake and the KV-cache wake"):
        lc.apply("generate")
    with pytest.raises(LifecycleError, match="level-2 sleep leaves garbage"):
        lc.apply("wake_kv")  # KV wake with the weights never loaded
    lc.apply("load")
    with pytest.raises(LifecycleError, match="prefix cache was not reset"):
        lc.apply("wake_kv")  # a sync without a prefix reset
    with pytest.raises(LifecycleError, match="prefix cache was not reset"):
        lc.apply("generate")
    lc.apply("reset_prefix")
    with pytest.raises(LifecycleError, match="between the weights wake and the KV-cache wake"):
        lc.apply("generate")
    lc.apply("wake_kv")
    lc.apply("generate")
    lc.apply("load")  # reloaded while awake: stale until reset
    with pytest.raises(LifecycleError, match="prefix cache was not reset"):
        lc.apply("generate")
    lc.apply("reset_prefix")
    lc.apply("generate")
    lc.sleep(2)
    assert not lc.holds_weights
    with pytest.raises(LifecycleError, match="wake the weights first"):
        lc.apply("load")


def test_engine_refuses_before_reaching_vllm():
    backend = RecordingBackend(asleep=True)
    engine = VllmEngine(backend, sleeps=True, sleep_level=2, eos_ids=[1], pad_id=0, device=torch.device("cpu"))
    with pytest.raises(LifecycleError):
        engine.generate(prompts(), SamplingParams(temperature=0.0, max_new_tokens=3), generator=None)
    with pytest.raises(LifecycleError):
        engine.wake()  # KV wake with no weights loaded
    assert backend.calls == []


def test_split_engine_never_sleeps():
    backend = RecordingBackend(asleep=False)
    engine = VllmEngine(backend, sleeps=False, sleep_level=2, eos_ids=[1], pad_id=0, device=torch.device("cpu"))
    params = SamplingParams(temperature=0.0, max_new_tokens=3)
    engine.update_weights(FakeSource().stream())
    engine.wake()
    engine.generate(prompts(), params, generator=None)
    engine.sleep()
    engine.update_weights(FakeSource().stream())  # while awake: READY -> STALE -> (reset) -> READY
    engine.generate(prompts(), params, generator=None)
    assert names(backend.calls) == [
        "load_weights",
        "reset_prefix_cache",
        "generate",
        "load_weights",
        "reset_prefix_cache",
        "generate",
    ]


def test_per_request_seeds_follow_the_generator():
    """Ranks of a TP group (same generator seed) send the same per-request seeds; other groups differ; greedy none."""

    def seeds(gen_seed, params):
        backend = RecordingBackend(asleep=False)
        engine = VllmEngine(backend, sleeps=False, sleep_level=2, eos_ids=[1], pad_id=0, device=torch.device("cpu"))
        engine.update_weights(FakeSource().stream())
        engine.wake()
        out = engine.generate(prompts(), params, generator=torch.Generator().manual_seed(gen_seed))
        assert out["responses_BR"].shape[0] == 2 * params.n and out["response_mask_BR"].sum() == 3 * 2 * params.n
        return backend.calls[-1][2]

    sample = SamplingParams(temperature=1.0, max_new_tokens=3, n=2)
    assert seeds(1, sample) == seeds(1, sample)
    assert seeds(1, sample) != seeds(2, sample) and len(set(seeds(1, sample))) == 4
    assert seeds(1, SamplingParams(temperature=0.0, max_new_tokens=3)) is None


def test_adapter_environment_and_missing_vllm(monkeypatch):
    from third_party import vllm_adapter

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ValueError, match="expandable_segments"):
        vllm_adapter.prepare_environment()
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    vllm_adapter.prepare_environment()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["NCCL_CUMEM_ENABLE"] == "0"
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"rlspmd\[vllm\]"):
            vllm_adapter.VllmBackend(
                "models/tiny",
                tensor_parallel_size=1,
                seed=0,
                dtype=torch.bfloat16,
                max_model_len=64,
                gpu_memory_utilization=0.5,
                kv_cache_memory_bytes=None,
                max_num_seqs=8,
                enforce_eager=True,
                enable_prefix_caching=True,
                sleeps=True,
            )
