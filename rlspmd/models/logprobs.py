"""Per-token log-probabilities and entropy from hidden states, without materialising B×T×V logits.

``chunked_logprobs`` projects hidden states to the vocabulary a chunk of tokens at a time and keeps only
the per-token log-prob and entropy. Its backward recomputes each chunk's logits instead of saving them (unless
there is one chunk), so the logits tensor never exists in full, neither in the forward nor in the backward — the
memory cost is one chunk of logits (``chunk_size × V`` in the weight's dtype), whatever the sequence length. The
softmax and its gradient run in float32 on row blocks of a chunk (on CPU small enough to stay in cache).

Gradients, with ``z = logits / τ``, ``p = softmax(z)``, ``lp_t = z_y − lse(z)``, ``H = lse(z) − Σ p z``:

    ∂lp/∂z = onehot(y) − p            ∂H/∂z = −p ⊙ (log p + H)

then ``∂/∂h = (∂/∂z · W) / τ`` and ``∂/∂W = (∂/∂z)ᵀ h / τ``.

**Per-token outputs a component asks for** (``extras``, computed in the same pass over each chunk, no gradient):
``sum_p2``, the sum over the vocabulary of the squared probabilities (the optimal token baseline's path variance,
``rlspmd/algorithms/otb.py``); ``argmax``, 1.0 where the target is the most probable token (a teacher's agreement with
the student's samples); ``vocab_logprobs``, the whole log-softmax of each position (a teacher's distribution, the target
of GKD's JSD: ``4·N·V`` bytes, affordable only where the caller keeps N small).

``chunked_jsd`` is GKD's generalized Jensen-Shannon divergence between the student's distribution (from its hidden
states, with gradient) and a given target distribution, chunk by chunk with the same recompute-in-backward scheme.
With ``s`` the student's and ``t`` the target's log-probs, ``M = (1-β) e^s + β e^t`` and ``J = β KL(T‖M) + (1-β)
KL(S‖M)`` (β = 0: KL(T‖S); β = 1: KL(S‖T), TRL's convention):

    ∂J/∂z = (1-β) p ⊙ ((s − m) − KL(S‖M))      β = 0: p − e^t      β = 1: p ⊙ (s − t − J)
"""

from __future__ import annotations

import math

import torch

DEFAULT_CHUNK = None
"""Tokens per chunk; None picks by device (``auto_chunk_size``)."""
SUM_P2, ARGMAX, VOCAB_LOGPROBS = "sum_p2", "argmax", "vocab_logprobs"
EXTRAS = (SUM_P2, ARGMAX, VOCAB_LOGPROBS)
"""The per-token outputs ``chunked_logprobs`` computes on request (module docstring)."""
CPU_BLOCK_BYTES = 1 << 20
"""On CPU, the float32 logits of one row block (``row_block``): what the elementwise passes over a chunk work on at a
time, so that they run in the core's cache instead of memory."""


def auto_chunk_size(hidden: torch.Tensor, vocab: int, *, row_kernels: bool = False) -> int:
    """1024 tokens on GPU, and on CPU where the C++ row kernels run the elementwise passes (``CPU_KERNELS``); else on
    CPU enough tokens that reading the LM head's weight once per chunk costs no more than the chunk's logits (the
    hidden size, within 128..1024).

    A chunk's logits are written by its matmul, then read by passes over row blocks that fit in cache
    (``row_block``); small chunks would re-read the ``V x H`` weight from memory for every few tokens (measured on
    a 2-core Xeon at V = 49152, H = 576 in bfloat16: 21-token chunks 2.2x slower, forward + backward, than 1024).
    With the row kernels, 1024-token chunks were faster than the hidden size's 576 (SmolLM2's head, bfloat16, 2 CPU
    cores, forward + backward: 292 against 435 ms on 1,024 tokens, one chunk whose logits the backward reuses; 709
    against 845 ms on 2,048).
    """
    if hidden.device.type != "cpu" or row_kernels:
        return 1024
    return max(128, min(1024, hidden.shape[-1]))


def row_block(hidden: torch.Tensor, vocab: int, chunk: int) -> int:
    """Rows per elementwise block: the whole chunk on GPU; on CPU as many as keep a block's float32 logits near
    ``CPU_BLOCK_BYTES`` (cache-resident), at least 1."""
    if hidden.device.type != "cpu":
        return chunk
    return max(1, min(chunk, CPU_BLOCK_BYTES // (4 * vocab)))


CPU_KERNELS = True
"""On CPU, a chunk's elementwise passes run as one C++ call each way (``models/cpu_kernels.py``: ``logprob_rows`` and
its backward, float32 inside, two passes over a row forward and one backward, the forward's log-sum-exp kept for the
backward) instead of about fourteen torch ops per row block (``extras`` still come from torch ops, block by block,
beside the kernels' log-prob and entropy, so those two are the same bits with or without them); not where the kernels
cannot be built. SmolLM2-135M's head on 1,024 tokens (vocabulary 49,152, bfloat16, 2 CPU cores), in 576-token
chunks: forward 106 against 162 ms, backward 361 against 428 ms (its matmuls alone 80 and 228); with the 1,024-token
chunks it then takes (``auto_chunk_size``) the GRPO step's update is 1.88 against 2.05 s and its reference 0.49
against 0.53 s (``stage_ablation.py --variants baseline,torch_logprobs``). False: the torch ops, in their chunks."""


def _row_kernels(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> object | None:
    """``torch.ops.rlspmd_cpu`` where ``CPU_KERNELS`` applies to these inputs, else None."""
    if not CPU_KERNELS or hidden.device.type != "cpu" or targets.dtype != torch.long:
        return None
    if weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    from rlspmd.models.cpu_kernels import cpu_ops

    return cpu_ops()


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0):
    """Reference (full-logits) implementation: ``(logprobs, entropy)`` of shape ``targets.shape``."""
    z = logits.float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _block_logp(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 ``log_softmax(z / temperature)`` of a row block of logits in the weight's dtype (one fused pass when
    the temperature is 1)."""
    if temperature == 1.0:
        return torch.log_softmax(z, dim=-1, dtype=torch.float32)
    return torch.log_softmax(z.float() / temperature, dim=-1)  # not in place: ``z`` may be the kept logits


class _ChunkedLogprob(torch.autograd.Function):
    # Per chunk: one matmul writes its logits (in the weight's dtype); then every elementwise pass runs block by block
    # of rows (``row_block``): on CPU a block stays in cache, where those passes cost about as much as the matmul
    # would from memory. Only the logits of a chunk are large; log p exists a block at a time.
    @staticmethod
    def forward(ctx, hidden_in, weight, bias, targets_in, temperature, chunk_size, with_entropy, extras=()):
        # Outputs are allocated in the targets' shape (not views of flat buffers: FSDP2 hooks module outputs).
        lp_out = hidden_in.new_empty(targets_in.shape, dtype=torch.float32)
        ent_out = hidden_in.new_zeros(targets_in.shape, dtype=torch.float32)
        extra_outs = [
            hidden_in.new_empty(
                (*targets_in.shape, weight.shape[0]) if name == VOCAB_LOGPROBS else targets_in.shape,
                dtype=torch.float32,
            )
            for name in extras
        ]
        flat_extras = {
            name: out.view(-1, weight.shape[0]) if name == VOCAB_LOGPROBS else out.view(-1)
            for name, out in zip(extras, extra_outs)
        }
        hidden, targets = hidden_in.reshape(-1, hidden_in.shape[-1]), targets_in.reshape(-1).contiguous()
        lp, ent = lp_out.view(-1), ent_out.view(-1)
        n = hidden.shape[0]
        block = row_block(hidden, weight.shape[0], chunk_size)
        # One chunk only: keep its logits for the backward instead of recomputing them there (the backward would
        # allocate the same buffer at its start, while the rest of the graph is still alive, so the peak is the same
        # and one matmul is saved). Several chunks: recompute (memory bound).
        single = n <= chunk_size and any(ctx.needs_input_grad[:3])
        saved_z = None
        ops = _row_kernels(hidden, weight, targets)
        lse = hidden_in.new_empty(n, dtype=torch.float32) if ops is not None else None
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = torch.nn.functional.linear(hidden[s:e], weight, bias)
            if ops is not None:  # log-prob and entropy from the row kernels, with or without extras: the same bits
                lp[s:e], ent_chunk, lse[s:e] = ops.logprob_rows(z, targets[s:e], temperature, with_entropy)
                if with_entropy:
                    ent[s:e] = ent_chunk
            if ops is None or flat_extras:
                torch_ent = with_entropy and ops is None
                for b in range(s, e, block):
                    f = min(b + block, e)
                    logp = _block_logp(z[b - s : f - s], temperature)
                    p = logp.exp() if torch_ent or SUM_P2 in flat_extras else None
                    if ops is None:
                        lp[b:f] = logp.gather(-1, targets[b:f, None]).squeeze(-1)
                    if torch_ent:  # H = -sum(p log p): bounded terms, no cancellation between lse and E[z]
                        ent[b:f] = -torch.linalg.vecdot(p, logp)
                    for name, out in flat_extras.items():
                        if name == SUM_P2:
                            out[b:f] = torch.linalg.vecdot(p, p)
                        elif name == ARGMAX:
                            out[b:f] = (logp.argmax(-1) == targets[b:f]).float()
                        else:
                            out[b:f] = logp
            if single:
                saved_z = z
        ctx.mark_non_differentiable(*extra_outs)
        ctx.save_for_backward(hidden_in, weight, bias, targets_in, ent_out, saved_z, lse)
        ctx.set_materialize_grads(False)  # an output nobody differentiates (often the entropy) arrives as None
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.has_bias = bias is not None
        ctx.hidden_shape = hidden_in.shape
        return (lp_out, ent_out, *extra_outs)

    @staticmethod
    def backward(ctx, g_lp, g_ent, *_g_extras):
        hidden, weight, bias, targets, ent, saved_z, lse = ctx.saved_tensors
        hidden, targets, ent = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).contiguous(), ent.reshape(-1)
        tau, chunk = ctx.temperature, ctx.chunk_size
        n = hidden.shape[0]
        if g_lp is None:
            g_lp = torch.zeros_like(ent)
        # d/d(raw logits) = (d/dz) / tau and d/dz is linear in (g_lp, g_ent): fold 1/tau into them once.
        g_lp = g_lp.reshape(-1).float() / tau
        with_entropy = ctx.with_entropy and g_ent is not None
        g_ent = g_ent.reshape(-1).float() / tau if with_entropy else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        block = row_block(hidden, weight.shape[0], chunk)
        g_hidden = torch.empty_like(hidden) if need_h else None
        g_weight = g_bias = None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e]
            z = saved_z if saved_z is not None else torch.nn.functional.linear(h, weight, bias)
            # d/dz = g_lp * (onehot - p) - g_ent * p * (log p + H)  =  p * c + g_lp * onehot,
            # with c = -(g_lp + g_ent * (log p + H)): built block by block, written over the logits (weight dtype).
            gz = z
            if lse is not None:  # the forward's kernels: its lse, and one pass per row written over z
                from rlspmd.models.cpu_kernels import cpu_ops

                cpu_ops().logprob_rows_backward_(
                    z, targets[s:e], lse[s:e], ent[s:e], g_lp[s:e], g_ent[s:e] if with_entropy else None, tau
                )
            else:
                for b in range(s, e, block):
                    f = min(b + block, e)
                    logp = _block_logp(z[b - s : f - s], tau)
                    p = logp.exp()
                    if with_entropy:
                        c = logp.add_(ent[b:f, None]).mul_(-g_ent[b:f, None]).sub_(g_lp[b:f, None])
                        g = p.mul_(c)
                    else:
                        g = p.mul_(-g_lp[b:f, None])
                    g.scatter_add_(-1, targets[b:f, None], g_lp[b:f, None])
                    gz[b - s : f - s] = g
            # The two matmuls run in the weight's dtype, as autograd's would for a linear layer in that dtype.
            if need_h:
                g_hidden[s:e] = (gz @ weight).to(hidden.dtype)
            if need_w:
                part = gz.t() @ h.to(weight.dtype)
                if e == n and s == 0:  # one chunk: its product is the gradient (a float32 round trip would be exact)
                    g_weight = part
                else:
                    g_weight = part.float() if g_weight is None else g_weight.add_(part)
            if need_b:
                part = gz.float().sum(0)
                g_bias = part if g_bias is None else g_bias.add_(part)
        g_weight = g_weight.to(weight.dtype) if need_w else None
        g_bias = g_bias.to(bias.dtype) if need_b else None
        g_hidden = g_hidden.view(ctx.hidden_shape) if need_h else None
        return g_hidden, g_weight, g_bias, None, None, None, None, None


def _chunk_logits(h, weight, bias, temperature):
    z = torch.nn.functional.linear(h, weight, bias).float()
    return z.div_(temperature) if temperature != 1.0 else z


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK,
    with_entropy: bool = True,
    extras: tuple[str, ...] = (),
):
    """Log-prob of ``targets`` and entropy under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Shapes: ``hidden`` (..., H), ``weight`` (V, H), ``targets`` (...) int64 → two float32 tensors of shape
    ``targets.shape``. Entropy is zeros when ``with_entropy`` is False (and costs nothing). ``chunk_size`` None:
    ``auto_chunk_size``. ``extras`` (names from ``EXTRAS``): a third output, ``{name: tensor}``, each of
    ``targets.shape`` except ``vocab_logprobs`` (``(*targets.shape, V)``); constants of autograd.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    unknown = sorted(set(extras) - set(EXTRAS))
    assert not unknown, f"unknown per-token outputs {unknown}; known: {EXTRAS}"
    row_kernels = _row_kernels(hidden, weight, targets) is not None
    chunk_size = chunk_size or auto_chunk_size(hidden, weight.shape[0], row_kernels=row_kernels)
    outs = _ChunkedLogprob.apply(
        hidden, weight, bias, targets, float(temperature), chunk_size, with_entropy, tuple(extras)
    )
    if not extras:
        return outs[0], outs[1]
    return outs[0], outs[1], dict(zip(extras, outs[2:]))


class _ChunkedJSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_in, weight, bias, target_logp, beta, temperature, chunk_size):
        hidden = hidden_in.reshape(-1, hidden_in.shape[-1])
        target = target_logp.reshape(hidden.shape[0], -1)
        jsd = hidden_in.new_empty(hidden.shape[0], dtype=torch.float32)
        for s in range(0, hidden.shape[0], chunk_size):
            e = s + chunk_size
            logp = torch.log_softmax(_chunk_logits(hidden[s:e], weight, bias, temperature), dim=-1)
            jsd[s:e] = _jsd_terms(logp, target[s:e].float(), beta)[0]
        ctx.save_for_backward(hidden_in, weight, bias, target_logp, jsd)
        ctx.set_materialize_grads(False)
        ctx.beta, ctx.temperature, ctx.chunk_size = beta, temperature, chunk_size
        ctx.has_bias = bias is not None
        return jsd.view(hidden_in.shape[:-1])

    @staticmethod
    def backward(ctx, g_jsd):
        hidden_in, weight, bias, target_logp, jsd = ctx.saved_tensors
        if g_jsd is None:
            return None, None, None, None, None, None, None
        hidden = hidden_in.reshape(-1, hidden_in.shape[-1])
        target = target_logp.reshape(hidden.shape[0], -1)
        g = g_jsd.reshape(-1).float() / ctx.temperature
        beta, chunk = ctx.beta, ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_hidden = torch.empty_like(hidden) if need_h else None
        g_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        g_bias = torch.zeros_like(bias, dtype=torch.float32) if (ctx.has_bias and ctx.needs_input_grad[2]) else None
        for s in range(0, hidden.shape[0], chunk):
            e = s + chunk
            h = hidden[s:e]
            logp = torch.log_softmax(_chunk_logits(h, weight, bias, ctx.temperature), dim=-1)
            t = target[s:e].float()
            p = logp.exp()
            if beta == 0:
                gz = p - t.exp()
            elif beta == 1:
                gz = p * (logp - t - jsd[s:e, None])
            else:
                _, m = _jsd_terms(logp, t, beta)
                d = logp - m
                gz = (1 - beta) * p * (d - torch.linalg.vecdot(p, d)[:, None])
            gz = gz * g[s:e, None]
            if need_h:
                g_hidden[s:e] = (gz.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                g_weight.addmm_(gz.t(), h.float())
            if g_bias is not None:
                g_bias += gz.sum(0)
        g_weight = g_weight.to(weight.dtype) if need_w else None
        g_bias = g_bias.to(bias.dtype) if g_bias is not None else None
        g_hidden = g_hidden.view(hidden_in.shape) if need_h else None
        return g_hidden, g_weight, g_bias, None, None, None, None


def _jsd_terms(logp: torch.Tensor, target: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row: the generalized JSD between ``logp`` (student) and ``target`` (teacher), and the mixture's log-probs
    (None at β = 0 or 1)."""
    if beta == 0:
        return torch.linalg.vecdot(target.exp(), target - logp), None
    if beta == 1:
        return torch.linalg.vecdot(logp.exp(), logp - target), None
    m = torch.logaddexp(logp + math.log(1 - beta), target + math.log(beta))
    jsd = beta * torch.linalg.vecdot(target.exp(), target - m) + (1 - beta) * torch.linalg.vecdot(logp.exp(), logp - m)
    return jsd, m


def chunked_jsd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_logprobs: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Per position, the generalized JSD (module docstring) between ``softmax((hidden @ weight.T + bias) /
    temperature)`` and the distribution whose log-probs are ``target_logprobs`` (a constant), never holding more than
    one chunk of the student's logits. Shapes: ``hidden`` (..., H), ``weight`` (V, H), ``target_logprobs`` (..., V) →
    float32 (...), differentiable in ``hidden``, ``weight`` and ``bias``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    assert 0 <= beta <= 1, beta
    assert target_logprobs.shape == (*hidden.shape[:-1], weight.shape[0]), (target_logprobs.shape, hidden.shape)
    chunk_size = chunk_size or auto_chunk_size(hidden, weight.shape[0])
    return _ChunkedJSD.apply(
        hidden, weight, bias, target_logprobs.detach(), float(beta), float(temperature), chunk_size
    )


class JSDTarget:
    """What a student's forward needs for GKD's loss term: the teacher's log-probs over the vocabulary at the positions
    the student scores (``vocab_logprobs`` of the teacher's forward on the same micro-batch), beta and the temperature.

    A plain class, not a dataclass or a tuple, on purpose: FSDP2 casts the floating-point tensors it finds in a
    module's inputs (lists, dicts, dataclasses) to its compute dtype, and these log-probs must stay float32."""

    __slots__ = ("teacher_logprobs", "beta", "temperature")

    def __init__(self, teacher_logprobs: torch.Tensor, *, beta: float, temperature: float):
        self.teacher_logprobs, self.beta, self.temperature = teacher_logprobs, beta, temperature
