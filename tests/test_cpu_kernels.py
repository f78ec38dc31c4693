"""The fused CPU decode kernels (``rlspmd/models/cpu_kernels.py``): each returns the bits of the torch ops it replaces,
and a decoder that uses them generates the logits of one that does not."""

import pytest
import torch
import torch.nn.functional as F

from rlspmd.models import cpu_kernels
from rlspmd.models.decoder import LlamaFamilyDecoder, apply_rope, rms_norm
from rlspmd.models.loader import load_causal_lm
from rlspmd.models.vision_decoder import rollout_decoder


@pytest.fixture(scope="module")
def ops():
    ops = cpu_kernels.decode_ops()
    assert ops is not None, "the fused CPU kernels did not build (g++ and ninja are part of the install)"
    return ops


def bf16(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


@pytest.mark.parametrize("rows", [3, 130])  # 130: more rows than one of the kernel's parallel chunks
def test_add_rms_norm_is_the_residual_add_and_rms_norm(ops, rows):
    g = torch.Generator().manual_seed(rows)
    h, y, w = bf16(rows, 1, 96, gen=g, scale=3.0), bf16(rows, 1, 96, gen=g), bf16(96, gen=g)
    expected_h = h + y
    expected = rms_norm(expected_h, w, 1e-6)
    got = ops.add_rms_norm(h, y, w, 1e-6)  # adds y to h in place
    assert torch.equal(h, expected_h) and torch.equal(got, expected)
    assert torch.equal(ops.add_rms_norm(h, None, w, 1e-6), expected)  # no residual to add: h as it is
    assert torch.equal(h, expected_h)


def test_rope_write_rotates_q_and_k_and_writes_k_and_v_into_the_slot(ops):
    g = torch.Generator().manual_seed(0)
    B, H, KV, D, L, slot = 5, 4, 2, 16, 9, 6
    qkv = bf16(B, 1, (H + 2 * KV) * D, gen=g, scale=2.0)
    angle = torch.rand(B, 1, 1, D // 2, generator=g) * 40
    cos = torch.cat((angle.cos(), angle.cos()), -1).bfloat16()
    sin = torch.cat((-angle.sin(), angle.sin()), -1).bfloat16()  # ``signed_sin``'s layout
    k_caches, v_caches = bf16(2, B, KV, L, D, gen=g), bf16(2, B, KV, L, D, gen=g)
    k_before, v_before = k_caches.clone(), v_caches.clone()

    q = ops.rope_write(qkv, cos, sin, k_caches[1], v_caches[1], slot, H, KV)

    q_ref, k_ref, v_ref = qkv.split((H * D, KV * D, KV * D), -1)
    q_ref = apply_rope(q_ref.view(B, 1, H, D).transpose(1, 2), cos, sin)
    k_ref = apply_rope(k_ref.view(B, 1, KV, D).transpose(1, 2), cos, sin)
    assert q.shape == (B, H, 1, D) and torch.equal(q, q_ref)
    assert torch.equal(k_caches[1][:, :, slot : slot + 1], k_ref)
    assert torch.equal(v_caches[1][:, :, slot : slot + 1], v_ref.view(B, 1, KV, D).transpose(1, 2))
    # nothing else moved: the other slots, and the other layer's cache
    k_before[1][:, :, slot : slot + 1], v_before[1][:, :, slot : slot + 1] = (
        k_ref,
        v_ref.view(B, 1, KV, D).transpose(1, 2),
    )
    assert torch.equal(k_caches, k_before) and torch.equal(v_caches, v_before)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_write(qkv, cos, sin, k_caches[1], v_caches[1], L, H, KV)


def test_silu_mul_is_swiglu_and_bad_inputs_are_named(ops):
    g = torch.Generator().manual_seed(1)
    gu = bf16(7, 1, 96, gen=g, scale=4.0)
    gate, up = gu.chunk(2, -1)
    assert torch.equal(ops.silu_mul(gu), F.silu(gate) * up)
    with pytest.raises(RuntimeError, match="h must be bfloat16"):
        ops.add_rms_norm(gu.float(), None, gu[0, 0].float(), 1e-6)


def greedy(model, *, cpu_kernels: bool, rows=6, prompt=7, new_tokens=10, keep_at=6):
    """Logits of a greedy generation from random prompts (the first two rows share a prompt, one row is left-padded;
    after ``keep_at`` tokens the last row is dropped, as a finished row is)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (rows, prompt), generator=g)
    ids[1] = ids[0]
    mask = torch.ones_like(ids)
    mask[rows // 2, : prompt // 2] = 0
    dec = LlamaFamilyDecoder(model, cpu_kernels=cpu_kernels)
    out = []
    with torch.no_grad():
        logits = dec.start(ids, mask, new_tokens)
        for t in range(new_tokens - 1):
            out.append(logits)
            if t == keep_at:
                dec.keep(torch.arange(rows - 1))
                logits = logits[: rows - 1]
            logits = dec.step(logits.argmax(-1))
    return dec, [*out, logits]


def test_decoding_with_the_kernels_gives_the_torch_ops_logits(ops, tiny_model):
    model = load_causal_lm(tiny_model, dtype="bfloat16", attn_implementation="sdpa", field_name="m").eval()
    dec, fused = greedy(model, cpu_kernels=True)
    assert dec.kernels is not None
    dec, plain = greedy(model, cpu_kernels=False)
    assert dec.kernels is None
    assert all(torch.equal(a, b) for a, b in zip(fused, plain, strict=True))
    assert rollout_decoder(model, cpu_kernels=False).cpu_kernels is False  # the engine's setting reaches the decoder
    # float32 decoding keeps the torch ops (the kernels are bfloat16 only)
    model32 = load_causal_lm(tiny_model, dtype="float32", attn_implementation="sdpa", field_name="m").eval()
    dec, _ = greedy(model32, cpu_kernels=True)
    assert dec.kernels is None


def test_a_failed_build_warns_and_decoding_runs_torch_ops(tmp_path, monkeypatch):
    broken = tmp_path / "cpu_kernels.cpp"
    broken.write_text('#error "a build that fails"\n')
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.warns(UserWarning, match="could not be built, so decoding runs torch ops"):
        assert cpu_kernels.decode_ops.__wrapped__() is None
