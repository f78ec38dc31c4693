import pytest
import torch

from rlspmd.protocol import Batch


def make(n=5):
    return Batch(
        {"x_BP": torch.arange(n * 2).view(n, 2), "uid_B": torch.arange(n)}, {"text": [f"t{i}" for i in range(n)]}
    )


def test_fields_must_share_batch_size():
    with pytest.raises(ValueError, match="batch size"):
        Batch({"a_B": torch.zeros(3)}, {"b": [1, 2]})
    with pytest.raises(ValueError, match="field 'y_B' has batch size 2"):
        make(3).set(y_B=torch.zeros(2))


def test_select_split_concat_round_trip():
    b = make(5)
    parts = b.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    back = Batch.concat(parts)
    assert torch.equal(back["x_BP"], b["x_BP"]) and back["text"] == b["text"]
    sel = b.select([4, 0, 0])
    assert sel["uid_B"].tolist() == [4, 0, 0] and sel["text"] == ["t4", "t0", "t0"]
    with pytest.raises(ValueError, match="pad_to_divisor"):
        b.chunk(2)


def test_repeat_is_consecutive():
    r = make(2).repeat(3)
    assert r["uid_B"].tolist() == [0, 0, 0, 1, 1, 1]
    assert r["text"] == ["t0"] * 3 + ["t1"] * 3


def test_pad_to_divisor():
    padded, n = make(5).pad_to_divisor(4)
    assert n == 3 and len(padded) == 8 and padded["uid_B"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    same, n0 = make(4).pad_to_divisor(4)
    assert n0 == 0 and len(same) == 4
    assert [len(c) for c in padded.chunk(4)] == [2, 2, 2, 2]


def test_missing_field_names_it():
    with pytest.raises(KeyError, match="no field 'nope'"):
        make()["nope"]


def test_concat_rejects_different_fields():
    with pytest.raises(ValueError, match="different fields"):
        Batch.concat([make(1), Batch({"z_B": torch.zeros(1)})])
