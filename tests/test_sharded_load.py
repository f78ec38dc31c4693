"""Sharded meta-device loading (``rlspmd/models/sharded_load.py``): the same parameters and buffers as today's path on
2 ranks for every role module kind, a lower peak host memory per rank, and errors that name the file and tensor."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import dist_script, load_script, torchrun
from rlspmd.models.sharded_load import SafetensorsIndex, meta_policy_module, meta_value_model

KW = dict(dtype="float32", attn_implementation="sdpa", field_name="actor.model.path")


@pytest.fixture(scope="module")
def untied_llama(tmp_path_factory) -> Path:
    return load_script("scripts/models/build_tiny.py").build(
        tmp_path_factory.mktemp("untied") / "m", arch="llama", tie_embeddings=False, seed=3
    )


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory) -> Path:
    return load_script("scripts/models/build_tiny.py").build(
        tmp_path_factory.mktemp("bf16") / "m", dtype="bfloat16", seed=4
    )


@pytest.mark.dist
def test_two_ranks_load_what_from_pretrained_loads(tiny_model, tiny_reward_model, untied_llama, bf16_file, tmp_path):
    specs = [
        f"policy:{tiny_model}",
        f"policy:{untied_llama}",
        f"value:{tiny_model}",
        f"value:{tiny_reward_model}",
        f"scorer:{tiny_reward_model}",
        f"policy:{tiny_model}:bfloat16",
        f"policy:{bf16_file}",
    ]
    out = tmp_path / "loaded.pt"
    torchrun([dist_script("sharded_load_check.py"), str(out), *specs], 2)
    results = torch.load(out, weights_only=False)
    for spec in specs:
        r = results[spec]
        full, sharded = r["full"], r["sharded"]
        assert full.keys() == sharded.keys() and len(full) > 10, spec
        for name in full:  # bit for bit (a bf16 file converts to float32 exactly; float32 rounds to bf16 as torch does)
            assert full[name].dtype == sharded[name].dtype and torch.equal(full[name], sharded[name]), f"{spec}: {name}"
        assert r["dtypes"][0] == r["dtypes"][1], spec
        fb, sb = r["buffers"]
        assert fb.keys() == sb.keys() and any("inv_freq" in k for k in fb), spec
        for name in fb:  # the rotary tables computed at construction survive materialisation
            assert torch.equal(fb[name], sb[name]), f"{spec}: {name}"
    # the value head: read from a one-label reward model's score head, else the seeded draw of today's path
    rm = load_file(str(tiny_reward_model / "model.safetensors"))
    assert torch.equal(results[f"value:{tiny_reward_model}"]["sharded"]["value_head.weight"], rm["score.weight"])
    assert results[f"value:{tiny_model}"]["sharded"]["value_head.weight"].abs().sum() > 0
    assert results[f"policy:{tiny_model}:bfloat16"]["sharded"]["hf.model.norm.weight"].dtype == torch.bfloat16


def _random_model(out: Path, *, hidden=512, layers=8, inter=2048, vocab=8192) -> Path:
    """A random Qwen2 directory (config + safetensors, no tokenizer: loading needs none), ~42M parameters, untied."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_peak_host_memory_per_rank_is_about_the_shard(tmp_path):
    """Peak RSS added by loading (VmHWM after the load minus VmRSS before it), per rank of 2: sharded loading adds
    about half the model, today's path the whole model (plus the memory-mapped file)."""
    model = _random_model(tmp_path / "m")
    model_bytes = sum(t.numel() * 4 for t in load_file(str(model / "model.safetensors")).values())
    added = {}
    for mode in ("full", "sharded"):
        out = tmp_path / f"{mode}.json"
        torchrun([dist_script("sharded_load_check.py"), "--rss", str(out), mode, str(model)], 2)
        records = json.loads(out.read_text())
        added[mode] = max(r["peak"] - r["before"] for r in records)
        assert abs(sum(r["local_param_bytes"] for r in records) - model_bytes) < 1e5  # each rank holds its half
    assert added["full"] > 0.9 * model_bytes, added  # today's path materialises the whole model on every rank
    assert added["sharded"] < 0.6 * added["full"], added
    assert added["sharded"] < 0.7 * model_bytes, added  # the half it keeps, plus one slice


# -- errors name the file and the tensor (checked before anything is sharded) ----------------------------------------


def _copy(model: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(model, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_missing_tensor_is_named(tiny_model, tmp_path):
    d = _copy(tiny_model, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError,
        match=r"actor\.model\.path: no tensor in .*edited holds parameter 'hf\.model\.layers\.1\.mlp\.up_proj\.weight'",
    ):
        meta_policy_module(d, **KW)


def test_unexpected_tensor_is_named_with_its_file(tiny_model, tmp_path):
    d = _copy(tiny_model, tmp_path, lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(2)}))
    with pytest.raises(
        ValueError, match=r"model\.safetensors: tensor 'model\.layers\.9\.extra\.weight' belongs to no parameter"
    ):
        meta_policy_module(d, **KW)


def test_shape_mismatch_names_file_tensor_and_both_shapes(tiny_model, tmp_path):
    d = _copy(tiny_model, tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor 'model\.norm\.weight' has shape \[7\], but parameter "
        r"'hf\.model\.norm\.weight' of the model built from config\.json has \[128\]",
    ):
        meta_policy_module(d, **KW)


def test_integer_dtype_is_refused_naming_the_tensor(tiny_model, tmp_path):
    d = _copy(tiny_model, tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(128, dtype=torch.int32)}))
    with pytest.raises(
        ValueError, match=r"tensor 'model\.norm\.weight' is stored as I32, which cannot load into parameter"
    ):
        meta_policy_module(d, **KW)


def test_untied_head_missing_points_at_tie_word_embeddings(tiny_model, tmp_path):
    d = tmp_path / "untied"
    shutil.copytree(tiny_model, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match=r"parameter 'hf\.lm_head\.weight'.*tie_word_embeddings=false"):
        meta_policy_module(d, **KW)


def test_tied_head_saved_twice_loads(tiny_model, tmp_path):
    """A tied checkpoint that also stores ``lm_head.weight`` (some exporters write both): expected, not unexpected."""
    d = _copy(tiny_model, tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    module, plan = meta_policy_module(d, **KW)
    assert plan.keys["hf.lm_head.weight"] == plan.keys["hf.model.embed_tokens.weight"] == "model.embed_tokens.weight"


def test_truncated_file_names_the_path(tiny_model, tmp_path):
    d = tmp_path / "cut"
    shutil.copytree(tiny_model, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    # check_model_dir (models/loader.py) checks every header's sizes first;
    # the index's own per-tensor check is a backstop
    with pytest.raises(ValueError, match=r"actor\.model\.path: .*cut/model\.safetensors is truncated"):
        SafetensorsIndex.of(d, field_name="actor.model.path")


def test_value_model_ignores_the_lm_head_and_a_multi_label_classifier(tiny_model, tmp_path):
    d = _copy(
        tiny_model,
        tmp_path,
        lambda t: t.update({"lm_head.weight": torch.zeros(896, 128), "score.weight": torch.zeros(3, 128)}),
    )
    module, plan = meta_value_model(d, seed=0, **KW)
    assert "hf.value_head.weight" not in plan.keys and "value_head.weight" in plan.inits  # a new head, seeded


def test_block_reads_match_the_tensor(tiny_model):
    """``SafetensorsIndex.read``: row runs (contiguous, straight into ``out``) and column blocks (narrowed)."""
    index = SafetensorsIndex.of(tiny_model, field_name="m")
    full = load_file(str(tiny_model / "model.safetensors"))["model.layers.0.mlp.gate_proj.weight"]
    out = torch.empty(5, full.shape[1])
    got = index.read("model.layers.0.mlp.gate_proj.weight", (3, 0), (5, full.shape[1]), out=out)
    assert got is out and torch.equal(out, full[3:8])
    assert torch.equal(index.read("model.layers.0.mlp.gate_proj.weight", (10, 32), (4, 64)), full[10:14, 32:96])
