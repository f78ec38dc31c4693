"""Config files, tyro overrides, --help and --dry-run."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, torchrun
from rlspmd.config import GAE, GRPO, GSPO, SAPO, AdaptiveKL, FixedKL, KLCov, ReinforcePPBaseline, load_config_file
from rlspmd.startup import parse_args


def write(tmp_path, body: str):
    p = tmp_path / "cfg.py"
    p.write_text(body)
    return p


def test_file_then_overrides(tmp_path):
    p = write(
        tmp_path,
        "from rlspmd.config import *\n"
        "config = Config(actor=ActorConfig(optim=OptimConfig(lr=3e-4)), rollout=RolloutConfig(n=8))\n",
    )
    cfg, dry = parse_args(
        ["--config", str(p), "--actor.optim.lr", "1e-6", "--data.train-files", "a.parquet", "b.jsonl"]
    )
    assert cfg.actor.optim.lr == 1e-6 and cfg.rollout.n == 8 and not dry
    assert cfg.data.train_files == ["a.parquet", "b.jsonl"]


def test_a_policy_loss_is_picked_by_name_with_its_own_options_anywhere_on_the_line(tmp_path):
    p = write(
        tmp_path,
        "from rlspmd.config import *\nconfig = Config(actor=ActorConfig(policy_loss=GSPO(clip_ratio_low=1e-3)))\n",
    )
    cfg, _ = parse_args(["--config", str(p), "--trainer.total-steps", "3"])
    assert cfg.actor.policy_loss == GSPO(clip_ratio_low=1e-3, clip_ratio_high=4e-4)  # the file's loss, kept
    cfg, _ = parse_args(["--config", str(p), "--actor.policy-loss.clip-ratio-high", "5e-4"])  # the file's loss's option
    assert cfg.actor.policy_loss == GSPO(clip_ratio_low=1e-3, clip_ratio_high=5e-4)
    cfg, _ = parse_args(
        [
            "--config",
            str(p),
            "actor.policy-loss:sapo",
            "--actor.policy-loss.tau-neg",
            "1.2",
            "--trainer.total-steps",
            "3",
            "--actor.optim.lr",
            "1e-6",
        ]
    )
    assert cfg.actor.policy_loss == SAPO(tau_pos=1.0, tau_neg=1.2)
    assert cfg.trainer.total_steps == 3 and cfg.actor.optim.lr == 1e-6
    cfg, _ = parse_args(["--config", str(p), "actor.policy-loss:kl_cov"])  # the Python name works too
    assert cfg.actor.policy_loss == KLCov()


def test_a_negated_flag_of_the_files_component_keeps_its_other_values(tmp_path):
    """``--actor.engine.no-cpu-offload`` without naming ``actor.engine:fsdp``: tyro alone rejected it ("Unrecognized
    options") though it read ``--actor.engine.cpu-offload``; the file's engine and its other options stay."""
    p = write(
        tmp_path,
        "from rlspmd.config import *\nfrom rlspmd.engines.fsdp import FSDPConfig\n"
        "config = Config(actor=ActorConfig(engine=FSDPConfig(reduce_dtype='bfloat16', cpu_offload=True,"
        " compile_norms=True)))\n",
    )
    for line in (
        ["--actor.engine.no-cpu-offload"],
        ["--actor.engine.no-cpu-offload", "--actor.engine.compile-norms", "False"],
    ):
        cfg, _ = parse_args(["--config", str(p), *line])
        e = cfg.actor.engine
        assert (e.name, e.reduce_dtype, e.cpu_offload) == ("fsdp", "bfloat16", False)
        assert e.compile_norms == (len(line) == 1)
    cfg, _ = parse_args(["--config", str(p), "--actor.engine.no-cpu-offload", "--data.no-shuffle"])
    assert not cfg.actor.engine.cpu_offload and not cfg.data.shuffle and cfg.actor.engine.compile_norms
    cfg, _ = parse_args(["--data.no-shuffle", "--actor.engine.no-cpu-offload"])  # no file: the default's engine
    assert not cfg.actor.engine.cpu_offload and not cfg.data.shuffle and cfg.actor.engine.compile_norms is None


def test_an_option_of_another_policy_loss_is_an_error_naming_it(tmp_path):
    p = write(tmp_path, "from rlspmd.config import *\nconfig = Config(actor=ActorConfig(policy_loss=GSPO()))\n")
    proc = subprocess.run(
        [sys.executable, "-m", "rlspmd.train", "--config", str(p), "--actor.policy-loss.clip-ratio-c", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "--actor.policy-loss.clip-ratio-c" in proc.stderr and "actor.policy-loss:ppo-clip" in proc.stderr


def test_an_estimator_and_a_kl_controller_are_picked_by_name_with_their_own_options(tmp_path):
    p = write(
        tmp_path,
        "from rlspmd.config import *\nconfig = Config(algorithm=AlgorithmConfig(adv_estimator=GAE(lam=0.95)))\n",
    )
    cfg, _ = parse_args(
        ["--config", str(p), "--algorithm.adv-estimator.gamma", "0.99"]
    )  # the file's estimator's option
    assert cfg.algorithm.adv_estimator == GAE(gamma=0.99, lam=0.95) and cfg.algorithm.kl_ctrl == FixedKL()
    cfg, _ = parse_args(
        [
            "--config",
            str(p),
            "algorithm.adv-estimator:grpo",
            "--algorithm.adv-estimator.norm-adv-by-std",
            "False",
            "algorithm.kl-ctrl:adaptive",
            "--algorithm.kl-ctrl.target-kl",
            "0.02",
            "--algorithm.use-kl-in-reward",
        ]
    )
    assert cfg.algorithm.adv_estimator == GRPO(norm_adv_by_std=False) and cfg.algorithm.use_kl_in_reward
    assert cfg.algorithm.kl_ctrl == AdaptiveKL(target_kl=0.02)
    cfg, _ = parse_args(["algorithm.adv-estimator:reinforce_pp_baseline"])  # the Python name works too
    assert cfg.algorithm.adv_estimator == ReinforcePPBaseline()
    cfg, _ = parse_args(["--algorithm.adv-estimator.norm-adv-by-std", "False"])  # a bool option of the default (GRPO)
    assert cfg.algorithm.adv_estimator == GRPO(norm_adv_by_std=False)


def test_an_option_of_another_estimator_is_an_error_naming_it(tmp_path):
    p = write(
        tmp_path, "from rlspmd.config import *\nconfig = Config(algorithm=AlgorithmConfig(adv_estimator=RLOO()))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "rlspmd.train", "--config", str(p), "--algorithm.adv-estimator.lam", "0.9"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "--algorithm.adv-estimator.lam" in proc.stderr and "algorithm.adv-estimator:gae" in proc.stderr


def test_dry_run_listing_names_each_component_with_its_options():
    from rlspmd.startup import flatten

    flat = flatten(load_config_file(ROOT / "configs/ppo.py:cpu"))
    assert flat["algorithm.adv_estimator"] == GAE(lam=0.95) and flat["algorithm.kl_ctrl"] == AdaptiveKL(
        0.001, 0.02, 1000
    )
    assert "algorithm.adv_estimator = GAE(gamma=1.0, lam=0.95)" in "\n".join(f"{k} = {v!r}" for k, v in flat.items())
    assert flat["actor.policy_loss"].name == "ppo_clip" and flat["algorithm.rollout_correction.mode"] == "auto"


def test_config_may_be_a_function(tmp_path):
    p = write(
        tmp_path,
        "from rlspmd.config import *\ndef config():\n    return Config(trainer=TrainerConfig(total_steps=7))\n",
    )
    assert load_config_file(p).trainer.total_steps == 7


def test_missing_config_file_and_missing_object(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_config_file(tmp_path / "nope.py")
    p = write(tmp_path, "x = 1\n")
    with pytest.raises(ValueError, match="must define `config"):
        load_config_file(p)
    p2 = write(tmp_path, "config = 3\n")
    with pytest.raises(ValueError, match="expected Config"):
        load_config_file(p2)


def test_unknown_field_is_rejected_with_its_name():
    proc = subprocess.run(
        [sys.executable, "-m", "rlspmd.train", "--actor.optim.lrr", "1"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "--actor.optim.lrr" in proc.stderr


def test_help_shows_field_docstrings():
    proc = subprocess.run([sys.executable, "-m", "rlspmd.train", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0
    out = proc.stdout
    assert "--actor.optim.lr" in out and "Peak learning rate." in out
    assert "Samples per prompt (the GRPO group size)." in out


@pytest.mark.slow  # 13 s under torchrun
def test_dry_run_prints_layout_4_ranks():
    proc = torchrun(["-m", "rlspmd.train", "--config", "configs/quickstart.py", "--dry-run"], 4)
    out = proc.stdout
    assert "world size 4, placement colocated" in out
    assert "actor    ranks 0-3" in out and "dp=4" in out
    assert "rollout.n = " in out and "actor.optim.lr = " in out
    assert out.count("world size 4") == 1  # printed by rank 0 only


@pytest.mark.slow  # several 4-rank dry runs: over 20 s on 2 cores
def test_dry_run_split_placement_and_bad_degrees():
    proc = torchrun(
        [
            "-m",
            "rlspmd.train",
            "--dry-run",
            "--mesh.actor-ranks",
            "0-1",
            "--mesh.rollout-ranks",
            "2-3",
            "--mesh.rollout-tp",
            "2",
        ],
        4,
    )
    assert "placement split" in proc.stdout and "rollout  ranks 2-3" in proc.stdout and "tp=2" in proc.stdout
    bad = torchrun(["-m", "rlspmd.train", "--dry-run", "--mesh.rollout-tp", "3"], 2, check=False)
    assert bad.returncode != 0
    assert "tensor-parallel degree 3 does not divide its 2 ranks" in bad.stderr
    bad = torchrun(["-m", "rlspmd.train", "--dry-run", "--mesh.rollout-ranks", "0-5"], 2, check=False)
    assert bad.returncode != 0 and "mesh.rollout_ranks='0-5'" in bad.stderr


def test_to_dict_names_the_picked_components():
    """The run's config.json and the checkpoint's meta tell two components with the same options apart."""
    from rlspmd.config import CISPO, ActorConfig, Config, MegatronConfig, PPOClip, to_dict

    cispo = to_dict(Config(actor=ActorConfig(policy_loss=CISPO(), engine=MegatronConfig(tp=2))))
    clip = to_dict(Config(actor=ActorConfig(policy_loss=PPOClip(clip_ratio_low=0.2, clip_ratio_high=0.2))))
    assert cispo["actor"]["policy_loss"] == {"name": "cispo", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2}
    assert clip["actor"]["policy_loss"]["name"] == "ppo_clip"
    assert cispo["actor"]["engine"]["name"] == "megatron" and cispo["actor"]["engine"]["tp"] == 2
    assert clip["actor"]["engine"]["name"] == "fsdp"
    json.dumps(cispo)  # plain data


HEAVY = ("transformers", "datasets", "vllm", "torch.distributed.checkpoint", "torch._dynamo")


def test_a_command_line_is_parsed_and_checked_before_the_heavy_imports():
    """``rlspmd.train`` and ``rlspmd.sft`` up to their config checks import no model library: a typo or a bad value
    is reported in about 2 s, not after seconds of importing transformers (the engines' configs load their engines in
    ``build``, the checkpoint package its modules on first use)."""
    probe = (
        "import sys\n"
        "from rlspmd.startup import parse_args\n"
        "from rlspmd.validate import config_problems\n"
        "import rlspmd.train, rlspmd.sft\n"
        "cfg, _ = parse_args(['--config', 'configs/quickstart.py', 'actor.engine:megatron'])\n"
        "assert type(cfg.actor.engine).__name__ == 'MegatronConfig'\n"
        "config_problems(cfg, world_size=2, check_files=False)\n"
        "from rlspmd.config import SFTConfig\n"
        "from rlspmd.validate import check_sft_config\n"
        "sft, _ = parse_args(['--config', 'configs/sft_quickstart.py', '--total-steps', '3'], SFTConfig)\n"
        "check_sft_config(sft, world_size=2, check_files=False)\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
        "from rlspmd.engines.fsdp import FSDPEngine, LoraEngine\n"  # the engines are still importable by name
        "from rlspmd.engines.megatron import MegatronEngine\n"
        "print('transformers' in sys.modules)\n"
        "import rlspmd.engines.fsdp as f\n"
        "try:\n    f.NoSuchEngine\nexcept AttributeError as e:\n    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "[]",
        "True",
        "module 'rlspmd.engines.fsdp' has no attribute 'NoSuchEngine'",
    ], proc.stdout
