"""Mixture-of-experts models (``rlspmd/models/moe.py``, ``rlspmd/algorithms/moe.py``): tiny random Qwen3-MoE and
Qwen2-MoE saved by transformers give transformers' log-probs, entropies, gradients and load-balancing loss in the
trainer's module (fp32); routing replay; greedy native generation (eager and continuous batching) equals
``generate`` and records the routing the trainer computes; exports load in transformers; sharded loading of the
per-expert checkpoint layout and its errors."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rlspmd.algorithms.moe import expert_counts, load_balancing_loss, same_expert_set
from rlspmd.models.loader import load_causal_lm, load_tokenizer
from rlspmd.models.logprobs import logprobs_from_logits
from rlspmd.models.moe import MoEBlock, fused_expert_keys, per_expert_tensors, route
from rlspmd.models.sharded_load import materialize, meta_policy_module
from rlspmd.protocol import Batch, position_ids
from rlspmd.rollout.continuous import Request, SlotDecoder, serve
from rlspmd.rollout.native import NativeEngine, OwnWeights
from rlspmd.rollout.sampling import SamplingParams
from rlspmd.trainer.checkpoint import write_hf_dir

pytestmark = pytest.mark.moe
MODELS = ["tiny_moe", "tiny_qwen2_moe"]
PROMPTS = ["Calculate 1 + 2.", "Calculate 37 + 45 - 12.", "Calculate 90 - 9 + 5.", "Hi"]


def trainer_module(path, *, packing: bool):
    """The actor's module as the trainer builds it (meta device, sharded load from the safetensors), on one rank."""
    module, plan = meta_policy_module(
        path, dtype="float32", attn_implementation="sdpa", field_name="m", packing=packing
    )
    materialize(module, device=torch.device("cpu"))
    module.hf.tie_weights()  # to_empty gives each module its own tensor; FSDP2 keeps the tie (one parameter) itself
    plan.load(module)
    return module


def rollout_layout(B=3, P=7, R=6, seed=0, vocab=800):
    """Token ids in the sample layout (left-padded prompts, right-padded responses)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + R), generator=g)
    mask = torch.ones(B, P + R, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    mask[2, :1] = 0
    return ids, mask, position_ids(mask), R


# -- the pure functions ----------------------------------------------------------------------------------------------


def test_load_balancing_loss_matches_transformers_and_a_hand_count():
    torch.manual_seed(0)
    logits = [torch.randn(10, 8) for _ in range(3)]
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1, 1.0])
    # transformers takes a (batch, seq) mask for (batch * seq) rows
    ref = load_balancing_loss_func(tuple(logits), 8, 2, mask.view(2, 5))
    assert torch.allclose(load_balancing_loss(logits, top_k=2, mask_T=mask), ref, atol=1e-6)
    assert torch.allclose(
        load_balancing_loss(logits, top_k=2), load_balancing_loss_func(tuple(logits), 8, 2), atol=1e-6
    )
    # two tokens, two experts, top-1, probabilities (0.75, 0.25) and (0.25, 0.75): f = (1/2, 1/2), P = (1/2, 1/2)
    x = torch.log(torch.tensor([[0.75, 0.25], [0.25, 0.75]]))
    assert load_balancing_loss([x], top_k=1).item() == pytest.approx(2 * (0.5 * 0.5 + 0.5 * 0.5))
    # both tokens to expert 0: f = (1, 0), P = (0.75, 0.25) -> 2 * 0.75
    x = torch.log(torch.tensor([[0.75, 0.25], [0.75, 0.25]]))
    assert load_balancing_loss([x], top_k=1).item() == pytest.approx(1.5)


def test_expert_sets_and_counts_by_hand():
    a = torch.tensor([[[1, 3]], [[0, 2]], [[5, 4]], [[-1, -1]]])  # (T=4, N=1, K=2)
    b = torch.tensor([[[3, 1]], [[0, 3]], [[4, 5]], [[-1, -1]]])
    assert same_expert_set(a, b).squeeze(-1).tolist() == [True, False, True, False]
    counts = expert_counts(a, num_experts=6, mask_T=torch.tensor([1, 1, 0, 1]))
    assert counts.tolist() == [[1, 1, 1, 1, 0, 0]]


def test_route_top_k_normalised_and_replayed():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.4, 0.1, 0.1, 0.4]]))
    w, used, own = route(logits, top_k=2, norm_topk_prob=True)
    assert used.tolist() == own.tolist() and used[0].tolist() == [1, 2]
    assert torch.allclose(w[0], torch.tensor([0.5 / 0.8, 0.3 / 0.8]))
    w, used, own = route(logits, top_k=2, norm_topk_prob=False, replay_TK=torch.tensor([[3, 0], [-1, -1]]))
    assert used.tolist() == [[3, 0], own[1].tolist()]  # a -1 row routes freely
    assert torch.allclose(w[0], torch.tensor([0.1, 0.1]))  # the current router's probabilities at the replayed experts


# -- the trainer's module against transformers -----------------------------------------------------------------------


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("fixture", MODELS)
def test_trainer_logprobs_entropy_and_aux_loss_equal_transformers(fixture, packing, request):
    path = request.getfixturevalue(fixture)
    module = trainer_module(path, packing=packing)
    assert all(isinstance(m.mlp, MoEBlock) for m in module.hf.model.layers)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, mask, pos, R = rollout_layout()
    with torch.no_grad():
        lp, ent = module(ids, mask, pos, response_len=R)
        out = hf(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
    ref_lp, ref_ent = logprobs_from_logits(out.logits[:, -R - 1 : -1], ids[:, -R:])
    m = mask[:, -R:].bool()
    assert (lp - ref_lp)[m].abs().max() < 1e-5 and (ent - ref_ent)[m].abs().max() < 1e-5
    assert not packing or (lp[~m] == 0).all()
    # transformers' aux loss over the valid tokens (its attention mask), ours over the tokens that ran
    assert abs(module.moe.aux_loss().item() - out.aux_loss.item()) < 1e-5
    used, own = module.moe.routed_BL()
    assert torch.equal(used, own) and used.shape == (*ids.shape, 4, 2)
    assert ((used >= 0).all(-1).all(-1) == mask.bool()).all() if packing else (used >= 0).all()


@pytest.mark.parametrize("fixture", MODELS)
def test_trainer_gradients_equal_transformers(fixture, request):
    """The loss sum(log-probs) + coef * aux: the same gradient for every parameter (experts, router, shared expert)."""
    path = request.getfixturevalue(fixture)
    module = trainer_module(path, packing=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, mask, pos, R = rollout_layout(seed=1)
    lp, _ = module(ids, mask, pos, response_len=R)
    (lp.sum() + 0.1 * module.moe.aux_loss()).backward()
    out = hf(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
    ref_lp, _ = logprobs_from_logits(out.logits[:, -R - 1 : -1], ids[:, -R:])
    (ref_lp[mask[:, -R:].bool()].sum() + 0.1 * out.aux_loss).backward()
    ours = {n.removeprefix("hf."): p.grad for n, p in module.named_parameters()}
    checked = 0
    for name, p in hf.named_parameters():
        if p.grad is None:
            continue
        torch.testing.assert_close(ours[name], p.grad, atol=2e-5, rtol=1e-4, msg=name)
        checked += "experts" in name or "gate" in name
    assert checked >= 8  # the experts and the routers got their gradients, and agree


def test_replayed_routing_is_used_on_every_token(tiny_moe):
    module = trainer_module(tiny_moe, packing=True)
    ids, mask, pos, R = rollout_layout(seed=2)
    with torch.no_grad():
        lp, _ = module(ids, mask, pos, response_len=R)
        used, _ = module.moe.routed_BL()
        same, _ = module(ids, mask, pos, response_len=R, replay_BL=used)
        assert torch.equal(lp, same)  # replaying its own routing changes nothing
        other = (used.long() + 1) % 8  # every token to other experts (still K distinct ones)
        other[:, 1] = -1  # ...except position 1, which routes freely
        lp2, _ = module(ids, mask, pos, response_len=R, replay_BL=other)
        used2, own2 = module.moe.routed_BL()
    valid = mask.bool()
    valid[:, 1] = False
    assert torch.equal(used2[valid], other[valid].to(torch.int16))
    assert torch.equal(used2[:, 1][mask[:, 1].bool()], own2[:, 1][mask[:, 1].bool()])
    assert (lp2 - lp).abs().max() > 1e-3  # other experts: other log-probs


# -- the native engine against generate ------------------------------------------------------------------------------


def encode(tok, texts=PROMPTS):
    t = [
        tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
        for c in texts
    ]
    enc = tok(t, padding=True, return_tensors="pt", add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


class Prompts:
    """A request source that hands out one request per prompt (continuous batching joins them as slots free)."""

    def __init__(self, contexts, max_new_tokens):
        self.todo = [Request(k, c, max_new_tokens, seed=k) for k, c in enumerate(contexts)]
        self.results = {}

    def take(self, *, block):
        out, self.todo = self.todo[:1], self.todo[1:]  # one at a time: later ones join a running batch
        return out

    def finish(self, key, tokens, logprobs):
        self.results[key] = tokens


@pytest.fixture(scope="module")
def decisive(tmp_path_factory):
    """``decisive(path)``: the tiny MoE with its experts and routers scaled by 10, saved (per-expert layout). A random
    tiny model greedily repeats one token whatever the prompt; scaled experts dominate the residual stream and
    decisive routers spread the tokens, so greedy continuations differ per prompt and depend on every expert."""
    made = {}

    def make(path):
        if path not in made:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            with torch.no_grad():
                for layer in model.model.layers:
                    for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj, layer.mlp.gate.weight):
                        p.mul_(10)
            out = tmp_path_factory.mktemp("decisive") / path.parent.name
            model.save_pretrained(out)
            load_tokenizer(path, field_name="m").save_pretrained(out)
            made[path] = out
        return made[path]

    return make


@pytest.mark.parametrize("fixture", MODELS)
def test_greedy_native_generation_equals_generate_and_records_the_trainers_routing(fixture, request, decisive):
    path = decisive(request.getfixturevalue(fixture))
    tok = load_tokenizer(path, field_name="model")
    model = load_causal_lm(path, dtype="float32", attn_implementation="sdpa", field_name="model").eval()
    ids, mask = encode(tok)
    T = 20
    hf = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=T,
        min_new_tokens=T,
        pad_token_id=tok.pad_token_id,
        eos_token_id=None,
    )[:, ids.shape[1] :]
    assert len({tuple(r) for r in hf.tolist()}) > 1  # prompts give different continuations
    engine = NativeEngine(
        OwnWeights(model), eos_ids=[], pad_id=tok.pad_token_id, max_batch_size=3, device=torch.device("cpu")
    )
    prompts = Batch({"prompts_BP": ids, "prompt_mask_BP": mask})
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=T), generator=None)
    assert torch.equal(out["responses_BR"], hf)
    # continuous batching (request-level generation): the same tokens
    contexts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    source = Prompts(contexts, T)
    serve(
        SlotDecoder(model, slots=2, max_len=64, device=torch.device("cpu")),
        source,
        SamplingParams(temperature=0.0),
        slots=2,
        eos_ids=[],
    )
    assert [source.results[k] for k in range(len(PROMPTS))] == hf.tolist()
    # the routing recorded with the sample is the trainer's own on every token the rollout ran
    routing = out["rollout_routing_BL"]
    assert routing.dtype == torch.int16 and routing.shape == (*out["input_ids_BL"].shape, 4, 2)
    module = trainer_module(path, packing=True)
    with torch.no_grad():
        module(out["input_ids_BL"], out["attention_mask_BL"], out["position_ids_BL"], response_len=T)
    used, _ = module.moe.routed_BL()
    ran = torch.ones_like(out["attention_mask_BL"], dtype=torch.bool)  # prompts (padding included) and responses...
    ran[:, -1] = False  # ...except the last sampled token, which never went through the rollout's model
    assert (routing[~ran] == -1).all() and (routing[ran] >= 0).all()
    valid = ran & out["attention_mask_BL"].bool()
    assert same_expert_set(routing[valid], used[valid]).all()


def test_eos_rows_record_no_routing_past_their_end(tiny_moe, decisive):
    path = decisive(tiny_moe)
    tok = load_tokenizer(path, field_name="model")
    model = load_causal_lm(path, dtype="float32", attn_implementation="sdpa", field_name="model").eval()
    ids, mask = encode(tok)
    # a random model rarely samples its EOS: a third of the vocabulary ends a row, so rows end at different steps
    engine = NativeEngine(
        OwnWeights(model),
        eos_ids=list(range(3, 300)),
        pad_id=tok.pad_token_id,
        max_batch_size=8,
        device=torch.device("cpu"),
    )
    p = SamplingParams(temperature=1.0, max_new_tokens=24)
    out = engine.generate(
        Batch({"prompts_BP": ids, "prompt_mask_BP": mask}).repeat(4), p, generator=torch.Generator().manual_seed(0)
    )
    lengths = out["response_mask_BR"].sum(-1)
    assert lengths.min() < lengths.max()  # rows finished at different steps (and were compacted away)
    P = ids.shape[1]
    for row, n in enumerate(lengths.tolist()):
        assert (out["rollout_routing_BL"][row, P : P + n - 1] >= 0).all()  # every token fed back in was routed
        assert (out["rollout_routing_BL"][row, P + n - 1 :] == -1).all()


# -- checkpoints -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", MODELS)
def test_export_writes_per_expert_tensors_that_transformers_loads(fixture, request, tmp_path):
    path = request.getfixturevalue(fixture)
    module = trainer_module(path, packing=True)
    with torch.no_grad():
        module.hf.model.layers[0].mlp.experts.gate_up_proj[3, 5, 7] = 42.0  # a change the export must carry
    state = {k: v.clone() for k, v in module.hf.state_dict().items()}
    write_hf_dir(module.hf, state, load_tokenizer(path, field_name="m"), path, tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) <= keys  # the per-expert layout (plus a tied head's alias)
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys and not any("gate_up_proj" in k for k in keys)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert loaded.model.layers[0].mlp.experts.gate_up_proj[3, 5, 7].item() == 42.0
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_per_expert_names_round_trip(tiny_moe):
    tensors = load_file(str(tiny_moe / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    split = dict(p for n, t in hf.state_dict().items() for p in per_expert_tensors(n, t))
    assert split.keys() - {"lm_head.weight"} == tensors.keys()  # the file stores the tied head once
    for k, v in tensors.items():
        assert torch.equal(split[k], v), k
    assert fused_expert_keys("model.layers.0.mlp.gate.weight", 8) is None


def test_sharded_load_names_a_missing_or_misshapen_expert(tiny_moe, tmp_path):
    tensors = load_file(str(tiny_moe / "model.safetensors"))
    cfg = json.loads((tiny_moe / "config.json").read_text())
    for case in ("missing", "shape"):
        d = tmp_path / case
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        bad = dict(tensors)
        key = "model.layers.2.mlp.experts.5.up_proj.weight"
        if case == "missing":
            del bad[key]
        else:
            bad[key] = bad[key][:-1].clone()
        save_file(bad, str(d / "model.safetensors"))
        match = "experts.gate_up_proj" if case == "missing" else r"experts\.5\.gate_proj.* do not make one"
        with pytest.raises(ValueError, match=match):
            meta_policy_module(d, dtype="float32", attn_implementation="sdpa", field_name="actor.model.path")


# -- CUDA: grouped GEMM ----------------------------------------------------------------------------------------------

CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_grouped_gemm_experts_equal_the_loop_on_cuda():
    """bfloat16 on CUDA takes ``grouped_mm`` (one GEMM per projection for all experts); its outputs and gradients equal
    the per-expert loop's in float32 on the same bf16-rounded weights, to bf16 precision, with empty experts."""
    from rlspmd.models.moe import grouped_swiglu

    g = torch.Generator().manual_seed(0)
    E, H, inter = 16, 256, 128
    counts = torch.randint(0, 130, (E,), generator=g)
    counts[3] = 0  # an expert that got no token
    S = int(counts.sum())
    x = torch.randn(S, H, generator=g).cuda().bfloat16().requires_grad_()
    gate_up = (torch.randn(E, 2 * inter, H, generator=g) * 0.05).cuda().bfloat16().requires_grad_()
    down = (torch.randn(E, H, inter, generator=g) * 0.05).cuda().bfloat16().requires_grad_()
    y = grouped_swiglu(x, counts.cuda(), gate_up, down, torch.nn.functional.silu)
    y.float().square().sum().backward()
    ref = [t.detach().float().requires_grad_() for t in (x, gate_up, down)]
    y_ref = grouped_swiglu(*ref[:1], counts.cuda(), *ref[1:], torch.nn.functional.silu)  # float32: the loop
    y_ref.square().sum().backward()
    scale = y_ref.abs().max()
    assert (y.float() - y_ref).abs().max() < 2e-2 * scale
    for t, r in zip((x, gate_up, down), ref):
        assert (t.grad.float() - r.grad).norm() < 2e-2 * r.grad.norm()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_moe_module_on_cuda_in_bfloat16_matches_float32(tiny_moe):
    """The trainer's MoE module in bfloat16 on CUDA (grouped GEMM experts) against float32 on CPU: log-probs to bf16
    precision, the same routing on almost every token."""
    module = trainer_module(tiny_moe, packing=True)
    ids, mask, pos, R = rollout_layout(seed=3)
    with torch.no_grad():
        lp, _ = module(ids, mask, pos, response_len=R)
        used, _ = module.moe.routed_BL()
        module.cuda().bfloat16()
        lp16, _ = module(ids.cuda(), mask.cuda(), pos.cuda(), response_len=R)
        used16, _ = module.moe.routed_BL()
    m = mask[:, -R:].bool()
    assert (lp16.float().cpu() - lp)[m].abs().mean() < 0.05
    valid = mask.bool()
    assert same_expert_set(used16.cpu()[valid], used[valid]).float().mean() > 0.9
