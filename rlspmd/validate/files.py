"""The files a run reads, checked before anything loads: model and tokenizer directories (every safetensors header),
data files, reward functions (found and parsed, never imported: importing runs the user's code), the models'
context against the longest sequence the run builds."""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import json
from pathlib import Path

from rlspmd.config import (
    Config,
)
from rlspmd.validate.problems import Problems


def check_files_exist(p: Problems, cfg: Config, *, with_critic: bool) -> None:
    """Model, tokenizer and data files, the reward function, the checkpoint to resume: every path the run reads."""
    a, rw = cfg.actor, cfg.reward
    check_model_files(p, "actor.model", a.model.path, tokenizer=a.model.tokenizer_path or a.model.path)
    if (
        cfg.ref.model_path is not None
    ):  # the reference and the critic read the actor's tokens: no tokenizer of their own
        check_model_files(p, "ref.model_path", cfg.ref.model_path, tokenizer=None)
    if with_critic and cfg.critic.model_path is not None:
        check_model_files(p, "critic.model_path", cfg.critic.model_path, tokenizer=None)
    if rw.model.path is not None:
        check_model_files(p, "reward.model", rw.model.path, tokenizer=rw.model.tokenizer_path or rw.model.path)
    check_data_files(p, "data.train_files", cfg.data.train_files)
    check_data_files(p, "data.val_files", cfg.data.val_files)
    if cfg.teacher.enabled:
        check_teacher_files(p, cfg)
    for problem in vision_problems(cfg, with_critic=with_critic):
        p.add(*problem)
    if rw.function is not None:
        p.file_check(check_function_spec, rw.function, field_name="reward.function")
    for i, spec in enumerate(rw.components):
        p.file_check(check_function_spec, spec, field_name=f"reward.components[{i}]")


def vision_problems(cfg: Config, *, with_critic: bool) -> list[tuple[str, object, str]]:
    """What a vision-language actor model does not run with (``models/vision.py: model_problems``)."""
    from rlspmd.models.vision import model_problems

    a = cfg.actor
    return model_problems(
        a.model.path,
        freeze_vision_tower=a.freeze_vision_tower,
        critic=with_critic,
        tp=cfg.mesh.actor_tp,
        engine=a.engine,
        lora=a.lora.enabled,
        rollout_engine=cfg.rollout.engine,
    )


def model_context(path: str) -> int | None:
    """The longest sequence a model directory's ``config.json`` allows (``max_position_embeddings``, also under a
    multimodal ``text_config``); None when the file or the field is absent (the model-file check reports a missing
    directory)."""
    config_json = Path(path).expanduser() / "config.json"
    try:
        c = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return None
    for section in (c, c.get("text_config") or {}):
        limit = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(limit, int) and limit > 0:
            return limit
    return None


def check_context(p: Problems, cfg: Config, *, with_critic: bool) -> None:
    """Every sequence the run builds, the prompt (``data.max_prompt_length``, tool schemas rendered in) plus the
    response (``rollout.max_response_length``; in a multi-turn run the whole conversation after the prompt: the model's
    turns, tool results and user turns), must fit the context of each model that reads it. Past it, positions run off
    the model's table (RoPE past its trained range) and nothing would say so. A prompt longer than
    ``data.max_prompt_length`` is dropped or reported with its file and row when the data loads."""
    d, r = cfg.data, cfg.rollout
    total = d.max_prompt_length + r.max_response_length
    what = (
        "the whole conversation after the prompt: model turns, tool results, user turns"
        if r.agent.enabled
        else "the generated tokens"
    )
    models = [
        ("actor.model.path", cfg.actor.model.path),
        ("ref.model_path", cfg.ref.model_path),
        ("teacher.model_path", cfg.teacher.model_path),
    ]
    if with_critic:
        models.append(("critic.model_path", cfg.critic.model_path))
    for field, path in models:
        limit = None if path is None else model_context(path)
        if limit is not None and total > limit:
            p.add(
                "data.max_prompt_length",
                d.max_prompt_length,
                f"+ rollout.max_response_length={r.max_response_length} ({what}) = {total} tokens exceeds the "
                f"context of {field}={path!r} (max_position_embeddings={limit} in its config.json); lower one of them "
                f"so their sum is <= {limit}",
            )
    path = cfg.actor.model.path
    for name, value, why in r.engine.context_problems(model_path=path, model_context=model_context(path)):
        p.add(f"rollout.engine.{name}", value, why)


def check_model_files(p: Problems, name: str, path: str, *, tokenizer: str | None) -> None:
    """A model directory (config, weights with sound safetensors headers) and, where the role reads text, its
    tokenizer files (the chat template is checked when the tokenizer loads)."""
    from rlspmd.models.loader import check_model_dir, check_tokenizer_dir

    field = name if name.endswith("model_path") else f"{name}.path"
    p.file_check(check_model_dir, path, field_name=field)
    if tokenizer is None:
        return
    tok_field = field if tokenizer == path else f"{name}.tokenizer_path"
    if tokenizer != path or Path(path).expanduser().is_dir():  # a missing model directory is reported once
        p.file_check(check_tokenizer_dir, tokenizer, field_name=tok_field)


def check_data_files(p: Problems, name: str, files: list[str]) -> None:
    from rlspmd.data.prompts import check_data_file

    for f in files:
        p.file_check(check_data_file, f, field_name=name)


def check_function_spec(spec: str, *, field_name: str) -> None:
    """A registered reward function's name, or ``path/to/file.py:fn`` / ``package.module:fn`` naming a file or module
    that exists and binds ``fn`` at its top level. Found and parsed, never imported: importing runs the user's code,
    which belongs to the run. A module whose names cannot be known without running it (a ``*`` import, a module
    ``__getattr__``) passes."""
    from rlspmd.rewards.rules import REWARD_FUNCTIONS
    from rlspmd.utils.imports import load_object, split_spec  # the same spec syntax as the loader that imports it later

    if spec in REWARD_FUNCTIONS:
        return
    if ":" not in str(spec):  # neither a name nor a path: the loader's own message, nothing imported
        load_object(spec, field_name=field_name, kind="callable", registered=REWARD_FUNCTIONS.names())
    target, name = split_spec(spec, field_name=field_name, example="function")
    if target.endswith(".py"):
        source = Path(target).expanduser()
        if not source.is_file():
            raise FileNotFoundError(f"{field_name}: file {source} does not exist")
    else:
        source = _module_source(target, spec=spec, field_name=field_name)
        if source is None:  # a compiled or namespace module: nothing to read
            return
    try:
        tree = ast.parse(source.read_text(), filename=str(source))
    except SyntaxError as e:
        raise ValueError(f"{field_name}={spec!r}: {source} line {e.lineno}: SyntaxError: {e.msg}") from None
    names = _top_level_names(tree.body)
    if name not in names and "*" not in names and "__getattr__" not in names:
        raise ValueError(f"{field_name}={spec!r}: {source} has no function {name!r}")


def _module_source(dotted: str, *, spec: str, field_name: str) -> Path | None:
    """The source file of ``a.b.c``, located package by package without importing (and so running) any of them."""
    parts = dotted.split(".")
    found = None
    path = None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        found = importlib.machinery.PathFinder.find_spec(name, path)
        if found is None and i == 0:  # a module that is not on sys.path: frozen or built in
            found = importlib.util.find_spec(name)
        if found is None:
            raise ValueError(f"{field_name}={spec!r}: cannot find module {name!r} (not on the Python path)")
        path = found.submodule_search_locations
    origin = found.origin if found is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


def _top_level_names(body: list[ast.stmt]) -> set[str]:
    """Names a module binds at its top level (inside top-level if/try/with blocks too)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.If):
            names |= _top_level_names(node.body) | _top_level_names(node.orelse)
        elif isinstance(node, ast.With):
            names |= _top_level_names(node.body)
        elif isinstance(node, ast.Try):
            names |= _top_level_names(node.body) | _top_level_names(node.orelse) | _top_level_names(node.finalbody)
            for handler in node.handlers:
                names |= _top_level_names(handler.body)
    return names


def check_teacher_files(p: Problems, cfg: Config) -> None:
    """The teacher's directory, its tokenizer against the student's (the same token ids, before any weights load) and,
    for a signal over the whole vocabulary, the same vocabulary size."""
    from rlspmd.models.loader import check_same_tokenizer

    path, a = cfg.teacher.model_path, cfg.actor.model
    check_model_files(p, "teacher.model_path", path, tokenizer=None)
    if not Path(path).expanduser().is_dir():
        return  # reported once, above
    student_field = "actor.model.tokenizer_path" if a.tokenizer_path else "actor.model.path"
    p.file_check(
        check_same_tokenizer,
        path,
        field_name="teacher.model_path",
        student=a.tokenizer_path or a.path,
        student_field=student_field,
    )
    if cfg.teacher.signal.full_vocab:
        sizes = {f: _vocab_size(q) for f, q in (("teacher.model_path", path), ("actor.model.path", a.path))}
        if None not in sizes.values() and len(set(sizes.values())) > 1:
            p.add(
                "teacher.model_path",
                path,
                f"has vocab_size={sizes['teacher.model_path']} in its config.json, the student "
                f"{sizes['actor.model.path']}: teacher.signal:{cfg.teacher.signal.name} compares the whole "
                "distributions, which needs the same number of logits",
            )


def _vocab_size(path: str) -> int | None:
    try:
        c = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = c.get("vocab_size") or (c.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) else None
