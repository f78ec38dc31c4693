"""The sample log (``trainer.samples``, ``rlspmd/trainer/samples.py``) and its reader (``python -m rlspmd.samples``).

Two short real runs on 2 ranks (Gloo): single-turn GRPO on the tiny model, and multi-turn with the calculator and the
``gsm8k`` interaction on a tiny model that was taught to call the calculator (150 optimiser steps on one demonstration,
in the test). Every actor update saves the batch it trains on (``tests/hooks``: ``RLSPMD_TEST_DUMP_UPDATES``), so the
log is compared with what the loss saw: the same token ids, the same loss mask, the same rewards and advantages.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, torchrun
from rl_run import metrics, rl_args, write_reward
from rlspmd.utils.sample_text import MASK_CLOSE, MASK_OPEN, format_sample, read_samples
from rlspmd.trainer.samples import loss_spans

pytestmark = pytest.mark.dist
HOOKS = Path(__file__).resolve().parent / "hooks"


def run(args: list[str], dump: Path) -> None:
    dump.mkdir(parents=True)
    env = {"PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ["PYTHONPATH"]]), "RLSPMD_TEST_DUMP_UPDATES": str(dump)}
    torchrun(args, 2, timeout=900, env=env)


def trained(dump: Path) -> dict[tuple[int, int], dict]:
    """(step, rank) -> the batch that rank's actor update trained on."""
    out = {}
    for f in dump.glob("rank*_update*.pt"):
        rank, step = f.stem.removeprefix("rank").split("_update")
        out[int(step), int(rank)] = torch.load(f, weights_only=False)
    return out


def check_against_batches(records: list[dict], batches: dict, tok) -> None:
    """Every logged training sample is row ``row`` of what rank ``dp_rank`` trained on at ``step``."""
    assert records

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    for rec in records:
        t = batches[rec["step"], rec["dp_rank"]]["tensors"]
        i = rec["row"]
        n = int(t["response_mask_BR"][i].sum())
        assert rec["prompt_ids"] == t["prompts_BP"][i][t["prompt_mask_BP"][i].bool()].tolist()
        assert rec["response_ids"] == t["responses_BR"][i, :n].tolist()
        assert rec["response_tokens"] == n
        mask = t["loss_mask_BR"][i, :n].tolist()
        assert rec["loss_spans"] == loss_spans(mask) and rec["trained_tokens"] == sum(mask)
        assert [j for s, e in rec["loss_spans"] for j in range(s, e)] == [j for j, m in enumerate(mask) if m]
        assert rec["reward"] == pytest.approx(float(t["scores_B"][i]), abs=1e-6)
        assert rec["rewards"]["task_score"] == pytest.approx(float(t["task_scores_B"][i]), abs=1e-6)
        adv = t["advantages_BR"][i, :n]
        assert rec["advantage"] == pytest.approx(
            float((adv * t["loss_mask_BR"][i, :n]).sum() / max(sum(mask), 1)), abs=1e-5
        )
        assert rec["weight_version"] == int(t["weight_version_B"][i]) == rec["step"] - 1
        assert rec["uid"] == int(t["uid_B"][i])
        # the text is the ids decoded with the special tokens; the segments cut it at the loss mask
        assert rec["prompt"] == decode(rec["prompt_ids"]) and rec["response"] == decode(rec["response_ids"])
        cuts = sorted({0, n, *(x for s in rec["loss_spans"] for x in s)})
        want = [[int(mask[a]), decode(rec["response_ids"][a:b])] for a, b in itertools.pairwise(cuts)]
        assert rec["segments"] == want


# -- single turn -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_turn(tiny_model, arithmetic_data, tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("samples_single")
    out, dump = tmp / "run", tmp / "dump"
    args = rl_args(
        tiny_model,
        arithmetic_data,
        out,
        steps=3,
        reward=write_reward(tmp),
        extra=[
            "--trainer.samples.num-train",
            "8",
            "--trainer.loggers",
            "jsonl",
            "tensorboard",
            "--checkpoint.save-every",
            "0",
            "--checkpoint.no-save-final",
        ],
    )
    run(args, dump)
    return out, dump


@pytest.mark.slow
def test_logged_training_samples_are_the_trained_rows(single_turn, tiny_model):
    """num_train=8 is the whole batch (4 prompts x 2 samples): each logged sample equals its row of the batch the
    update trained on (ids, loss mask, reward, advantage, weight version), and the logged rewards average to the
    step's reward/mean."""
    from transformers import AutoTokenizer

    out, dump = single_turn
    records = read_samples(out / "samples" / "train.jsonl")
    batches = trained(dump)
    check_against_batches(records, batches, AutoTokenizer.from_pretrained(str(tiny_model)))
    by_step = {m["step"]: m for m in metrics(out)}
    for step in (1, 2, 3):
        mine = [r for r in records if r["step"] == step]
        # the first 4 rows of each of the 2 ranks: every row of the step, rank 0's first
        assert [(r["dp_rank"], r["row"]) for r in mine] == [
            (0, 0),
            (0, 1),
            (0, 2),
            (0, 3),
            (1, 0),
            (1, 1),
            (1, 2),
            (1, 3),
        ]
        assert sum(r["reward"] for r in mine) / 8 == pytest.approx(by_step[step]["reward/mean"], abs=1e-6)
        assert sum(r["response_tokens"] for r in mine) / 8 == pytest.approx(by_step[step]["response_length/mean"])
        assert {r["stop"] for r in mine} <= {"eos", "length"} and all("agent" not in r for r in mine)


@pytest.mark.slow
def test_validation_logs_the_same_first_prompts_every_time(single_turn):
    """Validation at steps 0, 2 and 3 logs the first 8 prompts (all 8 of max_val_samples), in order, each time; their
    rewards average to val/reward and their index is the dataset row."""
    out, _ = single_turn
    records = read_samples(out / "samples" / "val.jsonl")
    by_step = {m["step"]: m for m in metrics(out)}
    assert sorted({r["step"] for r in records}) == [0, 2, 3]
    prompts = None
    for step in (0, 2, 3):
        mine = [r for r in records if r["step"] == step]
        assert [r["position"] for r in mine] == list(range(8)) == [r["index"] for r in mine]
        assert all(r["weight_version"] == step and "advantage" not in r for r in mine)
        assert sum(r["reward"] for r in mine) / 8 == pytest.approx(by_step[step]["val/reward"], abs=1e-6)
        ids = [r["prompt_ids"] for r in mine]
        assert prompts is None or ids == prompts
        prompts = ids


@pytest.mark.slow
def test_tensorboard_gets_each_sample_as_text(single_turn):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = single_turn
    ea = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    ea.Reload()
    tags = set(ea.Tags()["tensors"])
    assert {f"samples/train/{k}/text_summary" for k in range(8)} | {
        f"samples/val/{k}/text_summary" for k in range(8)
    } <= tags
    events = ea.Tensors("samples/train/3/text_summary")
    assert [e.step for e in events] == [1, 2, 3]
    records = [r for r in read_samples(out / "samples" / "train.jsonl") if r["step"] == 2]
    assert events[1].tensor_proto.string_val[0].decode() == "\n".join(
        "    " + x for x in format_sample(records[3]).splitlines()
    )


@pytest.mark.slow
def test_off_by_the_flag(tiny_model, arithmetic_data, tmp_path):
    """``--trainer.samples.no-enable``: a run (one process, one step, a validation) writes no sample log at all."""
    out = tmp_path / "run"
    args = rl_args(
        tiny_model,
        arithmetic_data,
        out,
        steps=1,
        extra=[
            "--trainer.samples.no-enable",
            "--trainer.val-every",
            "1",
            "--checkpoint.save-every",
            "0",
            "--checkpoint.no-save-final",
        ],
    )
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True, timeout=600)
    assert [m["step"] for m in metrics(out)] == [0, 1] and not (out / "samples").exists()


@pytest.mark.slow
def test_a_resumed_run_continues_the_log(tiny_model, arithmetic_data, tmp_path):
    """A run of 3 steps (checkpoint at step 2), then the same command again: it resumes at step 2, moves the first
    run's step-3 records to ``*.superseded.jsonl`` and logs step 3 again, the same samples (a deterministic resume)."""
    out = tmp_path / "run"
    args = rl_args(
        tiny_model, arithmetic_data, out, steps=3, reward=write_reward(tmp_path), extra=["--checkpoint.no-save-final"]
    )
    for _ in range(2):
        subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True, timeout=600)
    samples = out / "samples"
    train, val = read_samples(samples / "train.jsonl"), read_samples(samples / "val.jsonl")
    assert [r["step"] for r in train] == [1] * 4 + [2] * 4 + [3] * 4  # num_train=4 rows of the one rank
    assert [r["step"] for r in val] == [0] * 8 + [2] * 8 + [3] * 8
    old_train, old_val = (
        read_samples(samples / "train.superseded.jsonl"),
        read_samples(samples / "val.superseded.jsonl"),
    )
    assert old_train == train[8:] and old_val == val[16:]


def test_a_resume_supersedes_later_records(tmp_path):
    """``rewind_jsonl`` on the sample files: a resume at step 2 keeps steps <= 2 and moves later ones aside."""
    from rlspmd.metrics import rewind_jsonl

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"step": s, "row": r}) + "\n" for s in (1, 2, 3) for r in (0, 1)) + '{"step": 4')
    rewind_jsonl(path, 2)
    assert [r["step"] for r in read_samples(path)] == [1, 1, 2, 2]
    assert [json.loads(x)["step"] for x in (tmp_path / "train.superseded.jsonl").read_text().splitlines()[:2]] == [3, 3]


def test_loss_spans_are_the_runs_of_trained_tokens():
    assert loss_spans([]) == [] and loss_spans([0, 0]) == [] and loss_spans([1, 1, 1]) == [[0, 3]]
    assert loss_spans([1, 1, 0, 0, 1, 0, 1]) == [[0, 2], [4, 5], [6, 7]]


def test_the_reader_imports_neither_torch_nor_the_trainer():
    """``python -m rlspmd.samples`` answers without loading torch (seconds on a CPU core), transformers or the
    trainer: reading and formatting live in ``rlspmd/utils/sample_text.py``."""
    code = (
        "import sys, rlspmd.samples; print(sorted(m for m in sys.modules"
        " if m.split('.')[0] in ('torch', 'transformers') or m.startswith('rlspmd.trainer')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- multi turn: tools and an interaction ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_run(tool_caller, tmp_path_factory) -> tuple[Path, Path, Path]:
    model, data = tool_caller
    tmp = tmp_path_factory.mktemp("samples_agent")
    out, dump = tmp / "run", tmp / "dump"
    args = [
        "-m",
        "rlspmd.train",
        "--actor.model.path",
        str(model),
        "--data.train-files",
        str(data / "train.parquet"),
        "--data.val-files",
        str(data / "test.parquet"),
        "--data.train-batch-size",
        "4",
        "--data.max-val-samples",
        "4",
        "--actor.mini-batch-size",
        "2",
        "--actor.micro-batch-size",
        "4",
        "--actor.optim.lr",
        "1e-6",
        "--rollout.n",
        "2",
        "--rollout.max-response-length",
        "160",
        "--rollout.temperature",
        "0.5",
        "--rollout.agent.tools",
        "calculator",
        "--rollout.agent.interaction",
        "gsm8k",
        "--rollout.agent.max-turns",
        "3",
        "--trainer.total-steps",
        "2",
        "--trainer.val-every",
        "2",
        "--trainer.samples.num-train",
        "8",
        "--trainer.output-dir",
        str(out),
        "--trainer.loggers",
        "jsonl",
        "--trainer.deterministic",
        "--checkpoint.save-every",
        "0",
        "--checkpoint.no-save-final",
    ]
    run(args, dump)
    return out, dump, model


def expected_tool_response(call_text: str) -> str:
    """What the calculator answers to a call the model wrote: its result, or an error message (a malformed call, an
    expression it cannot evaluate)."""
    from rlspmd.agent.builtin import Calculator

    try:
        call = json.loads(call_text)
        return Calculator().call(None, call["arguments"])[0]
    except Exception:  # noqa: BLE001 - the loop turns every failure into an error message to the model
        return "Error:"


@pytest.mark.slow
def test_agent_samples_mark_tool_results_and_user_turns_as_untrained(agent_run):
    """The logged conversations are the trained rows; their untrained spans are exactly the appended turns: the
    calculator's answers to the calls of the turn before (in a tool turn), and the interaction's replies."""
    import re

    from transformers import AutoTokenizer

    out, dump, model = agent_run
    tok = AutoTokenizer.from_pretrained(str(model))
    records = read_samples(out / "samples" / "train.jsonl")
    check_against_batches(records, trained(dump), tok)
    answered = 0
    for rec in records:
        a = rec["agent"]
        tool_spans = user_spans = 0
        for k, (flag, text) in enumerate(rec["segments"]):
            if flag:
                continue
            before = rec["segments"][k - 1][1]  # the model's turn that this one answers
            if "<tool_response>" in text:
                calls = re.findall(r"<tool_call>(.*?)</tool_call>", before, flags=re.DOTALL)
                responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, flags=re.DOTALL)
                assert calls and len(responses) == len(calls), (before, text)
                for call, response in zip(calls, responses):
                    assert response.startswith(expected_tool_response(call)), (call, response)
                    answered += not response.startswith("Error:")
                tool_spans += 1
            else:
                assert "<|im_start|>user\nYour answer is wrong. Try again.<|im_end|>" in text
                user_spans += 1
            assert text.rstrip("\n").endswith("<|im_start|>assistant")  # the template glue before the next turn
        assert user_spans == a["user_turns"]
        assert a["tool_calls"]["calculator"] <= tool_spans <= a["tool_calls"]["calculator"] + a["tool_errors"]
        assert rec["stop"] in ("answer", "max_turns", "length", "interaction_error")
    assert answered >= len(records) // 2  # the model calls the calculator properly in most conversations
    assert sum(r["agent"]["user_turns"] for r in records) >= 1


@pytest.mark.slow
def test_val_agent_user_turns_is_logged(agent_run):
    """``val/agent/user_turns`` is the mean interaction replies over the validation samples (all 4 are logged)."""
    out, _, _ = agent_run
    vals = [r for r in read_samples(out / "samples" / "val.jsonl") if r["step"] == 2]
    last = [m for m in metrics(out) if m["step"] == 2][-1]
    assert len(vals) == 4
    assert last["val/agent/user_turns"] == pytest.approx(sum(r["agent"]["user_turns"] for r in vals) / 4)
    assert last["val/agent/tool_calls"] == pytest.approx(sum(r["agent"]["tool_calls"]["calculator"] for r in vals) / 4)
    assert last["val/agent/user_turns"] > 0


@pytest.mark.slow
def test_cli_prints_a_conversation_with_the_untrained_text_bracketed(agent_run):
    out, _, _ = agent_run
    cli = [sys.executable, "-m", "rlspmd.samples", str(out)]
    rec = [r for r in read_samples(out / "samples" / "train.jsonl") if r["step"] == 1][1]
    shown = subprocess.run(
        [*cli, "--step", "1", "--index", "1"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert shown.rstrip("\n") == format_sample(rec)
    body = shown.split("not trained on) ---\n", 1)[1].rstrip("\n")
    assert body == "".join(text if t else f"{MASK_OPEN}{text}{MASK_CLOSE}" for t, text in rec["segments"])
    assert body.count(MASK_OPEN) == rec["agent"]["tool_calls"]["calculator"] + rec["agent"]["user_turns"] >= 1
    assert f"step 1 train · dp_rank {rec['dp_rank']} row {rec['row']}" in shown and "tool calls: calculator x" in shown
    coloured = subprocess.run(
        [*cli, "--step", "1", "--index", "1", "--color", "always"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "\x1b[2;36m" in coloured and MASK_OPEN not in coloured
    listing = subprocess.run([*cli, "--list"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(listing) == 16 and listing[9].startswith("step     2 --index 1 ")
    bad = subprocess.run([*cli, "--step", "7"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "no samples of step 7; logged steps: 1, 2" in bad.stderr
