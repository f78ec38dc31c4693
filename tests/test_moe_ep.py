"""Expert parallel (``mesh.actor_ep``): 2 CPU ranks with the experts split between them equal FSDP2 alone on the same
ranks and data (``tests/dist/moe_ep_check.py``): log-probs, 3 PPO updates with the load-balancing loss (losses and
gradient norms per step, weights after), within 1e-5; the experts really sharded; the weight stream, the HF state
dict and DCP checkpoints (back into EP, and resharded into FSDP-only) cover them. Bad ``mesh.actor_ep`` settings
are refused with the field named."""

import dataclasses

import pytest
import torch

from conftest import dist_script, torchrun
from rlspmd.config import (
    ActorConfig,
    Config,
    MegatronConfig,
    MeshConfig,
    ModelConfig,
    MoEConfig,
    RolloutConfig,
    VllmConfig,
)
from rlspmd.distributed.mesh import ParallelDims
from rlspmd.validate import config_problems

pytestmark = pytest.mark.moe
ATOL = 1e-5
GATE_UP = "hf.model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def runs(tiny_moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    torchrun([dist_script("moe_ep_check.py"), str(out), str(tiny_moe)], 2)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.dist
def test_expert_parallel_equals_fsdp_alone(runs):
    ep, one = runs[0][2], runs[0][1]
    # the experts are split: 4 of the 8 per rank over ep, FSDP2 over the (here single-rank) edp dim on their rows
    assert ep["placements"][GATE_UP] == ["S(1)", "S(0)"] and ep["local_shapes"][GATE_UP] == (4, 384, 128)
    assert one["placements"][GATE_UP] == ["S(0)"]
    for key in ("logprobs", "entropy"):
        assert one[key].abs().sum() > 0
        torch.testing.assert_close(ep[key], one[key], rtol=0, atol=ATOL, msg=lambda m: f"{key}: {m}")
    for key in ("loss", "grad_norm"):  # per step, 3 steps
        assert len(one[key]) == 3 and one[key][0] != one[key][1]
        assert ep[key] == pytest.approx(one[key], rel=ATOL, abs=ATOL), key
    assert min(one["grad_norm"]) > 0.5  # clipping (grad_clip 0.5) was active: the clip scale is compared too
    assert ep["names"] == one["names"]
    for name in one["names"]:
        torch.testing.assert_close(ep["params"][name], one["params"][name], rtol=0, atol=ATOL, msg=name)


@pytest.mark.dist
def test_expert_parallel_weights_reach_the_rollout_and_checkpoints(runs):
    for rank in runs:  # every rank's stream holds every full tensor, the experts included
        ep = rank[2]
        hf_names = {k.removeprefix("hf."): k for k in ep["names"]}
        assert ep["stream"].keys() == hf_names.keys()
        for name, t in ep["stream"].items():
            assert torch.equal(t, ep["params"][hf_names[name]]), name
    ep = runs[0][2]
    assert ep["dcp_ok"] > 0  # saved and reloaded into a fresh EP engine bit for bit (checked in the script)
    for name, t in ep["hf_state_dict"].items():
        if f"hf.{name}" in ep["params"]:
            assert torch.equal(t, ep["params"][f"hf.{name}"]), name
    for name, t in runs[0][1]["resharded"].items():  # the EP checkpoint loads into an FSDP-only engine
        assert torch.equal(t, ep["params"][name]), name
    # a frozen (reference) EP engine and the whole-model load path give the same first log-probs
    torch.testing.assert_close(ep["logprobs_frozen"], runs[0][1]["logprobs"], rtol=0, atol=ATOL)
    torch.testing.assert_close(ep["logprobs_whole_load"], runs[0][1]["logprobs"], rtol=0, atol=ATOL)


def test_bad_expert_parallel_settings_are_refused(tiny_moe, tiny_model):
    with pytest.raises(ValueError, match=r"mesh.actor_ep=3 must be a positive divisor of the actor's 4 ranks"):
        ParallelDims.from_config(MeshConfig(actor_ep=3), 4)
    with pytest.raises(ValueError, match=r"mesh.actor_ep=2 and mesh.actor_tp=2: expert and tensor parallelism"):
        ParallelDims.from_config(MeshConfig(actor_ep=2, actor_tp=2), 4)

    def problems(model, world_size=4, **kw):
        mesh = MeshConfig(**{k: v for k, v in kw.items() if k.startswith("actor_")})
        actor = ActorConfig(
            model=ModelConfig(path=str(model)), **{k: v for k, v in kw.items() if k in ("engine", "moe")}
        )
        cfg = dataclasses.replace(Config(), actor=actor, mesh=mesh, rollout=kw.get("rollout", RolloutConfig()))
        lines = config_problems(cfg, world_size=world_size, check_files=True)
        return [line for line in lines if "moe" in line or "_ep" in line]

    assert problems(tiny_moe, actor_ep=2) == []
    assert any("is not a mixture-of-experts model" in p for p in problems(tiny_model, actor_ep=2))
    assert any(
        "no mixture-of-experts layers to replay" in p for p in problems(tiny_model, moe=MoEConfig(router_replay="R2"))
    )
    assert any("must divide the model's 8 experts" in p for p in problems(tiny_moe, world_size=6, actor_ep=3))
    assert any(
        "mesh.actor_ep=2: is the fsdp engine's expert parallelism" in p
        for p in problems(tiny_moe, actor_ep=2, engine=MegatronConfig())
    )
    r3_vllm = problems(tiny_moe, moe=MoEConfig(router_replay="R3"), rollout=RolloutConfig(engine=VllmConfig()))
    assert any("actor.moe.router_replay='R3'" in p and "rollout.engine:vllm does not record it" in p for p in r3_vllm)
    assert any("aux_loss_coef=-1" in p for p in problems(tiny_moe, moe=MoEConfig(aux_loss_coef=-1)))


def test_the_moe_quickstart_configs_pass_the_start_up_checks(tiny_moe, arithmetic_data):
    """``MODEL=moe bash scripts/quickstart.sh``'s configs: expert parallel 2 and R3, and nothing else for the checks to
    refuse on 2 ranks with a tiny Qwen3-MoE (its learning figures are measured by hand: docs/moe.md)."""
    from conftest import ROOT
    from rlspmd.config import SFTConfig, load_config_file

    cfg = load_config_file(ROOT / "configs/quickstart_moe.py")
    assert cfg.mesh.actor_ep == 2 and cfg.actor.moe.router_replay == "R3"
    data = dataclasses.replace(
        cfg.data,
        train_files=[str(arithmetic_data / "train.parquet")],
        val_files=[str(arithmetic_data / "test.parquet")],
    )
    actor = dataclasses.replace(cfg.actor, model=ModelConfig(path=str(tiny_moe)))
    assert config_problems(dataclasses.replace(cfg, actor=actor, data=data), world_size=2) == []
    sft = load_config_file(ROOT / "configs/sft_quickstart_moe.py", SFTConfig)
    assert sft.model.path == "models/tiny-moe" and sft.output_dir == "outputs/quickstart-moe-sft"
