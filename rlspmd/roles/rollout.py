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

Per-step metrics: ``sync_weights(metrics)`` adds them to the step's buffer, already reduced over the rollout ranks.
Bytes: ``weight_sync/gathered_bytes`` (per actor rank, the unit all-gathers), ``weight_sync/broadcast_bytes`` (per
rollout rank, split placement), ``weight_sync/loaded_bytes`` (per engine; 0 when reading in place). Seconds (wall
clock, so under ``timing/``): ``timing/rollout/weight_sync`` (every sync of the step, lazy re-syncs included),
``timing/rollout/wake``, ``timing/rollout/sleep``, ``timing/rollout/gen`` (engine time of the training generations),
and ``throughput/rollout/gen_tokens_per_s``.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from rlspmd.config import RolloutConfig
from rlspmd.distributed.dispatch import all_gather_objects, even_split, redistribute_batch
from rlspmd.distributed.mesh import DP, TP
from rlspmd.distributed.progress import progress
from rlspmd.engines.base import WeightStream
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.rollout.sampling import SamplingParams
from rlspmd.rollout.weight_sync import WeightBridge
from rlspmd.rollout.weights import WeightSource

TRAIN, VALIDATION = 0, 1  # generator purposes
SYNC_S = "timing/rollout/weight_sync"


class RolloutRole(Protocol):
    def generate(self, prompts: Batch, *, step: int, round: int = 0) -> Batch:
        """``rollout.n`` samples per prompt, with ``rollout_logprobs_BR``; metrics are kept until ``sync_weights``."""

    def generate_validation(self, prompts: Batch, *, step: int) -> Batch: ...

    def generate_greedy(self, prompts: Batch) -> Batch:
        """One greedy response per prompt (ReMax's baseline)."""

    def sync_weights(self, metrics: MetricBuffer) -> None:
        """Actor -> rollout after the update; adds the step's rollout metrics to ``metrics``."""


def put(metrics: MetricBuffer, reduced: dict[str, float]) -> None:
    """Values already reduced (the same on every rank) into a step buffer: a max over equal values keeps them."""
    for k, v in reduced.items():
        metrics.max(k, v)


def truncated(responses_BR: torch.Tensor, lengths_B: torch.Tensor, *, eos_ids: list[int], max_response_length: int) -> torch.Tensor:
    """Samples (``lengths_B`` tokens sampled each) that hit ``max_response_length`` without producing EOS."""
    lengths = lengths_B.long()
    R = responses_BR.shape[1]
    last = responses_BR.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    ended = torch.isin(last, torch.tensor(eos_ids, device=last.device))
    return (lengths >= max_response_length) & ~ended & (R >= max_response_length)


def sampling_params(cfg: RolloutConfig) -> tuple[SamplingParams, SamplingParams]:
    """(training, validation) sampling parameters."""
    train = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_response_length, n=cfg.n,
                           ignore_eos=cfg.ignore_eos)
    val = SamplingParams(temperature=cfg.val_temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_response_length, n=1)
    return train, val


class Rollout:
    """Generation on this rank's engine (colocated placement; the rollout ranks of a split placement)."""

    def __init__(self, cfg: RolloutConfig, *, engine, weights: WeightSource, mesh, seed: int, device: torch.device,
                 syncs_itself: bool = True):
        """``mesh``: the rollout role's 2-D (dp, tp) mesh. ``syncs_itself``: sync lazily when the engine has no
        current weights (colocated); in split placement the actor side orders every sync."""
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
        out = self.engine.generate(group, params, generator=generator)
        gen_s = time.perf_counter() - t0
        self.engine.sleep()
        if record:
            self._stats.max("timing/rollout/gen", gen_s)
            self._stats.sum("rollout/gen_tokens", out["response_mask_BR"].sum())
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
        # TP peers generate the same tokens: reduce over the DP dim only (each group counted once)
        out = m.reduce(mesh=self.dp_mesh)
        out["throughput/rollout/gen_tokens_per_s"] = out.pop("rollout/gen_tokens") / max(out["timing/rollout/gen"], 1e-9)
        self._stats, self._sync_stats = MetricBuffer(), {}
        return out


def _plan(link, rollout_ranks: list[int], total: int) -> list[int]:
    """Rows per link rank: ``total`` spread evenly over the rollout ranks (in rank order), none on actor ranks."""
    share = dict(zip(rollout_ranks, even_split(total, len(rollout_ranks))))
    return [share.get(g, 0) for g in link.mesh.tolist()]


def exchange(prompts: Batch, generate, *, link, rollout_ranks: list[int], device: torch.device) -> Batch:
    """One generation call across the link, entered by every rank of it: the actor ranks' prompts go to the rollout
    ranks, ``generate`` runs there (on the actor ranks it receives nothing and returns an empty batch), and each
    actor rank gets the samples of its own prompts back, in order. Returns this rank's samples (none on rollout ranks)."""
    counts = all_gather_objects(len(prompts), mesh=link)
    plan = _plan(link, rollout_ranks, sum(counts))
    mine = redistribute_batch(prompts if len(prompts) else None, mesh=link, sizes_in=counts, sizes_out=plan, device=device)
    out = generate(mine)  # also with no rows: TP peers gather together
    back = all_gather_objects(len(out), mesh=link)
    per_prompt = sum(back) // max(sum(counts), 1)
    return redistribute_batch(out if len(out) else None, mesh=link, sizes_in=back,
                              sizes_out=[n * per_prompt for n in counts], device=device)


class RolloutClient:
    """Split placement, actor ranks: generation and weight syncs run on the rollout ranks (``RolloutServer``)."""

    def __init__(self, *, link, bridge: WeightBridge, stream: WeightStream, rollout_ranks: list[int], device: torch.device):
        self.link, self.bridge, self.stream = link, bridge, stream
        self.rollout_ranks, self.device = rollout_ranks, device
        self.synced = False  # the rollout engine starts with disk (native) or dummy (vLLM) weights

    def generate(self, prompts: Batch, *, step: int, round: int = 0) -> Batch:
        return self._exchange(prompts)

    def generate_validation(self, prompts: Batch, *, step: int) -> Batch:
        return self._exchange(prompts)

    def generate_greedy(self, prompts: Batch) -> Batch:
        return self._exchange(prompts)

    def _exchange(self, prompts: Batch) -> Batch:
        if not self.synced:
            self.sync_weights(MetricBuffer())
        return exchange(prompts, lambda _: Batch(), link=self.link, rollout_ranks=self.rollout_ranks, device=self.device)

    def sync_weights(self, metrics: MetricBuffer) -> None:
        t0 = time.perf_counter()
        stats = self.bridge.send(self.stream)
        self.synced = True
        elapsed = time.perf_counter() - t0
        remote = next(m for m in all_gather_objects(None, mesh=self.link) if m is not None)
        remote[SYNC_S] = max(remote[SYNC_S], elapsed)
        remote["weight_sync/gathered_bytes"] = float(stats.gathered_bytes)
        put(metrics, remote)


class RolloutServer:
    """Split placement, rollout ranks: the same calls as ``RolloutClient``, served by the local ``Rollout``. The
    batches these ranks carry through the step are empty; the samples live on the actor's ranks."""

    def __init__(self, local: Rollout, *, link, rollout_ranks: list[int]):
        self.local, self.link, self.rollout_ranks = local, link, rollout_ranks
        self.synced = False

    def generate(self, prompts: Batch, *, step: int, round: int = 0) -> Batch:
        return self._exchange(lambda p: self.local.generate(p, step=step, round=round))

    def generate_validation(self, prompts: Batch, *, step: int) -> Batch:
        return self._exchange(lambda p: self.local.generate_validation(p, step=step))

    def generate_greedy(self, prompts: Batch) -> Batch:
        return self._exchange(self.local.generate_greedy)

    def _exchange(self, generate) -> Batch:
        if not self.synced:
            self.sync_weights(MetricBuffer())
        return exchange(Batch(), generate, link=self.link, rollout_ranks=self.rollout_ranks, device=self.local.device)

    def sync_weights(self, metrics: MetricBuffer) -> None:
        with progress.waiting():  # for the actor's update to end and its weights to arrive: not this rank's own work
            self.local.sync()  # receives the broadcast units
        self.synced = True
        report = self.local.report()  # reduced over the rollout ranks
        all_gather_objects(report, mesh=self.link)
        put(metrics, report)
