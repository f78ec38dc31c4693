"""Packed (padding-free) forwards equal padded ones: log-probs, entropies, gradients; the registered attention
implementation still serves padded forwards and generation; varlen attention equals per-sample attention."""

import pytest
import torch
import torch.nn.functional as F

from rlspmd.models.loader import load_causal_lm
from rlspmd.models.packing import (
    PACKED_ATTENTION,
    cu_seqlens_from_position_ids,
    pack,
    training_attn_implementation,
    varlen_attention_torch,
)
from rlspmd.models.policy import CausalLMPolicy


def rollout_layout(vocab: int, prompt_lens, response_lens, P: int, R: int, seed: int = 0):
    """Left-padded prompts ++ right-padded responses, as the rollout writes them."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    pm = (torch.arange(P)[None] >= P - torch.tensor(prompt_lens)[:, None]).long()
    rm = (torch.arange(R)[None] < torch.tensor(response_lens)[:, None]).long()
    am = torch.cat([pm, rm], 1)
    ids = torch.randint(3, vocab, (B, P + R), generator=g) * am
    return ids, am, (am.cumsum(-1) - 1).clamp(min=0), rm


def load(path, packing: bool):
    attn = training_attn_implementation("sdpa", packing=packing, field_name="attn")
    return CausalLMPolicy(load_causal_lm(path, dtype="float32", attn_implementation=attn, field_name="model"), packing=packing)


def grads_of(module, ids, am, pos, rm, R, temperature):
    module.zero_grad(set_to_none=True)
    lp, ent = module(ids, am, pos, response_len=R, temperature=temperature)
    g = torch.Generator().manual_seed(1)
    # a loss that weighs every valid token differently, like a policy loss with advantages
    w_lp, w_ent = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    loss = ((lp * w_lp + 0.1 * ent * w_ent) * rm).sum() / rm.sum()
    loss.backward()
    return lp.detach(), ent.detach(), loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_llama"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_equals_padded(fixture, temperature, request):
    path = request.getfixturevalue(fixture)
    padded, packed = load(path, False), load(path, True)
    assert packed.hf.config._attn_implementation == PACKED_ATTENTION
    P, R = 9, 12
    ids, am, pos, rm = rollout_layout(padded.config.vocab_size, [9, 4, 6, 2, 7], [12, 3, 1, 12, 8], P, R)
    a = grads_of(padded, ids, am, pos, rm, R, temperature)
    b = grads_of(packed, ids, am, pos, rm, R, temperature)
    m = rm.bool()
    torch.testing.assert_close(b[0][m], a[0][m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b[1][m], a[1][m], rtol=1e-5, atol=1e-5)
    assert bool((b[0][~m] == 0).all()) and bool((b[1][~m] == 0).all())  # packed outputs are 0 at padding
    torch.testing.assert_close(b[2], a[2], rtol=1e-5, atol=1e-6)
    assert a[3].keys() == b[3].keys()
    for name, g in a[3].items():
        torch.testing.assert_close(b[3][name], g, rtol=1e-4, atol=1e-6, msg=lambda msg: f"{name}: {msg}")


def test_packed_with_activation_checkpointing_same_gradients(tiny_model):
    """Checkpointed layers are re-run in the backward with the same packed keywords (cu_seq_lens)."""
    plain, ckpt = load(tiny_model, True), load(tiny_model, True)
    ckpt.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plain.train(), ckpt.train()
    ids, am, pos, rm = rollout_layout(plain.config.vocab_size, [5, 3, 5], [6, 2, 4], 5, 6, seed=3)
    a, b = grads_of(plain, ids, am, pos, rm, 6, 1.0), grads_of(ckpt, ids, am, pos, rm, 6, 1.0)
    for name, g in a[3].items():
        torch.testing.assert_close(b[3][name], g, rtol=1e-5, atol=1e-7)


def test_pack_unpack_and_locate():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [0, 8, 9, 1, 2, 3]])
    am = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    p = pack(ids, am, pos)
    assert p.input_ids_1T.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3]]
    assert p.position_ids_1T.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert p.cu_seqlens.tolist() == [0, 3, 8] and p.cu_seqlens.dtype == torch.int32 and p.max_seqlen == 5
    assert torch.equal(p.unpack(p.input_ids_1T[0]), ids * am)
    sel = torch.zeros_like(am, dtype=torch.bool)
    sel[0, 4], sel[1, 1] = True, True
    assert p.locate(sel).tolist() == [2, 3]
    assert cu_seqlens_from_position_ids(p.position_ids_1T).tolist() == [0, 3, 8]
    assert cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2], [0, 1, 0]])).tolist() == [0, 3, 5, 6]


def test_varlen_attention_equals_per_sample_attention():
    torch.manual_seed(0)
    lengths, H, KV, D = [5, 1, 9, 3], 4, 2, 8
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lengths), H, D, requires_grad=True)
    k, v = torch.randn(sum(lengths), KV, D, requires_grad=True), torch.randn(sum(lengths), KV, D, requires_grad=True)
    out = varlen_attention_torch(q, k, v, cu, max(lengths), scale=0.3)
    ref = []
    for s, n in zip(cu[:-1].tolist(), lengths):
        qs, ks, vs = (x[s : s + n].transpose(0, 1)[None] for x in (q, k, v))
        ks, vs = ks.repeat_interleave(H // KV, 1), vs.repeat_interleave(H // KV, 1)
        att = (qs @ ks.transpose(-1, -2) * 0.3).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        ref.append((att.softmax(-1) @ vs)[0].transpose(0, 1))
    ref = torch.cat(ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    ga = torch.autograd.grad(out, (q, k, v), g)
    gb = torch.autograd.grad(ref, (q, k, v), g)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_registered_attention_still_serves_padded_forwards_and_generate(tiny_model):
    """The packed implementation falls back to SDPA with transformers' mask for padded batches and KV-cached decoding;
    a plainly called packed input (position ids restart, no cu_seq_lens) is still split into its samples."""
    plain = load_causal_lm(tiny_model, dtype="float32", attn_implementation="sdpa", field_name="m").eval()
    packed = load_causal_lm(tiny_model, dtype="float32", attn_implementation=register(), field_name="m").eval()
    ids, am, pos, _ = rollout_layout(plain.config.vocab_size, [6, 3, 4], [2, 5, 1], 6, 5, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(packed(input_ids=ids, attention_mask=am).logits * am[..., None],
                                   plain(input_ids=ids, attention_mask=am).logits * am[..., None], rtol=1e-5, atol=1e-5)
        p = pack(ids, am, pos)
        by_position_ids = packed(input_ids=p.input_ids_1T, position_ids=p.position_ids_1T).logits[0]
        torch.testing.assert_close(p.unpack(by_position_ids) * am[..., None],
                                   plain(input_ids=ids, attention_mask=am).logits * am[..., None], rtol=1e-5, atol=1e-5)
    prompt, mask = ids[:, :6], am[:, :6]
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=0, eos_token_id=None)
    assert torch.equal(packed.generate(input_ids=prompt, **kw), plain.generate(input_ids=prompt, **kw))


def register():
    return training_attn_implementation("sdpa", packing=True, field_name="attn")


def test_packing_needs_a_varlen_capable_attention():
    with pytest.raises(ValueError, match="model.attn_implementation='eager' cannot run packed"):
        training_attn_implementation("eager", packing=True, field_name="model.attn_implementation")
    assert training_attn_implementation("eager", packing=False, field_name="x") == "eager"
    assert training_attn_implementation("flash_attention_2", packing=True, field_name="x") == "flash_attention_2"


def test_sliding_window_longer_than_samples_is_rejected():
    from rlspmd.models.packing import packed_attention_forward

    class M(torch.nn.Module):
        num_key_value_groups = 1

    q = torch.randn(1, 2, 6, 4)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="sliding window"):
        packed_attention_forward(M(), q, q, q, None, sliding_window=4, cu_seq_lens_q=cu, max_length_q=6)
    out, _ = packed_attention_forward(M(), q, q, q, None, sliding_window=8, cu_seq_lens_q=cu, max_length_q=6)
    ref = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, ref)


def test_packed_values_and_scores_equal_padded(tiny_model, tiny_reward_model):
    """The critic's values (and their gradients) and the reward model's scores: packed == padded."""
    from rlspmd.models.value import load_sequence_scorer, load_value_model

    P, R = 7, 9
    padded = load_value_model(tiny_model, dtype="float32", attn_implementation="sdpa", seed=0, field_name="m", packing=False)
    packed = load_value_model(tiny_model, dtype="float32", attn_implementation="sdpa", seed=0, field_name="m", packing=True)
    ids, am, pos, rm = rollout_layout(padded.config.vocab_size, [7, 2, 5, 4], [9, 1, 6, 3], P, R, seed=5)
    out = []
    for model in (padded, packed):
        model.zero_grad(set_to_none=True)
        v = model(ids, am, pos, response_len=R)
        loss = ((v - torch.linspace(-1, 1, R)).square() * rm).sum() / rm.sum()
        loss.backward()
        out.append((v.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    m = rm.bool()
    torch.testing.assert_close(out[1][0][m], out[0][0][m], rtol=1e-5, atol=1e-5)
    assert bool((out[1][0][~m] == 0).all())
    assert out[0][1].keys() == out[1][1].keys() and "value_head.weight" in out[0][1]
    for name, g in out[0][1].items():
        torch.testing.assert_close(out[1][1][name], g, rtol=1e-4, atol=1e-6, msg=lambda msg: f"{name}: {msg}")

    scorers = [load_sequence_scorer(tiny_reward_model, dtype="float32", attn_implementation="sdpa", field_name="m", packing=p)
               for p in (False, True)]
    ids, am, pos, _ = rollout_layout(scorers[0].hf.config.vocab_size, [7, 3, 5], [2, 9, 5], P, R, seed=6)
    with torch.no_grad():
        a, b = (s(ids, am, pos) for s in scorers)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
