"""The native engine: greedy equals HF `generate`; EOS/max-token stopping; sampling filters; the rollout layout; the
static-shape decoder (CUDA graphs on GPUs; its step runs uncaptured on CPU) gives the eager engine's tokens."""

import pytest
import torch

from rlspmd.models.decoder import HFDecoder, LlamaFamilyDecoder, make_decoder
from rlspmd.models.loader import eos_token_ids, load_causal_lm, load_tokenizer
from rlspmd.protocol import Batch
from rlspmd.rollout.cuda_graphs import StaticDecoder, static_decoder
from rlspmd.rollout.native import NativeEngine, OwnWeights, generate_tokens
from rlspmd.rollout import sampling
from rlspmd.rollout.sampling import SamplingParams, _filter, sample_next, sample_with_uniform

PROMPTS = ["Calculate 1 + 2.", "Calculate 37 + 45 - 12.", "Calculate 90 - 9 + 5.", "Hi"]


def encode(tok, texts=PROMPTS):
    t = [
        tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
        for c in texts
    ]
    enc = tok(t, padding=True, return_tensors="pt", add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_llama"])
def test_greedy_equals_hf_generate(fixture, request):
    path = request.getfixturevalue(fixture)
    tok = load_tokenizer(path, field_name="model")
    model = load_causal_lm(path, dtype="float32", attn_implementation="sdpa", field_name="model").eval()
    ids, mask = encode(tok)
    assert (mask == 0).any(), "prompts must need left padding for this test"
    hf = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=24,
        min_new_tokens=24,
        pad_token_id=tok.pad_token_id,
        eos_token_id=None,
    )[:, ids.shape[1] :]
    for decoder in (make_decoder(model), HFDecoder(model)):
        tokens, lengths, _ = generate_tokens(
            decoder,
            ids,
            mask,
            SamplingParams(temperature=0.0, max_new_tokens=24),
            eos_ids=torch.tensor([-1]),
            pad_id=tok.pad_token_id,
            generator=None,
        )
        assert torch.equal(tokens, hf), type(decoder).__name__
        assert lengths.tolist() == [24] * len(PROMPTS)
    assert isinstance(make_decoder(model), LlamaFamilyDecoder)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_llama"])
def test_a_group_prefills_its_prompt_once(fixture, static, request, monkeypatch):
    """Rows that repeat the previous row's prompt (a GRPO group) prefill it once and share its cache: the same sampled
    tokens and log-probs as prefilling every row, for a cache of the distinct prompts only; in the eager decoder and
    in the static one (``rollout/cuda_graphs.py``, its step uncompiled), which copies each prompt's slots in place."""
    path = request.getfixturevalue(fixture)
    tok = load_tokenizer(path, field_name="model")
    model = load_causal_lm(path, dtype="float32", attn_implementation="sdpa", field_name="model").eval()
    ids, mask = encode(tok)
    rows = torch.tensor([0, 0, 0, 1, 2, 2, 3, 0])  # groups of 3, 1, 2, 1, 1 (the last repeats row 0, not adjacent)
    ids, mask = ids[rows], mask[rows]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    kw = dict(eos_ids=torch.tensor([-1]), pad_id=tok.pad_token_id)
    prefilled = []
    prefill = LlamaFamilyDecoder.prefill

    def counted(self, ids_BP, *a):
        prefilled.append(ids_BP.shape[0])
        return prefill(self, ids_BP, *a)

    def decoder():
        return StaticDecoder(model, capture=False) if static else make_decoder(model)

    monkeypatch.setattr(LlamaFamilyDecoder, "prefill", counted)
    shared = generate_tokens(decoder(), ids, mask, params, generator=torch.Generator().manual_seed(3), **kw)
    monkeypatch.setattr(LlamaFamilyDecoder, "distinct_prompts", lambda self, ids_BP, mask_BP: None)
    whole = generate_tokens(decoder(), ids, mask, params, generator=torch.Generator().manual_seed(3), **kw)
    assert prefilled == [5, 8]
    assert torch.equal(shared[0], whole[0]) and torch.equal(shared[1], whole[1])
    torch.testing.assert_close(shared[2], whole[2], rtol=1e-5, atol=1e-5)
    assert not torch.equal(shared[0][0], shared[0][1])  # a group's rows still sample apart


def test_greedy_with_eos_matches_hf_and_layout(tiny_model):
    tok = load_tokenizer(tiny_model, field_name="model")
    model = load_causal_lm(tiny_model, dtype="float32", attn_implementation="sdpa", field_name="model").eval()
    ids, mask = encode(tok)
    # Make EOS likely: use the token the model greedily emits at step 3 of row 1 as an extra stop id.
    free, _, _ = generate_tokens(
        make_decoder(model),
        ids,
        mask,
        SamplingParams(temperature=0.0, max_new_tokens=8),
        eos_ids=torch.tensor([-1]),
        pad_id=0,
        generator=None,
    )
    stop = int(free[1, 3])
    engine = NativeEngine(
        OwnWeights(model), eos_ids=[stop], pad_id=tok.pad_token_id, max_batch_size=2, device=torch.device("cpu")
    )
    prompts = Batch({"prompts_BP": ids, "prompt_mask_BP": mask, "uid_B": torch.arange(len(PROMPTS))}, {"text": PROMPTS})
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8), generator=None)
    hf = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=8,
        pad_token_id=tok.pad_token_id,
        eos_token_id=stop,
    )[:, ids.shape[1] :]
    R = out["responses_BR"].shape[1]
    for b in range(len(PROMPTS)):
        n = int(out["response_mask_BR"][b].sum())
        assert out["responses_BR"][b, :n].tolist() == hf[b, :n].tolist()
        row = out["responses_BR"][b].tolist()
        if stop in row:
            assert n == row.index(stop) + 1  # EOS is part of the response
        assert all(t == tok.pad_token_id for t in row[n:])
    assert int(out["response_mask_BR"][1].sum()) <= 4  # row 1 emits the stop token by step 3
    P = ids.shape[1]
    assert torch.equal(out["input_ids_BL"][:, :P], ids) and out["input_ids_BL"].shape[1] == P + R
    assert torch.equal(out["attention_mask_BL"], torch.cat([mask, out["response_mask_BR"]], 1))


def test_n_samples_are_consecutive_and_seeded(tiny_model):
    tok = load_tokenizer(tiny_model, field_name="model")
    model = load_causal_lm(tiny_model, dtype="float32", attn_implementation="sdpa", field_name="model").eval()
    ids, mask = encode(tok)
    engine = NativeEngine(
        OwnWeights(model),
        eos_ids=eos_token_ids(tiny_model, tok),
        pad_id=tok.pad_token_id,
        max_batch_size=64,
        device=torch.device("cpu"),
    )
    prompts = Batch({"prompts_BP": ids, "prompt_mask_BP": mask, "uid_B": torch.arange(4)})
    p = SamplingParams(temperature=1.0, max_new_tokens=6, n=3)
    a = engine.generate(prompts, p, generator=torch.Generator().manual_seed(1))
    b = engine.generate(prompts, p, generator=torch.Generator().manual_seed(1))
    c = engine.generate(prompts, p, generator=torch.Generator().manual_seed(2))
    assert a["uid_B"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert torch.equal(a["responses_BR"], b["responses_BR"])
    assert not torch.equal(a["responses_BR"], c["responses_BR"])
    # rollout log-probs are the model's log-softmax at the sampled tokens
    logits = model(
        input_ids=a["input_ids_BL"], attention_mask=a["attention_mask_BL"], position_ids=a["position_ids_BL"]
    ).logits
    R = a["responses_BR"].shape[1]
    lp = torch.log_softmax(logits[:, -R - 1 : -1].float(), -1).gather(-1, a["responses_BR"][..., None]).squeeze(-1)
    m = a["response_mask_BR"].bool()
    torch.testing.assert_close(a["rollout_logprobs_BR"][m], lp[m], atol=1e-4, rtol=1e-4)


def test_sampling_filters_and_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    z = _filter(logits.clone(), top_k=2, top_p=1.0)
    assert torch.isinf(z[0, 2:]).all() and torch.isfinite(z[0, :2]).all()
    z = _filter(logits.clone(), top_k=0, top_p=0.7)  # keeps 0.5 and 0.3 (mass before 0.3 is 0.5 < 0.7)
    assert torch.isfinite(z[0, :2]).all() and torch.isinf(z[0, 2:]).all()
    z = _filter(logits.clone(), top_k=0, top_p=0.4)  # the top token alone reaches 0.4
    assert torch.isfinite(z[0, 0]) and torch.isinf(z[0, 1:]).all()
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_next(logits.expand(1000, 4), SamplingParams(temperature=1.0), g)[0] for _ in range(20)])
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0)
    tok, lp = sample_next(logits, SamplingParams(temperature=0.0), None)
    assert tok.item() == 0 and lp.item() == pytest.approx(torch.log(torch.tensor(0.5)).item(), abs=1e-6)


def test_real_tokenizer_smollm2(smollm2_l2):
    """The real SmolLM2 tokenizer and chat template (Llama architecture): chat rendering and greedy parity."""
    tok = load_tokenizer(smollm2_l2, field_name="model")
    model = load_causal_lm(smollm2_l2, dtype="float32", attn_implementation="sdpa", field_name="model").eval()
    ids, mask = encode(tok, ["What is 12 + 7?", "Name a colour."])
    assert tok.decode(ids[0][mask[0].bool()]).startswith("<|im_start|>system")
    hf = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=16,
        min_new_tokens=16,
        pad_token_id=tok.pad_token_id,
        eos_token_id=None,
    )[:, ids.shape[1] :]
    tokens, _, _ = generate_tokens(
        make_decoder(model),
        ids,
        mask,
        SamplingParams(temperature=0.0, max_new_tokens=16),
        eos_ids=torch.tensor([-1]),
        pad_id=tok.pad_token_id,
        generator=None,
    )
    assert isinstance(make_decoder(model), LlamaFamilyDecoder)
    assert torch.equal(tokens, hf)
    assert eos_token_ids(smollm2_l2, tok) == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_blocked_inverse_cdf_sampling_matches_the_distribution_across_blocks():
    """V spans several 128-token blocks (and a padded last block); -inf entries are never drawn."""
    g = torch.Generator().manual_seed(0)
    V = 300
    logits = torch.randn(1, V, generator=g) * 2
    logits[0, 5::7] = float("-inf")
    probs = torch.softmax(logits, -1)[0]
    draws = torch.cat([sample_next(logits.expand(5000, V), SamplingParams(temperature=1.0), g)[0] for _ in range(20)])
    freq = torch.bincount(draws, minlength=V).float() / draws.numel()
    assert freq[5::7].sum() == 0
    torch.testing.assert_close(freq, probs, atol=0.004, rtol=0)
    # the returned log-prob is the sampled token's log-softmax
    tok, lp = sample_next(logits.expand(8, V), SamplingParams(temperature=0.7), g)
    torch.testing.assert_close(lp, torch.log_softmax(logits / 0.7, -1)[0, tok], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
    ],
    ids=["greedy", "sampled", "filtered"],
)
def test_sampling_in_blocks_of_rows_equals_one_pass_over_the_upcast_logits(monkeypatch, params):
    """On CPU sampling takes the rows in blocks (``PASS_BYTES`` of float32 each) and upcasts each block: bfloat16
    logits sampled 3 rows at a time give exactly the tokens and log-probs of one pass over their float32 values."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(10, 1000, generator=g) * 3).bfloat16()
    u = None if params.greedy else torch.rand(10, 1, generator=g)
    monkeypatch.setattr(sampling, "PASS_BYTES", 4 * 1000 * 3)
    tok, lp = sample_with_uniform(logits, params, u)
    monkeypatch.setattr(sampling, "PASS_BYTES", 1 << 40)
    one_tok, one_lp = sample_with_uniform(logits.float(), params, u)
    assert lp.dtype == torch.float32 and torch.equal(tok, one_tok) and torch.equal(lp, one_lp)
    assert len(set(tok.tolist())) > 1  # rows differ: a block sampled for the wrong rows would show


def test_ignore_eos_never_samples_eos_and_fills_every_response(tiny_model):
    tok = load_tokenizer(tiny_model, field_name="model")
    model = load_causal_lm(tiny_model, dtype="float32", attn_implementation="sdpa", field_name="model").eval()
    ids, mask = encode(tok)
    prompts = Batch({"prompts_BP": ids, "prompt_mask_BP": mask, "uid_B": torch.arange(4)})
    free = NativeEngine(
        OwnWeights(model), eos_ids=[], pad_id=tok.pad_token_id, max_batch_size=64, device=torch.device("cpu")
    )
    p = SamplingParams(temperature=1.0, max_new_tokens=12, n=4)
    sampled = free.generate(prompts, p, generator=torch.Generator().manual_seed(0))["responses_BR"]
    stops = sorted(set(sampled[:, :3].flatten().tolist()))  # tokens the model does sample early: make them "EOS"
    engine = NativeEngine(
        OwnWeights(model), eos_ids=stops, pad_id=tok.pad_token_id, max_batch_size=64, device=torch.device("cpu")
    )
    stopped = engine.generate(prompts, p, generator=torch.Generator().manual_seed(0))
    assert int(stopped["response_mask_BR"].sum()) < 16 * 12  # without ignore_eos these stop ids do end rows
    out = engine.generate(
        prompts,
        SamplingParams(temperature=1.0, max_new_tokens=12, n=4, ignore_eos=True),
        generator=torch.Generator().manual_seed(0),
    )
    assert int(out["response_mask_BR"].sum()) == 16 * 12
    assert not torch.isin(out["responses_BR"], torch.tensor(stops)).any()


def test_compiled_decode_step_gives_the_eager_tokens(tiny_model, tiny_llama):
    """rollout.engine.compile_decode (native): the static decoder's step through torch.compile (whole-cache attention
    under a mask, no compaction) produces the eager engine's greedy tokens, with EOS stops, for Qwen2
    (q/k/v biases) and Llama."""
    for path in (tiny_model, tiny_llama):
        tok = load_tokenizer(path, field_name="model")
        model = load_causal_lm(path, dtype="float32", attn_implementation="sdpa", field_name="model").eval()
        ids, mask = encode(tok)
        free, _, _ = generate_tokens(
            make_decoder(model),
            ids,
            mask,
            SamplingParams(temperature=0.0, max_new_tokens=10),
            eos_ids=torch.tensor([-1]),
            pad_id=0,
            generator=None,
        )
        stop = int(free[1, 3])  # row 1 stops early, the others run on: finished rows stay in the compiled batch
        prompts = Batch({"prompts_BP": ids, "prompt_mask_BP": mask, "uid_B": torch.arange(len(PROMPTS))})
        outs = [
            NativeEngine(
                OwnWeights(model),
                eos_ids=[stop],
                pad_id=tok.pad_token_id,
                max_batch_size=8,
                device=torch.device("cpu"),
                compile_decode=c,
            ).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10), generator=None)
            for c in (False, True)
        ]
        assert torch.equal(outs[0]["responses_BR"], outs[1]["responses_BR"])
        assert torch.equal(outs[0]["response_mask_BR"], outs[1]["response_mask_BR"])
        assert int(outs[1]["response_mask_BR"][1].sum()) <= 4
        torch.testing.assert_close(outs[1]["rollout_logprobs_BR"], outs[0]["rollout_logprobs_BR"], atol=1e-5, rtol=1e-5)


def _engines(model, tok, *, eos, max_batch_size, device):
    """The eager engine and the CUDA-graph engine (``rollout.engine.cuda_graphs``)."""
    return tuple(
        NativeEngine(
            OwnWeights(model),
            eos_ids=eos,
            pad_id=tok.pad_token_id,
            max_batch_size=max_batch_size,
            device=device,
            cuda_graphs=graphs,
        )
        for graphs in (False, True)
    )


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_llama"])
def test_static_decode_step_gives_the_eager_tokens_on_cpu(fixture, request):
    """The CUDA-graph step (static KV cache, device-side sampling and stop bookkeeping, stop checks every k tokens) run
    without capture: greedy tokens, lengths and log-probs equal the eager decoder's with EOS stops (rows finish at
    different steps; finished rows stay in the static batch), for two batch sizes (3 + 1 rows) on one decoder."""
    path = request.getfixturevalue(fixture)
    tok = load_tokenizer(path, field_name="model")
    model = load_causal_lm(path, dtype="float32", attn_implementation="sdpa", field_name="model").eval()
    ids, mask = encode(tok)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    free, _, _ = generate_tokens(
        make_decoder(model), ids, mask, params, eos_ids=torch.tensor([-1]), pad_id=0, generator=None
    )
    eos = torch.tensor([int(free[1, 3])])  # row 1 stops at step 3, the others later or never
    static = StaticDecoder(model, capture=False, check_every=4)
    kw = dict(eos_ids=eos, pad_id=tok.pad_token_id, generator=None)
    lengths = []
    for rows in (slice(0, 3), slice(3, 4)):
        a = generate_tokens(make_decoder(model), ids[rows], mask[rows], params, **kw)
        b = generate_tokens(static, ids[rows], mask[rows], params, **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        torch.testing.assert_close(b[2], a[2], atol=1e-5, rtol=1e-5)
        lengths += b[1].tolist()
    assert len(static.states) == 2 and lengths[1] <= 4 < max(lengths)  # rows finish at different steps
    # the engine picks it only where asked: CPU keeps the eager decoder, compile_decode the static one
    assert static_decoder(model, device=torch.device("cpu"), cuda_graphs=True, compile=False) is None
    assert isinstance(static_decoder(model, device=torch.device("cpu"), cuda_graphs=False, compile=True), StaticDecoder)


def test_static_decode_step_with_concatenated_projections_equals_the_separate_ones(tiny_model, tiny_llama):
    """On CPU the static step (``rollout.engine.compile_decode``) multiplies q/k/v and gate/up as two concatenated
    matrices (``LlamaFamilyDecoder.params``); one step from the same cache gives the separate projections' logits and
    K/V, with (Qwen2) and without (Llama) q/k/v biases."""
    from rlspmd.models.decoder import LlamaFamilyDecoder, decode_step

    for path in (tiny_model, tiny_llama):
        model = load_causal_lm(path, dtype="float32", attn_implementation="sdpa", field_name="model").eval()
        dec = LlamaFamilyDecoder(model)
        fused, plain = dec.params(), dec.params(fuse=False)
        assert all(layer[3] is None and layer[13] is None for layer in fused[1])  # k and up folded into q and gate
        assert all(layer[3] is not None and layer[13] is not None for layer in plain[1])
        B, L, KV, D = 3, 9, dec.n_kv, dec.head_dim
        g = torch.Generator().manual_seed(0)
        caches = [torch.randn(dec.n_layers, B, KV, L, D, generator=g) for _ in range(2)]
        mask = torch.zeros(B, L)
        mask[:, 6:] = float("-inf")  # slots 0-4 filled, this token goes to slot 5
        mask[0, :2] = float("-inf")  # row 0's prompt is left-padded
        tok, pos, slot = torch.tensor([5, 17, 42]), torch.tensor([3, 5, 5]), torch.tensor([5])
        cos, sin = dec.rope_table_for(L, torch.device("cpu"))
        outs = []
        with torch.no_grad():
            for weights in (fused, plain):
                k, v = (c.clone() for c in caches)
                logits = decode_step(weights, k, v, tok, pos, slot, mask, cos, sin, dec.n_heads, KV, D, dec.eps)
                outs.append((logits, k, v))
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert not torch.equal(outs[0][1], caches[0])  # the step wrote its K into slot 5


def test_static_decoder_samples_the_eager_draws_on_cpu(tiny_model):
    """Sampling (temperature + top-k, and plain; EOS suppressed): the static decoder takes every step's uniform draws
    from the generator up front; on CPU those are the numbers the eager decoder draws step by step, so with the same
    seed the tokens and log-probs are the same."""
    tok = load_tokenizer(tiny_model, field_name="model")
    model = load_causal_lm(tiny_model, dtype="float32", attn_implementation="sdpa", field_name="model").eval()
    ids, mask = encode(tok)
    eos = torch.tensor(eos_token_ids(tiny_model, tok))
    for p in (
        SamplingParams(temperature=0.8, top_k=50, max_new_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True),
    ):
        a, b = (
            generate_tokens(
                dec, ids, mask, p, eos_ids=eos, pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(7)
            )
            for dec in (make_decoder(model), StaticDecoder(model, capture=False))
        )
        assert torch.equal(a[0], b[0]) and b[1].tolist() == [10] * 4
        torch.testing.assert_close(b[2], a[2], atol=1e-5, rtol=1e-5)
        assert not torch.isin(b[0], eos).any()


CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_llama"])
def test_cuda_graph_decoding_equals_eager_decoding(fixture, request):
    """On CUDA: greedy tokens from the captured graphs == the eager engine's (float32, TF32 off: no near-tie flips),
    with EOS stops and two batch sizes (two graphs, one pool); in bf16 the graphs replay exactly what the same step
    computes uncaptured; a replayed generation makes no host sync between stop checks; sampling is reproducible from
    the generator."""
    path = request.getfixturevalue(fixture)
    dev = torch.device("cuda")
    tok = load_tokenizer(path, field_name="model")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = load_causal_lm(path, dtype="float32", attn_implementation="sdpa", field_name="model").eval().to(dev)
    ids, mask = (x.to(dev) for x in encode(tok))
    free, _, _ = generate_tokens(
        make_decoder(model),
        ids,
        mask,
        SamplingParams(temperature=0.0, max_new_tokens=40),
        eos_ids=torch.tensor([-1], device=dev),
        pad_id=0,
        generator=None,
    )
    stop = int(free[1, 3])
    prompts = Batch({"prompts_BP": ids, "prompt_mask_BP": mask, "uid_B": torch.arange(len(PROMPTS), device=dev)})
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    eager, graphs = _engines(model, tok, eos=[stop], max_batch_size=3, device=dev)
    a, b = eager.generate(prompts, params, generator=None), graphs.generate(prompts, params, generator=None)
    assert graphs.take_times()["capture_s"] > 0  # graphs were captured (two batch sizes: 3 and 1)
    assert torch.equal(a["responses_BR"], b["responses_BR"]) and torch.equal(
        a["response_mask_BR"], b["response_mask_BR"]
    )
    torch.testing.assert_close(b["rollout_logprobs_BR"], a["rollout_logprobs_BR"], atol=1e-4, rtol=1e-4)

    bf16 = load_causal_lm(path, dtype="bfloat16", attn_implementation="sdpa", field_name="model").eval().to(dev)
    eos = torch.tensor([stop], device=dev)
    runs = []
    for capture in (False, True):
        dec = StaticDecoder(bf16, capture=capture)
        runs.append(dec.generate(ids, mask, params, eos_ids=eos, pad_id=tok.pad_token_id, generator=None))
    for x, y in zip(*runs):
        assert torch.equal(x, y)

    dec = StaticDecoder(bf16, capture=True)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)
    first = dec.generate(
        ids, mask, sampled, eos_ids=eos, pad_id=tok.pad_token_id, generator=torch.Generator(dev).manual_seed(3)
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # captured already: the generation below replays without host syncs
    try:
        again = dec.generate(
            ids, mask, sampled, eos_ids=eos, pad_id=tok.pad_token_id, generator=torch.Generator(dev).manual_seed(3)
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    other = dec.generate(
        ids, mask, sampled, eos_ids=eos, pad_id=tok.pad_token_id, generator=torch.Generator(dev).manual_seed(4)
    )
    assert not torch.equal(first[0], other[0])
