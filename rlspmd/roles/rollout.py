"""The rollout role: turns a DP shard of prompts into ``n`` samples per prompt, in any placement.

Sampling randomness comes from a generator seeded by ``(seed, step, rollout DP rank, purpose, round)``, so a
step's samples do not depend on how many steps ran before in this process (exact resume), differ between rollout
DP ranks and between the generation rounds of one step (dynamic sampling), and are the same on the ranks of one
rollout TP group (which generate the same prompts).

Placements (the builder picks the objects; every rank runs the same step, the trainer's call sites are the same):

* **Colocated** (``Rollout``): the engine runs on the actor's ranks, its weights from a ``WeightSource``
  (``rollout/weights.py``): the actor's parameters read in place (native engine, actor's compute dtype), or the
  weight stream. With ``mesh.rollout_tp > 1`` the ranks of a TP group all-gather their prompts, generate the same
  batch, and each keeps its own rows.
* **Split** (actor and rollout on disjoint ranks): the actor ranks hold a ``RolloutClient``, the rollout ranks a
  ``RolloutServer`` around their local ``Rollout``. Both sides run the same step function, so they reach every
  generation call together; the call is a fixed sequence of collectives on the link mesh that spans both
  (``exchange``: prompts go over with one all-to-all, rows spread evenly over the rollout ranks in order, and each
  actor rank gets its own samples back the same way). Nothing names a method across the link. The weight sync
  gathers each unit on the actor mesh and broadcasts it from the actor's first rank to the rollout ranks.
* **Asynchronous split** (``trainer.max_staleness`` = k > 0): the same two objects, pipelined. The exchange's two
  halves are entered one step apart: ``generate`` at step t sends the prompts of step t + k (``send_prompts``) and
  returns the batch of step t, generated earlier; the rollout ranks generate while the actor ranks train (no
  collective joins them meanwhile: Gloo and NCCL block only the ranks in a collective), and at the end of the step
  the weight sync goes over and the new samples come back (``return_samples``). Each sample carries the version of
  the weights that generated it (``weight_version_B``); rank 0 still decides everything (which prompts, when the
  pipeline fills), and with k = 0 the sequence of collectives is the synchronous one.

Per-step metrics: ``sync_weights(metrics)`` adds them to the step's buffer, already reduced over the rollout ranks.
Bytes: ``weight_sync/gathered_bytes`` (per actor rank, the unit all-gathers), ``weight_sync/broadcast_bytes`` (per
rollout rank, split placement), ``weight_sync/loaded_bytes`` (per engine; 0 when reading in place). Seconds (wall
clock, so under ``timing/``): ``timing/rollout/weight_sync`` (every sync of the step, lazy re-syncs included),
``timing/rollout/wake``, ``timing/rollout/sleep``, ``timing/rollout/gen`` (engine time of the training generations),
and ``throughput/rollout/gen_tokens_per_s``; staleness of the trained samples ``rollout/staleness/{mean,max,frac_<s>}``
(0 in synchronous runs); pipelined, ``timing/rollout/receive`` (the actor side's wait for the next batch after the
weight sync).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from rlspmd.agent.loop import AgentLoop
from rlspmd.config import RolloutConfig
from rlspmd.distributed.dispatch import all_gather_objects, broadcast_object, even_split, redistribute_batch
from rlspmd.distributed.mesh import DP, TP
from rlspmd.distributed.progress import progress
from rlspmd.engines.base import WeightStream
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.rollout.base import RolloutEngine
from rlspmd.rollout.sampling import SamplingParams
from rlspmd.rollout.weight_sync import WeightBridge
from rlspmd.rollout.weights import WeightSource

TRAIN, VALIDATION = 0, 1  # generator purposes
SYNC_S = "timing/rollout/weight_sync"


class RolloutRole(Protocol):
    def generate(self, prompts: Batch, *, step: int, round: int = 0) -> Batch:
        """``rollout.n`` samples per prompt, with ``rollout_logprobs_BR`` and the weight version that generated them
        (``weight_version_B``); metrics are kept until ``sync_weights``. Asynchronous (split placement,
        ``trainer.max_staleness`` = k > 0): the samples returned are those of the prompts given k steps earlier,
        generated while the trainer updated; these prompts are generated for step + k (``RolloutClient``)."""

    def generate_validation(self, prompts: Batch, *, step: int) -> Batch: ...

    def generate_greedy(self, prompts: Batch) -> Batch:
        """One greedy response per prompt (ReMax's baseline)."""

    def sync_weights(self, metrics: MetricBuffer) -> None:
        """Actor -> rollout after the update; adds the step's rollout metrics to ``metrics``."""


def put(metrics: MetricBuffer, reduced: dict[str, float]) -> None:
    """Values already reduced (the same on every rank) into a step buffer: a max over equal values keeps them."""
    for k, v in reduced.items():
        metrics.max(k, v)


def truncated(
    responses_BR: torch.Tensor, lengths_B: torch.Tensor, *, eos_ids: list[int], max_response_length: int
) -> torch.Tensor:
    """Samples (``lengths_B`` tokens sampled each) that hit ``max_response_length`` without producing EOS."""
    lengths = lengths_B.long()
    R = responses_BR.shape[1]
    last = responses_BR.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    ended = torch.isin(last, torch.tensor(eos_ids, device=last.device))
    return (lengths >= max_response_length) & ~ended & (R >= max_response_length)


def sampling_params(cfg: RolloutConfig) -> tuple[SamplingParams, SamplingParams]:
    """(training, validation) sampling parameters."""
    train = SamplingParams(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=cfg.max_response_length,
        n=cfg.n,
        ignore_eos=cfg.ignore_eos,
    )
    val = SamplingParams(
        temperature=cfg.val_temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_response_length, n=1
    )
    return train, val


class SingleTurn:
    """One response per sample: the engine's batched ``generate``."""

    tool_schemas: list[dict] | None = None
    tool_names: list[str] = []

    def run(
        self,
        engine: RolloutEngine,
        prompts: Batch,
        params: SamplingParams,
        generator: torch.Generator | None,
        metrics: MetricBuffer,
    ) -> Batch:
        return engine.generate(prompts, params, generator=generator)

    def declare(self, metrics: MetricBuffer) -> None:
        """Nothing of its own to report."""


class Rollout:
    """Generation on this rank's engine (colocated placement; the rollout ranks of a split placement)."""

    def __init__(
        self,
        cfg: RolloutConfig,
        *,
        engine: RolloutEngine,
        weights: WeightSource,
        mesh,
        seed: int,
        device: torch.device,
        syncs_itself: bool = True,
        episodes: SingleTurn | AgentLoop | None = None,
    ):
        """``mesh``: the rollout role's 2-D (dp, tp) mesh. ``syncs_itself``: sync lazily when the engine has no
        current weights (colocated); in split placement the actor side orders every sync. ``episodes``: what one
        sample is, ``SingleTurn`` (default) or a multi-turn ``AgentLoop`` (the builder decides); the loop runs here,
        where generation runs, so in split placement the tools run on the rollout ranks."""
        self.episodes = episodes or SingleTurn()
        self.cfg, self.engine, self.weights = cfg, engine, weights
        self.dp_mesh, self.tp_mesh = mesh[DP], mesh[TP]
        self.seed, self.dp_rank, self.device = seed, self.dp_mesh.get_local_rank(), device
        self.syncs_itself = syncs_itself
        self.train_params, self.val_params = sampling_params(cfg)
        self.greedy_params = SamplingParams(temperature=0.0, max_new_tokens=cfg.max_response_length, n=1)
        self.synced = weights.in_place
        self._stats = MetricBuffer()
        self._sync_stats: dict[str, float] = {}

    def _generator(self, step: int, purpose: int, round: int = 0) -> torch.Generator:
        g = torch.Generator(device=self.device)
        key = (self.seed, step, self.dp_rank, purpose) + ((round,) if round else ())  # round 0: the single-round seed
        g.manual_seed(hash(key) & (2**63 - 1))
        return g

    def generate(self, prompts: Batch, *, step: int, round: int = 0) -> Batch:
        """Colocated: the engine reads (or was synced to) the weights of the last update, version ``step - 1``."""
        batch = self.sample(prompts, step=step, round=round)
        if len(batch):
            batch = _versioned(batch, step - 1)
            staleness_metrics(batch, current=step - 1, max_staleness=0, metrics=self._stats)
        return batch

    def sample(self, prompts: Batch, *, step: int, round: int = 0) -> Batch:
        """The training samples of step ``step`` (its generator), with the weights the engine holds now."""
        return self._run(prompts, self.train_params, self._generator(step, TRAIN, round), record=True)

    def generate_greedy(self, prompts: Batch) -> Batch:
        """One greedy response per prompt (ReMax's baseline)."""
        return self._run(prompts, self.greedy_params, None, record=False)

    def generate_validation(self, prompts: Batch, *, step: int) -> Batch:
        return self._run(prompts, self.val_params, self._generator(step, VALIDATION), record=False)

    def _run(self, prompts: Batch, params: SamplingParams, generator: torch.Generator | None, *, record: bool) -> Batch:
        if not (self.synced and self.engine.holds_weights):
            if not self.syncs_itself:
                raise RuntimeError("rollout: generate before the first weight sync (the actor side orders syncs)")
            self.sync()
        parts = [prompts.to("cpu")]
        if self.tp_mesh.size() > 1:  # a TP group's ranks generate the same prompts: the union of their shards
            parts = all_gather_objects(parts[0], mesh=self.tp_mesh)
        nonempty = [p for p in parts if len(p)]
        if not nonempty:
            return prompts
        group = Batch.concat(nonempty).to(self.device)
        self.engine.wake()
        t0 = time.perf_counter()
        out = self.episodes.run(self.engine, group, params, generator, self._stats if record else MetricBuffer())
        gen_s = time.perf_counter() - t0
        self.engine.sleep()
        if record:
            self._stats.max("timing/rollout/gen", gen_s)
            self._stats.sum("rollout/gen_tokens", out["loss_mask_BR"].sum())  # the model's own tokens only
        me = self.tp_mesh.get_local_rank() if len(parts) > 1 else 0
        start = sum(len(p) for p in parts[:me]) * params.n
        return out.slice(start, start + len(prompts) * params.n)

    def sync(self) -> None:
        """Load the source's weights into the engine (nothing when it reads them in place)."""
        t0 = time.perf_counter()
        stream = self.weights.stream()
        loaded = 0 if stream is None else self.engine.update_weights(stream)
        self.synced = True
        # seconds add up over the syncs of a step (a level-2 sleep before validation costs one more); bytes are per sync
        seconds = self._sync_stats.get(SYNC_S, 0.0) + time.perf_counter() - t0
        self._sync_stats = {SYNC_S: seconds, "weight_sync/loaded_bytes": float(loaded), **self.weights.stats()}

    def sync_weights(self, metrics: MetricBuffer) -> None:
        """Colocated native in place: nothing moves. Otherwise the stream is loaded now (and again before a generate
        that finds the weights dropped by a level-2 sleep)."""
        self.sync()
        put(metrics, self.report())

    def report(self) -> dict[str, float]:
        """This step's rollout metrics, reduced over the rollout DP ranks (collective); starts the next step's."""
        m = self._stats
        for k in (SYNC_S, "weight_sync/gathered_bytes", "weight_sync/broadcast_bytes", "weight_sync/loaded_bytes"):
            m.max(k, self._sync_stats.get(k, 0.0))
        for k, v in self.engine.take_times().items():  # wake_s, sleep_s
            m.max(f"timing/rollout/{k.removesuffix('_s')}", v)
        m.max("timing/rollout/gen", 0.0)
        m.sum("rollout/gen_tokens", 0.0)
        self.episodes.declare(m)  # every rank records the same names, also one that generated nothing
        # TP peers generate the same tokens: reduce over the DP dim only (each group counted once)
        out = m.reduce(mesh=self.dp_mesh)
        out["throughput/rollout/gen_tokens_per_s"] = out.pop("rollout/gen_tokens") / max(
            out["timing/rollout/gen"], 1e-9
        )
        self._stats, self._sync_stats = MetricBuffer(), {}
        return out


def _plan(link, rollout_ranks: list[int], total: int) -> list[int]:
    """Rows per link rank: ``total`` spread evenly over the rollout ranks (in rank order), none on actor ranks."""
    share = dict(zip(rollout_ranks, even_split(total, len(rollout_ranks))))
    return [share.get(g, 0) for g in link.mesh.tolist()]


def send_prompts(prompts: Batch, *, link, rollout_ranks: list[int], device: torch.device) -> tuple[Batch, list[int]]:
    """The first half of a generation call across the link, entered by every rank of it: the actor ranks' prompts go
    to the rollout ranks (evenly, in order). Returns this rank's prompts to generate (none on actor ranks) and every
    actor rank's prompt count, which ``return_samples`` needs."""
    counts = all_gather_objects(len(prompts), mesh=link)
    plan = _plan(link, rollout_ranks, sum(counts))
    mine = redistribute_batch(
        prompts if len(prompts) else None, mesh=link, sizes_in=counts, sizes_out=plan, device=device
    )
    return mine, counts


def return_samples(samples: Batch, counts: list[int], *, link, device: torch.device) -> Batch:
    """The second half: each actor rank gets the samples of its own prompts back, in order (``counts``: what
    ``send_prompts`` returned). Returns this rank's samples (none on rollout ranks)."""
    back = all_gather_objects(len(samples), mesh=link)
    per_prompt = sum(back) // max(sum(counts), 1)
    return redistribute_batch(
        samples if len(samples) else None,
        mesh=link,
        sizes_in=back,
        sizes_out=[n * per_prompt for n in counts],
        device=device,
    )


def exchange(prompts: Batch, generate, *, link, rollout_ranks: list[int], device: torch.device) -> Batch:
    """One generation call across the link, both halves at once: ``generate`` runs on the rollout ranks (on the actor
    ranks it receives nothing and returns an empty batch). Returns this rank's samples (none on rollout ranks)."""
    mine, counts = send_prompts(prompts, link=link, rollout_ranks=rollout_ranks, device=device)
    return return_samples(generate(mine), counts, link=link, device=device)  # also with no rows: TP peers gather


def staleness_metrics(batch: Batch, *, current: int, max_staleness: int, metrics: MetricBuffer) -> None:
    """``rollout/staleness/{mean,max}`` and ``rollout/staleness/frac_<s>`` (s = 0..max_staleness): how many updates
    older than the trainer's current weights (version ``current``) the weights that generated each sample were."""
    staleness = (current - batch["weight_version_B"]).double()
    metrics.mean("rollout/staleness/mean", staleness.sum(), len(batch))
    metrics.max("rollout/staleness/max", staleness.max() if len(batch) else 0.0)
    for s in range(max_staleness + 1):
        metrics.mean(f"rollout/staleness/frac_{s}", (staleness == s).double().sum(), len(batch))


def _versioned(batch: Batch, version: int) -> Batch:
    return batch.set(
        weight_version_B=torch.full((len(batch),), version, dtype=torch.long, device=batch["responses_BR"].device)
    )


class RolloutClient:
    """Split placement, actor ranks: generation and weight syncs run on the rollout ranks (``RolloutServer``).

    Pipelined ``lag`` = ``trainer.max_staleness`` steps deep (0: synchronous). ``generate`` at step t sends the
    prompts of step t + lag to the rollout ranks (``send_prompts``) and returns the batch of step t, generated earlier;
    the rollout ranks generate while this side trains, and ``sync_weights`` at the end of the step sends the new
    weights and then takes the new batch back (``return_samples``). So the actor ranks never wait in a collective
    while the rollout ranks generate, except for what generation takes beyond training. The batches in flight are
    ``queue`` (checkpointed, ``trainer/checkpoint/state.py: InFlightBatches``). At the first step, and after a resume
    that saved fewer than ``lag`` batches, the pipeline fills itself: those batches are generated at once with the
    current weights, their prompts drawn by ``draw`` (rank 0 samples them, as any step's).

    Weight versions: the rollout ranks hold the weights of version v, the step whose update produced them (0: the
    initial weights); every sample carries the version that generated it (``weight_version_B``), and its staleness
    when trained at step t is t - 1 - v (``staleness_metrics``).
    """

    def __init__(
        self,
        *,
        link,
        bridge: WeightBridge,
        stream: WeightStream,
        rollout_ranks: list[int],
        device: torch.device,
        lag: int = 0,
        draw: Callable[[], Batch] | None = None,
    ):
        """``draw``: the next step's prompts on this rank (``Prompts.next``; collective over the actor mesh); needed
        when ``lag`` > 0."""
        assert lag == 0 or draw is not None, "a pipelined client draws the prompts that fill its pipeline"
        self.link, self.bridge, self.stream = link, bridge, stream
        self.rollout_ranks, self.device = rollout_ranks, device
        self.lag, self.draw = lag, draw
        self.synced = False  # the rollout engine starts with disk (native) or dummy (vLLM) weights
        self.version: int | None = None  # of the weights the rollout ranks hold; known at the first sync
        self.queue: deque[Batch] = deque()  # batches generated for the coming steps, oldest first
        self.pending: tuple[list[int], int] | None = None  # prompts sent, samples not yet back: (counts, version)
        self._stats = MetricBuffer()

    def generate(self, prompts: Batch, *, step: int, round: int = 0) -> Batch:
        self._synced(version=step - 1)
        for _ in range(self._fill(step)):  # the pipeline's first steps: generate now, with the current weights
            self.queue.append(_versioned(self._exchange(prompts), self.version))
            prompts = self.draw()
        mine, counts = send_prompts(prompts, link=self.link, rollout_ranks=self.rollout_ranks, device=self.device)
        assert not len(mine), "an actor rank generates nothing"
        self.pending = (counts, self.version)
        if self.lag == 0:
            self._receive()
        batch = self.queue.popleft()
        staleness_metrics(batch, current=step - 1, max_staleness=self.lag, metrics=self._stats)
        return batch

    def _fill(self, step: int) -> int:
        """How many batches the pipeline lacks; rank 0 decides and tells the rollout ranks (with the first step's)."""
        if self.lag == 0:
            return 0
        missing = self.lag - len(self.queue)
        return broadcast_object((missing, step + len(self.queue)), mesh=self.link)[0]

    def _receive(self) -> None:
        counts, version = self.pending
        self.pending = None
        samples = return_samples(Batch(), counts, link=self.link, device=self.device)
        self.queue.append(_versioned(samples, version))

    def generate_validation(self, prompts: Batch, *, step: int) -> Batch:
        self._synced(version=step)
        return self._exchange(prompts)

    def generate_greedy(self, prompts: Batch) -> Batch:
        """After the round's ``generate``, which synced the weights."""
        assert self.lag == 0 and self.synced, "ReMax's greedy baseline follows generate in the synchronous loop"
        return self._exchange(prompts)

    def _synced(self, *, version: int) -> None:
        """Before the first generation: the rollout ranks get the actor's weights (initial, or restored:
        ``version``)."""
        if not self.synced:
            self._send_weights(MetricBuffer())
            self.version = version

    def _exchange(self, prompts: Batch) -> Batch:
        return exchange(
            prompts, lambda _: Batch(), link=self.link, rollout_ranks=self.rollout_ranks, device=self.device
        )

    def _send_weights(self, metrics: MetricBuffer) -> None:
        t0 = time.perf_counter()
        stats = self.bridge.send(self.stream)
        self.synced = True
        elapsed = time.perf_counter() - t0
        remote = next(m for m in all_gather_objects(None, mesh=self.link) if m is not None)
        remote[SYNC_S] = max(remote[SYNC_S], elapsed)
        remote["weight_sync/gathered_bytes"] = float(stats.gathered_bytes)
        put(metrics, remote)

    def sync_weights(self, metrics: MetricBuffer) -> None:
        """The step's update to the rollout ranks (which finish generating the next batch first, when pipelined),
        then that batch back."""
        self._send_weights(metrics)
        self.version = None if self.version is None else self.version + 1  # None: no generation yet (benchmarks)
        if self.pending is not None:
            t0 = time.perf_counter()
            self._receive()
            metrics.max("timing/rollout/receive", time.perf_counter() - t0)
        metrics.merge(self._stats)
        self._stats = MetricBuffer()


class RolloutServer:
    """Split placement, rollout ranks: the same calls as ``RolloutClient``, served by the local ``Rollout``, in the
    same order of collectives. The batches these ranks carry through the step are empty; the samples live on the actor's
    ranks. Pipelined (``lag`` > 0), ``generate`` generates the batch of step t + lag and keeps it until ``sync_weights``
    has received the step's update, then sends it back."""

    def __init__(self, local: Rollout, *, link, rollout_ranks: list[int], lag: int = 0):
        self.local, self.link, self.rollout_ranks, self.lag = local, link, rollout_ranks, lag
        self.synced = False
        self.pending: tuple[Batch, list[int]] | None = None  # generated, not yet sent back: (samples, counts)

    def generate(self, prompts: Batch, *, step: int, round: int = 0) -> Batch:
        self._synced()
        missing, first = broadcast_object(None, mesh=self.link) if self.lag else (0, step)
        for i in range(missing):  # the pipeline fills: the client's first steps, generated now
            self._exchange(lambda p, s=first + i: self.local.sample(p, step=s))
        mine, counts = send_prompts(Batch(), link=self.link, rollout_ranks=self.rollout_ranks, device=self.local.device)
        samples = self.local.sample(mine, step=step + self.lag, round=round)  # the generation that overlaps training
        if self.lag == 0:
            return_samples(samples, counts, link=self.link, device=self.local.device)
        else:
            self.pending = (samples, counts)
        return Batch()

    def generate_validation(self, prompts: Batch, *, step: int) -> Batch:
        self._synced()
        return self._exchange(lambda p: self.local.generate_validation(p, step=step))

    def generate_greedy(self, prompts: Batch) -> Batch:
        assert self.lag == 0 and self.synced, "ReMax's greedy baseline follows generate in the synchronous loop"
        return self._exchange(self.local.generate_greedy)

    def _synced(self) -> None:
        if not self.synced:
            self._receive_weights(MetricBuffer())

    def _exchange(self, generate) -> Batch:
        return exchange(Batch(), generate, link=self.link, rollout_ranks=self.rollout_ranks, device=self.local.device)

    def _receive_weights(self, metrics: MetricBuffer) -> None:
        with progress.waiting():  # for the actor's update to end and its weights to arrive: not this rank's own work
            self.local.sync()  # receives the broadcast units
        self.synced = True
        report = self.local.report()  # reduced over the rollout ranks
        all_gather_objects(report, mesh=self.link)
        put(metrics, report)

    def sync_weights(self, metrics: MetricBuffer) -> None:
        self._receive_weights(metrics)
        if self.pending is not None:  # generated with the previous weights while the actor trained
            samples, counts = self.pending
            self.pending = None
            return_samples(samples, counts, link=self.link, device=self.local.device)
