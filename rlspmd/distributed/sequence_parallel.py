"""Sequence parallelism of the training roles (``mesh.actor_sp``): the ranks of an SP group split a packed
micro-batch's tokens between them, so one response is no longer bounded by one rank's memory.

**Whose rows.** The trainer's contract stays: every rank holds its own rows, normalises its losses by the global counts
and records its own metrics. An SP group therefore does not share samples; it runs its members' micro-batches, each
split over the group:

* no-grad passes (reference and old log-probs, values): ``SequenceParallel.run`` gathers the members' inputs (integer
  tensors, ``tp_batch.all_gather_varlen``), packs all their rows into ONE sequence (each member's rows packed as
  ``models/packing.pack`` does, the packs concatenated, so every sample's boundaries survive), pads it to a multiple
  of the group size and gives each rank one contiguous slice;
* training (``FSDPEngine.optimizer_step``): the group takes *turns*, one member's micro-batch at a time. The member
  whose turn it is (the owner) calls its loss function as without SP; the others call the module with no rows
  (``follow``), so the pack holds only the owner's rows and each rank holds ``1 / sp`` of them. The peak memory of a
  backward is then that of ``1 / sp`` of one micro-batch: the point of SP.

Either way ``run`` is the same: whatever rows the members hand in are packed together and split.

**Per layer.** Every token-wise layer (embedding, projections, MLP, norms) runs on the rank's slice unchanged, RoPE
on the slice's own position ids. Attention needs the whole sequence; the ``PackedAttention`` of the pack carries a
``SequenceShard`` that the packed attention function (``models/packing.py``) hands the layer's ``q, k, v`` to:

* ``ulysses`` (DeepSpeed-Ulysses): one ``all_to_all`` trades the sequence split for a head split (each rank then holds
  the whole sequence for ``heads / sp`` heads; q, k and v travel in one call), the micro-batch's packed kernel runs on
  the whole pack with its sample boundaries, and a second ``all_to_all`` trades back. KV heads that do not divide by
  ``sp`` are repeated first (each repeat is a head of its own; their gradients sum back). Per layer and rank, forward:
  ``(T / sp) x (heads + 2 kv_heads) x head_dim`` elements sent and the output's ``(T / sp) x heads x head_dim`` back;
  the backward moves the same again.
* ``allgather`` (the context parallelism of Llama 3 and of torch's FlexAttention ``context_parallel``): each rank keeps
  its queries and all-gathers the keys and values (``T x kv_heads x head_dim`` each), then attends per sample with a
  causal offset: a sample that began on an earlier rank gets a lower-right causal mask (one boolean ``(q, k)`` mask per
  forward, shared by all layers), the others SDPA's own causal kernel. Any head count; the backward reduce-scatters
  the key and value gradients.

**Outputs.** The hidden state that predicts a response token lives on exactly one rank, which computes that token's
log-prob and entropy (the chunked kernel, ``models/logprobs.py``) or value there, once. The group's ``(k, N)``
per-token outputs are summed over the group (each entry has one contributor; ``SumOverGroup``: all-reduce forward,
all-reduce backward) and each rank keeps its own rows. The backward's all-reduce hands every rank the gradient that the
owner's loss put on the tokens it computed, so the parameter gradients of the ranks sum (FSDP2's reduce-scatter over
all of the role's ranks) to the gradient of the same loss without SP: nothing is counted twice or dropped.

Simplifications: packed sequences only (``model.packing``, the ``rlspmd_packed`` attention); no MoE or
vision-language models; the reward model stays unsplit. The ``allgather`` mode runs per-sample SDPA whatever
``model.attn_kernel`` says.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import (
    all_gather_single_autograd,
    all_to_all_single_autograd,
    wait_tensor,
)

from rlspmd.distributed.tp_batch import all_gather_varlen
from rlspmd.models.packing import (
    PackedAttention,
    TokenCounts,
    document_causal_block_mask,
    pack,
    packed_decoder_hidden,
)

SP_MODES = ("auto", "ulysses", "allgather")
"""Values of ``mesh.actor_sp_mode``."""


def ulysses_problem(*, heads: int, kv_heads: int, sp: int, tp: int = 1) -> str | None:
    """Why Ulysses cannot split ``heads`` attention heads (``kv_heads`` KV heads) over ``sp`` ranks after tensor
    parallelism of degree ``tp`` (None: it can)."""
    if heads % tp or kv_heads % tp:
        return f"mesh.actor_tp={tp} does not divide the {heads} attention heads and {kv_heads} KV heads"
    h, kv = heads // tp, kv_heads // tp
    if h % sp:
        return f"the {h} attention heads{' per TP rank' if tp > 1 else ''} do not divide by mesh.actor_sp={sp}"
    repeat = sp // math.gcd(kv, sp)
    if (h // kv) % repeat:
        return (
            f"the {kv} KV heads{' per TP rank' if tp > 1 else ''} cannot be spread over mesh.actor_sp={sp} ranks "
            f"(each would need {repeat} copies, and {h // kv} query heads share one)"
        )
    return None


def resolve_sp_mode(mode: str, *, heads: int, kv_heads: int, sp: int, tp: int = 1) -> str:
    """The concrete mode for ``mesh.actor_sp_mode``: ``auto`` picks ulysses where the heads allow it; an explicit
    ``ulysses`` the heads do not allow is a ValueError naming the field."""
    if mode not in SP_MODES:
        raise ValueError(f"mesh.actor_sp_mode={mode!r} is not one of {list(SP_MODES)}")
    if mode == "allgather":
        return mode
    problem = ulysses_problem(heads=heads, kv_heads=kv_heads, sp=sp, tp=tp)
    if problem is None:
        return "ulysses"
    if mode == "ulysses":
        raise ValueError(f"mesh.actor_sp_mode='ulysses': {problem}; use actor_sp_mode='allgather' (or 'auto')")
    return "allgather"


class SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over ``group`` in the forward and in the backward: per-token outputs that each rank filled for
    its own tokens (zeros elsewhere) become the group's, and the gradient every rank's loss put on them comes back to
    the rank that computed each token."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@dataclass(eq=False)
class SequenceShard:
    """What the attention layers of one sequence-parallel forward need beyond the pack's own metadata: the group, this
    rank's slice ``[lo, hi)`` of the padded pack, and the mode. ``PackedAttention.seq`` holds it; the packed
    attention function calls ``attention``."""

    sp: "SequenceParallel"
    lo: int
    hi: int
    lengths: tuple[int, ...]
    """Every segment of the padded pack (the samples, then the padding), host-side."""
    _masks: dict = field(default_factory=dict)

    def attention(self, q, k, v, meta: PackedAttention, kernel, scale: float, dropout: float) -> torch.Tensor:
        """``q`` ``(T_local, heads, D)``, ``k, v`` ``(T_local, kv_heads, D)`` of this rank's slice -> the attention
        output of the slice's queries over the whole pack, ``(T_local, heads, D)``. ``kernel(q, k, v, meta, scale,
        dropout)``: the micro-batch's packed kernel (Ulysses runs it on the whole pack)."""
        if self.sp.mode == "ulysses":
            return self._ulysses(q, k, v, meta, kernel, scale, dropout)
        return self._allgather(q, k, v, scale, dropout)

    def _ulysses(self, q, k, v, meta, kernel, scale, dropout):
        sp, group = self.sp.size, self.sp.group
        T, H, D = q.shape
        KV = k.shape[1]
        repeat = sp // math.gcd(KV, sp)
        if repeat > 1:  # each rank needs whole KV heads: copies, whose gradients the repeat's backward sums
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        h, kv = H // sp, k.shape[1] // sp
        # (T, sp, heads / sp, D) per tensor, one all_to_all for all three: chunk c of the heads goes to rank c
        x = torch.cat([q.view(T, sp, h, D), k.view(T, sp, kv, D), v.view(T, sp, kv, D)], dim=2)
        x = wait_tensor(all_to_all_single_autograd(x.transpose(0, 1).contiguous(), None, None, group))
        x = x.reshape(sp * T, h + 2 * kv, D)  # rank order is sequence order
        qf, kf, vf = (t.contiguous() for t in x.split([h, kv, kv], dim=1))
        out = kernel(qf, kf, vf, meta, scale, dropout)  # (sp * T, h, D): the whole pack, this rank's heads
        out = wait_tensor(all_to_all_single_autograd(out.reshape(sp, T, h, D).contiguous(), None, None, group))
        return out.transpose(0, 1).reshape(T, H, D)

    def _allgather(self, q, k, v, scale, dropout):
        group = self.sp.group
        kf = wait_tensor(all_gather_single_autograd(k.contiguous(), 0, group))
        vf = wait_tensor(all_gather_single_autograd(v.contiguous(), 0, group))
        gqa = kf.shape[1] != q.shape[1]
        outs, start = [], 0
        for length in self.lengths:
            s, e = start, start + length
            start = e
            qa, qb = max(s, self.lo), min(e, self.hi)
            if qa >= qb:
                continue
            qs = q[qa - self.lo : qb - self.lo].transpose(0, 1)[None]
            ks, vs = kf[s:qb].transpose(0, 1)[None], vf[s:qb].transpose(0, 1)[None]
            if qa == s:  # the sample starts on this rank: plain causal attention
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=gqa
                )
            else:  # it began on an earlier rank: query i sits at key qa - s + i (lower-right causal)
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=self._offset_mask(qb - qa, qb - s, q.device), scale=scale,
                    dropout_p=dropout, enable_gqa=gqa,
                )  # fmt: skip
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)

    def _offset_mask(self, nq: int, nk: int, device) -> torch.Tensor:
        """The lower-right causal mask of ``nq`` queries over ``nk`` keys, built once per forward (every layer reads
        the same tensor, so autograd keeps one copy)."""
        key = (nq, nk)
        if key not in self._masks:
            self._masks[key] = torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq)
        return self._masks[key]


class SequenceParallel:
    """A training role module's sequence-parallel group. The engine (``engines/fsdp``) sets it as the module's ``seq``;
    the module's packed forward then calls ``run`` instead of packing by itself.

    The module's forward signature is the protocol: ``module(input_ids_BL, attention_mask_BL, position_ids_BL, *,
    response_len, ...)``; a member that only follows another's turn calls it with no rows (``follow``).
    """

    def __init__(self, group: dist.ProcessGroup, *, mode: str):
        assert mode in ("ulysses", "allgather"), mode
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.mode = mode

    def follow(self, module: torch.nn.Module, *, device: torch.device) -> torch.Tensor:
        """Run ``module`` in another member's turn with no rows of this rank's own: the owner's rows are packed and
        this rank computes its slice of them. Returns a zero that depends on the outputs (``.backward()`` it: the
        gradient the owner's loss put on this rank's tokens reaches it through ``SumOverGroup``)."""
        empty = torch.zeros(0, 0, dtype=torch.long, device=device)
        outs = module(empty, empty, empty, response_len=0)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(o.sum() for o in outs)

    def run(
        self,
        decoder: torch.nn.Module,
        head: Callable[[torch.Tensor, torch.Tensor, tuple[float, ...]], Sequence[torch.Tensor]],
        input_ids_BL: torch.Tensor,
        attention_mask_BL: torch.Tensor,
        position_ids_BL: torch.Tensor,
        *,
        response_len: int,
        scalars: tuple[float, ...] = (),
        kernel: str,
    ) -> tuple[torch.Tensor, ...]:
        """This rank's ``(B, response_len)`` outputs, the group's rows packed together and split over it.

        ``decoder``: the HF backbone (``last_hidden_state``); ``head(hidden_NH, target_ids_N, scalars)``: the
        per-token outputs (``(N,)`` float tensors) of the hidden states that predict ``target_ids_N``. ``scalars``:
        the head's options (temperature, ...), travelling with the rows: the members with rows must agree on them (a
        turn's are the owner's). ``kernel``: the packed attention kernel (``packing.resolve_attn_kernel``)."""
        assert position_ids_BL.dim() == 2, "sequence parallelism runs text models (2-D position ids)"
        meta = torch.tensor([float(response_len), *scalars], dtype=torch.float64).view(torch.long)
        members = all_gather_varlen(
            [input_ids_BL, attention_mask_BL, position_ids_BL, meta.to(input_ids_BL.device)], self.group
        )
        metas = [m[3].cpu().view(torch.float64).tolist() for m in members]
        with_rows = [i for i, m in enumerate(members) if m[0].shape[0]]
        assert with_rows, "a sequence-parallel forward with no rows on any member"
        scalars = tuple(metas[with_rows[0]][1:])
        assert all(tuple(metas[i][1:]) == scalars for i in with_rows), ("members disagree on", metas)
        group_pack = self._pack(members, with_rows, [int(m[0]) for m in metas], kernel=kernel)
        hidden_TH = packed_decoder_hidden(
            decoder, group_pack.input_ids_1T, group_pack.position_ids_1T, group_pack.attention
        )
        a, b = group_pack.local_targets
        targets_N = group_pack.targets_N[a:b]
        outs = head(
            hidden_TH.index_select(0, targets_N - 1 - group_pack.lo),
            group_pack.all_ids_T.index_select(0, targets_N),
            scalars,
        )
        N = group_pack.targets_N.shape[0]
        summed = SumOverGroup.apply(F.pad(torch.stack([o.float() for o in outs]), (a, N - b)), self.group)
        mine = group_pack.members.get(self.rank)
        if mine is None:  # no rows of this rank's own (it follows another member's turn)
            return tuple(s[:0].reshape(0, response_len).clone() for s in summed)
        offset, packed = mine
        own = summed[:, offset : offset + packed.target_pos_N.shape[0]]
        return tuple(packed.scatter_responses(o) for o in own)

    def _pack(self, members, with_rows: list[int], response_lens: list[int], *, kernel: str) -> "GroupPack":
        """The members' rows packed into one sequence (member order, each member's rows as ``pack`` orders them),
        padded to a multiple of the group size, with this rank's slice of it."""
        device = members[0][0].device
        # every member's host counts in one device-to-host copy
        sums = []
        for i in with_rows:
            mask, R = members[i][1], response_lens[i]
            sums += [mask.sum(-1), mask[:, -R:].sum(-1) if R else mask.new_zeros(mask.shape[0])]
        flat = torch.cat(sums).tolist()
        packs: dict[int, tuple[int, object]] = {}
        ids, pos, lengths, targets, response_spans = [], [], [], [], []
        offset_T = offset_N = at = 0
        for i in with_rows:
            input_ids, mask, position_ids, _ = members[i]
            B, R = input_ids.shape[0], response_lens[i]
            counts = TokenCounts(tuple(flat[at : at + B]), tuple(flat[at + B : at + 2 * B]) if R else ())
            at += 2 * B
            p = pack(input_ids, mask, position_ids, kernel="sdpa_loop", response_len=R, counts=counts)
            packs[i] = (offset_N, p)
            ids.append(p.input_ids_1T[0])
            pos.append(p.position_ids_1T[0])
            start = offset_T
            for n, r in zip(counts.lengths, counts.response_lengths or (0,) * B):
                response_spans.append((start + n - r, start + n))  # packed positions of the sample's targets
                start += n
            lengths += counts.lengths
            if R:
                targets.append(p.target_pos_N + offset_T)
                offset_N += p.target_pos_N.shape[0]
            offset_T += p.num_tokens
        T = offset_T
        padded = -(-T // self.size) * self.size
        if padded > T:  # one padding segment of its own: no sample attends to it
            ids.append(torch.zeros(padded - T, dtype=torch.long, device=device))
            pos.append(torch.arange(padded - T, dtype=torch.long, device=device))
            lengths.append(padded - T)
        cu = torch.tensor([0, *_cumsum(lengths)], dtype=torch.int32, device=device)
        lengths_t = torch.tensor(lengths, device=device)
        block_mask = document_causal_block_mask(lengths_t, padded) if kernel == "flex" else None
        local = padded // self.size
        lo, hi = self.rank * local, (self.rank + 1) * local
        shard = SequenceShard(self, lo, hi, tuple(lengths))
        attention = PackedAttention(kernel, cu, max(lengths), tuple(lengths), block_mask, seq=shard)
        all_ids = torch.cat(ids)
        # the targets whose predicting hidden state (target - 1) is in [lo, hi): a contiguous run of the sorted targets
        before = lambda x: sum(min(max(x - s, 0), e - s) for s, e in response_spans)  # noqa: E731
        return GroupPack(
            input_ids_1T=all_ids[lo:hi][None],
            position_ids_1T=torch.cat(pos)[lo:hi][None],
            attention=attention,
            all_ids_T=all_ids,
            targets_N=torch.cat(targets) if targets else torch.zeros(0, dtype=torch.long, device=device),
            lo=lo,
            local_targets=(before(lo + 1), before(hi + 1)),
            members=packs,
        )


@dataclass
class GroupPack:
    """One SP forward's pack: this rank's slice (``input_ids_1T``, ``position_ids_1T``) of the group's packed rows."""

    input_ids_1T: torch.Tensor
    position_ids_1T: torch.Tensor
    attention: PackedAttention
    all_ids_T: torch.Tensor
    """The whole pack's token ids (the targets of this rank's hidden states may lie on the next rank)."""
    targets_N: torch.Tensor
    """(N,) packed position of every member's valid response tokens, in member order (sorted)."""
    lo: int
    local_targets: tuple[int, int]
    """``[a, b)``: the targets predicted by this rank's hidden states."""
    members: dict
    """member -> (offset of its targets in ``targets_N``, its own ``PackedBatch``)."""


def _cumsum(xs: Sequence[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out
