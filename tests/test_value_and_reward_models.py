"""Scalar-head models (critic value model, reward-model scorer) and the reward model's re-rendering."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from conftest import PLAIN_TEMPLATE
from rlspmd.models.loader import load_tokenizer
from rlspmd.models.value import load_sequence_scorer, load_value_model
from rlspmd.roles.reward_model import render_conversations, same_tokenization


def inputs(vocab: int, B: int = 3, L: int = 9):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[2, -2:] = 0  # right padding
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_value_model_head_is_seeded_and_values_cover_the_response(tiny_model):
    kw = dict(dtype="float32", attn_implementation="eager", field_name="critic.model_path")
    a, b, c = (
        load_value_model(tiny_model, seed=0, **kw),
        load_value_model(tiny_model, seed=0, **kw),
        load_value_model(tiny_model, seed=1, **kw),
    )
    torch.testing.assert_close(a.value_head.weight, b.value_head.weight)
    assert not torch.equal(a.value_head.weight, c.value_head.weight)
    assert a.value_head.bias.item() == 0.0
    ids, mask, pos = inputs(a.config.vocab_size)
    values = a(ids, mask, pos, response_len=4)
    assert values.shape == (3, 4) and values.dtype == torch.float32 and values._base is None
    # V(s_t) is read at the position that predicts response token t: L-5 .. L-2
    hidden = a.hf(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    torch.testing.assert_close(values, a.value_head(hidden[:, -5:-1]).squeeze(-1))
    assert 0.0 < values.std().item() < 1.0  # small initial values


def test_value_model_starts_from_a_reward_models_head(tiny_reward_model):
    critic = load_value_model(
        tiny_reward_model, dtype="float32", attn_implementation="eager", seed=0, field_name="critic.model_path"
    )
    rm = AutoModelForSequenceClassification.from_pretrained(str(tiny_reward_model))
    torch.testing.assert_close(critic.value_head.weight, rm.score.weight)
    torch.testing.assert_close(critic.hf.embed_tokens.weight, rm.model.embed_tokens.weight)


def test_sequence_scorer_matches_hf_pooling(tiny_reward_model):
    scorer = load_sequence_scorer(
        tiny_reward_model, dtype="float32", attn_implementation="eager", field_name="reward.model.path"
    )
    hf = AutoModelForSequenceClassification.from_pretrained(str(tiny_reward_model), attn_implementation="eager")
    ids, mask, pos = inputs(hf.config.vocab_size)
    ids = ids.masked_fill(mask == 0, hf.config.pad_token_id)  # HF pools at the last non-pad token
    got = scorer(ids, mask, pos)
    want = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits.squeeze(-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sequence_scorer_rejects_a_causal_lm(tiny_model):
    with pytest.raises(ValueError, match="reward.model.path: .* not a \\*ForSequenceClassification"):
        load_sequence_scorer(tiny_model, dtype="float32", attn_implementation="eager", field_name="reward.model.path")


def test_rerendering_uses_the_reward_models_template(tiny_model, tiny_reward_model, tiny_reward_model_plain_template):
    actor = load_tokenizer(tiny_model, field_name="actor")
    same = load_tokenizer(tiny_reward_model, field_name="rm")
    plain = load_tokenizer(tiny_reward_model_plain_template, field_name="rm")
    assert same_tokenization(actor, same) and not same_tokenization(actor, plain)
    msgs = [[{"role": "user", "content": "Calculate 2 + 3."}], [{"role": "user", "content": "Calculate 10 - 1."}]]
    out = render_conversations(plain, msgs, ["2 + 3 = 5 #### 5", "9"])
    first = plain.decode(out["input_ids_BL"][0][out["attention_mask_BL"][0] > 0])
    assert first == "USER: Calculate 2 + 3.\nASSISTANT: 2 + 3 = 5 #### 5\n"
    assert out["attention_mask_BL"][1, 0] == 0 and out["attention_mask_BL"][:, -1].tolist() == [1, 1]  # left-padded
    torch.testing.assert_close(out["position_ids_BL"], (out["attention_mask_BL"].cumsum(-1) - 1).clamp(min=0))
    assert PLAIN_TEMPLATE == plain.chat_template
