"""Dataset preparation scripts: schema, determinism, held-out hygiene and answer correctness.

The scripts live outside the package, so they are imported by file path, the way other scripts do.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str) -> ModuleType:
    """Import a file by path under a private name (``reasoning_gym.py`` must not shadow the package)."""
    path = ROOT / relpath
    name = "rlspmd_test_" + relpath.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


arithmetic = load_script("scripts/data/arithmetic.py")
gsm8k = load_script("scripts/data/gsm8k.py")
rg_script = load_script("scripts/data/reasoning_gym.py")
agent_arithmetic = load_script("scripts/data/agent_arithmetic.py")
gsm8k_multiturn = load_script("scripts/data/gsm8k_multiturn.py")
rg_reward = load_script("rlspmd/rewards/reasoning_gym.py")


def read_rows(path: Path) -> list[dict]:
    import datasets

    if path.suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(path)).to_list()
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_schema(row: dict, *, data_source: str, split: str) -> None:
    assert row["data_source"] == data_source
    assert isinstance(row["prompt"], list) and row["prompt"][0]["role"] == "user"
    assert isinstance(row["prompt"][0]["content"], str) and row["prompt"][0]["content"]
    assert row["ability"] == "math"
    assert row["reward_model"]["style"] == "rule" and isinstance(row["reward_model"]["ground_truth"], str)
    assert row["extra_info"]["split"] == split and isinstance(row["extra_info"]["index"], int)


# ---------------------------------------------------------------- arithmetic


def test_solve_worked_examples():
    assert arithmetic.solve("37 + 45 - 12") == ("37 + 45 = 82, 82 - 12 = 70 #### 70", 70)
    assert arithmetic.solve("37 + 45") == ("37 + 45 = 82 #### 82", 82)
    assert arithmetic.solve("3 - 10 + 2") == ("3 - 10 = -7, -7 + 2 = -5 #### -5", -5)
    # Products bind tighter, so their steps come first and the answer matches eval.
    assert arithmetic.solve("2 + 3 * 4") == ("3 * 4 = 12, 2 + 12 = 14 #### 14", 14)
    with pytest.raises(ValueError, match="expression"):
        arithmetic.solve("2 / 3")


SMALL = dict(num_train=400, num_test=100, num_sft=300)


def test_arithmetic_rows_are_correct_and_in_range():
    splits = arithmetic.generate(**SMALL, min_terms=2, max_terms=4, max_value=50, ops="+-*", seed=3)
    assert {k: len(v) for k, v in splits.items()} == {"train": 400, "test": 100, "sft": 300}
    for split, rows in splits.items():
        for i, row in enumerate(rows):
            check_schema(row, data_source="arithmetic", split=split)
            info = row["extra_info"]
            expression = info["expression"]
            assert info["index"] == i
            assert row["prompt"][0]["content"] == f"Calculate {expression}."
            assert row["reward_model"]["ground_truth"] == str(eval(expression))
            assert info["solution"].endswith(f"#### {eval(expression)}")
            operands = [int(t) for t in expression.split()[::2]]
            assert 2 <= len(operands) <= 4 and all(0 <= v <= 50 for v in operands)
            if split == "sft":
                assert row["response"] == info["solution"]
            else:
                assert "response" not in row


def test_arithmetic_is_deterministic_and_held_out():
    a = arithmetic.generate(**SMALL, seed=0)
    assert a == arithmetic.generate(**SMALL, seed=0)
    assert a["train"] != arithmetic.generate(**SMALL, seed=1)["train"]
    expressions = {split: [r["extra_info"]["expression"] for r in rows] for split, rows in a.items()}
    # SFT is its own stream, not a copy or prefix of train.
    assert expressions["sft"] != expressions["train"][: len(expressions["sft"])]
    assert not set(expressions["test"]) & (set(expressions["train"]) | set(expressions["sft"]))
    assert len(set(expressions["test"])) == len(expressions["test"])


def test_arithmetic_rejects_impossible_sizes():
    with pytest.raises(ValueError, match="--num-test"):
        arithmetic.generate(num_train=100, num_test=50, num_sft=0, max_value=3, min_terms=2, max_terms=2, ops="+")
    with pytest.raises(ValueError, match="--ops"):
        arithmetic.generate(**SMALL, ops="+/")


def test_arithmetic_cli_writes_identical_files(tmp_path):
    args = ["--num-train", "50", "--num-test", "10", "--num-sft", "20", "--seed", "7"]
    arithmetic.main(["--out-dir", str(tmp_path / "a"), *args])
    arithmetic.main(["--out-dir", str(tmp_path / "b"), *args])
    expected = arithmetic.generate(num_train=50, num_test=10, num_sft=20, seed=7)
    for split in ("train", "test", "sft"):
        first, second = tmp_path / "a" / f"{split}.parquet", tmp_path / "b" / f"{split}.parquet"
        assert first.read_bytes() == second.read_bytes()
        assert read_rows(first) == expected[split]
    arithmetic.main(["--out-dir", str(tmp_path / "j"), "--format", "jsonl", *args])
    assert read_rows(tmp_path / "j" / "sft.jsonl") == expected["sft"]


def test_agent_arithmetic_rows_are_verl_multiturn_and_demonstrations_are_right(tmp_path):
    """verl's multi-turn schema (``extra_info.tools_kwargs``); demonstrations: the call's expression evaluates (with the
    built-in calculator) to the tool turn and the final answer; about ``--sft-tool-share`` of them call the tool."""
    from rlspmd.agent.builtin import evaluate

    splits = agent_arithmetic.generate(num_train=50, num_test=20, num_sft=400, sft_tool_share=0.3, seed=3)
    row = splits["train"][0]
    assert row["prompt"][0]["role"] == "user" and row["extra_info"]["need_tools_kwargs"] is True
    assert row["extra_info"]["tools_kwargs"] == {
        "calculator": {"create_kwargs": {"expression": row["extra_info"]["expression"]}}
    }
    calls = 0
    for r in splits["sft"]:
        m, truth = r["messages"], r["reward_model"]["ground_truth"]
        assert m[-1] == {"role": "assistant", "content": m[-1]["content"]} and m[-1]["content"].endswith(
            f"#### {truth}"
        )
        assert str(evaluate(r["extra_info"]["expression"])) == truth
        if len(m) == 4:
            calls += 1
            call = json.loads(m[1]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
            assert call == {"name": "calculator", "arguments": {"expression": r["extra_info"]["expression"]}}
            assert m[2] == {"role": "tool", "content": truth}
    assert 0.25 < calls / len(splits["sft"]) < 0.35
    seen = {r["extra_info"]["expression"] for r in splits["train"] + splits["sft"]}
    assert not seen & {r["extra_info"]["expression"] for r in splits["test"]}
    agent_arithmetic.main(
        ["--out-dir", str(tmp_path), "--num-train", "50", "--num-test", "20", "--num-sft", "400", "--seed", "3"]
    )
    assert read_rows(tmp_path / "sft.parquet") == splits["sft"]
    with pytest.raises(ValueError, match="--sft-tool-share"):
        agent_arithmetic.generate(sft_tool_share=1.5)


# ---------------------------------------------------------------- gsm8k

FAKE_GSM8K = {
    "train": [
        {
            "question": "Ada has 3 pears and buys 4 more. How many pears does she have?",
            "answer": "She has 3 + 4 = <<3+4=7>>7 pears.\n#### 7",
        },
        {
            "question": "A shop sells 12 boxes of 100 nails. How many nails is that?",
            "answer": "12 * 100 = <<12*100=1200>>1200 nails.\n#### 1,200",
        },
        {"question": "Bo had 10 cards and gave away 12. What is his balance?", "answer": "10 - 12 = -2\n#### -2"},
    ],
    "test": [
        {"question": "Half of 9 is what?", "answer": "9 / 2 = 4.5\n#### 4.5"},
    ],
}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_gsm8k_official_jsonl_dir(tmp_path):
    src = tmp_path / "gsm8k"
    src.mkdir()
    for split, records in FAKE_GSM8K.items():
        write_jsonl(src / f"{split}.jsonl", records)
    gsm8k.main(["--input", str(src), "--out-dir", str(tmp_path / "out")])
    train = read_rows(tmp_path / "out" / "train.parquet")
    test = read_rows(tmp_path / "out" / "test.parquet")
    assert [r["reward_model"]["ground_truth"] for r in train] == ["7", "1200", "-2"]
    assert [r["reward_model"]["ground_truth"] for r in test] == ["4.5"]
    for i, (row, record) in enumerate(zip(train, FAKE_GSM8K["train"])):
        check_schema(row, data_source="openai/gsm8k", split="train")
        assert row["prompt"][0]["content"] == (
            record["question"] + ' Let\'s think step by step and output the final answer after "####".'
        )
        assert row["extra_info"] == {"split": "train", "index": i, **record}


def test_gsm8k_save_to_disk_and_single_file_agree(tmp_path):
    import datasets

    dd = datasets.DatasetDict({split: datasets.Dataset.from_list(r) for split, r in FAKE_GSM8K.items()})
    dd.save_to_disk(str(tmp_path / "dict"))
    datasets.Dataset.from_list(FAKE_GSM8K["test"]).save_to_disk(str(tmp_path / "single"))
    single_file = write_jsonl(tmp_path / "gsm8k_test.jsonl", FAKE_GSM8K["test"])

    from_dict = gsm8k.load_splits(tmp_path / "dict")
    from_single = gsm8k.load_splits(tmp_path / "single", split="test")
    from_file = gsm8k.load_splits(single_file, split="test")
    assert from_dict["test"] == from_single["test"] == from_file["test"]
    assert [r["reward_model"]["ground_truth"] for r in from_dict["train"]] == ["7", "1200", "-2"]
    assert list(gsm8k.load_splits(single_file)) == ["gsm8k_test"]  # split defaults to the file stem

    gsm8k.main(["--input", str(tmp_path / "dict"), "--out-dir", str(tmp_path / "out"), "--format", "jsonl"])
    assert read_rows(tmp_path / "out" / "train.jsonl") == from_dict["train"]


def test_gsm8k_errors_name_file_and_row(tmp_path):
    bad = write_jsonl(tmp_path / "train.jsonl", [FAKE_GSM8K["train"][0], {"question": "q?", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"train\.jsonl: row 1: .*####"):
        gsm8k.load_splits(bad)
    missing = write_jsonl(tmp_path / "x.jsonl", [{"question": "q?"}])
    with pytest.raises(ValueError, match=r"x\.jsonl: row 0: missing string field 'answer'"):
        gsm8k.load_splits(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="train.jsonl/test.jsonl"):
        gsm8k.load_splits(tmp_path / "empty")


def test_gsm8k_multiturn_keeps_the_single_turn_rows_and_adds_verl_tool_fields(tmp_path):
    """Every layout gsm8k.py reads; the multi-turn row is the single-turn row with the system prompt, verl's tool and
    interaction kwargs; errors still name the file and row."""
    write_jsonl(tmp_path / "train.jsonl", FAKE_GSM8K["train"])
    single, multi = gsm8k.load_splits(tmp_path)["train"], gsm8k_multiturn.from_gsm8k(tmp_path)["train"]
    for s, m in zip(single, multi):
        assert {k: v for k, v in m.items() if k not in ("prompt", "extra_info")} == {
            k: v for k, v in s.items() if k not in ("prompt", "extra_info")
        }
        assert m["prompt"] == [{"role": "system", "content": gsm8k_multiturn.SYSTEM_PROMPT}, s["prompt"][0]]
        truth = s["reward_model"]["ground_truth"]
        assert m["extra_info"] == {
            **s["extra_info"],
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
            "interaction_kwargs": {"name": "gsm8k", "query": s["extra_info"]["question"], "ground_truth": truth},
        }
    gsm8k_multiturn.main(
        ["--input", str(tmp_path / "train.jsonl"), "--split", "train", "--out-dir", str(tmp_path / "out")]
    )
    assert read_rows(tmp_path / "out" / "train.parquet") == multi
    write_jsonl(tmp_path / "bad.jsonl", [{"question": "q?", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 0: .*####"):
        gsm8k_multiturn.from_gsm8k(tmp_path / "bad.jsonl")
    with pytest.raises(SystemExit):  # one source is required
        gsm8k_multiturn.main(["--out-dir", str(tmp_path / "none")])


# ---------------------------------------------------------------- reasoning_gym


def test_extract_answer():
    assert rg_reward.extract_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert rg_reward.extract_answer("#### 5 then #### 6\nmore chatter") == "6"
    assert rg_reward.extract_answer("x <answer>12</answer> y <answer> 13 </answer>") == "13"
    assert rg_reward.extract_answer("no final answer here") is None
    assert rg_reward.extract_answer("ends with ####   ") is None


RG_TASKS = ["gsm_symbolic", "basic_arithmetic", "chain_sum"]


@pytest.fixture(scope="module")
def rg_splits():
    pytest.importorskip("reasoning_gym", reason="reasoning-gym not installed (pip install reasoning-gym==0.1.25)")
    return rg_script.generate(RG_TASKS, num_train=60, num_test=20, seed=5)


def test_reasoning_gym_rows(rg_splits):
    assert rg_splits == rg_script.generate(RG_TASKS, num_train=60, num_test=20, seed=5)
    assert len(rg_splits["train"]) == 180 and len(rg_splits["test"]) == 60
    for split, rows in rg_splits.items():
        assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
        for row in rows:
            task = row["extra_info"]["task"]
            check_schema(row, data_source=f"reasoning_gym/{task}", split=split)
            entry = json.loads(row["extra_info"]["entry"])
            assert row["prompt"][0]["content"] == entry["question"] + ' Output the final answer after "####".'
            assert row["reward_model"]["ground_truth"] == str(entry["answer"])
    questions = {s: {r["prompt"][0]["content"] for r in rows} for s, rows in rg_splits.items()}
    assert not questions["train"] & questions["test"]


def test_reasoning_gym_reward_uses_package_checker(rg_splits):
    for row in rg_splits["test"]:
        gt, info = row["reward_model"]["ground_truth"], row["extra_info"]
        assert rg_reward.score(f"Working it out.\n#### {gt}", gt, info) == 1.0
        assert rg_reward.score(f"<answer>{gt}</answer>", gt, info) == 1.0
        assert rg_reward.score("I don't know", gt, info) == 0.0
        assert rg_reward.score(f"#### {int(float(gt)) + 1}", gt, info) < 1.0
    with pytest.raises(ValueError, match="entry"):
        rg_reward.score("#### 1", "1", {"task": "chain_sum"})


def test_reasoning_gym_cli_roundtrip(tmp_path, rg_splits):
    rg_script.main(["--tasks", "chain_sum", "--num-train", "8", "--num-test", "4", "--out-dir", str(tmp_path)])
    rows = read_rows(tmp_path / "test.parquet")
    assert len(rows) == 4 and len(read_rows(tmp_path / "train.parquet")) == 8
    # extra_info survives parquet, so the checker can run on rows as the trainer will load them.
    assert all(rg_reward.score(f"#### {r['reward_model']['ground_truth']}", "", r["extra_info"]) == 1.0 for r in rows)
    with pytest.raises(ValueError, match="no_such_task"):
        rg_script.generate(["no_such_task"], num_train=1, num_test=1)
