"""verl's agent configuration carried over unchanged: its ``tool_config`` and ``interaction_config`` YAML files
(written here exactly as verl's examples/sglang_multiturn/config/ write them), several named interactions chosen per
row, per-row ``agent_name``, ``need_tools_kwargs``, and the start-up errors for what rlspmd cannot honour. The loop
tests drive the real loop, tools, interactions, tokenizer and template with ``ScriptedModel`` (test_agent_loop.py);
the last test trains a step on verl-schema rows under torchrun.
"""

import dataclasses
import json

import pytest

from conftest import ROOT, torchrun
from rlspmd.agent import (
    Gsm8kAnswer,
    build_agent_loop,
    check_rows,
    load_interactions,
    load_tools,
    read_interaction_config,
    read_tool_config,
)
from rlspmd.agent.interaction import Gsm8kInteraction
from rlspmd.config import AgentConfig, load_config_file
from rlspmd.data.prompts import PromptDataset
from rlspmd.metrics import MetricBuffer
from rlspmd.validate import config_problems
from test_agent_loop import GREEDY, ScriptedModel, call, response

# verl: examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml (byte for byte, trailing space included,
# written ``\x20``; the ``\`` ending the description's first half joins its two halves into verl's one line)
VERL_TOOL_CONFIG = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:\x20
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, \
0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""

# verl: examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml
VERL_INTERACTION_CONFIG = """\
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}"""

# A user interaction in a module (verl spells user classes as dotted module paths) with an option from `config`.
USER_MODULE = '''
class PoliteInteraction:
    """Replies with its configured text and never ends the conversation itself."""

    def __init__(self, reply: str):
        self.reply = reply

    def start(self, sample):
        return {"query": sample.kwargs["query"]}

    def respond(self, state, messages):
        return False, f"{self.reply} ({state['query']})", 0.25

    def finish(self, state):
        pass
'''

SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "You should use the `calc_gsm8k_reward` tool after step by step solving the question."
)


def w_tool_row(i: int, truth: str, **top) -> dict:
    """A row as verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py writes it (``top``: e.g. agent_name, as
    gsm8k_tool_agent_loop.py adds)."""
    question = f"Question {i}?"
    return {
        "data_source": "openai/gsm8k",
        **top,
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {
            "split": "train",
            "index": i,
            "answer": f"#### {truth}",
            "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
            "interaction_kwargs": {"query": question, "ground_truth": truth},
        },
    }


def w_interaction_row(i: int, truth: str, name: str = "gsm8k") -> dict:
    """A row as verl's examples/data_preprocess/gsm8k_multiturn_w_interaction.py writes it."""
    question = f"Question {i}?"
    return {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "You are a math expert. Put your final answer as `#### <answer>`."},
            {"role": "user", "content": question},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {
            "split": "train",
            "index": i,
            "answer": f"#### {truth}",
            "question": question,
            "interaction_kwargs": {"name": name, "query": question, "ground_truth": truth},
        },
    }


def write(path, text: str):
    path.write_text(text)
    return str(path)


def parquet(path, rows: list[dict]) -> str:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


@pytest.fixture
def configs(tmp_path, monkeypatch):
    """verl's two YAML files, and an interaction file with verl's gsm8k plus a user class by module path."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_interactions.py").write_text(USER_MODULE)
    two = VERL_INTERACTION_CONFIG + (
        '\n  - name: "polite"\n    class_name: "my_interactions.PoliteInteraction"\n'
        '    config: {reply: "Please check again."}\n'
    )
    return {
        "tools": write(tmp_path / "gsm8k_tool_config.yaml", VERL_TOOL_CONFIG),
        "interaction": write(tmp_path / "gsm8k_interaction_config.yaml", VERL_INTERACTION_CONFIG),
        "two": write(tmp_path / "two_interactions.yaml", two),
    }


@pytest.fixture(scope="module")
def tok(tiny_tools_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tools_model))


def loop_for(tok, **cfg):
    return build_agent_loop(
        AgentConfig(**cfg),
        tokenizer=tok,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        max_response_length=256,
        model_field="actor.model.path",
    )


def test_verls_yaml_files_load_as_rlspmds_builtins(configs):
    [tool] = load_tools(AgentConfig(tool_config_path=configs["tools"]))
    assert isinstance(tool, Gsm8kAnswer) and tool.name == "calc_gsm8k_reward"
    fn = tool.schema["function"]  # the model sees verl's schema, not the built-in's
    assert fn["description"].startswith("A tool for calculating the reward of gsm8k.")
    assert (
        fn["parameters"]["properties"]["answer"]["description"]
        == "The model's answer to the GSM8K math problem, must be a digits"
    )
    assert Gsm8kAnswer.schema["function"]["description"].startswith(
        "Submit your final answer"
    )  # the class is untouched
    interactions = load_interactions(AgentConfig(interaction_config_path=configs["two"]))
    assert list(interactions) == ["gsm8k", "polite"] and isinstance(interactions["gsm8k"], Gsm8kInteraction)
    assert interactions["polite"].reply == "Please check again."  # `config` became the constructor's arguments
    [entry] = read_interaction_config(configs["interaction"])
    assert (entry.name, entry.config) == ("gsm8k", {})
    assert read_tool_config(configs["tools"])[0].config == {}  # verl's `type: native` is consumed


def test_the_yaml_schema_reaches_the_prompt(configs, tok, tmp_path):
    loop = loop_for(tok, tool_config_path=configs["tools"])
    path = parquet(tmp_path / "w_tool.parquet", [w_tool_row(0, "7")])
    text = PromptDataset([path], tok, prompt_key="prompt", max_prompt_length=1024, tools=loop.tool_schemas).batch([0])[
        "prompt_text"
    ][0]
    assert "A tool for calculating the reward of gsm8k." in text and "Submit your final answer" not in text


def test_rows_choose_their_interaction_by_name_and_single_turn_rows_run_one_turn(configs, tok, tmp_path):
    """Three rows: verl's gsm8k interaction (wrong, then right), the user's polite one, and a single_turn_agent row
    whose tool call is not run. Every reply, reward and mask is the one the row's own choice gives."""
    loop = loop_for(tok, tool_config_path=configs["tools"], interaction_config_path=configs["two"], max_user_turns=2)
    rows = [
        w_interaction_row(0, "42"),
        w_interaction_row(1, "5", name="polite"),
        w_tool_row(2, "9", agent_name="single_turn_agent"),
    ]
    paths = [parquet(tmp_path / "inter.parquet", rows[:2]), parquet(tmp_path / "single.parquet", rows[2:])]
    ds = PromptDataset(paths, tok, prompt_key="prompt", max_prompt_length=1024, tools=loop.tool_schemas)
    check_rows(ds.rows, loop=loop, field_name="data.train_files")
    batch = ds.batch([0, 1, 2])
    assert batch["agent_name"] == [None, None, "single_turn_agent"]
    model = ScriptedModel(
        tok, {0: ["#### 41", "#### 42"], 1: ["#### 5"] * 3, 2: [call("calc_gsm8k_reward", answer="9")]}
    )
    out = loop.run(model, batch, GREEDY, None, MetricBuffer())
    for i, reply in ((0, Gsm8kInteraction.retry), (1, "Please check again. (Question 1?)")):
        ids, loss, _ = response(out, i)
        delta = loop.renderer.delta_ids([{"role": "user", "content": reply}], stop_text="<|im_end|>")
        want_ids, want_loss = [], []
        for j, gen in enumerate(model.generated[i]):
            want_ids += (delta if j else []) + gen
            want_loss += ([0] * len(delta) if j else []) + [1] * len(gen)
        assert ids == want_ids and loss == want_loss
    ids, loss, _ = response(out, 2)
    assert ids == model.generated[2][0] and all(loss)  # one turn; the call was not run
    # gsm8k: 0 for the wrong answer, then 1 and done; polite: 0.25 per reply, ended by max_user_turns; single turn: 0
    assert out["agent_rewards_B"].tolist() == pytest.approx([1.0, 0.5, 0.0])
    assert out["agent_user_turns_B"].tolist() == [1.0, 2.0, 0.0] and out["agent_tool_calls_BK"].tolist() == [[0.0]] * 3
    assert out["agent_turns_B"].tolist() == [2.0, 3.0, 1.0] and out["agent_stop"] == ["answer"] * 3


def test_default_agent_loop_applies_to_rows_without_agent_name(configs, tok, tmp_path):
    loop = loop_for(tok, tool_config_path=configs["tools"], default_agent_loop="single_turn_agent")
    path = parquet(
        tmp_path / "rows.parquet", [w_tool_row(0, "7", agent_name=None), w_tool_row(1, "8", agent_name="tool_agent")]
    )
    batch = PromptDataset([path], tok, prompt_key="prompt", max_prompt_length=1024, tools=loop.tool_schemas).batch(
        [0, 1]
    )
    script = [call("calc_gsm8k_reward", answer="7"), "#### 7"]
    out = loop.run(
        ScriptedModel(tok, {0: script, 1: [call("calc_gsm8k_reward", answer="8"), "#### 8"]}),
        batch,
        GREEDY,
        None,
        MetricBuffer(),
    )
    assert out["agent_turns_B"].tolist() == [1.0, 2.0] and out["agent_tool_calls_BK"].tolist() == [[0.0], [1.0]]
    assert out["agent_rewards_B"].tolist() == [0.0, 1.0]  # the tool_agent row's create_kwargs reached the tool


BAD_TOOL_CONFIGS = [
    (
        "tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: mcp}\n",
        r"tools\[0\].config.type='mcp': rlspmd runs native \(in-process\) tools only",
    ),
    (
        "tools:\n  - class_name: verl.tools.mcp_base_tool.MCPBaseTool\n    config: {type: native}\n"
        "    mcp: {mcp_servers_config_path: x.json}\n",
        r"tools\[0\]: key\(s\) \['mcp'\] are not supported.*\(MCP tools are not supported\)",
    ),
    (
        "tools:\n  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool\n    config: {type: native}\n",
        r"tools\[0\].class_name='verl.tools.sandbox_fusion_tools.SandboxFusionTool': "
        r"rlspmd does not import verl.*built-in `python` tool",
    ),
    (
        "tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native, rate_limit: 3}\n",
        r"tools\[0\].config: the built-in 'calc_gsm8k_reward' \(verl.tools.gsm8k_tool.Gsm8kTool\) takes no options, "
        r"got \['rate_limit'\]",
    ),
    (
        VERL_TOOL_CONFIG.replace("answer:\n", "response:\n").replace('["answer"]', '["response"]'),
        r"tools\[0\].tool_schema: the built-in 'calc_gsm8k_reward' reads the arguments \{'answer': 'string'\}",
    ),
    (
        "tools:\n  - class_name: no_such_module.Tool\n",
        r"tools\[0\].class_name='no_such_module:Tool': module 'no_such_module' failed to import",
    ),
    ("tool:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n", r"must be a mapping with a `tools:` list"),
    (
        VERL_TOOL_CONFIG + VERL_TOOL_CONFIG.removeprefix("tools:\n"),
        r"tools\[1\]: tool name 'calc_gsm8k_reward' is already used by .*tools\[0\]",
    ),
]


@pytest.mark.parametrize("text,error", BAD_TOOL_CONFIGS, ids=range(len(BAD_TOOL_CONFIGS)))
def test_what_rlspmd_cannot_honour_in_a_tool_config_names_the_file_and_entry(tmp_path, text, error):
    path = write(tmp_path / "tool_config.yaml", text)
    with pytest.raises(ValueError, match=rf"rollout.agent.tool_config_path='{path}': {error}"):
        load_tools(AgentConfig(tool_config_path=path))


BAD_INTERACTION_CONFIGS = [
    (
        VERL_INTERACTION_CONFIG.replace("config: {}", "config: {strict: true}"),
        r"interaction\[0\].config: the built-in 'gsm8k' .* takes no options, got \['strict'\]",
    ),
    (
        VERL_INTERACTION_CONFIG + "\n" + VERL_INTERACTION_CONFIG.removeprefix("interaction:\n"),
        r"interaction\[1\].name='gsm8k': already used by .*interaction\[0\]",
    ),
    (
        "interaction:\n  - class_name: verl.interactions.weather_interaction.WeatherInteraction\n",
        r"interaction\[0\].class_name=.*rlspmd does not import verl",
    ),
    (
        "interaction:\n  - name: p\n    class_name: my_interactions.PoliteInteraction\n    config: {tone: dry}\n",
        r"interaction\[0\] \(my_interactions.PoliteInteraction\): constructing it failed: TypeError",
    ),
]


@pytest.mark.parametrize("text,error", BAD_INTERACTION_CONFIGS, ids=range(len(BAD_INTERACTION_CONFIGS)))
def test_what_rlspmd_cannot_honour_in_an_interaction_config_names_the_file_and_entry(configs, tmp_path, text, error):
    path = write(tmp_path / "interaction_config.yaml", text)
    with pytest.raises(ValueError, match=rf"rollout.agent.interaction_config_path='{path}': {error}"):
        load_interactions(AgentConfig(interaction_config_path=path))


def test_rows_the_run_cannot_honour_name_the_file_and_row(configs, tok, tmp_path):
    loop = loop_for(tok, tool_config_path=configs["tools"], interaction_config_path=configs["two"])

    def problem(row: dict, run=loop) -> str:
        path = parquet(tmp_path / "bad.parquet", [row, w_interaction_row(0, "1")])  # from_list: the first row's columns
        ds = PromptDataset([path], tok, prompt_key="prompt", max_prompt_length=1024, tools=loop.tool_schemas)
        with pytest.raises(ValueError) as e:
            check_rows(ds.rows, loop=run, field_name="data.val_files")
        assert str(e.value).startswith(f"data.val_files: {path} row 0: ")
        return str(e.value)

    assert "agent_name='react_agent'; rlspmd runs ['tool_agent', 'single_turn_agent']" in problem(
        w_tool_row(1, "2", agent_name="react_agent")
    )
    empty = w_tool_row(1, "2")
    del empty["extra_info"]["tools_kwargs"]
    assert "need_tools_kwargs=True but extra_info.tools_kwargs is empty" in problem(empty)
    other = w_tool_row(1, "2")
    other["extra_info"]["tools_kwargs"] = {"search": {"create_kwargs": {"q": "x"}}}
    assert "names the tool 'search', which the run does not have (its tools: ['calc_gsm8k_reward'])" in problem(other)
    execute = w_tool_row(1, "2")
    execute["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["execute_kwargs"] = {"strict": True}
    assert "sets ['execute_kwargs']; rlspmd passes only create_kwargs" in problem(execute)
    assert "name='weather' is not one of the run's: ['gsm8k', 'polite']" in problem(
        w_interaction_row(1, "2", name="weather")
    )
    assert "has no name and the run has several" in problem(w_tool_row(1, "2"))  # verl's w_tool rows carry no name
    assert "extra_info.need_tools_kwargs=True but the run has no rollout.agent" in problem(w_tool_row(1, "2"), run=None)
    # a single_turn_agent row asks nothing of the tools or interactions
    path = parquet(tmp_path / "ok.parquet", [w_tool_row(0, "1", agent_name="single_turn_agent")])
    check_rows(PromptDataset([path], tok, prompt_key="prompt", max_prompt_length=1024).rows, loop=loop, field_name="x")


def test_start_up_checks_report_the_yaml_problems(configs, tmp_path):
    cfg = load_config_file(ROOT / "configs/agent_quickstart.py")
    bad = write(
        tmp_path / "bad.yaml", "tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: mcp}\n"
    )
    agent = AgentConfig(tool_config_path=bad, interaction_config_path=str(tmp_path / "missing.yaml"))
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, agent=agent))
    problems = config_problems(cfg, world_size=2, check_files=True)
    assert any(p.startswith(f"rollout.agent.tool_config_path='{bad}': tools[0].config.type='mcp'") for p in problems), (
        problems
    )
    assert any(p.startswith("rollout.agent.interaction_config_path=") and "does not exist" in p for p in problems), (
        problems
    )
    assert not any("rollout.agent" in p for p in config_problems(cfg, world_size=2, check_files=False))
    good = dataclasses.replace(
        cfg,
        rollout=dataclasses.replace(
            cfg.rollout,
            agent=AgentConfig(tool_config_path=configs["tools"], interaction_config_path=configs["interaction"]),
        ),
    )
    assert not any("rollout.agent" in p for p in config_problems(good, world_size=2, check_files=True))


CONFIG = """
from rlspmd.config import ActorConfig, AgentConfig, Config, DataConfig, ModelConfig, RolloutConfig, TrainerConfig

config = Config(
    actor=ActorConfig(model=ModelConfig(path={model!r}), mini_batch_size=2, micro_batch_size=8,
                      logprob_micro_batch_size=8),
    rollout=RolloutConfig(n=2, max_response_length=24, agent=AgentConfig(
        tool_config_path={tools!r}, interaction_config_path={interaction!r}, max_turns=2)),
    data=DataConfig(train_files={files!r}, val_files={files!r}, train_batch_size=2, val_batch_size=4, max_val_samples=4,
                    max_prompt_length=400),
    trainer=TrainerConfig(total_steps=1, val_every=1, output_dir={out!r}, loggers=["jsonl"]),
)
"""


@pytest.mark.slow
def test_verl_rows_and_yaml_files_train_a_step_under_torchrun(configs, tiny_tools_model, tmp_path):
    """verl's three GSM8K multi-turn row shapes (w_tool, w_interaction, tool_agent_loop's agent_name) with verl's two
    YAML files, unchanged, through the trainer on 2 ranks: start-up checks, rollouts, a step, validation."""
    files = [
        parquet(tmp_path / "w_tool.parquet", [w_tool_row(i, str(i)) for i in range(2)]),
        parquet(tmp_path / "w_interaction.parquet", [w_interaction_row(i, str(i)) for i in range(2)]),
        parquet(tmp_path / "tool_agent.parquet", [w_tool_row(i, str(i), agent_name="tool_agent") for i in range(2)]),
    ]
    out = tmp_path / "run"
    config = write(
        tmp_path / "verl_run.py",
        CONFIG.format(
            model=str(tiny_tools_model),
            tools=configs["tools"],
            interaction=configs["interaction"],
            files=files,
            out=str(out),
        ),
    )
    proc = torchrun(["-m", "rlspmd.train", "--config", config], 2, timeout=900)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = next(r for r in rows if r["step"] == 1 and "agent/turns" in r)
    assert "agent/tool_calls/calc_gsm8k_reward" in train and train["agent/turns"] >= 1  # the tool came from the YAML
    val = [(r["step"], r["val/agent/tool_call_rate"]) for r in rows if "val/agent/tool_call_rate" in r]
    assert [s for s, _ in val] == [0, 1]
    # the run's summary carries the greedy tool-call rate first -> last, as the agent quickstart prints it
    assert json.loads((out / "summary.json").read_text())["val_tool_call_rate"] == [list(v) for v in val]
    assert proc.stdout.count("greedy tool-call rate: ") == 1
