"""Tensor parallel + FSDP2 (``mesh.actor_tp``): 4 ranks as 2 dp x 2 tp against 1 rank (``tests/dist/tp_check.py``).

The same global batch of 8 rows (each of the 4 ranks holds 2, as the trainer dispatches them): equal log-probs,
entropy and critic values; one PPO update with equal global loss, gradient norm, gradients and weights after the
AdamW step (float32, 1e-5); TP really applied (2-D placements); the 2-D actor's weight stream equals its full state
dict on every rank; a DCP checkpoint of the 2-D engine loads back exactly (checked inside the script). Bad
``mesh.actor_tp`` values give errors naming the field.
"""

import dataclasses

import pytest
import torch

from conftest import dist_script, torchrun
from rlspmd.config import ActorConfig, Config, MegatronConfig, MeshConfig, ModelConfig
from rlspmd.distributed.mesh import ParallelDims
from rlspmd.validate import config_problems

ATOL = 1e-5


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    torchrun([dist_script("tp_check.py"), "parallel", str(out), str(tiny_model)], 4)
    torchrun([dist_script("tp_check.py"), "single", str(out), str(tiny_model)], 1)  # also loads parallel's checkpoint
    load = lambda name: torch.load(out / name, weights_only=False)  # noqa: E731
    return load("single_rank0.pt"), load("parallel_rank0.pt"), load("parallel_rank3.pt")


def test_two_d_layout_is_tensor_and_data_parallel(runs):
    _, tp, tp3 = runs
    assert tp["groups"] == {"tp": [0, 1], "dp": [0, 2]}  # consecutive ranks form a TP group
    assert tp3["groups"] == {"tp": [2, 3], "dp": [1, 3]}
    placements = tp["placements"]
    # column-wise: FSDP's strided shard over dp of TP's row shard; row-wise: dp on rows, tp on columns
    assert placements["hf.model.layers.0.self_attn.q_proj.weight"] == ["_S(0, 2)", "S(0)"]
    assert placements["hf.model.layers.0.mlp.down_proj.weight"] == ["S(0)", "S(1)"]
    assert placements["hf.model.layers.0.self_attn.o_proj.weight"] == ["S(0)", "S(1)"]
    assert placements["hf.model.embed_tokens.weight"] == ["S(0)"]  # replicated over tp, FSDP over dp
    assert placements["hf.model.norm.weight"] == ["S(0)"]


def test_forward_equals_one_rank(runs):
    one, tp, _ = runs
    for key in ("logprobs", "entropy", "values"):
        assert one[key].abs().sum() > 0
        torch.testing.assert_close(tp[key], one[key], rtol=0, atol=ATOL, msg=lambda m: f"{key}: {m}")
    # the same with the model loaded whole and then distributed (model.sharded_load=False)
    torch.testing.assert_close(tp["logprobs_whole_load"], one["logprobs"], rtol=0, atol=ATOL)


def test_update_equals_one_rank(runs):
    one, tp, _ = runs
    assert tp["loss"] == pytest.approx(one["loss"], rel=ATOL)
    assert tp["grad_norm"] == pytest.approx(one["grad_norm"], rel=ATOL)
    assert tp["grad_norm"] > 0.5  # clipping (grad_clip 0.5) was active, so the clip scale is compared too
    assert tp["names"] == one["names"]
    for name in one["names"]:
        g1, g = one["grads"][name], tp["grads"][name]
        assert g.shape == g1.shape
        torch.testing.assert_close(g, g1, rtol=0, atol=ATOL, msg=lambda m: f"gradient of {name}: {m}")
        # relative to the tensor's own gradient too (many are ~1e-4 here): no TP shard counted twice or dropped
        assert float((g - g1).norm()) <= ATOL * float(g1.norm()), name
        torch.testing.assert_close(
            tp["params"][name], one["params"][name], rtol=0, atol=ATOL, msg=lambda m: f"{name} after the step: {m}"
        )


def test_weight_stream_of_the_2d_actor_is_the_full_state_dict(runs):
    _, tp, tp3 = runs
    full = tp["hf_state_dict"]
    stream = dict(tp["stream"])
    assert len(stream) == len(tp["stream"])  # every name once
    assert set(full) - set(stream) == {"lm_head.weight"}  # the tied head is streamed once, as the embedding
    torch.testing.assert_close(full["lm_head.weight"], full["model.embed_tokens.weight"], rtol=0, atol=0)
    for name, t in stream.items():
        torch.testing.assert_close(t, full[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    for name, t in tp3["stream"]:  # another TP group's second rank gets the same full tensors
        torch.testing.assert_close(t, stream[name], rtol=0, atol=0, msg=lambda m: f"rank 3 {name}: {m}")
    assert tp["stream_stats"]["gathered_bytes"] > 0


def test_dcp_round_trip_on_the_2d_mesh(runs):
    _, tp, _ = runs
    assert (
        tp["dcp_ok"] == len(tp["names"]) + 1
    )  # every model entry (the tied head too) and the AdamW state reloaded exactly


def test_2d_checkpoint_loads_at_tp_1(runs):
    one, tp, _ = runs
    assert sorted(one["resharded"]) == sorted(tp["params"])
    for name, w in tp["params"].items():  # the 2-D engine's weights after its step, bit for bit
        torch.testing.assert_close(one["resharded"][name], w, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_bad_actor_tp_names_the_field(tiny_model):
    with pytest.raises(ValueError, match=r"mesh.actor_tp=3 must be a positive divisor of the actor's 4 ranks"):
        ParallelDims.from_config(MeshConfig(actor_tp=3), 4)
    with pytest.raises(ValueError, match=r"mesh.actor_tp=0"):
        ParallelDims.from_config(MeshConfig(actor_tp=0), 4)
    cfg = Config()
    cfg = dataclasses.replace(
        cfg, mesh=MeshConfig(actor_tp=4), actor=dataclasses.replace(cfg.actor, model=ModelConfig(path=str(tiny_model)))
    )
    lines = config_problems(cfg, world_size=4)
    assert any(
        line.startswith("mesh.actor_tp=4: must divide the model's 4 attention heads and 2 KV heads") for line in lines
    ), lines
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(actor_tp=2), actor=ActorConfig(engine=MegatronConfig()))
    lines = config_problems(cfg, world_size=4, check_files=False)
    assert any(line.startswith("mesh.actor_tp=2: is the fsdp engine's tensor parallelism") for line in lines), lines


def test_engine_refuses_heads_that_do_not_split(tiny_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlspmd.engines.fsdp import check_tp

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tiny_model)))
    check_tp(model, 2)
    with pytest.raises(ValueError, match=r"mesh.actor_tp=4 must divide the model's 4 attention heads and 2 KV heads"):
        check_tp(model, 4)
