"""The ``reward`` section: rule rewards, the user's reward function, further reward components, a reward model and
DAPO's overlong shaping. Imports nothing heavy (reward worker processes import the rewards package without torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class RewardModelConfig:
    path: str | None = None
    """Hugging Face ``*ForSequenceClassification`` directory (one label) that scores prompt + response.
    None: no reward model."""
    tokenizer_path: str | None = None
    """The reward model's tokenizer (and chat template); defaults to ``path``. When it differs from the actor's,
    prompt and response are re-rendered as text with the reward model's own template."""
    weight: float = 1.0
    """Weight of the reward model's score in the reward: ``score = rule_weight * rule + weight * rm``."""
    micro_batch_size: int = 16
    """Sequences per reward-model forward on one rank."""
    max_tokens_per_micro_batch: int | None = None
    """Dynamic batching for the reward-model forward: at most this many valid tokens per micro-batch. None: off."""


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO overlong reward shaping: a linear penalty for responses that run into the last ``len`` tokens before
    ``rollout.max_response_length``."""
    len: int = 16
    """Length of the soft-penalty buffer at the end of the response budget (tokens)."""
    penalty_factor: float = 1.0
    """Penalty at ``rollout.max_response_length`` tokens (it grows linearly from 0 at the buffer's start)."""


@dataclass
class RewardConfig:
    function: str | None = None
    """User reward function ``path/to/file.py:fn`` or ``package.module:fn`` with signature
    ``fn(response: str, ground_truth: str, extra_info: dict, data_source: str) -> float``.
    None: rule rewards chosen by each sample's ``data_source``."""
    components: list[str] = field(default_factory=list)
    """Further reward functions (``path/to/file.py:fn`` or ``module:fn``, ``reward.function``'s signature), each
    scored on every sample and logged as ``reward/component/<fn>``. They are columns of ``reward_components_BK``
    (after the rule / function score and the reward model's), which GDPO (``algorithm.adv_estimator=GDPO()``)
    normalises one by one; they do not enter ``scores_B``."""
    rule_weight: float = 1.0
    """Weight of the rule / function score. 0 with a reward model: the reward model alone (rule functions are
    not called, so accuracy metrics read 0)."""
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward model (sequence classifier), combined with the rule score."""
    agent_weight: float = 1.0
    """Weight of the agent's rewards in the score (``rollout.agent``: tool reward deltas, the tools' final-state
    scores, interaction rewards): ``score = rule_weight * rule + model.weight * rm + agent_weight * agent``."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO overlong reward shaping (training rewards only; validation reports the unshaped score)."""
    timeout_s: float | None = 60.0
    """Hard limit in seconds on one call of a reward function. With a limit, ``reward.function`` and third-party rule
    checkers (reasoning-gym) run in a pool of worker processes, and a call that takes longer is killed together with
    its worker (which is replaced): this stops calls that ignore signals, e.g. a C-level loop in a math checker. The
    built-in gsm8k/arithmetic rules always run in this process (a bounded regular expression). None: every function
    runs in this process without a limit (a call that never returns stalls the step until ``dist.hang_timeout_s``)."""
    timeout_policy: Literal["zero", "error"] = "zero"
    """A call that runs past ``timeout_s``: ``zero`` scores the sample 0 and counts it (``reward/timeouts``); ``error``
    stops the run naming the sample's index and data_source."""
    num_workers: int = 0
    """Worker processes per rank for reward functions under ``timeout_s`` (they also spread slow checkers over cores).
    0: the CPU cores per local rank, at most 8."""
