"""The step's prompts: rank 0 reads the datasets and decides which prompts each step (and each validation round)
uses; every DP rank of the trainer receives its consecutive share (a prompt's samples then stay on one rank).

``NoPrompts`` stands in on the rollout-only ranks of a split placement: their prompts arrive through the rollout
role's link, not from here.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.config import DataConfig
from rlspmd.data.images import MultimodalPrompts
from rlspmd.data.prompts import EpochSampler, PromptDataset
from rlspmd.distributed.dispatch import scatter_batch
from rlspmd.protocol import Batch


class Prompts:
    def __init__(
        self,
        cfg: DataConfig,
        tokenizer,
        *,
        mesh: DeviceMesh,
        device: torch.device,
        is_main: bool,
        prompts_per_round: int,
        seed: int,
        tools: list[dict] | None = None,
        vision: MultimodalPrompts | None = None,
    ):
        """Collective over ``mesh``; only rank 0 (``is_main``) reads the files. ``tools``: schemas rendered into
        every prompt (``rollout.agent``). ``vision``: a vision-language model's image processing (rows with images)."""
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.train = self.val = self.sampler = None
        if is_main:
            kw = dict(
                prompt_key=cfg.prompt_key,
                max_prompt_length=cfg.max_prompt_length,
                overlong=cfg.overlong_prompts,
                empty=cfg.empty_prompts,
                tools=tools,
                image_key=cfg.image_key,
                vision=vision,
            )
            self.train = PromptDataset(cfg.train_files, tokenizer, field_name="data.train_files", **kw)
            self.val = PromptDataset(cfg.val_files, tokenizer, field_name="data.val_files", **kw)
            self.sampler = EpochSampler(len(self.train), prompts_per_round, seed=seed, shuffle=cfg.shuffle)

    def stats(self) -> dict[str, int] | None:
        """On rank 0: the counts the run's log and the validation loop need."""
        if self.train is None:
            return None
        n_val = len(self.val) if self.cfg.max_val_samples is None else min(len(self.val), self.cfg.max_val_samples)
        return {
            "train_prompts": len(self.train),
            "train_dropped": self.train.n_dropped,
            "train_empty_dropped": self.train.n_empty,
            "val_prompts": n_val,
        }

    def next(self) -> Batch:
        """This rank's share of the next training prompts."""
        batch = self.train.batch(self.sampler.next_batch()) if self.sampler is not None else None
        return scatter_batch(batch, mesh=self.mesh, device=self.device)

    def validation(self, start: int, stop: int) -> tuple[Batch, int]:
        """This rank's share of validation prompts ``[start, stop)``, padded to split evenly; ``(batch, n_pad)``
        where ``n_pad`` (known on rank 0) is the number of padding rows at the global end."""
        batch, n_pad = (
            self.val.batch(list(range(start, stop))).pad_to_divisor(self.mesh.size())
            if self.val is not None
            else (None, 0)
        )
        return scatter_batch(batch, mesh=self.mesh, device=self.device), n_pad


class NoPrompts:
    """Rollout-only ranks (split placement): empty batches."""

    sampler = None

    def stats(self) -> None:
        return None

    def next(self) -> Batch:
        return Batch()

    def validation(self, start: int, stop: int) -> tuple[Batch, int]:
        return Batch(), 0
