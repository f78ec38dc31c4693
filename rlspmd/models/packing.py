"""Padding-free ("packed") training forwards, shared by every model wrapper (policy, reference, value, reward).

A micro-batch in the padded layout of ``rlspmd.protocol`` (left-padded prompt, right-padded response) is packed
into ONE sequence of its valid tokens::

    input_ids_BL  [. . p p r r r .]      input_ids_1T  [p p r r r | q q q r r | ...]
                  [. q q q r r . .]  ->  position_ids  [0 1 2 3 4 | 0 1 2 3 4 | ...]   (restart per sample)
                                         cu_seqlens    [0, 5, 10, ...]                 (int32, B + 1)

so every token-wise layer (embedding, projections, MLP, norms, LM head) runs on ``T = Σ valid`` tokens instead of
``B × L``. Only attention needs the sample boundaries. Transformers passes any extra keyword of a model's forward
down to the attention function; ``cu_seq_lens_q/k`` and ``max_length_q/k`` are the keys its own flash-attention
integration reads for packed input, so a packed forward is just::

    hf_model.get_decoder()(input_ids=p.input_ids_1T, position_ids=p.position_ids_1T, **p.attention_kwargs())

With ``attn_implementation="flash_attention_2"`` that runs transformers' varlen flash path unchanged. For the
default ``sdpa`` we register an attention implementation, ``rlspmd_packed`` (``AttentionInterface`` plus a mask
function in ``AttentionMaskInterface``), instead of patching model code:

* packed calls use flash-attn's ``flash_attn_varlen_func`` on CUDA when it is installed and the dtype is half
  precision; otherwise a torch fallback: one causal SDPA call per sample on its slice of the pack (exact
  ``Σ len²`` work). On CPU this measured faster than the alternatives: a block-diagonal ``T × T`` mask does work
  quadratic in the whole pack, and scattering samples into a padded ``(samples, max_len)`` layout pays
  ``max_len²`` per sample plus scatter/gather backwards that cost more than the attention they save.
* every other call (a padded batch with a 2-D mask, generation with a KV cache) gets transformers' own SDPA mask
  and SDPA attention, so the same model object still serves padded forwards and ``generate``.

Equivalence with the padded forward (log-probs, entropies, values, losses, gradients) is tested in
``tests/test_packing.py``. Simplification: a sliding-window layer is only supported while every sample fits
in the window (the fallback has no sliding-window mask); longer samples raise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PACKED_ATTENTION = "rlspmd_packed"
"""The attention implementation name registered with transformers (SDPA semantics, plus packed varlen calls)."""


@dataclass
class PackedBatch:
    """One micro-batch's valid tokens as a single sequence, and the maps back to the padded ``(B, L)`` layout."""

    input_ids_1T: torch.Tensor
    position_ids_1T: torch.Tensor
    cu_seqlens: torch.Tensor
    """(B + 1,) int32 sample boundaries in the pack (flash-attn's varlen convention)."""
    max_seqlen: int
    token_index_T: torch.Tensor
    """(T,) flat index into ``B * L`` of each packed token (row-major order)."""
    shape: tuple[int, int]
    """(B, L) of the padded layout."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids_1T.shape[1]

    def attention_kwargs(self) -> dict:
        """The keyword arguments transformers forwards to the attention function for a packed sequence."""
        return dict(
            cu_seq_lens_q=self.cu_seqlens,
            cu_seq_lens_k=self.cu_seqlens,
            max_length_q=self.max_seqlen,
            max_length_k=self.max_seqlen,
        )

    def locate(self, mask_BL: torch.Tensor) -> torch.Tensor:
        """Packed positions of the ``True`` entries of ``mask_BL`` (row-major); each must be a valid token."""
        B, L = self.shape
        where = torch.full((B * L,), -1, dtype=torch.long, device=self.token_index_T.device)
        where[self.token_index_T] = torch.arange(self.num_tokens, device=where.device)
        pos = where[mask_BL.reshape(-1).to(where.device)]
        assert bool((pos >= 0).all()), "locate: a selected position is a padding token"
        return pos

    def unpack(self, x_T: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``(T, ...)`` per packed token -> ``(B, L, ...)`` with ``fill`` at padding (differentiable)."""
        B, L = self.shape
        out = x_T.new_full((B * L, *x_T.shape[1:]), fill)
        return out.index_copy(0, self.token_index_T, x_T).view(B, L, *x_T.shape[1:])


def pack(input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor, position_ids_BL: torch.Tensor) -> PackedBatch:
    """Pack the tokens with ``attention_mask_BL == 1`` of each row, in order, into one sequence.

    Position ids are taken from ``position_ids_BL`` (the rollout layout counts them from 0 at each sample's first
    valid token), so RoPE sees exactly what the padded forward sees.
    """
    B, L = input_ids_BL.shape
    valid_BL = attention_mask_BL.bool()
    lengths_B = valid_BL.sum(-1)
    token_index_T = valid_BL.reshape(-1).nonzero().squeeze(-1)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=input_ids_BL.device)
    cu[1:] = lengths_B.cumsum(0)
    return PackedBatch(
        input_ids_1T=input_ids_BL.reshape(-1)[token_index_T][None],
        position_ids_1T=position_ids_BL.reshape(-1)[token_index_T][None],
        cu_seqlens=cu,
        max_seqlen=max(int(lengths_B.max()), 1) if B else 1,
        token_index_T=token_index_T,
        shape=(B, L),
    )


def shifted_target_positions(packed: PackedBatch, attention_mask_BL: torch.Tensor, response_len: int) -> torch.Tensor:
    """Packed positions of the valid response tokens (the last ``response_len`` columns), row-major.

    The hidden state that predicts the token at packed position ``t`` is at ``t - 1`` (the sample's previous
    valid token), which needs at least one valid prompt token before each response.
    """
    select_BL = torch.zeros_like(attention_mask_BL, dtype=torch.bool)
    select_BL[:, -response_len:] = attention_mask_BL[:, -response_len:].bool()
    pos = packed.locate(select_BL)
    starts = packed.cu_seqlens[:-1].long()
    assert not bool(torch.isin(pos, starts).any()), "a response token has no prompt token before it"
    return pos


# ---------------------------------------------------------------------------------------------------------------
# attention


def cu_seqlens_from_position_ids(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """Sample boundaries of a (possibly packed) ``(B, S)`` layout: a sample starts at each row start and wherever the
    position id does not continue the previous one."""
    B, S = position_ids_BS.shape
    pos = position_ids_BS.reshape(-1)
    start = torch.ones_like(pos, dtype=torch.bool)
    start[1:] = pos[1:] != pos[:-1] + 1
    start[::S] = True
    idx = start.nonzero().squeeze(-1)
    return torch.cat([idx, idx.new_tensor([pos.numel()])]).to(torch.int32)


def varlen_attention_torch(q_THD, k_TKD, v_TKD, cu_seqlens: torch.Tensor, max_seqlen: int, *, scale: float, dropout: float = 0.0):
    """Causal attention of each sample with itself, for packed ``(T, heads, D)`` inputs (GQA allowed).

    One causal SDPA call per sample on its contiguous slice of the pack: exact ``Σ len²`` attention work, no padding,
    and slicing/concatenation are the only data movement (their backwards are a concatenation and a split).
    """
    H, KV = q_THD.shape[1], k_TKD.shape[1]
    lengths = cu_seqlens.diff().tolist()
    outs = []
    for q, k, v in zip(q_THD.split(lengths), k_TKD.split(lengths), v_TKD.split(lengths)):
        if q.shape[0] == 0:
            outs.append(q)
            continue
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=KV != H,
        )
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def varlen_attention(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen: int, *, scale: float, dropout: float = 0.0):
    """flash-attn's varlen kernel on CUDA in half precision when installed, the torch fallback otherwise."""
    if q_THD.is_cuda and q_THD.dtype in (torch.float16, torch.bfloat16):
        fn = _flash_varlen()
        if fn is not None:
            cu = cu_seqlens.to(torch.int32)
            return fn(q_THD, k_TKD, v_TKD, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout, softmax_scale=scale, causal=True)
    return varlen_attention_torch(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale=scale, dropout=dropout)


def packed_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Transformers attention function (``query`` is ``(B, heads, S, D)``; returns ``(B, S, heads, D)``, None).

    Varlen attention when the caller passed ``cu_seq_lens_q`` (a packed forward) or when no mask was built and the
    position ids show packed samples; SDPA with the given mask otherwise.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, S, D = query.shape
    fresh = attention_mask is None and key.shape[2] == S and S > 1
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None and fresh and kwargs.get("position_ids") is not None:
        cu = cu_seqlens_from_position_ids(kwargs["position_ids"].expand(B, -1))
        max_len = int(cu.diff().max())
        if cu.numel() - 1 == B:  # one sample per row: plain causal attention
            cu = None
    if cu is None or not fresh:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    window = kwargs.get("sliding_window")
    if window is not None and max_len > window:
        raise ValueError(f"packed attention: a sample of {max_len} tokens exceeds the sliding window {window}; set model.packing=False")
    scale = scaling if scaling is not None else D**-0.5
    flat = lambda x: x.transpose(1, 2).reshape(B * S, x.shape[1], D)  # noqa: E731
    out = varlen_attention(flat(query), flat(key), flat(value), cu, int(max_len), scale=scale, dropout=dropout)
    return out.view(B, S, H, D), None


def packed_attention_mask(*, attention_mask=None, q_offset=0, kv_offset=0, q_length=0, kv_length=0, **kwargs):
    """Mask function of ``rlspmd_packed``: no mask for a fresh, unpadded input (attention derives causality and the
    sample boundaries itself); transformers' SDPA mask in every other case."""
    from transformers.masking_utils import sdpa_mask

    fresh = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0 and q_length == kv_length
    if attention_mask is None and fresh:
        return None
    return sdpa_mask(attention_mask=attention_mask, q_offset=q_offset, kv_offset=kv_offset, q_length=q_length,
                     kv_length=kv_length, **kwargs)


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
        f"{field_name}={requested!r} cannot run packed sequences; use sdpa or flash_attention_2, or set model.packing=False"
    )


def packed_hidden_states(decoder: torch.nn.Module, packed: PackedBatch) -> torch.Tensor:
    """``(T, H)`` last hidden states of the packed tokens from an HF decoder (``hf_model.get_decoder()``)."""
    out = decoder(
        input_ids=packed.input_ids_1T, position_ids=packed.position_ids_1T, use_cache=False, **packed.attention_kwargs()
    )
    return out.last_hidden_state[0]
