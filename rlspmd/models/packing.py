"""Padding-free ("packed") training forwards, shared by every model wrapper (policy, reference, value, reward),
and the packed-attention kernels' calls.

A micro-batch in the padded layout of ``rlspmd.protocol`` (left-padded prompt, right-padded response) is packed
into ONE sequence of its valid tokens::

    input_ids_BL  [. . p p r r r .]      input_ids_1T  [p p r r r | q q q r r | ...]
                  [. q q q r r . .]  ->  position_ids  [0 1 2 3 4 | 0 1 2 3 4 | ...]   (restart per sample)
                                         cu_seqlens    [0, 5, 10, ...]                 (int32, B + 1)

so every token-wise layer (embedding, projections, MLP, norms, LM head) runs on ``T = Σ valid`` tokens instead of
``B × L``. Only attention needs the sample boundaries. ``pack`` builds them ONCE per micro-batch, as a
``PackedAttention`` (the kernel's name, ``cu_seqlens``, the longest sample, and FlexAttention's block mask), and the
forward hands it to every layer through transformers' attention keywords: a model's forward passes unknown keywords
down to its attention function, so the layers share one object and none of them recomputes anything::

    decoder(input_ids=p.input_ids_1T, position_ids=p.position_ids_1T, attention_mask=<4-D placeholder>,
            **p.attention_kwargs())          # {"packed_attention": PackedAttention, "cu_seq_lens_q": ..., ...}

We register an attention implementation, ``rlspmd_packed`` (``AttentionInterface`` plus a mask function in
``AttentionMaskInterface``), instead of patching model code. A call that carries ``packed_attention`` runs the
micro-batch's kernel; every other call (a padded batch with a 2-D mask, generation with a KV cache) gets
transformers' own SDPA mask and SDPA attention, so the same model object still serves padded forwards and
``generate``. ``attn_implementation="flash_attention_2"`` (transformers' own) also packs, through the
``cu_seq_lens_q/k`` keys its flash integration reads.

The kernels and which one runs where (``ModelConfig.attn_kernel``): ``models/attn_kernels.py``; their calls on a
pack are ``KERNELS`` below.

Host syncs: exactly one device-to-host copy per packed micro-batch, in ``TokenCounts.of`` (the valid-token counts:
the packed length ``T`` and the kernels' integer max length are host integers). A caller that already has the
counts on the host passes them (``pack(..., counts=...)``) and the packed forward then syncs nowhere. Internal
invariant checks that would read device data run on CPU only.

Sequence parallelism (``mesh.actor_sp``, ``distributed/sequence_parallel.py``) hands each rank a slice of one pack;
its ``PackedAttention`` then carries a ``seq`` object through which attention sees the whole pack (the kernels here
run on the whole pack for a share of the heads, or on all-gathered keys and values).

Equivalence with the padded forward (log-probs, entropies, values, losses, gradients) and between kernels is tested
in ``tests/test_packing.py`` (CUDA kernels in its ``gpu``-marked tests). Simplification: a sliding-window layer is
only supported while every sample fits in the window (no kernel here applies a window); longer samples raise.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rlspmd.models.attn_kernels import compiled_flex, flex_api, varlen_api

PACKED_ATTENTION = "rlspmd_packed"
"""The attention implementation name registered with transformers (SDPA semantics, plus packed varlen calls)."""

SHARES_PROMPTS = ("sdpa_loop", "cpu_fused")
"""The kernels that run packs with shared prompts (``pack(..., share_prompts=True)``)."""

FLEX_BLOCK = 128
"""FlexAttention's sparse block size (its default)."""


# ---------------------------------------------------------------------------------------------------------------
# packing


@dataclass(frozen=True)
class TokenCounts:
    """Host-side valid-token counts of a micro-batch: what packing needs to know on the host."""

    lengths: tuple[int, ...]
    """Valid tokens (prompt + response) per row."""
    response_lengths: tuple[int, ...]
    """Valid tokens among the last ``response_len`` columns per row (empty when there is no response)."""
    shares_prompt: tuple[bool, ...] = ()
    """Per row: its prompt (the columns before the last ``response_len``: ids and mask) is the previous row's, and is
    not empty (a GRPO group's samples). Empty when not asked for (``of(..., input_ids_BL=...)``)."""

    @classmethod
    def of(
        cls, attention_mask_BL: torch.Tensor, response_len: int = 0, input_ids_BL: torch.Tensor | None = None
    ) -> "TokenCounts":
        """The counts (and with ``input_ids_BL`` and a response, ``shares_prompt``) in ONE device-to-host copy (the
        packed path's only host sync per micro-batch)."""
        per_row = [attention_mask_BL.sum(-1)]
        if response_len:
            per_row.append(attention_mask_BL[:, -response_len:].sum(-1))
        share = input_ids_BL is not None and response_len > 0
        if share:
            per_row.append(same_prompt_as_previous(input_ids_BL, attention_mask_BL, response_len).long())
        rows = torch.stack(per_row).tolist()
        return cls(
            tuple(rows[0]),
            tuple(rows[1]) if response_len else (),
            tuple(bool(x) for x in rows[2]) if share else (),
        )


def same_prompt_as_previous(input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor, response_len: int):
    """(B,) bool: row ``b`` has row ``b - 1``'s prompt (ids and mask of the columns before the last ``response_len``),
    and that prompt has a valid token (row 0: False). Device ops only."""
    P = input_ids_BL.shape[1] - response_len
    m = attention_mask_BL[:, :P].bool()
    ids = input_ids_BL[:, :P].masked_fill(~m, 0)
    same = torch.zeros(input_ids_BL.shape[0], dtype=torch.bool, device=input_ids_BL.device)
    if P > 0:
        same[1:] = (ids[1:] == ids[:-1]).all(-1) & (m[1:] == m[:-1]).all(-1) & m[1:].any(-1)
    return same


@dataclass(frozen=True)
class PackedAttention:
    """Everything the attention layers of one packed forward need, built once per micro-batch by ``pack``."""

    kernel: str
    cu_seqlens: torch.Tensor
    """(N + 1,) int32 sample boundaries in the pack, on the device (flash-attn's varlen convention)."""
    max_seqlen: int
    lengths: tuple[int, ...]
    """Per-sample lengths on the host (``sdpa_loop`` slices by them, without reading ``cu_seqlens`` back)."""
    block_mask: object | None = None
    """FlexAttention's document-causal ``BlockMask`` (``flex`` only)."""
    groups: tuple[tuple[int, ...], ...] | None = None
    """A pack with shared prompts (``pack(..., share_prompts=True)``): per group of rows that share a prompt, in pack
    order, ``(prompt tokens, response tokens of each row...)``; the group's tokens are its prompt once, then each row's
    response, and ``cu_seqlens``/``lengths`` bound the groups. None: every sample is whole and contiguous."""
    prefix: "PrefixBatch | None" = None
    """With ``groups``: every group's prompt and every response attended in two batched SDPA calls
    (``prefix_batch``), or None where padding them would cost more than the calls it saves (one call per segment)."""
    seq: object | None = None
    """Sequence parallelism (``distributed/sequence_parallel.py: SequenceShard``): this rank holds a slice of the pack,
    the rest of this object describes the whole pack, and attention goes through ``seq.attention``. None: the rank
    holds the whole pack."""

    def kwargs(self) -> dict:
        """The keyword arguments transformers forwards to the attention function for a packed sequence: ours, and
        the ``cu_seq_lens``/``max_length`` keys of transformers' own flash-attention integration."""
        return dict(
            packed_attention=self,
            cu_seq_lens_q=self.cu_seqlens,
            cu_seq_lens_k=self.cu_seqlens,
            max_length_q=self.max_seqlen,
            max_length_k=self.max_seqlen,
        )


@dataclass
class PackedBatch:
    """One micro-batch's valid tokens as a single sequence, and the maps back to the padded ``(B, L)`` layout."""

    input_ids_1T: torch.Tensor
    position_ids_1T: torch.Tensor
    """(1, T), or (3, 1, T) for M-RoPE."""
    attention: PackedAttention
    token_index_T: torch.Tensor
    """(T,) flat index into ``B * L`` of each packed token (row-major order)."""
    shape: tuple[int, int]
    """(B, L) of the padded layout."""
    response_len: int = 0
    target_pos_N: torch.Tensor | None = None
    """(N,) packed position of each valid response token (row-major). None without ``response_len``."""
    predictor_pos_N: torch.Tensor | None = None
    """(N,) packed position of the hidden state that predicts each valid response token: the token before it in its
    row (``target_pos_N - 1``, except at a shared prompt's rows, whose first response token follows the group's
    prompt). None without ``response_len``."""
    response_rows_N: torch.Tensor | None = None
    response_cols_N: torch.Tensor | None = None
    """(N,) row and column in the ``(B, response_len)`` layout of each valid response token."""

    source_BL: torch.Tensor | None = None
    """With shared prompts: (B, L) packed position of each valid token of the padded layout (a row's prompt tokens
    at its group's one copy), -1 at padding. None otherwise (``token_index_T`` is then a one-to-one map)."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids_1T.shape[1]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.attention.cu_seqlens

    @property
    def max_seqlen(self) -> int:
        return self.attention.max_seqlen

    def attention_kwargs(self) -> dict:
        """The keyword arguments transformers forwards to the attention function for a packed sequence: ours, and
        the ``cu_seq_lens``/``max_length`` keys of transformers' own flash-attention integration."""
        return self.attention.kwargs()

    def unpack(self, x_T: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``(T, ...)`` per packed token -> ``(B, L, ...)`` with ``fill`` at padding (differentiable)."""
        B, L = self.shape
        if self.source_BL is not None:  # a shared prompt's tokens appear in each of its rows
            src = self.source_BL.reshape(-1)
            out = x_T.index_select(0, src.clamp(min=0))
            pad = (src < 0).view(-1, *([1] * (x_T.dim() - 1)))
            return out.masked_fill(pad, fill).view(B, L, *x_T.shape[1:])
        out = x_T.new_full((B * L, *x_T.shape[1:]), fill)
        return out.index_copy(0, self.token_index_T, x_T).view(B, L, *x_T.shape[1:])

    def scatter_responses(self, x_N: torch.Tensor) -> torch.Tensor:
        """``(N,)`` per valid response token -> a fresh ``(B, response_len)`` tensor, 0 at padding (differentiable;
        not a view, which FSDP2 warns about for module outputs)."""
        zeros = x_N.new_zeros(self.shape[0], self.response_len)
        return zeros.index_put((self.response_rows_N, self.response_cols_N), x_N)


def pack(
    input_ids_BL: torch.Tensor,
    attention_mask_BL: torch.Tensor,
    position_ids_BL: torch.Tensor,
    *,
    kernel: str = "sdpa_loop",
    response_len: int = 0,
    counts: TokenCounts | None = None,
    share_prompts: bool = False,
) -> PackedBatch:
    """Pack the tokens with ``attention_mask_BL == 1`` of each row, in order, into one sequence, and build the
    attention metadata of ``kernel`` (a concrete name, see ``resolve_attn_kernel``) once for all layers.

    Position ids are taken from ``position_ids_BL`` (the rollout layout counts them from 0 at each sample's first
    valid token), so RoPE sees exactly what the padded forward sees. Leading dims are carried: M-RoPE's ``(3, B, L)``
    positions (``rlspmd.models.vision``) pack to ``(3, 1, T)``. ``response_len`` also locates the valid response
    tokens (the last ``response_len`` columns), each of which needs a valid token before it in its row. ``counts``:
    the host-side counts if the caller has them (else one device-to-host copy here).

    ``share_prompts`` (the ``SHARES_PROMPTS`` kernels, with a response): consecutive rows with the same prompt (a GRPO
    group's samples, ``TokenCounts.shares_prompt``) pack that prompt once, followed by each row's response, and
    attention lets each response see the group's prompt (``prefix_loop_attention``). Every token-wise layer then runs on
    fewer tokens; log-probs, values and gradients are those of the unshared pack (up to float summation order).
    """
    B, L = input_ids_BL.shape
    dev = input_ids_BL.device
    share_prompts = share_prompts and response_len > 0
    if share_prompts and kernel not in SHARES_PROMPTS:
        raise ValueError(
            f"packing with shared prompts needs the sdpa_loop or cpu_fused attention kernel, not {kernel!r}"
        )
    if counts is None or (share_prompts and not counts.shares_prompt):
        counts = TokenCounts.of(attention_mask_BL, response_len, input_ids_BL if share_prompts else None)
    shared = share_prompts and any(counts.shares_prompt)
    valid_BL = attention_mask_BL.bool()
    keep_BL, lengths, lead_B = valid_BL, counts.lengths, None
    if shared:
        member_B = torch.tensor(counts.shares_prompt, device=dev)
        keep_BL = valid_BL.clone()
        keep_BL[:, : L - response_len] &= ~member_B[:, None]
        groups: list[list[int]] = []
        lead: list[int] = []  # the row whose prompt each row's response follows in the pack
        for b, (n, r, member) in enumerate(zip(counts.lengths, counts.response_lengths, counts.shares_prompt)):
            if member:
                groups[-1].append(r)
            else:
                groups.append([n - r, r])
            lead.append(lead[-1] if member else b)
        lengths = tuple(sum(g) for g in groups)
        lead_B = torch.tensor(lead, device=dev)
    max_len = max(max(counts.lengths, default=1), 1)  # the longest sample, its prompt counted
    T = sum(lengths)
    # nonzero_static: the output size is known on the host, so no device-to-host read of the count (plain nonzero syncs)
    token_index_T = torch.nonzero_static(keep_BL.reshape(-1), size=T).squeeze(-1)
    lengths_B = torch.tensor(lengths, device=dev) if shared else valid_BL.sum(-1)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=dev)
    cu[1:] = lengths_B.cumsum(0)
    block_mask = document_causal_block_mask(lengths_B, T) if kernel == "flex" else None
    packed = PackedBatch(
        input_ids_1T=input_ids_BL.reshape(-1)[token_index_T][None],
        position_ids_1T=position_ids_BL.reshape(*position_ids_BL.shape[:-2], -1)[..., token_index_T].unsqueeze(-2),
        attention=PackedAttention(
            kernel,
            cu,
            max_len,
            lengths,
            block_mask,
            groups=tuple(map(tuple, groups)) if shared else None,
            prefix=prefix_batch(groups, dev) if shared else None,
        ),
        token_index_T=token_index_T,
        shape=(B, L),
    )
    if response_len:
        _locate_responses(packed, valid_BL, response_len, n_valid=sum(counts.response_lengths), lead_B=lead_B)
    return packed


def _locate_responses(
    packed: PackedBatch, valid_BL: torch.Tensor, R: int, *, n_valid: int, lead_B: torch.Tensor | None
) -> None:
    """Fill ``target_pos_N``, ``predictor_pos_N`` and the ``(B, R)`` coordinates of the valid response tokens (gathers
    only, no sync). ``lead_B``: with shared prompts, the row whose prompt each row's response follows in the pack."""
    B, L = packed.shape
    dev = valid_BL.device
    flat_N = torch.nonzero_static(valid_BL[:, -R:].reshape(-1), size=n_valid).squeeze(-1)  # into (B, R)
    rows_N, cols_N = flat_N // R, flat_N % R
    where_BL = torch.full((B * L,), -1, dtype=torch.long, device=dev)
    where_BL[packed.token_index_T] = torch.arange(packed.num_tokens, device=dev)
    where_BL = where_BL.view(B, L)
    if lead_B is not None:  # a member's prompt tokens are its group's
        where_BL[:, : L - R] = where_BL[lead_B, : L - R]
        packed.source_BL = where_BL
    target_N = where_BL[rows_N, L - R + cols_N]
    # the token before a response token is in its row's previous column (valid tokens are contiguous in a row)
    col_N = L - R + cols_N - 1
    before_N = where_BL[rows_N, col_N.clamp(min=0)].masked_fill(col_N < 0, -1)
    if dev.type == "cpu":  # invariants; reading them on CUDA would be a host sync per micro-batch
        assert bool((target_N >= 0).all()), "a response position is a padding token"
        assert bool((before_N >= 0).all()), "a response token has no token before it"
    packed.response_len, packed.target_pos_N, packed.predictor_pos_N = R, target_N, before_N
    packed.response_rows_N, packed.response_cols_N = rows_N, cols_N


def document_causal_block_mask(lengths_B: torch.Tensor, T: int, *, block: int = FLEX_BLOCK):
    """FlexAttention ``BlockMask`` for causal attention within each of the packed samples of ``lengths_B``.

    Built at block granularity from the samples' boundaries (``create_block_mask`` would evaluate the mask on all
    ``T × T`` pairs): samples are contiguous and in order, so with ``first``/``last`` the sample of a block's first and
    last token, KV block ``j`` touches query block ``i`` iff ``j <= i`` and ``last[j] >= first[i]``, and every pair of
    the two is allowed ("full", no mask evaluation) iff ``j < i`` and ``first[j] == last[i]``. Partial blocks apply
    the exact mask, ``same sample and q >= kv``. All device ops, no host sync.
    """
    BlockMask = flex_api()[1]
    dev = lengths_B.device
    doc_T = torch.repeat_interleave(torch.arange(lengths_B.numel(), device=dev), lengths_B, output_size=T)
    n = -(-T // block)
    starts = torch.arange(n, device=dev) * block
    first, last = doc_T[starts], doc_T[(starts + block).clamp(max=T) - 1]
    i, j = torch.arange(n, device=dev)[:, None], torch.arange(n, device=dev)[None, :]
    touch = (j <= i) & (last[None, :] >= first[:, None])
    full = (j < i) & (first[None, :] == last[:, None])

    def blocks(m):  # (counts, indices) with the selected blocks first, in increasing order
        return (
            m.sum(-1, dtype=torch.int32)[None, None],
            torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)[None, None],
        )

    def document_causal(b, h, q_idx, kv_idx):
        return (doc_T[q_idx] == doc_T[kv_idx]) & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(
        *blocks(touch & ~full), *blocks(full), BLOCK_SIZE=block, mask_mod=document_causal, seq_lengths=(T, T)
    )


# ---------------------------------------------------------------------------------------------------------------
# attention kernels: (T, heads, D) packed inputs (GQA allowed) -> (T, heads, D)


def cpu_backward_in_float32(q, k, v) -> bool:
    """Whether ``sdpa_loop_attention`` runs these inputs in float32: half precision on CPU, differentiated."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float16)
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
    )


def _sdpa_thd(q, k, v, *, scale: float, dropout: float, **mask) -> torch.Tensor:
    """SDPA on ``(tokens, heads, D)`` slices of a pack (grouped-query heads unrepeated)."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        scale=scale,
        dropout_p=dropout,
        enable_gqa=k.shape[1] != q.shape[1],
        **mask,
    )
    return o[0].transpose(0, 1)


def sdpa_loop_attention(q_THD, k_TKD, v_TKD, lengths: Sequence[int], *, scale: float, dropout: float = 0.0):
    """One causal SDPA call per sample on its contiguous slice of the pack (lengths on the host: no sync).

    On CPU, half-precision inputs that need gradients run in float32 (output cast back): torch's CPU flash-attention
    backward is 2x slower in bfloat16 than in float32, upcasts included (SmolLM2's 9 heads / 3 KV heads, 16 samples
    of 60-112 tokens: 42-51 ms against 19-27 ms per layer on a 2-core Xeon with AMX), and no less exact.
    """
    if cpu_backward_in_float32(q_THD, k_TKD, v_TKD):
        out = sdpa_loop_attention(q_THD.float(), k_TKD.float(), v_TKD.float(), lengths, scale=scale, dropout=dropout)
        return out.to(q_THD.dtype)
    outs = []
    for q, k, v in zip(q_THD.split(lengths), k_TKD.split(lengths), v_TKD.split(lengths)):
        outs.append(_sdpa_thd(q, k, v, scale=scale, dropout=dropout, is_causal=True) if q.shape[0] else q)
    return torch.cat(outs)


def prefix_loop_attention(q_THD, k_TKD, v_TKD, groups: Sequence[Sequence[int]], *, scale: float, dropout: float = 0.0):
    """``sdpa_loop_attention`` over a pack with shared prompts (``PackedAttention.groups``): per group, one causal SDPA
    call on its prompt, then one per response over the prompt's and its own keys and values, causal with the queries
    aligned to the end of the keys (``causal_lower_right``). Each response sees exactly what it sees in its own whole
    sample; the prompt's keys and values get the gradients of every response of its group. ``prefix_batched_attention``
    computes the same in two calls, and runs instead wherever its padding costs less than the calls it saves
    (``prefix_batch``)."""
    from torch.nn.attention.bias import causal_lower_right

    if cpu_backward_in_float32(q_THD, k_TKD, v_TKD):
        out = prefix_loop_attention(q_THD.float(), k_TKD.float(), v_TKD.float(), groups, scale=scale, dropout=dropout)
        return out.to(q_THD.dtype)

    def sdpa(q, k, v, **mask):
        return _sdpa_thd(q, k, v, scale=scale, dropout=dropout, **mask)

    sizes = [n for g in groups for n in g]
    qs, ks, vs = q_THD.split(sizes), k_TKD.split(sizes), v_TKD.split(sizes)
    outs = list(qs)  # empty segments stay as they are
    at = 0
    for g in groups:
        P, kp, vp = g[0], ks[at], vs[at]
        if P:
            outs[at] = sdpa(qs[at], kp, vp, is_causal=True)
        for i in range(at + 1, at + len(g)):
            n = sizes[i]
            if n:
                mask = dict(is_causal=True) if P == 0 else dict(attn_mask=causal_lower_right(n, P + n))
                outs[i] = sdpa(qs[i], torch.cat((kp, ks[i])), torch.cat((vp, vs[i])), **mask)
        at += len(g)
    return torch.cat(outs)


PREFIX_CALL_PAIRS = 5000
"""What one SDPA call costs beyond its work, in query-key pairs (``prefix_batch``'s choice): on a 2-core Xeon, one
response's call (64 queries, 112 keys, SmolLM2's 9 / 3 heads, float32, forward and backward) took 0.70 ms alone and
0.40 ms within a batch of 16, about 5,000 pairs' worth of the difference."""


class PrefixBatch(NamedTuple):
    """``prefix_batched_attention``'s plan for a pack with shared prompts, built once per micro-batch on the host.

    Responses: ``(R, N)`` rows of pack positions (each response's tokens, padded to the longest ``N`` by repeating its
    last token) against ``(R, Pm + N)`` key positions (its group's prompt padded to the longest prompt ``Pm``, then its
    own tokens), under a boolean mask ``(R, 1, N, Pm + N)``: the prompt's real tokens, and its own tokens causally
    (pad rows see what the last real row sees, so no row is empty). Prompts: ``(G, Pm)`` positions, causal over their
    real tokens. ``where``: each pack position's row in the concatenated ``(R * N + G * Pm)`` outputs."""

    resp_q: torch.Tensor
    resp_kv: torch.Tensor
    resp_mask: torch.Tensor
    prompt_pos: torch.Tensor | None
    prompt_mask: torch.Tensor | None
    where: torch.Tensor


def prefix_batch(groups: Sequence[Sequence[int]], device: torch.device) -> PrefixBatch | None:
    """The ``PrefixBatch`` of ``groups`` (``PackedAttention.groups``), or None where the padded work exceeds the
    per-segment calls' by more than the calls it saves cost (``PREFIX_CALL_PAIRS`` each; e.g. responses of very
    different lengths): ``prefix_loop_attention`` then runs one call per segment."""
    prompts: list[tuple[int, int]] = []  # (start, length)
    resps: list[tuple[int, int, int, int]] = []  # (start, length, its prompt's start, its prompt's length)
    at = 0
    for g in groups:
        P = g[0]
        if P:
            prompts.append((at, P))
        pos = at + P
        for n in g[1:]:
            if n:
                resps.append((pos, n, at, P))
            pos += n
        at = pos
    if not resps:
        return None
    R, G = len(resps), len(prompts)
    N = max(n for _, n, _, _ in resps)
    Pm = max((P for _, P in prompts), default=0)
    exact = sum(n * (P + (n + 1) / 2) for _, n, _, P in resps) + sum(P * (P + 1) / 2 for _, P in prompts)
    padded = R * N * (Pm + N) + G * Pm * Pm
    if padded - exact > PREFIX_CALL_PAIRS * (R + G - 1 - (G > 0)):
        return None
    start, n, p_start, P = (torch.tensor(c) for c in zip(*resps))
    rows = torch.arange(N)
    last = torch.minimum(rows[None], n[:, None] - 1)  # (R, N): pad rows repeat the last real one
    resp_q = start[:, None] + last
    prompt_kv = p_start[:, None] + torch.minimum(torch.arange(Pm)[None], (P[:, None] - 1).clamp(min=0))
    slot = torch.arange(Pm + N)[None, None]  # key slot: the prompt's Pm, then the response's N
    resp_mask = torch.where(slot < Pm, slot < P[:, None, None], slot - Pm <= last[:, :, None])
    where = torch.empty(at, dtype=torch.long)
    _fill_runs(where, start, n, torch.arange(R) * N)
    prompt_pos = prompt_mask = None
    if prompts:
        p_start, P = (torch.tensor(c) for c in zip(*prompts))
        cols = torch.arange(Pm)
        p_last = torch.minimum(cols[None], P[:, None] - 1)
        prompt_pos = p_start[:, None] + p_last
        prompt_mask = (cols[None, None] <= p_last[:, :, None])[:, None]
        _fill_runs(where, p_start, P, R * N + torch.arange(G) * Pm)
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    return PrefixBatch(
        to(resp_q),
        to(torch.cat((prompt_kv, resp_q), 1)),
        to(resp_mask[:, None]),
        to(prompt_pos),
        to(prompt_mask),
        to(where),
    )


def _fill_runs(out: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor) -> None:
    """``out[starts[i] + j] = values[i] + j`` for ``j < lengths[i]``, for every run ``i`` at once."""
    offset = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    out[torch.repeat_interleave(starts, lengths) + offset] = torch.repeat_interleave(values, lengths) + offset


def prefix_batched_attention(q_THD, k_TKD, v_TKD, plan: PrefixBatch, *, scale: float, dropout: float = 0.0):
    """``prefix_loop_attention``'s result in two SDPA calls (``PrefixBatch``): every response, padded, against its
    group's prompt and itself; every prompt, causally. Gathers in, one gather out; the prompt's keys and values get the
    gradients of every response of its group through the gathers' backward. 1.7-2.3x faster than the loop on CPU
    (SmolLM2-135M's 9 / 3 heads, 4 groups of a 48-token prompt and 4 responses of 64 tokens, a 2-core Xeon: 11 against
    19 ms a layer with gradients, 1.6 against 3.7 ms without, bfloat16)."""
    if cpu_backward_in_float32(q_THD, k_TKD, v_TKD):
        out = prefix_batched_attention(q_THD.float(), k_TKD.float(), v_TKD.float(), plan, scale=scale, dropout=dropout)
        return out.to(q_THD.dtype)
    H, KV, D = q_THD.shape[1], k_TKD.shape[1], q_THD.shape[2]

    def attend(pos_q, pos_kv, mask):
        B, S, L = pos_q.shape[0], pos_q.shape[1], pos_kv.shape[1]
        q = q_THD.index_select(0, pos_q.reshape(-1)).view(B, S, H, D).transpose(1, 2)
        k = k_TKD.index_select(0, pos_kv.reshape(-1)).view(B, L, KV, D).transpose(1, 2)
        v = v_TKD.index_select(0, pos_kv.reshape(-1)).view(B, L, KV, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=KV != H)
        return o.transpose(1, 2).reshape(B * S, H, D)

    outs = [attend(plan.resp_q, plan.resp_kv, plan.resp_mask)]
    if plan.prompt_pos is not None:
        outs.append(attend(plan.prompt_pos, plan.prompt_pos, plan.prompt_mask))
    return torch.cat(outs).index_select(0, plan.where)


def _flash_attn_kernel(q, k, v, a: PackedAttention, scale: float, dropout: float):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q,
        k,
        v,
        a.cu_seqlens,
        a.cu_seqlens,
        a.max_seqlen,
        a.max_seqlen,
        dropout_p=dropout,
        softmax_scale=scale,
        causal=True,
    )


def _varlen_kernel(q, k, v, a: PackedAttention, scale: float, dropout: float):
    if dropout:
        raise ValueError("attn_kernel='varlen' has no attention dropout; use flash_attn or sdpa_loop")
    fn, params = varlen_api()
    kw = {}
    if "window_size" in params:  # torch >= 2.11: causal is the window (-1, 0), compared as a tuple
        kw["window_size"] = (-1, 0)
    else:  # torch 2.10
        kw["is_causal"] = True
    if "scale" in params:
        kw["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(
            f"varlen_attn of torch {torch.__version__} has no scale argument; this model scales by {scale}"
        )
    if "enable_gqa" in params:  # torch >= 2.12 refuses fewer KV heads unless asked
        kw["enable_gqa"] = k.shape[1] != q.shape[1]
    return fn(q, k, v, a.cu_seqlens, a.cu_seqlens, a.max_seqlen, a.max_seqlen, **kw)


def _flex_kernel(q, k, v, a: PackedAttention, scale: float, dropout: float):
    if dropout:
        raise ValueError("attn_kernel='flex' has no attention dropout; use flash_attn or sdpa_loop")
    # compiled on CUDA; CPU only runs forwards (tests, no-grad roles) and compiling there costs more than it saves
    fn = compiled_flex() if q.is_cuda else flex_api()[0]
    out = fn(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=a.block_mask,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[0].transpose(0, 1)


def _sdpa_loop_kernel(q, k, v, a: PackedAttention, scale: float, dropout: float):
    if a.prefix is not None:
        return prefix_batched_attention(q, k, v, a.prefix, scale=scale, dropout=dropout)
    if a.groups is not None:
        return prefix_loop_attention(q, k, v, a.groups, scale=scale, dropout=dropout)
    return sdpa_loop_attention(q, k, v, a.lengths, scale=scale, dropout=dropout)


@functools.lru_cache(maxsize=256)
def segment_tables(
    lengths: tuple[int, ...], groups: tuple[tuple[int, ...], ...] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``segment_attention``'s host tables of a pack: ``segs`` ``(S, 4)`` rows ``(start, length, prompt start, prompt
    length)``, each a run of queries that attends causally to itself after the given prompt's keys (a sample: no
    prompt; a shared prompt: none; a response: its group's prompt); ``groups`` ``(G, 4)`` rows ``(first segment, end
    segment, first token, end token)``, the samples or prompt groups, whose keys no other group's queries read."""
    segs: list[tuple[int, int, int, int]] = []
    spans: list[tuple[int, int, int, int]] = []
    at = 0
    for g in groups if groups is not None else tuple((n,) for n in lengths):
        first, prompt = len(segs), g[0]
        segs.append((at, prompt, 0, 0))
        pos = at + prompt
        for n in g[1:]:
            segs.append((pos, n, at, prompt))
            pos += n
        spans.append((first, len(segs), at, pos))
        at = pos
    return torch.tensor(segs, dtype=torch.long).view(-1, 4), torch.tensor(spans, dtype=torch.long).view(-1, 4)


class _SegmentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segs, groups, scale):
        from rlspmd.models.cpu_kernels import cpu_ops

        out, lse = cpu_ops().segment_attention(q, k, v, segs, scale)
        ctx.save_for_backward(q, k, v, lse, segs, groups)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        from rlspmd.models.cpu_kernels import cpu_ops

        q, k, v, lse, segs, groups = ctx.saved_tensors
        dq, dk, dv = cpu_ops().segment_attention_backward(dout.contiguous(), q, k, v, lse, segs, groups, ctx.scale)
        return dq, dk, dv, None, None, None


def segment_attention(
    q_THD, k_TKD, v_TKD, lengths: Sequence[int], groups: Sequence[Sequence[int]] | None = None, *, scale: float
) -> torch.Tensor:
    """Causal attention over a pack in one C++ call each way (``attn_kernel=cpu_fused``; ``models/cpu_kernels.py``):
    the samples of ``lengths``, or with ``groups`` (``PackedAttention.groups``) each response after its group's prompt,
    as ``prefix_loop_attention``. Computes in float32 from bfloat16 or float32 inputs and rounds once; the gradients
    come back in the inputs' dtype. CPU only; needs the kernels built and ``head_dim`` a multiple of 16."""
    segs, spans = segment_tables(
        tuple(int(n) for n in lengths), None if groups is None else tuple(tuple(int(n) for n in g) for g in groups)
    )
    return _SegmentAttention.apply(q_THD.contiguous(), k_TKD.contiguous(), v_TKD.contiguous(), segs, spans, scale)


def runs_cpu_fused(q, dropout: float) -> bool:
    """Whether ``segment_attention`` takes this call: CPU, bfloat16 or float32, ``head_dim`` a multiple of 16, no
    attention dropout, and the kernels built (else ``cpu_fused`` runs ``sdpa_loop``'s calls)."""
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float32) or q.shape[-1] % 16 or dropout:
        return False
    from rlspmd.models.cpu_kernels import cpu_ops

    return cpu_ops() is not None


def _cpu_fused_kernel(q, k, v, a: PackedAttention, scale: float, dropout: float):
    if not runs_cpu_fused(q, dropout):
        return _sdpa_loop_kernel(q, k, v, a, scale, dropout)
    return segment_attention(q, k, v, a.lengths, a.groups, scale=scale)


KERNELS = {
    "flash_attn": _flash_attn_kernel,
    "varlen": _varlen_kernel,
    "flex": _flex_kernel,
    "sdpa_loop": _sdpa_loop_kernel,
    "cpu_fused": _cpu_fused_kernel,
}


def cu_seqlens_from_position_ids(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """Sample boundaries of a (possibly packed) ``(B, S)`` layout: a sample starts at each row start and wherever the
    position id does not continue the previous one. (For direct calls without ``packed_attention``; syncs.)"""
    B, S = position_ids_BS.shape
    pos = position_ids_BS.reshape(-1)
    start = torch.ones_like(pos, dtype=torch.bool)
    start[1:] = pos[1:] != pos[:-1] + 1
    start[::S] = True
    idx = start.nonzero().squeeze(-1)
    return torch.cat([idx, idx.new_tensor([pos.numel()])]).to(torch.int32)


def packed_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Transformers attention function (``query`` is ``(B, heads, S, D)``; returns ``(B, S, heads, D)``, None).

    The micro-batch's kernel when the caller passed ``packed_attention`` (a packed forward, see ``pack``); per-sample
    SDPA when no mask was built and the position ids show packed samples (a packed input called directly); SDPA with
    the given mask otherwise.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, S, D = query.shape
    meta: PackedAttention | None = kwargs.get("packed_attention")
    if meta is None:
        fresh = attention_mask is None and key.shape[2] == S and S > 1
        position_ids = kwargs.get("position_ids")
        cu = cu_seqlens_from_position_ids(position_ids.expand(B, -1)) if fresh and position_ids is not None else None
        if cu is None or cu.numel() - 1 == B:  # a padded batch, a KV-cached step, or one sample per row
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        lengths = tuple(cu.diff().tolist())
        meta = PackedAttention("sdpa_loop", cu, max(lengths), lengths)
    assert B == 1 and key.shape[2] == S, "a packed forward is one sequence without a KV cache"
    window = kwargs.get("sliding_window")
    if window is not None and meta.max_seqlen > window:
        raise ValueError(
            f"packed attention: a sample of {meta.max_seqlen} tokens exceeds the sliding window {window}; "
            "set model.packing=False"
        )
    scale = scaling if scaling is not None else D**-0.5
    # (1, heads, T, D) -> contiguous (T, heads, D): each sample a contiguous slice (on CPU, SDPA on strided per-sample
    # views of the (heads, T, D) layout measured 1.5-3x slower, forward + backward), FlashAttention's own layout
    flat = lambda x: x.transpose(1, 2).reshape(S, x.shape[1], D)  # noqa: E731
    if meta.seq is not None:  # this rank's slice of a sequence-parallel pack: the group attends over the whole
        return meta.seq.attention(flat(query), flat(key), flat(value), meta, KERNELS[meta.kernel], scale, dropout)[
            None
        ], None
    out = KERNELS[meta.kernel](flat(query), flat(key), flat(value), meta, scale, dropout)
    return out[None], None


def packed_attention_mask(*, attention_mask=None, q_offset=0, kv_offset=0, q_length=0, kv_length=0, **kwargs):
    """Mask function of ``rlspmd_packed``: no mask for a fresh, unpadded input (attention derives causality and the
    sample boundaries itself); transformers' SDPA mask in every other case."""
    from transformers.masking_utils import sdpa_mask

    fresh = (
        isinstance(q_offset, int)
        and isinstance(kv_offset, int)
        and q_offset == kv_offset == 0
        and q_length == kv_length
    )
    if attention_mask is None and fresh:
        return None
    return sdpa_mask(
        attention_mask=attention_mask,
        q_offset=q_offset,
        kv_offset=kv_offset,
        q_length=q_length,
        kv_length=kv_length,
        **kwargs,
    )


def register_packed_attention() -> str:
    """Register ``rlspmd_packed`` with transformers (idempotent); returns the name for ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, packed_attention_mask)
    return PACKED_ATTENTION


def training_attn_implementation(requested: str, *, packing: bool, field_name: str) -> str:
    """The attention implementation to load a training model with.

    Packing with ``sdpa`` (the default) uses ``rlspmd_packed``; ``flash_attention_2`` packs natively through the
    same ``cu_seq_lens`` keywords. ``eager`` has no packed path.
    """
    if not packing:
        return requested
    if requested == "sdpa":
        return register_packed_attention()
    if requested.startswith("flash_attention"):
        return requested
    raise ValueError(
        f"{field_name}={requested!r} cannot run packed sequences; use sdpa or flash_attention_2, "
        "or set model.packing=False"
    )


def packed_hidden_states(
    decoder: torch.nn.Module, packed: PackedBatch, *, inputs_embeds: torch.Tensor | None = None, **extra
) -> torch.Tensor:
    """``(T, H)`` last hidden states of the packed tokens from an HF decoder (``hf_model.get_decoder()``).
    ``inputs_embeds`` (1, T, H): the packed tokens' input embeddings instead of their ids (image features inserted by
    ``rlspmd.models.vision``); ``extra``: further keywords of the decoder's forward.

    With ``rlspmd_packed`` the decoder gets a 4-D placeholder as its attention mask: transformers treats a 4-D mask
    as already prepared and skips mask creation, whose packed-sequence detection reads a device value back (a host
    sync per forward); the attention function, which finds ``packed_attention`` in its keywords, ignores it.
    """
    return packed_decoder_hidden(
        decoder, packed.input_ids_1T, packed.position_ids_1T, packed.attention, inputs_embeds=inputs_embeds, **extra
    )


def packed_decoder_hidden(
    decoder: torch.nn.Module,
    input_ids_1T: torch.Tensor,
    position_ids_1T: torch.Tensor,
    attention: PackedAttention,
    *,
    inputs_embeds: torch.Tensor | None = None,
    **extra,
) -> torch.Tensor:
    """``packed_hidden_states`` from the pieces of a pack (a sequence-parallel rank runs its slice of one)."""
    mask = None
    if decoder.config._attn_implementation == PACKED_ATTENTION:
        mask = torch.empty((1, 1, 0, 0), dtype=torch.bool, device=position_ids_1T.device)
    ids = dict(input_ids=input_ids_1T) if inputs_embeds is None else dict(inputs_embeds=inputs_embeds)
    out = decoder(
        **ids, position_ids=position_ids_1T, attention_mask=mask, use_cache=False, **attention.kwargs(), **extra
    )
    return out.last_hidden_state[0]
