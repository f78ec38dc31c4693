"""The trainer's algorithm stages on small hand-made batches (one process): token rewards with the KL penalty,
the advantage stage for every estimator, overlong shaping, reward mixing, re-padding, dynamic-sampling plans."""

import dataclasses
import math

import pytest
import torch

from rlspmd.algorithms import (
    ADVANTAGE_ESTIMATORS,
    gae,
    gdpo,
    gpg,
    grpo_outcome,
    grpo_passk,
    masked_whiten,
    opo,
    optimal_token_baseline,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
)
from rlspmd.config import (
    RLOO,
    AdaptiveKL,
    AlgorithmConfig,
    FixedKL,
    OverlongBufferConfig,
    RewardConfig,
    RewardModelConfig,
)
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.rewards.shaping import OverlongShaping, overlong_penalty
from rlspmd.trainer.advantage import AdvantageStage, KLPenalizedTokenRewards, TokenRewards, build_token_rewards
from rlspmd.trainer.sampling import plan_groups

MASK = torch.tensor(
    [
        [1, 1, 1, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 1],  # a hole (tool tokens) inside the response
        [1, 1, 1, 1],
        [1, 0, 0, 0],
        [1, 1, 1, 0],
    ],
    dtype=torch.long,
)
SCORES = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5])
UID = torch.tensor([7, 7, 3, 7, 3, 9])  # groups by id, not by position; 9 is a singleton
# The response mask covers every position up to the last token (tool tokens are part of the sequence); the stages
# must read the loss mask, so row 2's hole only shows if they do.
RESPONSE_MASK = (MASK.flip(1).cummax(1).values.flip(1) > 0).long()


def batch(**extra) -> Batch:
    return Batch(
        {
            "scores_B": SCORES.clone(),
            "response_mask_BR": RESPONSE_MASK.clone(),
            "loss_mask_BR": MASK.clone(),
            "uid_B": UID.clone(),
            **extra,
        }
    )


def test_overlong_penalty_hand_computed():
    # budget 20, buffer 4: free up to 16 tokens, then -1/4 per token, -1 at 20; factor scales it
    lengths = torch.tensor([10, 16, 17, 19, 20])
    got = overlong_penalty(lengths, max_length=20, buffer_len=4, penalty_factor=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.375, -0.5]))


def test_overlong_shaping_adds_to_scores_and_checks_its_config():
    b = Batch({"scores_B": torch.tensor([1.0, 1.0]), "response_mask_BR": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])})
    out = OverlongShaping(OverlongBufferConfig(enable=True, len=2, penalty_factor=1.0), max_response_length=4)(
        b, MetricBuffer()
    )
    torch.testing.assert_close(out["overlong_penalty_B"], torch.tensor([-0.5, -1.0]))
    torch.testing.assert_close(out["scores_B"], torch.tensor([0.5, 0.0]))
    with pytest.raises(ValueError, match="reward.overlong_buffer.len=8"):
        OverlongShaping(OverlongBufferConfig(enable=True, len=8), max_response_length=4)


def test_token_rewards_put_the_score_on_the_last_valid_token():
    out = TokenRewards()(batch(), MetricBuffer())
    want = torch.zeros(6, 4)
    want[0, 2], want[1, 1], want[2, 3], want[3, 3], want[4, 0], want[5, 2] = 1.0, 0.0, 1.0, 1.0, 0.5, 0.5
    torch.testing.assert_close(out["token_rewards_BR"], want)


def kl_batch():
    old = torch.full((6, 4), -1.0)
    ref = torch.full((6, 4), -1.0)
    old[0] = torch.tensor([-1.0, -2.0, -0.5, -9.0])
    ref[0] = torch.tensor([-1.5, -1.0, -0.5, 0.0])
    return batch(old_logprobs_BR=old, ref_logprobs_BR=ref)


def test_kl_in_reward_fixed_coefficient_hand_computed():
    stage = KLPenalizedTokenRewards(
        AlgorithmConfig(use_kl_in_reward=True, kl_penalty="k1", kl_ctrl=FixedKL(kl_coef=0.1)), mesh=None
    )
    metrics = MetricBuffer()
    out = stage(kl_batch(), metrics)
    # row 0: k1 = old - ref = [0.5, -1.0, 0.0] on its 3 valid tokens, score 1.0 on the last one
    torch.testing.assert_close(out["token_rewards_BR"][0], torch.tensor([-0.05, 0.1, 1.0, 0.0]))
    torch.testing.assert_close(
        out["token_rewards_BR"][1:], TokenRewards()(batch(), MetricBuffer())["token_rewards_BR"][1:]
    )
    m = metrics.reduce(mesh=None)
    assert m["kl_in_reward/coef"] == pytest.approx(0.1)
    # verl's controller KL: the mean over the 6 samples of each sample's mean KL (row 0: -0.5 / 3, others 0)
    assert m["kl_in_reward/kl"] == pytest.approx(-0.5 / 3 / 6)
    assert stage.state_dict() == {"kl_ctrl": {"value": 0.1}}


def test_kl_in_reward_adaptive_controller_updates_and_round_trips():
    cfg = AlgorithmConfig(
        use_kl_in_reward=True, kl_penalty="abs", kl_ctrl=AdaptiveKL(kl_coef=0.2, target_kl=0.1, horizon=60)
    )
    stage = build_token_rewards(cfg, mesh=None)
    stage(kl_batch(), MetricBuffer())
    mean_kl = 1.5 / 3 / 6  # abs: 0.5 + 1.0 over row 0's 3 tokens; the mean over 6 samples of per-sample means
    error = min(max(mean_kl / 0.1 - 1, -0.2), 0.2)
    assert stage.controller.value == pytest.approx(0.2 * (1 + error * 6 / 60))
    fresh = build_token_rewards(cfg, mesh=None)
    fresh.load_state_dict(stage.state_dict())
    assert fresh.controller.value == stage.controller.value


def advantages(estimator: str, b: Batch, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """The stage with the estimator named ``estimator`` and those of ``options`` that it has."""
    component = ADVANTAGE_ESTIMATORS[estimator]
    names = {f.name for f in dataclasses.fields(component)}
    b = TokenRewards()(b, MetricBuffer())
    out = AdvantageStage(component(**{k: v for k, v in options.items() if k in names}), mesh=None)(b, MetricBuffer())
    return out["advantages_BR"], out["returns_BR"]


def test_every_estimator_is_wired_to_its_library_function():
    m = MASK.float()
    values = torch.linspace(-1, 1, 24).view(6, 4)
    baseline = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.5, 0.0])
    components = torch.stack([SCORES, (SCORES > 0.7).float()], -1)
    tokens = TokenRewards()(batch(), MetricBuffer())["token_rewards_BR"]
    old = -torch.linspace(0.1, 2.0, 24).view(6, 4)
    sum_p2 = torch.linspace(0.2, 0.9, 24).view(6, 4)
    expected = {
        "grpo": grpo_outcome(SCORES, m, UID, norm_by_std=True),
        "grpo_passk": grpo_passk(SCORES, m, UID, norm_by_std=True),
        "rloo": rloo(SCORES, m, UID),
        "opo": opo(SCORES, m, UID),
        "gpg": gpg(SCORES, m, UID),  # one rank: the global alpha is the local one
        "remax": remax(tokens, baseline, m),
        "gdpo": gdpo(components, m, UID),  # one rank: global whitening is the library's own
        # one rank: global whitening is the library's own batch whitening
        "reinforce_pp": reinforce_pp(tokens, m, gamma=0.9),
        "reinforce_pp_baseline": reinforce_pp_baseline(SCORES, m, UID),
        "optimal_token_baseline": optimal_token_baseline(tokens, m, UID, old, sum_p2),
        "tir_optimal_token_baseline": optimal_token_baseline(
            tokens, m, UID, old, sum_p2, multi_turn=True, handle_zero_tail=True
        ),
        "none": (torch.zeros_like(m), torch.zeros_like(m)),
    }
    adv, ret = gae(tokens, values, m, gamma=0.9, lam=0.8)
    expected["gae"] = (masked_whiten(adv, m), ret)
    assert set(expected) == ADVANTAGE_ESTIMATORS.shipped()
    for name, (want_adv, want_ret) in expected.items():
        got_adv, got_ret = advantages(
            name,
            batch(
                values_BR=values,
                baseline_scores_B=baseline,
                reward_components_BK=components,
                old_logprobs_BR=old,
                sum_pi_squared_BR=sum_p2,
            ),
            gamma=0.9,
            lam=0.8,
        )
        torch.testing.assert_close(got_adv, want_adv.float(), msg=lambda s: f"{name}: {s}")
        if name not in ("reinforce_pp_baseline", "gdpo"):  # their returns are their (whitened) advantages
            torch.testing.assert_close(got_ret, want_ret.float(), msg=lambda s: f"{name}: {s}")


def test_global_whitening_hand_computed():
    # REINFORCE++ with gamma 1: return-to-go is the score at every valid token; whitened over all 16 valid tokens
    adv, ret = advantages("reinforce_pp", batch(), gamma=1.0)
    valid = MASK > 0
    per_token = SCORES[:, None].expand(6, 4)[valid].double()
    mean, std = per_token.mean(), per_token.std()
    torch.testing.assert_close(ret, SCORES[:, None] * MASK)
    torch.testing.assert_close(
        adv[valid].double(), (per_token - mean) / torch.sqrt(std**2 + 1e-8), rtol=1e-5, atol=1e-6
    )


def test_dr_grpo_and_std_option_defaults():
    dr, _ = advantages("grpo", batch(), norm_adv_by_std=False)
    # group 7 = rows 0, 1, 3 with scores 1, 0, 1: mean 2/3, no std division
    torch.testing.assert_close(dr[:, 0][[0, 1, 3]], torch.tensor([1 / 3, -2 / 3, 1 / 3]))
    torch.testing.assert_close(dr[5], 0.5 * MASK[5].float())  # a singleton keeps its score (verl)
    gpg_default, _ = advantages("gpg", batch())
    torch.testing.assert_close(gpg_default, gpg(SCORES, MASK.float(), UID, norm_by_std=False)[0])


def test_kl_in_reward_reaches_outcome_estimators_through_the_sequence_reward():
    cfg = AlgorithmConfig(adv_estimator=RLOO(), use_kl_in_reward=True, kl_penalty="k1", kl_ctrl=FixedKL(kl_coef=0.1))
    b = KLPenalizedTokenRewards(cfg, mesh=None)(kl_batch(), MetricBuffer())
    out = AdvantageStage(cfg.adv_estimator, mesh=None)(b, MetricBuffer())
    penalised = SCORES.clone()
    penalised[0] = 1.0 - 0.1 * (0.5 - 1.0)  # the row's score minus coef * its summed KL
    torch.testing.assert_close(out["advantages_BR"], rloo(penalised, MASK.float(), UID)[0])


def test_reward_role_mixes_rule_and_reward_model_scores(tiny_model):
    from rlspmd.models.loader import load_tokenizer
    from rlspmd.rewards import RewardManager
    from rlspmd.roles.reward import Reward

    tok = load_tokenizer(tiny_model, field_name="t")

    class FakeRM:  # stands in for the FSDP role: adds its raw score
        def __call__(self, b):
            return b.set(rm_scores_B=torch.tensor([0.25, -1.0]))

    resp = tok(
        ["2 + 3 = 5 #### 5", "nope"], add_special_tokens=False, padding=True, padding_side="right", return_tensors="pt"
    )
    b = Batch(
        {"responses_BR": resp["input_ids"], "response_mask_BR": resp["attention_mask"]},
        {"ground_truth": ["5", "5"], "data_source": ["arithmetic"] * 2, "extra_info": [{}, {}]},
    )
    cfg = RewardConfig(rule_weight=0.5, model=RewardModelConfig(path="unused", weight=2.0))
    reward = Reward(cfg, rules=RewardManager(cfg, tok), model=FakeRM())
    out = reward.score(b, MetricBuffer())
    torch.testing.assert_close(out["task_scores_B"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(out["scores_B"], torch.tensor([0.5 + 0.5, -2.0]))
    assert reward.components == (("task_scores_B", "task_score"), ("rm_scores_B", "rm_score"))
    # GDPO's columns: the rule score and the reward model's, unweighted
    torch.testing.assert_close(out["reward_components_BK"], torch.tensor([[1.0, 0.25], [0.0, -1.0]]))


@pytest.mark.parametrize("timeout_s", [None, 30.0])  # in this process, and in the worker pool
def test_reward_components_are_columns_scored_by_their_own_functions(tiny_model, tmp_path, timeout_s):
    """``reward.components``: each function scores every sample; the columns of ``reward_components_BK`` are the rule
    score then the components in the config's order; ``scores_B`` stays the rule score; each is logged."""
    from rlspmd.models.loader import load_tokenizer
    from rlspmd.rewards import RewardManager
    from rlspmd.roles.reward import Reward, component_columns, component_manager

    (tmp_path / "lengths.py").write_text("def short(response, ground_truth):\n    return float(len(response) < 10)\n")
    specs = ["rlspmd.rewards.rules:answer_format", f"{tmp_path / 'lengths.py'}:short"]
    tok = load_tokenizer(tiny_model, field_name="t")
    texts = ["2 + 3 = 5\n#### 5", "The answer is 5.", "#### 4"]
    resp = tok(texts, add_special_tokens=False, padding=True, padding_side="right", return_tensors="pt")
    b = Batch(
        {"responses_BR": resp["input_ids"], "response_mask_BR": resp["attention_mask"]},
        {"ground_truth": ["5"] * 3, "data_source": ["arithmetic"] * 3, "extra_info": [{}, {}, {}]},
    )
    cfg = RewardConfig(components=specs, timeout_s=timeout_s, num_workers=1)
    assert component_columns(cfg) == ["task_score", "answer_format", "short"]
    reward = Reward(
        cfg,
        rules=RewardManager(cfg, tok),
        model=None,
        extra={name: component_manager(cfg, spec, tok) for name, spec in zip(["answer_format", "short"], specs)},
    )
    metrics = MetricBuffer()
    try:
        out = reward.score(b, metrics)
    finally:
        reward.close()
    torch.testing.assert_close(
        out["reward_components_BK"], torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    )
    torch.testing.assert_close(out["scores_B"], torch.tensor([1.0, 0.0, 0.0]))  # the task's score only
    assert out["response_text"] == texts and out["task_scores_B"].tolist() == [1.0, 0.0, 0.0]
    m = metrics.reduce(mesh=None)
    assert m["reward/component/answer_format"] == pytest.approx(2 / 3) and m["reward/component/short"] == pytest.approx(
        1 / 3
    )


def rollout_part(P: int, R: int, rows: int, start: int) -> Batch:
    prompt_mask = torch.ones(rows, P, dtype=torch.long)
    prompt_mask[0, 0] = 0
    resp_mask = torch.ones(rows, R, dtype=torch.long)
    resp_mask[-1, -1] = 0
    prompts = torch.arange(start, start + rows * P).view(rows, P) * prompt_mask + 99 * (1 - prompt_mask)
    responses = torch.arange(start, start + rows * R).view(rows, R) * resp_mask + 99 * (1 - resp_mask)
    attn = torch.cat([prompt_mask, resp_mask], 1)
    return Batch(
        {
            "prompts_BP": prompts,
            "prompt_mask_BP": prompt_mask,
            "responses_BR": responses,
            "response_mask_BR": resp_mask,
            "input_ids_BL": torch.cat([prompts, responses], 1),
            "attention_mask_BL": attn,
            "position_ids_BL": (attn.cumsum(-1) - 1).clamp(min=0),
            "old_logprobs_BR": -resp_mask.float(),
            "uid_B": torch.arange(rows) + start,
        },
        {"text": [f"r{start + i}" for i in range(rows)]},
    )


def test_concat_padded_repads_prompts_left_and_responses_right():
    a, b = rollout_part(P=3, R=2, rows=2, start=0), rollout_part(P=2, R=4, rows=1, start=10)
    out = Batch.concat_padded([a, b], pad_id=99)
    assert (
        out["prompts_BP"].shape == (3, 3)
        and out["responses_BR"].shape == (3, 4)
        and out["input_ids_BL"].shape == (3, 7)
    )
    assert out["prompts_BP"][2].tolist() == [99, 99, 11] and out["prompt_mask_BP"][2].tolist() == [0, 0, 1]
    assert out["responses_BR"][0].tolist() == [0, 1, 99, 99] and out["response_mask_BR"][0].tolist() == [1, 1, 0, 0]
    assert out["old_logprobs_BR"][0].tolist() == [-1.0, -1.0, 0.0, 0.0]
    assert out["input_ids_BL"][2].tolist() == [99, 99, 11, 10, 11, 12, 99]
    assert out["position_ids_BL"][2].tolist() == [0, 0, 0, 1, 2, 3, 3]
    torch.testing.assert_close(out["position_ids_BL"], (out["attention_mask_BL"].cumsum(-1) - 1).clamp(min=0))
    assert out["text"] == ["r0", "r1", "r10"] and out["uid_B"].tolist() == [0, 1, 10]


@pytest.mark.parametrize(
    "kept_per_round, dropped_last, target, want",
    [
        # enough groups with signal: rank 0's surplus fills rank 1
        ([[3, 1]], [1, 3], 4, dict(kept=[3, 1], topped_up=[0, 0], stay=[2, 1], send=[[(1, 1)], []])),
        # a surplus nobody needs is trimmed; nothing moves
        ([[4, 4]], [0, 0], 4, dict(kept=[2, 2], topped_up=[0, 0], stay=[2, 2], send=[[], []])),
        # too few after the last round: each rank tops up with its own dropped groups first
        ([[1, 0], [0, 0]], [2, 2], 4, dict(kept=[1, 0], topped_up=[1, 2], stay=[2, 2], send=[[], []])),
        # rank 1 holds everything: half of it moves
        ([[0, 0]], [0, 4], 4, dict(kept=[0, 0], topped_up=[0, 4], stay=[0, 2], send=[[], [(0, 2)]])),
        # groups with signal are preferred to dropped ones even when they must move
        (
            [[2, 0, 0, 0], [3, 0, 0, 1]],
            [3, 4, 4, 3],
            8,
            dict(kept=[5, 0, 0, 1], topped_up=[0, 2, 0, 0], stay=[2, 2, 0, 1], send=[[(2, 2), (3, 1)], [], [], []]),
        ),
    ],
)
def test_plan_groups(kept_per_round, dropped_last, target, want):
    plan = plan_groups(kept_per_round, dropped_last, target=target)
    assert plan.__dict__ == want
    per_rank = target // len(dropped_last)
    received = [0] * len(dropped_last)
    for sends in plan.send:
        for dst, n in sends:
            received[dst] += n
    assert [s + r for s, r in zip(plan.stay, received)] == [per_rank] * len(dropped_last)
    assert math.isclose(sum(plan.kept) + sum(plan.topped_up), target)


class FakeMesh:
    """Stands in for a DP mesh where a constructor only asks its size (every error here comes before a collective)."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def test_bad_settings_fail_early_naming_the_field(tmp_path):
    from rlspmd.config import FilterGroupsConfig
    from rlspmd.trainer.sampling import DynamicSampling

    def dynamic(cfg, **kw):
        args = dict(mesh=FakeMesh(2), train_batch_size=8, samples_per_prompt=4, pad_id=0) | kw
        return DynamicSampling(cfg, **args)

    with pytest.raises(ValueError, match="algorithm.filter_groups.gen_batch_size=4 must be >= data.train_batch_size=8"):
        dynamic(FilterGroupsConfig(enable=True, gen_batch_size=4))
    with pytest.raises(ValueError, match="algorithm.filter_groups.gen_batch_size=9 does not split over 2"):
        dynamic(FilterGroupsConfig(enable=True, gen_batch_size=9))
    with pytest.raises(ValueError, match="algorithm.filter_groups.max_rounds"):
        dynamic(FilterGroupsConfig(enable=True, max_rounds=0))
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        dynamic(FilterGroupsConfig(enable=True), samples_per_prompt=1)


def test_settings_that_do_nothing_are_reported():
    from rlspmd.config import Config, CriticConfig, FilterGroupsConfig
    from rlspmd.validate import ignored_settings
    from rlspmd.config import load_config_file
    from conftest import ROOT

    assert ignored_settings(Config()) == []
    for name in ("ppo", "grpo", "dapo", "rloo", "reinforce_pp", "remax", "gspo"):
        assert ignored_settings(load_config_file(ROOT / f"configs/{name}.py")) == [], name
        assert ignored_settings(load_config_file(ROOT / f"configs/{name}.py:cpu")) == [], name
    cfg = Config(
        critic=CriticConfig(warmup_steps=3),
        algorithm=AlgorithmConfig(kl_ctrl=FixedKL(kl_coef=0.5), filter_groups=FilterGroupsConfig(max_rounds=9)),
    )
    cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef = False, 0.1
    messages = ignored_settings(cfg)
    assert len(messages) == 4 and "algorithm.adv_estimator='grpo' uses no critic" in messages[0]


@pytest.mark.dist
def test_checkpoint_state_names_every_stateful_object_the_builder_makes(tiny_model, arithmetic_data, tmp_path):
    from conftest import dist_script, torchrun

    proc = torchrun(
        [dist_script("roles_state_check.py"), str(tiny_model), str(arithmetic_data), str(tmp_path / "out")], 1
    )
    assert "ROLES STATE OK" in proc.stdout
