"""Tools as plain Python: tool-call parsing, schema and argument checks, the start-up checks that name the tool and
the field, the built-in tools, and the code runner's limits (a real subprocess under real rlimits)."""

import contextlib
import os
import socket
import subprocess
import sys
import threading

import pytest

from rlspmd.agent import (
    Calculator,
    Gsm8kAnswer,
    HermesParser,
    ParseError,
    ToolCall,
    ToolSample,
    check_arguments,
    load_interaction,
    load_parser,
    load_tools,
)
from rlspmd.agent.builtin import evaluate
from rlspmd.agent.sandbox import network_namespace_prefix, run_python
from rlspmd.config import AgentConfig, CodeRunnerConfig


def test_hermes_parser_reads_one_several_and_malformed_calls():
    p = HermesParser()
    assert p.parse("The answer is 4.") == []
    one = p.parse('Let me add. <tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>')
    assert one == [ToolCall("calculator", {"expression": "2 + 2"})]
    several = p.parse(
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call> and '
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}</tool_call>'
    )
    assert several == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [1, 2]})]  # string-encoded arguments decoded
    bad = p.parse(
        '<tool_call>{"name": "a", "arguments": {</tool_call><tool_call>[1, 2]</tool_call>'
        '<tool_call>{"name": "c", "arguments": "not json"}</tool_call><tool_call>{"name": "d"'
    )
    assert [type(c) for c in bad] == [ParseError] * 4
    assert "not valid JSON" in bad[0].message and "JSON object" in bad[1].message
    assert "not JSON" in bad[2].message and "without its </tool_call>" in bad[3].message
    # a good call next to a malformed one keeps its place
    mixed = p.parse('<tool_call>{oops}</tool_call><tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert isinstance(mixed[0], ParseError) and mixed[1] == ToolCall("a", {})


def test_arguments_are_checked_against_the_schema_without_raising():
    schema = Calculator.schema
    assert check_arguments(schema, {"expression": "1 + 1"}) is None
    assert "missing required" in check_arguments(schema, {})
    assert "unknown argument" in check_arguments(schema, {"expression": "1", "mode": "x"})
    assert "must be of type string" in check_arguments(schema, {"expression": 3})
    assert "JSON object" in check_arguments(schema, ["1 + 1"])


def test_calculator_is_a_safe_evaluator():
    assert evaluate("4821 + 3907") == 8728 and evaluate("(2 + 3) * -4 / 2") == -10.0 and evaluate("2 ** 10 % 7") == 2
    assert Calculator().call(None, {"expression": "7 / 2"})[0] == "3.5"
    assert Calculator().call(None, {"expression": "6 / 2"})[0] == "3"
    for bad, why in [
        ("__import__('os').system('true')", "unsupported"),
        ("1 / 0", "division by zero"),
        ("2 ** 100000", "exponent"),
        ("[1, 2]", "unsupported"),
        ("1 +", "cannot parse"),
        ("x", "unsupported"),
        ("1" * 300, "longer than"),
    ]:
        with pytest.raises(ValueError, match=why):
            evaluate(bad)


def test_gsm8k_answer_tool_reads_verl_create_kwargs_and_scores_the_last_answer():
    tool = Gsm8kAnswer()
    state = tool.create(
        ToolSample(ground_truth="7", data_source="openai/gsm8k", extra_info={}, create_kwargs={"ground_truth": "72"})
    )
    assert tool.call(state, {"answer": "70"}) == ("incorrect", -0.05, {})  # no improvement costs 0.05 (verl)
    assert tool.call(state, {"answer": "#### 72"}) == ("correct", 0.0, {})
    assert tool.score(state) == 1.0
    assert tool.call(state, {"answer": "1,000"})[1] == -0.05 and tool.score(state) == 0.0  # the LAST answer counts


BAD_TOOLS = """
class NoCall:
    name = "nocall"
    schema = {"type": "function", "function": {"name": "nocall", "parameters": {"type": "object", "properties": {}}}}
    def create(self, sample): return None
    def score(self, state): return 0.0
    def release(self, state): pass

class BadSchema:
    name = "bad"
    schema = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object",
              "properties": {"x": {"type": "float"}}}}}
    def create(self, sample): return None
    def call(self, state, arguments): return "", 0.0, {}
    def score(self, state): return 0.0
    def release(self, state): pass

class Mismatch(BadSchema):
    name = "other"
    schema = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {}}}}
"""


def test_start_up_checks_name_the_tool_and_the_field(tmp_path):
    f = tmp_path / "my_tools.py"
    f.write_text(BAD_TOOLS)
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    cases = [
        ([f"{broken}:X"], r"rollout.agent.tools\[0\]=.*broken.py:X.*broken.py failed to import: ModuleNotFoundError"),
        (
            [f"{f}:Missing"],
            r"rollout.agent.tools\[0\]=.*my_tools.py has no class 'Missing' "
            r"\(it defines \['BadSchema', 'Mismatch', 'NoCall'\]\)",
        ),
        (["calculator", f"{f}:NoCall"], r"rollout.agent.tools\[1\].*lacks \['call'\]"),
        ([f"{f}:BadSchema"], r"rollout.agent.tools\[0\].*invalid tool schema: property 'x' needs a 'type'"),
        ([f"{f}:Mismatch"], r"name 'other' differs from its schema's function.name 'bad'"),
        (["calculator", "calculator"], r"rollout.agent.tools\[1\].*already used by rollout.agent.tools\[0\]"),
        (["nonsense"], r"rollout.agent.tools\[0\]='nonsense'.*neither a registered name"),
    ]
    for specs, match in cases:
        with pytest.raises(ValueError, match=match):
            load_tools(AgentConfig(tools=specs))
    with pytest.raises(ValueError, match=r"rollout.agent.parser='nope': neither a registered name \(hermes\)"):
        load_parser(AgentConfig(parser="nope"))
    with pytest.raises(ValueError, match=r"rollout.agent.interaction=.*lacks"):
        load_interaction(AgentConfig(interaction=f"{f}:NoCall"))
    names = [t.name for t in load_tools(AgentConfig(tools=["calculator", "gsm8k_answer", "python"]))]
    assert names == ["calculator", "calc_gsm8k_reward", "python"]


LIMITS = dict(timeout_s=5.0, memory_mb=256, cpu_s=5, max_output_chars=400)
MODES = pytest.mark.parametrize("sandbox", ["bwrap", "audit-hook-unsafe"])


@MODES
def test_code_runner_runs_code_in_its_own_directory(sandbox):
    r = run_python(
        "import os; open('out.txt', 'w').write('x' * 3); print(sorted(os.listdir('.')), os.getpid())",
        **LIMITS,
        sandbox=sandbox,
    )
    assert r.exit_code == 0 and not r.timed_out
    assert "'out.txt'" in r.output and str(os.getpid()) not in r.output.split("]")[1]  # another process
    with pytest.warns(UserWarning, match="can read every file") if sandbox != "bwrap" else contextlib.nullcontext():
        tool = load_tools(AgentConfig(tools=["python"], code=CodeRunnerConfig(timeout_s=5.0, sandbox=sandbox)))[0]
    text, reward, metrics = tool.call(None, {"code": "print(6 * 7)"})
    assert text.strip() == "42" and metrics["code_failures"] == 0.0


@MODES
def test_code_runner_wall_time_limit_kills_the_process_group(sandbox):
    r = run_python("import time\nwhile True: time.sleep(0.01)", **{**LIMITS, "timeout_s": 1.0}, sandbox=sandbox)
    assert r.timed_out and r.exit_code is None and r.seconds < 5


@MODES
def test_code_runner_cpu_limit(sandbox):
    r = run_python("while True: pass", **{**LIMITS, "timeout_s": 30.0, "cpu_s": 1}, sandbox=sandbox)
    assert not r.timed_out and r.exit_code != 0 and r.seconds < 25  # SIGXCPU, long before the wall-time limit


@MODES
def test_code_runner_memory_limit(sandbox):
    r = run_python("x = bytearray(1024 ** 3)\nprint('allocated')", **LIMITS, sandbox=sandbox)
    assert r.exit_code != 0 and "MemoryError" in r.output and "allocated" not in r.output
    assert run_python("x = bytearray(50 * 1024 ** 2)\nprint('ok')", **LIMITS, sandbox=sandbox).output.strip() == "ok"


def _listening_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    return server, accepted


@MODES
def test_code_runner_has_no_network(sandbox):
    server, accepted = _listening_server()
    port = server.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    r = run_python(code, **LIMITS, sandbox=sandbox)
    assert "connected" not in r.output and r.exit_code != 0 and not accepted
    if sandbox == "audit-hook-unsafe":
        assert "network access is disabled" in r.output  # the audit hook refuses the socket
    else:
        assert "ConnectionRefusedError" in r.output  # a network namespace of its own: its loopback has no server
    server.close()


def test_network_namespace_has_no_route_even_without_the_audit_hook():
    """The layer under the audit hook (audit-hook-unsafe mode): a plain Python in the runner's namespace cannot reach
    a server on this host."""
    prefix = network_namespace_prefix()
    if not prefix:
        pytest.skip("unprivileged user namespaces are not available here; the audit hook alone refuses sockets")
    server, accepted = _listening_server()
    port = server.getsockname()[1]
    code = (
        f"import socket\ntry:\n socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')\n"
        "except OSError as e:\n print('refused', e)"
    )
    out = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=30).stdout
    assert out.startswith("refused") and not accepted
    direct = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30).stdout
    assert direct.startswith("connected")  # the same code outside the namespace does connect: the test can fail
    server.close()


def test_audit_hook_mode_refuses_writes_outside_its_directory(tmp_path):
    """What the weaker mode does hold (tests/test_sandbox.py attacks the default mode)."""
    target = tmp_path / "escaped.txt"
    keep = tmp_path / "keep.txt"
    keep.write_text("keep")
    attempts = [
        f"open({str(target)!r}, 'w').write('x')",
        f"import os; os.remove({str(keep)!r})",
        f"import os; os.rename({str(keep)!r}, 'stolen.txt')",
        f"import os; os.mkdir({str(tmp_path / 'dir')!r})",
        f"import os; fd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT); os.write(fd, b'x')",
        f"import os; os.chdir({str(tmp_path)!r}); open('escaped.txt', 'w').write('x')",
        f"import subprocess; subprocess.run(['touch', {str(target)!r}])",
        f"import os; os.system('touch {target}')",
        "import ctypes",
    ]
    for code in attempts:
        r = run_python(code, **LIMITS, sandbox="audit-hook-unsafe")
        assert r.exit_code != 0 and "PermissionError" in r.output, (code, r.output)
    assert not target.exists() and keep.read_text() == "keep" and not (tmp_path / "dir").exists()


def test_what_the_audit_hook_mode_gives_up(tmp_path):
    """The list of what audit-hook-unsafe gives up (docs/agents.md), shown: the code reads the run's files, and a
    process started by a primitive that raises no audit event writes outside. The default mode holds against both."""
    canary = tmp_path / "answers.txt"
    canary.write_text("the answer is 4242")
    target = tmp_path / "escaped.txt"
    inner = f"open({str(target)!r}, 'w').write('x')"
    code = (
        f"try:\n    print(open({str(canary)!r}).read())\nexcept OSError as e:\n    print(type(e).__name__)\n"
        "import _posixsubprocess, os, sys\n"
        f"inner = {inner!r}\n"
        "pid = _posixsubprocess.fork_exec([sys.executable, '-c', inner], [os.fsencode(sys.executable)], True, (), "
        "None, None, -1, -1, -1, -1, -1, -1, *os.pipe(), False, False, -1, None, None, None, -1, None, False)\n"
        "os.waitpid(pid, 0)"
    )
    r = run_python(code, **LIMITS, sandbox="bwrap")
    assert "4242" not in r.output and "FileNotFoundError" in r.output and not target.exists(), r.output
    r = run_python(code, **LIMITS, sandbox="audit-hook-unsafe")
    assert "4242" in r.output and target.exists(), r.output


@MODES
def test_code_runner_truncates_its_output_and_limits_file_sizes(sandbox):
    r = run_python("print('y' * 100000)", **LIMITS, sandbox=sandbox)
    assert r.truncated and len(r.output) == LIMITS["max_output_chars"] and " [...] " in r.output
    r = run_python("open('big', 'wb').write(b'0' * (64 << 20))", **LIMITS, sandbox=sandbox)  # RLIMIT_FSIZE (16 MiB)
    assert r.exit_code != 0
