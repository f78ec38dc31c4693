"""``python -m rlspmd.plot``: runs' metrics.jsonl drawn as one panel per metric, every run in each panel."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from PIL import Image

from conftest import ROOT
from rlspmd.plot import DPI, PANEL_INCHES, main, plot_runs


def write_run(path, *, scale: float, steps: int = 6, val_every: int = 3):
    """A run's metrics.jsonl as the trainer writes it: validation at step 0 and every ``val_every`` steps, a null
    (a non-finite value) at step 2, and a torn last line (a killed run)."""
    path.mkdir(parents=True)
    rows = [{"step": 0, "time": 0.0, "val/acc": 0.0}]
    for s in range(1, steps + 1):
        row = {"step": s, "time": float(s), "reward/mean": scale * s, "actor/entropy": 6 - s * scale}
        row["actor/kl_loss"] = None if s == 2 else 0.01 * s
        row["response_length/mean"] = 10.0 + s
        if s % val_every == 0:
            row["val/acc"] = scale * s / steps
        rows.append(row)
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "reward/me'
    (path / "metrics.jsonl").write_text(text)
    return path


def lines_of(ax) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (line.get_xdata().tolist(), line.get_ydata().tolist()) for line in ax.get_lines()}


def jsonl_curve(run, name: str) -> tuple[list, list]:
    """(steps, values) of ``name`` in the run's metrics.jsonl, its nulls and torn line skipped."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:-1]]
    points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
    return [s for s, _ in points], [v for _, v in points]


def test_every_panel_draws_each_run_from_its_jsonl(tmp_path):
    a, b = write_run(tmp_path / "run_a", scale=0.1), write_run(tmp_path / "run_b", scale=0.2)
    fig = plot_runs([a, b])
    # the default curves these runs logged, in DEFAULT_METRICS' order
    titles = ["val/acc", "reward/mean", "response_length/mean", "actor/entropy", "actor/kl_loss"]
    assert [ax.get_title() for ax in fig.axes] == titles
    for ax in fig.axes:
        assert lines_of(ax) == {"run_a": jsonl_curve(a, ax.get_title()), "run_b": jsonl_curve(b, ax.get_title())}
    val, reward, _, _, kl = fig.axes
    assert lines_of(val)["run_a"][0] == [0, 3, 6] and lines_of(reward)["run_b"][0] == [1, 2, 3, 4, 5, 6]
    assert [line.get_marker() for line in val.get_lines()] == ["o", "o"]  # sparse (validation): markers
    assert [line.get_marker() for line in reward.get_lines()] == ["None", "None"]
    assert lines_of(kl)["run_a"][0] == [1, 3, 4, 5, 6]  # the null at step 2 is left out
    assert fig.legends and [t.get_text() for t in fig.legends[0].get_texts()] == ["run_a", "run_b"]


def test_the_command_writes_a_png_of_the_chosen_metrics(tmp_path):
    a, b = write_run(tmp_path / "a" / "run", scale=0.1), write_run(tmp_path / "b" / "run", scale=0.3)
    out = tmp_path / "pics" / "compare.png"
    proc = subprocess.run(
        [sys.executable, "-m", "rlspmd.plot", str(a), str(b), "--metrics", "val/acc, actor/*", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    # val/acc, then actor/entropy and actor/kl_loss: 3 panels in one row
    with Image.open(out) as png:
        assert png.format == "PNG" and png.size == (round(3 * PANEL_INCHES[0] * DPI), round(PANEL_INCHES[1] * DPI))
        assert len(set(png.convert("L").getdata())) > 10  # something is drawn
    fig = plot_runs([a, b], metrics=["val/acc", "actor/*"])
    assert [ax.get_title() for ax in fig.axes] == ["val/acc", "actor/entropy", "actor/kl_loss"]
    assert set(lines_of(fig.axes[0])) == {str(a), str(b)}  # same directory names: labelled by path


def test_default_output_is_the_runs_curves_png_and_errors_name_what_is_wrong(tmp_path, capsys):
    a = write_run(tmp_path / "run_a", scale=0.1)
    assert main([str(a)]) == a / "curves.png" and (a / "curves.png").is_file()
    with pytest.raises(SystemExit) as e:
        main([str(a), "--metrics", "val/acc,critic/*"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--metrics: ['critic/*'] not logged by any run; they logged: actor/entropy, actor/kl_loss" in err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere")])
    assert "nowhere: no metrics.jsonl here" in capsys.readouterr().err
