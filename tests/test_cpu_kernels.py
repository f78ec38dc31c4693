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
    ops = cpu_kernels.cpu_ops()
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


def greedy(model, *, cpu_kernels: bool, kernel_attention=False, rows=6, prompt=7, new_tokens=10, keep_at=6):
    """Logits of a greedy generation from random prompts (the first two rows share a prompt, one row is left-padded;
    after ``keep_at`` tokens the last row is dropped, as a finished row is). ``kernel_attention``: with the kernels,
    the decode steps attend with their ``decode_attention`` (else SDPA, as the torch ops do)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (rows, prompt), generator=g)
    ids[1] = ids[0]
    mask = torch.ones_like(ids)
    mask[rows // 2, : prompt // 2] = 0
    dec = LlamaFamilyDecoder(model, cpu_kernels=cpu_kernels)
    dec.kernel_attention = kernel_attention
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


def test_decode_attention_is_float64_attention_rounded_once(ops):
    """The decode step's attention kernel against SDPA in float64 on the same bfloat16 inputs (a masked prompt slot,
    grouped-query and plain heads, a partly filled cache): within one bfloat16 rounding, and no worse than SDPA's own
    bfloat16 result."""
    g = torch.Generator().manual_seed(5)
    for B, H, KV, D, L, M in ((6, 9, 3, 64, 40, 33), (3, 4, 4, 32, 9, 1), (17, 8, 2, 128, 20, 20)):
        q, k, v = (bf16(*shape, gen=g, scale=2.0) for shape in ((B, H, 1, D), (B, KV, L, D), (B, KV, L, D)))
        mask = torch.zeros(B, M, dtype=torch.bfloat16)
        mask[0, : M // 2] = float("-inf")  # a left-padded prompt; the token's own slot (M - 1) stays open
        out = ops.decode_attention(q, k, v, mask)

        def attend(q, k, v):
            o = F.scaled_dot_product_attention(
                q, k[:, :, :M], v[:, :, :M], attn_mask=mask[:, None, None].to(q.dtype), enable_gqa=H != KV
            )
            return o.transpose(1, 2).reshape(B, 1, H * D)

        want = attend(*(t.double() for t in (q, k, v)))
        err = (out.double() - want).abs()
        assert out.dtype == torch.bfloat16 and out.shape == (B, 1, H * D)
        bound = want.abs() * 2**-8 * 1.01 + 1e-5  # half an ulp of bfloat16, at most one when float32 sits on a tie
        assert bool((err <= bound).all()), (B, H, KV, D, (err - bound).max())
        assert err.max() <= (attend(q, k, v).double() - want).abs().max()


def test_decoding_with_the_kernel_attention_gives_the_torch_ops_logits_to_bfloat16_precision(ops, tiny_model):
    """The whole fused step with the kernels' attention against the torch ops: the same logits to bfloat16's
    precision at every step (the probabilities stay float32 instead of rounding to bfloat16 inside SDPA)."""
    model = load_causal_lm(tiny_model, dtype="bfloat16", attn_implementation="sdpa", field_name="m").eval()
    dec, fused = greedy(model, cpu_kernels=True, kernel_attention=True)
    _, plain = greedy(model, cpu_kernels=False)
    assert dec.kernels is not None and len(fused) == len(plain)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0.05 * b.float().abs().max().item())
    assert not all(torch.equal(a, b) for a, b in zip(fused, plain))  # the kernel attention ran (other roundings)


def test_a_failed_build_warns_and_the_callers_run_torch_ops(tmp_path, monkeypatch):
    broken = tmp_path / "cpu_kernels.cpp"
    broken.write_text('#error "a build that fails"\n')
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.warns(UserWarning, match="could not be built, so decoding and training attention run torch ops"):
        assert cpu_kernels.cpu_ops.__wrapped__() is None


def _float64_reference(q, k, v, lengths, groups, scale, grad_out):
    """``prefix_loop_attention`` (shared prompts) or ``sdpa_loop_attention`` in float64 on the same (rounded) inputs:
    the output and the gradients of ``(out * grad_out).sum()``."""
    from rlspmd.models.packing import prefix_loop_attention, sdpa_loop_attention

    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    if groups is None:
        out = sdpa_loop_attention(q, k, v, lengths, scale=scale)
    else:
        out = prefix_loop_attention(q, k, v, groups, scale=scale)
    out.backward(grad_out.double())
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "groups"),
    [
        # GRPO-shaped groups of uneven prompts and responses: a group without a prompt, one-token responses, a response
        # longer than the 64-row blocks of the kernel (with 3 heads per KV head: 75 * 3 rows)
        (9, 3, 64, [(48, 64, 60, 1, 64), (0, 30), (27, 75, 5), (5, 1)]),
        (4, 4, 48, [(7, 12, 3), (1, 1, 1, 1)]),  # no grouped heads; head_dim 48: a one-vector tail in the products
        (6, 2, 32, None),  # plain samples (no shared prompts)
    ],
)
def test_segment_attention_is_float64_attention_rounded_once(dtype, heads, kv_heads, head_dim, groups):
    """``segment_attention`` (the ``cpu_fused`` kernel) against the per-segment SDPA loop in float64 on the same
    inputs: forward and gradients to float32's precision in float32, and within bfloat16's rounding of the float64
    result in bfloat16 (it computes in float32 and rounds once, where torch's bfloat16 path rounds at every op)."""
    from rlspmd.models.packing import segment_attention

    lengths = [101, 1, 37, 64] if groups is None else [sum(grp) for grp in groups]
    T = sum(lengths)
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(T, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    grad_out = torch.randn(T, heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    ref = _float64_reference(q, k, v, lengths, groups, scale, grad_out)

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = segment_attention(qg, kg, vg, lengths, groups, scale=scale)
    out.backward(grad_out)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, qg.grad, kg.grad, vg.grad), ref):
        assert got.dtype == dtype and got.shape == want.shape, name
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        else:  # one bfloat16 rounding (half an ulp, 2**-9 relative) plus float32's error
            err = (got.double() - want).abs()
            bound = want.abs() * 2**-8 + 1e-3 * want.abs().max()
            assert bool((err <= bound).all()), f"{name}: worst excess {(err - bound).max().item()}"


def test_segment_attention_names_what_it_cannot_take(ops):
    q, k = torch.zeros(4, 2, 64), torch.zeros(4, 1, 64)
    segs, groups = torch.tensor([[0, 4, 0, 0]]), torch.tensor([[0, 1, 0, 4]])
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        ops.segment_attention(q.half(), k.half(), k.half(), segs, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of"):
        ops.segment_attention(*(t[..., :8].contiguous() for t in (q, k, k)), segs, 0.125)
    with pytest.raises(RuntimeError, match="segs must be contiguous int64"):
        ops.segment_attention(q, k, k, segs.int(), 0.125)
    with pytest.raises(RuntimeError, match=r"segment 0 \(2, 4, 0, 0\) lies outside the 4 tokens"):
        ops.segment_attention(q, k, k, torch.tensor([[2, 4, 0, 0]]), 0.125)
    out, lse = ops.segment_attention(q, k, k, segs, 0.125)
    with pytest.raises(RuntimeError, match="groups must be contiguous int64"):
        ops.segment_attention_backward(out, q, k, k, lse, segs, groups.int(), 0.125)


ISA_CHECK = """
import sys, torch, torch.nn.functional as F
from rlspmd.models import cpu_kernels
cpu_kernels.CFLAGS = ["-O3", sys.argv[1], "-ffp-contract=off", "-fopenmp"]
ops = cpu_kernels.cpu_ops()
assert ops is not None, "the build failed"
from rlspmd.models.packing import prefix_loop_attention, segment_attention
from rlspmd.models.logprobs import chunked_logprobs, logprobs_from_logits
g = torch.Generator().manual_seed(0)
groups = [(5, 9, 1, 7), (0, 3)]
T = sum(map(sum, groups))
q, k, v = (torch.randn(T, h, 32, generator=g).requires_grad_() for h in (4, 2, 2))
out = segment_attention(q, k, v, [sum(x) for x in groups], groups, scale=0.2)
out.square().sum().backward()
grads = [t.grad.clone() for t in (q, k, v)]
for t in (q, k, v):
    t.grad = None
ref = prefix_loop_attention(q, k, v, groups, scale=0.2)
ref.square().sum().backward()
torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
for a, t in zip(grads, (q, k, v)):
    torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-5)
h, W, y = torch.randn(6, 8, generator=g), torch.randn(37, 8, generator=g), torch.randint(0, 37, (6,), generator=g)
for a, b in zip(chunked_logprobs(h, W, y), logprobs_from_logits(h @ W.T, y)):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
qd, kc, vc = (torch.randn(*s, generator=g).bfloat16() for s in ((3, 4, 1, 32), (3, 2, 6, 32), (3, 2, 6, 32)))
mask = torch.zeros(3, 5, dtype=torch.bfloat16)
want = F.scaled_dot_product_attention(qd.float(), kc[:, :, :5].float(), vc[:, :, :5].float(), enable_gqa=True)
got = ops.decode_attention(qd, kc, vc, mask).float().view(3, 1, 4, 32).transpose(1, 2)
torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("march", ["-march=haswell", "-march=x86-64"])  # the AVX2 branch, and the scalar one
def test_every_isa_branch_builds_and_computes(march, tmp_path):
    """The kernels' AVX2 and scalar branches (this machine builds AVX-512 with ``-march=native``): each builds and
    computes the training attention, the log-probs and the decode attention as the torch references do."""
    import os
    import platform
    import subprocess
    import sys

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"{march} is an x86 target; this machine is {platform.machine()}")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    run = subprocess.run(
        [sys.executable, "-c", ISA_CHECK, march], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
