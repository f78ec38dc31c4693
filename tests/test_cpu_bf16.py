"""bfloat16 compute on CPUs that have it (issue 38): ``param_dtype=auto`` resolves by the CPU's bfloat16 instructions
(or ``RLSPMD_CPU_BF16``), FSDP2 then computes in bfloat16 while the master weights, gradients and AdamW state stay
float32, and the CPU-specific fast paths that came with it (float32 attention for half-precision training, fused
decode projections) compute what the plain paths compute."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.config import FSDPConfig, OptimConfig
from rlspmd.engines.base import CPU_BF16_ENV, cpu_bf16_features, native_bf16, precision_summary
from rlspmd.engines.fsdp import FSDPEngine
from rlspmd.engines.megatron.config import MegatronConfig
from rlspmd.models import decoder as decoder_mod
from rlspmd.models.decoder import LlamaFamilyDecoder
from rlspmd.models.loader import load_causal_lm
from rlspmd.models.packing import sdpa_loop_attention, training_attn_implementation
from rlspmd.models.policy import CausalLMPolicy

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def mesh():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DeviceMesh("cpu", torch.tensor([0]), mesh_dim_names=("dp",))
    dist.destroy_process_group()


def test_auto_computes_in_bfloat16_where_the_cpu_has_it_and_the_override_wins(monkeypatch):
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    hardware = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert native_bf16() == (hardware and torch.backends.mkldnn.is_available())
    detected = torch.bfloat16 if native_bf16() else torch.float32
    assert FSDPConfig().compute_dtype(CPU) == detected
    line = precision_summary(FSDPConfig(), CPU, master="float32", rollout=detected)
    assert ("hardware bfloat16 (" in line) == native_bf16(), line
    assert all(f in ("AVX512-BF16", "AMX") for f in cpu_bf16_features())

    monkeypatch.setenv(CPU_BF16_ENV, "1")
    assert FSDPConfig().compute_dtype(CPU) == torch.bfloat16
    assert FSDPConfig(param_dtype="float32").compute_dtype(CPU) == torch.float32  # an explicit dtype wins
    assert MegatronConfig().compute_dtype(CPU) == torch.float32  # megatron computes in float32 on CPU
    assert f"{CPU_BF16_ENV}=1" in precision_summary(FSDPConfig(), CPU, master="float32", rollout=torch.bfloat16)
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    assert FSDPConfig().compute_dtype(CPU) == torch.float32
    monkeypatch.setenv(CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match=CPU_BF16_ENV):
        FSDPConfig().compute_dtype(CPU)


def _engine(path, mesh) -> FSDPEngine:
    attn = training_attn_implementation("sdpa", packing=True, field_name="attn")
    module = CausalLMPolicy(
        load_causal_lm(path, dtype="float32", attn_implementation=attn, field_name="m"), packing=True
    )
    return FSDPEngine(
        module,
        module.hf,
        mesh=mesh,
        device=CPU,
        fsdp=FSDPConfig(),  # param_dtype=auto
        optim=OptimConfig(lr=1e-3, grad_clip=1.0),
        total_optim_steps=4,
    )


def _update(e: FSDPEngine):
    g = torch.Generator().manual_seed(0)
    am = torch.ones(4, 24, dtype=torch.long)
    am[1, :5] = 0
    ids = torch.randint(3, e.module.config.vocab_size, (4, 24), generator=g) * am
    pos = (am.cumsum(-1) - 1).clamp(min=0)

    def loss(module, _):
        lp, _ = module(ids, am, pos, response_len=12)
        return -(lp * am[:, -12:]).sum() / am[:, -12:].sum()

    return e.optimizer_step([None], loss)


def test_bfloat16_training_keeps_float32_master_weights_and_follows_float32(tiny_model, mesh, monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    fp32 = _engine(tiny_model, mesh)
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    bf16 = _engine(tiny_model, mesh)
    with bf16.unsharded() as m:  # what the forwards and a colocated rollout compute with
        assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    start = torch.cat([p.full_tensor().detach().flatten() for p in fp32.module.parameters()])
    a, b = _update(fp32), _update(bf16)
    # master weights, gradients and optimiser state stay float32
    assert {p.to_local().dtype for p in bf16.module.parameters()} == {torch.float32}
    for state in bf16.optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # the same gradient to bfloat16's precision (8 bits of mantissa through 2 layers), not a different one
    assert float(b["grad_norm"]) == pytest.approx(float(a["grad_norm"]), rel=3e-2)
    # and the same step: AdamW's first step is lr * sign(gradient), so the two steps agree where the gradients'
    # signs do (all but the near-zero ones)
    step_a = torch.cat([p.full_tensor().detach().flatten() for p in fp32.module.parameters()]) - start
    step_b = torch.cat([p.full_tensor().detach().flatten() for p in bf16.module.parameters()]) - start
    assert torch.nn.functional.cosine_similarity(step_a, step_b, dim=0) > 0.95


def test_cpu_attention_trains_half_precision_in_float32():
    g = torch.Generator().manual_seed(0)
    lengths = [7, 12, 5]
    q, k, v = (torch.randn(24, h, 16, generator=g) for h in (4, 2, 2))
    half = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = sdpa_loop_attention(*half, lengths, scale=0.25)
    assert out.dtype == torch.bfloat16
    ref = sdpa_loop_attention(*(t.bfloat16().float() for t in (q, k, v)), lengths, scale=0.25)
    torch.testing.assert_close(out, ref.bfloat16(), rtol=0, atol=0)  # float32 arithmetic, rounded once
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in half)
    with torch.no_grad():  # a reference's forward keeps the bfloat16 kernel (faster without a backward)
        assert sdpa_loop_attention(*half, lengths, scale=0.25).dtype == torch.bfloat16


def greedy_decode(model, rows: int, prompt: int, new_tokens: int, seed: int):
    """``(decoder, logits (new_tokens, rows, vocab))`` of a greedy generation from random prompts, one left-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (rows, prompt), generator=g)
    mask = torch.ones_like(ids)
    mask[rows // 3, : prompt // 2] = 0
    dec = LlamaFamilyDecoder(model)
    with torch.no_grad():
        logits = [dec.start(ids, mask, new_tokens)]
        for _ in range(new_tokens - 1):
            logits.append(dec.step(logits[-1].argmax(-1)))
    return dec, torch.stack(logits)


def test_fused_decode_projections_give_the_modules_logits(tiny_model, monkeypatch):
    model = load_causal_lm(tiny_model, dtype="float32", attn_implementation="sdpa", field_name="m").eval()
    dec, fused = greedy_decode(model, 3, 9, 6, seed=1)
    assert dec.fused is not None and len(dec.fused) == model.config.num_hidden_layers
    monkeypatch.setattr(decoder_mod, "fused_projections", lambda base, **kw: None)
    dec, plain = greedy_decode(model, 3, 9, 6, seed=1)
    assert dec.fused is None
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


def test_packed_decode_weights_give_the_plain_weights_logits(tiny_model, monkeypatch):
    """bfloat16 decoding on CPU multiplies by weights packed once per generation (``packs_weights``): the same products
    as F.linear on the plain weights, so the same logits and greedy tokens."""
    if not decoder_mod.packs_weights(torch.bfloat16):
        pytest.skip("this CPU has no native bfloat16 matmul (oneDNN): weights are not packed")
    model = load_causal_lm(tiny_model, dtype="bfloat16", attn_implementation="sdpa", field_name="m").eval()
    dec, packed = greedy_decode(model, 4, 7, 8, seed=2)
    assert dec.fused is not None and all(f.packed for f in dec.fused) and dec.head[2]
    monkeypatch.setattr(decoder_mod, "packs_weights", lambda dtype: False)
    dec, plain = greedy_decode(model, 4, 7, 8, seed=2)
    assert not dec.fused[0].packed and not dec.head[2]
    torch.testing.assert_close(packed, plain, rtol=1e-2, atol=1e-2)  # bfloat16 logits
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))


def test_bfloat16_decode_attends_with_sdpa_over_the_filled_slots(tiny_model, monkeypatch):
    """bfloat16 decoding on CPU attends with SDPA over the cache slots filled so far (``sdpa_decodes``), float32 with
    ``decode_attention`` over the whole cache: the same attention, so the same logits to bfloat16's precision and the
    same greedy tokens (one row left-padded, so the prompt mask is exercised)."""
    model = load_causal_lm(tiny_model, dtype="bfloat16", attn_implementation="sdpa", field_name="m").eval()
    dec, sdpa = greedy_decode(model, 4, 7, 8, seed=3)
    assert dec.sdpa_decode and not dec.whole_cache
    monkeypatch.setattr(decoder_mod, "sdpa_decodes", lambda device, dtype: False)
    dec, matmuls = greedy_decode(model, 4, 7, 8, seed=3)
    assert not dec.sdpa_decode and dec.whole_cache
    torch.testing.assert_close(sdpa, matmuls, rtol=2e-2, atol=2e-2)
    assert torch.equal(sdpa.argmax(-1), matmuls.argmax(-1))
    fp32 = load_causal_lm(tiny_model, dtype="float32", attn_implementation="sdpa", field_name="m").eval()
    assert not greedy_decode(fp32, 2, 5, 2, seed=3)[0].sdpa_decode
