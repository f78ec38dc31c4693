"""The pieces both training engines share: the optimiser component (``rlspmd/engines/optim.py``), the compute dtype
(``engines.base.compute_dtype``) and the model-parallel groups ``rlspmd.distributed.mesh`` makes for megatron.

The clipping factor is checked against ``torch.nn.utils.clip_grad_norm_`` bit for bit (the FSDP engine clips with it
on a 1-D mesh, with ``clip_coef`` on a 2-D one, the megatron engine with ``clip_coef`` on a float norm)."""

import math

import pytest
import torch
from torch import nn

from rlspmd.config import OptimConfig
from rlspmd.distributed.mesh import grid_coords, model_parallel_groups
from rlspmd.engines.base import compute_dtype
from rlspmd.engines.optim import Optimizer


def params_with_grads(scale: float) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3, generator=g)), nn.Parameter(torch.randn(7, generator=g))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


@pytest.mark.parametrize("scale", [0.01, 10.0])
@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_clip_coef_is_clip_grad_norm_s_factor(scale, grad_clip):
    """Tensor norm (FSDP, 2-D) and float norm (megatron) give clip_grad_norm_'s gradients exactly."""
    want = params_with_grads(scale)
    opt = Optimizer(want, OptimConfig(grad_clip=grad_clip), total_steps=1)
    norm = torch.nn.utils.clip_grad_norm_(want, opt.max_norm)
    as_tensor = params_with_grads(scale)
    coef = opt.clip_coef(torch.nn.utils.get_total_norm([p.grad for p in as_tensor]))
    assert isinstance(coef, torch.Tensor)
    for p in as_tensor:
        p.grad.mul_(coef)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(want, as_tensor))
    as_float = opt.clip_coef(float(norm))
    assert isinstance(as_float, float) and as_float == min(opt.max_norm / (float(norm) + 1e-6), 1.0)
    if grad_clip <= 0:
        assert opt.max_norm == math.inf and float(coef) == as_float == 1.0
    else:
        assert (as_float < 1.0) == (scale == 10.0)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # the skipped first step
def test_a_skipped_step_leaves_the_weights_and_moves_the_schedule():
    params = params_with_grads(1.0)
    before = [p.detach().clone() for p in params]
    opt = Optimizer(params, OptimConfig(lr=1e-2, warmup_steps=2), total_steps=4)
    assert opt.lr == pytest.approx(0.5e-2)  # warmup: (step + 1) / warmup_steps
    opt.step(torch.tensor(1.0))
    assert all(p.grad is None for p in params) and all(torch.equal(p, b) for p, b in zip(params, before))
    assert opt.lr == pytest.approx(1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step(False)
    assert not any(torch.equal(p, b) for p, b in zip(params, before))
    assert [float(opt.optimizer.state[p]["step"]) for p in params] == [1.0, 1.0]


def test_init_state_is_what_a_first_step_creates():
    params = params_with_grads(1.0)
    opt = Optimizer(params, OptimConfig(), total_steps=1)
    opt.init_state()
    for p in params:
        st = opt.optimizer.state[p]
        assert float(st["step"]) == 0 and not st["exp_avg"].any() and st["exp_avg_sq"].shape == p.shape


def test_compute_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compute_dtype("auto", cpu) == torch.float32 and compute_dtype("auto", cuda) == torch.bfloat16
    assert compute_dtype("bfloat16", cpu) == torch.bfloat16 and compute_dtype("float32", cuda) == torch.float32


def test_grid_coords_run_tp_fastest():
    assert [grid_coords(i, tp=2, dp=2) for i in range(8)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]


def test_model_parallel_groups_of_one_rank(mesh_of_one):
    g = model_parallel_groups(mesh_of_one, tp=1, pp=1, field_prefix="critic.engine", pipeline_ends=True)
    assert (g.tp, g.pp, g.dp, g.tp_rank, g.pp_rank, g.dp_rank) == (1, 1, 1, 0, 0, 0)
    assert g.first_stage and g.last_stage and g.pp_ranks == [0]
    assert g.embd_group is None and g.tp_mesh is None  # no second stage to tie with; no TP DTensors
    assert model_parallel_groups(mesh_of_one, tp=1, pp=1, field_prefix="actor.engine").tp_group is g.tp_group  # cached
    with pytest.raises(ValueError, match=r"critic.engine.tp=2 x critic.engine.pp=1 does not divide the role's 1 ranks"):
        model_parallel_groups(mesh_of_one, tp=2, pp=1, field_prefix="critic.engine")
