"""On-policy distillation's signals, the optimal token baseline, DPPO and DRO against hand-computed values (verl's and
TRL's formulas transcribed into the comments), and the vocabulary kernels against full-logit references."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlspmd.algorithms import (
    AggArgs,
    dppo_kl,
    dppo_tv,
    dro,
    generalized_jsd,
    optimal_token_baseline,
    reverse_kl_advantage,
)
from rlspmd.config import GKD, DPPOKL, DPPOTV, DRO, MultiTurnOptimalTokenBaseline, OptimalTokenBaseline, ReverseKL
from rlspmd.models.logprobs import chunked_jsd, chunked_logprobs, logprobs_from_logits
from rlspmd.protocol import Batch

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


# -- the reverse KL on the advantage (slime's --use-opd) ------------------------------------------------------------
#   A = (1, 1, 1 | -0.5, -0.5, pad), student log-probs (-1, -2, -0.5 | -1, -3, .), teacher (-0.5, -2, -2 | -1, -1, .)
#   reverse KL per token = student - teacher = (-0.5, 0, 1.5 | 0, -2, 0); coef 0.5:
#   A' = (1.25, 1, 0.25 | -0.5, 0.5, pad unchanged)


def test_reverse_kl_advantage_hand_computed_and_zero_for_a_teacher_equal_to_the_student():
    adv = t([[1.0, 1.0, 1.0], [-0.5, -0.5, 7.0]])
    student = t([[-1.0, -2.0, -0.5], [-1.0, -3.0, math.nan]])
    teacher = t([[-0.5, -2.0, -2.0], [-1.0, -1.0, -math.inf]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    got, kl = reverse_kl_advantage(adv, student, teacher, mask, coef=0.5)
    assert_close(got, t([[1.25, 1.0, 0.25], [-0.5, 0.5, 7.0]]))
    assert_close(kl, t([[-0.5, 0.0, 1.5], [0.0, -2.0, 0.0]]))
    same, kl = reverse_kl_advantage(adv, student, student, mask, coef=3.0)
    assert torch.equal(same[mask > 0], adv[mask > 0]) and torch.all(kl == 0)
    # the component binds its coefficient
    got2, _ = ReverseKL(kl_coef=0.5).build()(adv, student, teacher, mask)
    assert torch.equal(got2, got)
    assert ReverseKL(kl_coef=0).problems() == [("kl_coef", 0, "must be > 0")]


# -- GKD's generalized JSD (TRL's generalized_jsd_loss, before its reduction) ---------------------------------------
#   Two tokens, temperature 1: student logits (0, 0) -> S = (1/2, 1/2); teacher logits (log 3, 0) -> T = (3/4, 1/4).
#   beta 0: KL(T||S) = 3/4 log(3/2) + 1/4 log(1/2);  beta 1: KL(S||T) = 1/2 log(2/3) + 1/2 log 2
#   beta 0.5: M = (5/8, 3/8); J = 0.5 [3/4 log(6/5) + 1/4 log(2/3)] + 0.5 [1/2 log(4/5) + 1/2 log(4/3)]


def test_generalized_jsd_hand_computed():
    s, tt = t([[0.0, 0.0]]), t([[math.log(3.0), 0.0]])
    kl_ts = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    kl_st = 0.5 * math.log(2 / 3) + 0.5 * math.log(2.0)
    half = 0.5 * (0.75 * math.log(6 / 5) + 0.25 * math.log(2 / 3)) + 0.5 * (
        0.5 * math.log(4 / 5) + 0.5 * math.log(4 / 3)
    )
    for beta, want in ((0.0, kl_ts), (1.0, kl_st), (0.5, half)):
        assert generalized_jsd(s, tt, beta=beta).item() == pytest.approx(want, rel=1e-6)
    # temperature 2 halves both logits: T = softmax(log 3 / 2, 0) = (sqrt 3, 1) / (sqrt 3 + 1)
    p = math.sqrt(3) / (math.sqrt(3) + 1)
    assert generalized_jsd(s, tt, beta=0.0, temperature=2.0).item() == pytest.approx(
        p * math.log(2 * p) + (1 - p) * math.log(2 * (1 - p)), rel=1e-6
    )
    # a teacher equal to the student: no signal, whatever beta
    x = torch.randn(3, 4, 9, dtype=F64)
    for beta in (0.0, 0.3, 1.0):
        assert torch.all(generalized_jsd(x, x, beta=beta).abs() < 1e-6)
    assert GKD(beta=1.5, temperature=0).problems() == [
        ("beta", 1.5, "must be in [0, 1]"),
        ("temperature", 0, "must be > 0"),
    ]


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_chunked_jsd_matches_the_full_logit_reference_in_value_and_gradient(beta):
    g = torch.Generator().manual_seed(0)
    N, H, V = 7, 5, 11
    h = torch.randn(N, H, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=F64, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=F64, requires_grad=True)
    teacher_logits = torch.randn(N, V, generator=g, dtype=F64)
    weights = torch.randn(N, generator=g, dtype=F64)
    tau = 0.7
    want = generalized_jsd(h @ w.T + b, teacher_logits, beta=beta, temperature=tau)
    want_grads = torch.autograd.grad((want * weights).sum(), (h, w, b))
    target = torch.log_softmax(teacher_logits / tau, dim=-1)
    got = chunked_jsd(h, w, target, beta=beta, temperature=tau, bias=b, chunk_size=3)  # three chunks, one short
    got_grads = torch.autograd.grad((got * weights).sum(), (h, w, b))
    # the kernel computes in float32 (as on the device), the reference in float64
    assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    for a, e in zip(got_grads, want_grads):
        assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_log_prob_kernel_extras_match_full_logits():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(2, 6, 8, generator=g), torch.randn(13, 8, generator=g)
    y = torch.randint(0, 13, (2, 6), generator=g)
    logits = h @ w.T
    y[0, 0] = int(logits[0, 0].argmax())  # one target that is the argmax
    lp, ent, extra = chunked_logprobs(
        h, w, y, temperature=0.5, chunk_size=4, extras=("sum_p2", "argmax", "vocab_logprobs")
    )
    want_lp, want_ent = logprobs_from_logits(logits, y, temperature=0.5)
    full = torch.log_softmax(logits / 0.5, dim=-1)
    assert_close(lp, want_lp) and assert_close(ent, want_ent)
    assert_close(extra["vocab_logprobs"], full)
    assert_close(extra["sum_p2"], full.exp().square().sum(-1))
    assert torch.equal(extra["argmax"], (full.argmax(-1) == y).float()) and extra["argmax"][0, 0] == 1
    # without extras: the same two outputs, bit for bit
    lp2, ent2 = chunked_logprobs(h, w, y, temperature=0.5, chunk_size=4)
    assert torch.equal(lp2, lp) and torch.equal(ent2, ent)


# -- the optimal token baseline (verl: compute_[multi_turn_]optimal_token_baseline_advantage) -----------------------
#   Group 0, two samples. Sample a: mask (1,1,1), reward 1 on its last token, pi = 1/2 and sum pi^2 = 1/2 at every
#   token -> w = 1 - 2 pi + sum pi^2 = 1/2, W = (0.5, 1, 1.5), returns G = (1, 1, 1). Sample b: mask (1,1,0), reward 0,
#   pi = 1/4, sum pi^2 = 1/4 -> w = 3/4, W = (0.75, 1.5), G = 0.
#   B_0 = (1 * 0.5) / (0.5 + 0.75) = 0.4; B_1 = 1 / (1 + 1.5) = 0.4; B_2 = 1.5 / 1.5 = 1 (a alone).
#   A_a = (0.6, 0.6, 0), A_b = (-0.4, -0.4); zero tail (a is the unique longest, b has 2 tokens): B_a,2 = 0,
#   A_a,2 = 1.
#   Group 1, one sample c: mask (1,1,0), reward 2 on token 1 -> no baseline: A_c = G_c = (2, 2).


def otb_batch():
    mask = t([[1, 1, 1], [1, 1, 0], [1, 1, 0]])
    rewards = t([[0, 0, 1], [0, 0, 0], [0, 2, 0]])
    old = torch.log(t([[0.5] * 3, [0.25] * 3, [0.5] * 3]))
    sum_p2 = t([[0.5] * 3, [0.25] * 3, [0.5] * 3])
    return rewards, mask, torch.tensor([0, 0, 1]), old, sum_p2


def test_optimal_token_baseline_hand_computed():
    rewards, mask, uid, old, sum_p2 = otb_batch()
    adv, ret = optimal_token_baseline(rewards, mask, uid, old, sum_p2)
    assert_close(adv, t([[0.6, 0.6, 0.0], [-0.4, -0.4, 0.0], [2.0, 2.0, 0.0]]), atol=1e-7, rtol=0)
    assert_close(ret, t([[1, 1, 1], [0, 0, 0], [2, 2, 0]]))
    adv, _ = optimal_token_baseline(rewards, mask, uid, old, sum_p2, handle_zero_tail=True)
    assert_close(adv, t([[0.6, 0.6, 1.0], [-0.4, -0.4, 0.0], [2.0, 2.0, 0.0]]), atol=1e-7, rtol=0)
    # truncated IS weights scale w by rho^2: b's w at token 0 becomes 4 * 0.75 = 3 -> B_0 = 0.5 / 3.5
    w = t([[1, 1, 1], [2, 1, 1], [1, 1, 1]])
    adv, _ = optimal_token_baseline(rewards, mask, uid, old, sum_p2, weights_BT=w)
    assert adv[0, 0].item() == pytest.approx(1 - 0.5 / 3.5)


#   Multi-turn: sample a has a tool token at position 1 (mask 1,0,1,1; reward 1 at its last token), b mask (1,1,0,0).
#   a's cumulative W skips the hole: (0.5, -, 1.0, 1.5) at its model tokens k = 0, 1, 2; b: (0.75, 1.5).
#   Aligned by model token: B_k0 = 0.5 / 1.25 = 0.4, B_k1 = 1 / 2.5 = 0.4, B_k2 = 1 (zero tail, the default: 0).
#   A_a = (0.6, 0 [tool], 0.6, 1.0), A_b = (-0.4, -0.4). Aligned by position (single-turn): position 1 has only b
#   (W 1.5, G 0) -> B = 0; positions 2, 3 only a -> B = G: A_a = (0.6, 0, 0, 0), A_b = (-0.4, 0, 0, 0).


def test_multi_turn_optimal_token_baseline_aligns_the_models_tokens():
    mask = t([[1, 0, 1, 1], [1, 1, 0, 0]])
    rewards = t([[0, 0, 0, 1], [0, 0, 0, 0]])
    old = torch.log(t([[0.5] * 4, [0.25] * 4]))
    sum_p2 = t([[0.5] * 4, [0.25] * 4])
    uid = torch.tensor([3, 3])
    adv, _ = optimal_token_baseline(rewards, mask, uid, old, sum_p2, multi_turn=True, handle_zero_tail=True)
    assert_close(adv, t([[0.6, 0.0, 0.6, 1.0], [-0.4, -0.4, 0.0, 0.0]]), atol=1e-7, rtol=0)
    adv, _ = optimal_token_baseline(rewards, mask, uid, old, sum_p2)
    assert_close(adv, t([[0.6, 0.0, 0.0, 0.0], [-0.4, 0.0, 0.0, 0.0]]), atol=1e-7, rtol=0)
    # the components: verl's names, their traits and defaults, the batch adapter
    batch = Batch(
        {
            "token_rewards_BR": rewards,
            "loss_mask_BR": mask,
            "uid_B": uid,
            "old_logprobs_BR": old,
            "sum_pi_squared_BR": sum_p2,
        }
    )
    adv_c, _ = MultiTurnOptimalTokenBaseline().build(all_reduce=None)(batch)
    assert_close(adv_c, t([[0.6, 0.0, 0.6, 1.0], [-0.4, -0.4, 0.0, 0.0]]), atol=1e-7, rtol=0)
    assert (OptimalTokenBaseline.name, MultiTurnOptimalTokenBaseline.name) == (
        "optimal_token_baseline",
        "tir_optimal_token_baseline",
    )
    assert OptimalTokenBaseline.uses_sum_pi_squared and OptimalTokenBaseline.uses_old_logprobs
    assert not OptimalTokenBaseline().handle_zero_tail and MultiTurnOptimalTokenBaseline().handle_zero_tail


# -- DPPO (verl: compute_policy_loss_dppo_tv / _kl) and DRO ---------------------------------------------------------
#   Five tokens (p = pi_theta, q = pi_old), token-sum aggregation:
#   1. p .6  q .4  A  1: TV p - q = .2 > .15 -> outside, no gradient
#   2. p .5  q .4  A  1: TV .1 -> inside, r = 1.25: loss -1.25 log .5, d/dlogp = -1.25
#   3. p .2  q .4  A -1: TV -.2 < -.15 -> outside
#   4. p .3  q .4  A -2: TV -.1 -> inside, r = .75: loss 2 * .75 log .3, d/dlogp = 1.5
#   5. p .9  q .01 A -1: A < 0 and p > q -> inside; r = 90 truncated at 20: loss 20 log .9, d/dlogp = 20

P = [0.6, 0.5, 0.2, 0.3, 0.9]
Q = [0.4, 0.4, 0.4, 0.4, 0.01]
A = [1.0, 1.0, -1.0, -2.0, -1.0]


def run_loss(fn, p=P, q=Q, a=A, **kw):
    logp = torch.log(t([p])).requires_grad_()
    mask = torch.ones(1, len(p), dtype=F64)
    loss, metrics = fn(logp, torch.log(t([q])), t([a]), mask, agg=AggArgs.from_mask(mask, mode="token-sum"), **kw)
    loss.backward()
    return loss.detach(), logp.grad[0], metrics


def test_dppo_tv_hand_computed():
    loss, grad, m = run_loss(dppo_tv)
    assert loss.item() == pytest.approx(-1.25 * math.log(0.5) + 1.5 * math.log(0.3) + 20 * math.log(0.9))
    assert_close(grad, t([0.0, -1.25, 0.0, 1.5, 20.0]))
    assert m["clip_frac"].item() == pytest.approx(2 / 5)
    assert (m["clip_frac_upper"].item(), m["clip_frac_lower"].item()) == pytest.approx((1 / 5, 1 / 5))
    assert m["truncated_frac"].item() == pytest.approx(1 / 5)
    # asymmetric bounds: clip_low 0.25 lets token 3 (TV -.2) in, clip_high .05 keeps token 2 (TV .1) out
    _, grad, _ = run_loss(dppo_tv, clip_low=0.25, clip_high=0.05)
    assert_close(grad, t([0.0, 0.0, 0.5, 1.5, 20.0]))
    assert DPPOTV().build().keywords == {"clip_low": 0.15, "clip_high": 0.15, "clip_ratio_c": 20.0}


#   Binary KL D = q log(q/p) + (1-q) log((1-q)/(1-p)) (1e-8 in both parts of the second ratio; negligible here):
#   1. q .4 p .6: .4 log(2/3) + .6 log(1.5) = .0811 > .05, A > 0 and p > q -> outside
#   2. q .4 p .5: .4 log .8 + .6 log 1.2 = .0201 -> inside
#   3. q .4 p .2: .4 log 2 + .6 log .75 = .1046 > .05, A < 0 and p < q -> outside
#   4. q .4 p .3: .4 log(4/3) + .6 log(6/7) = .0226 -> inside
#   5. A < 0 and p > q -> inside whatever D


def test_dppo_kl_hand_computed():
    def binary_kl(q, p):
        return q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))

    assert [round(binary_kl(q, p), 4) for p, q in zip(P[:4], Q[:4])] == [0.0811, 0.0201, 0.1046, 0.0226]
    loss, grad, m = run_loss(dppo_kl)
    assert_close(grad, t([0.0, -1.25, 0.0, 1.5, 20.0]))
    assert m["clip_frac"].item() == pytest.approx(2 / 5)
    # a bound of 0.09 lets token 1 (D .0811) in
    _, grad, _ = run_loss(dppo_kl, clip_high=0.09)
    assert grad[0].item() == pytest.approx(-1.5)  # r = .6 / .4
    assert [name for name, _, _ in DPPOKL(-1, 0.05, 0.5).problems()] == ["clip_divergence_low", "clip_ratio_c"]


#   DRO: loss_t = -(logp A - 0.5 beta (logp - old)^2), d/dlogp = -A + beta (logp - old); beta 0.5 on tokens 1, 2:
#   loss = -(log .6 - .25 log(1.5)^2) - (log .5 - .25 log(1.25)^2); grads -1 + .5 log 1.5, -1 + .5 log 1.25


def test_dro_hand_computed():
    loss, grad, m = run_loss(dro, p=P[:2], q=Q[:2], a=A[:2], beta=0.5)
    want = -(math.log(0.6) - 0.25 * math.log(1.5) ** 2) - (math.log(0.5) - 0.25 * math.log(1.25) ** 2)
    assert loss.item() == pytest.approx(want)
    assert_close(grad, t([-1 + 0.5 * math.log(1.5), -1 + 0.5 * math.log(1.25)]))
    assert m["log_ratio_sq"].item() == pytest.approx((math.log(1.5) ** 2 + math.log(1.25) ** 2) / 2)
    assert DRO(beta=0).problems() == [("beta", 0, "must be > 0")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_jsd_and_extras_on_cuda_in_bfloat16():
    """The kernels as a bf16 policy runs them on a GPU (bf16 hidden states and head, float32 teacher log-probs):
    within bf16 rounding of the float64 reference, with the gradient."""
    g = torch.Generator().manual_seed(2)
    N, H, V = 300, 64, 1000
    h64, w64 = torch.randn(N, H, generator=g, dtype=F64) / 4, torch.randn(V, H, generator=g, dtype=F64) / 4
    teacher = torch.log_softmax(torch.randn(N, V, generator=g, dtype=F64), dim=-1)
    h = h64.to("cuda", torch.bfloat16).requires_grad_()
    w = w64.to("cuda", torch.bfloat16).requires_grad_()
    got = chunked_jsd(h, w, teacher.float().cuda(), beta=0.5, chunk_size=128)
    got.sum().backward()
    hr, wr = h.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    want = generalized_jsd(hr @ wr.T, teacher, beta=0.5, temperature=1.0)
    want.sum().backward()
    assert_close(got.double().cpu(), want, rtol=2e-2, atol=2e-3)
    assert_close(h.grad.double().cpu(), hr.grad, rtol=5e-2, atol=5e-3)
    y = torch.randint(0, V, (N,), generator=g)
    _, _, extra = chunked_logprobs(h.detach(), w.detach(), y.cuda(), extras=("sum_p2", "vocab_logprobs"))
    full = torch.log_softmax(hr.detach() @ wr.detach().T, dim=-1)
    assert_close(extra["vocab_logprobs"].double().cpu(), full, rtol=2e-2, atol=2e-2)
    assert_close(extra["sum_p2"].double().cpu(), full.exp().square().sum(-1), rtol=2e-2, atol=1e-4)
