"""Router replay (``actor.moe.router_replay``, ``rlspmd/roles/moe.py``): which routing each pass replays, the
load-balancing term's weighting and the routing metrics, on the trainer's module; end to end on 2 ranks, with a
bfloat16 rollout against a float32 trainer (routing differs on some tokens): R3 makes the trainer route every token as
the rollout did and lowers the logged mismatch KL (k3) against the same run without replay; R2 replays the
old-log-prob pass in the update."""

import json

import pytest
import torch

from conftest import torchrun
from rlspmd.algorithms import AggArgs
from rlspmd.config import MoEConfig
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.roles.moe import OLD_ROUTING, ROLLOUT_ROUTING, MoEActor, NoMoE
from test_moe import rollout_layout, trainer_module

pytestmark = pytest.mark.moe


def actor(mode: str, **kw) -> MoEActor:
    args = dict(model_aux_loss_coef=0.001, num_experts=8, rollout_routing=True, metrics_in_update=False, mesh=None)
    return MoEActor(MoEConfig(router_replay=mode, aux_loss_coef=kw.pop("coef", None)), **{**args, **kw})


def sample_batch(module):
    """A batch in the rollout layout whose ``rollout_routing_BL`` differs from the trainer's own on one token in 4."""
    ids, mask, pos, R = rollout_layout(seed=4)
    with torch.no_grad():
        module(ids, mask, pos, response_len=R)
    own, _ = module.moe.routed_BL()
    rollout = own.clone()
    rollout[:, ::4] = (rollout[:, ::4] + 3) % 8
    return Batch(
        {
            "input_ids_BL": ids,
            "attention_mask_BL": mask,
            "position_ids_BL": pos,
            "responses_BR": ids[:, -R:],
            "loss_mask_BR": mask[:, -R:],
            ROLLOUT_ROUTING: rollout,
        }
    ), own


def test_replay_keys_per_mode():
    batch = Batch({ROLLOUT_ROUTING: torch.zeros(2, 3), OLD_ROUTING: torch.ones(2, 3)})
    assert actor("off").replay(batch, update=False) == {} == actor("off").replay(batch, update=True)
    assert actor("R2").replay(batch, update=False) == {}
    assert actor("R2").replay(batch, update=True)["replay_BL"] is batch[OLD_ROUTING]
    for update in (False, True):
        assert actor("R3").replay(batch, update=update)["replay_BL"] is batch[ROLLOUT_ROUTING]
    assert NoMoE().replay(batch, update=True) == {}
    with pytest.raises(AssertionError, match="R3 needs the rollout's routing"):
        actor("R3", rollout_routing=False)


@pytest.mark.parametrize("mode", ["off", "R2", "R3"])
def test_log_prob_pass_metrics_and_what_r2_keeps(tiny_moe, mode):
    module = trainer_module(tiny_moe, packing=True)
    batch, own = sample_batch(module)
    moe, metrics = actor(mode), MetricBuffer()
    with torch.no_grad():
        module(
            *(batch[k] for k in ("input_ids_BL", "attention_mask_BL", "position_ids_BL")),
            response_len=6,
            **moe.replay(batch, update=False),
        )
    routed = list(module.moe.routed_BL())
    batch = moe.routed(batch, routed, metrics)
    moe.flush(metrics)
    m = metrics.reduce(mesh=None)
    valid = batch["attention_mask_BL"].bool()
    changed = torch.zeros_like(valid)
    changed[:, ::4] = True
    expected_router = 1 - (changed & valid).sum() / valid.sum()  # the router's own choice misses the changed tokens
    if mode == "R3":  # routed as the rollout; the router's own choices then see other hidden states past layer 0
        assert m["moe/routing_agreement"] == 1.0 and m["moe/router_agreement"] < 1.0
    else:
        assert m["moe/router_agreement"] == m["moe/routing_agreement"] == pytest.approx(float(expected_router))
    assert m["moe/expert_load"] >= m["moe/expert_load_mean"] >= 1.0
    if mode == "R2":  # the update will replay what this pass routed
        assert torch.equal(batch[OLD_ROUTING], own)
    else:
        assert OLD_ROUTING not in batch


def test_aux_loss_term_is_the_token_share_of_the_coefficient_times_the_loss(tiny_moe):
    module = trainer_module(tiny_moe, packing=True)
    batch, _ = sample_batch(module)
    n_tok = float(batch["loss_mask_BR"].sum())
    agg = AggArgs(mode="token-mean", global_tokens=4 * n_tok, global_seqs=12)
    moe, metrics = actor("off", coef=0.5), MetricBuffer()
    module(*(batch[k] for k in ("input_ids_BL", "attention_mask_BL", "position_ids_BL")), response_len=6)
    term = moe.loss_term(module, batch, agg, metrics)
    aux = module.moe.aux_loss()
    assert term.item() == pytest.approx(0.5 * aux.item() / 4)  # a quarter of the mini-batch's tokens
    assert term.requires_grad  # the router learns from it
    assert metrics.reduce(mesh=None)["actor/moe_aux_loss"] == pytest.approx(aux.item())
    assert actor("off", model_aux_loss_coef=0.02).coef == 0.02  # None: the model's router_aux_loss_coef


def run_replay(tiny_moe, arithmetic_data, tmp_path, mode: str) -> list[dict]:
    from rl_run import rl_args, write_reward

    out = tmp_path / mode
    extra = ["--rollout.dtype", "bfloat16", "--actor.moe.router-replay", mode, "--trainer.val-every", "0"]
    torchrun(rl_args(tiny_moe, arithmetic_data, out, steps=1, reward=write_reward(tmp_path), extra=extra), 2)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.dist
def test_r3_routes_as_the_rollout_and_lowers_the_mismatch(tiny_moe, arithmetic_data, tmp_path):
    off, r3, r2 = (run_replay(tiny_moe, arithmetic_data, tmp_path, mode)[-1] for mode in ("off", "R3", "R2"))
    # step 1: the same samples (same seed, same bf16 rollout weights): the same free routing without replay in the
    # old-log-prob pass (R3's router sees the replayed layers' outputs, so its own choices differ a little)
    assert off["moe/router_agreement"] == r2["moe/router_agreement"] < 1.0
    assert off["moe/routing_agreement"] == off["moe/router_agreement"]
    assert r3["moe/routing_agreement"] == 1.0  # every token of every layer routed as the rollout routed it
    # k3, the non-negative estimator (k1's sign and size at this scale are sampling noise: docs/moe.md has both on the
    # warm-started model)
    assert r3["rollout_corr/mismatch/kl_k3"] < off["rollout_corr/mismatch/kl_k3"]
    assert r2["moe/routing_agreement"] == off["moe/routing_agreement"]  # R2 replays only inside the update
    for m in (off, r3, r2):
        assert m["actor/moe_aux_loss"] > 0 and m["moe/expert_load"] >= 1.0
