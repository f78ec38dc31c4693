"""The rollout role: turns a DP shard of prompts into ``n`` scored-ready samples per prompt.

Sampling randomness comes from a generator seeded by ``(seed, step, rollout DP rank, purpose, round)``, so a
step's samples do not depend on how many steps ran before in this process (exact resume) and differ between
DP ranks and between the generation rounds of one step (dynamic sampling). Colocated with the actor, the native
engine reads the actor's weights in place and the weight sync is a no-op that costs nothing; other placements
stream weights (``sync_weights``).
"""

from __future__ import annotations


import torch

from rlspmd.config import RolloutConfig
from rlspmd.protocol import Batch
from rlspmd.rollout.native import ColocatedWeights, NativeEngine
from rlspmd.rollout.sampling import SamplingParams


class Rollout:
    def __init__(self, cfg: RolloutConfig, *, policy, eos_ids: list[int], pad_id: int, device: torch.device, seed: int, dp_rank: int):
        if cfg.engine != "native":
            raise ValueError(f"rollout.engine={cfg.engine!r} is not available in this build; use 'native'")
        self.cfg = cfg
        self.seed, self.dp_rank, self.device = seed, dp_rank, device
        self.engine = NativeEngine(
            ColocatedWeights(policy.engine), eos_ids=eos_ids, pad_id=pad_id, max_batch_size=cfg.max_batch_size, device=device
        )
        self.eos_ids = eos_ids
        self.train_params = SamplingParams(
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_response_length, n=cfg.n
        )
        self.val_params = SamplingParams(
            temperature=cfg.val_temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_response_length, n=1
        )
        self.greedy_params = SamplingParams(temperature=0.0, max_new_tokens=cfg.max_response_length, n=1)

    def _generator(self, step: int, purpose: int, round: int = 0) -> torch.Generator:
        g = torch.Generator(device=self.device)
        key = (self.seed, step, self.dp_rank, purpose) + ((round,) if round else ())  # round 0: the single-round seed
        g.manual_seed(hash(key) & (2**63 - 1))
        return g

    def generate(self, prompts: Batch, *, step: int, round: int = 0) -> Batch:
        return self.engine.generate(prompts.to(self.device), self.train_params, generator=self._generator(step, 0, round))

    def generate_greedy(self, prompts: Batch) -> Batch:
        """One greedy response per prompt (ReMax's baseline)."""
        return self.engine.generate(prompts.to(self.device), self.greedy_params, generator=None)

    def generate_validation(self, prompts: Batch, *, step: int) -> Batch:
        return self.engine.generate(prompts.to(self.device), self.val_params, generator=self._generator(step, 1))

    def sync_weights(self, policy) -> dict[str, float]:
        """Colocated native engine: the next generate reads the updated parameters directly."""
        return {"rollout/weight_sync_bytes": 0.0}

    def truncated(self, batch: Batch) -> torch.Tensor:
        """Samples that hit ``max_response_length`` without producing EOS."""
        lengths = batch["response_mask_BR"].sum(-1)
        R = batch["responses_BR"].shape[1]
        last = batch["responses_BR"].gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        ended = torch.isin(last, torch.tensor(self.eos_ids, device=last.device))
        return (lengths >= self.cfg.max_response_length) & ~ended & (R >= self.cfg.max_response_length)
