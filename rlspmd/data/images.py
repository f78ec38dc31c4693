"""Images in verl's multimodal rows, turned into model inputs once, when prompts are read.

A row's prompt holds ``<image>`` placeholders in its message text and its ``images`` column one entry per
placeholder, in order: ``{"bytes": ...}`` (how ``datasets`` and verl's preprocessing scripts store an image in
parquet), ``{"path": ...}``, a path string, or an already decoded ``PIL.Image`` (``datasets`` decodes columns of its
``Image`` feature). ``MultimodalPrompts``

* splits each message's text at the placeholders into content parts (``[{"type": "image"}, {"type": "text", ...}]``,
  verl's layout), which the model's chat template renders with its own vision tokens;
* decodes the images (RGB) and runs the model's own image processor (``AutoImageProcessor`` from the model directory;
  transformers picks its PIL backend where torchvision is absent) into one ``ImageInputs`` per row: the pixel
  patches and ``(t, h, w)`` grids;
* repeats each rendered image placeholder token once per image token, as the model's processor does
  (``<|image_pad|>`` x ``t * h * w / merge**2``).

The model's ``AutoProcessor`` is not used: for Qwen2-VL / Qwen2.5-VL it also builds a video processor, which needs
torchvision. The tokenizer (with its chat template) and the image processor are the two parts of it that images need.

A missing, unreadable or too small image, or a count of placeholders that differs from the row's images, is a
``ValueError`` naming the file, the row and the image.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import torch

from rlspmd.models.vision import ImageInputs

IMAGE_PLACEHOLDER = "<image>"
"""verl's placeholder for an image in a prompt's text."""


def load_image(item, *, where: str, base: Path | None = None):
    """One ``images`` entry as an RGB ``PIL.Image``. ``base``: the data file's directory, where a relative path that
    does not exist from the working directory is looked up."""
    from PIL import Image

    try:
        if isinstance(item, Image.Image):
            image = item
        elif isinstance(item, dict) and item.get("bytes") is not None:
            image = Image.open(io.BytesIO(item["bytes"]))
        elif isinstance(item, (dict, str)):
            path = Path(item["path"] if isinstance(item, dict) else item)
            if isinstance(item, dict) and item.get("path") is None:
                raise ValueError(f"neither bytes nor a path (keys {sorted(item)})")
            if not path.is_file() and not path.is_absolute() and base is not None and (base / path).is_file():
                path = base / path
            if not path.is_file():
                raise FileNotFoundError(f"image file {path} does not exist")
            image = Image.open(path)
        else:
            raise ValueError(f"an image must be {{'bytes': ...}}, {{'path': ...}} or a path, got {type(item).__name__}")
        return image.convert("RGB")
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds; every one is a bad image of this row
        raise ValueError(f"{where}: {type(e).__name__}: {e}") from None


def image_parts(messages: list[dict], n_images: int, *, where: str) -> list[dict]:
    """``messages`` with each string content split at ``<image>`` into text and image parts (verl's layout); the
    placeholders must number ``n_images``."""
    out, found = [], 0
    for m in messages:
        content = m["content"]
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            parts = []
            for piece in re.split(f"({re.escape(IMAGE_PLACEHOLDER)})", content):
                if piece == IMAGE_PLACEHOLDER:
                    parts.append({"type": "image"})
                    found += 1
                elif piece:
                    parts.append({"type": "text", "text": piece})
            m = {**m, "content": parts}
        elif isinstance(content, list):
            found += sum(isinstance(p, dict) and p.get("type") == "image" for p in content)
        out.append(m)
    if found != n_images:
        raise ValueError(
            f"{where}: the prompt has {found} {IMAGE_PLACEHOLDER} placeholder(s) but the row has {n_images} image(s)"
        )
    return out


class MultimodalPrompts:
    """The model's image processor and image placeholder token. At read time a row's images are decoded (a bad one is
    named now, not steps later) and counted in image tokens, which the prompt's token ids need; the pixels are made
    when the row is batched (``images``), so a dataset's decoded images are never all held in memory."""

    def __init__(self, model_dir: str | Path, tokenizer, *, field_name: str):
        from transformers import AutoConfig, AutoImageProcessor

        from rlspmd.models.vision import VisionSpec, is_vision_language

        config = AutoConfig.from_pretrained(str(model_dir))
        assert is_vision_language(config), config.model_type
        if not (Path(model_dir) / "preprocessor_config.json").is_file():
            raise FileNotFoundError(f"{field_name}: {model_dir} has no preprocessor_config.json (the image processor)")
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        self.spec = VisionSpec.of(config)
        self.tokenizer = tokenizer
        self.image_token = tokenizer.convert_ids_to_tokens(self.spec.image_token_id)

    @classmethod
    def for_model(cls, model_dir: str | Path, tokenizer, *, field_name: str) -> "MultimodalPrompts | None":
        """The model's, or None for a text model."""
        from transformers import AutoConfig

        from rlspmd.models.vision import is_vision_language

        model_dir = Path(model_dir).expanduser()  # model paths may start with ~ (configs/gsm8k_smollm2.py)
        if not is_vision_language(AutoConfig.from_pretrained(str(model_dir))):
            return None
        return cls(model_dir, tokenizer, field_name=field_name)

    def token_counts(self, items: list, *, where: str, base: Path | None = None) -> list[int]:
        """Image tokens of each of a row's ``images`` entries (each decoded once, to check it)."""
        counts = []
        for k, item in enumerate(items):
            image = load_image(item, where=f"{where} image {k}", base=base)
            try:
                patches = self.processor.get_number_of_image_patches(image.height, image.width)
            except ValueError as e:  # smart_resize: smaller than one merged patch, or too elongated
                raise ValueError(f"{where} image {k} ({image.width}x{image.height}): {e}") from None
            counts.append(patches // self.spec.merge_size**2)
        return counts

    def images(self, items: list, *, where: str, base: Path | None = None) -> ImageInputs:
        """A row's ``images`` entries through the image processor."""
        decoded = [load_image(x, where=f"{where} image {k}", base=base) for k, x in enumerate(items)]
        try:
            out = self.processor(images=decoded, return_tensors="pt")
        except ValueError as e:
            raise ValueError(f"{where}: the image processor refused an image: {e}") from None
        return ImageInputs(out["pixel_values"].float(), out["image_grid_thw"].long(), source=where)

    def expand_ids(self, ids: list[int], counts: list[int], *, where: str) -> list[int]:
        """Token ids with their k-th image placeholder repeated ``counts[k]`` times (``expand`` for ids)."""
        at = [j for j, t in enumerate(ids) if t == self.spec.image_token_id]
        if len(at) != len(counts):
            raise ValueError(f"{where}: {len(at)} {self.image_token} token(s) in the prompt for {len(counts)} image(s)")
        out, prev = [], 0
        for j, n in zip(at, counts):
            out += ids[prev:j] + [self.spec.image_token_id] * n
            prev = j + 1
        return out + ids[prev:]

    def picture(self, images: ImageInputs, k: int):
        """Image ``k`` of ``images`` as the model saw it (resized by the processor), rebuilt from its patches: uint8
        ``(height, width, 3)``. For the sample log's thumbnails: the original bytes stay with the data."""
        import numpy as np

        p, m, tp = self.processor.patch_size, self.processor.merge_size, self.processor.temporal_patch_size
        grids = images.grid_thw.tolist()
        start = sum(t * h * w for t, h, w in grids[:k])
        t, h, w = grids[k]
        x = images.pixel_values[start : start + t * h * w].view(t, h // m, w // m, m, m, 3, tp, p, p)[:, ..., 0, :, :]
        x = x.permute(0, 5, 1, 3, 6, 2, 4, 7).reshape(t, 3, h * p, w * p)[0]  # the first frame, (3, H, W)
        mean = torch.tensor(self.processor.image_mean).view(3, 1, 1)
        std = torch.tensor(self.processor.image_std).view(3, 1, 1)
        rgb = ((x * std + mean) * 255).round().clamp(0, 255).to(torch.uint8)
        return np.ascontiguousarray(rgb.permute(1, 2, 0).numpy())

    def expand(self, text: str, counts: list[int], *, where: str) -> str:
        """``text`` (a rendered prompt) with its k-th image placeholder token repeated ``counts[k]`` times."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(counts):
            raise ValueError(
                f"{where}: the chat template rendered {len(pieces) - 1} {self.image_token} token(s) for {len(counts)} "
                "image(s); its template must render an image part as the model's image placeholder"
            )
        return pieces[0] + "".join(self.image_token * n + rest for n, rest in zip(counts, pieces[1:]))


def undecoded(ds, column: str):
    """``ds`` with ``column`` as stored (``{"bytes", "path"}`` dicts) where ``datasets`` would decode it into PIL
    images (its ``Image`` feature): rows then hold the compressed bytes, and images are decoded when used."""
    import datasets

    feature = ds.features[column]
    inner = feature.feature if isinstance(feature, (datasets.Sequence, datasets.List)) else None
    if isinstance(inner, datasets.Image) and inner.decode:
        return ds.cast_column(column, datasets.List(datasets.Image(decode=False)))
    return ds
