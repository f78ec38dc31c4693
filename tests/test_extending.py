"""A user's own components, from their own files, with no change to rlspmd (docs/extending.md).

A policy loss, an advantage estimator and a reward function defined in a file outside the package train the tiny model,
picked once on the command line by import path and once from a Python config file that imports them; both runs give the
same numbers, and the config-file run stops after step 1 and resumes to the same end. Bad options of a user's loss are
reported by name before anything loads, and every kind of config component resolves from an import path. A stage of
the user's runs in every step of the config-file run.
"""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, torchrun
from rl_run import metrics, rl_args
from rlspmd.startup import parse_args

PARTS = '''
"""A user's parts: rlspmd is imported, never edited."""

from dataclasses import dataclass
from typing import ClassVar

from rlspmd.algorithms import AdvantageEstimator, PolicyLoss, grpo_outcome, ppo_clip
from rlspmd.components import Problem
from rlspmd.rollout.native import NativeConfig
from rlspmd.stages import StepStage


@dataclass
class ScaledPPO(PolicyLoss):
    """PPO-clip without dual clip, its loss scaled."""

    name: ClassVar[str] = "scaled_ppo"
    scale: float = 0.5
    """Factor on the loss (> 0)."""

    def problems(self) -> list[Problem]:
        return [] if self.scale > 0 else [("scale", self.scale, "must be > 0")]

    def build(self, *, generator=None):
        def loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, weights_BT=None):
            value, metrics = ppo_clip(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, agg=agg,
                                      weights_BT=weights_BT, clip_low=0.2, clip_high=0.2, clip_ratio_c=None)
            return self.scale * value, metrics

        return loss


@dataclass
class CentredScore(AdvantageEstimator):
    """Each sample's score minus its group's mean (Dr.GRPO), written by the user."""

    def build(self, *, all_reduce):
        def estimate(batch):
            rewards, mask = batch["token_rewards_BR"], batch["loss_mask_BR"].float()
            return grpo_outcome(rewards.sum(-1), mask, batch["uid_B"], norm_by_std=False)

        return estimate


@dataclass
class SmallBatchNative(NativeConfig):
    """The native engine with a small default batch (a rollout engine of the user's)."""

    max_batch_size: int = 8


@dataclass
class ResponseTokens(StepStage):
    """Logs the mean response length of the scored samples (a stage of the user's, changing nothing)."""

    at: ClassVar[str] = "scored"

    def build(self, *, mesh, tokenizer):
        def stage(batch, metrics):
            metrics.mean("user/response_tokens", float(batch["response_mask_BR"].sum()), float(len(batch)))
            return batch

        return stage


def length_reward(response, ground_truth):
    return (len(response) % 7) / 7.0
'''


@pytest.fixture
def parts(tmp_path):
    d = tmp_path / "user"
    d.mkdir()
    (d / "my_parts.py").write_text(PARTS)
    return d / "my_parts.py"


def test_every_kind_of_config_component_resolves_from_an_import_path(parts):
    cfg, _ = parse_args(
        [
            f"actor.policy-loss:{parts}:ScaledPPO",
            "--actor.policy-loss.scale",
            "0.25",
            f"algorithm.adv-estimator:{parts}:CentredScore",
            f"rollout.engine:{parts}:SmallBatchNative",
            "--rollout.engine.max-batch-size",
            "4",
            "actor.engine:rlspmd.engines.megatron.config:MegatronConfig",
            "--actor.engine.tp",
            "2",
        ]
    )
    loss, est, engine = cfg.actor.policy_loss, cfg.algorithm.adv_estimator, cfg.rollout.engine
    assert (type(loss).__name__, loss.scale, loss.name) == ("ScaledPPO", 0.25, "scaled_ppo")
    assert type(est).__name__ == "CentredScore" and est.name == "centred_score"  # a name derived from the class
    assert (type(engine).__name__, engine.max_batch_size) == ("SmallBatchNative", 4)
    assert (cfg.actor.engine.name, cfg.actor.engine.tp) == ("megatron", 2)
    # config.json and the checkpoint meta record a user's component by its import path, a shipped one by its name
    from rlspmd.config import to_dict

    record = to_dict(cfg)
    assert record["actor"]["policy_loss"] == {"name": "scaled_ppo", "import": f"{parts}:ScaledPPO", "scale": 0.25}
    assert record["actor"]["engine"] == {"name": "megatron", "tp": 2, "pp": 1, "param_dtype": "auto"}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{parts}:CentredScore", "actor.policy_loss='{parts}:CentredScore': CentredScore is not a policy loss"),
        ("{parts}:Nope", "actor.policy_loss='{parts}:Nope': {parts} has no class 'Nope'"),
        ("{missing}:X", "actor.policy_loss='{missing}:X': file {missing} does not exist"),
    ],
)
def test_an_import_path_that_is_not_a_component_of_the_kind_is_an_error_naming_the_field(parts, spec, message):
    spec = spec.format(parts=parts, missing=parts.parent / "missing.py")
    proc = subprocess.run(
        [sys.executable, "-m", "rlspmd.train", f"actor.policy-loss:{spec}", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert message.format(parts=parts, missing=parts.parent / "missing.py") in proc.stderr, proc.stderr


def test_a_bad_option_of_a_users_loss_is_reported_by_name_before_anything_loads(parts, tiny_model, arithmetic_data):
    proc = subprocess.run(
        [
            sys.executable,
            *rl_args(tiny_model, arithmetic_data, parts.parent / "out", steps=2),
            f"actor.policy-loss:{parts}:ScaledPPO",
            "--actor.policy-loss.scale",
            "-1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "invalid configuration (1 problem; nothing was loaded):" in proc.stderr
    assert "actor.policy_loss.scale=-1.0: must be > 0 (scaled_ppo)" in proc.stderr
    assert not (parts.parent / "out" / "config.json").exists()  # it stopped before the run started


@pytest.mark.slow
@pytest.mark.dist
def test_user_components_train_from_the_command_line_and_from_a_config_file_and_resume(
    parts, tiny_model, arithmetic_data, tmp_path
):
    base = dict(steps=2)
    cli = tmp_path / "cli"
    torchrun(
        [
            *rl_args(tiny_model, arithmetic_data, cli, reward=f"{parts}:length_reward", **base),
            f"actor.policy-loss:{parts}:ScaledPPO",
            "--actor.policy-loss.scale",
            "0.5",
            f"algorithm.adv-estimator:{parts}:CentredScore",
        ],
        1,
    )
    # The same parts from a Python config next to them (its directory is importable, as a script's is)
    config = parts.parent / "run.py"
    config.write_text(
        "from my_parts import CentredScore, ResponseTokens, ScaledPPO\n"
        "from rlspmd.config import ActorConfig, AlgorithmConfig, Config, RewardConfig, TrainerConfig\n"
        f"config = Config(actor=ActorConfig(policy_loss=ScaledPPO(scale=0.5)),\n"
        f"                algorithm=AlgorithmConfig(adv_estimator=CentredScore()),\n"
        f"                reward=RewardConfig(function={str(parts) + ':length_reward'!r}),\n"
        f"                trainer=TrainerConfig(stages=[ResponseTokens()]))\n"
    )
    from_file = tmp_path / "file"
    args = ["--config", str(config), *rl_args(tiny_model, arithmetic_data, from_file, **base)[2:]]
    torchrun(["-m", "rlspmd.train", *args, "--trainer.stop-at-step", "1"], 1)
    assert "resumed from" in torchrun(["-m", "rlspmd.train", *args, "--resume", "auto"], 1).stdout
    want, got = metrics(cli), metrics(from_file)
    assert all("user/response_tokens" in r for r in got[1:])  # the user's stage ran in every step
    got = [{k: v for k, v in r.items() if not k.startswith("user/")} for r in got]
    assert [r["step"] for r in got] == [0, 1, 2] and got == want
    assert want[-1]["actor/grad_norm"] > 0  # the user's loss and advantages moved the policy
    recorded = json.loads((from_file / "config.json").read_text())
    assert recorded["actor"]["policy_loss"]["import"] == "my_parts:ScaledPPO"
    assert recorded["algorithm"]["adv_estimator"] == {"name": "centred_score", "import": "my_parts:CentredScore"}
