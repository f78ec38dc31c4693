"""Token sampling for the native engine.

Sampling uses the inverse CDF with one uniform draw per row (``searchsorted`` on the cumulative
probabilities) rather than ``torch.multinomial``, whose exponential-race implementation draws V random
numbers per row and dominated decode time on CPU. The distribution is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample_next(logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator | None):
    """Next token per row and its log-prob under ``softmax(logits / T)`` (T = 1 for greedy).

    The returned log-prob ignores top-k/top-p filtering: it is what the trainer computes for the same
    token, so the rollout-vs-trainer log-prob gap measures numerics, not the sampling filter.
    """
    if params.greedy:
        tok = logits_BV.argmax(-1)
        logp = torch.log_softmax(logits_BV, -1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    z = logits_BV / params.temperature if params.temperature != 1.0 else logits_BV
    logp = torch.log_softmax(z, -1)
    if params.top_k > 0 or params.top_p < 1.0:
        z = _filter(z, params.top_k, params.top_p)
        probs = torch.softmax(z, -1)
    else:
        probs = logp.exp()
    cdf = probs.cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device, dtype=cdf.dtype) * cdf[:, -1:]
    tok = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _filter(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, idx = torch.sort(z, dim=-1, descending=True)
        p = torch.softmax(sorted_z, -1)
        # drop a token when the mass strictly before it already reaches top_p (the first token is always kept)
        drop_sorted = (p.cumsum(-1) - p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, idx, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z
