"""LoRA RL (``actor.lora``): only the adapters train; the reference is the base model with the adapters off (the same
weights); the LoRA policy's log-probs equal a merged model's; the rollout generates from merged weights (in place and
streamed); checkpoints hold the adapters and resume exactly; export writes a merged HF model and a peft adapter."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, dist_script, torchrun
from rl_run import assert_same_state, checkpoint_tensors, metrics, rl_args, write_reward
from rlspmd.config import LoraConfig
from rlspmd.models.lora import merge_lora, peft_adapter_state


@pytest.mark.dist
def test_lora_policy_reference_and_rollout_on_two_ranks(tiny_model, tmp_path):
    out = tmp_path / "lora.pt"
    torchrun([dist_script("lora_check.py"), str(tiny_model), str(out)], 2)
    r = torch.load(out, weights_only=False)
    adapters = {k for k in r["before"] if ".lora_A." in k or ".lora_B." in k}
    assert len(adapters) == 4 * 7 * 2  # all-linear: q, k, v, o, gate, up, down in each of the 4 layers, A and B
    assert set(r["trainable"]) == adapters  # the optimiser holds the adapters only
    changed = {k for k in r["before"] if not torch.equal(r["before"][k], r["after"][k])}
    assert changed == adapters  # every adapter moved, nothing else did
    for k in r["after"]:  # activation checkpointing recomputes the same forward, CPU offload moves nothing here
        torch.testing.assert_close(r["after_ac"][k], r["after"][k], rtol=0, atol=1e-6)
    mask = torch.zeros_like(r["lora_lp"], dtype=torch.bool)
    for b, n in enumerate([10, 4, 7, 2, 9, 10, 3, 6]):
        mask[b, :n] = True
    # the LoRA forward (adapters applied on the fly, FSDP2, packed) = a plain HF model holding W + s B A
    torch.testing.assert_close(r["lora_lp"][mask], r["merged_lp"][mask], rtol=0, atol=1e-5)
    assert (r["lora_lp"] - r["ref_lp"])[mask].abs().max() > 1e-2  # the adapters changed the policy
    assert torch.equal(r["ref_lp"], r["base_lp"])  # the reference (adapters off) is the base model, bit for bit
    # the model state of a checkpoint and the optimiser state: the adapters only
    assert set(r["state_keys"][0]) == adapters and len(r["state_keys"][1]) == len(adapters)
    # the weight stream hands out the merged weights under plain HF names (vLLM / own copies load them)
    assert r["stream"].keys() == r["merged"].keys() - {"lm_head.weight"}  # tied: streamed once, as the embedding
    assert not any("lora" in k or "base_layer" in k for k in r["stream"])
    for k in r["stream"]:
        assert torch.equal(r["stream"][k], r["merged"][k]), k
    # the colocated engine generates from the merged in-place weights: same tokens and log-probs as a merged copy
    assert torch.equal(r["in_place"][0], r["own"][0])
    torch.testing.assert_close(r["in_place"][1], r["own"][1], rtol=0, atol=1e-5)
    assert (r["in_place"][1] - r["base_gen"][1]).abs().max() > 1e-2  # and not from the base model
    assert r["base_unchanged"]  # the merge touched only the gathered copies


def test_merge_lora_renames_and_merges_a_unit():
    g = torch.Generator().manual_seed(0)
    w, a, b, bias = (
        torch.randn(6, 4, generator=g),
        torch.randn(2, 4, generator=g),
        torch.randn(6, 2, generator=g),
        torch.randn(6, generator=g),
    )
    unit = [
        ("l.q.base_layer.weight", w),
        ("l.q.base_layer.bias", bias),
        ("l.q.lora_A.default.weight", a),
        ("l.q.lora_B.default.weight", b),
        ("l.norm.weight", torch.ones(4)),
    ]
    out = dict(merge_lora(unit, 0.5))
    assert list(out) == ["l.q.weight", "l.q.bias", "l.norm.weight"]
    torch.testing.assert_close(out["l.q.weight"], w + 0.5 * b @ a)
    assert torch.equal(out["l.q.bias"], bias)
    assert list(peft_adapter_state(dict(unit))) == [
        "base_model.model.l.q.lora_A.weight",
        "base_model.model.l.q.lora_B.weight",
    ]


def test_unknown_target_modules_name_the_field():
    """(The config-only LoRA checks live in ``rlspmd/validate/``, tested in test_input_checks.py; a target module
    is known only against the model.)"""
    from rlspmd.models.lora import apply_lora
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    with pytest.raises(ValueError, match=r"actor\.lora\.target_modules=\['qkv'\]"):
        apply_lora(model, LoraConfig(rank=2, target_modules=["qkv"]))


# one optimiser step per RL step (mini-batch = the step's 4 prompts): step 1's KL is measured before any update
LORA = [
    "--actor.lora.rank",
    "4",
    "--actor.lora.alpha",
    "8",
    "--actor.optim.lr",
    "1e-2",
    "--actor.kl-loss-coef",
    "0.1",
    "--actor.mini-batch-size",
    "4",
]


@pytest.mark.dist
@pytest.mark.slow
def test_lora_run_resumes_exactly_and_exports_merged_model_and_peft_adapter(tiny_model, arithmetic_data, tmp_path):
    reward = write_reward(tmp_path)
    ref_out, out = tmp_path / "reference", tmp_path / "resumed"
    torchrun(rl_args(tiny_model, arithmetic_data, ref_out, reward=reward, extra=[*LORA, "--checkpoint.save-hf"]), 2)
    args = rl_args(tiny_model, arithmetic_data, out, reward=reward, extra=LORA)
    assert "stopped after step 2" in torchrun([*args, "--trainer.stop-at-step", "2"], 2).stdout
    assert "resumed from" in torchrun([*args, "--resume", "auto"], 2).stdout
    assert metrics(out) == metrics(ref_out)
    kl = [m["actor/kl_loss"] for m in metrics(ref_out) if "actor/kl_loss" in m]
    assert kl[0] == 0.0 and kl[-1] > 0  # the policy starts as the base model (B = 0) and moves away from the reference
    final = ref_out / "checkpoints" / "step_00000004"
    state = checkpoint_tensors(final)
    assert_same_state(state, checkpoint_tensors(out / "checkpoints" / "step_00000004"))
    model_keys = [k for k in state if k.startswith("actor.model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)  # the adapters, not the base
    assert not any("embed_tokens" in k or "layernorm" in k for k in state if k.startswith("actor.optim."))

    exported = tmp_path / "export"
    subprocess.run(
        [sys.executable, "scripts/export_hf.py", str(final), str(exported)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(tiny_model)), str(exported / "adapter")
    ).eval()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    ids = torch.randint(3, 800, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp_merged, lp_peft, lp_base = (m(input_ids=ids).logits.log_softmax(-1) for m in (merged, peft_model, base))
    torch.testing.assert_close(lp_merged, lp_peft, rtol=0, atol=1e-4)
    assert (lp_merged - lp_base).abs().max() > 1e-3
    # checkpoint.save_hf wrote the same merged weights during the run
    saved_hf, exported_sd = (
        load_file(str(final / "hf" / "model.safetensors")),
        load_file(str(exported / "model.safetensors")),
    )
    # the run's save also writes the tied head's alias (its state dict is torch's, which names both); the same tensor
    assert saved_hf.keys() - {"lm_head.weight"} == exported_sd.keys()
    if "lm_head.weight" in saved_hf:
        assert torch.equal(saved_hf["lm_head.weight"], saved_hf["model.embed_tokens.weight"])
    for k in exported_sd:
        torch.testing.assert_close(saved_hf[k], exported_sd[k], rtol=0, atol=1e-6)
