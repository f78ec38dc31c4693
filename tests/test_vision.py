"""Vision-language models (``rlspmd/models/vision.py``, ``rlspmd/data/images.py``): the tiny random Qwen2.5-VL (and
Qwen2-VL, Qwen3-VL) gives the same log-probs in rlspmd's training wrapper (padded and packed, loaded whole and sharded
under FSDP2) as transformers' own forward, on rows with one, two and no images; M-RoPE positions are transformers'."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image, ImageDraw

from rlspmd.protocol import Batch, position_ids

TOL = 1e-5


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    """A small deterministic picture (a few coloured rectangles)."""
    g = torch.Generator().manual_seed(seed)
    img = Image.new("RGB", size, tuple(torch.randint(0, 256, (3,), generator=g).tolist()))
    draw = ImageDraw.Draw(img)
    for _ in range(3):
        x0, y0 = (
            torch.randint(0, size[0] // 2, (1,), generator=g).item(),
            torch.randint(0, size[1] // 2, (1,), generator=g).item(),
        )
        draw.rectangle(
            [x0, y0, x0 + size[0] // 3, y0 + size[1] // 3],
            fill=tuple(torch.randint(0, 256, (3,), generator=g).tolist()),
        )
    return img


ROWS = [  # (user text, images, response length)
    ("<image>What colour is the largest shape?", [picture(0, (112, 84))], 5),
    ("Compare <image> with <image>. Same?", [picture(1, (56, 56)), picture(2, (84, 112))], 3),
    ("No picture here, just text.", [], 4),
]


def vl_rows(model_dir, rows=ROWS, *, seed: int = 0) -> tuple[Batch, list[dict]]:
    """A padded batch (left-padded prompts, right-padded random responses) of ``rows`` and, per row, what transformers
    needs (its unpadded ids, pixel values, grids)."""
    from rlspmd.data.images import MultimodalPrompts, image_parts
    from rlspmd.models.loader import load_tokenizer

    tok = load_tokenizer(model_dir, field_name="model")
    mp = MultimodalPrompts(model_dir, tok, field_name="model")
    g = torch.Generator().manual_seed(seed)
    prompts, responses, images, refs = [], [], [], []
    for i, (text, pics, r) in enumerate(rows):
        messages = image_parts([{"role": "user", "content": text}], len(pics), where=f"row {i}")
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        im = mp.images(pics, where=f"row {i}") if pics else None
        if im is not None:
            rendered = mp.expand(rendered, im.tokens_per_image(2), where=f"row {i}")
        prompts.append(tok(rendered, add_special_tokens=False)["input_ids"])
        responses.append(torch.randint(3, 800, (r,), generator=g).tolist())  # text tokens only
        images.append(im)
    P, R = max(map(len, prompts)), max(map(len, responses))
    B = len(rows)
    ids = torch.full((B, P + R), tok.pad_token_id)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, P - len(p) : P + len(r)] = torch.tensor(p + r)
        mask[b, P - len(p) : P + len(r)] = 1
        refs.append({"ids": torch.tensor([p + r]), "prompt_len": len(p), "images": images[b]})
    batch = Batch(
        {
            "input_ids_BL": ids,
            "attention_mask_BL": mask,
            "position_ids_BL": position_ids(mask),
            "responses_BR": ids[:, P:],
            "response_mask_BR": mask[:, P:],
            "loss_mask_BR": mask[:, P:],
        },
        {"images": images},
    )
    return batch, refs


@torch.no_grad()
def hf_logprobs(model_dir, refs, R: int) -> torch.Tensor:
    """Per row, transformers' own forward on the unpadded sequence: log-probs of the response tokens, (B, R)."""
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = torch.zeros(len(refs), R)
    for b, ref in enumerate(refs):
        ids, im, P = ref["ids"], ref["images"], ref["prompt_len"]
        kw = {}
        if im is not None:
            kw = dict(
                pixel_values=im.pixel_values,
                image_grid_thw=im.grid_thw,
                mm_token_type_ids=(ids == hf.config.image_token_id).int(),
            )
        logits = hf(input_ids=ids, **kw).logits[0].float()
        lp = torch.log_softmax(logits[P - 1 : -1], -1).gather(-1, ids[0, P:, None]).squeeze(-1)
        out[b, : lp.numel()] = lp
    return out


def assert_log_probs_equal_transformers(
    model_dir, *, packing: bool, device=torch.device("cpu"), atol: float = TOL
) -> tuple[Batch, list[dict]]:
    """rlspmd's training wrapper of ``model_dir`` (fp32, on ``device``) gives ``vl_rows``' response log-probs as
    transformers' forward on CPU does, within ``atol``; returns the rows."""
    from rlspmd.models.sharded_load import build_policy_module

    batch, refs = vl_rows(model_dir)
    R = batch["responses_BR"].shape[1]
    mask = batch["response_mask_BR"]
    expected = hf_logprobs(model_dir, refs, R) * mask
    module = build_policy_module(
        str(model_dir), dtype="float32", attn_implementation="sdpa", field_name="model", packing=packing
    ).to(device)
    with torch.no_grad():
        lp, _ = module(
            batch["input_ids_BL"].to(device),
            batch["attention_mask_BL"].to(device),
            batch["position_ids_BL"].to(device),
            images=batch["images"],
            response_len=R,
        )
    torch.testing.assert_close(lp.cpu() * mask, expected, atol=atol, rtol=0)
    return batch, refs


@pytest.mark.parametrize("packing", [False, True])
def test_log_probs_equal_transformers_forward(tiny_vl_model, packing):
    assert_log_probs_equal_transformers(tiny_vl_model, packing=packing)


def test_mrope_positions_equal_transformers(tiny_vl_model):
    from transformers import AutoModelForImageTextToText

    from rlspmd.models.vision import VisionSpec, mrope_position_ids

    batch, refs = vl_rows(tiny_vl_model)
    hf = AutoModelForImageTextToText.from_pretrained(str(tiny_vl_model), dtype=torch.float32)
    ids, mask = batch["input_ids_BL"], batch["attention_mask_BL"]
    images = batch["images"]
    grids = torch.cat([im.grid_thw for im in images if im is not None])
    expected, expected_delta = hf.model.get_rope_index(
        ids, mm_token_type_ids=(ids == hf.config.image_token_id).int(), image_grid_thw=grids, attention_mask=mask
    )
    R = batch["responses_BR"].shape[1]
    pos, delta, index = mrope_position_ids(
        ids, mask, images, spec=VisionSpec.of(hf.config), prompt_len=ids.shape[1] - R
    )
    assert torch.equal(pos, expected)
    assert torch.equal(delta, expected_delta[:, 0])
    assert torch.equal(index, (ids.flatten() == hf.config.image_token_id).nonzero().squeeze(-1))


def test_images_reach_the_model(tiny_vl_model):
    """Other pixels change the log-probs of the rows with images, and only theirs."""
    from rlspmd.models.vision import ImageInputs
    from rlspmd.models.sharded_load import build_policy_module

    batch, _ = vl_rows(tiny_vl_model)
    R = batch["responses_BR"].shape[1]
    module = build_policy_module(
        str(tiny_vl_model), dtype="float32", attn_implementation="sdpa", field_name="model", packing=True
    )
    other = [None if im is None else ImageInputs(im.pixel_values.flip(0), im.grid_thw) for im in batch["images"]]
    with torch.no_grad():
        lp = [
            module(
                batch["input_ids_BL"], batch["attention_mask_BL"], batch["position_ids_BL"], images=ims, response_len=R
            )[0]
            for ims in (batch["images"], other)
        ]
    changed = (lp[0] - lp[1]).abs().amax(-1)
    assert (changed[:2] > 1e-4).all() and changed[2] == 0, changed


@pytest.mark.parametrize("model_fixture", ["tiny_vl_model", "tiny_qwen3_vl"])
@pytest.mark.parametrize("freeze", [False, True])
def test_sharded_fsdp_engine_equals_transformers_and_trains_the_tower_unless_frozen(
    request, model_fixture, mesh_of_one, freeze
):
    """The trainer's path: built on the meta device, FSDP2-wrapped (vision blocks included), each rank's shards read
    from safetensors; log-probs over micro-batches (the first two rows share one image object, as a prompt's samples
    do) equal transformers'; one optimiser step moves the vision tower's weights unless ``freeze_vision_tower``
    (Qwen3-VL: its DeepStack mergers too, which get gradients through the decoder layers they feed)."""
    from rlspmd.config import FSDPConfig, ModelConfig, OptimConfig
    from rlspmd.engines.fsdp import FSDPEngine
    from rlspmd.models.vision import freeze_vision_tower
    from rlspmd.roles.policy import compute_logprobs
    from rlspmd.engines.fsdp import fsdp_role_module

    tiny_vl_model = request.getfixturevalue(model_fixture)
    batch, refs = vl_rows(tiny_vl_model)
    batch, refs = batch.select([0, 0, 1, 2]), [refs[0], refs[0], refs[1], refs[2]]
    assert batch["images"][0] is batch["images"][1]
    R = batch["responses_BR"].shape[1]
    expected = hf_logprobs(tiny_vl_model, refs, R) * batch["response_mask_BR"]
    model = ModelConfig(path=str(tiny_vl_model), sharded_load=True)
    module, weights = fsdp_role_module("policy", model.path, model=model, field_name="model.path")
    assert weights is not None
    if freeze:
        freeze_vision_tower(module.hf)
    engine = FSDPEngine(
        module,
        module.hf,
        mesh=mesh_of_one["dp"],
        device=torch.device("cpu"),
        fsdp=FSDPConfig(),
        optim=OptimConfig(lr=1e-2),
        weights=weights,
    )
    lp, _ = compute_logprobs(engine.module, batch, micro_batch_size=3, temperature=1.0)
    torch.testing.assert_close(lp * batch["response_mask_BR"], expected, atol=TOL, rtol=0)

    def visual():
        return {n: p.full_tensor().clone() for n, p in engine.module.named_parameters() if ".visual." in n}

    before = visual()
    engine.optimizer_step(
        [batch],
        lambda m, mb: (
            -m(mb["input_ids_BL"], mb["attention_mask_BL"], mb["position_ids_BL"], images=mb["images"], response_len=R)[
                0
            ].sum()
        ),
    )
    after = visual()
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved == (set() if freeze else set(before)), sorted(set(before) - moved)[:5]


def test_hub_layout_loads_sharded_and_export_round_trips(tiny_vl_model, mesh_of_one, tmp_path):
    """transformers saves (and the Hub holds) Qwen2.5-VL in its old layout (``model.layers.*``, ``visual.*``); a
    checkpoint in the new one (``model.language_model.*``, ``model.visual.*``) loads sharded too, and the trainer's HF
    export (weights, tokenizer, image processor) loads back in transformers with the same weights."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from rlspmd.config import FSDPConfig, ModelConfig
    from rlspmd.engines.fsdp import FSDPEngine
    from rlspmd.models.loader import load_tokenizer
    from rlspmd.engines.fsdp import fsdp_role_module
    from rlspmd.trainer.checkpoint import save_hf_model

    hub = tmp_path / "hub"
    shutil.copytree(tiny_vl_model, hub)
    state = load_file(hub / "model.safetensors")
    assert any(k.startswith("visual.") for k in state) and any(k.startswith("model.layers.") for k in state)
    new_layout = {
        ("model.language_model." + k[6:] if k.startswith("model.") else "model." + k): v for k, v in state.items()
    }
    save_file(new_layout, hub / "model.safetensors", metadata={"format": "pt"})
    model = ModelConfig(path=str(hub), sharded_load=True)
    module, weights = fsdp_role_module("policy", model.path, model=model, field_name="model.path")
    engine = FSDPEngine(
        module,
        module.hf,
        mesh=mesh_of_one["dp"],
        device=torch.device("cpu"),
        fsdp=FSDPConfig(),
        optim=None,
        weights=weights,
    )
    out = save_hf_model(engine, load_tokenizer(hub, field_name="model"), hub, tmp_path / "export", is_main=True)
    assert AutoImageProcessor.from_pretrained(str(out)).merge_size == 2
    back = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).state_dict()
    original = AutoModelForImageTextToText.from_pretrained(str(tiny_vl_model), dtype=torch.float32).state_dict()
    assert back.keys() == original.keys()
    for k in original:
        assert torch.equal(back[k], original[k]), k


def test_start_up_checks_name_what_a_vision_model_does_not_run_with(tiny_vl_model, tiny_model):
    from rlspmd.models.vision import model_problems

    from rlspmd.config import FSDPConfig, MegatronConfig, NativeConfig, VllmConfig

    kw = dict(
        freeze_vision_tower=False, critic=False, tp=1, engine=FSDPConfig(), lora=False, rollout_engine=NativeConfig()
    )
    assert model_problems(str(tiny_vl_model), **kw) == []
    megatron = MegatronConfig()
    problems = model_problems(str(tiny_vl_model), **{**kw, "critic": True, "tp": 2, "engine": megatron, "lora": True})
    assert [f for f, _, _ in problems] == [
        "algorithm.adv_estimator",
        "mesh.actor_tp",
        "actor.engine",
        "actor.lora.rank",
    ]
    assert all("qwen2_5_vl" in why for _, _, why in problems)
    (vllm,) = model_problems(str(tiny_vl_model), **{**kw, "rollout_engine": VllmConfig()})
    assert vllm[0] == "rollout.engine" and "does not pass images" in vllm[2]
    assert model_problems(str(tiny_model), **{**kw, "rollout_engine": VllmConfig()}) == []
    (problem,) = model_problems(str(tiny_model), **{**kw, "freeze_vision_tower": True})
    assert problem[0] == "actor.freeze_vision_tower" and "no vision tower" in problem[2]


# -- data: verl's multimodal rows --------------------------------------------------------------------------------------


def png(seed: int, size=(84, 56), image: Image.Image | None = None) -> bytes:
    import io

    buf = io.BytesIO()
    (image or picture(seed, size)).save(buf, format="PNG")
    return buf.getvalue()


def write_rows(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def mm_row(text: str, images: list, truth="red"):
    return {
        "data_source": "shapes",
        "prompt": [{"role": "user", "content": text}],
        "images": images,
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "test"},
    }


def test_multimodal_rows_read_once_and_batch_with_their_images(tiny_vl_model, tmp_path):
    """verl's rows (images as bytes and as a path relative to the data file) read unchanged; each batch row carries its
    ``ImageInputs`` (the image processor's pixels and grids) and its prompt holds one placeholder per image token."""
    from rlspmd.data.images import MultimodalPrompts
    from rlspmd.data.prompts import PromptDataset
    from rlspmd.models.loader import load_tokenizer

    picture(7, (56, 112)).save(tmp_path / "seven.png")
    f = write_rows(
        tmp_path / "mm.parquet",
        [
            mm_row("<image>What colour?", [{"bytes": png(1)}]),
            mm_row("Two: <image> and <image>.", [{"bytes": png(2)}, {"path": "seven.png", "bytes": None}]),
            mm_row("Plain text.", []),
        ],
    )
    tok = load_tokenizer(tiny_vl_model, field_name="model")
    vision = MultimodalPrompts.for_model(tiny_vl_model, tok, field_name="actor.model.path")
    ds = PromptDataset([f], tok, prompt_key="prompt", max_prompt_length=512, vision=vision)
    batch = ds.batch([0, 1, 2])
    images = batch["images"]
    assert images[2] is None and images[0].grid_thw.tolist() == [[1, 4, 6]]
    assert images[1].grid_thw.tolist() == [[1, 4, 6], [1, 8, 4]]
    image_id = vision.spec.image_token_id
    n_placeholders = (batch["prompts_BP"] == image_id).sum(-1).tolist()
    assert n_placeholders == [6, 6 + 8, 0]
    assert batch["prompt_text"][1].count("<|image_pad|>") == 2  # the readable text keeps one per image
    # the pixels are the image processor's own
    from transformers import AutoImageProcessor

    ref = AutoImageProcessor.from_pretrained(str(tiny_vl_model))(images=[picture(1, (84, 56))], return_tensors="pt")
    assert torch.equal(images[0].pixel_values, ref["pixel_values"])


@pytest.mark.parametrize(
    "row, message",
    [
        (mm_row("<image> and <image>", [{"bytes": b"0"}]), "2 <image> placeholder(s) but the row has 1 image(s)"),
        (mm_row("<image>", [{"bytes": b"not an image"}]), "row 0 image 0: UnidentifiedImageError"),
        (mm_row("<image>", [{"path": "missing.png", "bytes": None}]), "image file missing.png does not exist"),
        (
            mm_row("<image>", [{"bytes": png(0, image=Image.new("RGB", (300, 1)))}]),
            "row 0 image 0 (300x1): absolute aspect ratio",
        ),
    ],
)
def test_bad_images_name_the_file_and_row(tiny_vl_model, tmp_path, row, message):
    from rlspmd.data.images import MultimodalPrompts
    from rlspmd.data.prompts import PromptDataset
    from rlspmd.models.loader import load_tokenizer

    f = write_rows(tmp_path / "bad.parquet", [row])
    tok = load_tokenizer(tiny_vl_model, field_name="model")
    vision = MultimodalPrompts.for_model(tiny_vl_model, tok, field_name="actor.model.path")
    with pytest.raises(ValueError, match=rf"data.train_files: {tmp_path}/bad.parquet row 0") as e:
        PromptDataset([f], tok, prompt_key="prompt", max_prompt_length=512, vision=vision)
    assert message in str(e.value)


def test_images_for_a_text_model_are_refused(tiny_model, tmp_path):
    from rlspmd.data.images import MultimodalPrompts
    from rlspmd.data.prompts import PromptDataset
    from rlspmd.models.loader import load_tokenizer

    f = write_rows(tmp_path / "mm.parquet", [mm_row("<image>What colour?", [{"bytes": png(1)}])])
    tok = load_tokenizer(tiny_model, field_name="model")
    assert MultimodalPrompts.for_model(tiny_model, tok, field_name="actor.model.path") is None
    with pytest.raises(ValueError, match="row 0: the row has 1 image.* the model reads text only"):
        PromptDataset([f], tok, prompt_key="prompt", max_prompt_length=512)


def test_thumbnail_is_the_picture_the_model_saw(tiny_vl_model):
    """An image the processor does not resize (its sides multiples of 28, within its pixel range) comes back from its
    patches as it was, up to the normalisation's rounding."""
    import numpy as np

    from rlspmd.data.images import MultimodalPrompts
    from rlspmd.models.loader import load_tokenizer

    vision = MultimodalPrompts.for_model(tiny_vl_model, load_tokenizer(tiny_vl_model, field_name="m"), field_name="m")
    pics = [picture(4, (84, 56)), picture(5, (56, 112))]
    images = vision.images(pics, where="row 0")
    for k, pic in enumerate(pics):
        got = vision.picture(images, k).astype(int)
        assert got.shape == (pic.height, pic.width, 3)
        assert np.abs(got - np.asarray(pic).astype(int)).max() <= 1


# -- rollout -----------------------------------------------------------------------------------------------------------


def prompt_batch(batch: Batch, refs) -> Batch:
    """The prompts of ``vl_rows``' batch, left-padded, with their images."""
    P = max(r["prompt_len"] for r in refs)
    ids = torch.zeros(len(refs), P, dtype=torch.long)
    mask = torch.zeros(len(refs), P, dtype=torch.long)
    for b, r in enumerate(refs):
        ids[b, P - r["prompt_len"] :] = r["ids"][0, : r["prompt_len"]]
        mask[b, P - r["prompt_len"] :] = 1
    return Batch({"prompts_BP": ids, "prompt_mask_BP": mask}, {"images": batch["images"]})


@torch.no_grad()
def hf_greedy(model_dir, refs, n: int) -> list[list[int]]:
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for r in refs:
        ids, im = r["ids"][:, : r["prompt_len"]], r["images"]
        kw = {}
        if im is not None:
            kw = dict(
                pixel_values=im.pixel_values,
                image_grid_thw=im.grid_thw,
                mm_token_type_ids=(ids == hf.config.image_token_id).int(),
            )
        g = hf.generate(input_ids=ids, **kw, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(g[0, ids.shape[1] :].tolist())
    return out


def assert_native_greedy_equals_transformers(
    model_dir, batch: Batch, refs, n: int, *, device=torch.device("cpu")
) -> list[list[int]]:
    """The native engine on ``device`` (eager, one batch) decodes ``n`` greedy tokens per row as transformers'
    ``generate`` on CPU does; returns them."""
    from rlspmd.models.loader import load_causal_lm
    from rlspmd.rollout.native import NativeEngine, OwnWeights
    from rlspmd.rollout.sampling import SamplingParams

    hf = load_causal_lm(model_dir, dtype="float32", attn_implementation="sdpa", field_name="model").to(device)
    engine = NativeEngine(OwnWeights(hf), eos_ids=[], pad_id=0, max_batch_size=8, device=device)
    out = engine.generate(prompt_batch(batch, refs), SamplingParams(temperature=0.0, max_new_tokens=n), generator=None)
    expected = hf_greedy(model_dir, refs, n)
    assert out["responses_BR"].tolist() == expected
    return expected


@pytest.fixture(scope="module")
def lively_vl_model(tiny_vl_model, tmp_path_factory):
    """The tiny VL model with its matrices redrawn 10x larger (seeded): its greedy tokens depend on the images and
    positions (the random init's near-uniform logits give the same token everywhere)."""
    import shutil

    from transformers import AutoModelForImageTextToText

    out = tmp_path_factory.mktemp("lively_vl") / "model"
    shutil.copytree(tiny_vl_model, out)
    hf = AutoModelForImageTextToText.from_pretrained(str(tiny_vl_model), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    hf.save_pretrained(str(out))
    return out


def test_native_engine_greedy_generation_equals_transformers_generate(lively_vl_model):
    """Left-padded prompts with one, two and no images, decoded in one batch (eager, prefill with image features and
    M-RoPE, decode steps at index + delta), give transformers' greedy tokens."""
    batch, refs = vl_rows(lively_vl_model)
    expected = assert_native_greedy_equals_transformers(lively_vl_model, batch, refs, 12)
    assert len({tuple(e) for e in expected}) == len(expected)  # the rows (their images) lead to different tokens


class Requests:
    """A ``RequestSource`` of fixed requests: all ready at once, results kept."""

    def __init__(self, requests):
        self.ready, self.results = list(requests), {}

    def take(self, *, block):
        out, self.ready = self.ready, []
        return out

    def finish(self, key, tokens, logprobs):
        self.results[key] = tokens


def test_continuous_batching_with_images_equals_transformers_generate(lively_vl_model):
    """Request-level generation (the agent loop's): each request carries its prompt's images; a second turn's context
    (prompt + first turn + a tool result, the prompt's images again) continues exactly as transformers does."""
    from rlspmd.models.loader import load_causal_lm
    from rlspmd.rollout.continuous import Request, SlotDecoder, serve
    from rlspmd.rollout.sampling import SamplingParams

    batch, refs = vl_rows(lively_vl_model)
    n = 8
    hf = load_causal_lm(lively_vl_model, dtype="float32", attn_implementation="sdpa", field_name="model")
    decoder = SlotDecoder(hf, slots=2, max_len=128, device=torch.device("cpu"))

    def request(k, ids, r, counter=0):
        return Request(k, ids, n, seed=0, counter=counter, images=r["images"], prompt_len=r["prompt_len"])

    first = Requests([request(k, r["ids"][0, : r["prompt_len"]].tolist(), r) for k, r in enumerate(refs)])
    serve(decoder, first, SamplingParams(temperature=0.0), slots=2, eos_ids=[])
    assert [first.results[k] for k in range(len(refs))] == hf_greedy(lively_vl_model, refs, n)
    tool = [5, 6, 7]
    second_refs = [
        {**r, "ids": torch.tensor([r["ids"][0, : r["prompt_len"]].tolist() + first.results[k] + tool])}
        for k, r in enumerate(refs)
    ]
    second = Requests([request(k, r["ids"][0].tolist(), r, counter=n) for k, r in enumerate(second_refs)])
    serve(decoder, second, SamplingParams(temperature=0.0), slots=2, eos_ids=[])
    expected = hf_greedy(lively_vl_model, [{**r, "prompt_len": r["ids"].shape[1]} for r in second_refs], n)
    assert [second.results[k] for k in range(len(refs))] == expected


# -- end to end --------------------------------------------------------------------------------------------------------


SIZES = [
    [(56, 56)],
    [(112, 112)],
    [(112, 56)],
    [(56, 56), (84, 84)],
    [(84, 56)],
    [(112, 84)],
    [(56, 112)],
    [(84, 84), (56, 56)],
]
"""Images of the end-to-end rows: 4 to 16 image tokens each, one or two per prompt, so prompt lengths differ and DP
balancing moves rows between ranks."""


@pytest.mark.slow
@pytest.mark.dist
def test_multimodal_rows_train_two_steps_on_two_ranks(tiny_vl_model, tmp_path):
    """verl-schema rows (images as PNG bytes) train unchanged for 2 GRPO steps on 2 ranks with the native engine
    (colocated, reading the FSDP2-gathered weights in place, vision blocks included), samples balanced across ranks
    before the update (prompts of different lengths: rows move). The rollout's log-probs equal the trainer's (up to
    float noise): the images reached the rollout's prefill and, after dispatch and balancing, the right rows of the
    trainer's forward."""
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from conftest import torchrun
    from rl_run import rl_args, write_reward

    data = tmp_path / "data"
    data.mkdir()
    data_rows = [
        mm_row(
            " and ".join(["<image>"] * len(sizes)) + ": what colour?",
            [{"bytes": png(k * 10 + j, size)} for j, size in enumerate(sizes)],
        )
        for k, sizes in enumerate(SIZES)
    ]
    write_rows(data / "train.parquet", data_rows)
    write_rows(data / "test.parquet", data_rows)
    out = tmp_path / "run"
    args = rl_args(tiny_vl_model, data, out, steps=2, reward=write_reward(tmp_path))
    extra = [
        "--data.max-prompt-length",
        "64",
        "--trainer.samples.num-train",
        "2",
        "--trainer.loggers",
        "jsonl",
        "tensorboard",
    ]
    torchrun([*args, *extra], 2, timeout=600)
    rows = [r for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if r["step"]]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["actor/grad_norm"] > 0 and r["rollout/logprob_gap"] < 1e-4, r
        assert r["balance/token_imbalance_before"] >= r["balance/token_imbalance_after"]
    assert any(r["balance/token_imbalance_before"] > r["balance/token_imbalance_after"] for r in rows)  # rows moved
    # the sample log names each sample's image (data file and row) and keeps a thumbnail; TensorBoard shows it
    samples = [json.loads(line) for line in (out / "samples/train.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    for s in samples:
        assert [im["image"] for im in s["images"]] == list(range(len(SIZES[s["index"]])))
        for im, size in zip(s["images"], SIZES[s["index"]]):
            assert im["source"] == f"{data / 'train.parquet'} row {s['index']}"
            assert Image.open(out / "samples" / im["thumbnail"]).size == size
    shown = subprocess.run(
        [sys.executable, "-m", "rlspmd.samples", str(out)], capture_output=True, text=True, check=True
    )
    assert f"image 0: {samples[-1]['images'][0]['source']} · thumbnail samples/" in shown.stdout
    ea = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    ea.Reload()
    assert {"samples/train/0/image0", "samples/train/1/image0"} <= set(ea.Tags()["images"])


@pytest.fixture(scope="module")
def vl_tool_caller(tmp_path_factory):
    """The tiny VL model with the tool-calling template, fitted to one demonstration whose prompt holds an image:
    call the calculator, read its result, answer. Returns (model dir, data dir: one prompt with an image)."""
    from transformers import AutoModelForImageTextToText

    from conftest import load_script
    from rlspmd.agent import ChatRenderer, load_tools, tool_schemas
    from rlspmd.config import AgentConfig
    from rlspmd.data.images import MultimodalPrompts, image_parts
    from rlspmd.models.loader import load_tokenizer
    from rlspmd.sft import conversation_ids

    tmp = tmp_path_factory.mktemp("vl_tool_caller")
    model_dir = load_script("scripts/models/build_tiny.py").build(tmp / "model", vision=True, tools=True)
    tok = load_tokenizer(model_dir, field_name="model")
    vision = MultimodalPrompts.for_model(model_dir, tok, field_name="model")
    image = {"bytes": png(3)}
    messages = [
        {"role": "user", "content": "<image>Calculate 6 + 5."},
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "6 + 5"}}</tool_call>',
        },
        {"role": "tool", "content": "11"},
        {"role": "assistant", "content": "#### 11"},
    ]
    renderer = ChatRenderer(tok, tools=tool_schemas(load_tools(AgentConfig(tools=["calculator"]))), field_name="m")
    prompt, response, mask = conversation_ids(
        image_parts(messages, 1, where="demo"), renderer, eos_id=tok.eos_token_id, where="demo"
    )
    im = vision.images([image], where="demo")
    k = prompt.index(vision.spec.image_token_id)
    prompt = prompt[:k] + prompt[k : k + 1] * im.tokens_per_image(2)[0] + prompt[k + 1 :]
    ids = torch.tensor([prompt + response])
    labels = torch.tensor([[-100] * len(prompt) + [t if m else -100 for t, m in zip(response, mask)]])
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    kw = dict(
        pixel_values=im.pixel_values,
        image_grid_thw=im.grid_thw,
        mm_token_type_ids=(ids == vision.spec.image_token_id).int(),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small: one thread is fastest (two spin against other jobs on 2 cores)
    try:
        for _ in range(150):
            model(input_ids=ids, labels=labels, **kw).loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(str(model_dir))
    row = mm_row(messages[0]["content"], [image], truth="11")
    row["data_source"] = "arithmetic"
    row["extra_info"] = {"tools_kwargs": {"calculator": {"create_kwargs": {"expression": "6 + 5"}}}}
    data = tmp / "data"
    data.mkdir()
    write_rows(data / "train.parquet", [row])
    return model_dir, data


def test_agent_conversation_with_an_image_calls_its_tool(vl_tool_caller):
    """Multi-turn with an image in the prompt: the agent loop's conversation (continuous batching, the image at every
    turn's prefill) calls the calculator, gets its result and answers; the trainer's forward over the assembled
    conversation (image in the prompt, the tool result in the response, masked out) gives the rollout's log-probs."""
    from rlspmd.agent import build_agent_loop
    from rlspmd.config import AgentConfig
    from rlspmd.data.images import MultimodalPrompts
    from rlspmd.data.prompts import PromptDataset
    from rlspmd.metrics import MetricBuffer
    from rlspmd.models.loader import load_causal_lm, load_tokenizer
    from rlspmd.models.vision import VisionLanguagePolicy
    from rlspmd.rollout.native import NativeEngine, OwnWeights
    from rlspmd.rollout.sampling import SamplingParams

    model_dir, data = vl_tool_caller
    tok = load_tokenizer(model_dir, field_name="model")
    loop = build_agent_loop(
        AgentConfig(tools=["calculator"]),
        tokenizer=tok,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        max_response_length=96,
        model_field="model",
    )
    vision = MultimodalPrompts.for_model(model_dir, tok, field_name="model")
    ds = PromptDataset(
        [str(data / "train.parquet")],
        tok,
        prompt_key="prompt",
        max_prompt_length=256,
        tools=loop.tool_schemas,
        vision=vision,
    )
    hf = load_causal_lm(model_dir, dtype="float32", attn_implementation="sdpa", field_name="model")
    engine = NativeEngine(
        OwnWeights(hf),
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        max_batch_size=4,
        device=torch.device("cpu"),
    )
    out = loop.run(engine, ds.batch([0]), SamplingParams(temperature=0.0, max_new_tokens=96), None, MetricBuffer())
    text = tok.decode(out["responses_BR"][0][out["response_mask_BR"][0].bool()])
    assert out["agent_tool_calls_BK"].tolist() == [[1.0]], text
    assert "<tool_response>\n11\n</tool_response>" in text and text.rstrip().endswith("#### 11<|im_end|>"), text
    loss = out["loss_mask_BR"][0]
    assert 0 < loss.sum() < out["response_mask_BR"][0].sum()  # the tool result is in the response, not trained on
    policy = VisionLanguagePolicy(hf, packing=True)
    R = out["responses_BR"].shape[1]
    with torch.no_grad():
        lp, _ = policy(
            out["input_ids_BL"], out["attention_mask_BL"], out["position_ids_BL"], images=out["images"], response_len=R
        )
    torch.testing.assert_close(lp * loss, out["rollout_logprobs_BR"] * loss, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.dist
def test_sft_on_image_rows_lowers_the_loss_and_exports_a_loadable_model(tiny_vl_model, shapes_data, tmp_path):
    """``rlspmd.sft`` reads verl's multimodal rows (prompt with ``<image>``, images as bytes, a response): the loss
    falls over a few steps on 2 ranks, and the exported directory loads in transformers with its image processor."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from conftest import torchrun

    out = tmp_path / "sft"
    torchrun(
        [
            "-m",
            "rlspmd.sft",
            "--config",
            "configs/sft_vision_quickstart.py",
            "--model.path",
            str(tiny_vl_model),
            "--data.train-files",
            str(shapes_data / "sft.parquet"),
            "--data.batch-size",
            "16",
            "--micro-batch-size",
            "8",
            "--total-steps",
            "12",
            "--optim.warmup-steps",
            "2",
            "--log-every",
            "4",
            "--output-dir",
            str(out),
            "--loggers",
            "jsonl",
        ],
        2,
        timeout=600,
    )
    losses = [
        json.loads(line)["sft/loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if "sft/loss" in line
    ]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2] and losses[2] < 0.7 * losses[0], losses
    assert AutoImageProcessor.from_pretrained(str(out / "hf")).merge_size == 2
    AutoModelForImageTextToText.from_pretrained(str(out / "hf"))


@pytest.fixture(scope="module")
def tiny_qwen2_vl(tiny_vl_model, tmp_path_factory):
    """A tiny random Qwen2-VL (its own vision tower: LayerNorm blocks, no window attention) with the tiny VL model's
    tokenizer and image processor, matrices drawn large enough that greedy tokens depend on the images."""
    import shutil

    import transformers

    out = tmp_path_factory.mktemp("qwen2_vl") / "model"
    shutil.copytree(tiny_vl_model, out)
    vl = transformers.AutoConfig.from_pretrained(str(tiny_vl_model))
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(
            vocab_size=vl.text_config.vocab_size,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        ),
        vision_config=dict(
            depth=2,
            embed_dim=64,
            hidden_size=128,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=vl.image_token_id,
        video_token_id=vl.video_token_id,
        vision_start_token_id=vl.vision_start_token_id,
        vision_end_token_id=vl.vision_end_token_id,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2VLForConditionalGeneration._from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(str(out))
    return out


def test_qwen2_vl_log_probs_and_greedy_generation_equal_transformers(tiny_qwen2_vl):
    batch, refs = assert_log_probs_equal_transformers(tiny_qwen2_vl, packing=True)
    assert_native_greedy_equals_transformers(tiny_qwen2_vl, batch, refs, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_fixture", ["lively_vl_model", "tiny_qwen3_vl"])
@pytest.mark.parametrize("packing", [False, True])
def test_cuda_log_probs_and_greedy_generation_equal_transformers_on_cpu(request, model_fixture, packing):
    """On CUDA (fp32, TF32 off): the training wrapper's log-probs (padded and packed, image features scattered on the
    GPU; Qwen3-VL: DeepStack features too) and the native engine's greedy tokens equal transformers' forward and
    ``generate`` on CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = torch.device("cuda")
    model_dir = request.getfixturevalue(model_fixture)
    batch, refs = assert_log_probs_equal_transformers(model_dir, packing=packing, device=cuda, atol=1e-3)
    assert_native_greedy_equals_transformers(model_dir, batch, refs, 12, device=cuda)


# -- Qwen3-VL: DeepStack, interleaved M-RoPE, a Qwen3 language model ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen3_vl(tmp_path_factory):
    """A tiny random Qwen3-VL (``build_tiny.py --vision qwen3_vl``: two vision blocks, each feeding a DeepStack merger
    whose features go into decoder layers 0 and 1), matrices redrawn large enough that greedy tokens depend on the
    images (as ``lively_vl_model``)."""
    from transformers import AutoModelForImageTextToText

    from conftest import load_script

    out = load_script("scripts/models/build_tiny.py").build(
        tmp_path_factory.mktemp("qwen3_vl") / "model", vision="qwen3_vl"
    )
    hf = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32)
    assert hf.config.model_type == "qwen3_vl" and hf.config.vision_config.deepstack_visual_indexes == [0, 1]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    hf.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("packing", [False, True])
def test_qwen3_vl_log_probs_equal_transformers_forward(tiny_qwen3_vl, packing, monkeypatch):
    """DeepStack features reach the first decoder layers at the image tokens, padded and packed; without them the
    log-probs of the rows with images differ (the comparison can fail)."""
    from rlspmd.models import vision

    assert_log_probs_equal_transformers(tiny_qwen3_vl, packing=packing)
    monkeypatch.setattr(vision, "deepstack_inputs", lambda *a, **k: {})
    with pytest.raises(AssertionError, match="Mismatched elements"):
        assert_log_probs_equal_transformers(tiny_qwen3_vl, packing=packing)


def test_qwen3_vl_mrope_positions_equal_transformers(tiny_qwen3_vl):
    from transformers import AutoModelForImageTextToText

    from rlspmd.models.vision import VisionSpec, mrope_position_ids

    batch, _ = vl_rows(tiny_qwen3_vl)
    hf = AutoModelForImageTextToText.from_pretrained(str(tiny_qwen3_vl), dtype=torch.float32)
    ids, mask, images = batch["input_ids_BL"], batch["attention_mask_BL"], batch["images"]
    grids = torch.cat([im.grid_thw for im in images if im is not None])
    expected, expected_delta = hf.model.get_rope_index(
        ids, mm_token_type_ids=(ids == hf.config.image_token_id).int(), image_grid_thw=grids, attention_mask=mask
    )
    spec = VisionSpec.of(hf.config)
    assert spec.deepstack == 2
    pos, delta, _ = mrope_position_ids(ids, mask, images, spec=spec, prompt_len=ids.shape[1] - 5)
    assert torch.equal(pos, expected) and torch.equal(delta, expected_delta[:, 0])


def test_qwen3_vl_native_greedy_generation_equals_transformers_generate(tiny_qwen3_vl, monkeypatch):
    """The native engine's prefill adds the DeepStack features after the first layers: greedy tokens (one batch, and
    request by request with continuous batching) equal ``generate``'s on rows with one, two and no images; without
    the features the rows with images decode other tokens (the comparison can fail)."""
    from rlspmd.models import vision_decoder
    from rlspmd.models.loader import load_causal_lm
    from rlspmd.rollout.continuous import Request, SlotDecoder, serve
    from rlspmd.rollout.sampling import SamplingParams

    batch, refs = vl_rows(tiny_qwen3_vl)
    n = 8
    expected = assert_native_greedy_equals_transformers(tiny_qwen3_vl, batch, refs, n)
    assert len({tuple(e) for e in expected}) == len(expected)  # the rows (their images) lead to different tokens
    hf = load_causal_lm(tiny_qwen3_vl, dtype="float32", attn_implementation="sdpa", field_name="model")
    requests = Requests(
        [
            Request(
                k, r["ids"][0, : r["prompt_len"]].tolist(), n, seed=0, images=r["images"], prompt_len=r["prompt_len"]
            )
            for k, r in enumerate(refs)
        ]
    )
    serve(
        SlotDecoder(hf, slots=2, max_len=128, device=torch.device("cpu")),
        requests,
        SamplingParams(temperature=0.0),
        slots=2,
        eos_ids=[],
    )
    assert [requests.results[k] for k in range(len(refs))] == expected
    monkeypatch.setattr(vision_decoder, "deepstack_hook", lambda *a: None)
    with pytest.raises(AssertionError):
        assert_native_greedy_equals_transformers(tiny_qwen3_vl, batch, refs, n)


def test_qwen3_vl_loads_sharded_and_export_round_trips(tiny_qwen3_vl, mesh_of_one, tmp_path):
    """transformers saves Qwen3-VL (and the Hub holds it) in its own layout (``model.language_model.*``,
    ``model.visual.*``, DeepStack mergers and the learned position embedding included): it loads sharded under FSDP2,
    and the HF export loads back in transformers with the same weights and the image processor."""
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from rlspmd.config import FSDPConfig, ModelConfig, NativeConfig
    from rlspmd.engines.fsdp import FSDPEngine, fsdp_role_module
    from rlspmd.models.loader import load_tokenizer
    from rlspmd.models.vision import model_problems
    from rlspmd.trainer.checkpoint import save_hf_model

    state = load_file(tiny_qwen3_vl / "model.safetensors")
    assert (
        "model.visual.deepstack_merger_list.1.linear_fc2.weight" in state and "model.visual.pos_embed.weight" in state
    )
    model = ModelConfig(path=str(tiny_qwen3_vl), sharded_load=True)
    module, weights = fsdp_role_module("policy", model.path, model=model, field_name="model.path")
    engine = FSDPEngine(
        module,
        module.hf,
        mesh=mesh_of_one["dp"],
        device=torch.device("cpu"),
        fsdp=FSDPConfig(),
        optim=None,
        weights=weights,
    )
    tok = load_tokenizer(tiny_qwen3_vl, field_name="model")
    out = save_hf_model(engine, tok, tiny_qwen3_vl, tmp_path / "export", is_main=True)
    assert AutoImageProcessor.from_pretrained(str(out)).patch_size == 16
    back = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).state_dict()
    original = AutoModelForImageTextToText.from_pretrained(str(tiny_qwen3_vl), dtype=torch.float32).state_dict()
    assert back.keys() == original.keys()
    for k in original:
        assert torch.equal(back[k], original[k]), k
    kw = dict(freeze_vision_tower=True, critic=False, tp=1, engine=FSDPConfig(), lora=False)
    assert model_problems(str(tiny_qwen3_vl), **kw, rollout_engine=NativeConfig()) == []


@pytest.mark.slow
@pytest.mark.dist
def test_qwen3_vl_trains_a_grpo_step_on_two_ranks(tiny_qwen3_vl, tmp_path):
    """A Qwen3-VL trains through ``rlspmd.train`` on 2 ranks with the native engine (colocated, reading the
    FSDP2-gathered weights in place): the rollout's log-probs (its prefill adds the DeepStack features) equal the
    trainer's (packed, DeepStack at the packed image tokens) up to float noise, and the update has a gradient."""
    from conftest import torchrun
    from rl_run import rl_args, write_reward

    data = tmp_path / "data"
    data.mkdir()
    rows = [
        mm_row(
            " and ".join(["<image>"] * len(sizes)) + ": what colour?",
            [{"bytes": png(k * 10 + j, size)} for j, size in enumerate(sizes)],
        )
        for k, sizes in enumerate(SIZES[:4])
    ]
    write_rows(data / "train.parquet", rows)
    write_rows(data / "test.parquet", rows)
    out = tmp_path / "run"
    args = rl_args(tiny_qwen3_vl, data, out, steps=1, reward=write_reward(tmp_path))
    torchrun([*args, "--data.max-prompt-length", "64", "--data.max-val-samples", "4"], 2, timeout=600)
    rows = [r for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if r["step"]]
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["actor/grad_norm"] > 0 and rows[0]["rollout/logprob_gap"] < 1e-4, rows[0]
