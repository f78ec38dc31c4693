"""Prompt datasets (verl schema via `datasets`), chat template, overlong handling, the sampler."""

import json

import pytest
import torch

from rlspmd.data.prompts import EpochSampler, PromptDataset
from rlspmd.models.loader import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model, field_name="actor.model.path")


def rows(n, long_at=()):
    return [
        {
            "data_source": "arithmetic",
            "prompt": [
                {
                    "role": "user",
                    "content": ("Calculate " + "1 + " * 200 + "1.") if i in long_at else f"Calculate {i} + 1.",
                }
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


def write_parquet(path, data):
    import datasets

    datasets.Dataset.from_list(data).to_parquet(str(path))
    return str(path)


def write_jsonl(path, data):
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return str(path)


def test_parquet_and_jsonl_load_the_same(tmp_path, tok):
    a = PromptDataset([write_parquet(tmp_path / "a.parquet", rows(4))], tok, prompt_key="prompt", max_prompt_length=64)
    b = PromptDataset([write_jsonl(tmp_path / "a.jsonl", rows(4))], tok, prompt_key="prompt", max_prompt_length=64)
    ba, bb = a.batch([0, 3]), b.batch([0, 3])
    assert torch.equal(ba["prompts_BP"], bb["prompts_BP"])
    assert ba["ground_truth"] == ["1", "4"] and ba["data_source"] == ["arithmetic"] * 2
    text = tok.apply_chat_template(rows(1)[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert ba["prompt_text"][0] == text and text.endswith("<|im_start|>assistant\n")
    # left padding: the last column is never padding, pads are the tokenizer's pad id
    assert bool(ba["prompt_mask_BP"][:, -1].all())
    assert ((ba["prompts_BP"] == tok.pad_token_id) == (ba["prompt_mask_BP"] == 0)).all()


def test_overlong_prompts_dropped_or_rejected(tmp_path, tok, caplog):
    f = write_parquet(tmp_path / "long.parquet", rows(5, long_at=(1, 3)))
    d = PromptDataset([f], tok, prompt_key="prompt", max_prompt_length=64)
    assert len(d) == 3 and d.n_dropped == 2
    assert "dropped 2 of 5 prompts" in caplog.text
    with pytest.raises(ValueError, match=r"long.parquet row 1: prompt has \d+ tokens > data.max_prompt_length=64"):
        PromptDataset([f], tok, prompt_key="prompt", max_prompt_length=64, overlong="error")


def test_bad_files_name_the_file_and_column(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="data.train_files: data file .*missing.parquet does not exist"):
        PromptDataset([str(tmp_path / "missing.parquet")], tok, prompt_key="prompt", max_prompt_length=64)
    bad = [{k: v for k, v in r.items() if k != "reward_model"} for r in rows(2)]
    with pytest.raises(ValueError, match=r"nocol.parquet lacks required column\(s\) \['reward_model'\]"):
        PromptDataset([write_parquet(tmp_path / "nocol.parquet", bad)], tok, prompt_key="prompt", max_prompt_length=64)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl"):
        PromptDataset([str(tmp_path / "empty.jsonl")], tok, prompt_key="prompt", max_prompt_length=64)


def test_sampler_is_seeded_and_resumable():
    a = EpochSampler(10, 4, seed=3)
    seq = [a.next_batch() for _ in range(5)]  # crosses two epoch boundaries (tail of 2 dropped)
    assert all(len(set(b)) == 4 for b in seq)
    assert sorted(seq[0] + seq[1]) != sorted(range(10))[:8] or True
    b = EpochSampler(10, 4, seed=3)
    b.next_batch(), b.next_batch()
    state = b.state_dict()
    c = EpochSampler(10, 4, seed=3)
    c.load_state_dict(state)
    assert [c.next_batch() for _ in range(3)] == seq[2:]
    assert EpochSampler(10, 4, seed=4).next_batch() != seq[0]
    with pytest.raises(ValueError, match="train_batch_size=11 is larger than the dataset"):
        EpochSampler(10, 11, seed=0)
