"""Prompt datasets in verl's schema, the chat template, and a seeded resumable sampler.

A row: ``data_source`` (str), ``prompt`` (list of ``{role, content}`` messages), ``ability``,
``reward_model: {style, ground_truth}``, ``extra_info`` (dict). Parquet files prepared for verl load
unchanged. Files are read through ``datasets``; prompts are rendered with the model's chat template
(``add_generation_prompt=True``) and tokenized once, up front, on the rank that loads them (rank 0: it
decides the step's prompts and scatters them).

Prompts longer than ``max_prompt_length`` tokens are dropped (counted and logged) or rejected with the
file and row named. A prompt without text (no user message with non-blank content) is rejected naming the file and
row, or dropped and counted (``data.empty_prompts``): it would be trained on as if it were a question. A jsonl line
that is not JSON (a file cut off mid-write) is named by file and line number.

Multimodal rows (verl's: ``<image>`` in the prompt text, the images in ``data.image_key``) need a vision-language
model: ``rlspmd/data/images.py`` counts their image tokens when the file is read and processes the images when a row
is batched, into the batch's ``images`` objects.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from rlspmd.data.images import MultimodalPrompts, image_parts, undecoded
from rlspmd.models.vision import ImageInputs
from rlspmd.protocol import Batch

log = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("data_source", "reward_model")


KINDS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


def check_data_file(f: str, *, field_name: str) -> Path:
    """The file exists and is parquet or jsonl (no reading)."""
    path = Path(f).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{field_name}: data file {path} does not exist")
    if path.suffix.lower() not in KINDS:
        raise ValueError(f"{field_name}: {path} is neither .parquet nor .jsonl")
    return path


def read_rows(files: list[str], *, prompt_key: str, field_name: str):
    """Load parquet/jsonl files with ``datasets``; check existence, emptiness and the required columns."""
    import datasets

    if not files:
        raise ValueError(f"{field_name} is empty: give at least one parquet or jsonl file")
    tables = []
    for f in files:
        path = check_data_file(f, field_name=field_name)
        kind = KINDS[path.suffix.lower()]
        if _has_no_rows(path, kind):  # `datasets` would only say 'Instruction "train" corresponds to no data'
            raise ValueError(f"{field_name}: {path} has no rows")
        try:
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as e:  # noqa: BLE001 - name the file (and the line, for jsonl) for any reader failure
            where = _first_bad_json_line(path) if kind == "json" else None
            raise ValueError(f"{field_name}: cannot read {path}{where or ''}: {type(e).__name__}: {e}") from None
        if len(ds) == 0:
            raise ValueError(f"{field_name}: {path} has no rows")
        missing = [c for c in (*REQUIRED_COLUMNS, prompt_key) if c not in ds.column_names]
        if missing:
            raise ValueError(f"{field_name}: {path} lacks required column(s) {missing} (has {ds.column_names})")
        tables.append((str(path), ds))
    return tables


def _first_bad_json_line(path: Path) -> str | None:
    """`` line N: <why>`` for the first line of a jsonl file that is not one JSON object (``datasets`` reports only
    a generation error), or None."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.rstrip(b"\r\n"))
            except ValueError as e:  # also UnicodeDecodeError
                why = f"{e.msg}: column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
                return f" line {n}: not valid JSON ({why}); the file may have been cut off while it was written"
            if not isinstance(row, dict):
                return f" line {n}: a JSON {type(row).__name__}, not an object"
    return None


def _has_no_rows(path: Path, kind: str) -> bool:
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows == 0
        with open(path, "rb") as f:
            return not any(line.strip() for line in f)
    except Exception:  # noqa: BLE001 - an unreadable file is reported by the reader below, naming the file
        return False


def has_user_text(messages: list[dict]) -> bool:
    """Some user message has non-blank text (``content`` a string, or a list of parts with ``text``) or an image."""
    for m in messages:
        if m.get("role", "user") != "user":
            continue
        content = m.get("content")
        if isinstance(content, list):  # multimodal parts: [{"type": "text", "text": ...}, {"type": "image"}, ...]
            if any(isinstance(part, dict) and part.get("type") == "image" for part in content):
                return True
            content = " ".join(part.get("text") or "" for part in content if isinstance(part, dict))
        if isinstance(content, str) and content.strip():
            return True
    return False


class PromptDataset:
    def __init__(
        self,
        files: list[str],
        tokenizer,
        *,
        prompt_key: str,
        max_prompt_length: int,
        overlong: str = "drop",
        empty: str = "error",
        field_name: str = "data.train_files",
        tools: list[dict] | None = None,
        image_key: str = "images",
        vision: MultimodalPrompts | None = None,
    ):
        """``tools``: tool schemas rendered into every prompt through the chat template's ``tools`` argument
        (``rollout.agent``); None renders as before. ``vision``: a vision-language model's image processing
        (``data/images.py``): rows' ``image_key`` images become ``images`` in their batches; None (a text model)
        refuses rows with images."""
        self.tokenizer = tokenizer
        self.vision = vision
        self.prompt_ids: list[list[int]] = []
        self.rows: list[dict] = []
        self.n_dropped = 0
        self.n_empty = 0  # dropped for having no text (empty="drop")
        for path, ds in read_rows(files, prompt_key=prompt_key, field_name=field_name):
            texts = []
            with_images = image_key in ds.column_names
            if with_images:
                ds = undecoded(ds, image_key)
            for i, row in enumerate(ds):
                where = f"{field_name}: {path} row {i}"
                messages = row[prompt_key]
                if isinstance(messages, str):  # plain-text prompt: treat as one user turn
                    messages = [{"role": "user", "content": messages}]
                if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
                    raise ValueError(f"{field_name}: {path} row {i}: `{prompt_key}` must be a list of chat messages")
                images = list(row[image_key] or []) if with_images else []
                if images and vision is None:
                    raise ValueError(
                        f"{where}: the row has {len(images)} image(s) in `{image_key}`, but the model reads text only "
                        "(vision-language models: docs/vision.md)"
                    )
                if vision is not None:
                    messages = image_parts(messages, len(images), where=where)
                if not has_user_text(messages):
                    if empty == "drop":
                        self.n_empty += 1
                        continue
                    raise ValueError(
                        f"{field_name}: {path} row {i}: the prompt has no user message with text "
                        f"({prompt_key}={messages!r}); "
                        "fix the row, or skip such rows with data.empty_prompts=drop"
                    )
                gt = (row["reward_model"] or {}).get("ground_truth")
                if gt is None:
                    raise ValueError(f"{field_name}: {path} row {i}: reward_model.ground_truth is missing")
                text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
                texts.append(text)
                counts = []
                if vision is not None:  # one placeholder token per image token, as the model's processor expands them
                    counts = vision.token_counts(images, where=where, base=Path(path).parent)
                    texts[-1] = vision.expand(text, counts, where=where)
                info = dict(row.get("extra_info") or {})
                info.setdefault("index", i)
                self.rows.append(
                    {
                        "data_source": row["data_source"],
                        "ground_truth": gt,
                        "extra_info": info,
                        "prompt_text": text,
                        "prompt_messages": messages,
                        "where": (path, i),
                        "agent_name": row.get("agent_name"),
                        "images": images,
                        "image_tokens": counts,
                    }
                )
            if texts:
                self.prompt_ids.extend(tokenizer(texts, add_special_tokens=False)["input_ids"])
        if self.n_empty:
            log.warning("%s: dropped %d prompts with no user text (data.empty_prompts=drop)", field_name, self.n_empty)
        if not self.prompt_ids:
            raise ValueError(f"{field_name}: no prompt has any user text")
        keep = []
        for j, ids in enumerate(self.prompt_ids):
            if len(ids) <= max_prompt_length:
                keep.append(j)
            elif overlong == "error":
                path, i = self.rows[j]["where"]
                raise ValueError(
                    f"{field_name}: {path} row {i}: prompt has {len(ids)} tokens > "
                    f"data.max_prompt_length={max_prompt_length}"
                )
        self.n_dropped = len(self.prompt_ids) - len(keep)
        if self.n_dropped:
            log.warning(
                "%s: dropped %d of %d prompts longer than %d tokens",
                field_name,
                self.n_dropped,
                len(self.prompt_ids),
                max_prompt_length,
            )
        if not keep:
            raise ValueError(f"{field_name}: every prompt is longer than data.max_prompt_length={max_prompt_length}")
        self.prompt_ids = [self.prompt_ids[j] for j in keep]
        self.rows = [self.rows[j] for j in keep]

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def batch(self, indices: list[int]) -> Batch:
        """Left-padded prompts with per-sample objects; ``uid_B`` is the position in this batch (the group id)."""
        ids = [self.prompt_ids[i] for i in indices]
        P = max(len(x) for x in ids)
        pad = self.tokenizer.pad_token_id
        prompts = torch.full((len(ids), P), pad, dtype=torch.long)
        mask = torch.zeros(len(ids), P, dtype=torch.long)
        for r, x in enumerate(ids):
            prompts[r, P - len(x) :] = torch.tensor(x)
            mask[r, P - len(x) :] = 1
        rows = [self.rows[i] for i in indices]
        objects = {
            "data_source": [r["data_source"] for r in rows],
            "ground_truth": [r["ground_truth"] for r in rows],
            "extra_info": [r["extra_info"] for r in rows],
            "prompt_text": [r["prompt_text"] for r in rows],
            "prompt_messages": [r["prompt_messages"] for r in rows],  # a reward model re-renders them
            "agent_name": [r["agent_name"] for r in rows],  # verl's per-row agent (rollout.agent; None: the default)
        }
        if self.vision is not None:  # decoded and processed here, once: the ImageInputs travel with their rows
            objects["images"] = [self._images(r) for r in rows]
        return Batch({"prompts_BP": prompts, "prompt_mask_BP": mask, "uid_B": torch.arange(len(ids))}, objects)

    def _images(self, row: dict) -> ImageInputs | None:
        if not row["images"]:
            return None
        path, i = row["where"]
        images = self.vision.images(row["images"], where=f"{path} row {i}", base=Path(path).parent)
        assert images.tokens_per_image(self.vision.spec.merge_size) == row["image_tokens"], (path, i)
        return images


class EpochSampler:
    """Global batches of dataset indices: a seeded permutation per epoch, incomplete tail batch dropped.

    Deterministic in (seed, epoch) and resumable from ``state_dict`` (epoch, position).
    """

    def __init__(self, size: int, batch_size: int, *, seed: int, shuffle: bool = True):
        if batch_size > size:
            raise ValueError(f"data.train_batch_size={batch_size} is larger than the dataset ({size} prompts)")
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._perm: tuple[int, np.ndarray] | None = None

    def _order(self) -> np.ndarray:
        if self._perm is None or self._perm[0] != self.epoch:
            order = (
                np.random.default_rng([self.seed, self.epoch]).permutation(self.size)
                if self.shuffle
                else np.arange(self.size)
            )
            self._perm = (self.epoch, order)
        return self._perm[1]

    def next_batch(self) -> list[int]:
        if self.position + self.batch_size > self.size:
            self.epoch, self.position = self.epoch + 1, 0
        idx = self._order()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return idx.tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
