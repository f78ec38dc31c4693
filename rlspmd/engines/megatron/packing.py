"""The padded layout megatron runs: each row's valid tokens moved to the front (front-packing), and a model-parallel
group's rows joined into the one batch every stage runs.

A token's index in a front-packed row is its position id (``cumsum(mask) - 1``, rlspmd's ``position_ids_BL``), so
RoPE over the row indices sees the positions the HF model sees. Rows are padded at the end and masked (causal + key
padding); no packed (THD) sequences: a micro-batch runs padded to its longest row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlspmd.distributed.tp_batch import all_gather_varlen


@dataclass
class FrontPacked:
    """A micro-batch with each row's valid tokens moved to the front: ``ids_BW`` (W = the longest row, 0 after the
    end), ``lengths_B``, and for the response columns their index in that layout (``resp_pos_BR``) and validity."""

    ids_BW: torch.Tensor
    lengths_B: torch.Tensor
    resp_pos_BR: torch.Tensor
    resp_valid_BR: torch.Tensor


def front_pack(input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor, response_len: int) -> FrontPacked:
    """Move each row's valid tokens (``attention_mask_BL``) to the front, in order. A token's index in the result is
    its position id (``cumsum(mask) - 1``, rlspmd's ``position_ids_BL``), so RoPE over the row indices is exact."""
    valid = attention_mask_BL.bool()
    lengths = valid.sum(-1)
    order = torch.argsort((~valid).long(), dim=1, stable=True)  # valid tokens first, order kept
    W = max(int(lengths.max()), 1)
    ids = input_ids_BL.gather(1, order)[:, :W]
    ids = ids.masked_fill(torch.arange(W, device=ids.device)[None] >= lengths[:, None], 0)
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    return FrontPacked(ids, lengths, pos[:, -response_len:], valid[:, -response_len:])


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


def gather_front_packed(fp: FrontPacked, group: dist.ProcessGroup) -> list[FrontPacked]:
    """Every member's ``FrontPacked`` (in group-rank order), with two all-gathers: shapes, then one padded buffer."""
    return [
        FrontPacked(*m) for m in all_gather_varlen([fp.ids_BW, fp.lengths_B, fp.resp_pos_BR, fp.resp_valid_BR], group)
    ]


@dataclass
class GroupRows:
    """One micro-batch of the whole model-parallel group as every stage runs it: the members' rows (``FrontPacked``,
    in mp-group order) concatenated and padded to the longest, with the causal + key-padding mask megatron reads."""

    members: list[FrontPacked]
    ids_NW: torch.Tensor
    offsets: list[int]
    """Row offset of each member in ``ids_NW``."""
    mask_N1WW: torch.Tensor
    """True where attention is not allowed (megatron's convention)."""

    @classmethod
    def of(cls, members: list[FrontPacked]) -> "GroupRows":
        W = max(m.ids_BW.shape[1] for m in members)
        ids = torch.cat([_pad_cols(m.ids_BW, W) for m in members])
        lengths = torch.cat([m.lengths_B for m in members])
        cols = torch.arange(W, device=ids.device)
        allowed = (cols[None, :] <= cols[:, None])[None] & (cols[None, None, :] < lengths[:, None, None])
        offsets = [0]
        for m in members[:-1]:
            offsets.append(offsets[-1] + m.ids_BW.shape[0])
        return cls(members, ids, offsets, ~allowed[:, None])

    @property
    def hidden_shape(self) -> tuple[int, int]:
        """``(W, N)``: the leading dims of the hidden states passed between stages."""
        return self.ids_NW.shape[1], self.ids_NW.shape[0]
