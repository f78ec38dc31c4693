"""Packed (padding-free) forwards equal padded ones: log-probs, entropies, gradients; the registered attention
implementation still serves padded forwards and generation; every packed-attention kernel equals the per-sample
path (CPU: sdpa_loop and FlexAttention's forward; CUDA kernels forward and backward in the ``gpu`` tests); start-up
checks of ``model.attn_kernel`` name the field."""

import pytest
import torch
import torch.nn.functional as F

from rlspmd.models.loader import load_causal_lm
from rlspmd.models import packing
from rlspmd.models.packing import (
    PACKED_ATTENTION,
    PackedAttention,
    TokenCounts,
    cu_seqlens_from_position_ids,
    document_causal_block_mask,
    pack,
    prefix_batch,
    prefix_batched_attention,
    prefix_loop_attention,
    sdpa_loop_attention,
    training_attn_implementation,
)
from rlspmd.models.attn_kernels import check_attn_kernel, kernel_problem, resolve_attn_kernel
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


def load(path, packing: bool, attn_kernel: str = "auto", dtype: str = "float32"):
    attn = training_attn_implementation("sdpa", packing=packing, field_name="attn")
    hf = load_causal_lm(path, dtype=dtype, attn_implementation=attn, field_name="model")
    return CausalLMPolicy(hf, packing=packing, attn_kernel=attn_kernel)


def grads_of(module, ids, am, pos, rm, R, temperature):
    module.zero_grad(set_to_none=True)
    lp, ent = module(ids, am, pos, response_len=R, temperature=temperature)
    g = torch.Generator().manual_seed(1)
    # a loss that weighs every valid token differently, like a policy loss with advantages
    w_lp, w_ent = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    loss = ((lp * w_lp + 0.1 * ent * w_ent) * rm).sum() / rm.sum()
    loss.backward()
    return (
        lp.detach(),
        ent.detach(),
        loss.detach(),
        {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None},
    )


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


def test_pack_unpack_and_response_positions():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [0, 8, 9, 1, 2, 3]])
    am = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    p = pack(ids, am, pos, response_len=3)
    assert p.input_ids_1T.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3]]
    assert p.position_ids_1T.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert p.cu_seqlens.tolist() == [0, 3, 8] and p.cu_seqlens.dtype == torch.int32 and p.max_seqlen == 5
    assert p.attention.lengths == (3, 5) and p.attention.kernel == "sdpa_loop"
    assert torch.equal(p.unpack(p.input_ids_1T[0]), ids * am)
    # response columns 3..5: row 0 holds 6, 7 (columns 3, 4), row 1 holds 1, 2, 3: packed positions 1, 2 and 5, 6, 7
    assert p.target_pos_N.tolist() == [1, 2, 5, 6, 7]
    assert p.response_rows_N.tolist() == [0, 0, 1, 1, 1] and p.response_cols_N.tolist() == [0, 1, 0, 1, 2]
    assert p.scatter_responses(p.input_ids_1T[0, p.target_pos_N].float()).tolist() == [[6, 7, 0], [1, 2, 3]]
    assert TokenCounts.of(am, 3) == TokenCounts((3, 5), (2, 3))
    q = pack(ids, am, pos, response_len=3, counts=TokenCounts((3, 5), (2, 3)))  # host counts given: same pack
    assert q.target_pos_N.tolist() == p.target_pos_N.tolist() and q.cu_seqlens.tolist() == [0, 3, 8]
    assert cu_seqlens_from_position_ids(p.position_ids_1T).tolist() == [0, 3, 8]
    assert cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2], [0, 1, 0]])).tolist() == [0, 3, 5, 6]


def grouped_layout(vocab: int, groups, P: int, R: int, seed: int = 0):
    """``rollout_layout`` where each of ``groups`` (``(prompt length, [response lengths])``) repeats one prompt over
    consecutive rows, as a GRPO batch of groups does."""
    prompt_lens = [p for p, rs in groups for _ in rs]
    ids, am, pos, rm = rollout_layout(vocab, prompt_lens, [r for _, rs in groups for r in rs], P, R, seed=seed)
    first = 0
    for _, rs in groups:
        ids[first : first + len(rs), :P] = ids[first, :P].clone()
        first += len(rs)
    return ids, am, pos, rm


def test_shared_prompt_pack_layout():
    """Rows 0-2 share a prompt, row 3 has its own, row 4 repeats row 3's: each shared prompt is packed once, and
    every response token is predicted from the token before it in its own row."""
    ids = torch.tensor(
        [
            [0, 5, 6, 7, 8, 0],
            [0, 5, 6, 9, 0, 0],
            [0, 5, 6, 1, 2, 3],
            [4, 4, 6, 2, 2, 0],
            [4, 4, 6, 3, 0, 0],
        ]
    )
    am = (ids != 0).long()
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    counts = TokenCounts.of(am, 3, ids)
    assert counts.shares_prompt == (False, True, True, False, True)
    assert TokenCounts.of(am, 3) == TokenCounts((4, 3, 5, 5, 4), (2, 1, 3, 2, 1))  # not asked: no flags
    p = pack(ids, am, pos, response_len=3, share_prompts=True)
    assert p.input_ids_1T.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 4, 6, 2, 2, 3]]
    assert p.position_ids_1T.tolist() == [[0, 1, 2, 3, 2, 2, 3, 4, 0, 1, 2, 3, 4, 3]]
    assert p.attention.groups == ((2, 2, 1, 3), (3, 2, 1)) and p.attention.lengths == (8, 6)
    assert p.cu_seqlens.tolist() == [0, 8, 14] and p.max_seqlen == 5
    assert p.target_pos_N.tolist() == [2, 3, 4, 5, 6, 7, 11, 12, 13]
    assert p.predictor_pos_N.tolist() == [1, 2, 1, 1, 5, 6, 10, 11, 10]
    assert torch.equal(p.unpack(p.input_ids_1T[0]), ids * am)  # every row gets its group's prompt back
    assert p.scatter_responses(p.input_ids_1T[0, p.target_pos_N].float()).tolist() == [
        [7, 8, 0], [9, 0, 0], [1, 2, 3], [2, 2, 0], [3, 0, 0]
    ]  # fmt: skip
    plain = pack(ids, am, pos, response_len=3)  # not asked: every row whole, predictors just before the targets
    assert plain.attention.groups is None and plain.num_tokens == 21
    assert plain.predictor_pos_N.tolist() == (plain.target_pos_N - 1).tolist()
    with pytest.raises(ValueError, match="sdpa_loop"):
        pack(ids, am, pos, response_len=3, share_prompts=True, kernel="flex")


def test_prefix_loop_attention_equals_each_sample_whole():
    """Each response attends to its group's one prompt copy exactly as in its own whole sample, forward and backward
    (the prompt's keys and values summing every response's gradient), grouped-query heads included."""
    torch.manual_seed(0)
    H, KV, D = 4, 2, 8
    groups = ((5, 3, 0, 4), (2, 6), (0, 3), (5, 3, 4), (0, 3), (4, 0), (2, 6, 6))
    sizes = [n for g in groups for n in g]
    q, k, v = (torch.randn(sum(sizes), h, D, dtype=torch.float64, requires_grad=True) for h in (H, KV, KV))
    out = prefix_loop_attention(q, k, v, groups, scale=0.3)
    qs, ks, vs = q.split(sizes), k.split(sizes), v.split(sizes)
    ref, at = [], 0
    for g in groups:
        P = g[0]
        for i in range(at + 1, at + len(g)):  # each sample whole: its prompt, then its response
            whole = [torch.cat((x[at], x[i])) for x in (qs, ks, vs)]
            o = sdpa_loop_attention(*whole, [P + sizes[i]], scale=0.3)
            ref.append((o[:P], o[P:]))
        at += len(g)
    # the prompt rows' outputs: any sample of the group gives them (here its first)
    expect, at, r = [], 0, 0
    for g in groups:
        expect.append(ref[r][0])
        expect += [ref[r + j][1] for j in range(len(g) - 1)]
        r += len(g) - 1
        at += len(g)
    torch.testing.assert_close(out, torch.cat(expect), rtol=1e-12, atol=1e-12)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    # the same loss on whole samples: a response's weight on its own rows, the prompt's split across the group
    loss, at, r = 0.0, 0, 0
    ws = w.split(sizes)
    for g in groups:
        for j in range(len(g) - 1):
            loss = loss + (ref[r + j][1] * ws[at + 1 + j]).sum()
        loss = loss + (ref[r][0] * ws[at]).sum()
        r += len(g) - 1
        at += len(g)
    want = torch.autograd.grad(loss, (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "groups",
    [
        ((5, 3, 0, 4), (2, 6), (0, 3), (5, 3, 4), (0, 3), (4, 0), (2, 6, 6)),  # empty prompts and responses
        ((48, 64, 64, 64, 64),) * 4,  # the SmolLM2 benchmark's groups
        ((7, 5), (0, 4, 2)),  # no prompt in the second group
    ],
)
def test_prefix_batched_attention_equals_the_loop(groups):
    """The two-call batched form (padded responses against their group's prompt, and the prompts) gives the per-segment
    loop's outputs and gradients (the loop equals each sample whole: the test above), grouped-query heads included."""
    torch.manual_seed(0)
    H, KV, D = 4, 2, 8
    T = sum(sum(g) for g in groups)
    q, k, v = (torch.randn(T, h, D, dtype=torch.float64, requires_grad=True) for h in (H, KV, KV))
    plan = prefix_batch(groups, q.device)
    assert plan is not None
    out, ref = prefix_batched_attention(q, k, v, plan, scale=0.3), prefix_loop_attention(q, k, v, groups, scale=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_prefix_batch_keeps_the_loop_where_padding_costs_more():
    """Responses of very different lengths would pad most of the batched work: one call per segment instead."""
    assert prefix_batch([(40, 5, 200, 7, 190, 3, 180, 6, 9)] * 2, torch.device("cpu")) is None
    assert prefix_batch([(40, 5, 6)], torch.device("cpu")) is not None  # three calls become two
    assert prefix_batch([(40, 5, 0)], torch.device("cpu")) is None  # two calls either way: padding only adds work
    assert prefix_batch([(40, 0, 0)], torch.device("cpu")) is None  # no response: nothing to batch


def assert_same_training_outputs(a, b, rm, dtype: str):
    """``grads_of``'s outputs ``a`` and ``b`` agree: log-probs and entropies at the valid tokens ``rm``, the loss and
    every gradient, to float32's precision or (bfloat16) to bfloat16's."""
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    m = rm.bool()
    torch.testing.assert_close(b[0][m], a[0][m], **tol)
    torch.testing.assert_close(b[1][m], a[1][m], **tol)
    torch.testing.assert_close(b[2], a[2], **tol)
    assert a[3].keys() == b[3].keys()
    for name, g in a[3].items():
        gtol = dict(rtol=1e-4, atol=1e-6) if dtype == "float32" else dict(rtol=5e-2, atol=5e-3)
        torch.testing.assert_close(b[3][name].float(), g.float(), **gtol, msg=lambda msg: f"{name}: {msg}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shared_prompts_equal_whole_rows(tiny_llama, dtype):
    """A policy that packs each group's prompt once gives the log-probs, entropies, loss and gradients of one that
    packs every row whole, with fewer tokens through the layers (bfloat16: the same to its precision)."""
    whole, shared = load(tiny_llama, True, dtype=dtype), load(tiny_llama, True, dtype=dtype)
    shared.share_prompts = True
    P, R = 9, 12
    groups = [(9, [12, 3, 7]), (4, [1, 12]), (6, [8]), (7, [5, 5, 12, 2])]
    ids, am, pos, rm = grouped_layout(whole.config.vocab_size, groups, P, R)
    calls = []
    hook = shared.hf.get_decoder().layers[0].register_forward_hook(lambda m, a, o: calls.append(a[0].shape[1]))
    a = grads_of(whole, ids, am, pos, rm, R, 1.0)
    b = grads_of(shared, ids, am, pos, rm, R, 1.0)
    hook.remove()
    assert calls == [sum(p + sum(rs) for p, rs in groups)]  # each prompt once: 26 prompt tokens, not 69
    assert pack(ids, am, pos, response_len=R, share_prompts=True).attention.prefix is not None  # the batched form ran
    assert_same_training_outputs(a, b, rm, dtype)


def test_sdpa_loop_attention_equals_per_sample_attention():
    torch.manual_seed(0)
    lengths, H, KV, D = [5, 1, 9, 3], 4, 2, 8
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lengths), H, D, requires_grad=True)
    k, v = torch.randn(sum(lengths), KV, D, requires_grad=True), torch.randn(sum(lengths), KV, D, requires_grad=True)
    out = sdpa_loop_attention(q, k, v, lengths, scale=0.3)
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
        torch.testing.assert_close(
            packed(input_ids=ids, attention_mask=am).logits * am[..., None],
            plain(input_ids=ids, attention_mask=am).logits * am[..., None],
            rtol=1e-5,
            atol=1e-5,
        )
        p = pack(ids, am, pos)
        by_position_ids = packed(input_ids=p.input_ids_1T, position_ids=p.position_ids_1T).logits[0]
        torch.testing.assert_close(
            p.unpack(by_position_ids) * am[..., None],
            plain(input_ids=ids, attention_mask=am).logits * am[..., None],
            rtol=1e-5,
            atol=1e-5,
        )
    prompt, mask = ids[:, :6], am[:, :6]
    kw = dict(
        attention_mask=mask, do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=0, eos_token_id=None
    )
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
    meta = PackedAttention("sdpa_loop", torch.tensor([0, 6], dtype=torch.int32), 6, (6,))
    with pytest.raises(ValueError, match="sliding window"):
        packed_attention_forward(M(), q, q, q, None, sliding_window=4, packed_attention=meta)
    out, _ = packed_attention_forward(M(), q, q, q, None, sliding_window=8, packed_attention=meta)
    ref = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, ref)


def test_packed_values_and_scores_equal_padded(tiny_model, tiny_reward_model):
    """The critic's values (and their gradients) and the reward model's scores: packed == padded."""
    from rlspmd.models.value import load_sequence_scorer, load_value_model

    P, R = 7, 9
    padded = load_value_model(
        tiny_model, dtype="float32", attn_implementation="sdpa", seed=0, field_name="m", packing=False
    )
    packed = load_value_model(
        tiny_model, dtype="float32", attn_implementation="sdpa", seed=0, field_name="m", packing=True
    )
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

    scorers = [
        load_sequence_scorer(tiny_reward_model, dtype="float32", attn_implementation="sdpa", field_name="m", packing=p)
        for p in (False, True)
    ]
    ids, am, pos, _ = rollout_layout(scorers[0].hf.config.vocab_size, [7, 3, 5], [2, 9, 5], P, R, seed=6)
    with torch.no_grad():
        a, b = (s(ids, am, pos) for s in scorers)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def doc_causal_dense(lengths):
    """The (T, T) allowed-pairs matrix of causal attention within each packed sample."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    T = doc.numel()
    return (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()


@pytest.mark.parametrize("lengths", [[300, 5, 200, 1, 90], [128, 128, 256], [7], [3, 500, 2, 2, 140]])
def test_document_causal_block_mask_matches_the_dense_mask(lengths):
    """The block mask built from the sample boundaries (no T x T evaluation) has exactly the dense mask's pairs, and
    its full blocks are exactly the all-allowed ones: checked against the dense matrix block by block."""
    T = sum(lengths)
    bm = document_causal_block_mask(torch.tensor(lengths), T, block=128)
    assert bm.seq_lengths == (T, T)
    dense = doc_causal_dense(lengths)
    assert torch.equal(bm.to_dense()[0, 0], _block_any(dense, 128))  # which blocks are visited
    n = -(-T // 128)
    full = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in bm.full_kv_indices[0, 0, i, : bm.full_kv_num_blocks[0, 0, i]].tolist():
            full[i, j] = True
    want_full = torch.tensor(
        [
            [bool(dense[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].all()) and j < i for j in range(n)]
            for i in range(n)
        ]
    )
    assert torch.equal(full, want_full)
    # the mask_mod inside partial blocks is the exact pair rule
    q, kv = torch.arange(T)[:, None], torch.arange(T)[None, :]
    assert torch.equal(bm.mask_mod(0, 0, q, kv), dense)


def _block_any(dense, block):
    T = dense.shape[0]
    n = -(-T // block)
    padded = torch.zeros(n * block, n * block, dtype=torch.bool)
    padded[:T, :T] = dense
    return padded.view(n, block, n, block).any(3).any(1)


def test_flex_attention_forward_on_cpu_equals_per_sample_attention():
    """FlexAttention with the document-causal block mask (eager on CPU, forward only) == one SDPA call per sample."""
    from rlspmd.models.packing import KERNELS

    torch.manual_seed(0)
    lengths, H, KV, D = [150, 3, 283, 40, 1], 4, 2, 16
    T = sum(lengths)
    q, k, v = torch.randn(T, H, D), torch.randn(T, KV, D), torch.randn(T, KV, D)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    meta = PackedAttention(
        "flex", cu, max(lengths), tuple(lengths), document_causal_block_mask(torch.tensor(lengths), T)
    )
    with torch.no_grad():
        out = KERNELS["flex"](q, k, v, meta, 0.25, 0.0)
    torch.testing.assert_close(out, sdpa_loop_attention(q, k, v, lengths, scale=0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_llama"])
def test_flex_kernel_log_probs_equal_the_per_sample_kernel_on_cpu(fixture, request):
    """A whole model forward through CausalLMPolicy: attn_kernel=flex (CPU: forward only) == sdpa_loop."""
    path = request.getfixturevalue(fixture)
    loop, flex = load(path, True, "sdpa_loop"), load(path, True, "flex")
    P, R = 9, 12
    ids, am, pos, rm = rollout_layout(loop.config.vocab_size, [9, 4, 6, 2, 7], [12, 3, 1, 12, 8], P, R)
    with torch.no_grad():
        a, b = loop(ids, am, pos, response_len=R), flex(ids, am, pos, response_len=R)
    torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b[1], a[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attn_kernel='flex': FlexAttention has no backward on CPU"):
        flex(ids, am, pos, response_len=R)  # grad enabled: a training forward


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("share_prompts", [False, True])
def test_cpu_fused_kernel_equals_the_sdpa_loop(tiny_llama, dtype, share_prompts):
    """``attn_kernel=cpu_fused`` (one C++ call per pack each way) gives the log-probs, entropies, loss and gradients of
    ``sdpa_loop`` through a whole policy, with shared prompts or whole rows (bfloat16: to its precision)."""
    loop, fused = load(tiny_llama, True, "sdpa_loop", dtype=dtype), load(tiny_llama, True, "cpu_fused", dtype=dtype)
    loop.share_prompts = fused.share_prompts = share_prompts
    P, R = 9, 12
    groups = [(9, [12, 3, 7]), (4, [1, 12]), (6, [8]), (7, [5, 5, 12, 2])]
    ids, am, pos, rm = grouped_layout(loop.config.vocab_size, groups, P, R)
    calls = []
    kernel = packing.KERNELS["cpu_fused"]
    packing.KERNELS["cpu_fused"] = lambda *a: (
        calls.append((a[3].groups is not None, packing.runs_cpu_fused(a[0], a[5]))) or kernel(*a)
    )
    try:
        a = grads_of(loop, ids, am, pos, rm, R, 1.0)
        b = grads_of(fused, ids, am, pos, rm, R, 1.0)
    finally:
        packing.KERNELS["cpu_fused"] = kernel
    # one call per layer, on the shared pack, and the C++ kernel took each (not sdpa_loop's fallback)
    assert calls == [(share_prompts, True)] * fused.config.num_hidden_layers
    assert_same_training_outputs(a, b, rm, dtype)


def test_kernel_choice_and_start_up_checks():
    cpu = torch.device("cpu")
    assert resolve_attn_kernel("auto", device=cpu, dtype=torch.float32) == "sdpa_loop"
    # bfloat16 with gradients (training): rlspmd's C++ kernel (built in the install); without: torch's bfloat16 flash
    assert resolve_attn_kernel("auto", device=cpu, dtype=torch.bfloat16) == "cpu_fused"
    assert resolve_attn_kernel("auto", device=cpu, dtype=torch.bfloat16, backward=False) == "sdpa_loop"
    assert kernel_problem("cpu_fused", device=cpu, dtype=torch.float32) is None
    assert "bfloat16 or float32" in kernel_problem("cpu_fused", device=cpu, dtype=torch.float16)
    assert "CPU only" in kernel_problem("cpu_fused", device=torch.device("cuda"), dtype=torch.bfloat16)
    kw = dict(
        attn_implementation="sdpa", packing=True, device=cpu, dtype=torch.float32, field_name="actor.model.attn_kernel"
    )
    assert check_attn_kernel("auto", **kw) == "sdpa_loop"
    assert check_attn_kernel("sdpa_loop", **kw) == "sdpa_loop"
    assert check_attn_kernel("flex", **{**kw, "backward": False}) == "flex"  # a frozen role's forward runs on CPU
    with pytest.raises(
        ValueError, match=r"actor.model.attn_kernel: attn_kernel='varlen': varlen_attn runs on CUDA only"
    ):
        check_attn_kernel("varlen", **kw)
    with pytest.raises(
        ValueError, match=r"actor.model.attn_kernel: attn_kernel='flex': FlexAttention has no backward on CPU"
    ):
        check_attn_kernel("flex", **kw)
    with pytest.raises(ValueError, match=r"actor.model.attn_kernel='flash' is not one of"):
        check_attn_kernel("flash", **kw)
    with pytest.raises(
        ValueError, match=r"actor.model.attn_kernel='sdpa_loop' needs packed sequences .*model.packing=False"
    ):
        check_attn_kernel("sdpa_loop", **{**kw, "packing": False})
    assert check_attn_kernel("auto", **{**kw, "packing": False}) == "padded"
    assert (
        check_attn_kernel("auto", **{**kw, "attn_implementation": "flash_attention_2"})
        == "flash_attention_2 (transformers)"
    )
    # flash-attn: not installed here, or CPU; either way a reason that names it
    problem = kernel_problem("flash_attn", device=cpu, dtype=torch.bfloat16)
    assert problem is not None and "flash-attn" in problem
    with pytest.raises(ValueError, match=r"actor.model.attn_kernel: attn_kernel='flash_attn': flash-attn"):
        check_attn_kernel("flash_attn", **kw)


# ---------------------------------------------------------------------------------------------------------------
# CUDA kernels: forward and backward against the per-sample path (skipped without a GPU)

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def cuda_kernels() -> list[str]:
    if not CUDA:
        return ["varlen", "flex", "flash_attn"]  # listed so the skipped tests are visible
    dev = torch.device("cuda")
    return [k for k in ("varlen", "flex", "flash_attn") if kernel_problem(k, device=dev, dtype=torch.bfloat16) is None]


def _rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kernel", cuda_kernels())
def test_cuda_kernel_attention_forward_backward_equals_per_sample(kernel):
    """One layer's packed attention at Qwen2.5-0.5B's head shapes (14 / 2 heads, D 64), bf16: output and q/k/v
    gradients against one SDPA call per sample."""
    from rlspmd.models.packing import KERNELS

    dev = torch.device("cuda")
    if kernel_problem(kernel, device=dev, dtype=torch.bfloat16):
        pytest.skip(kernel_problem(kernel, device=dev, dtype=torch.bfloat16))
    torch.manual_seed(0)
    lengths, H, KV, D = [150, 283, 7, 201, 1, 190], 14, 2, 64
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for h in (H, KV, KV))
    lens = torch.tensor(lengths, device=dev)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=dev)
    cu[1:] = lens.cumsum(0)
    meta = PackedAttention(
        kernel, cu, max(lengths), tuple(lengths), document_causal_block_mask(lens, T) if kernel == "flex" else None
    )
    out = KERNELS[kernel](q, k, v, meta, D**-0.5, 0.0)
    ref = sdpa_loop_attention(q, k, v, lengths, scale=D**-0.5)
    g = torch.randn_like(ref)
    ga, gb = torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)
    assert _rel_err(out, ref) < 1e-2
    for name, x, y in zip("qkv", ga, gb):
        assert _rel_err(x, y) < 2e-2, name


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kernel", cuda_kernels())
def test_cuda_kernel_policy_log_probs_and_gradients_equal_per_sample(kernel, tiny_model):
    """A small Qwen2 through CausalLMPolicy on CUDA in bf16: log-probs, entropies and every parameter gradient with
    ``kernel`` against the per-sample kernel; and the packed forward + backward runs with no host sync at all once
    the token counts are known (``torch.cuda.set_sync_debug_mode('error')``)."""
    dev = torch.device("cuda")
    if kernel_problem(kernel, device=dev, dtype=torch.bfloat16):
        pytest.skip(kernel_problem(kernel, device=dev, dtype=torch.bfloat16))
    ref, model = (load(tiny_model, True, name, dtype="bfloat16").to(dev) for name in ("sdpa_loop", kernel))
    P, R = 27, 64
    ids, am, pos, rm = (
        x.to(dev)
        for x in rollout_layout(
            ref.config.vocab_size, [27, 20, 5, 27, 13, 27, 9, 1], [64, 30, 64, 1, 50, 64, 17, 40], P, R, seed=4
        )
    )
    counts = TokenCounts.of(am, R)
    weights = torch.linspace(-1, 1, R, device=dev)

    def forward_backward(m):
        m.zero_grad(set_to_none=True)
        lp, ent = m(ids, am, pos, response_len=R, counts=counts)
        ((lp * weights + 0.1 * ent) * rm).sum().div(64).backward()
        return (
            lp.detach(),
            ent.detach(),
            {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None},
        )

    forward_backward(model)  # once outside the check: FlexAttention compiles on its first call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # now any host sync in the packed forward or backward raises
    try:
        outs = [None, forward_backward(model)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    outs[0] = forward_backward(ref)
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = outs
    m = rm.bool()
    assert (lp_b[m] - lp_a[m]).abs().max() < 0.05 and (ent_b[m] - ent_a[m]).abs().max() < 0.05
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        assert _rel_err(g_b[name], g_a[name]) < 0.05, name
