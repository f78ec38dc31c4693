"""Rule scoring of generated samples.

``RewardManager.score`` decodes each response (``response_text``) and calls the sample's reward function — the user's
``reward.function`` or the rule for its ``data_source`` — giving ``task_scores_B``. The reward role
(``roles/reward.py``) combines it with a reward model's score. A function that raises, or returns something that is
not a finite number, stops the run with the sample's index and data_source in the message: a silently wrong reward
wastes a whole run.

Where functions run: with ``reward.timeout_s`` (the default) the user's function and third-party rule checkers run
in a ``RewardPool`` of worker processes, and a call past the limit is killed with its worker; the built-in regex
rules (gsm8k, arithmetic) run here, as does everything when ``reward.timeout_s`` is None. ``metrics()`` reports
``reward/timeouts``: calls killed since the last read (this rank; sum it over ranks).

The trainer calls scoring inside its ``reward`` stage (training step and validation), so a hang in user code here is
named by the hang monitor (``rlspmd/distributed/progress.py``).
"""

from __future__ import annotations

import math
import numbers
import os
import sys

import torch

from rlspmd.rewards.config import RewardConfig
from rlspmd.protocol import Batch
from rlspmd.rewards.functions import call_reward, function_name, load_function, resolve, spec_name
from rlspmd.rewards.pool import RewardPool, RewardWorkerError
from rlspmd.rewards.rules import rule_for, runs_in_process

__all__ = ["RewardError", "RewardManager", "load_function"]


class RewardError(RuntimeError):
    pass


def default_num_workers() -> int:
    """The CPU cores of this rank's share of the node (at least 1, at most 8)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


class RewardManager:
    def __init__(self, cfg: RewardConfig, tokenizer):
        self.cfg = cfg
        self.tokenizer = tokenizer
        # In this process: the user's function when there is no time limit. In workers: the rest, started on first use
        # (at once for a user's function, so its import overlaps with model loading).
        self.custom = load_function(cfg.function) if cfg.function and cfg.timeout_s is None else None
        self.pool: RewardPool | None = None
        if cfg.function and cfg.timeout_s is not None and cfg.rule_weight:
            self.pool = self._start_pool()
        self.timeouts = 0

    def _start_pool(self) -> RewardPool:
        workers = self.cfg.num_workers or default_num_workers()
        return RewardPool(self.cfg.function, num_workers=workers, timeout_s=self.cfg.timeout_s)

    def score(self, batch: Batch) -> Batch:
        """Adds ``response_text`` and ``task_scores_B`` (rule / function; 0 when ``reward.rule_weight`` is 0, which
        leaves the reward to a reward model), float32 on the batch's device."""
        texts = self.tokenizer.batch_decode(batch["responses_BR"] * batch["response_mask_BR"], skip_special_tokens=True)
        device = batch["responses_BR"].device
        task = self._rule_scores(batch, texts) if self.cfg.rule_weight else [0.0] * len(texts)
        return batch.set(response_text=texts, task_scores_B=torch.tensor(task, dtype=torch.float32, device=device))

    def metrics(self) -> dict[str, float]:
        """``reward/timeouts``: calls stopped at ``reward.timeout_s`` on this rank since the last call of
        ``metrics``."""
        out = {"reward/timeouts": float(self.timeouts)}
        self.timeouts = 0
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def _pooled(self, data_source: str) -> bool:
        if self.cfg.timeout_s is None:
            return False
        return bool(self.cfg.function) or not runs_in_process(data_source)

    def _name(self, data_source: str) -> str:
        if self.cfg.function:
            return spec_name(self.cfg.function)
        return function_name(rule_for(data_source))

    def _rule_scores(self, batch: Batch, texts: list[str]) -> list[float]:
        gts, sources, infos = batch["ground_truth"], batch["data_source"], batch["extra_info"]
        values: list[object] = [None] * len(texts)
        pooled = []
        for i, (text, gt, src, info) in enumerate(zip(texts, gts, sources, infos)):
            if self._pooled(src):
                pooled.append(i)
                continue
            fn = resolve(self.custom, src)
            try:
                values[i] = call_reward(fn, text, gt, info or {}, src)
            except Exception as e:  # noqa: BLE001 - re-raised with the sample named
                raise RewardError(self._raised(i, f"{type(e).__name__}: {e}", infos[i], src)) from e
        if pooled:
            self.pool = self.pool or self._start_pool()
            try:
                outcomes = self.pool.map([(texts[i], gts[i], infos[i] or {}, sources[i]) for i in pooled])
            except RewardWorkerError as e:
                if e.item is None:
                    raise RewardError(f"reward.function: {e}") from None
                i = pooled[e.item]
                raise RewardError(self._raised(i, str(e), infos[i], sources[i])) from None
            for i, out in zip(pooled, outcomes):
                if out.kind == "error":
                    raise RewardError(self._raised(i, out.error, infos[i], sources[i]))
                values[i] = 0.0 if out.kind == "timeout" else out.value
                if out.kind == "timeout":
                    self._timed_out(i, infos[i], sources[i])
        return [self._finite(v, i, infos[i], sources[i]) for i, v in enumerate(values)]

    def _raised(self, i: int, error: str, info: dict | None, src: str) -> str:
        return (
            f"reward function {self._name(src)} raised on sample {_sample_id(info, i)} (data_source={src!r}): {error}"
        )

    def _timed_out(self, i: int, info: dict | None, src: str) -> None:
        what = (
            f"reward function {self._name(src)} ran past reward.timeout_s={self.cfg.timeout_s:g} on sample "
            f"{_sample_id(info, i)} (data_source={src!r}); its worker was killed"
        )
        if self.cfg.timeout_policy == "error":
            raise RewardError(f"{what} (reward.timeout_policy=error)")
        self.timeouts += 1
        sys.stderr.write(
            f"[rlspmd] rank {os.environ.get('RANK', '0')}: {what} and replaced; the sample scores 0 "
            "(reward.timeout_policy=zero)\n"
        )
        sys.stderr.flush()

    def _finite(self, value, i: int, info: dict | None, src: str) -> float:
        if isinstance(value, dict):  # {"score": x, ...} as verl allows
            value = value.get("score")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(
                f"reward function {self._name(src)} returned {value!r} (not a finite number) on sample "
                f"{_sample_id(info, i)} (data_source={src!r})"
            )
        return float(value)


def _sample_id(info: dict | None, position: int) -> str:
    if info and "index" in info:
        return f"index={info['index']} (batch position {position})"
    return f"at batch position {position}"
