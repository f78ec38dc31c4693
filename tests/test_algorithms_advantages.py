"""Advantage estimators against hand-computed values (the arithmetic is in the comments)."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlspmd.algorithms import (
    ADVANTAGE_ESTIMATORS,
    gae,
    gpg,
    grpo_outcome,
    grpo_passk,
    masked_moments,
    masked_whiten,
    opo,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
    token_level_scores,
    zero_variance_rows,
)

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def ids(x):
    return torch.tensor(x, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------------------
# token_level_scores


def test_token_level_scores_last_valid_token():
    mask = t([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    out = token_level_scores(t([3.0, 4.0, 5.0]), mask)
    # Row 0's last valid token is position 3 (position 2 is a tool-token hole); row 1 has none; row 2 is position 0.
    assert_close(out, t([[0, 0, 0, 3, 0], [0, 0, 0, 0, 0], [5, 0, 0, 0, 0]]))


# ---------------------------------------------------------------------------------------------------------------
# GAE


def test_gae_hand_values():
    # gamma = 0.9, lam = 0.8, gamma*lam = 0.72; rewards [0, 0, 1], values [0.5, 0.6, 0.7].
    # t=2: delta = 1 + 0.9*0 - 0.7 = 0.3;                    A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03;                 A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04;                 A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    adv, ret = gae(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), gamma=0.9, lam=0.8)
    assert_close(adv, t([[0.21712, 0.246, 0.3]]))
    assert_close(ret, t([[0.71712, 0.846, 1.0]]))


def test_gae_skips_holes_and_padding():
    # Same sequence with a tool-output hole at position 1 (garbage reward/value there, ignored) and padding at 4:
    # the hole is jumped over (next value of token 0 is the value at token 2), not an episode end.
    rewards = t([[0, 5.0, 0, 1, 7.0], [0, 0, 0, 0, 0]])
    values = t([[0.5, 99.0, 0.6, 0.7, -3.0], [1, 2, 3, 4, 5]])
    mask = t([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(adv, t([[0.21712, 0, 0.246, 0.3, 0], [0, 0, 0, 0, 0]]))
    assert_close(ret, t([[0.71712, 0, 0.846, 1.0, 0], [0, 0, 0, 0, 0]]))


def test_gae_hole_equals_compacted_sequence():
    g = torch.Generator().manual_seed(0)
    mask = t([[1, 1, 0, 0, 1, 0, 1, 1, 0, 0]])
    rewards = torch.randn(1, 10, generator=g, dtype=F64)
    values = torch.randn(1, 10, generator=g, dtype=F64)
    keep = mask[0] > 0
    adv, ret = gae(rewards, values, mask, gamma=0.97, lam=0.9)
    adv_c, ret_c = gae(rewards[:, keep], values[:, keep], mask[:, keep], gamma=0.97, lam=0.9)
    assert_close(adv[:, keep], adv_c)
    assert_close(ret[:, keep], ret_c)
    assert torch.all(adv[:, ~keep] == 0) and torch.all(ret[:, ~keep] == 0)


# ---------------------------------------------------------------------------------------------------------------
# REINFORCE++


def test_reinforce_pp_hand_values_with_hole():
    # gamma = 0.5. Row 0: rewards [0, 0, 1, pad] -> G = [0.25, 0.5, 1, 0].
    # Row 1: rewards [1, 7 (tool token, ignored), 2, pad] -> G2 = 2, G0 = 1 + 0.5*2 = 2 (the hole is skipped).
    rewards = t([[0, 0, 1, 0], [1, 7, 2, 0]])
    mask = t([[1, 1, 1, 0], [1, 0, 1, 0]])
    adv, ret = reinforce_pp(rewards, mask, gamma=0.5)
    assert_close(ret, t([[0.25, 0.5, 1, 0], [2, 0, 2, 0]]))
    # Whitening over the 5 valid returns {0.25, 0.5, 1, 2, 2}: mean = 5.75/5 = 1.15,
    # deviations -0.9, -0.65, -0.15, 0.85, 0.85; squares sum to 0.81+0.4225+0.0225+0.7225+0.7225 = 2.7,
    # unbiased var = 2.7/4 = 0.675.
    std = math.sqrt(0.675 + 1e-8)
    assert_close(adv, t([[-0.9 / std, -0.65 / std, -0.15 / std, 0], [0.85 / std, 0, 0.85 / std, 0]]))


def test_reinforce_pp_hole_equals_compacted_sequence():
    g = torch.Generator().manual_seed(1)
    mask = t([[1, 0, 0, 1, 1, 0, 1, 0]])
    rewards = torch.randn(1, 8, generator=g, dtype=F64)
    keep = mask[0] > 0
    adv, ret = reinforce_pp(rewards, mask, gamma=0.9)
    adv_c, ret_c = reinforce_pp(rewards[:, keep], mask[:, keep], gamma=0.9)
    assert_close(ret[:, keep], ret_c)
    assert_close(adv[:, keep], adv_c)
    assert torch.all(adv[:, ~keep] == 0)


# ---------------------------------------------------------------------------------------------------------------
# Whitening


def test_masked_whiten_global_moments_match_full_batch():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 5, generator=g, dtype=F64)
    mask = (torch.rand(6, 5, generator=g) > 0.3).to(F64)
    full = masked_whiten(x, mask)
    # Two "ranks" each hold 3 rows; their moments are summed (the all-reduce) and each whitens its own rows.
    moments = masked_moments(x[:3], mask[:3]) + masked_moments(x[3:], mask[3:])
    parts = [masked_whiten(x[:3], mask[:3], moments=moments), masked_whiten(x[3:], mask[3:], moments=moments)]
    assert_close(torch.cat(parts), full)
    valid = mask > 0
    assert abs(full[valid].mean().item()) < 1e-12
    assert abs(full[valid].std().item() - 1.0) < 1e-6  # unbiased std, as documented


def test_masked_whiten_shift_mean_false_and_empty():
    x, mask = t([[1.0, 3.0, 100.0]]), t([[1, 1, 0]])
    # mean 2, unbiased var ((1-2)^2 + (3-2)^2)/1 = 2; without the shift the mean is added back.
    std = math.sqrt(2 + 1e-8)
    assert_close(masked_whiten(x, mask, shift_mean=False), t([[-1 / std + 2, 1 / std + 2, 0]]))
    assert torch.equal(masked_whiten(x, torch.zeros_like(mask)), torch.zeros_like(x))


# ---------------------------------------------------------------------------------------------------------------
# Group estimators

# Rows in shuffled group order: group 5 = {1, 0, 0.5} (rows 0, 2, 4), group 9 = {2, 2} (zero variance),
# group 7 = {3} (singleton).
SCORES = t([1.0, 2.0, 0.0, 3.0, 0.5, 2.0])
GROUPS = ids([5, 9, 5, 7, 5, 9])
MASK = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 0]])


def per_row(values):
    return t(values).unsqueeze(-1) * MASK


def test_grpo_outcome_hand_values():
    # Group 5: mean 0.5; deviations 0.5, -0.5, 0; unbiased std = sqrt((0.25 + 0.25 + 0) / 2) = 0.5.
    adv, ret = grpo_outcome(SCORES, MASK, GROUPS)
    a = 0.5 / (0.5 + 1e-6)
    assert_close(adv, per_row([a, 0, -a, 0, 0, 0]))
    assert torch.equal(adv, ret)
    # Dr.GRPO: no division by std.
    adv, _ = grpo_outcome(SCORES, MASK, GROUPS, norm_by_std=False)
    assert_close(adv, per_row([0.5, 0, -0.5, 0, 0, 0]))


def test_grpo_outcome_uses_unbiased_std():
    # {0, 1}: mean 0.5, unbiased std sqrt(0.5) = 0.70710678 (the biased std, 0.5, would give +-1).
    adv, _ = grpo_outcome(t([0.0, 1.0]), torch.ones(2, 1, dtype=F64), ids([0, 0]), eps=0.0)
    assert_close(adv, t([[-0.70710678118654757], [0.70710678118654757]]))


def test_grpo_zero_variance_is_exactly_zero():
    # 0.1 three times: the float mean differs from 0.1 in the last bit; the advantage must still be exactly 0.
    adv, _ = grpo_outcome(torch.tensor([0.1, 0.1, 0.1]), torch.ones(3, 2), ids([4, 4, 4]))
    assert torch.equal(adv, torch.zeros(3, 2))
    assert zero_variance_rows(SCORES, GROUPS).tolist() == [False, True, False, True, False, True]


def test_grpo_passk_hand_values():
    # Group 5: best is row 0 (score 1), second best 0.5: gap 0.5, divided by std 0.5 (+eps). Others 0.
    adv, _ = grpo_passk(SCORES, MASK, GROUPS)
    assert_close(adv, per_row([0.5 / (0.5 + 1e-6), 0, 0, 0, 0, 0]))
    adv, _ = grpo_passk(SCORES, MASK, GROUPS, norm_by_std=False)
    assert_close(adv, per_row([0.5, 0, 0, 0, 0, 0]))
    # A tie at the top: max - second max = 0 for everyone.
    adv, _ = grpo_passk(t([1.0, 0.0, 1.0]), torch.ones(3, 1, dtype=F64), ids([0, 0, 0]))
    assert torch.equal(adv, torch.zeros(3, 1, dtype=F64))


def test_rloo_hand_values():
    # Group 5: row0 1 - (0 + 0.5)/2 = 0.75; row2 0 - (1 + 0.5)/2 = -0.75; row4 0.5 - (1 + 0)/2 = 0.
    adv, _ = rloo(SCORES, MASK, GROUPS)
    assert_close(adv, per_row([0.75, 0, -0.75, 0, 0, 0]))
    # {2, 4}: 2 - 4 = -2 and 4 - 2 = 2.
    adv, _ = rloo(t([2.0, 4.0]), torch.ones(2, 1, dtype=F64), ids([1, 1]))
    assert_close(adv, t([[-2.0], [2.0]]))


def test_reinforce_pp_baseline_hand_values():
    # Group 0 = {1, 0} -> centred +0.5 (row 0, 2 tokens), -0.5 (row 1, 1 token); group 1 = {2, 2} -> 0, 0.
    # Valid token values {0.5, 0.5, -0.5, 0, 0}: mean 0.1; deviations 0.4, 0.4, -0.6, -0.1, -0.1;
    # squares sum 0.16+0.16+0.36+0.01+0.01 = 0.7; unbiased var 0.7/4 = 0.175; eps 1e-6.
    mask = t([[1, 1], [1, 0], [0, 1], [1, 0]])
    adv, _ = reinforce_pp_baseline(t([1.0, 0.0, 2.0, 2.0]), mask, ids([0, 0, 1, 1]))
    std = math.sqrt(0.175 + 1e-6)
    assert_close(adv, t([[0.4, 0.4], [-0.6, 0], [0, -0.1], [-0.1, 0]]) / std)


def test_remax_hand_values():
    mask = t([[1, 1, 0], [1, 0, 0]])
    adv, ret = remax(t([1.0, 0.5]), t([0.25, 1.0]), mask)
    assert_close(adv, t([[0.75, 0.75, 0], [-0.5, 0, 0]]))
    assert_close(ret, adv)


def test_opo_length_weighted_baseline():
    # Group 0: scores {1, 0}, lengths {3, 1}: b = (3*1 + 1*0)/4 = 0.75 -> advantages 0.25, -0.75.
    # Row 2 is a singleton -> 0.
    mask = t([[1, 1, 1], [0, 1, 0], [1, 1, 0]])
    adv, _ = opo(t([1.0, 0.0, 0.3]), mask, ids([0, 0, 1]))
    assert_close(adv, t([[0.25, 0.25, 0.25], [0, -0.75, 0], [0, 0, 0]]))


def test_gpg_alpha_and_baseline():
    # Groups: {1, 0} (valid), {1, 1} (all equal), {0.5} (singleton). B = 5, M = 3 -> alpha = 5 / (5 - 3) = 2.5.
    # Advantages 2.5 * (1 - 0.5) = 1.25 and 2.5 * (0 - 0.5) = -1.25; the rest 0.
    scores, groups, mask = t([1.0, 1.0, 0.0, 1.0, 0.5]), ids([0, 1, 0, 1, 2]), torch.ones(5, 2, dtype=F64)
    adv, _ = gpg(scores, mask, groups)
    assert_close(adv, t([[1.25] * 2, [0] * 2, [-1.25] * 2, [0] * 2, [0] * 2]))
    # F_norm = std: unbiased std of {1, 0} = sqrt(0.5).
    adv, _ = gpg(scores, mask, groups, norm_by_std=True)
    a = 2.5 * 0.5 / (math.sqrt(0.5) + 1e-6)
    assert_close(adv, t([[a] * 2, [0] * 2, [-a] * 2, [0] * 2, [0] * 2]))
    # A global alpha from the trainer overrides the local one.
    adv, _ = gpg(scores, mask, groups, alpha=1.0)
    assert_close(adv[:, 0], t([0.5, 0, -0.5, 0, 0]))


GROUP_ESTIMATORS = {
    "grpo": grpo_outcome,
    "grpo_passk": grpo_passk,
    "rloo": rloo,
    "opo": opo,
    "gpg": gpg,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


@pytest.mark.parametrize("name", sorted(GROUP_ESTIMATORS))
def test_group_estimators_are_permutation_equivariant(name):
    fn = GROUP_ESTIMATORS[name]
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 3, (12,), generator=g).to(F64) / 2
    groups = torch.randint(0, 4, (12,), generator=g)
    mask = (torch.rand(12, 6, generator=g) > 0.2).to(F64)
    adv, ret = fn(scores, mask, groups)
    perm = torch.randperm(12, generator=g)
    adv_p, ret_p = fn(scores[perm], mask[perm], groups[perm])
    assert_close(adv_p, adv[perm])
    assert_close(ret_p, ret[perm])
    assert torch.all(adv[mask == 0] == 0)


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "gpg", "grpo_passk"])
def test_singleton_group_gets_zero(name):
    adv, _ = GROUP_ESTIMATORS[name](t([0.7]), torch.ones(1, 3, dtype=F64), ids([42]))
    assert torch.equal(adv, torch.zeros(1, 3, dtype=F64))


def test_bad_group_ids_raise():
    with pytest.raises(ValueError, match="group_ids_B"):
        grpo_outcome(SCORES, MASK, SCORES)  # float ids
    with pytest.raises(ValueError, match="group_ids_B"):
        grpo_outcome(SCORES, MASK, GROUPS[:3])
    with pytest.raises(ValueError, match="scores_B"):
        grpo_outcome(SCORES[:2], MASK, GROUPS)


def test_registry_names():
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "grpo_passk", "rloo", "reinforce_pp",
                                         "reinforce_pp_baseline", "remax", "opo", "gpg"}
