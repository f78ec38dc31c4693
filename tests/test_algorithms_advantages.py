"""Advantage estimators against hand-computed values (the arithmetic is in the comments)."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlspmd.algorithms import (
    gae,
    gdpo,
    gdpo_combine,
    gpg,
    gpg_alpha,
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
from rlspmd.algorithms import ADVANTAGE_ESTIMATORS

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
# group 7 = {3} (singleton: verl gives it mean 0 and std 1, so it keeps its score).
SCORES = t([1.0, 2.0, 0.0, 3.0, 0.5, 2.0])
GROUPS = ids([5, 9, 5, 7, 5, 9])
MASK = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 0]])


def per_row(values):
    return t(values).unsqueeze(-1) * MASK


def test_grpo_outcome_hand_values():
    # Group 5: mean 0.5; deviations 0.5, -0.5, 0; unbiased std = sqrt((0.25 + 0.25 + 0) / 2) = 0.5.
    # Singleton row 3: (3 - 0) / (1 + 1e-6).
    adv, ret = grpo_outcome(SCORES, MASK, GROUPS)
    a = 0.5 / (0.5 + 1e-6)
    assert_close(adv, per_row([a, 0, -a, 3 / (1 + 1e-6), 0, 0]))
    assert torch.equal(adv, ret)
    # Dr.GRPO: no division by std; the singleton keeps its raw score.
    adv, _ = grpo_outcome(SCORES, MASK, GROUPS, norm_by_std=False)
    assert_close(adv, per_row([0.5, 0, -0.5, 3.0, 0, 0]))
    # GRPO.eps reaches the division: eps 0.5 -> 0.5 / (0.5 + 0.5) = 0.5 and 3 / 1.5 = 2.
    adv, _ = grpo_outcome(SCORES, MASK, GROUPS, eps=0.5)
    assert_close(adv, per_row([0.5, 0, -0.5, 2.0, 0, 0]))


def test_grpo_outcome_uses_unbiased_std():
    # {0, 1}: mean 0.5, unbiased std sqrt(0.5) = 0.70710678 (the biased std, 0.5, would give +-1).
    adv, _ = grpo_outcome(t([0.0, 1.0]), torch.ones(2, 1, dtype=F64), ids([0, 0]), eps=0.0)
    assert_close(adv, t([[-0.70710678118654757], [0.70710678118654757]]))


def test_grpo_zero_variance_is_exactly_zero():
    # 0.1 three times: the float mean differs from 0.1 in the last bit; the advantage must still be exactly 0.
    adv, _ = grpo_outcome(torch.tensor([0.1, 0.1, 0.1]), torch.ones(3, 2), ids([4, 4, 4]))
    assert torch.equal(adv, torch.zeros(3, 2))
    assert zero_variance_rows(SCORES, GROUPS).tolist() == [False, True, False, True, False, True]
    # verl's dynamic sampling keeps singletons (they carry their score): without them only group 9 is degenerate.
    without_singletons = zero_variance_rows(SCORES, GROUPS, include_singletons=False)
    assert without_singletons.tolist() == [False, True, False, False, False, True]


def test_grpo_passk_hand_values():
    # Group 5: best is row 0 (score 1), second best 0.5: gap 0.5, divided by std 0.5 (+eps). Others 0, the
    # singleton too (no second best; verl raises there).
    adv, _ = grpo_passk(SCORES, MASK, GROUPS)
    assert_close(adv, per_row([0.5 / (0.5 + 1e-6), 0, 0, 0, 0, 0]))
    adv, _ = grpo_passk(SCORES, MASK, GROUPS, norm_by_std=False)
    assert_close(adv, per_row([0.5, 0, 0, 0, 0, 0]))
    # A tie at the top: max - second max = 0 for everyone.
    adv, _ = grpo_passk(t([1.0, 0.0, 1.0]), torch.ones(3, 1, dtype=F64), ids([0, 0, 0]))
    assert torch.equal(adv, torch.zeros(3, 1, dtype=F64))


def test_rloo_hand_values():
    # Group 5: row0 1 - (0 + 0.5)/2 = 0.75; row2 0 - (1 + 0.5)/2 = -0.75; row4 0.5 - (1 + 0)/2 = 0.
    # Singleton row 3 keeps 3 (verl leaves a group of one untouched).
    adv, _ = rloo(SCORES, MASK, GROUPS)
    assert_close(adv, per_row([0.75, 0, -0.75, 3.0, 0, 0]))
    # {2, 4}: 2 - 4 = -2 and 4 - 2 = 2.
    adv, _ = rloo(t([2.0, 4.0]), torch.ones(2, 1, dtype=F64), ids([1, 1]))
    assert_close(adv, t([[-2.0], [2.0]]))


def test_reinforce_pp_baseline_hand_values():
    # Group 0 = {1, 0} -> centred +0.5 (row 0, 2 tokens), -0.5 (row 1, 1 token); group 1 = {2, 2} -> 0, 0.
    # Valid token values {0.5, 0.5, -0.5, 0, 0}: mean 0.1; deviations 0.4, 0.4, -0.6, -0.1, -0.1;
    # squares sum 0.16+0.16+0.36+0.01+0.01 = 0.7; unbiased var 0.7/4 = 0.175; eps 1e-8 (verl's masked_whiten).
    mask = t([[1, 1], [1, 0], [0, 1], [1, 0]])
    adv, _ = reinforce_pp_baseline(t([1.0, 0.0, 2.0, 2.0]), mask, ids([0, 0, 1, 1]))
    std = math.sqrt(0.175 + 1e-8)
    assert_close(adv, t([[0.4, 0.4], [-0.6, 0], [0, -0.1], [-0.1, 0]]) / std)


def test_reinforce_pp_baseline_singleton_keeps_its_score_before_whitening():
    # Group 0 = {1, 0} -> +0.5, -0.5 (one token each); singleton 3 -> its raw score 3 (mean 0), on 2 tokens.
    # Tokens {0.5, -0.5, 3, 3}: mean 1.5; deviations -1, -2, 1.5, 1.5; squares 1 + 4 + 2.25 + 2.25 = 9.5;
    # unbiased var 9.5 / 3.
    mask = t([[1, 0], [1, 0], [1, 1]])
    adv, _ = reinforce_pp_baseline(t([1.0, 0.0, 3.0]), mask, ids([0, 0, 1]))
    std = math.sqrt(9.5 / 3 + 1e-8)
    assert_close(adv, t([[-1.0, 0], [-2.0, 0], [1.5, 1.5]]) / std)


def test_remax_reward_to_go_minus_greedy_baseline():
    # Row 0: per-token rewards (a KL penalty on each token, the score 1.0 on the last valid one) with a tool-token
    # hole at position 1 and padding at 4, both holding garbage that must not count:
    #   rewards -0.1, [7], -0.2, 1.0 - 0.3, [5]  ->  reward-to-go 0.4, 0, 0.5, 0.7, 0
    #   baseline 0.25  ->  advantages 0.15, 0, 0.25, 0.45, 0
    # Row 1: one valid token with reward 0.5, baseline 1.0 -> return 0.5, advantage -0.5.
    rewards = t([[-0.1, 7.0, -0.2, 0.7, 5.0], [0.5, 3.0, 3.0, 3.0, 3.0]])
    mask = t([[1, 0, 1, 1, 0], [1, 0, 0, 0, 0]])
    adv, ret = remax(rewards, t([0.25, 1.0]), mask)
    assert_close(ret, t([[0.4, 0, 0.5, 0.7, 0], [0.5, 0, 0, 0, 0]]))
    assert_close(adv, t([[0.15, 0, 0.25, 0.45, 0], [-0.5, 0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="token_rewards_BT"):
        remax(t([1.0, 0.5]), t([0.25, 1.0]), mask)


def test_opo_length_weighted_baseline():
    # Group 0: scores {1, 0}, lengths {3, 1}: b = (3*1 + 1*0)/4 = 0.75 -> advantages 0.25, -0.75.
    # Row 2 is a singleton: baseline 0, it keeps 0.3.
    mask = t([[1, 1, 1], [0, 1, 0], [1, 1, 0]])
    adv, _ = opo(t([1.0, 0.0, 0.3]), mask, ids([0, 0, 1]))
    assert_close(adv, t([[0.25, 0.25, 0.25], [0, -0.75, 0], [0.3, 0.3, 0]]))


def test_gpg_alpha_and_baseline():
    # Groups: {1, 0} (rows 0, 2), {1, 1} (rows 1, 3: all equal), {0.5} (row 4: singleton, mean 0).
    # verl's alpha = B / max(1, non-zero scores) = 5 / 4 = 1.25.
    # Advantages 1.25 * (1 - 0.5) = 0.625, 1.25 * (0 - 0.5) = -0.625, 0, 0, singleton 1.25 * 0.5 = 0.625.
    scores, groups, mask = t([1.0, 1.0, 0.0, 1.0, 0.5]), ids([0, 1, 0, 1, 2]), torch.ones(5, 2, dtype=F64)
    adv, _ = gpg(scores, mask, groups)
    assert_close(adv, t([[0.625] * 2, [0] * 2, [-0.625] * 2, [0] * 2, [0.625] * 2]))
    # F_norm = std: unbiased std of {1, 0} = sqrt(0.5); the singleton's std is 1.
    adv, _ = gpg(scores, mask, groups, norm_by_std=True)
    a = 1.25 * 0.5 / (math.sqrt(0.5) + 1e-6)
    assert_close(adv, t([[a] * 2, [0] * 2, [-a] * 2, [0] * 2, [1.25 * 0.5 / (1 + 1e-6)] * 2]))
    # A global alpha from the trainer overrides the local one.
    adv, _ = gpg(scores, mask, groups, alpha=1.0)
    assert_close(adv[:, 0], t([0.5, 0, -0.5, 0, 0.5]))
    # No non-zero score at all: alpha = B / 1 (its advantages are 0 anyway).
    assert gpg_alpha(num_rows=8, num_nonzero_scores=0) == 8.0 and gpg_alpha(num_rows=8, num_nonzero_scores=2) == 4.0


# ---------------------------------------------------------------------------------------------------------------
# GDPO: rows in shuffled group order, group 8 = rows 1, 3; group 4 = rows 0, 2; group 6 = row 4 (singleton).
#   component 0 (correctness)  1, 0, 0, 1, 1      component 1 (format)  0, 1, 1, 1, 0.5
#   a = 0.5 / (sqrt(0.5) + 1e-6): the GRPO advantage of each member of a {1, 0} pair (unbiased std sqrt(0.5)).
#   c0: group 4 {1, 0} -> +a, -a; group 8 {0, 1} -> -a, +a; singleton 1 / (1 + 1e-6)
#   c1: group 4 {0, 1} -> -a, +a; group 8 {1, 1} -> 0, 0 (all equal); singleton 0.5 / (1 + 1e-6)
#   weights (1, 0.5): S = [a - a/2, -a, -a + a/2, a, (1 + 0.25) / (1 + 1e-6)] = [a/2, -a, -a/2, a, 1.25/(1+1e-6)]
GDPO_C = t([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.5]])
GDPO_G = ids([4, 8, 4, 8, 6])
GDPO_MASK = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 1, 1], [1, 0, 0]])


def test_gdpo_hand_values():
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    s = [a / 2, -a, -a / 2, a, 1.25 / (1 + 1e-6)]
    combined = gdpo_combine(GDPO_C, GDPO_MASK, GDPO_G, weights_K=[1.0, 0.5])
    assert_close(combined, t(s).unsqueeze(-1) * GDPO_MASK)
    # Whitened over the 9 valid tokens (row lengths 2, 3, 1, 2, 1), unbiased variance, eps 1e-8.
    tokens = [s[0]] * 2 + [s[1]] * 3 + [s[2]] + [s[3]] * 2 + [s[4]]
    mean = sum(tokens) / 9
    var = sum((x - mean) ** 2 for x in tokens) / 8
    want = [(x - mean) / math.sqrt(var + 1e-8) for x in s]
    adv, ret = gdpo(GDPO_C, GDPO_MASK, GDPO_G, weights_K=[1.0, 0.5])
    assert_close(adv, t(want).unsqueeze(-1) * GDPO_MASK)
    assert torch.equal(adv, ret)


def test_gdpo_one_component_is_whitened_grpo_and_keeps_apart_what_grpo_collapses():
    g = torch.Generator().manual_seed(4)
    scores = torch.randint(0, 3, (12,), generator=g).to(F64)
    groups = torch.randint(0, 4, (12,), generator=g)
    mask = (torch.rand(12, 5, generator=g) > 0.2).to(F64)
    adv, _ = gdpo(scores.unsqueeze(-1), mask, groups)
    assert_close(adv, masked_whiten(grpo_outcome(scores, mask, groups)[0], mask))
    # The paper's collapse: group 0 = {(1, 1), (0, 0)}, group 1 = {(1, 0), (0, 0)}. Summed, both groups are {x, 0}
    # and GRPO gives both winners sqrt(0.5) (x / (|x| / sqrt(2))); GDPO normalises each reward in its group first:
    # group 0's winner gets sqrt(0.5) + sqrt(0.5), group 1's only sqrt(0.5) (its second reward is all 0).
    c = t([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    one, pairs = torch.ones(4, 1, dtype=F64), ids([0, 0, 1, 1])
    grpo_sum, _ = grpo_outcome(c.sum(-1), one, pairs, eps=0.0)
    assert_close(grpo_sum[:, 0], t([1, -1, 1, -1]) * math.sqrt(0.5))
    combined = gdpo_combine(c, one, pairs, eps=0.0)
    assert_close(combined[:, 0], t([2, -2, 1, -1]) * math.sqrt(0.5))


def test_gdpo_rejects_bad_components_and_weights():
    with pytest.raises(ValueError, match="weights_K has 3 entries but components_BK has 2"):
        gdpo(GDPO_C, GDPO_MASK, GDPO_G, weights_K=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="components_BK must have shape"):
        gdpo(GDPO_C[:3], GDPO_MASK, GDPO_G)


def gdpo_two_rewards(scores, mask, groups):
    """GDPO on (score, score^2) with weights (1, 0.5), so the group-estimator tests below cover it."""
    return gdpo(torch.stack([scores, scores * scores], -1), mask, groups, weights_K=[1.0, 0.5])


GROUP_ESTIMATORS = {
    "grpo": grpo_outcome,
    "grpo_passk": grpo_passk,
    "rloo": rloo,
    "opo": opo,
    "gpg": gpg,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "gdpo": gdpo_two_rewards,
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


# A group of one keeps its score as verl computes it; pass@k has no second best and gives 0.
SINGLETON = {"grpo": 0.7 / (1 + 1e-6), "rloo": 0.7, "opo": 0.7, "gpg": 0.7, "grpo_passk": 0.0}


@pytest.mark.parametrize("name", sorted(SINGLETON))
def test_singleton_group_keeps_its_score(name):
    adv, _ = GROUP_ESTIMATORS[name](t([0.7]), t([[1, 0, 1]]), ids([42]))
    assert_close(adv, t([[SINGLETON[name], 0, SINGLETON[name]]]))


def test_bad_group_ids_raise():
    with pytest.raises(ValueError, match="group_ids_B"):
        grpo_outcome(SCORES, MASK, SCORES)  # float ids
    with pytest.raises(ValueError, match="group_ids_B"):
        grpo_outcome(SCORES, MASK, GROUPS[:3])
    with pytest.raises(ValueError, match="scores_B"):
        grpo_outcome(SCORES[:2], MASK, GROUPS)


def test_estimator_names():
    assert ADVANTAGE_ESTIMATORS.shipped() == {
        "gae",
        "grpo",
        "grpo_passk",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "remax",
        "opo",
        "gpg",
        "gdpo",
        "optimal_token_baseline",
        "tir_optimal_token_baseline",
        "none",
    }
