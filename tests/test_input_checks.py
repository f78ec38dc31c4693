"""Bad input, in one process: the start-up config check (``rlspmd/validate/``), prompts without text, jsonl lines
cut in half, truncated safetensors. Every message names the field and its value, or the file and the row/line."""

from __future__ import annotations

import dataclasses
import glob
import json
import shutil
from pathlib import Path

import pytest

from rlspmd.config import (
    GAE,
    GDPO,
    GRPO,
    AdaptiveKL,
    ReMax,
    GSPO,
    ActorConfig,
    AgentConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    FilterGroupsConfig,
    LoraConfig,
    MeshConfig,
    RefConfig,
    KLCov,
    MegatronConfig,
    PPOClip,
    RewardConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    SFTConfig,
    SFTDataConfig,
    TrainerConfig,
    VllmConfig,
    load_config_file,
)
from rlspmd.data.prompts import PromptDataset, has_user_text, read_rows
from rlspmd.models.loader import check_model_dir, load_causal_lm, load_tokenizer
from rlspmd.validate import ConfigError, check_config, check_function_spec, config_problems, sft_config_problems

ROOT = Path(__file__).resolve().parents[1]


def problems(cfg: Config, world_size: int = 2) -> list[str]:
    return config_problems(cfg, world_size=world_size, check_files=False)


def with_(cfg=None, **sections) -> Config:
    return dataclasses.replace(cfg or Config(), **sections)


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (with_(data=DataConfig(train_batch_size=0)), ["data.train_batch_size=0: must be >= 1"]),
        (with_(rollout=RolloutConfig(n=-1)), ["rollout.n=-1: must be >= 1"]),
        (with_(actor=ActorConfig(micro_batch_size=0)), ["actor.micro_batch_size=0: must be >= 1"]),
        (
            with_(actor=ActorConfig(mini_batch_size=12)),
            ["actor.mini_batch_size=12: does not divide data.train_batch_size=32 (prompts per step)"],
        ),
        (
            with_(data=DataConfig(train_batch_size=33), actor=ActorConfig(mini_batch_size=11)),
            ["data.train_batch_size=33: does not split over the actor's 2 DP ranks"],
        ),
        (
            with_(actor=ActorConfig(mini_batch_size=1), rollout=RolloutConfig(n=1)),
            [
                "actor.mini_batch_size=1: x rollout.n=1 = 1 samples per mini-batch do not split over "
                "the actor's 2 DP ranks"
            ],
        ),
        (with_(rollout=RolloutConfig(temperature=0.0)), ["rollout.temperature=0.0: must be > 0"]),
        (
            with_(algorithm=AlgorithmConfig(adv_estimator="ppo")),
            ["algorithm.adv_estimator='ppo': must be an advantage estimator (GAE, GRPO, "],
        ),
        (
            with_(algorithm=AlgorithmConfig(adv_estimator=GAE(gamma=1.5, lam=-0.1))),
            [
                "algorithm.adv_estimator.gamma=1.5: must be in [0, 1] (gae)",
                "algorithm.adv_estimator.lam=-0.1: must be in [0, 1] (gae)",
            ],
        ),
        (
            with_(algorithm=AlgorithmConfig(adv_estimator=GRPO(eps=-1.0))),
            ["algorithm.adv_estimator.eps=-1.0: must be >= 0 (grpo)"],
        ),
        (
            with_(
                algorithm=AlgorithmConfig(
                    use_kl_in_reward=True, kl_ctrl=AdaptiveKL(kl_coef=-1.0, target_kl=0.0, horizon=0)
                )
            ),
            [
                "algorithm.kl_ctrl.kl_coef=-1.0: must be >= 0 (adaptive)",
                "algorithm.kl_ctrl.target_kl=0.0: must be > 0 (adaptive)",
                "algorithm.kl_ctrl.horizon=0: must be > 0 (adaptive)",
            ],
        ),
        (
            with_(algorithm=AlgorithmConfig(use_kl_in_reward=True, kl_ctrl="adaptive")),
            ["algorithm.kl_ctrl='adaptive': must be a KL controller (FixedKL, AdaptiveKL), not str"],
        ),
        (
            with_(algorithm=AlgorithmConfig(use_kl_in_reward=True, kl_penalty="k9")),
            ["algorithm.kl_penalty='k9': must be one of ["],
        ),
        (
            with_(actor=ActorConfig(policy_loss="ppo")),
            [
                "actor.policy_loss='ppo': must be a policy loss "
                "(PPOClip, CISPO, GPG, DRO, GSPO, SAPO, GMPO, ClipCov, KLCov, DPPOTV"
            ],
        ),
        (
            with_(actor=ActorConfig(policy_loss=PPOClip(clip_ratio_c=1.0))),
            ["actor.policy_loss.clip_ratio_c=1.0: the dual-clip bound must be > 1, or None (off) (ppo_clip)"],
        ),
        (
            with_(actor=ActorConfig(policy_loss=KLCov(kl_cov_ratio=2.0, kl_cov_coef=-1.0))),
            [
                "actor.policy_loss.kl_cov_ratio=2.0: must be in (0, 1]",
                "actor.policy_loss.kl_cov_coef=-1.0: must be >= 0 (kl_cov)",
            ],
        ),
        (
            with_(actor=ActorConfig(policy_loss=GSPO(clip_ratio_low="3e-4"))),
            ["actor.policy_loss.clip_ratio_low='3e-4': must be float, not str"],
        ),
        (
            with_(
                algorithm=AlgorithmConfig(
                    adv_estimator=GRPO(), filter_groups=FilterGroupsConfig(enable=True, gen_batch_size=16)
                )
            ),
            ["algorithm.filter_groups.gen_batch_size=16: must be >= data.train_batch_size=32"],
        ),
        (with_(reward=RewardConfig(rule_weight=0.0)), ["reward.rule_weight=0.0: 0 without a reward model"]),
        (
            with_(reward=RewardConfig(rule_weight=0.0), rollout=RolloutConfig(agent=AgentConfig(tools=["calculator"]))),
            [],
        ),
        (
            with_(rollout=RolloutConfig(agent=AgentConfig(tools=["calculator"], max_turns=0, tool_timeout_s=0.0))),
            ["rollout.agent.max_turns=0: must be >= 1", "rollout.agent.tool_timeout_s=0.0: must be > 0"],
        ),
        (
            with_(rollout=RolloutConfig(ignore_eos=True, agent=AgentConfig(tools=["calculator"]))),
            ["rollout.ignore_eos=True: fixed-length"],
        ),
        (
            with_(rollout=RolloutConfig(agent=AgentConfig(tools=["calculator", "no_such_tool"]))),
            [
                "rollout.agent.tools[1]='no_such_tool': neither a registered name "
                "(calc_gsm8k_reward, calculator, gsm8k_answer, python)"
            ],
        ),
        (with_(reward=RewardConfig(timeout_s=0.0)), ["reward.timeout_s=0.0: must be > 0, or None"]),
        (
            with_(mesh=MeshConfig(rollout_ranks="0")),
            ["mesh.rollout_ranks='0': ranks [0] must equal the actor's ranks [0, 1]"],
        ),
        (with_(mesh=MeshConfig(actor_ranks="1", rollout_ranks="0")), ["mesh.actor_ranks='1': must include rank 0"]),
        (with_(mesh=MeshConfig(rollout_tp=3)), ["mesh: rollout tensor-parallel degree 3 does not divide its 2 ranks"]),
        (with_(actor=ActorConfig(lora=LoraConfig(rank=-1))), ["actor.lora.rank=-1: must be >= 0"]),
        (
            with_(actor=ActorConfig(lora=LoraConfig(rank=4, alpha=0.0, dropout=1.0, target_modules=[]))),
            [
                "actor.lora.alpha=0.0: must be > 0",
                "actor.lora.dropout=1.0: must be in [0, 1)",
                "actor.lora.target_modules=[]: must name",
            ],
        ),
        (
            with_(actor=ActorConfig(engine=MegatronConfig(), lora=LoraConfig(rank=4))),
            ["actor.engine='megatron': actor.lora.rank=4 needs the fsdp"],
        ),
        # an engine is a component that checks its own options;
        # the old string spelling is a type error naming both engines
        (
            with_(actor=ActorConfig(engine=MegatronConfig(tp=0, pp=-1))),
            ["actor.engine.tp=0: must be >= 1 (megatron)", "actor.engine.pp=-1: must be >= 1 (megatron)"],
        ),
        (
            with_(algorithm=AlgorithmConfig(adv_estimator=GAE()), critic=CriticConfig(engine=MegatronConfig(pp=0))),
            ["critic.engine.pp=0: must be >= 1 (megatron)"],
        ),
        (
            with_(actor=ActorConfig(engine="megatron")),
            ["actor.engine='megatron': must be a training engine (FSDPConfig, MegatronConfig), not str"],
        ),
        (
            with_(actor=ActorConfig(lora=LoraConfig(rank=4)), ref=RefConfig(model_path="other")),
            ["ref.model_path='other': with actor.lora the reference is the actor's base model"],
        ),
        (with_(actor=ActorConfig(lora=LoraConfig(rank=0, alpha=0.0))), []),  # LoRA off: its other fields are not read
        # asynchronous RL: split placement only, and no generation that depends on the trained batch
        (
            with_(trainer=TrainerConfig(max_staleness=1)),
            ["trainer.max_staleness=1: asynchronous RL needs split placement"],
        ),
        (with_(trainer=TrainerConfig(max_staleness=-1)), ["trainer.max_staleness=-1: must be >= 0"]),
        (
            with_(
                trainer=TrainerConfig(max_staleness=1),
                mesh=MeshConfig(actor_ranks="0", rollout_ranks="1"),
                algorithm=AlgorithmConfig(adv_estimator=ReMax()),
            ),
            ["trainer.max_staleness=1: does not combine with algorithm.adv_estimator='remax'"],
        ),
        (
            with_(
                trainer=TrainerConfig(max_staleness=2),
                mesh=MeshConfig(actor_ranks="0", rollout_ranks="1"),
                algorithm=AlgorithmConfig(filter_groups=FilterGroupsConfig(enable=True)),
            ),
            ["trainer.max_staleness=2: does not combine with dynamic sampling"],
        ),
        # bypass mode: one update per step, the correction on (auto on the native engine in fp32 resolves to off)
        (
            with_(
                algorithm=AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(mode="tis", bypass=True)),
                actor=ActorConfig(mini_batch_size=8),
            ),
            [
                "algorithm.rollout_correction.bypass=True needs one optimiser update per step: actor.ppo_epochs=1 and "
                "actor.mini_batch_size = data.train_batch_size, got actor.ppo_epochs=1, actor.mini_batch_size=8"
            ],
        ),
        (
            with_(
                algorithm=AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(bypass=True)),
                actor=ActorConfig(mini_batch_size=32),
            ),
            ["algorithm.rollout_correction.bypass=True needs the correction on, but its mode resolved to 'off'"],
        ),
        # GDPO: one weight per column (the rule score, then reward.components), components named once
        (
            with_(algorithm=AlgorithmConfig(adv_estimator=GDPO(reward_weights=[1.0, 0.5]))),
            [
                "algorithm.adv_estimator.reward_weights=[1.0, 0.5]: needs one weight per reward component: "
                "1 columns ['task_score']"
            ],
        ),
        (
            with_(reward=RewardConfig(components=["a.py:fmt", "b.py:fmt"])),
            ["reward.components=['a.py:fmt', 'b.py:fmt']: name the function(s) ['fmt'] twice"],
        ),
    ],
)
def test_config_problems_name_the_field_and_value(cfg, expected):
    got = problems(cfg)
    assert len(got) == len(expected), got
    for line, want in zip(got, expected):
        assert line.startswith(want), (line, want)


def test_every_problem_is_reported_at_once():
    cfg = with_(
        data=DataConfig(train_batch_size=0, val_batch_size=0), rollout=RolloutConfig(n=0, max_response_length=0)
    )
    with pytest.raises(ConfigError) as err:
        check_config(cfg, world_size=1, check_files=False)
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid configuration (4 problems; nothing was loaded):"
    assert {line.split("=")[0].strip() for line in lines[1:]} == {
        "data.train_batch_size",
        "data.val_batch_size",
        "rollout.n",
        "rollout.max_response_length",
    }


def test_a_literal_set_in_a_config_file_is_checked(tmp_path):
    path = tmp_path / "cfg.py"
    path.write_text(
        "from rlspmd.config import Config, DataConfig\nconfig = Config(data=DataConfig(overlong_prompts='truncate'))\n"
    )
    assert problems(load_config_file(path)) == ["data.overlong_prompts='truncate': must be one of ['drop', 'error']"]


def test_a_value_of_the_wrong_type_set_in_a_config_file_names_the_field_and_the_type(tmp_path):
    """A string where an int belongs used to be accepted and run; every field's annotation is checked, through
    optional, list and tuple types; an int passes for a float, a bool does not pass for an int."""
    path = tmp_path / "cfg.py"
    path.write_text(
        "from rlspmd.config import ActorConfig, Config, DataConfig, OptimConfig, RolloutConfig, TrainerConfig\n"
        "config = Config(trainer=TrainerConfig(total_steps='3', loggers=['jsonl', 3]),\n"
        "                rollout=RolloutConfig(n=True, temperature=1),\n"
        "                data=DataConfig(max_val_samples=2.5),\n"
        "                actor=ActorConfig(optim=OptimConfig(betas=(0.9,))))\n"
    )
    assert sorted(problems(load_config_file(path))) == sorted(
        [
            "trainer.total_steps='3': must be int, not str",
            "trainer.loggers=['jsonl', 3]: must be list[str], not list",
            "rollout.n=True: must be int, not bool",
            "data.max_val_samples=2.5: must be int or None, not float",
            "actor.optim.betas=(0.9,): must be tuple[float, float], not tuple",
        ]
    )


def test_shipped_configs_pass():
    """Every config in configs/ (and its cpu() variant) is valid for the world sizes it is meant for."""
    checked = 0
    for path in sorted(glob.glob(str(ROOT / "configs" / "**" / "*.py"), recursive=True)):
        text = Path(path).read_text()
        kind = SFTConfig if "SFTConfig(" in text else Config
        for name in ("config", "cpu"):
            if name == "cpu" and "def cpu" not in text:
                continue
            cfg = load_config_file(path if name == "config" else f"{path}:{name}", kind)
            fn = sft_config_problems if kind is SFTConfig else config_problems
            # an expert-parallel config (mesh.actor_ep) is meant for worlds its expert groups fill
            ep = cfg.mesh.actor_ep if kind is Config else 1
            for world in (w for w in (1, 2, 4) if w % ep == 0):
                assert fn(cfg, world_size=world, check_files=False) == [], (path, name, world)
            checked += 1
    assert checked >= 10


def test_sft_config_problems():
    cfg = dataclasses.replace(SFTConfig(), data=SFTDataConfig(batch_size=3, max_length=0), micro_batch_size=0)
    assert sft_config_problems(cfg, world_size=2, check_files=False) == [
        "data.max_length=0: must be >= 1",
        "data.batch_size=3: does not split over 2 DP ranks (every rank is a DP rank in SFT)",
        "micro_batch_size=0: must be >= 1",
    ]
    tools = dataclasses.replace(SFTConfig(), data=SFTDataConfig(tools=["calculator", "nope"]))
    assert sft_config_problems(tools, world_size=2, check_files=False) == [
        "data.tools[1]='nope': neither a registered name (calc_gsm8k_reward, calculator, gsm8k_answer, python) "
        "nor 'path/to/file.py:Class' / 'package.module:Class'"
    ]


def test_files_that_must_exist(tmp_path, tiny_model):
    cfg = with_(
        actor=ActorConfig(model=dataclasses.replace(ActorConfig().model, path=str(tmp_path / "no_model"))),
        data=DataConfig(train_files=[str(tmp_path / "train.parquet")], val_files=[str(tmp_path / "val.csv")]),
        reward=RewardConfig(function=f"{tmp_path / 'r.py'}:score"),
    )
    (tmp_path / "val.csv").write_text("x")
    got = config_problems(cfg, world_size=1)
    assert got == [
        f"actor.model.path: model directory {tmp_path / 'no_model'} does not exist",
        f"data.train_files: data file {tmp_path / 'train.parquet'} does not exist",
        f"data.val_files: {tmp_path / 'val.csv'} is neither .parquet nor .jsonl",
        f"reward.function: file {tmp_path / 'r.py'} does not exist",
    ]
    model = dataclasses.replace(ActorConfig().model, path=str(tiny_model))
    assert [p for p in config_problems(with_(cfg, actor=ActorConfig(model=model)), world_size=1) if "actor" in p] == []


def test_prompt_plus_response_over_the_models_context_is_a_config_error(tmp_path, tiny_model):
    """data.max_prompt_length + rollout.max_response_length above max_position_embeddings (512 for the tiny model) is
    reported before anything loads, naming both fields and the limit; in a multi-turn run the response budget is the
    whole conversation. A model directory without the field, or without config.json, is not checked."""
    data = tmp_path / "p.jsonl"
    data.write_text("")
    model = dataclasses.replace(ActorConfig().model, path=str(tiny_model))
    base = with_(actor=ActorConfig(model=model), data=DataConfig(train_files=[str(data)], val_files=[str(data)]))

    def context_problems(max_prompt_length: int, max_response_length: int, cfg: Config = base, **rollout) -> list[str]:
        cfg = with_(
            cfg,
            data=dataclasses.replace(cfg.data, max_prompt_length=max_prompt_length),
            rollout=RolloutConfig(max_response_length=max_response_length, **rollout),
        )
        return [line for line in config_problems(cfg, world_size=1) if "context" in line]

    assert context_problems(400, 112) == []  # 512 fits exactly
    assert context_problems(400, 113) == [
        "data.max_prompt_length=400: + rollout.max_response_length=113 (the generated tokens) = 513 tokens exceeds the "
        f"context of actor.model.path={str(tiny_model)!r} (max_position_embeddings=512 in its config.json); "
        "lower one of them so their sum is <= 512"
    ]
    agent = context_problems(96, 512, agent=AgentConfig(tools=["calculator"]))
    assert (
        len(agent) == 1
        and "rollout.max_response_length=512 (the whole conversation after the prompt: model turns, "
        "tool results, user turns) = 608 tokens exceeds"
        in agent[0]
    )
    vllm = context_problems(100, 100, engine=VllmConfig(max_model_len=1024))
    assert vllm == [
        f"rollout.engine.max_model_len=1024: exceeds the context of actor.model.path={str(tiny_model)!r} "
        "(max_position_embeddings=512)"
    ]
    # a reference of its own is checked too; a directory without the field is not
    short = tmp_path / "short"
    shutil.copytree(tiny_model, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    with_ref = with_(base, ref=RefConfig(model_path=str(short)))
    assert [
        line.split(" exceeds the context of ")[1].split("=")[0] for line in context_problems(200, 100, with_ref)
    ] == ["ref.model_path"]
    (short / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "max_position_embeddings"}))
    assert (
        context_problems(200, 1000, with_(base, actor=ActorConfig(model=dataclasses.replace(model, path=str(short)))))
        == []
    )
    # the same with check_files=False (a dry run): nothing is read
    cfg = with_(
        base, data=dataclasses.replace(base.data, max_prompt_length=400), rollout=RolloutConfig(max_response_length=200)
    )
    assert not [line for line in config_problems(cfg, world_size=1, check_files=False) if "context" in line]


def test_reward_function_is_found_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "fn.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "import math as m\nfrom os.path import join as joined\n"
        "if True:\n    def score(r, g):\n        return 0.0\nelse:\n    pass\n"
        "try:\n    other = lambda r, g: 1.0\nexcept ImportError:\n    pass\n"
    )
    for name in ("score", "other", "m", "joined"):
        check_function_spec(f"{tmp_path / 'fn.py'}:{name}", field_name="reward.function")
    with pytest.raises(ValueError, match=r"reward.function='.*fn.py:nope': .*fn.py has no function 'nope'"):
        check_function_spec(f"{tmp_path / 'fn.py'}:nope", field_name="reward.function")
    assert not marker.exists(), "checking must not import the user's module"
    (tmp_path / "broken.py").write_text("def score(r, g)\n    return 0\n")
    with pytest.raises(ValueError, match=r"broken.py line 1: SyntaxError"):
        check_function_spec(f"{tmp_path / 'broken.py'}:score", field_name="reward.function")
    check_function_spec(
        "rlspmd.rewards.rules:gsm8k", field_name="reward.function"
    )  # a module on the path, not imported
    with pytest.raises(ValueError, match="rlspmd.rewards.rules:nope.*has no function 'nope'"):
        check_function_spec("rlspmd.rewards.rules:nope", field_name="reward.function")
    with pytest.raises(ValueError, match="cannot find module 'no_such_pkg'"):
        check_function_spec("no_such_pkg.mod:fn", field_name="reward.function")


# -- data ---------------------------------------------------------------------------------------------------


def rows(contents: list) -> list[dict]:
    return [
        {"data_source": "arithmetic", "prompt": c, "reward_model": {"style": "rule", "ground_truth": "1"}}
        for c in contents
    ]


def write_jsonl(path: Path, data: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return str(path)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model, field_name="actor.model.path")


EMPTY = [
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": " \n "}],
    [],
    "",
    [{"role": "user", "content": [{"type": "text", "text": ""}]}],
]


def test_prompts_without_text_are_rejected_naming_file_and_row(tmp_path, tok):
    good = [[{"role": "user", "content": "Calculate 1 + 2."}]]
    for bad in EMPTY:
        path = write_jsonl(tmp_path / "p.jsonl", rows(good * 3 + [bad]))
        with pytest.raises(
            ValueError, match=rf"data.train_files: {path} row 3: the prompt has no user message with text"
        ):
            PromptDataset([path], tok, prompt_key="prompt", max_prompt_length=64)
    assert has_user_text([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}])


def test_prompts_without_text_dropped_and_counted(tmp_path, tok, caplog):
    good = [[{"role": "user", "content": f"Calculate {i} + 2."}] for i in range(3)]
    path = write_jsonl(tmp_path / "p.jsonl", rows([good[0], EMPTY[0], good[1], EMPTY[1], good[2]]))
    ds = PromptDataset([path], tok, prompt_key="prompt", max_prompt_length=64, empty="drop")
    assert len(ds) == 3 and ds.n_empty == 2 and ds.n_dropped == 0
    assert [r["where"][1] for r in ds.rows] == [0, 2, 4]
    assert "dropped 2 prompts with no user text (data.empty_prompts=drop)" in caplog.text


def test_an_overlong_agent_prompt_is_named_with_file_and_row(tmp_path, tiny_tools_model):
    """Agent prompts are measured with the tool schemas rendered in (what the model reads): the row over
    data.max_prompt_length is named with data.overlong_prompts=error, dropped and counted otherwise."""
    from rlspmd.agent import load_tools, tool_schemas

    tools = tool_schemas(load_tools(AgentConfig(tools=["calculator"])))
    tools_tok = load_tokenizer(tiny_tools_model, field_name="actor.model.path")
    prompts = [
        [{"role": "user", "content": "Calculate 1 + 2."}],
        [{"role": "user", "content": "Calculate " + " + ".join(["12"] * 30)}],
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows(prompts))

    def ids(p: list[dict], **kw) -> list[int]:
        return tools_tok(
            tools_tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **kw), add_special_tokens=False
        )["input_ids"]

    lengths = [len(ids(p, tools=tools)) for p in prompts]
    limit = lengths[0] + 5  # the first prompt fits, the second does not
    assert lengths[1] > limit and len(ids(prompts[0])) < lengths[0]  # the schemas count
    overlong = rf"data.train_files: {path} row 1: prompt has {lengths[1]} tokens > data.max_prompt_length={limit}"
    with pytest.raises(ValueError, match=overlong):
        PromptDataset([path], tools_tok, prompt_key="prompt", max_prompt_length=limit, overlong="error", tools=tools)
    ds = PromptDataset([path], tools_tok, prompt_key="prompt", max_prompt_length=limit, tools=tools)
    assert len(ds) == 1 and ds.n_dropped == 1 and ds.prompt_ids[0] == ids(prompts[0], tools=tools)


def test_a_jsonl_line_cut_in_half_is_named(tmp_path):
    lines = [json.dumps(r) for r in rows([[{"role": "user", "content": f"Calculate {i}."}] for i in range(5)])]
    path = tmp_path / "cut.jsonl"
    path.write_text("\n".join([*lines[:3], lines[3][:20], lines[4]]) + "\n")
    with pytest.raises(
        ValueError, match=rf"data.train_files: cannot read {path} line 4: not valid JSON \(Unterminated string"
    ):
        read_rows([str(path)], prompt_key="prompt", field_name="data.train_files")


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda b: b[: len(b) // 2], "bytes, but its header describes"),
        (lambda b: b[:5], "5 bytes, shorter than the 8-byte header length"),
        (lambda b: b[:8] + b"{not json" + b[17:], "header is not JSON"),
        (lambda b: b + b"\0" * 16, "bytes, but its header describes"),
    ],
)
def test_damaged_safetensors_name_the_file(tmp_path, tiny_model, damage, why):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    for load in (
        lambda: check_model_dir(model, field_name="actor.model.path"),
        lambda: load_causal_lm(model, dtype="float32", attn_implementation="sdpa", field_name="actor.model.path"),
    ):
        with pytest.raises(ValueError, match=rf"actor.model.path: {weights} is truncated or corrupt \(.*{why}"):
            load()
