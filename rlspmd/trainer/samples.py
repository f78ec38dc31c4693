"""The sample log: a few of each step's samples, and of each validation's, written where a person can read them.

Rank 0 appends one JSON object per sample to ``<trainer.output_dir>/samples/train.jsonl`` (after every step) and
``samples/val.jsonl`` (after every validation round), adds each conversation to TensorBoard's text tab
(``samples/train/<k>``, ``samples/val/<prompt>``: the same validation prompt under one tag, so its answers can be
stepped through), and sends them to the experiment trackers as a table (``samples/train``, ``samples/val``:
``table_row``). ``python -m rlspmd.samples <output_dir>`` prints one readably (``format_sample``).

A record holds what the trainer trained on, not a re-rendering of it: the prompt and response token ids exactly as
they were in the batch (the response is the whole conversation after the prompt: the model's turns, tool results,
interaction turns and template glue), their text decoded with the special tokens kept, and the loss mask as
``loss_spans`` (``[start, end)`` runs of trained response tokens, i.e. ``loss_mask_BR`` at the end of the step,
after any rollout-correction rejection) with ``segments``, the response text cut at those runs.

Cost: the rows are chosen without communication (each DP rank takes the first rows of its share; validation takes the
first ``num_val`` prompts, whose positions every rank knows), copied to the host, and brought to rank 0 with one
gather of small Python objects per step (per validation round while rows are still wanted). Decoding and writing
happen on rank 0 only. ``trainer.samples.enable=False`` builds ``NoSampleLog``: nothing at all.

Resuming at step N keeps the records of steps <= N and moves later ones (a crashed run's steps after its last
checkpoint, now run again) to ``<split>.superseded.jsonl``, as ``metrics.jsonl`` does.

A vision-language run's records also name their prompt's images (``images``: the data file and row each came from,
and a thumbnail of it as the model saw it in ``samples/images/``), and TensorBoard shows them beside the text.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch.distributed.device_mesh import DeviceMesh

from rlspmd.config import SampleLogConfig
from rlspmd.data.images import MultimodalPrompts
from rlspmd.distributed.dispatch import even_split, gather_batch
from rlspmd.metrics import MetricLogger, rewind_jsonl
from rlspmd.models.vision import ImageInputs
from rlspmd.protocol import Batch
from rlspmd.roles.rollout import truncated
from rlspmd.utils.sample_text import format_sample, marked_response

SPLITS = ("train", "val")
THUMBNAIL = 256
"""Largest side, in pixels, of a sample's image thumbnail (``samples/images/``)."""


def loss_spans(mask: list[int]) -> list[list[int]]:
    """``[start, end)`` runs of 1s in a 0/1 list: the trained tokens of a response."""
    spans, start = [], None
    for j, m in enumerate(mask + [0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            spans.append([start, j])
            start = None
    return spans


class SampleLog:
    def __init__(
        self,
        cfg: SampleLogConfig,
        *,
        tokenizer,
        mesh: DeviceMesh,
        output_dir: str,
        eos_ids: list[int],
        max_response_length: int,
        reward_columns: list[str],
        tool_names: list[str] | None,
        val_prompts: int,
        vision: MultimodalPrompts | None = None,
    ):
        """``mesh``: the trainer's DP mesh (the gather's group; its first rank writes). ``reward_columns``: the names of
        ``reward_components_BK``'s columns (``roles/reward.component_columns``). ``tool_names``: multi-turn rollouts'
        tools (None: single-turn samples, no agent fields). ``val_prompts``: the size of the validation set.
        ``vision``: a vision-language model's image processing, on the writing rank (for the images' thumbnails)."""
        self.cfg, self.tokenizer, self.mesh = cfg, tokenizer, mesh
        self.vision = vision
        self.dir = Path(output_dir) / "samples"
        self.eos_ids, self.max_response_length = eos_ids, max_response_length
        self.reward_columns, self.tool_names = reward_columns, tool_names
        self.n_val = min(cfg.num_val, val_prompts)
        self.logger: MetricLogger | None = None  # rank 0, once ``open`` has run

    def open(self, logger: MetricLogger, *, initial_step: int) -> None:
        """Start writing (the rank whose ``logger`` is enabled): rewind the files
        to ``initial_step`` like the metrics."""
        if not logger.enabled:
            return
        self.logger = logger
        self.dir.mkdir(parents=True, exist_ok=True)
        for split in SPLITS:
            path = self.dir / f"{split}.jsonl"
            if path.exists():
                rewind_jsonl(path, initial_step)
        logger.write(
            f"sample log: {self.dir}/{{train,val}}.jsonl (read them with: python -m rlspmd.samples {self.dir.parent})"
        )

    def train(self, batch: Batch, *, step: int) -> None:
        """The step's trained batch (collective over the DP mesh): the first rows of each rank's share, to rank 0."""
        if not self.cfg.num_train:  # the same on every rank: no gather
            return
        share = even_split(self.cfg.num_train, self.mesh.size())[self.mesh.get_local_rank()]
        rows = list(range(min(share, len(batch))))
        self._write(
            "train", step, self._rows(batch, rows, step=step, train=True), tag=lambda k, r: f"samples/train/{k}"
        )

    def validation(self, scored: Batch, *, step: int, start: int) -> None:
        """One validation round's scored samples, this rank's share of prompts ``[start, ...)`` (consecutive shares of
        equal size: ``trainer/prompts.py``): the rows among the first ``num_val`` prompts go to rank 0."""
        if start >= self.n_val:  # every rank knows: no gather once the wanted prompts are past
            return
        first = start + self.mesh.get_local_rank() * len(scored)
        rows = [i for i in range(len(scored)) if first + i < self.n_val]
        self._write(
            "val",
            step,
            self._rows(scored, rows, step=step, train=False, first=first),
            tag=lambda k, r: f"samples/val/{r['position']}",
        )

    def _rows(self, batch: Batch, rows: list[int], *, step: int, train: bool, first: int = 0) -> list[dict]:
        """The chosen rows as plain Python (one host copy of ``rows`` only); text is decoded on rank 0."""
        if not rows:
            return []
        b = batch.select(rows).to("cpu")
        prompt_mask, response_mask, loss_mask = (
            b["prompt_mask_BP"].bool(),
            b["response_mask_BR"].bool(),
            b["loss_mask_BR"],
        )
        lengths = response_mask.sum(-1)
        stop = (
            b["agent_stop"]
            if "agent_stop" in b
            else [
                "length" if t else "eos"
                for t in truncated(
                    b["responses_BR"], lengths, eos_ids=self.eos_ids, max_response_length=self.max_response_length
                ).tolist()
            ]
        )
        out = []
        for j, i in enumerate(rows):
            n = int(lengths[j])
            mask = [int(m > 0) for m in loss_mask[j, :n].tolist()]
            rec = {
                "split": "train" if train else "val",
                "step": step,
                "dp_rank": self.mesh.get_local_rank(),
                "row": i,
                "uid": int(b["uid_B"][j]),
                "index": b["extra_info"][j].get("index"),
                "data_source": b["data_source"][j],
                "weight_version": int(b["weight_version_B"][j]) if train else step,
                "reward": float(b["scores_B"][j]),
                "rewards": dict(zip(self.reward_columns, b["reward_components_BK"][j].tolist())),
            }
            if not train:
                rec["position"] = first + i  # in the validation set, the TensorBoard tag
            if "overlong_penalty_B" in b:
                rec["rewards"]["overlong_penalty"] = float(b["overlong_penalty_B"][j])
            if train:
                adv = b["advantages_BR"][j, :n]
                rec["advantage"] = float((adv * loss_mask[j, :n]).sum() / max(sum(mask), 1))  # mean over trained tokens
            rec["stop"] = stop[j]
            rec["response_tokens"], rec["trained_tokens"] = n, sum(mask)
            if self.tool_names is not None:
                rec["agent"] = {
                    "turns": int(b["agent_turns_B"][j]),
                    "user_turns": int(b["agent_user_turns_B"][j]),
                    "tool_calls": {
                        name: int(c) for name, c in zip(self.tool_names, b["agent_tool_calls_BK"][j].tolist())
                    },
                    "tool_errors": int(b["agent_tool_errors_B"][j]),
                    "tool_timeouts": int(b["agent_tool_timeouts_B"][j]),
                }
            rec["ground_truth"] = b["ground_truth"][j]
            if "images" in b and b["images"][j] is not None:
                rec["_images"] = b["images"][j]  # the pixels go to rank 0 with the record; it writes thumbnails
            rec["prompt_ids"] = b["prompts_BP"][j][prompt_mask[j]].tolist()
            rec["response_ids"] = b["responses_BR"][j, :n].tolist()
            rec["loss_spans"] = loss_spans(mask)
            out.append(rec)
        return out

    def _write(self, split: str, step: int, rows: list[dict], *, tag) -> None:
        """The one gather; rank 0 decodes and appends."""
        gathered = gather_batch(Batch(objects={"sample": rows}), mesh=self.mesh)
        if gathered is None or self.logger is None:
            return
        lines, table = [], []
        for k, rec in enumerate(gathered["sample"]):
            if "_images" in rec:
                rec["images"] = self._thumbnails(rec.pop("_images"), f"{split}-{step:06d}-{k:03d}", tag(k, rec), step)
            rec = self._with_text(rec)
            lines.append(json.dumps(rec, ensure_ascii=False, default=str) + "\n")
            self.logger.text(tag(k, rec), tensorboard_text(rec), step)
            table.append(table_row(rec))
        with open(self.dir / f"{split}.jsonl", "a") as f:
            f.writelines(lines)
        self.logger.table(f"samples/{split}", table, step)

    def _thumbnails(self, images: ImageInputs, name: str, tag: str, step: int) -> list[dict]:
        """Each image of a sample's prompt, as the model saw it, into ``samples/images/<name>-<k>.png`` (at most
        ``THUMBNAIL`` pixels a side) and TensorBoard's images tab (``<tag>/image<k>``); returns the record's references:
        where the image came from (data file and row) and its thumbnail, relative to ``samples/``."""
        from PIL import Image

        assert self.vision is not None, "a sample with images needs the model's image processing on the writing rank"
        (self.dir / "images").mkdir(exist_ok=True)
        refs = []
        for k in range(images.grid_thw.shape[0]):
            picture = self.vision.picture(images, k)
            thumb = Image.fromarray(picture)
            thumb.thumbnail((THUMBNAIL, THUMBNAIL))
            path = f"images/{name}-{k}.png"
            thumb.save(self.dir / path)
            self.logger.image(f"{tag}/image{k}", picture, step)
            refs.append({"source": images.source, "image": k, "thumbnail": path})
        return refs

    def _with_text(self, rec: dict) -> dict:
        """Text decoded with the special tokens (what the model saw), before the ids in the record."""

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        ids, spans = rec["response_ids"], rec["loss_spans"]
        segments, pos = [], 0
        for s, e in spans + [[len(ids), len(ids)]]:
            if s > pos:
                segments.append([0, decode(ids[pos:s])])
            if e > s:
                segments.append([1, decode(ids[s:e])])
            pos = e
        ids_part = {k: rec.pop(k) for k in ("prompt_ids", "response_ids", "loss_spans")}
        return {
            **rec,
            "prompt": decode(ids_part["prompt_ids"]),
            "response": decode(ids),
            "segments": segments,
            **ids_part,
        }


class NoSampleLog:
    """``trainer.samples.enable=False``, and the rollout-only ranks of a split placement: nothing."""

    def open(self, logger: MetricLogger, *, initial_step: int) -> None:
        pass

    def train(self, batch: Batch, *, step: int) -> None:
        pass

    def validation(self, scored: Batch, *, step: int, start: int) -> None:
        pass


def table_row(rec: dict) -> dict:
    """A record as a row of the experiment trackers' samples table (TRL's completions table): step, prompt, response
    with the untrained spans marked, reward, advantage (None for validation samples)."""
    return {
        "step": rec["step"],
        "prompt": rec["prompt"],
        "response": marked_response(rec["segments"]),
        "reward": rec["reward"],
        "advantage": rec.get("advantage"),
    }


def tensorboard_text(rec: dict) -> str:
    """``format_sample`` as a Markdown code block (indented), so TensorBoard shows the special tokens literally."""
    return "\n".join("    " + line for line in format_sample(rec).splitlines())
