"""A sample log's records (``<output_dir>/samples/*.jsonl``, written by ``rlspmd/trainer/samples.py``) read back and
shown as text: what ``python -m rlspmd.samples`` prints and the trainer sends to TensorBoard and the trackers. No torch
here, so the reader starts at once."""

from __future__ import annotations

import json
from pathlib import Path

MASK_OPEN, MASK_CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧: around response text that is in the context but not trained on


def read_samples(path: Path) -> list[dict]:
    """The records of a ``samples/*.jsonl`` file (a torn last line of a killed run is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def format_sample(rec: dict, *, color: bool = False) -> str:
    """One record as text: a header (step, ids, reward and its parts, advantage, stop reason, tool calls), the prompt,
    then the response with the tokens that were not trained on marked: between ``⟦ ⟧``, or dimmed in colour."""
    where = (
        f"step {rec['step']} {rec['split']} · dp_rank {rec['dp_rank']} row {rec['row']} · prompt index {rec['index']}"
    )
    where += f" ({rec['data_source']}) · group {rec['uid']} · weights v{rec['weight_version']}"
    parts = " + ".join(f"{k} {v:.4g}" for k, v in rec["rewards"].items())
    line2 = f"reward {rec['reward']:.4g} ({parts})"
    if "advantage" in rec:
        line2 += f" · advantage {rec['advantage']:+.4g}"
    line2 += f" · stop: {rec['stop']} · {rec['response_tokens']} response tokens, {rec['trained_tokens']} trained"
    lines = [where, line2]
    if "agent" in rec:
        a = rec["agent"]
        calls = ", ".join(f"{k} x{v}" for k, v in a["tool_calls"].items() if v) or "none"
        lines.append(
            f"turns {a['turns']} · user turns {a['user_turns']} · tool calls: {calls} · tool errors {a['tool_errors']}"
            f" · timeouts {a['tool_timeouts']}"
        )
    for im in rec.get("images", []):  # a vision-language prompt's images: where each came from, and its thumbnail
        lines.append(f"image {im['image']}: {im['source']} · thumbnail samples/{im['thumbnail']}")
    lines.append(f"ground truth: {rec['ground_truth']}")
    if color:
        dim, reset = "\x1b[2;36m", "\x1b[0m"
        body = "".join(text if trained else f"{dim}{text}{reset}" for trained, text in rec["segments"])
        note = f"{dim}dimmed{reset}: in the context, not trained on"
    else:
        body = marked_response(rec["segments"])
        note = f"{MASK_OPEN}...{MASK_CLOSE}: in the context, not trained on"
    lines += ["--- prompt ---", rec["prompt"], f"--- response ({note}) ---", body]
    return "\n".join(lines)


def marked_response(segments: list) -> str:
    """The response with the text the loss did not train on between ``⟦ ⟧``."""
    return "".join(text if trained else f"{MASK_OPEN}{text}{MASK_CLOSE}" for trained, text in segments)
