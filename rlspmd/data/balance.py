"""Balancing work by token count: DP sequence balancing and token-budget micro-batches. Pure functions.

``karmarkar_karp`` is the largest differencing method for k-way number partitioning (Karmarkar & Karp 1982;
k-way form as in Korf, "Multi-way number partitioning", IJCAI 2009): start from one partial partition per item (or,
with ``equal_size``, per group of k consecutive items in descending order, one item per part), repeatedly merge the
two partial partitions with the largest spread, pairing the heaviest part of one with the lightest of the other.
With ``equal_size`` every part gets the same number of items, which keeps per-rank sample counts (and so
mini-batch sizes) unchanged.

``micro_batch_plan`` splits one rank's samples into token-balanced micro-batches under a token budget; the caller
agrees on the count over ranks first (``count_micro_batches`` per rank, then a max over the DP mesh), because under
FSDP every rank must run the same number of forwards and backwards.
"""

from __future__ import annotations

import heapq
import math


def karmarkar_karp(weights: list[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Partition ``range(len(weights))`` into ``k`` lists with near-equal weight sums.

    ``equal_size`` requires ``len(weights) % k == 0`` and gives every part ``len(weights) // k`` items. Each part's
    indices are sorted; the parts are ordered by ascending first index (empty parts last), so the result is
    deterministic.
    """
    n = len(weights)
    if k <= 0:
        raise ValueError(f"cannot partition into {k} parts")
    if equal_size and n % k:
        raise ValueError(f"equal-size partition of {n} items into {k} parts is impossible")
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    # A partial partition: k parts as (sum, items), kept sorted by descending sum.
    states: list[list[tuple[int, list[int]]]] = []
    if equal_size:
        for g in range(0, n, k):
            states.append(sorted(((weights[i], [i]) for i in order[g : g + k]), key=lambda p: -p[0]))
    else:
        for i in order:
            states.append([(weights[i], [i])] + [(0, []) for _ in range(k - 1)])
    heap = [(-(s[0][0] - s[-1][0]), t, s) for t, s in enumerate(states)]
    heapq.heapify(heap)
    tick = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))), key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tick, merged))
        tick += 1
    parts = [sorted(items) for _, items in heap[0][2]] if heap else [[] for _ in range(k)]
    return sorted(parts, key=lambda p: (not p, p[0] if p else 0))


def imbalance(loads: list[float]) -> float:
    """max / mean of per-rank loads (1.0 is perfect balance)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def count_micro_batches(tokens: list[int], max_tokens: int) -> int:
    """Fewest token-balanced micro-batches whose largest stays within ``max_tokens`` (a sample longer than the
    budget gets a micro-batch of its own); at least 1, at most ``len(tokens)``."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_micro_batch must be positive, got {max_tokens}")
    n = len(tokens)
    if n == 0:
        return 1
    k = max(1, math.ceil(sum(tokens) / max_tokens))
    while k < n and any(len(p) > 1 and sum(tokens[i] for i in p) > max_tokens for p in karmarkar_karp(tokens, k)):
        k += 1
    return min(k, n)


def micro_batch_plan(tokens: list[int], count: int) -> list[list[int]]:
    """Exactly ``count`` token-balanced micro-batches of sample indices (some empty when ``count > len(tokens)``)."""
    return karmarkar_karp(tokens, count)
