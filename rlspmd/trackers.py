"""Experiment trackers: Weights & Biases, MLflow and Trackio, chosen in ``trainer.loggers`` beside the console, jsonl
and TensorBoard sinks (``MetricLogger``), configured by ``trainer.tracking`` (``TrackerConfig``).

Rank 0 sends each tracker what ``metrics.jsonl`` holds (every finite metric at its step, under the same name), the
resolved config (the dict of ``config.json``: W&B's and Trackio's run config; MLflow's params, flattened, and a
``config.json`` artifact) and the sample log as a table (``samples/train``, ``samples/val``: step, prompt, response
with the untrained spans between ``⟦ ⟧``, reward, advantage), as TRL's completions table does.

Each tracker's package is imported only when it is chosen; a missing one is a start-up error from
``rlspmd.validate`` naming the pip command (``missing_packages``). Starting a run is synchronous, and a tracker that
cannot start stops the job with the tracker's own error (a typo'd server, no W&B login): the user asked for it.
After that, every call runs on a thread of the tracker's own, in order, so a slow or dead server never holds up a
step (or, through rank 0, every rank's next collective). A call that raises is reported once, as one warning line,
that tracker gets nothing more in this run, and training goes on; ``metrics.jsonl`` and ``samples/`` keep everything.

``Trackers`` is a checkpoint component (``state_dict``: the run id of each tracker), so a resumed run continues the
same W&B run (``resume="allow"`` with its id; offline, a new ``offline-run-*`` directory with the same id, which
``wandb sync`` appends to the run), the same MLflow run (by run id, set back to RUNNING) and the same Trackio run (by
name, ``resume="must"``; a new Trackio run takes ``<name>-2``, ... when its name is taken, so names stay unique).
Simplifications: a step that a crashed run logged after its last checkpoint is logged again
after the resume; W&B drops values for steps below its run's last step, MLflow and Trackio keep both. MLflow params
cannot change: a resume that changed the config keeps the first values (the log names the keys) and rewrites the
``config.json`` artifact.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

TRACKERS = ("wandb", "mlflow", "trackio")
"""The experiment trackers ``trainer.loggers`` can name, each the name of its package."""

INSTALL = 'pip install "rlspmd[trackers]"'
"""Installs every tracker (setup.py's ``trackers`` extra; ``pip install wandb`` etc. installs one)."""

REMOTE_SCHEMES = ("http", "https", "databricks", "databricks-uc", "uc")
"""MLflow tracking URIs that need a network (``trainer.tracking.offline`` refuses them, but for a server on this
machine: ``LOOPBACK``)."""

LOOPBACK = ("localhost", "127.0.0.1", "::1")


@dataclass
class TrackerConfig:
    """The experiment trackers chosen in ``loggers`` (``wandb``, ``mlflow``, ``trackio``): where their runs go."""

    project: str = "rlspmd"
    """The W&B and Trackio project, and the MLflow experiment unless ``experiment`` is set."""
    experiment: str | None = None
    """The MLflow experiment (created if missing). None: ``project``."""
    run_name: str | None = None
    """The run's name in every tracker. None: the name of the output directory (``outputs/quickstart`` ->
    ``quickstart``)."""
    offline: bool = False
    """Keep everything on this machine: W&B writes its run files under ``<output_dir>/wandb`` only (``wandb sync``
    uploads them later), MLflow's tracking URI must be a local store (``sqlite:``, ``file:`` or a path; MLflow's
    default ``sqlite:///mlflow.db`` is one) or a server on this machine (``http://127.0.0.1:5000``), and Trackio keeps
    its local database (no Space, no server). Off: W&B needs a login (``wandb login`` or ``WANDB_API_KEY``);
    ``WANDB_MODE=offline`` works as well."""
    wandb_entity: str | None = None
    """The W&B team or user the run belongs to. None: the login's default entity."""
    mlflow_tracking_uri: str | None = None
    """Where MLflow logs: a tracking server (``http://host:5000``), ``sqlite:///path/mlflow.db`` or ``file:///dir``.
    None: ``MLFLOW_TRACKING_URI`` if set, else MLflow's default (``sqlite:///mlflow.db`` in the working directory)."""
    trackio_space_id: str | None = None
    """A Hugging Face Space Trackio logs to (``user/space``). None: ``TRACKIO_SPACE_ID`` if set, else Trackio's local
    database under ``TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``; ``trackio show`` opens its dashboard)."""
    close_timeout_s: float = 120.0
    """At the end of the run, how long to wait for each tracker to send what it still holds (a slow or dead server)
    before leaving it behind with a warning."""

    def problems(self) -> list[tuple[str, object, str]]:
        """(field, value, why) for each setting that cannot run; ``missing_packages`` checks the packages."""
        out = []
        if not self.project:
            out.append(("project", self.project, "must not be empty"))
        if not self.close_timeout_s > 0:
            out.append(("close_timeout_s", self.close_timeout_s, "must be > 0"))
        if self.offline:
            uri = self.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            if uri and _remote(uri):
                out.append(
                    (
                        "mlflow_tracking_uri",
                        uri,
                        "is a server elsewhere, and offline=True keeps MLflow on this machine: give a sqlite:/// or "
                        "file:/// store, or a server on 127.0.0.1"
                        + ("" if self.mlflow_tracking_uri else " (this one comes from MLFLOW_TRACKING_URI)"),
                    )
                )
            space = self.trackio_space_id or os.environ.get("TRACKIO_SPACE_ID")
            if space:
                out.append(
                    (
                        "trackio_space_id",
                        space,
                        "is a Hugging Face Space, and offline=True keeps Trackio on this machine"
                        + ("" if self.trackio_space_id else " (this one comes from TRACKIO_SPACE_ID)"),
                    )
                )
        return out


def _remote(uri: str) -> bool:
    parsed = urlparse(uri)
    scheme = parsed.scheme or uri  # MLflow's bare ``databricks``
    return scheme in REMOTE_SCHEMES and parsed.hostname not in LOOPBACK


def missing_packages(loggers: Sequence[str]) -> list[tuple[str, str]]:
    """(tracker, pip command) for each chosen tracker whose package cannot be imported here."""
    return [
        (name, f"pip install {name} (or every tracker: {INSTALL})")
        for name in TRACKERS
        if name in loggers and importlib.util.find_spec(name) is None
    ]


class Trackers:
    """The chosen trackers of one run. Built on every rank; only rank 0's ``MetricLogger`` starts them.

    A checkpoint component (``Stateful``): its state is each tracker's run id (trackers chosen in earlier segments
    of the run are kept, so dropping one for a while and taking it back still continues its run)."""

    def __init__(
        self,
        loggers: Sequence[str] = (),
        cfg: TrackerConfig | None = None,
        *,
        output_dir: str = ".",
        config: dict | None = None,
    ):
        """``loggers``: ``trainer.loggers`` (the trackers among them are used); ``config``: the resolved config as plain
        data (``rlspmd.config.to_dict``), the run's config in each tracker."""
        self.names = tuple(name for name in TRACKERS if name in loggers)
        self.cfg = cfg or TrackerConfig()
        self.output_dir, self.config = Path(output_dir), config or {}
        self.runs: dict[str, object] = {}
        self.workers: list[_Worker] = []

    def component(self, *, is_main: bool, saved: Sequence[str] | None) -> dict[str, Trackers]:
        """``{"trackers": self}`` on rank 0, for the checkpoint's trainer components. ``saved``: the components of the
        checkpoint being resumed (None: a fresh start); one written before trackers had state holds none, and is
        resumed without it (new tracker runs)."""
        return {"trackers": self} if is_main and (saved is None or "trackers" in saved) else {}

    def state_dict(self) -> dict:
        return {"runs": dict(self.runs)}

    def load_state_dict(self, state: dict) -> None:
        self.runs = dict(state["runs"])

    def start(self, *, write: Callable[[str], None]) -> None:
        """Start (or, with run ids from a checkpoint, continue) each tracker's run; ``write`` prints a line to the run's
        log (this line, and a failing tracker's warning from its thread)."""
        run_name = self.cfg.run_name or self.output_dir.resolve().name
        for name in self.names:
            backend = BACKENDS[name](self.cfg, run_name=run_name, output_dir=self.output_dir, write=write)
            saved = self.runs.get(name)
            try:
                self.runs[name] = backend.start(config=self.config, resume=saved)
            except Exception as e:
                hint = (
                    "; to log without a network set trainer.tracking.offline=True"
                    if name == "wandb" and not self.cfg.offline
                    else ""
                )
                raise RuntimeError(
                    f"experiment tracker {name} could not {'continue' if saved else 'start'} its run "
                    f"({type(e).__name__}: {e}){hint}"
                ) from e
            write(f"{name}: {'continuing' if saved else 'started'} {backend.where()}")
            self.workers.append(_Worker(name, backend, write=write))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """The step's finite numbers (NaN and inf are ``null`` in metrics.jsonl, absent here, as in TensorBoard)."""
        finite = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        stamp = time.time()
        for w in self.workers:
            w.submit("log", step, finite, stamp, step=step)

    def table(self, name: str, rows: list[dict], step: int) -> None:
        """Rows of one table (the same columns in every row), logged at ``step`` under ``name``."""
        if rows:
            for w in self.workers:
                w.submit("table", name, rows, step, step=step)

    def close(self) -> None:
        """Finish every run, each waiting at most ``close_timeout_s`` for its tracker."""
        for w in self.workers:
            w.submit("finish", step=None)
        deadline = time.monotonic() + self.cfg.close_timeout_s
        for w in self.workers:
            w.close(timeout=max(0.0, deadline - time.monotonic()))
        self.workers = []


class _Worker:
    """One tracker's calls, in order, on a daemon thread; the first that raises ends them (one warning)."""

    def __init__(self, name: str, backend, *, write: Callable[[str], None]):
        self.name, self.backend, self.write = name, backend, write
        self.queue: queue.Queue = queue.Queue()
        self.failed = False
        self.thread = threading.Thread(target=self._run, name=f"rlspmd-{name}", daemon=True)
        self.thread.start()

    def submit(self, method: str, *args, step: int | None) -> None:
        if not self.failed:
            self.queue.put((method, args, step))

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            method, args, step = item
            if self.failed:
                continue
            try:
                getattr(self.backend, method)(*args)
            except Exception as e:  # the tracker's own errors are many (HTTP, sqlite, its service): any ends it
                self.failed = True
                at = f" at step {step}" if step is not None else " at the end of the run"
                self.write(
                    f"warning: {self.name} failed{at} ({type(e).__name__}: {_one_line(e)}); nothing more goes to "
                    f"{self.name} in this run and training goes on (metrics.jsonl and samples/ have everything)"
                )

    def close(self, *, timeout: float) -> None:
        self.queue.put(None)
        self.thread.join(timeout)
        if self.thread.is_alive() and not self.failed:
            self.failed = True
            self.write(
                f"warning: {self.name} was still sending after trainer.tracking.close_timeout_s; left behind, its run "
                "may miss the last records (metrics.jsonl and samples/ have everything)"
            )


def _one_line(e: Exception, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the trackers ------------------------------------------------------------------------------------------------------
#
# Each is a small class: ``start(config, resume) -> run id`` (the id the checkpoint keeps), ``where()`` (for the log),
# ``log(step, metrics, time)``, ``table(name, rows, step)``, ``finish()``. Only ``start`` runs on the caller's thread;
# ``write`` prints a line to the run's log.


class WandbTracker:
    def __init__(self, cfg: TrackerConfig, *, run_name: str, output_dir: Path, write: Callable[[str], None]):
        self.cfg, self.run_name, self.dir, self.write = cfg, run_name, output_dir, write
        self.run = None

    def start(self, *, config: dict, resume: str | None) -> str:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(
            project=self.cfg.project,
            entity=self.cfg.wandb_entity,
            name=self.run_name,
            id=resume,
            resume="allow" if resume else None,
            dir=str(self.dir),
            mode="offline" if self.cfg.offline else None,  # None: WANDB_MODE, else online
            config=config,
            allow_val_change=True,  # a resume may change the config
            reinit="create_new",
        )
        return self.run.id

    def where(self) -> str:
        offline = self.run.settings.mode == "offline" if self.run is not None else False
        place = f"offline, in {self.run.dir}" if offline else self.run.url
        return f"run {self.run.id} ({self.run.name}) in project {self.run.project}: {place}"

    def log(self, step: int, metrics: dict[str, float], stamp: float) -> None:
        self.run.log(metrics, step=step)

    def table(self, name: str, rows: list[dict], step: int) -> None:
        columns = list(rows[0])
        self.run.log({name: self.wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])}, step=step)

    def finish(self) -> None:
        self.run.finish()


class MlflowTracker:
    MAX_PARAMS, MAX_METRICS, MAX_VALUE = 100, 1000, 6000  # MLflow's per-request and per-value limits

    def __init__(self, cfg: TrackerConfig, *, run_name: str, output_dir: Path, write: Callable[[str], None]):
        self.cfg, self.run_name, self.write = cfg, run_name, write
        self.renamed: set[str] = set()

    def start(self, *, config: dict, resume: str | None) -> str:
        # log_table appends by downloading the table first; MLflow would draw a progress bar for that every step
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.cfg.mlflow_tracking_uri)
        self.experiment = self.cfg.experiment or self.cfg.project
        if resume:
            run = self.client.get_run(resume)
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            have = run.data.params
        else:
            exp = self.client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.experiment)
            self.run_id = self.client.create_run(exp_id, run_name=self.run_name).info.run_id
            have = {}
        params = {mlflow_name(k): v for k, v in flat_params(config, limit=self.MAX_VALUE).items()}
        changed = sorted(k for k, v in params.items() if k in have and have[k] != v)
        if changed:
            self.write(
                f"mlflow: params cannot change; the run keeps its first values of {', '.join(changed)} "
                "(its config.json artifact, rewritten, has the new ones)"
            )
        new = [Param(k, v) for k, v in params.items() if k not in have]
        for i in range(0, len(new), self.MAX_PARAMS):
            self.client.log_batch(self.run_id, params=new[i : i + self.MAX_PARAMS])
        self.client.log_dict(self.run_id, config, "config.json")
        return self.run_id

    def where(self) -> str:
        return f"run {self.run_id} ({self.run_name}) in experiment {self.experiment} at {self.client.tracking_uri}"

    def log(self, step: int, metrics: dict[str, float], stamp: float) -> None:
        from mlflow.entities import Metric

        ms = int(stamp * 1000)
        batch = [Metric(self._name(k), v, ms, step) for k, v in metrics.items()]
        for i in range(0, len(batch), self.MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=batch[i : i + self.MAX_METRICS])

    def _name(self, key: str) -> str:
        """MLflow takes letters, digits and ``_-. :/`` in names; any other character becomes ``_`` (said once)."""
        name = mlflow_name(key)
        if name != key and key not in self.renamed:
            self.renamed.add(key)
            self.write(f"mlflow: metric {key!r} is logged as {name!r} (MLflow's name rules)")
        return name

    def table(self, name: str, rows: list[dict], step: int) -> None:
        # appended to the artifact <name>.json (MLflow's table format; mlflow.load_table reads it back)
        self.client.log_table(self.run_id, {c: [r[c] for r in rows] for c in rows[0]}, f"{name}.json")

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker:
    def __init__(self, cfg: TrackerConfig, *, run_name: str, output_dir: Path, write: Callable[[str], None]):
        self.cfg, self.run_name, self.write = cfg, run_name, write

    def start(self, *, config: dict, resume: dict | None) -> dict:
        import trackio

        self.trackio = trackio
        self.run = trackio.init(
            project=self.cfg.project,
            name=resume["name"] if resume else self._free_name(),
            config=config,
            resume="must" if resume else "never",
            space_id=self.cfg.trackio_space_id,
            embed=False,
        )
        if resume and self.run.id != resume["id"]:  # Trackio resumes the newest run of a name
            self.write(
                f"trackio: continuing the newest run named {resume['name']!r} ({self.run.id}); the checkpoint's was "
                f"{resume['id']} (another run took the same name)"
            )
        return {"name": self.run.name, "id": self.run.id}

    def _free_name(self) -> str:
        """``run_name``, or ``run_name-2``, ``-3``, ... when the project's local store has it: Trackio resumes a run by
        its name (the newest of that name), so each run keeps its own."""
        try:
            taken = {run.name for run in self.trackio.Api().runs(self.cfg.project)}
        except ValueError:  # no such project yet
            return self.run_name
        return next(n for n in (self.run_name, *(f"{self.run_name}-{i}" for i in range(2, 10**6))) if n not in taken)

    def where(self) -> str:
        place = self.cfg.trackio_space_id or os.environ.get("TRACKIO_SPACE_ID") or "the local database"
        return f"run {self.run.name} ({self.run.id}) in project {self.cfg.project}, {place}"

    def log(self, step: int, metrics: dict[str, float], stamp: float) -> None:
        self.run.log(metrics, step=step)

    def table(self, name: str, rows: list[dict], step: int) -> None:
        columns = list(rows[0])
        self.run.log(
            {name: self.trackio.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])}, step=step
        )

    def finish(self) -> None:
        self.run.finish()


BACKENDS = {"wandb": WandbTracker, "mlflow": MlflowTracker, "trackio": TrackioTracker}


def flat_params(config: dict, *, limit: int, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: ``{"actor.optim.lr": "1e-06"}``; lists and other non-strings as JSON text,
    values over ``limit`` characters cut (``config.json`` has them whole)."""
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, limit=limit, prefix=f"{key}."))
            continue
        text = v if isinstance(v, str) else json.dumps(v, default=str)
        out[key] = text if len(text) <= limit else text[: limit - 3] + "..."
    return out


def mlflow_name(key: str) -> str:
    """A metric or param name MLflow accepts: letters, digits and ``_-. :/``; any other character becomes ``_``."""
    return re.sub(r"[^\w\-. :/]", "_", key)
