"""Scoring generated samples.

``RewardManager.score`` decodes each response and calls the sample's reward function (``task_scores_B``), asks the
reward model for its score when one is configured (``rm_scores_B``), and combines them:
``scores_B = reward.rule_weight * task_scores_B + reward.model.weight * rm_scores_B``. A function that raises, or
returns something that is not a finite number, stops the run with the sample's index and data_source in the
message: a silently wrong reward wastes a whole run.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
from collections.abc import Callable
from pathlib import Path

import torch

from rlspmd.config import RewardConfig
from rlspmd.protocol import Batch
from rlspmd.rewards.rules import rule_for
from rlspmd.roles.reward_model import NoRewardModel


class RewardError(RuntimeError):
    pass


def load_function(spec: str, *, field_name: str = "reward.function") -> Callable:
    """``path/to/file.py:fn`` or ``package.module:fn`` -> the function."""
    if ":" not in spec:
        raise ValueError(f"{field_name}={spec!r}: expected 'path/to/file.py:function' or 'module:function'")
    target, name = spec.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise FileNotFoundError(f"{field_name}: file {path} does not exist")
        mod_spec = importlib.util.spec_from_file_location(f"_rlspmd_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"{field_name}={spec!r}: cannot import module {target!r}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{field_name}={spec!r}: {target} has no function {name!r}")
    return fn


def _call(fn: Callable, response: str, ground_truth, extra_info: dict, data_source: str):
    # User functions may take (response, ground_truth, extra_info, data_source) or the first 3 / 2 of them.
    n = len(inspect.signature(fn).parameters)
    args = (response, ground_truth, extra_info, data_source)
    return fn(*args[: max(2, min(n, 4))])


class RewardManager:
    def __init__(self, cfg: RewardConfig, tokenizer, *, reward_model=None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.custom = load_function(cfg.function) if cfg.function else None
        self.reward_model = reward_model if reward_model is not None else NoRewardModel()
        if cfg.model.path is None and cfg.rule_weight == 0:
            raise ValueError("reward.rule_weight=0 without a reward model (reward.model.path) leaves no reward at all")

    def score(self, batch: Batch) -> Batch:
        """Adds ``response_text``, ``task_scores_B`` (rule / function), ``rm_scores_B`` (with a reward model) and
        their weighted sum ``scores_B`` (float32, on the batch's device)."""
        texts = self.tokenizer.batch_decode(batch["responses_BR"] * batch["response_mask_BR"], skip_special_tokens=True)
        device = batch["responses_BR"].device
        task = self._rule_scores(batch, texts) if self.cfg.rule_weight else [0.0] * len(texts)
        batch.set(response_text=texts, task_scores_B=torch.tensor(task, dtype=torch.float32, device=device))
        batch = self.reward_model(batch)
        scores = self.cfg.rule_weight * batch["task_scores_B"]
        if "rm_scores_B" in batch:
            scores = scores + self.cfg.model.weight * batch["rm_scores_B"]
        return batch.set(scores_B=scores)

    def _rule_scores(self, batch: Batch, texts: list[str]) -> list[float]:
        scores = []
        for i, (text, gt, src, info) in enumerate(
            zip(texts, batch["ground_truth"], batch["data_source"], batch["extra_info"])
        ):
            fn = self.custom or rule_for(src)
            name = getattr(fn, "__name__", str(fn))
            try:
                value = _call(fn, text, gt, info or {}, src)
            except Exception as e:  # noqa: BLE001 - re-raised with the sample named
                raise RewardError(
                    f"reward function {name} raised on sample {_sample_id(info, i)} (data_source={src!r}): "
                    f"{type(e).__name__}: {e}"
                ) from e
            if isinstance(value, dict):  # {"score": x, ...} as verl allows
                value = value.get("score")
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise RewardError(
                    f"reward function {name} returned {value!r} (not a finite number) on sample "
                    f"{_sample_id(info, i)} (data_source={src!r})"
                )
            scores.append(float(value))
        return scores


def _sample_id(info: dict | None, position: int) -> str:
    if info and "index" in info:
        return f"index={info['index']} (batch position {position})"
    return f"at batch position {position}"
