"""Batch: named tensors sharing a batch dimension, plus per-sample Python objects.

Tensor names carry their shape as a suffix so the data path reads like a type signature:
``_B`` one value per sample, ``_BP`` per prompt token (left-padded), ``_BR`` per response token
(right-padded), ``_BL`` per token of prompt+response (``L = P + R``). Per-sample objects are plain lists
(prompt text, ground truth, data source, extra info). Configuration never travels in a Batch.

The layout of one sample in the ``_BL`` tensors::

    [pad pad p0 p1 p2 | r0 r1 r2 eos pad pad]
     <---- P prompt ---><----- R response ---->

so response token ``j`` sits at position ``P + j`` and is predicted by the hidden state at ``P + j - 1``.

Two response masks: ``response_mask_BR`` says a response position holds a token (it builds ``attention_mask_BL``,
lengths and packing); ``loss_mask_BR`` says the model generated that token. They are equal for a single-turn
response; in a multi-turn (agent) response the tool results, template glue and interaction turns are part of the
sequence but not the model's: ``loss_mask_BR`` is 0 there. Everything that means "the tokens that count" (policy,
KL and entropy terms, value loss, advantages and returns, rollout correction, the step's token metrics) reads
``loss_mask_BR``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

TOKEN_ID_FIELDS = ("prompts_BP", "responses_BR", "input_ids_BL")
"""Fields holding token ids: ``concat_padded`` pads them with the pad token; every other tensor is padded with 0."""


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-/right-padded layout: each sample counts from 0 at its first valid token; padding before
    it gets 0 and padding after it repeats the last position (masked out either way)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class Batch:
    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, objects: dict[str, list] | None = None):
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.objects: dict[str, list] = {k: list(v) for k, v in (objects or {}).items()}
        self._check()

    def _check(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.objects.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.objects.values():
            return len(v)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.objects

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.objects:
            return self.objects[key]
        raise KeyError(f"Batch has no field {key!r}; fields: {sorted(self.keys())}")

    def keys(self) -> list[str]:
        return [*self.tensors, *self.objects]

    def set(self, **fields: torch.Tensor | list) -> "Batch":
        """Add or replace fields in place (tensors or per-sample lists); returns self for chaining."""
        n = len(self) if self.keys() else None
        for k, v in fields.items():
            size = v.shape[0] if isinstance(v, torch.Tensor) else len(v)
            if n is not None and size != n:
                raise ValueError(f"field {k!r} has batch size {size}, Batch has {n}")
            if isinstance(v, torch.Tensor):
                self.tensors[k] = v
            else:
                self.objects[k] = list(v)
            n = size
        return self

    def pop(self, *keys: str) -> None:
        for k in keys:
            self.tensors.pop(k, None)
            self.objects.pop(k, None)

    def select(self, index: torch.Tensor | Sequence[int]) -> "Batch":
        """Rows ``index`` (any order, repeats allowed) as a new Batch."""
        idx = torch.as_tensor(index, dtype=torch.long)
        idx_list = idx.tolist()
        return Batch(
            {k: v[idx.to(v.device)] for k, v in self.tensors.items()},
            {k: [v[i] for i in idx_list] for k, v in self.objects.items()},
        )

    def slice(self, start: int, stop: int) -> "Batch":
        return Batch(
            {k: v[start:stop] for k, v in self.tensors.items()},
            {k: v[start:stop] for k, v in self.objects.items()},
        )

    def split(self, size: int) -> list["Batch"]:
        """Consecutive chunks of ``size`` rows (the last may be shorter)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.slice(i, i + size) for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list["Batch"]:
        """``n`` consecutive parts of equal size; the batch size must divide by ``n``."""
        if len(self) % n:
            raise ValueError(f"cannot chunk a batch of {len(self)} into {n} equal parts; pad_to_divisor first")
        return self.split(len(self) // n) if len(self) else [self.slice(0, 0) for _ in range(n)]

    @staticmethod
    def concat(batches: Iterable["Batch"]) -> "Batch":
        batches = [b for b in batches]
        if not batches:
            return Batch()
        keys_t, keys_o = set(batches[0].tensors), set(batches[0].objects)
        for b in batches[1:]:
            if set(b.tensors) != keys_t or set(b.objects) != keys_o:
                raise ValueError("cannot concat Batches with different fields")
        return Batch(
            {k: torch.cat([b.tensors[k] for b in batches]) for k in batches[0].tensors},
            {k: [x for b in batches for x in b.objects[k]] for k in batches[0].objects},
        )

    @staticmethod
    def concat_padded(batches: Iterable["Batch"], *, pad_id: int = 0) -> "Batch":
        """Concatenate Batches whose padded widths differ (generation rounds, rows gathered from several ranks).

        Widths follow the layout above: ``_BP`` tensors are left-padded to the widest prompt, ``_BR`` tensors
        right-padded to the widest response, and each ``_BL`` tensor is split at its batch's prompt width (``L - R``)
        and padded both ways, keeping ``input_ids_BL = prompts_BP ++ responses_BR``. Token ids (``TOKEN_ID_FIELDS``)
        are padded with ``pad_id``, everything else with 0 (masks say what is padding); ``position_ids_BL`` is
        recomputed from the padded attention mask. Other tensors must agree beyond the batch dim.
        """
        batches = [b for b in batches if len(b)]
        if not batches:
            return Batch()
        keys = set(batches[0].tensors)
        if any(set(b.tensors) != keys for b in batches):
            raise ValueError("cannot concat Batches with different fields")

        def width(b: "Batch", suffix: str) -> int:
            return next((v.shape[1] for k, v in b.tensors.items() if k.endswith(suffix)), 0)

        P = max(width(b, "_BP") for b in batches)
        R = max(width(b, "_BR") for b in batches)
        PL = {k: max(b.tensors[k].shape[1] - width(b, "_BR") for b in batches) for k in keys if k.endswith("_BL")}
        padded = []
        for b in batches:
            r = width(b, "_BR")
            t = {}
            for k, v in b.tensors.items():
                value = pad_id if k in TOKEN_ID_FIELDS else 0
                if k.endswith("_BP"):
                    v = _pad(v, left=P - v.shape[1], right=0, value=value)
                elif k.endswith("_BR"):
                    v = _pad(v, left=0, right=R - v.shape[1], value=value)
                elif k.endswith("_BL"):
                    p = v.shape[1] - r
                    v = torch.cat(
                        [
                            _pad(v[:, :p], left=PL[k] - p, right=0, value=value),
                            _pad(v[:, p:], left=0, right=R - r, value=value),
                        ],
                        1,
                    )
                t[k] = v
            padded.append(Batch(t, b.objects))
        out = Batch.concat(padded)
        if "position_ids_BL" in out.tensors:
            out.set(position_ids_BL=position_ids(out["attention_mask_BL"]))
        return out

    def repeat(self, n: int) -> "Batch":
        """Each row repeated ``n`` times consecutively (row0, row0, ..., row1, row1, ...)."""
        return self.select(torch.arange(len(self)).repeat_interleave(n))

    def pad_to_divisor(self, divisor: int) -> tuple["Batch", int]:
        """Append copies of the first rows until the size divides by ``divisor``; returns (batch, n_added)."""
        pad = (-len(self)) % divisor
        if pad == 0:
            return self, 0
        if len(self) == 0:
            raise ValueError("cannot pad an empty batch")
        idx = torch.cat([torch.arange(len(self)), torch.arange(pad) % len(self)])
        return self.select(idx), pad

    def to(self, device: torch.device | str) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.objects)

    def __repr__(self) -> str:
        parts = [f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in self.tensors.items()]
        parts += [f"{k}: list" for k in self.objects]
        return f"Batch(size={len(self)}, " + ", ".join(parts) + ")"


def _pad(x: torch.Tensor, *, left: int, right: int, value) -> torch.Tensor:
    """Pad dim 1 of ``x`` with ``value``: ``left`` columns before, ``right`` after."""
    if not left and not right:
        return x
    parts = [x.new_full([x.shape[0], left, *x.shape[2:]], value)] if left else []
    parts.append(x)
    if right:
        parts.append(x.new_full([x.shape[0], right, *x.shape[2:]], value))
    return torch.cat(parts, 1)
