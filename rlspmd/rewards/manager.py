"""Rule scoring of generated samples.

``RewardManager.score`` decodes each response (``response_text``) and calls the sample's reward function — the user's
``reward.function`` or the rule for its ``data_source`` — giving ``task_scores_B``. The reward role
(``roles/reward.py``) combines it with a reward model's score. A function that raises, or returns something that is
not a finite number, stops the run with the sample's index and data_source in the message: a silently wrong reward
wastes a whole run.
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
    def __init__(self, cfg: RewardConfig, tokenizer):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.custom = load_function(cfg.function) if cfg.function else None

    def score(self, batch: Batch) -> Batch:
        """Adds ``response_text`` and ``task_scores_B`` (rule / function; 0 when ``reward.rule_weight`` is 0, which
        leaves the reward to a reward model), float32 on the batch's device."""
        texts = self.tokenizer.batch_decode(batch["responses_BR"] * batch["response_mask_BR"], skip_special_tokens=True)
        device = batch["responses_BR"].device
        task = self._rule_scores(batch, texts) if self.cfg.rule_weight else [0.0] * len(texts)
        return batch.set(response_text=texts, task_scores_B=torch.tensor(task, dtype=torch.float32, device=device))

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
