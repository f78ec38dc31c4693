"""Sequence parallel (``mesh.actor_sp``): SP 2 and SP 4 on 4 CPU ranks against SP 1 on the same ranks and data
(``tests/dist/sp_check.py``).

Two steps of the actor (GRPO advantages, two PPO epochs, k3 KL loss against the reference, entropy bonus,
``token-mean``) and a critic (GAE returns, token-budget micro-batches, ``seq-mean-token-sum-norm``) on 2k-token
responses (the short run: ``seq-mean-token-mean`` and ``seq-mean-token-sum``): every reduced metric
(losses, gradient norms, KL, entropy, clip fractions, value statistics) and the reference log-probs, old log-probs and
values of every row agree within 1e-5 in float32. A shorter run checks the ``allgather`` mode (SP 2 and 4), SP with
tensor parallelism (2 x 2) and with LoRA. Bad settings give errors naming the field.
"""

import dataclasses
import json
import math

import pytest
import torch

from conftest import dist_script, load_script, torchrun
from rlspmd.config import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    MegatronConfig,
    MeshConfig,
    ModelConfig,
    OptimalTokenBaseline,
    TeacherConfig,
)
from rlspmd.distributed.mesh import ParallelDims
from rlspmd.distributed.sequence_parallel import resolve_sp_mode, ulysses_problem
from rlspmd.validate import config_problems, ignored_settings

TOL = 1e-5
STEPS = 2  # the second compares trained weights
RESPONSE = 2048


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny model with room for 2k-token responses (max_position_embeddings 4096)."""
    return load_script("scripts/models/build_tiny.py").build(
        tmp_path_factory.mktemp("tiny4k") / "model", max_position=4096
    )


@pytest.fixture(scope="module")
def long_runs(long_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "long.pt"
    cmd = [dist_script("sp_check.py"), str(out), str(long_model), "sp1,sp2,sp4", "--steps", str(STEPS),
           "--response-len", str(RESPONSE)]  # fmt: skip
    torchrun(cmd, 4, timeout=900)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def short_runs(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "short.pt"
    cases = "sp1,sp2-allgather,sp4-allgather,sp2-tp2,sp1-lora,sp2-lora"
    aggs = ["--actor-agg", "seq-mean-token-mean", "--critic-agg", "seq-mean-token-sum"]
    torchrun(
        [dist_script("sp_check.py"), str(out), str(tiny_model), cases, "--steps", "2", "--response-len", "160", *aggs],
        4,
    )
    return torch.load(out, weights_only=False)


def assert_same(run: dict, base: dict, *, steps: int) -> None:
    assert len(run["metrics"]) == len(base["metrics"]) == steps
    for step, (m, m0) in enumerate(zip(run["metrics"], base["metrics"])):
        assert sorted(m) == sorted(m0)
        for key, value in m0.items():
            assert math.isfinite(value), (step, key)
            assert m[key] == pytest.approx(value, rel=TOL, abs=TOL), f"step {step}: {key} {m[key]} != {value}"
    for key in ("ref_logprobs", "old_logprobs", "values"):
        for step, (x, x0) in enumerate(zip(run[key], base[key])):
            assert x0.abs().sum() > 0
            torch.testing.assert_close(x, x0, rtol=0, atol=TOL, msg=lambda msg: f"step {step} {key}: {msg}")


@pytest.mark.slow
@pytest.mark.dist
def test_sp2_and_sp4_equal_sp1_over_two_grpo_steps_with_2k_responses(long_runs):
    base = long_runs["sp1"]
    assert base["sp_group"] is None and base["mode"] is None
    assert long_runs["sp2"]["sp_group"] == [0, 1] and long_runs["sp4"]["sp_group"] == [0, 1, 2, 3]
    # 4 heads / 2 KV heads: SP 4 spreads each KV head over two ranks (repeated), SP 2 splits them
    assert long_runs["sp2"]["mode"] == long_runs["sp4"]["mode"] == "ulysses"
    m0 = base["metrics"]
    for key in (
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "actor/grad_norm",
        "critic/vf_loss",
        "critic/grad_norm",
    ):
        assert m0[0][key] != m0[-1][key], key  # the steps moved the models: later steps compare trained weights
    # clipping (actor 0.1, critic 0.02) was active on every step: the clip scale is compared too
    assert min(m["actor/grad_norm"] for m in m0) > 0.1 and min(m["critic/grad_norm"] for m in m0) > 0.02
    assert max(m["actor/clip_frac"] for m in m0) > 0  # the second PPO epoch moved the ratio off 1
    assert m0[-1]["actor/kl_loss"] > 0
    assert base["ref_logprobs"][0].shape[1] == RESPONSE
    for case in ("sp2", "sp4"):
        assert_same(long_runs[case], base, steps=STEPS)


@pytest.mark.slow
@pytest.mark.dist
def test_allgather_mode_tensor_parallel_and_lora_compose(short_runs):
    base = short_runs["sp1"]
    assert short_runs["sp2-allgather"]["mode"] == short_runs["sp4-allgather"]["mode"] == "allgather"
    assert_same(short_runs["sp2-allgather"], base, steps=2)
    assert_same(short_runs["sp4-allgather"], base, steps=2)
    # tp fastest: ranks {0, 1} and {2, 3} are TP groups, {0, 2} and {1, 3} SP groups; 4 heads over tp 2 x sp 2
    assert short_runs["sp2-tp2"]["sp_group"] == [0, 2] and short_runs["sp2-tp2"]["mode"] == "ulysses"
    assert_same(short_runs["sp2-tp2"], base, steps=2)
    assert_same(short_runs["sp2-lora"], short_runs["sp1-lora"], steps=2)
    lora, full = short_runs["sp1-lora"]["metrics"][-1], base["metrics"][-1]
    assert lora["actor/grad_norm"] != pytest.approx(full["actor/grad_norm"])  # LoRA really trained adapters only


def test_sp_modes_follow_the_heads():
    assert ulysses_problem(heads=4, kv_heads=2, sp=2) is None
    assert ulysses_problem(heads=4, kv_heads=2, sp=4) is None  # KV heads repeated twice
    assert resolve_sp_mode("auto", heads=4, kv_heads=2, sp=4) == "ulysses"
    assert resolve_sp_mode("auto", heads=4, kv_heads=2, sp=2, tp=2) == "ulysses"
    # SmolLM2-135M: 9 heads, 3 KV heads: Ulysses cannot split them, all-gather KV can
    assert resolve_sp_mode("auto", heads=9, kv_heads=3, sp=2) == "allgather"
    assert resolve_sp_mode("allgather", heads=4, kv_heads=2, sp=2) == "allgather"
    with pytest.raises(
        ValueError, match=r"actor_sp_mode='ulysses': the 9 attention heads do not divide by mesh.actor_sp=2"
    ):
        resolve_sp_mode("ulysses", heads=9, kv_heads=3, sp=2)
    with pytest.raises(ValueError, match=r"the 2 attention heads per TP rank do not divide by mesh.actor_sp=4"):
        resolve_sp_mode("ulysses", heads=4, kv_heads=2, sp=4, tp=2)


def test_bad_actor_sp_names_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"mesh.actor_sp=3 \(times mesh.actor_tp=1\) must divide the actor's 4 ranks"):
        ParallelDims.from_config(MeshConfig(actor_sp=3), 4)
    with pytest.raises(ValueError, match=r"mesh.actor_sp=2 \(times mesh.actor_tp=4\) must divide the actor's 4 ranks"):
        ParallelDims.from_config(MeshConfig(actor_sp=2, actor_tp=4), 4)
    with pytest.raises(ValueError, match=r"mesh.actor_sp=2 and mesh.actor_ep=2: sequence and expert parallelism"):
        ParallelDims.from_config(MeshConfig(actor_sp=2, actor_ep=2), 4)
    assert "sequences split over sp=2" in ParallelDims.from_config(MeshConfig(actor_sp=2), 4).layout()

    def problems(model_type: str, heads: int, kv: int, **mesh) -> list[str]:
        model = tmp_path / f"{model_type}-{heads}-{kv}"
        model.mkdir(exist_ok=True)
        config = {"model_type": model_type, "num_attention_heads": heads, "num_key_value_heads": kv}
        (model / "config.json").write_text(json.dumps(config))
        cfg = Config()
        actor = dataclasses.replace(cfg.actor, model=ModelConfig(path=str(model)))
        lines = config_problems(dataclasses.replace(cfg, mesh=MeshConfig(**mesh), actor=actor), world_size=4)
        return [line for line in lines if line.startswith("mesh.actor_sp")]

    assert problems("qwen2", 4, 2, actor_sp=2) == []
    assert problems("llama", 9, 3, actor_sp=2) == []  # auto: allgather
    (line,) = problems("llama", 9, 3, actor_sp=2, actor_sp_mode="ulysses")
    assert line.startswith("mesh.actor_sp_mode='ulysses': actor.model.path=") and "9 attention heads" in line, line
    (line,) = problems("qwen3_moe", 4, 2, actor_sp=2)
    assert line.startswith("mesh.actor_sp=2: does not run mixture-of-experts models yet"), line
    (line,) = problems("qwen2_vl", 4, 2, actor_sp=2)
    assert "vision-language" in line, line

    cfg = dataclasses.replace(Config(), mesh=MeshConfig(actor_sp=2))
    for actor, expected in (
        (ActorConfig(engine=MegatronConfig()), "mesh.actor_sp=2: is the fsdp engine's sequence parallelism"),
        (ActorConfig(model=ModelConfig(packing=False)), "mesh.actor_sp=2: splits packed sequences"),
        (ActorConfig(model=ModelConfig(attn_implementation="eager")), "mesh.actor_sp=2: splits packed sequences"),
    ):
        lines = config_problems(dataclasses.replace(cfg, actor=actor), world_size=4, check_files=False)
        assert any(line.startswith(expected) for line in lines), lines
    # what SP does not compute (the vocabulary outputs): a teacher role, OTB's sum of squared probabilities
    teacher = dataclasses.replace(cfg, teacher=TeacherConfig(model_path=str(tmp_path / "qwen2-4-2")))
    lines = config_problems(teacher, world_size=4, check_files=False)
    assert any(line.startswith("teacher.model_path=") and "mesh.actor_sp=2" in line for line in lines), lines
    otb = dataclasses.replace(cfg, algorithm=AlgorithmConfig(adv_estimator=OptimalTokenBaseline()))
    lines = config_problems(otb, world_size=4, check_files=False)
    assert any(line.startswith("algorithm.adv_estimator=") and "mesh.actor_sp=2" in line for line in lines), lines
    assert ignored_settings(dataclasses.replace(Config(), mesh=MeshConfig(actor_sp_mode="allgather"))) == [
        "mesh.actor_sp_mode is set but mesh.actor_sp=1 (no sequence parallelism)"
    ]
