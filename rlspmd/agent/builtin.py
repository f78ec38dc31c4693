"""The built-in tools: a calculator, a GSM8K answer check and a Python code runner.

* ``calculator`` evaluates an arithmetic expression with a small evaluator over Python's ``ast`` (numbers, ``+ - * /
  // % **``, unary signs, parentheses), never ``eval``: anything else in the expression is an error message.
* ``calc_gsm8k_reward`` (also registered as ``gsm8k_answer``; verl's tool name, so verl's GSM8K multi-turn files and
  their ``tools_kwargs`` load unchanged): the model submits an answer and hears whether it is right. The last submitted
  answer is the tool's final score (``score``); as in verl, a submission that does not improve on the previous one
  costs 0.05.
* ``python`` runs model-written code in OS-level isolation (``agent/sandbox.py``) and returns its output; it refuses
  to be built where the configured isolation cannot run here (fail closed).
"""

from __future__ import annotations

import ast
import math
import operator
import re
import warnings

from rlspmd.agent.sandbox import check_sandbox, run_python
from rlspmd.agent.tools import TOOLS, Tool, ToolSample, function_schema

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ``ValueError`` (with a message for the model) for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as an arithmetic expression") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) > MAX_EXPONENT:
            raise ValueError(f"exponent {b} is larger than {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](a, b)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value
    raise ValueError(f"unsupported element {ast.unparse(node)!r}: only numbers, + - * / // % ** and parentheses")


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


@TOOLS.register("calculator")
class Calculator(Tool):
    name = "calculator"
    schema = function_schema(
        "calculator",
        "Evaluate an arithmetic expression.",
        {"expression": {"type": "string", "description": "e.g. 4821 + 3907"}},
        ["expression"],
    )

    def call(self, state, arguments: dict) -> tuple[str, float, dict]:
        return format_number(evaluate(arguments["expression"])), 0.0, {}


_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def _parse_number(text: str) -> float | None:
    found = _NUMBER.findall(text.replace("####", " "))
    try:
        return float(found[-1].replace(",", "")) if found else None
    except ValueError:
        return None


@TOOLS.register("calc_gsm8k_reward", "gsm8k_answer")
class Gsm8kAnswer(Tool):
    name = "calc_gsm8k_reward"
    schema = function_schema(
        "calc_gsm8k_reward",
        "Submit your final answer; you hear whether it is correct.",
        {"answer": {"type": "string", "description": "the final answer, a number"}},
        ["answer"],
    )
    penalty = 0.05
    """Cost of a submission that does not improve on the previous one (verl's value)."""

    def create(self, sample: ToolSample) -> dict:
        truth = sample.create_kwargs.get("ground_truth", sample.ground_truth)
        return {"ground_truth": str(truth), "answer": None, "reward": 0.0}

    def call(self, state: dict, arguments: dict) -> tuple[str, float, dict]:
        answer = arguments["answer"]
        got, want = _parse_number(answer), _parse_number(state["ground_truth"])
        reward = float(got is not None and want is not None and abs(got - want) < 1e-6)
        delta = 0.0 if reward > state["reward"] else -self.penalty
        state["answer"], state["reward"] = answer, reward
        return ("correct" if reward else "incorrect"), delta, {}

    def score(self, state: dict) -> float:
        return state["reward"]


@TOOLS.register("python")
class PythonRunner(Tool):
    name = "python"
    schema = function_schema(
        "python",
        "Run a Python program and read what it prints.",
        {"code": {"type": "string", "description": "the program"}},
        ["code"],
    )

    def __init__(self, *, timeout_s: float, memory_mb: int, cpu_s: int, max_output_chars: int, sandbox: str = "bwrap"):
        check_sandbox(sandbox)  # fail closed: no tool that would run model code unisolated by accident
        if sandbox == "audit-hook-unsafe":
            warnings.warn(
                "rollout.agent.code.sandbox='audit-hook-unsafe': the python tool's code can read every file "
                "this process can (data, checkpoints) and can step around the audit hook; see docs/agents.md: The "
                "python tool's sandbox",
                stacklevel=2,
            )
        self.limits = dict(
            timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s, max_output_chars=max_output_chars, sandbox=sandbox
        )

    @classmethod
    def from_config(cls, agent) -> PythonRunner:
        c = agent.code
        return cls(
            timeout_s=c.timeout_s,
            memory_mb=c.memory_mb,
            cpu_s=c.cpu_s,
            max_output_chars=c.max_output_chars,
            sandbox=c.sandbox,
        )

    def call(self, state, arguments: dict) -> tuple[str, float, dict]:
        r = run_python(arguments["code"], **self.limits)
        text = r.output
        if r.timed_out:
            text += f"\n[killed: wall-time limit of {self.limits['timeout_s']} s]"
        elif r.exit_code:
            text += f"\n[exit code {r.exit_code}]"
        if r.truncated:
            text += "\n[output truncated]"
        return (
            text,
            0.0,
            {"code_timeouts": float(r.timed_out), "code_failures": float(bool(r.exit_code) or r.timed_out)},
        )
