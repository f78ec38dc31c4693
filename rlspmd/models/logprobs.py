"""Per-token log-probabilities and entropy from hidden states, without materialising B×T×V logits.

``chunked_logprobs`` projects hidden states to the vocabulary a chunk of tokens at a time and keeps only
the per-token log-prob and entropy. Its backward recomputes each chunk's logits instead of saving them,
so the float32 logits tensor never exists in full, neither in the forward nor in the backward — the memory
cost is one chunk of logits (``chunk_size × V``), whatever the sequence length.

Gradients, with ``z = logits / τ``, ``p = softmax(z)``, ``lp_t = z_y − lse(z)``, ``H = lse(z) − Σ p z``:

    ∂lp/∂z = onehot(y) − p            ∂H/∂z = −p ⊙ (log p + H)

then ``∂/∂h = (∂/∂z · W) / τ`` and ``∂/∂W = (∂/∂z)ᵀ h / τ``.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 1024


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0):
    """Reference (full-logits) implementation: ``(logprobs, entropy)`` of shape ``targets.shape``."""
    z = logits.float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_in, weight, bias, targets_in, temperature, chunk_size, with_entropy):
        # Outputs are allocated in the targets' shape (not views of flat buffers: FSDP2 hooks module outputs).
        lp_out = hidden_in.new_empty(targets_in.shape, dtype=torch.float32)
        ent_out = hidden_in.new_empty(targets_in.shape, dtype=torch.float32)
        hidden, targets = hidden_in.reshape(-1, hidden_in.shape[-1]), targets_in.reshape(-1)
        lp, ent = lp_out.view(-1), ent_out.view(-1)
        n = hidden.shape[0]
        for s in range(0, n, chunk_size):
            z = _chunk_logits(hidden[s : s + chunk_size], weight, bias, temperature)
            lse = torch.logsumexp(z, dim=-1)
            lp[s : s + chunk_size] = z.gather(-1, targets[s : s + chunk_size, None]).squeeze(-1) - lse
            if with_entropy:
                ent[s : s + chunk_size] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
            else:
                ent[s : s + chunk_size] = 0.0
        ctx.save_for_backward(hidden_in, weight, bias, targets_in, ent_out)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.has_bias = bias is not None
        ctx.hidden_shape = hidden_in.shape
        return lp_out, ent_out

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, ent = ctx.saved_tensors
        hidden, targets, ent = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), ent.reshape(-1)
        g_lp, g_ent = g_lp.reshape(-1), g_ent.reshape(-1)
        tau, chunk = ctx.temperature, ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_hidden = torch.empty_like(hidden) if need_h else None
        g_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        g_bias = torch.zeros_like(bias, dtype=torch.float32) if (ctx.has_bias and ctx.needs_input_grad[2]) else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            z = _chunk_logits(h, weight, bias, tau)
            p = torch.softmax(z, dim=-1)
            # d(loss)/dz = g_lp * (onehot - p) + g_ent * (-p * (log p + H))
            gz = -p * g_lp[s : s + chunk, None]
            gz.scatter_add_(-1, targets[s : s + chunk, None], g_lp[s : s + chunk, None])
            if ctx.with_entropy:
                logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
                gz -= p * (logp + ent[s : s + chunk, None]) * g_ent[s : s + chunk, None]
            gz = gz / tau
            if need_h:
                g_hidden[s : s + chunk] = (gz.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                g_weight += gz.t() @ h.float()
            if g_bias is not None:
                g_bias += gz.sum(0)
        g_weight = g_weight.to(weight.dtype) if need_w else None
        g_bias = g_bias.to(bias.dtype) if g_bias is not None else None
        g_hidden = g_hidden.view(ctx.hidden_shape) if need_h else None
        return g_hidden, g_weight, g_bias, None, None, None, None


def _chunk_logits(h, weight, bias, temperature):
    z = torch.nn.functional.linear(h, weight, bias).float()
    return z / temperature if temperature != 1.0 else z


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` and entropy under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Shapes: ``hidden`` (..., H), ``weight`` (V, H), ``targets`` (...) int64 → two float32 tensors of shape
    ``targets.shape``. Entropy is zeros when ``with_entropy`` is False (and costs nothing).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    return _ChunkedLogprob.apply(hidden, weight, bias, targets, float(temperature), chunk_size, with_entropy)
