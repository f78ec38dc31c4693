"""The HF <-> megatron-core layout (``rlspmd.models.megatron_convert``) and the megatron engine's pure helpers.

Nothing here needs megatron-core: the converter is plain tensor code, checked against hand-built layouts and by
exact round trips on the tiny Qwen2 (GQA, qkv bias, tied embeddings) and Llama models.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import load_script
from rlspmd.distributed.mesh import grid_coords
from rlspmd.engines.megatron.packing import front_pack
from rlspmd.models import megatron_convert as mc


def hf_state(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def arch_of(model_dir) -> mc.MegatronArch:
    return mc.megatron_arch(json.loads((model_dir / "config.json").read_text()), field_name="actor.model.path")


def test_fuse_qkv_interleaves_per_query_group():
    """2 KV heads, 2 query heads per group, head_dim 1: rows [q0 q1 k0 v0 | q2 q3 k1 v1] (megatron's layout)."""
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = mc.fuse_qkv(q, k, v, num_kv_heads=2, head_dim=1)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    bias = mc.fuse_qkv(q[:, 0], k[:, 0], v[:, 0], num_kv_heads=2, head_dim=1)  # 1-D (qkv bias) the same way
    assert bias.tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    q2, k2, v2 = mc.split_qkv(fused, num_kv_heads=2, head_dim=1)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_fuse_qkv_head_dim_blocks():
    """head_dim 2: each head is a block of 2 consecutive rows, kept together."""
    q = torch.arange(8.0)[:, None]  # heads (0,1) (2,3) (4,5) (6,7); group 0 = heads 0,1
    k = torch.arange(100.0, 104.0)[:, None]
    v = torch.arange(200.0, 204.0)[:, None]
    fused = mc.fuse_qkv(q, k, v, num_kv_heads=2, head_dim=2).flatten().tolist()
    assert fused == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_llama"])
def test_round_trip_is_exact(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    arch = arch_of(model_dir)
    hf = hf_state(model_dir)
    m = mc.hf_to_megatron(hf, arch)
    assert set(m) == set(mc.megatron_names(arch))
    qkv = m["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim, arch.hidden_size)
    assert "output_layer.weight" not in m  # tied: the head reads the embedding
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in m) == (arch.model_type == "qwen2")
    back = mc.megatron_to_hf(m, arch)
    assert set(back) == set(hf) | {"lm_head.weight"}
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    assert torch.equal(back["lm_head.weight"], hf["model.embed_tokens.weight"])


def test_round_trip_untied_llama(tmp_path):
    model_dir = load_script("scripts/models/build_tiny.py").build(
        tmp_path / "m", arch="llama", tie_embeddings=False, num_layers=2
    )
    arch = arch_of(model_dir)
    hf = hf_state(model_dir)
    m = mc.hf_to_megatron(hf, arch)
    assert torch.equal(m["output_layer.weight"], hf["lm_head.weight"])
    back = mc.megatron_to_hf(m, arch)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("tp", [2])
def test_tp_shards_are_megatrons_layout(tiny_model, tp):
    """Column-parallel tensors (fused QKV, embedding) are contiguous row chunks of the full megatron tensor; fc1's
    shard is [gate chunk; up chunk] (megatron's SwiGLU TP layout); row-parallel ones are column chunks."""
    arch = arch_of(tiny_model)
    hf = hf_state(tiny_model)
    m = mc.hf_to_megatron(hf, arch)

    def shards(name):
        return [mc.tp_shard(name, [hf[h] for h in mc.hf_names_of(name)], arch, tp=tp, tp_rank=r) for r in range(tp)]

    for name in (
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "decoder.layers.1.self_attention.linear_qkv.bias",
        "embedding.word_embeddings.weight",
    ):
        assert torch.equal(torch.cat(shards(name)), m[name]), name
    for name in ("decoder.layers.1.self_attention.linear_proj.weight", "decoder.layers.1.mlp.linear_fc2.weight"):
        assert torch.equal(torch.cat(shards(name), dim=1), m[name]), name
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    for r, s in enumerate(shards("decoder.layers.1.mlp.linear_fc1.weight")):
        assert torch.equal(s, torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
    assert all(
        torch.equal(s, hf["model.layers.1.input_layernorm.weight"])
        for s in shards("decoder.layers.1.input_layernorm.weight")
    )
    # A rank's QKV shard holds whole query groups: splitting it with the local KV-head count gives the HF chunks.
    q, k, v = mc.split_qkv(
        shards("decoder.layers.1.self_attention.linear_qkv.weight")[1],
        num_kv_heads=arch.num_kv_heads // tp,
        head_dim=arch.head_dim,
    )
    assert torch.equal(q, hf["model.layers.1.self_attn.q_proj.weight"].chunk(tp)[1])
    assert torch.equal(k, hf["model.layers.1.self_attn.k_proj.weight"].chunk(tp)[1])


def test_arch_from_config(tiny_model, tiny_llama):
    a = arch_of(tiny_model)
    assert (a.model_type, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.ffn_hidden_size) == (
        "qwen2",
        4,
        128,
        4,
        2,
        32,
        352,
    )
    assert (
        a.qkv_bias and a.tie_embeddings and a.rope_theta == 10000.0 and a.rms_norm_eps == 1e-6 and a.vocab_size == 896
    )
    b = arch_of(tiny_llama)
    assert b.model_type == "llama" and not b.qkv_bias and b.heads_per_group == 2
    # transformers 4.x layout: rope_theta at the top level
    old = {**json.loads((tiny_model / "config.json").read_text()), "rope_theta": 5e5}
    old.pop("rope_parameters")
    assert mc.megatron_arch(old, field_name="m").rope_theta == 5e5


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gemma"}, "model_type='gemma'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type='yarn'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ],
)
def test_unsupported_configs_name_the_key(tiny_model, change, match):
    cfg = {**json.loads((tiny_model / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=match) as e:
        mc.megatron_arch(cfg, field_name="actor.model.path")
    assert "actor.model.path" in str(e.value)


def test_llama_attention_bias_refused(tiny_llama):
    cfg = {**json.loads((tiny_llama / "config.json").read_text()), "attention_bias": True}
    with pytest.raises(ValueError, match="attention_bias"):
        mc.megatron_arch(cfg, field_name="actor.model.path")


def test_parallel_degrees_checked_against_the_model(tiny_model):
    arch = arch_of(tiny_model)  # 2 KV heads, 4 layers
    mc.check_parallel(arch, tp=2, pp=2, field_prefix="actor.megatron")
    with pytest.raises(ValueError, match=r"actor.megatron.tp=4 does not divide the model's num_key_value_heads=2"):
        mc.check_parallel(arch, tp=4, pp=1, field_prefix="actor.megatron")
    with pytest.raises(ValueError, match=r"critic.megatron.pp=3 does not divide the model's num_hidden_layers=4"):
        mc.check_parallel(arch, tp=1, pp=3, field_prefix="critic.megatron")


def test_stage_names():
    assert mc.stage_layers(8, pp=4, pp_rank=2) == range(4, 6)
    assert mc.local_name("decoder.layers.5.mlp.linear_fc1.weight", 4) == "decoder.layers.1.mlp.linear_fc1.weight"
    assert mc.global_name("decoder.layers.1.mlp.linear_fc1.weight", 4) == "decoder.layers.5.mlp.linear_fc1.weight"
    assert mc.local_name("embedding.word_embeddings.weight", 4) == "embedding.word_embeddings.weight"


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_llama"])
def test_hf_shapes_are_the_checkpoints(fixture, request):
    """``hf_shapes`` (what a pipeline stage allocates for tensors another stage holds) is the HF state dict's shapes,
    in model order; ``lm_head.weight`` only when the safetensors have one of their own."""
    model_dir = request.getfixturevalue(fixture)
    hf = hf_state(model_dir)
    shapes = mc.hf_shapes(arch_of(model_dir))
    assert shapes == {k: tuple(v.shape) for k, v in hf.items()}
    assert list(shapes)[0] == "model.embed_tokens.weight" and list(shapes)[-1] in (
        "model.norm.weight",
        "lm_head.weight",
    )


def test_stage_names_split_the_model():
    """Two stages of an untied 4-layer model: the embedding on the first, norm and head on the last, together every
    name once; one stage (first and last) holds the whole model."""
    arch = mc.MegatronArch("llama", 4, 8, 16, 2, 1, 4, 32, 64, 1e-6, 1e4, qkv_bias=False, tie_embeddings=False)
    stages = [
        mc.stage_names(arch, mc.stage_layers(4, pp=2, pp_rank=r), first=r == 0, last=r == 1, with_head=True)
        for r in (0, 1)
    ]
    assert stages[0][0] == "embedding.word_embeddings.weight" and stages[0][-1].startswith("decoder.layers.1.")
    assert stages[1][0].startswith("decoder.layers.2.") and stages[1][-2:] == [
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    ]
    assert stages[0] + stages[1] == mc.megatron_names(arch)
    assert mc.stage_names(arch, range(4), first=True, last=True, with_head=True) == mc.megatron_names(arch)


def test_grid_coords_tp_fastest():
    """8 ranks, tp 2, dp 2, pp 2: megatron's tp-cp-ep-dp-pp order."""
    coords = [grid_coords(i, tp=2, dp=2) for i in range(8)]
    assert coords == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]


def test_front_pack_moves_valid_tokens_first():
    """Left-padded prompt + right-padded response -> each row's valid tokens from index 0; response columns map to
    their index there (the position id), which is what RoPE and the head read."""
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 0], [0, 4, 5, 6, 7, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0]])
    fp = front_pack(ids, mask, response_len=3)
    assert fp.ids_BW.tolist() == [[5, 6, 7, 8], [4, 5, 6, 7]]
    assert fp.lengths_B.tolist() == [4, 4]
    assert fp.resp_valid_BR.tolist() == [[True, True, False], [True, False, False]]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -3:]
    assert torch.equal(fp.resp_pos_BR, positions)
    assert fp.resp_pos_BR[0, :2].tolist() == [2, 3]  # tokens 7, 8 sit at indices 2, 3 of the packed row


def test_an_engine_is_picked_by_name_with_its_own_options(capsys):
    from rlspmd.config import FSDPConfig, MegatronConfig
    from rlspmd.validate import ignored_settings
    from rlspmd.train import parse_args

    cfg, _ = parse_args(
        ["actor.engine:megatron", "--actor.engine.tp", "2", "critic.engine:megatron", "algorithm.adv-estimator:gae"]
    )
    assert cfg.actor.engine == MegatronConfig(tp=2) and cfg.critic.engine == MegatronConfig()
    assert ignored_settings(cfg) == []
    cfg, _ = parse_args(["--actor.engine.cpu-offload"])  # the default engine's options need no subcommand
    assert cfg.actor.engine == FSDPConfig(cpu_offload=True) and cfg.critic.engine == FSDPConfig()
    with pytest.raises(SystemExit):  # an option of the other engine is an error naming the engine that has it
        parse_args(["--actor.engine.tp", "2"])
    err = capsys.readouterr().err
    assert "--actor.engine.tp" in err and "actor.engine:megatron" in err
