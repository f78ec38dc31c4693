"""The FSDP2 engine's optimiser: fused AdamW (what CUDA gets) takes the same steps as torch's default AdamW, and a
non-finite gradient norm skips the update inside the fused kernel (no host read) exactly as the default path skips
it. Run on CPU, where torch also has the fused kernel, in a Gloo world of one (FSDP2 DTensor shards, as on GPUs)."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.config import FSDPConfig, OptimConfig
from rlspmd.engines.fsdp import FSDPEngine
from rlspmd.models.loader import load_causal_lm
from rlspmd.models.packing import training_attn_implementation
from rlspmd.models.policy import CausalLMPolicy


@pytest.fixture(scope="module")
def mesh():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DeviceMesh("cpu", torch.tensor([0]), mesh_dim_names=("dp",))
    dist.destroy_process_group()


def engine(path, mesh, *, fused: bool, fsdp: FSDPConfig | None = None) -> FSDPEngine:
    attn = training_attn_implementation("sdpa", packing=True, field_name="attn")
    module = CausalLMPolicy(
        load_causal_lm(path, dtype="float32", attn_implementation=attn, field_name="m"), packing=True
    )
    return FSDPEngine(
        module,
        module.hf,
        mesh=mesh,
        device=torch.device("cpu"),
        fsdp=fsdp or FSDPConfig(),
        optim=OptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0),
        total_optim_steps=10,
        fused_optimizer=fused,
    )


def batch(vocab):
    g = torch.Generator().manual_seed(0)
    am = torch.ones(3, 12, dtype=torch.long)
    am[0, :2] = 0
    am[2, -3:] = 0
    return torch.randint(3, vocab, (3, 12), generator=g) * am, am, (am.cumsum(-1) - 1).clamp(min=0)


def loss_fn(scale):
    def fn(module, mb):
        ids, am, pos = mb
        lp, _ = module(ids, am, pos, response_len=6)
        return scale * (lp * am[:, -6:]).sum() / 20

    return fn


def full_params(e: FSDPEngine) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in e.module.named_parameters()}


def test_fused_adamw_steps_like_the_default_and_skips_non_finite_updates_on_device(tiny_model, mesh):
    plain, fused = engine(tiny_model, mesh, fused=False), engine(tiny_model, mesh, fused=True)
    assert fused.fused_optimizer and not plain.fused_optimizer
    mb = batch(plain.module.config.vocab_size)
    initial = full_params(plain)
    for _ in range(2):
        a, b = plain.optimizer_step([mb], loss_fn(1.0)), fused.optimizer_step([mb], loss_fn(1.0))
        assert float(a["skipped"]) == float(b["skipped"]) == 0.0
        torch.testing.assert_close(b["grad_norm"], a["grad_norm"], rtol=1e-5, atol=1e-7)
    pa, pb = full_params(plain), full_params(fused)
    for name in pa:  # two steps of lr 1e-3: agree to 1% of one step (the kernels round differently)
        torch.testing.assert_close(pb[name], pa[name], rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert all(not torch.equal(pa[name], initial[name]) for name in pa)  # every parameter moved
    start = {name: p.clone() for name, p in pb.items()}
    steps = [float(s["step"]) for s in fused.optimizer.state.values()]
    moments = [s["exp_avg"].full_tensor().clone() for s in fused.optimizer.state.values()]
    stats = fused.optimizer_step([mb], loss_fn(float("nan")))  # a NaN loss: non-finite gradient norm
    assert float(stats["skipped"]) == 1.0 and not torch.isfinite(stats["grad_norm"])
    after = full_params(fused)
    for name in start:  # parameters, moments and step counts untouched, decided by the kernel
        assert torch.equal(after[name], start[name]), name
    assert [float(s["step"]) for s in fused.optimizer.state.values()] == steps
    for m, s in zip(moments, fused.optimizer.state.values()):
        assert torch.equal(s["exp_avg"].full_tensor(), m)
    assert plain.optimizer_step([mb], loss_fn(float("nan")))["skipped"] == 1.0  # the host-checked path agrees
    assert plain.optimizer_step([mb], loss_fn(1.0))["skipped"] == 0.0


def test_gather_once_per_update_accumulates_the_same_gradients(tiny_model, mesh):
    def build(once: bool) -> FSDPEngine:
        return engine(
            tiny_model, mesh, fused=False, fsdp=FSDPConfig(param_dtype="float32", gather_once_per_update=once)
        )

    plain, once = build(False), build(True)
    mb = batch(plain.module.config.vocab_size)
    for _ in range(2):  # three micro-batches per update: two kept gathered, the last reduces and reshards
        a = plain.optimizer_step([mb, mb, mb], loss_fn(1 / 3))
        b = once.optimizer_step([mb, mb, mb], loss_fn(1 / 3))
        torch.testing.assert_close(b["grad_norm"], a["grad_norm"], rtol=1e-6, atol=0)
    pa, pb = full_params(plain), full_params(once)
    for name in pa:
        torch.testing.assert_close(pb[name], pa[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    # afterwards the parameters are sharded again, as after any update (a rollout gathers them itself)
    assert all(isinstance(p.data, torch.distributed.tensor.DTensor) for p in once.module.parameters())


def test_one_rank_cpu_keeps_gathered_parameters_through_backward_with_the_same_steps(tiny_model, mesh):
    """``reshard_after_forward=None`` (the default) on a one-rank CPU mesh: within an update each layer keeps its
    compute-dtype copy from forward to backward instead of casting it again, with the same gradients and steps as
    resharding (bit for bit, one machine); forwards outside an update still reshard, and after the update the
    parameters are the sharded ones again. Explicit settings are kept."""
    from torch.distributed.tensor import DTensor

    def build(raf):
        return engine(tiny_model, mesh, fused=True, fsdp=FSDPConfig(param_dtype="bfloat16", reshard_after_forward=raf))

    kept, resharded = build(None), build(True)
    assert kept.keep_for_backward and not resharded.keep_for_backward and not build(False).keep_for_backward
    mb = batch(kept.module.config.vocab_size)
    gathered = {}

    def watched(e):
        def fn(module, mb_):
            loss = loss_fn(0.5)(module, mb_)
            weight = e.hf_model.model.layers[0].self_attn.q_proj.weight  # after the whole forward
            gathered.setdefault(id(e), []).append(not isinstance(weight, DTensor))
            return loss

        return fn

    for _ in range(2):
        a, b = kept.optimizer_step([mb, mb], watched(kept)), resharded.optimizer_step([mb, mb], watched(resharded))
        assert torch.equal(a["grad_norm"], b["grad_norm"])
    assert gathered[id(kept)] == [True] * 4 and gathered[id(resharded)] == [False] * 4
    pa, pb = full_params(kept), full_params(resharded)
    assert all(torch.equal(pa[name], pb[name]) for name in pa)
    with torch.no_grad():  # outside an update a forward reshards: the parameters stay DTensors
        loss_fn(1.0)(kept.module, mb)
    assert all(isinstance(p, DTensor) for p in kept.hf_model.model.layers[0].parameters())


def test_one_rank_reduces_gradients_in_the_compute_dtype_with_the_same_steps(tiny_model, mesh):
    """On a one-rank mesh FSDP2 reduces the gradients in the compute dtype (``mixed_precision``), not in
    ``reduce_dtype`` (float32): one rank sums nothing, so the gradient norms and the parameters after two updates of
    two micro-batches are bit-identical to a float32 reduction's. ``gather_once_per_update`` (which accumulates in the
    reduce dtype) keeps float32."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    def groups(e):
        return [m._get_fsdp_state()._fsdp_param_group for m in e.module.modules() if isinstance(m, FSDPModule)]

    def build(**kw):
        return engine(tiny_model, mesh, fused=True, fsdp=FSDPConfig(param_dtype="bfloat16", **kw))

    half, full = build(), build()
    once = build(gather_once_per_update=True)
    assert all(g.mp_policy.reduce_dtype == torch.bfloat16 for g in groups(half))
    assert all(g.mp_policy.reduce_dtype == torch.float32 for g in groups(once))
    for g in groups(full):  # what the config says without the one-rank rule (read at the first forward)
        g.mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mb = batch(half.module.config.vocab_size)
    for _ in range(2):
        a, b = half.optimizer_step([mb, mb], loss_fn(0.5)), full.optimizer_step([mb, mb], loss_fn(0.5))
        assert torch.equal(a["grad_norm"], b["grad_norm"])
    assert all(g._reduce_dtype is None for g in groups(half))  # None: no cast, the gradients' own dtype
    assert all(g._reduce_dtype == torch.float32 for g in groups(full))
    pa, pb = full_params(half), full_params(full)
    assert all(torch.equal(pa[name], pb[name]) for name in pa)
    assert all(p.dtype == torch.float32 for p in half.module.parameters())  # master weights stay float32


def test_compiled_norms_train_like_the_eager_ones(tiny_model, mesh):
    """``fsdp.compile_norms`` (None: on for bfloat16 compute on CPU): every RMSNorm of the language model runs compiled
    (the decoder layers' two and the final one) and the update is the eager one's up to bfloat16 rounding: the same
    log-probs before the first step, the same gradient norms and parameters after two."""

    def build(compiled: bool) -> FSDPEngine:
        return engine(tiny_model, mesh, fused=True, fsdp=FSDPConfig(param_dtype="bfloat16", compile_norms=compiled))

    from rlspmd.engines.fsdp.engine import compiles_norms, rms_norms

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compiles_norms(FSDPConfig(param_dtype="bfloat16"), cpu)  # None: on for bfloat16 compute on CPU
    assert not compiles_norms(FSDPConfig(param_dtype="float32"), cpu)
    assert not compiles_norms(FSDPConfig(param_dtype="bfloat16"), cuda)
    assert not compiles_norms(FSDPConfig(param_dtype="bfloat16", compile_norms=False), cpu)
    assert compiles_norms(FSDPConfig(param_dtype="float32", compile_norms=True), cpu)
    eager, compiled = build(False), build(True)
    p0 = full_params(eager)
    norms = rms_norms(compiled.module.hf)
    assert len(norms) == 2 * compiled.module.config.num_hidden_layers + 1
    assert all(m._compiled_call_impl is not None for m in norms)
    assert not any(m._compiled_call_impl is not None for m in eager.module.hf.modules())
    mb = batch(eager.module.config.vocab_size)
    ids, am, pos = mb
    torch._dynamo.reset()  # compiled anew here (an earlier test's bfloat16 engine may have compiled the same norm)
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        lp_e, _ = eager.module(ids, am, pos, response_len=6)
        assert not torch._dynamo.utils.counters["stats"]["unique_graphs"]
        lp_c, _ = compiled.module(ids, am, pos, response_len=6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # compiled, not fallen back to eager
    torch.testing.assert_close(lp_c, lp_e, rtol=0, atol=0.02)
    for _ in range(2):
        a, b = eager.optimizer_step([mb], loss_fn(1.0)), compiled.optimizer_step([mb], loss_fn(1.0))
        torch.testing.assert_close(b["grad_norm"], a["grad_norm"], rtol=1e-3, atol=0)
    # The two updates agree, tensor by tensor, to within 2 % of their size, not element by element: an element whose
    # gradient is near 0 is rounding noise that AdamW's normalised step turns into a move of up to lr (1e-3) either
    # way. Not the key biases at all: their exact gradient is 0 (q . b_k is the same for every key of a query, and
    # softmax ignores it), so their whole update is such noise.
    pe, pc = full_params(eager), full_params(compiled)
    assert any(name.endswith("k_proj.bias") for name in pe)
    worst = 0.0
    for name in (n for n in pe if not n.endswith("k_proj.bias")):
        moved = (pe[name] - p0[name]).norm()
        assert moved > 0, name
        worst = max(worst, float((pc[name] - pe[name]).norm() / moved))
    assert worst < 0.02, worst  # 0.0025 on a Zen 4 EPYC
