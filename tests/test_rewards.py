import pytest
import torch

from rlspmd.config import RewardConfig
from rlspmd.protocol import Batch
from rlspmd.rewards import RewardError, RewardManager, load_function
from rlspmd.rewards.rules import extract_final_answer, gsm8k, rule_for


def test_gsm8k_rule():
    assert extract_final_answer("so 3 + 4 = 7 #### 7") == "7"
    assert extract_final_answer("#### 1,234 and later #### -5") == "-5"
    assert gsm8k("The answer #### 1,234", "1234") == 1.0
    assert gsm8k("The answer #### 72.0", "72") == 1.0
    assert gsm8k("The answer is 72", "72") == 0.0
    assert gsm8k("#### 71", "72") == 0.0


def test_unknown_data_source_names_it():
    with pytest.raises(ValueError, match="no rule reward for data_source 'mystery'"):
        rule_for("mystery")


class FakeTok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(str(int(t)) for t in row if t) for row in ids]


def batch(n=3):
    resp = torch.tensor([[5, 0], [7, 1], [9, 9]])[:n]
    return Batch(
        {"responses_BR": resp, "response_mask_BR": (resp > 0).long()},
        {
            "ground_truth": ["5", "7", "x"][:n],
            "data_source": ["arithmetic", "custom", "custom"][:n],
            "extra_info": [{"index": 10}, {"index": 11}, {"index": 12}][:n],
        },
    )


def test_user_function_from_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def score(response, ground_truth, extra_info, data_source):\n"
        "    return float(response.startswith(ground_truth)) + extra_info['index'] / 100\n"
    )
    m = RewardManager(RewardConfig(function=f"{f}:score"), FakeTok())
    out = m.score(batch())
    assert out["task_scores_B"].tolist() == pytest.approx([1.10, 1.11, 0.12])


def test_user_function_from_module_with_two_args():
    fn = load_function("rlspmd.rewards.rules:gsm8k")
    assert fn("#### 3", "3") == 1.0
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_function("rlspmd.rewards.rules:nope")
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_function("missing.py:score")


def test_raising_reward_names_sample_and_source(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text(
        "def score(response, ground_truth):\n    if ground_truth == 'x':\n        raise KeyError('boom')\n"
        "    return 1.0\n"
    )
    with pytest.raises(RewardError, match=r"raised on sample index=12 .*data_source='custom'.*KeyError"):
        RewardManager(RewardConfig(function=f"{f}:score"), FakeTok()).score(batch())


@pytest.mark.parametrize("value", ["'high'", "None", "float('nan')"])
def test_non_number_reward_is_rejected(tmp_path, value):
    f = tmp_path / "bad.py"
    f.write_text(f"def score(response, ground_truth):\n    return {value}\n")
    with pytest.raises(RewardError, match="not a finite number.*index=10"):
        RewardManager(RewardConfig(function=f"{f}:score"), FakeTok()).score(batch(1))
