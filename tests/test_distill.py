"""On-policy distillation's teacher: the policy module's vocabulary outputs and JSD against transformers, and the
start-up checks (a teacher with another tokenizer is named before any weights load; pure distillation needs no
reward but a teacher; the signals' engine and layout needs). Training runs: tests/test_distill_training.py."""

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from conftest import load_script
from rlspmd.algorithms import generalized_jsd
from rlspmd.config import (
    GKD,
    ActorConfig,
    AlgorithmConfig,
    Config,
    DataConfig,
    MegatronConfig,
    MeshConfig,
    ModelConfig,
    NoAdvantage,
    OptimalTokenBaseline,
    RewardConfig,
    ReverseKL,
    RolloutCorrectionConfig,
    TeacherConfig,
)
from rlspmd.models.logprobs import JSDTarget
from rlspmd.validate import ConfigError, check_config, config_problems, ignored_settings
from test_packing import load, rollout_layout


@pytest.mark.parametrize("packing", [False, True])
def test_policy_module_vocabulary_outputs_and_jsd_equal_transformers(tiny_model, packing):
    student = load(tiny_model, packing)
    P, R = 6, 5
    ids, am, pos, rm = rollout_layout(student.config.vocab_size, [6, 3, 4], [5, 2, 4], P, R)
    with torch.no_grad():
        logits = student.hf(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, P - 1 : -1].float()
    full = torch.log_softmax(logits / 0.8, dim=-1)  # (B, R, V)
    valid = rm.bool()
    lp, ent, out = student(ids, am, pos, response_len=R, temperature=0.8, extras=("sum_p2", "argmax", "vocab_logprobs"))
    vocab = out["vocab_logprobs"]
    # packed: the valid response tokens row by row; padded: every (B, R) position
    assert_close(vocab, full[valid] if packing else full.reshape(-1, full.shape[-1]), rtol=1e-4, atol=1e-5)
    assert_close(out["sum_p2"][valid], full.exp().square().sum(-1)[valid], rtol=1e-4, atol=1e-6)
    targets = ids[:, P:]
    assert torch.equal(out["argmax"][valid], (full.argmax(-1) == targets).float()[valid])

    # GKD: the JSD against a "teacher" (the student's distribution at another temperature) equals the reference on
    # transformers' logits, and against its own distribution it is 0
    teacher = torch.log_softmax(logits / 1.7, dim=-1)
    target = teacher[valid] if packing else teacher.reshape(-1, teacher.shape[-1])
    _, _, out = student(ids, am, pos, response_len=R, jsd=JSDTarget(target, beta=0.5, temperature=1.0))
    want = generalized_jsd(logits, logits / 1.7, beta=0.5)
    assert_close(out["jsd"][valid], want[valid], rtol=1e-4, atol=1e-6)
    own = torch.log_softmax(logits, dim=-1)
    _, _, out = student(
        ids,
        am,
        pos,
        response_len=R,
        jsd=JSDTarget(own[valid] if packing else own.reshape(-1, own.shape[-1]), beta=1.0, temperature=1.0),
    )
    assert out["jsd"][valid].abs().max() < 1e-5
    out["jsd"].sum().backward()  # differentiable into the student
    assert student.hf.get_output_embeddings().weight.grad is not None
    # without extras: the usual two outputs
    assert len(student(ids, am, pos, response_len=R)) == 2


def distill_config(student, teacher_path, data, **kw) -> Config:
    cfg = Config(
        actor=ActorConfig(model=ModelConfig(path=str(student)), mini_batch_size=2, micro_batch_size=2),
        data=DataConfig(
            train_files=[str(data / "train.parquet")], val_files=[str(data / "test.parquet")], train_batch_size=2
        ),
        teacher=TeacherConfig(model_path=str(teacher_path)),
    )
    return dataclasses.replace(cfg, **kw)


def test_a_teacher_with_another_tokenizer_is_named_before_anything_loads(tiny_model, arithmetic_data, tmp_path):
    other = load_script("scripts/models/build_tiny.py").build(tmp_path / "other", vocab_size=320)
    with pytest.raises(ConfigError) as e:
        check_config(distill_config(tiny_model, other, arithmetic_data), world_size=2)
    msg = str(e.value)
    assert "nothing was loaded" in msg
    assert f"teacher.model_path: the tokenizer in {other}" in msg and f"actor.model.path={tiny_model}" in msg
    assert "the teacher scores the student's token ids" in msg.lower()
    # the same tokenizer in another directory (another model: more layers, another seed) passes
    same = load_script("scripts/models/build_tiny.py").build(tmp_path / "same", num_layers=2, seed=3)
    assert config_problems(distill_config(tiny_model, same, arithmetic_data), world_size=2) == []


def test_pure_distillation_needs_a_teacher_and_no_reward(tiny_model, arithmetic_data):
    no_reward = dict(algorithm=AlgorithmConfig(adv_estimator=NoAdvantage()), reward=RewardConfig(rule_weight=0.0))
    cfg = distill_config(tiny_model, tiny_model, arithmetic_data, **no_reward)
    assert config_problems(cfg, world_size=2) == []  # no reward at all: allowed
    lines = config_problems(dataclasses.replace(cfg, teacher=TeacherConfig()), world_size=2)
    assert any(line.startswith("algorithm.adv_estimator='none': learns from no reward") for line in lines), lines
    grpo = dataclasses.replace(cfg, algorithm=AlgorithmConfig())
    assert any(line.startswith("reward.rule_weight=0.0") for line in config_problems(grpo, world_size=2))


def test_signal_and_estimator_needs_are_checked(tiny_model, arithmetic_data):
    def problems(**kw):
        return config_problems(distill_config(tiny_model, tiny_model, arithmetic_data, **kw), world_size=2)

    gkd = TeacherConfig(model_path=str(tiny_model), signal=GKD(beta=2.0), offload=True)
    lines = problems(teacher=gkd, actor=ActorConfig(model=ModelConfig(path=str(tiny_model)), engine=MegatronConfig()))
    assert any(line.startswith("teacher.signal.beta=2.0: must be in [0, 1] (gkd)") for line in lines), lines
    assert any(line.startswith("teacher.offload=True: does not combine with gkd") for line in lines), lines
    assert any("actor.engine:megatron does not compute" in line for line in lines), lines
    lines = problems(teacher=dataclasses.replace(gkd, signal=GKD(), offload=False), mesh=MeshConfig(actor_tp=2))
    assert any(line.startswith("mesh.actor_tp=2: teacher.signal:gkd") for line in lines), lines
    otb = AlgorithmConfig(
        adv_estimator=OptimalTokenBaseline(),
        rollout_correction=RolloutCorrectionConfig(bypass=True, mode="mis"),
    )
    lines = problems(algorithm=otb)
    assert any(line.startswith("algorithm.rollout_correction.bypass=True: skips the old-log-prob") for line in lines)
    cfg = Config(teacher=TeacherConfig(logprob_micro_batch_size=4))
    assert "teacher.* is set but teacher.model_path is None" in ignored_settings(cfg)


def test_the_teacher_scores_only_the_models_tokens_of_a_multi_turn_response():
    """A response with a tool result inside (loss mask 0 at positions 2-3): the reverse KL moves only the model's
    tokens' advantages, and ``teacher/kl`` averages over them; GKD's term aggregates over the same tokens."""
    from rlspmd.algorithms import AggArgs
    from rlspmd.algorithms.distill import JSDTerm
    from rlspmd.metrics import MetricBuffer
    from rlspmd.protocol import Batch
    from rlspmd.roles.teacher import TeacherAdvantage, TeacherLossTerm

    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    batch = Batch(
        {
            "advantages_BR": torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.5]]),
            "old_logprobs_BR": torch.tensor([[-1.0, -2.0, -9.0, -9.0, -0.5]]),
            "teacher_logprobs_BR": torch.tensor([[-1.5, -1.0, -0.1, -0.1, -0.5]]),
            "loss_mask_BR": mask,
        }
    )
    m = MetricBuffer()
    out = TeacherAdvantage(ReverseKL(kl_coef=2.0).build())(batch, m)
    # KL = (0.5, -1, -, -, 0) on the model's tokens; A - 2 KL
    assert_close(out["advantages_BR"], torch.tensor([[-0.5, 2.5, 0.0, 0.0, 0.5]]))
    assert m.reduce(mesh=None)["teacher/kl"] == pytest.approx(-0.5 / 3)

    class NoTeacherModel:  # the term's own arithmetic: what the student's forward returned, aggregated over the mask
        pass

    term = TeacherLossTerm(JSDTerm(coef=0.5, beta=0.5, temperature=1.0), teacher=NoTeacherModel())
    jsd = torch.tensor([[0.2, 0.4, 5.0, 5.0, 0.6]], requires_grad=True)
    m = MetricBuffer()
    mb = Batch({"loss_mask_BR": mask, "teacher_logprobs_BR": batch["teacher_logprobs_BR"]})
    loss = term.add(
        torch.tensor(1.0),
        {"jsd": jsd},
        batch["old_logprobs_BR"],
        mb,
        agg=AggArgs.from_mask(mask, mode="token-mean"),
        metrics=m,
    )
    assert loss.item() == pytest.approx(1.0 + 0.5 * 1.2 / 3)
    assert m.reduce(mesh=None)["teacher/jsd"] == pytest.approx(0.4)
