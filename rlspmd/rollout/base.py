"""What every rollout engine shares: the interface and the layout of a generated batch.

An engine takes a Batch of left-padded prompts (``prompts_BP``, ``prompt_mask_BP`` plus per-sample
objects) and returns ``n`` samples per prompt, consecutive, with the training layout of
``rlspmd.protocol`` (``input_ids_BL = prompts_BP ++ responses_BR``).

Which engine a run uses is a config component (``RolloutEngineConfig``: ``NativeConfig`` in ``native.py``,
``VllmConfig`` in ``vllm.py``), registered in ``ROLLOUT_ENGINES``: its options, its checks, what it supports and a
``build`` that returns the rank's engine. ``rollout.engine`` holds one (``rollout.engine:vllm
--rollout.engine.max-num-seqs 64`` on the command line); a user's engine is a subclass in their own file. Nothing
outside an engine's own component compares its name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Protocol

import torch

from rlspmd.components import Component, Problem, Registry
from rlspmd.protocol import Batch, position_ids
from rlspmd.rollout.continuous import RequestSource
from rlspmd.rollout.sampling import SamplingParams


class RolloutEngine(Protocol):
    def generate(self, prompts: Batch, params: SamplingParams, *, generator: torch.Generator) -> Batch: ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load a full ``(HF name, tensor)`` stream (``rollout/weight_sync.py``); returns the bytes loaded."""

    def sleep(self) -> None:
        """Release memory until the next ``wake`` (may drop the weights: see ``holds_weights``)."""

    def wake(self) -> None: ...

    @property
    def holds_weights(self) -> bool:
        """Whether generate can run after ``wake`` without a weight load first."""

    def take_times(self) -> dict[str, float]:
        """Seconds spent in wake and sleep since the last call (``wake_s``, ``sleep_s``)."""

    def serve(self, source: RequestSource, params: SamplingParams, *, max_len: int, max_requests: int) -> dict:
        """Request-level generation for the agent loop: run ``source``'s requests (each a conversation's next turn),
        at most ``max_requests`` at a time and ``max_len`` tokens per sequence, until it has none left; returns
        counts (decode steps, prefills, tokens, idle waits)."""


ROLLOUT_ENGINES = Registry("rollout engine")
"""Every rollout engine by its name (``rollout.engine:NAME``)."""


class RolloutEngineConfig(Component):
    """``rollout.engine``: a generation engine with its options (the dataclass fields of a subclass).

    Traits the rest of the run reads: ``reads_in_place``, colocated with an actor whose engine lends its weights
    (``lends_weights``) and in the actor's compute dtype, it reads them where they are instead of a streamed copy;
    ``kernels`` is None when the engine samples with the trainer's own kernels (rollout correction's ``auto`` then
    stays off for it), else how its numerics differ (the reason logged when ``auto`` switches the correction on);
    ``serves_images``, it passes a prompt's images to a vision-language model (docs/vision.md); ``records_routing``,
    its single-turn samples carry a mixture-of-experts model's routing (``rollout_routing_BL``: R3, docs/moe.md);
    ``colocated_only`` is None when the engine also runs on ranks of its own (split placement), else why not."""

    registry = ROLLOUT_ENGINES
    reads_in_place: ClassVar[bool] = False
    serves_images: ClassVar[bool] = False
    records_routing: ClassVar[bool] = False
    kernels: ClassVar[str | None] = None
    colocated_only: ClassVar[str | None] = None

    def prepare_process(self) -> None:
        """Process-wide settings the engine needs before the first collective (every rank, at start-up)."""

    def context_problems(self, *, model_path: str, model_context: int | None) -> list[Problem]:
        """Checks against the context length of the model at ``model_path`` (``max_position_embeddings``; None:
        unknown)."""
        return []

    def build(
        self,
        *,
        weights,
        model_path: str,
        dtype: torch.dtype,
        sleeps: bool,
        tp: int,
        seed: int,
        eos_ids: list[int],
        pad_id: int,
        device: torch.device,
        max_model_len: int,
    ) -> RolloutEngine:
        """This rank's engine. ``weights``: where they come from (``rollout/weights.py``: in place, streamed, bridged);
        ``dtype``: the rollout's weight dtype; ``sleeps``: colocated, release memory between generations; ``tp``: the
        rollout's tensor-parallel degree; ``seed``: this rank's; ``max_model_len``: prompt + response tokens.
        Collective where the engine's construction is (vLLM's spans the world)."""
        raise NotImplementedError


def assemble_rollout(
    batch: Batch,
    responses_BR: torch.Tensor,
    lengths_B: torch.Tensor,
    logprobs_BR: torch.Tensor,
    *,
    pad_id: int,
    loss_mask_BR: torch.Tensor | None = None,
) -> Batch:
    """Add the response tensors and the concatenated training layout to ``batch`` (the repeated prompts).

    ``responses_BR`` may be wider than needed; it is trimmed to the longest response. Tokens past each
    row's length are set to ``pad_id`` and masked out. ``loss_mask_BR``: which response tokens the model generated
    (multi-turn rollouts); None: all of them (a single turn).
    """
    R = max(int(lengths_B.max()), 1) if len(lengths_B) else 1
    responses_BR = responses_BR[:, :R]
    logprobs_BR = logprobs_BR[:, :R]
    mask_BR = (torch.arange(R, device=responses_BR.device)[None] < lengths_B[:, None].to(responses_BR.device)).long()
    responses_BR = responses_BR.masked_fill(mask_BR == 0, pad_id)
    attention_mask_BL = torch.cat([batch["prompt_mask_BP"].long(), mask_BR], dim=1)
    return batch.set(
        responses_BR=responses_BR,
        response_mask_BR=mask_BR,
        loss_mask_BR=mask_BR.clone() if loss_mask_BR is None else loss_mask_BR[:, :R] * mask_BR,
        rollout_logprobs_BR=logprobs_BR * mask_BR,
        input_ids_BL=torch.cat([batch["prompts_BP"], responses_BR], dim=1),
        attention_mask_BL=attention_mask_BL,
        position_ids_BL=position_ids(attention_mask_BL),
    )
