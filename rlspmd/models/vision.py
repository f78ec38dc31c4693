"""Vision-language models in the trainer: Qwen2-VL / Qwen2.5-VL (a vision tower and merger in front of a Qwen2
language model with M-RoPE) and Qwen3-VL (the same shape with a Qwen3 language model, interleaved M-RoPE, and DeepStack:
features of intermediate vision blocks added to the hidden states of the first decoder layers at the image tokens).

A sample's images travel with it as one per-sample object, ``ImageInputs`` (the pixel patches and ``(t, h, w)`` grids
the model's own image processor made when the prompts were read, ``rlspmd/data/images.py``), in the Batch's
``images`` list: they are selected, repeated, packed, balanced and dispatched with the rest of the row, and never
re-decoded. The prompt's token ids already hold one ``<|image_pad|>`` per image token (the processor's expansion).

``VisionLanguagePolicy`` is ``CausalLMPolicy`` (``models/policy.py``) for such a model. Its forward

* runs the vision tower once per distinct ``ImageInputs`` object of the micro-batch (a prompt's ``n`` samples share
  one: repeated rows are references to the same object), in row order;
* embeds the tokens and writes the image features over the image placeholders of the *prompt* columns (a response
  that samples the placeholder token id keeps it as text: the rollout engines treat generated tokens as text too);
* computes the 3-D M-RoPE position ids (``mrope_position_ids``: text tokens count on, an image's tokens take its
  temporal/height/width grid coordinates from where the text stopped, and text after it resumes past the image's
  largest side), and packs them with the tokens (``models/packing.py`` carries the leading dim);
* runs the language model on the embeddings (Qwen3-VL: with the DeepStack features and the image tokens' mask, which
  its language model adds after each of its first layers; padded or packed, the mask marks the same tokens the
  features replaced) and computes log-probs and entropy as the text policy does.

Simplifications: images only (no video); the M-RoPE positions and the placeholders' indices are computed on the host
from the micro-batch's token ids (one device-to-host copy per micro-batch, which the text path avoids); tensor
parallelism, a critic and a reward model over images are not supported (``vision_problems``, checked at start-up).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rlspmd.models.logprobs import DEFAULT_CHUNK, chunked_logprobs
from rlspmd.models.packing import TokenCounts, pack, packed_hidden_states
from rlspmd.models.attn_kernels import packed_kernel

VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""``model_type`` of the vision-language families the trainer and the native engine run."""


def is_vision_language(config) -> bool:
    """A config of a vision-language model this module runs (``VISION_MODEL_TYPES``)."""
    return config.model_type in VISION_MODEL_TYPES


@dataclass(frozen=True, eq=False)
class ImageInputs:
    """One sample's images as its model's image processor made them. Compared and hashed by identity: the rows of one
    prompt's samples hold the same object, and the vision tower runs once for it."""

    pixel_values: torch.Tensor
    """(patches, channels * temporal_patch * patch * patch) float32, the images' patches in order."""
    grid_thw: torch.Tensor
    """(images, 3) int64: each image's (temporal, height, width) grid in patches."""
    source: str = ""
    """Where the images came from (``file row i``), for the sample log."""

    def tokens_per_image(self, merge_size: int) -> list[int]:
        """Image tokens (placeholders in the prompt) of each image: its patches over the merger's ``merge_size**2``."""
        return (self.grid_thw.prod(-1) // merge_size**2).tolist()


@dataclass(frozen=True)
class VisionSpec:
    """What the trainer needs to know of a vision-language config."""

    image_token_id: int
    merge_size: int
    """Patches merged per image token, per side (``vision_config.spatial_merge_size``)."""
    deepstack: int = 0
    """DeepStack levels (Qwen3-VL: ``len(vision_config.deepstack_visual_indexes)``): the vision tower's extra
    features, one set per decoder layer ``0 .. deepstack - 1``, added to its output at the image tokens; 0: none."""

    @classmethod
    def of(cls, config) -> "VisionSpec":
        deepstack = len(config.vision_config.deepstack_visual_indexes) if config.model_type == "qwen3_vl" else 0
        return cls(
            image_token_id=config.image_token_id,
            merge_size=config.vision_config.spatial_merge_size,
            deepstack=deepstack,
        )


def vision_inputs(batch) -> dict:
    """The keywords a model wrapper's forward takes for the rows of ``batch`` beyond their tokens: ``images`` when the
    batch carries them (a vision-language run), nothing otherwise."""
    return {"images": batch["images"]} if "images" in batch else {}


def mrope_position_ids(
    input_ids_BL: torch.Tensor,
    attention_mask_BL: torch.Tensor,
    images: Sequence[ImageInputs | None],
    *,
    spec: VisionSpec,
    prompt_len: int | Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M-RoPE position ids of a padded batch, on the host: ``(position_ids_3BL, deltas_B, image_index_N)``.

    In each row's valid tokens, the ``<|image_pad|>`` tokens of the first ``prompt_len`` columns (one bound for every
    row, or one per row) are its images' tokens, image after image in order (each a contiguous run of
    ``tokens_per_image``); an image of grid ``(t, h, w)`` (``h' = h / merge``, ``w' = w / merge``) starting where the
    text positions reached ``p`` gets ``(p + t_i, p + h_i, p + w_i)``, and the text after it continues at
    ``p + max(h', w')``; text positions are equal in the three dims. Padding gets 0. ``deltas_B``: max position + 1 -
    valid tokens per row (a decode step's position is its index plus the delta). ``image_index_N``: the placeholders'
    flat indices into ``B * L``, in row order.
    """
    ids, valid = input_ids_BL.detach().cpu(), attention_mask_BL.detach().cpu().bool()
    B, L = ids.shape
    if len(images) != B:
        raise ValueError(f"{len(images)} image entries for a batch of {B} rows")
    pos = torch.zeros(3, B, L, dtype=torch.long)
    deltas = torch.zeros(B, dtype=torch.long)
    index = []
    m = spec.merge_size
    for b in range(B):
        cols = valid[b].nonzero().squeeze(-1)
        n = cols.numel()
        limit = prompt_len if isinstance(prompt_len, int) else prompt_len[b]
        found = ((ids[b, cols] == spec.image_token_id) & (cols < limit)).nonzero().squeeze(-1)
        grids = images[b].grid_thw.tolist() if images[b] is not None else []
        sizes = images[b].tokens_per_image(m) if images[b] is not None else []
        if sum(sizes) != found.numel():
            raise ValueError(
                f"row {b}: its prompt has {found.numel()} image placeholder tokens, its {len(sizes)} image(s) "
                f"have {sum(sizes)} image tokens (the prompt and its images do not belong together)"
            )
        p = torch.empty(3, n, dtype=torch.long)
        at = cur = start = 0  # text cursor in the valid tokens, position reached, next placeholder
        for (t, h, w), size in zip(grids, sizes):
            s = int(found[start])
            if int(found[start + size - 1]) - s + 1 != size:
                raise ValueError(f"row {b}: an image's {size} placeholder tokens are not contiguous in the prompt")
            start += size
            p[:, at:s] = torch.arange(s - at) + cur
            cur += s - at
            hh, ww = h // m, w // m
            p[0, s : s + size] = torch.arange(t).repeat_interleave(hh * ww) + cur
            p[1, s : s + size] = torch.arange(hh).repeat_interleave(ww).repeat(t) + cur
            p[2, s : s + size] = torch.arange(ww).repeat(t * hh) + cur
            cur += max(hh, ww)
            at = s + size
        p[:, at:] = torch.arange(n - at) + cur
        pos[:, b, cols] = p
        deltas[b] = int(p.max()) + 1 - n if n else 0
        index.append(b * L + cols[found])
    image_index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
    return pos, deltas, image_index


@dataclass(frozen=True)
class ImageFeatures:
    """The vision tower's output for a batch's image tokens, in row order."""

    merged: torch.Tensor
    """(image tokens, hidden): what replaces the image placeholders' embeddings."""
    deepstack: list[torch.Tensor]
    """(image tokens, hidden) per DeepStack level (Qwen3-VL): decoder layer ``i`` adds ``deepstack[i]`` to its output
    at the image tokens. Empty for a model without DeepStack."""


def image_embeddings(
    hf_model: nn.Module, images: Sequence[ImageInputs | None], *, device: torch.device
) -> ImageFeatures | None:
    """The vision tower's features of every row's images, in row order (None when no row has any). Each distinct
    ``ImageInputs`` runs through the tower once."""
    slot: dict[int, int] = {}
    unique: list[ImageInputs] = []
    order: list[int] = []
    for im in images:
        if im is None:
            continue
        if id(im) not in slot:
            slot[id(im)] = len(unique)
            unique.append(im)
        order.append(slot[id(im)])
    if not unique:
        return None
    visual = hf_model.model.visual
    dtype = visual.patch_embed.proj.weight.dtype
    pixels = torch.cat([u.pixel_values for u in unique]).to(device=device, dtype=dtype)
    grid = torch.cat([u.grid_thw for u in unique]).to(device)
    out = visual(pixels, grid_thw=grid)
    sizes = [sum(u.tokens_per_image(visual.spatial_merge_size)) for u in unique]

    def in_row_order(x: torch.Tensor) -> torch.Tensor:
        per = x.split(sizes)
        return torch.cat([per[i] for i in order])

    deepstack = out.deepstack_features if VisionSpec.of(hf_model.config).deepstack else []
    return ImageFeatures(in_row_order(out.pooler_output), [in_row_order(x) for x in deepstack])


def with_images(embeds_NH: torch.Tensor, index_N: torch.Tensor, features: ImageFeatures | None) -> torch.Tensor:
    """``embeds_NH`` (flat tokens) with rows ``index_N`` replaced by the image ``features`` (differentiable in both)."""
    if features is None:
        assert index_N.numel() == 0, "image placeholders without images"
        return embeds_NH
    return embeds_NH.index_put((index_N.to(embeds_NH.device),), features.merged.to(embeds_NH.dtype))


def deepstack_inputs(features: ImageFeatures | None, index_N: torch.Tensor, shape: tuple[int, ...], device) -> dict:
    """The keywords that make a Qwen3-VL language model's forward add the DeepStack features: the image tokens' mask
    (``shape``: the tokens' ``(B, L)``, or ``(1, T)`` packed; ``index_N`` their flat indices, ascending, in the
    features' order) and the features. Nothing for a model without DeepStack or a micro-batch without images."""
    if features is None or not features.deepstack:
        return {}
    mask = torch.zeros(shape, dtype=torch.bool, device=device)
    mask.view(-1)[index_N.to(device)] = True
    return {"visual_pos_masks": mask, "deepstack_visual_embeds": features.deepstack}


def deepstack_hook(features: ImageFeatures | None, index_N: torch.Tensor):
    """For the native decoders' prefill: ``(i, h_BSH) -> h_BSH`` adding DeepStack level ``i``'s features at the flat
    token indices ``index_N`` after decoder layer ``i`` (as transformers' language model does); None when there is
    nothing to add."""
    if features is None or not features.deepstack:
        return None
    deep = features.deepstack

    def after_layer(i: int, h: torch.Tensor) -> torch.Tensor:
        if i >= len(deep):
            return h
        flat = h.flatten(0, 1)
        index = index_N.to(h.device)
        return flat.index_put((index,), flat[index] + deep[i].to(h.dtype)).view_as(h)

    return after_layer


class VisionLanguagePolicy(nn.Module):
    """Wraps an HF ``*ForConditionalGeneration`` vision-language model; ``forward`` returns ``(logprobs_BR,
    entropy_BR)`` of the response tokens, like ``CausalLMPolicy``, given the rows' ``images``."""

    def __init__(
        self,
        hf_model: nn.Module,
        *,
        logprob_chunk: int | None = DEFAULT_CHUNK,
        packing: bool = False,
        attn_kernel: str = "auto",
    ):
        super().__init__()
        self.hf = hf_model
        self.logprob_chunk = logprob_chunk
        self.packing = packing
        self.attn_kernel = attn_kernel
        self.spec = VisionSpec.of(hf_model.config)
        self.moe = None  # no mixture-of-experts layers (``CausalLMPolicy.moe``: rlspmd runs no MoE vision model)

    @property
    def config(self):
        return self.hf.config

    def forward(
        self,
        input_ids_BL: torch.Tensor,
        attention_mask_BL: torch.Tensor,
        position_ids_BL: torch.Tensor,
        *,
        images: Sequence[ImageInputs | None],
        response_len: int,
        temperature: float = 1.0,
        with_entropy: bool = True,
        counts: TokenCounts | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids_BL`` (1-D positions) is replaced by the M-RoPE positions computed from the tokens."""
        head = self.hf.get_output_embeddings()
        kw = dict(bias=head.bias, temperature=temperature, chunk_size=self.logprob_chunk, with_entropy=with_entropy)
        lm = self.hf.get_decoder()
        B, L = input_ids_BL.shape
        dev = input_ids_BL.device
        pos_3BL, _, image_index = mrope_position_ids(
            input_ids_BL, attention_mask_BL, images, spec=self.spec, prompt_len=L - response_len
        )
        features = image_embeddings(self.hf, images, device=dev)
        R = response_len
        if not self.packing:
            embeds = with_images(lm.embed_tokens(input_ids_BL).flatten(0, 1), image_index, features).view(B, L, -1)
            hidden = lm(
                inputs_embeds=embeds,
                attention_mask=attention_mask_BL,
                position_ids=pos_3BL.to(dev),
                use_cache=False,
                **deepstack_inputs(features, image_index, (B, L), dev),
            ).last_hidden_state
            return chunked_logprobs(hidden[:, L - R - 1 : L - 1], head.weight, input_ids_BL[:, -R:], **kw)
        kernel = packed_kernel(self.attn_kernel, dev, head.weight.dtype)
        packed = pack(input_ids_BL, attention_mask_BL, pos_3BL.to(dev), kernel=kernel, response_len=R, counts=counts)
        # the placeholders' places in the pack: the pack keeps row-major order, so the features' order is kept
        where = torch.full((B * L,), -1, dtype=torch.long)
        where[packed.token_index_T.cpu()] = torch.arange(packed.num_tokens)
        at = where[image_index]
        embeds = with_images(lm.embed_tokens(packed.input_ids_1T[0]), at, features)
        deep = deepstack_inputs(features, at, (1, packed.num_tokens), dev)
        hidden_TH = packed_hidden_states(lm, packed, inputs_embeds=embeds[None], **deep)
        targets_N = packed.target_pos_N
        lp_N, ent_N = chunked_logprobs(
            hidden_TH.index_select(0, packed.predictor_pos_N),
            head.weight,
            packed.input_ids_1T[0].index_select(0, targets_N),
            **kw,
        )
        return packed.scatter_responses(lp_N), packed.scatter_responses(ent_N)


def policy_module(hf_model: nn.Module, *, packing: bool, attn_kernel: str) -> nn.Module:
    """The training wrapper of an HF model: ``VisionLanguagePolicy`` for a vision-language model, else
    ``CausalLMPolicy``."""
    from rlspmd.models.policy import CausalLMPolicy

    cls = VisionLanguagePolicy if is_vision_language(hf_model.config) else CausalLMPolicy
    return cls(hf_model, packing=packing, attn_kernel=attn_kernel)


def auto_class(config):
    """The transformers auto class that builds a policy's model from ``config``."""
    import transformers

    if is_vision_language(config):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def vision_blocks(hf_model: nn.Module) -> list[nn.Module]:
    """The vision tower's blocks of a vision-language model (FSDP units of their own; Qwen3-VL's DeepStack mergers stay
    in the root unit with the patch embedding and the final merger); none for a text model."""
    if not is_vision_language(hf_model.config):
        return []
    return list(hf_model.model.visual.blocks)


def freeze_vision_tower(hf_model: nn.Module) -> None:
    """``actor.freeze_vision_tower``: the vision tower and its mergers (Qwen3-VL's DeepStack mergers included) get no
    gradients (and no optimiser state)."""
    hf_model.model.visual.requires_grad_(False)


def attn_implementation(config, text: str) -> str | dict[str, str]:
    """``attn_implementation`` to build a model with: ``text`` for a text model; for a vision-language model, ``text``
    in the language model and SDPA in the vision tower (its attention is bidirectional within each image window, which
    the packed causal kernels are not)."""
    if not is_vision_language(config):
        return text
    return {"": text, "text_config": text, "vision_config": "sdpa"}


def model_problems(
    path: str, *, freeze_vision_tower: bool, critic: bool, tp: int, engine, lora: bool, rollout_engine
) -> list[tuple[str, object, str]]:
    """``(field, value, why)`` for what the actor model at ``path`` cannot run with: ``actor.freeze_vision_tower`` on a
    text model, and for a vision-language model what is not supported yet: a critic, tensor parallelism, LoRA, a
    training engine without ``supports_vision`` (megatron), a rollout engine that does not pass the images to its model
    (``serves_images``: vLLM). ``engine`` / ``rollout_engine``: the config's components. Reads ``config.json`` only;
    nothing when it is unreadable (the model-file check reports that)."""
    import json
    from pathlib import Path

    try:
        model_type = json.loads((Path(path).expanduser() / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError):
        return []
    if model_type not in VISION_MODEL_TYPES:
        why = f"actor.model.path is a {model_type} model, which has no vision tower"
        return [("actor.freeze_vision_tower", True, why)] if freeze_vision_tower else []
    unsupported = f"is not supported with a vision-language model ({model_type}) yet"
    out = []
    if critic:
        out.append(("algorithm.adv_estimator", "a critic", f"a critic (value model over images) {unsupported}"))
    if tp > 1:
        out.append(("mesh.actor_tp", tp, f"tensor parallelism {unsupported}"))
    if not engine.supports_vision:
        out.append(("actor.engine", engine.name, f"the {engine.name} engine {unsupported}; use fsdp"))
    if lora:
        out.append(("actor.lora.rank", "> 0", f"LoRA {unsupported}"))
    if not rollout_engine.serves_images:
        why = f"the {rollout_engine.name} engine does not pass images to its model yet: use rollout.engine:native"
        out.append(("rollout.engine", rollout_engine.name, why))
    return out


def checkpoint_keys(name: str) -> list[str]:
    """Where a vision-language model's parameter ``name`` (transformers 5's layout: ``model.language_model.*``,
    ``model.visual.*``) may be stored: under its own name, or in the layout Qwen2-VL / Qwen2.5-VL checkpoints on the
    Hub carry (``model.*`` for the language model, ``visual.*``)."""
    for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(new):
            return [name, old + name[len(new) :]]
    return [name]
