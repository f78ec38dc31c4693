"""The advantage stage and KL-in-reward stage with the verl-parity estimators, on small hand-made batches (one
process): GPG's alpha from non-zero scores, ReMax's reward-to-go of KL-penalised token rewards, GDPO's components,
``GRPO.eps``."""

import math

import torch
from torch.testing import assert_close

from rlspmd.config import GDPO, GRPO, AlgorithmConfig, FixedKL, GPGAdvantage, ReMax
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.trainer.advantage import AdvantageStage, KLPenalizedTokenRewards, TokenRewards

MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])  # row 1 has a hole
UID = torch.tensor([3, 8, 3, 8, 5])  # shuffled groups; 5 is a singleton


def stage(estimator, b):
    b = TokenRewards()(b, MetricBuffer())
    out = AdvantageStage(estimator, mesh=None)(b, MetricBuffer())
    return out["advantages_BR"], out["returns_BR"]


def batch(scores, **extra):
    return Batch(
        {
            "scores_B": torch.tensor(scores),
            "response_mask_BR": MASK.clone(),
            "loss_mask_BR": MASK.clone(),
            "uid_B": UID.clone(),
            **extra,
        }
    )


def test_gpg_alpha_counts_non_zero_scores():
    # Scores 1, 0, 0, 0, 2: two non-zero of five -> alpha 5 / 2. Group 3 {1, 0} -> +-0.5; group 8 {0, 0} -> 0;
    # singleton 2 (mean 0) -> 2. Advantages 2.5 * (0.5, 0, -0.5, 0, 2).
    adv, _ = stage(GPGAdvantage(), batch([1.0, 0.0, 0.0, 0.0, 2.0]))
    assert_close(adv, 2.5 * torch.tensor([0.5, 0.0, -0.5, 0.0, 2.0])[:, None] * MASK)


def test_grpo_eps_is_the_component_option():
    # Singleton score 2 -> 2 / (1 + eps); group 3 {1, 0}: +-0.5 / (sqrt(0.5) + eps).
    adv, _ = stage(GRPO(eps=0.25), batch([1.0, 0.0, 0.0, 0.0, 2.0]))
    a = 0.5 / (math.sqrt(0.5) + 0.25)
    assert_close(adv[:, 0], torch.tensor([a, 0.0, -a, 0.0, 2 / 1.25]))


def test_remax_is_the_reward_to_go_of_kl_penalised_token_rewards():
    # k1 KL with coefficient 0.5 on row 0: old - ref = (0.2, -0.4, 0.1) on its 3 valid tokens, score 1 on the last.
    # Token rewards -0.1, 0.2, 1 - 0.05 = 0.95 -> reward-to-go 1.05, 1.15, 0.95; baseline 0.3 -> 0.75, 0.85, 0.65.
    # Other rows: no KL (old = ref); row 1 (hole at 1): score 0.5 on token 3 -> returns 0.5 at tokens 0, 2, 3.
    old = torch.zeros(5, 4)
    ref = torch.zeros(5, 4)
    old[0, :3] = torch.tensor([0.2, -0.4, 0.1])
    cfg = AlgorithmConfig(adv_estimator=ReMax(), use_kl_in_reward=True, kl_penalty="kl", kl_ctrl=FixedKL(kl_coef=0.5))
    b = batch(
        [1.0, 0.5, 0.0, 0.0, 2.0],
        old_logprobs_BR=old,
        ref_logprobs_BR=ref,
        baseline_scores_B=torch.tensor([0.3, 1.0, 0.0, 0.0, 0.0]),
    )
    b = KLPenalizedTokenRewards(cfg, mesh=None)(b, MetricBuffer())
    out = AdvantageStage(cfg.adv_estimator, mesh=None)(b, MetricBuffer())
    assert_close(out["returns_BR"][:2], torch.tensor([[1.05, 1.15, 0.95, 0.0], [0.5, 0.0, 0.5, 0.5]]))
    assert_close(out["advantages_BR"][:2], torch.tensor([[0.75, 0.85, 0.65, 0.0], [-0.5, 0.0, -0.5, -0.5]]))


def test_gdpo_reads_reward_components():
    components = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    adv, ret = stage(GDPO(reward_weights=[1.0, 0.5]), batch([2.0, 1.0, 0.0, 2.0, 1.0], reward_components_BK=components))
    # Group 3 rows 0, 2: both components {1, 0} -> +-a each, a = 0.5 / (sqrt(0.5) + 1e-6): sum +-1.5 a.
    # Group 8 rows 1, 3: component 0 {0, 1} -> -+a; component 1 {1, 1} -> 0: sum -a, +a. Singleton: 1 / (1 + 1e-6).
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    s = [1.5 * a, -a, -1.5 * a, a, 1 / (1 + 1e-6)]
    tokens = [v for v, n in zip(s, MASK.sum(-1).tolist()) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1) + 1e-8)
    assert_close(adv, torch.tensor([(v - mean) / std for v in s])[:, None] * MASK)
    assert torch.equal(adv, ret)
