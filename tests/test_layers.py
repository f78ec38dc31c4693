"""The import graph of ``rlspmd/`` runs down the layers and has no circle (STYLE.md 17).

Read from the source with ``ast`` (every ``import``, module-level or inside a function, since a deferred import is
still an arrow), so the check needs nothing installed and costs milliseconds. Floors, top to bottom:

    entry points   train, sft, startup, validate (the collector that checks a config before anything loads), samples,
                   plot
    trainer        the loop, the builder, checkpointing, the trainer's own stages
    roles          policy, reference, critic, reward, rollout roles; their contracts
    config         the top-level sections, composing the components of the floors below (each beside its code)
    agent          the multi-turn agent loop, tools, interactions
    rollout        generation engines and weight sync
    engines        training engines (FSDP2, megatron), rewards, third_party adapters
    distributed    runtime, meshes, dispatch, micro-batches
    data, models
    protocol, components (the registries), stages (a user stage's contract), algorithms, metrics, trackers, utils

A module may import from its own floor or any floor below, never from above.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = [
    {"protocol", "components", "stages", "algorithms", "metrics", "trackers", "utils"},
    {"data", "models"},
    {"distributed"},
    {"engines", "rewards", "third_party"},
    {"rollout"},
    {"agent"},
    {"config"},
    {"roles"},
    {"trainer"},
    {"train", "sft", "startup", "validate", "samples", "plot", "__main__", ""},
]
FLOOR = {part: level for level, parts in enumerate(FLOORS) for part in parts}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part(module: str) -> str:
    """The package a module belongs to (``rlspmd.roles.policy`` -> ``roles``; ``third_party.x`` -> ``third_party``)."""
    if module.startswith("third_party"):
        return "third_party"
    return module.split(".")[1] if module.count(".") else ""


def import_graph() -> dict[str, set[str]]:
    files = [*(ROOT / "rlspmd").rglob("*.py"), *(ROOT / "third_party").glob("*.py")]
    modules = {module_name(f): f for f in files}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def test_no_module_imports_from_a_higher_floor():
    graph = import_graph()
    unknown = {part(m) for m in graph} - set(FLOOR)
    assert not unknown, f"packages missing from FLOORS: {sorted(unknown)}"
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if FLOOR[part(b)] > FLOOR[part(a)])
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt) :] + [nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "import circles:\n" + "\n".join(circles)
