"""Chunked log-prob/entropy kernel against the full-logits reference: values and gradients."""

import pytest
import torch

from rlspmd.models import logprobs
from rlspmd.models.logprobs import chunked_logprobs, logprobs_from_logits


@pytest.fixture(params=[True, False], ids=["cpu_kernels", "torch_ops"])
def kernels(request, monkeypatch):
    """Both paths of a chunk's elementwise passes on CPU: the C++ row kernels, and the torch ops."""
    monkeypatch.setattr(logprobs, "CPU_KERNELS", request.param)
    return request.param


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 5, 1024])  # 1024: one chunk, whose log p the forward keeps for the backward
@pytest.mark.parametrize("uses", ["both", "lp", "ent"])  # an unused output reaches the backward as None
def test_chunked_equals_full(temperature, chunk, uses, kernels):
    torch.manual_seed(0)
    B, T, H, V = 3, 7, 16, 50  # V = 50: the kernels' vectors of 16 and a scalar tail
    h = torch.randn(B, T, H, requires_grad=True)
    W = torch.randn(V, H, requires_grad=True)
    b = torch.randn(V, requires_grad=True)
    y = torch.randint(0, V, (B, T))
    coef_lp, coef_ent = torch.randn(B, T), torch.randn(B, T)
    if uses == "lp":
        coef_ent = None
    if uses == "ent":
        coef_lp = None

    def loss(lp, ent):
        return sum((x * c).sum() for x, c in ((lp, coef_lp), (ent, coef_ent)) if c is not None)

    assert (logprobs._row_kernels(h, W, y) is not None) == kernels  # the path under test runs
    lp, ent = chunked_logprobs(h, W, y, bias=b, temperature=temperature, chunk_size=chunk)
    loss(lp, ent).backward()
    grads = [x.grad.clone() for x in (h, W, b)]
    for x in (h, W, b):
        x.grad = None
    lp2, ent2 = logprobs_from_logits(torch.nn.functional.linear(h, W, b), y, temperature=temperature)
    loss(lp2, ent2).backward()
    torch.testing.assert_close(lp, lp2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent2, rtol=1e-5, atol=1e-5)
    for g, x in zip(grads, (h, W, b)):
        torch.testing.assert_close(g, x.grad, rtol=1e-4, atol=1e-5)


def test_hand_computed_two_token_vocab():
    # logits [0, ln 3] -> p = [1/4, 3/4]; token 1: log(3/4); entropy = -(1/4 ln 1/4 + 3/4 ln 3/4)
    import math

    h = torch.tensor([[1.0]])
    W = torch.tensor([[0.0], [math.log(3.0)]])
    lp, ent = chunked_logprobs(h, W, torch.tensor([1]))
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)


def test_entropy_off_is_zero_and_outputs_are_not_views():
    h, W, y = torch.randn(2, 3, 4), torch.randn(6, 4), torch.randint(0, 6, (2, 3))
    lp, ent = chunked_logprobs(h, W, y, with_entropy=False)
    assert ent.abs().sum() == 0 and lp.shape == (2, 3)
    assert lp._base is None and ent._base is None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cpu_kernels_equal_the_torch_ops_in_bfloat16(temperature, monkeypatch):
    """A bfloat16 head (SmolLM2's vocabulary, a few rows, two chunks): the C++ row kernels give the torch ops'
    log-probs and entropies to float32's precision, and gradients within one bfloat16 rounding of d/dz (both compute
    in float32 and round d/dz to the weight's dtype once)."""
    g = torch.Generator().manual_seed(7)
    N, H, V = 12, 64, 49152
    h0 = torch.randn(N, H, generator=g).bfloat16()
    W0 = (torch.randn(V, H, generator=g) * 0.2).bfloat16()
    y = torch.randint(0, V, (N,), generator=g)
    c_lp, c_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    out = {}
    for flag in (True, False):
        monkeypatch.setattr(logprobs, "CPU_KERNELS", flag)
        h, W = h0.clone().requires_grad_(), W0.clone().requires_grad_()
        lp, ent = chunked_logprobs(h, W, y, temperature=temperature, chunk_size=8)
        ((lp * c_lp).sum() + (ent * c_ent).sum()).backward()
        out[flag] = (lp, ent, h.grad.float(), W.grad.float())
    for name, a, b in zip(("lp", "ent", "d_hidden", "d_weight"), out[True], out[False]):
        # lp and ent: sums over 49,152 terms in float32, in different orders (the scalar build sums one lane)
        tol = dict(rtol=2e-5, atol=1e-4) if name in ("lp", "ent") else dict(rtol=2e-2, atol=1e-2 * b.abs().max())
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")
