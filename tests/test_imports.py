"""The shared ``path/to/file.py:Name`` loader (``rlspmd/utils/imports.py``) and the fields that use it: every error
names the field, the spec and the file."""

import pickle

import pytest

from rlspmd.agent import load_interaction, load_parser, load_tools
from rlspmd.config import AgentConfig
from rlspmd.rewards.functions import load_function
from rlspmd.utils.imports import load_object, module_name_for, split_spec

USER = """
import dataclasses

@dataclasses.dataclass
class State:
    hits: int = 0

class Counter:
    calls = 0
    def __init__(self):
        type(self).calls += 1

def score(response, ground_truth):
    return float(response == ground_truth)

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_file(tmp_path):
    f = tmp_path / "user_code.py"
    f.write_text(USER)
    return f


def test_loads_classes_and_functions_from_files_and_modules(user_file):
    assert load_function(f"{user_file}:score")("a", "a") == 1.0
    assert load_function("rlspmd.rewards.rules:gsm8k")("#### 3", "3") == 1.0
    cls = load_object(f"{user_file}:Counter", field_name="f", kind="class")
    assert cls.__name__ == "Counter"
    # one module per file per process: a second field naming the file sees the same class (and its class state)
    assert load_object(f"{user_file}:Counter", field_name="g", kind="class") is cls
    # classes defined in a user file pickle by reference (tool states travel between ranks in split placement)
    state_cls = load_object(f"{user_file}:State", field_name="f", kind="class")
    assert pickle.loads(pickle.dumps(state_cls(hits=2))) == state_cls(hits=2)


def test_same_stem_in_two_directories_are_two_modules(tmp_path):
    for d, value in (("a", 1), ("b", 2)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "tools.py").write_text(f"def f():\n    return {value}\n")
    assert module_name_for(tmp_path / "a/tools.py") != module_name_for(tmp_path / "b/tools.py")
    assert [load_function(f"{tmp_path / d / 'tools.py'}:f")() for d in "ab"] == [1, 2]


@pytest.mark.parametrize(
    "spec, kind, exc, match",
    [
        (
            "no_colon",
            "callable",
            ValueError,
            r"reward.function='no_colon': expected 'path/to/file.py:function' or 'package.module:function'",
        ),
        ("file.py:", "callable", ValueError, r"expected 'path/to/file.py:function'"),
        (
            "{d}/missing.py:score",
            "callable",
            FileNotFoundError,
            r"reward.function='.*missing.py:score': file .*missing.py does not exist",
        ),
        (
            "{f}:nope",
            "callable",
            ValueError,
            r"reward.function='.*user_code.py:nope': .*user_code.py has no function 'nope' "
            r"\(it defines \['Counter', 'State', 'score'\]\)",
        ),
        (
            "{f}:NOT_CALLABLE",
            "callable",
            ValueError,
            r"user_code.py: NOT_CALLABLE is an object of type int \(3\), expected a function or other callable",
        ),
        ("{f}:score", "class", ValueError, r"user_code.py: score is an object of type function .*expected a class"),
        (
            "{d}/raises.py:f",
            "callable",
            ValueError,
            r"reward.function='.*raises.py:f': .*raises.py failed to import: ZeroDivisionError",
        ),
        (
            "not_a_module_anywhere.sub:f",
            "callable",
            ValueError,
            r"module 'not_a_module_anywhere.sub' failed to import: ModuleNotFoundError",
        ),
        ("rlspmd.rewards.rules:nope", "callable", ValueError, r"rlspmd.rewards.rules has no function 'nope'"),
    ],
)
def test_errors_name_the_field_the_spec_and_the_file(tmp_path, user_file, spec, kind, exc, match):
    (tmp_path / "raises.py").write_text("x = 1 / 0\n")
    with pytest.raises(exc, match=match):
        load_object(spec.format(d=tmp_path, f=user_file), field_name="reward.function", kind=kind)


def test_a_file_that_failed_to_import_is_not_left_half_loaded(tmp_path):
    f = tmp_path / "flaky.py"
    f.write_text("raise RuntimeError('first')\n")
    with pytest.raises(ValueError, match="RuntimeError: first"):
        load_function(f"{f}:g")
    f.write_text("def g():\n    return 5\n")
    assert load_function(f"{f}:g")() == 5


def test_split_spec_keeps_colons_in_the_path():
    assert split_spec("C:/x/y.py:fn", field_name="f") == ("C:/x/y.py", "fn")
    with pytest.raises(ValueError, match="f='a.py:1x'"):
        split_spec("a.py:1x", field_name="f")


def test_every_agent_field_uses_it(user_file):
    with pytest.raises(
        ValueError,
        match=r"rollout.agent.tools\[0\]='x': neither a registered name \(calc_gsm8k_reward, "
        r"calculator, gsm8k_answer, python\)",
    ):
        load_tools(AgentConfig(tools=["x"]))
    with pytest.raises(
        ValueError, match=r"rollout.agent.tools\[0\]=.*user_code.py: score is an object of type function"
    ):
        load_tools(AgentConfig(tools=[f"{user_file}:score"]))
    with pytest.raises(
        FileNotFoundError, match=r"rollout.agent.parser=.*missing.py:P': file .*missing.py does not exist"
    ):
        load_parser(AgentConfig(parser=f"{user_file.parent}/missing.py:P"))
    with pytest.raises(ValueError, match=r"rollout.agent.interaction='gsm9k': neither a registered name \(gsm8k\)"):
        load_interaction(AgentConfig(interaction="gsm9k"))
    with pytest.raises(
        ValueError,
        match=r"rollout.agent.interaction=.*user_code.py has no class 'Nope' \(it defines "
        r"\['Counter', 'State'\]\)",
    ):
        load_interaction(AgentConfig(interaction=f"{user_file}:Nope"))


def test_importing_rlspmd_keeps_scikit_learn_out_of_transformers_generation():
    """``rlspmd/__init__.py``: a model class imports ``transformers.generation``, which imports scikit-learn (1-2 s of
    every rank's start) where it is installed; after ``import rlspmd`` it does not, and scikit-learn still imports."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("scikit-learn is not installed (mlflow brings it): nothing to keep out")
    probe = (
        "import sys, rlspmd, transformers.generation.candidate_generator as g, transformers.utils.import_utils as u; "
        "print('sklearn' in sys.modules, g.is_sklearn_available(), u.is_sklearn_available(), end=' '); "
        "import sklearn.metrics; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    # transformers' own check still finds it (without the hook the module would import it); the module was told no
    assert out.stdout.split() == ["False", "False", "True", "ok"], out.stderr[-2000:]
