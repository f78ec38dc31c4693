"""Reading the experiment trackers' stores back in tests, each through what the tracker itself writes or serves:

* W&B offline: the run's ``.wandb`` file under ``<output_dir>/wandb/offline-run-*/`` (LevelDB log framing of
  ``wandb_internal_pb2.Record`` protos: the run record with its config, one history record per step) and the table
  JSON files it references;
* MLflow: a real tracking server on 127.0.0.1 (sqlite backend, artifacts served by it), read through ``MlflowClient``;
* Trackio: its local SQLite store (``TRACKIO_DIR``), read through ``trackio.sqlite_storage.SQLiteStorage``.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

from conftest import free_port

WANDB_INTERNAL = ("_timestamp", "_runtime", "_step")
"""History keys W&B adds to every step."""


# -- W&B -------------------------------------------------------------------------------------------------------------


def _wandb_log_records(path: Path) -> list[bytes]:
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, version), then 32 KiB blocks of chunks, each with a
    7-byte header (CRC-32 of type+data, length, type: 1 full, 2 first, 3 middle, 4 last), blocks padded with zeros."""
    data = path.read_bytes()
    if len(data) < 7:  # still being created
        return []
    assert data[:4] == b":W&B", f"{path}: not a W&B transaction log"
    block, pos, out, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"{path}: bad CRC at byte {pos}"
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
    return out


@dataclass
class WandbRun:
    """One offline run directory (a resumed run adds another with the same id)."""

    dir: Path
    run_id: str
    project: str
    name: str
    config: dict
    history: dict[int, dict]  # step -> {key: value}, W&B's own keys left out


def _wandb_records(log: Path, *, timeout: float = 60) -> list:
    """The records of a finished run's ``.wandb`` file. ``run.finish()`` can return before W&B's service process has
    written them all, so this waits (up to ``timeout``) for the exit record that closes the file."""
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout
    while True:
        records = []
        for raw in _wandb_log_records(log):
            rec = pb.Record()
            rec.ParseFromString(raw)
            records.append(rec)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wandb_runs(output_dir: Path) -> list[WandbRun]:
    """Every offline run under ``<output_dir>/wandb``, oldest first."""
    runs = []
    for run_dir in sorted((Path(output_dir) / "wandb").glob("offline-run-*")):
        (log,) = run_dir.glob("run-*.wandb")
        info, config, history = None, {}, {}
        for rec in _wandb_records(log):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                info = rec.run
                config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
            elif kind == "history":
                row = history.setdefault(rec.history.step.num, {})
                for item in rec.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if key not in WANDB_INTERNAL:
                        row[key] = json.loads(item.value_json)
        assert info is not None, f"{log}: no run record"
        config.pop("_wandb", None)
        runs.append(WandbRun(run_dir, info.run_id, info.project, info.display_name, config, history))
    return runs


def wandb_table(run: WandbRun, step: int, name: str) -> list[dict]:
    """The rows of table ``name`` logged at ``step``, read from the table file the history record points at."""
    path = run.history[step][f"{name}/path"]
    table = json.loads((run.dir / "files" / path).read_text())
    return [dict(zip(table["columns"], row)) for row in table["data"]]


# -- MLflow ----------------------------------------------------------------------------------------------------------


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with a sqlite backend and served artifacts, in its own process group."""

    def __init__(self, root: Path, *, timeout: float = 180):
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        self.log = root / "server.log"
        self.proc = subprocess.Popen(
            cmd, cwd=root, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mlflow server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.3)

    def kill(self) -> None:
        """SIGKILL to the server's process group (uvicorn and its job runner with it), as a crash would."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)


def mlflow_runs(client, experiment: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r}"
    return client.search_runs([exp.experiment_id])


def mlflow_history(client, run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) list, in step order."""
    return {
        k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k))
        for k in keys
        if client.get_metric_history(run_id, k)
    }


def mlflow_table(client, run, name: str) -> list[dict]:
    """The rows of the table artifact ``<name>.json`` (every step's rows, appended), through MLflow's own reader.
    ``load_table`` searches runs through the global tracking URI, not its client's: it is pointed at the server."""
    import mlflow

    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(client.tracking_uri)
    try:
        df = client.load_table(run.info.experiment_id, f"{name}.json", run_ids=[run.info.run_id])
    finally:
        mlflow.set_tracking_uri(before)
    return [
        {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items() if k != "run_id"}
        for row in df.to_dict(orient="records")
    ]


# -- Trackio ---------------------------------------------------------------------------------------------------------

TRACKIO_INTERNAL = ("timestamp", "step")


def trackio_runs(project: str) -> list[dict]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_run_records(project)


def trackio_logs(project: str, run_id: str) -> dict[int, dict]:
    """step -> everything logged at it (metrics, and tables as ``{"_type": "trackio.table", "_value": rows}``)."""
    from trackio.sqlite_storage import SQLiteStorage

    out: dict[int, dict] = {}
    for row in SQLiteStorage.get_logs(project, run_id=run_id):
        out.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k not in TRACKIO_INTERNAL})
    return out


def trackio_config(project: str, run_id: str) -> dict:
    from trackio.sqlite_storage import SQLiteStorage

    return {k: v for k, v in SQLiteStorage.get_run_config(project, run_id=run_id).items() if not k.startswith("_")}
