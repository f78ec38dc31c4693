"""The agent loop: token-in/token-out layout of multi-turn conversations, the loss mask, error handling, interactions,
verl multi-turn rows, and request-level generation on the native engine (continuous batching).

Most tests drive the loop with ``ScriptedModel``, an engine whose *model* is replaced by a script of turns (what a model
would generate), so that the conversation is known by hand; the tokenizer, chat templates, tools, parser, and the loop
are the real ones. The continuous-batching tests run the real native engine on the tiny model.
"""

import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlspmd.agent import Tool, build_agent_loop, function_schema
from rlspmd.config import AgentConfig
from rlspmd.data.prompts import PromptDataset
from rlspmd.metrics import MetricBuffer
from rlspmd.models.decoder import make_decoder
from rlspmd.protocol import Batch
from rlspmd.rollout.continuous import Request, SlotDecoder, serve
from rlspmd.rollout.native import NativeEngine, OwnWeights, generate_tokens
from rlspmd.rollout.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=256)


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class ScriptedModel:
    """An engine whose model is a script: conversation k's t-th request generates ``scripts[k][t]`` (+ EOS). It checks
    the loop's side of token-in/token-out: every request's context is the previous context plus the ids it got back."""

    def __init__(self, tokenizer, scripts: dict[int, list[str]]):
        self.tok, self.scripts = tokenizer, scripts
        self.eos = tokenizer.eos_token_id
        self.generated: dict[int, list[list[int]]] = {k: [] for k in scripts}
        self.contexts: dict[int, list[list[int]]] = {k: [] for k in scripts}

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos]

    def serve(self, source, params, *, max_len, max_requests):
        while True:
            requests = source.take(block=True)
            if not requests:
                return {}
            for r in requests:
                turn = len(self.generated[r.key])
                ids = self.ids(self.scripts[r.key][turn])[: r.max_new_tokens]
                self.contexts[r.key].append(list(r.ids))
                self.generated[r.key].append(ids)
                source.finish(r.key, ids, [-0.25 - 0.01 * j for j in range(len(ids))])


def prompts(tokenizer, loop, rows: list[dict]) -> Batch:
    """A prompt batch as ``PromptDataset.batch`` makes it, for rows ``{"messages", "ground_truth", "extra_info"}``."""
    texts = [
        tokenizer.apply_chat_template(
            r["messages"], tools=loop.tool_schemas, tokenize=False, add_generation_prompt=True
        )
        for r in rows
    ]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    P = max(map(len, ids))
    p = torch.full((len(ids), P), tokenizer.pad_token_id)
    m = torch.zeros(len(ids), P, dtype=torch.long)
    for i, x in enumerate(ids):
        p[i, P - len(x) :], m[i, P - len(x) :] = torch.tensor(x), 1
    return Batch(
        {"prompts_BP": p, "prompt_mask_BP": m, "uid_B": torch.arange(len(ids))},
        {
            "data_source": ["arithmetic"] * len(rows),
            "ground_truth": [r["ground_truth"] for r in rows],
            "extra_info": [r.get("extra_info", {"index": i}) for i, r in enumerate(rows)],
            "prompt_text": texts,
            "prompt_messages": [r["messages"] for r in rows],
        },
    )


def agent(tokenizer, max_response_length: int = 256, **cfg):
    return build_agent_loop(
        AgentConfig(**cfg),
        tokenizer=tokenizer,
        eos_ids=[tokenizer.eos_token_id],
        pad_id=tokenizer.pad_token_id,
        max_response_length=max_response_length,
        model_field="actor.model.path",
    )


def response(out: Batch, i: int) -> tuple[list[int], list[int], list[float]]:
    n = int(out["response_mask_BR"][i].sum())
    return (
        out["responses_BR"][i, :n].tolist(),
        out["loss_mask_BR"][i, :n].tolist(),
        out["rollout_logprobs_BR"][i, :n].tolist(),
    )


@pytest.fixture(scope="module")
def tok(tiny_tools_model):
    return AutoTokenizer.from_pretrained(str(tiny_tools_model))


def test_loss_mask_is_exactly_the_models_tokens_and_ids_are_generated_ids_plus_templated_turns(tok):
    loop = agent(tok, tools=["calculator"], max_turns=4)
    user = [{"role": "user", "content": "Calculate 12 + 30 - 5."}]
    turns = [
        call("calculator", expression="12 + 30") + call("calculator", expression="42 - 5"),  # two calls, one turn
        call("calculator", expression="37 * 1"),
        "#### 37",
    ]
    model = ScriptedModel(tok, {0: turns})
    out = loop.run(model, prompts(tok, loop, [{"messages": user, "ground_truth": "37"}]), GREEDY, None, MetricBuffer())
    ids, loss, logprobs = response(out, 0)
    gen = model.generated[0]
    # the tool turns as the template renders them after an assistant turn (delta of the probe conversation)
    tool1 = loop.renderer.delta_ids(
        [{"role": "tool", "content": "42"}, {"role": "tool", "content": "37"}], stop_text="<|im_end|>"
    )
    tool2 = loop.renderer.delta_ids([{"role": "tool", "content": "37"}], stop_text="<|im_end|>")
    assert ids == gen[0] + tool1 + gen[1] + tool2 + gen[2]
    assert loss == [1] * len(gen[0]) + [0] * len(tool1) + [1] * len(gen[1]) + [0] * len(tool2) + [1] * len(gen[2])
    want_lp = [lp for g in gen for lp in [-0.25 - 0.01 * j for j in range(len(g))]]
    assert [lp for lp, m in zip(logprobs, loss) if m] == pytest.approx(want_lp) and all(
        lp == 0 for lp, m in zip(logprobs, loss) if not m
    )
    # token in, token out: each request's context was the previous one plus exactly the ids appended
    prompt = out["prompts_BP"][0][out["prompt_mask_BP"][0].bool()].tolist()
    assert model.contexts[0] == [prompt, prompt + gen[0] + tool1, prompt + gen[0] + tool1 + gen[1] + tool2]
    # an append-only template (this one) re-renders the whole conversation to the same ids (plus the final newline)
    convo = user + [
        {"role": "assistant", "content": turns[0]},
        {"role": "tool", "content": "42"},
        {"role": "tool", "content": "37"},
        {"role": "assistant", "content": turns[1]},
        {"role": "tool", "content": "37"},
        {"role": "assistant", "content": turns[2]},
    ]
    full = tok(tok.apply_chat_template(convo, tools=loop.tool_schemas, tokenize=False), add_special_tokens=False)[
        "input_ids"
    ]
    assert full == prompt + ids + tok("\n", add_special_tokens=False)["input_ids"]
    # the training layout and the per-sample counts
    assert torch.equal(out["input_ids_BL"][0], torch.cat([out["prompts_BP"][0], out["responses_BR"][0]]))
    assert out["agent_turns_B"].tolist() == [3.0] and out["agent_tool_calls_BK"].tolist() == [[3.0]]
    assert out["agent_stop"] == ["answer"] and out["agent_tool_errors_B"].tolist() == [0.0]


THINK_TEMPLATE = (  # ChatML that drops the reasoning of every assistant turn but the last (Qwen3 / R1 style)
    "{% for m in messages %}"
    "{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{% if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if tools %}{% for t in tools %}{{ t['function']['name'] }}{% endfor %}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_that_drops_earlier_reasoning_does_not_shift_generated_tokens(tiny_tools_model):
    tok = AutoTokenizer.from_pretrained(str(tiny_tools_model))
    tok.chat_template = THINK_TEMPLATE
    loop = agent(tok, tools=["calculator"])
    user = [{"role": "user", "content": "Calculate 40 + 2."}]
    turns = [
        "<think>I need the calculator</think>" + call("calculator", expression="40 + 2"),
        "<think>done</think>#### 42",
    ]
    model = ScriptedModel(tok, {0: turns})
    out = loop.run(model, prompts(tok, loop, [{"messages": user, "ground_truth": "42"}]), GREEDY, None, MetricBuffer())
    ids, loss, _ = response(out, 0)
    gen, delta = (
        model.generated[0],
        loop.renderer.delta_ids([{"role": "tool", "content": "42"}], stop_text="<|im_end|>"),
    )
    assert ids == gen[0] + delta + gen[1] and loss == [1] * len(gen[0]) + [0] * len(delta) + [1] * len(gen[1])
    assert "I need the calculator" in tok.decode(ids)  # the model's reasoning is still what it is trained on ...
    convo = user + [
        {"role": "assistant", "content": turns[0]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": turns[1]},
    ]
    rerendered = tok.apply_chat_template(convo, tools=loop.tool_schemas, tokenize=False)
    assert "I need the calculator" not in rerendered  # ... which re-rendering the history would have dropped


class Raises(Tool):
    name = "raises"
    schema = function_schema("raises", "Always fails.", {"x": {"type": "integer"}}, ["x"])

    def call(self, state, arguments):
        raise RuntimeError("boom")


class Hangs(Tool):
    name = "hangs"
    schema = function_schema("hangs", "Never returns in time.", {}, [])

    def call(self, state, arguments):
        time.sleep(30)
        return "late", 0.0, {}


class BadReward(Tool):
    name = "bad_reward"
    schema = function_schema("bad_reward", "Returns a NaN reward.", {}, [])

    def call(self, state, arguments):
        return "ok", float("nan"), {}


class Counter(Tool):
    """Counts its calls in the conversation's state; rewards 0.5 per call and reports a metric."""

    name = "counter"
    schema = function_schema("counter", "Counts.", {}, [])

    def create(self, sample):
        return {"calls": 0, "truth": sample.ground_truth, "kwargs": sample.create_kwargs}

    def call(self, state, arguments):
        state["calls"] += 1
        return f"call {state['calls']}", 0.5, {"counted": 1.0}

    def score(self, state):
        return float(state["calls"])


def test_malformed_calls_failing_and_hanging_tools_are_error_messages_not_exceptions(tok):
    specs = [f"test_agent_loop:{n}" for n in ("Raises", "Hangs", "BadReward", "Counter")]  # module:Class specs
    loop = agent(tok, max_response_length=2000, tools=specs, tool_timeout_s=0.5, max_turns=3)  # room for long errors
    turn1 = (
        "<tool_call>{not json</tool_call>"
        + call("nope")
        + call("raises", x="one")
        + call("raises", x=1)
        + call("counter")
        + call("bad_reward")
    )
    scripts = {0: [turn1, call("hangs") + call("counter"), "#### 1"], 1: [call("counter"), "#### 0"]}
    out = loop.run(
        ScriptedModel(tok, scripts),
        prompts(
            tok,
            loop,
            [
                {"messages": [{"role": "user", "content": "a"}], "ground_truth": "1"},
                {"messages": [{"role": "user", "content": "b"}], "ground_truth": "0"},
            ],
        ),
        GREEDY,
        None,
        MetricBuffer(),
    )
    text = tok.decode(response(out, 0)[0])
    for message in [
        "not valid JSON",
        "unknown tool 'nope'",
        "argument 'x' must be of type integer",
        "raises failed: RuntimeError: boom",
        "reward_delta nan is not finite",
        "call 1",
        "hangs timed out after 0.5 s",
        "not run (an earlier call of this turn timed out)",
    ]:
        assert message in text, message
    # errors: bad JSON, unknown tool, wrong type, raised, NaN reward, the call skipped after the timeout; 1 timeout
    assert out["agent_tool_errors_B"].tolist() == [6.0, 0.0] and out["agent_tool_timeouts_B"].tolist() == [1.0, 0.0]
    # dispatched calls by tool: raises (x=1 only), hangs, bad_reward, counter (the one after hangs never ran)
    assert out["agent_tool_calls_BK"].tolist() == [[1.0, 1.0, 1.0, 2.0], [0.0, 0.0, 0.0, 1.0]]
    # rewards: counter's 0.5 per call that ran, plus its final-state score (calls counted in its state)
    assert out["agent_rewards_B"].tolist() == [1.5, 1.5]
    assert out["agent_tool_metrics"] == [{"counted": 1.0}, {"counted": 1.0}]
    assert out["agent_stop"] == ["answer", "answer"] and out["agent_turns_B"].tolist() == [3.0, 2.0]


def test_max_turns_and_the_token_budget_end_conversations(tok):
    loop = agent(tok, max_response_length=120, tools=["calculator"], max_turns=2)
    scripts = {0: [call("calculator", expression="1 + 1")] * 3, 1: ["1 + 1 = 2 " * 20]}
    out = loop.run(
        ScriptedModel(tok, scripts),
        prompts(
            tok,
            loop,
            [
                {"messages": [{"role": "user", "content": "a"}], "ground_truth": "2"},
                {"messages": [{"role": "user", "content": "b"}], "ground_truth": "2"},
            ],
        ),
        GREEDY,
        None,
        MetricBuffer(),
    )
    assert out["agent_stop"] == ["max_turns", "length"]
    assert out["agent_turns_B"].tolist() == [2.0, 1.0] and int(out["response_mask_BR"][1].sum()) == 120
    assert out["response_mask_BR"].shape[1] <= 120


def test_interaction_replies_until_the_answer_is_right_and_its_reward_counts(tok):
    loop = agent(tok, tools=[], interaction="gsm8k", max_user_turns=2)
    rows = [
        {
            "messages": [{"role": "user", "content": "What is 6 * 7?"}],
            "ground_truth": "0",
            "extra_info": {"index": 0, "interaction_kwargs": {"name": "gsm8k", "ground_truth": "42"}},
        }
    ]
    model = ScriptedModel(tok, {0: ["#### 41", "#### 42"]})
    out = loop.run(model, prompts(tok, loop, rows), GREEDY, None, MetricBuffer())
    ids, loss, _ = response(out, 0)
    gen = model.generated[0]
    reply = loop.renderer.delta_ids(
        [{"role": "user", "content": "Your answer is wrong. Try again."}], stop_text="<|im_end|>"
    )
    assert ids == gen[0] + reply + gen[1] and loss == [1] * len(gen[0]) + [0] * len(reply) + [1] * len(gen[1])
    assert out["agent_rewards_B"].tolist() == [1.0] and out["agent_user_turns_B"].tolist() == [1.0]  # kwargs' truth


def test_verl_multiturn_parquet_rows_load_and_their_tool_kwargs_reach_the_tools(tok, tmp_path):
    """A file as verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py writes it, loaded unchanged."""
    import datasets

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [
                {"role": "system", "content": "You are a math expert. Use the `calc_gsm8k_reward` tool."},
                {
                    "role": "user",
                    "content": f"Question {i}? Let's think step by step and output the final answer after `####`.",
                },
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(10 + i)},
            "extra_info": {
                "split": "train",
                "index": i,
                "answer": f"... #### {10 + i}",
                "question": f"Question {i}?",
                "need_tools_kwargs": True,
                "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": str(10 + i)}}},
                "interaction_kwargs": {"query": f"Question {i}?", "ground_truth": str(10 + i)},
            },
        }
        for i in range(3)
    ]
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    loop = agent(tok, tools=["calc_gsm8k_reward"])
    ds = PromptDataset([str(path)], tok, prompt_key="prompt", max_prompt_length=256, tools=loop.tool_schemas)
    batch = ds.batch([0, 1, 2])
    assert "calc_gsm8k_reward(answer)" in batch["prompt_text"][0] and "You are a math expert" in batch["prompt_text"][0]
    scripts = {
        0: [call("calc_gsm8k_reward", answer="10"), "#### 10"],
        1: [call("calc_gsm8k_reward", answer="#### 5"), "#### 5"],
        2: ["#### 12"],
    }
    out = loop.run(ScriptedModel(tok, scripts), batch, GREEDY, None, MetricBuffer())
    # the tool's ground truth came from create_kwargs: right (1), wrong (-0.05 for a non-improving submission, 0), none
    assert out["agent_rewards_B"].tolist() == pytest.approx([1.0, -0.05, 0.0])
    assert "correct" in tok.decode(response(out, 0)[0]) and "incorrect" in tok.decode(response(out, 1)[0])


# -- request-level generation on the native engine -------------------------------------------------------------------


class TwoTurnSource:
    """Conversations of two turns whose second turn (context + answer + 5 'tool' ids) becomes ready only when a
    condition holds. ``after``: conversation -> the conversation whose second turn must have finished first."""

    def __init__(self, contexts, *, after: dict[int, int], new_tokens=(12, 9)):
        self.contexts, self.after, self.new = contexts, after, new_tokens
        self.ready = [Request(k, c, new_tokens[0], seed=100 + k) for k, c in enumerate(contexts)]
        self.waiting: dict[int, Request] = {}
        self.results: dict[int, tuple[list[int], list[float]]] = {}
        self.order: list[int] = []

    def _release(self):
        for k, r in list(self.waiting.items()):
            if self.after.get(k) is None or self.after[k] + 100 in self.results:
                self.ready.append(self.waiting.pop(k))

    def take(self, *, block):
        self._release()
        if block and not self.ready and self.waiting:
            raise AssertionError(
                "the engine went idle while a conversation waits for another's turn: lock-step, not continuous"
            )
        out, self.ready = self.ready, []
        return out

    def finish(self, key, tokens, logprobs):
        self.results[key] = (tokens, logprobs)
        self.order.append(key)
        if key < 100:
            ctx = self.contexts[key] + tokens + [5, 6, 7, 8, 9]
            self.waiting[key] = Request(key + 100, ctx, self.new[1], seed=100 + key, counter=len(tokens))


CONTEXTS = [[1] + list(range(10, 10 + n)) for n in (3, 7, 12, 5, 9, 4)]


def run_source(model, *, slots: int, params: SamplingParams, after=None):
    source = TwoTurnSource(CONTEXTS, after=after or {})
    decoder = SlotDecoder(model, slots=slots, max_len=64, device=torch.device("cpu"))
    stats = serve(decoder, source, params, slots=slots, eos_ids=[2])
    return source, stats


@pytest.fixture(scope="module")
def model(tiny_tools_model):
    return AutoModelForCausalLM.from_pretrained(str(tiny_tools_model)).eval()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_continuous_batching_gives_the_tokens_of_one_at_a_time_generation(model, temperature):
    params = SamplingParams(temperature=temperature)
    batched, stats = run_source(model, slots=4, params=params)
    alone, _ = run_source(model, slots=1, params=params)
    assert batched.results.keys() == alone.results.keys() and len(batched.results) == 12
    for k in batched.results:
        assert batched.results[k][0] == alone.results[k][0], k
        torch.testing.assert_close(
            torch.tensor(batched.results[k][1]), torch.tensor(alone.results[k][1]), atol=1e-4, rtol=0
        )
    assert stats["prefills"] < 12  # requests joined running batches
    if temperature == 0.0:  # and the first turns are what the single-turn eager decoder generates for each prompt
        for k, c in enumerate(CONTEXTS):
            toks, n, _ = generate_tokens(
                make_decoder(model),
                torch.tensor([c]),
                torch.ones(1, len(c), dtype=torch.long),
                SamplingParams(temperature=0.0, max_new_tokens=12),
                eos_ids=torch.tensor([2]),
                pad_id=0,
                generator=None,
            )
            assert toks[0, : int(n[0])].tolist() == batched.results[k][0]


def test_bfloat16_slot_decoder_reads_packed_weights_and_gives_the_static_decoders_logits(model):
    """In bfloat16 on CPU the slot decoder reads its weights as the static-batch decoder does (q/k/v and gate/up
    concatenated, packed where oneDNN computes bfloat16) and attends with SDPA over the filled slots: the same logits
    as ``LlamaFamilyDecoder`` for the same rows, to bfloat16's precision, and the same greedy tokens. (Not bitwise
    batch-invariant: SDPA's blocking follows the step's longest row, and in bfloat16 that can flip a near-tie; float32
    continuous batching gives one-at-a-time's tokens, tested above.)"""
    bf16 = AutoModelForCausalLM.from_pretrained(str(model.name_or_path), dtype=torch.bfloat16).eval()
    slot = SlotDecoder(bf16, slots=4, max_len=32, device=torch.device("cpu"))
    assert slot.sdpa_decode and slot.fused is not None
    assert all(f.packed == slot.head[2] for f in slot.fused)
    prompts = torch.tensor([c[:4] for c in CONTEXTS[:3]])
    static = make_decoder(bf16)
    with torch.inference_mode():
        want = [static.start(prompts, torch.ones_like(prompts), 5)]
        got = [slot.prefill([0, 1, 2], [Request(k, p.tolist(), 5, seed=0) for k, p in enumerate(prompts)])]
        for _ in range(4):
            tok = want[-1].argmax(-1)
            want.append(static.step(tok))
            got.append(slot.step(torch.tensor([0, 1, 2]), tok))
    want, got = torch.stack(want), torch.stack(got)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_conversation_waiting_does_not_hold_up_the_others(model):
    """Conversation 0's second turn waits until conversation 3's second turn is done: the engine keeps decoding the
    others (in lock-step turns it would sit idle, which the source refuses), and 0 joins the batch when ready."""
    source, _ = run_source(model, slots=3, params=SamplingParams(temperature=0.0), after={0: 3})
    assert source.order.index(103) < source.order.index(100) and len(source.results) == 12


def test_native_engine_serves_the_agent_loop(tiny_tools_model, tok, model):
    """The real engine end to end: conversations of a random model through the loop, greedy, with the slot count
    smaller than the number of conversations; each is what the model alone generates for its prompt."""
    loop = agent(tok, tools=["calculator"])
    rows = [
        {"messages": [{"role": "user", "content": f"Calculate {a} + {b}."}], "ground_truth": str(a + b)}
        for a, b in [(1, 2), (30, 4), (555, 66), (7, 8), (9, 99)]
    ]
    batch = prompts(tok, loop, rows)
    engine = NativeEngine(
        OwnWeights(model),
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        max_batch_size=2,
        device=torch.device("cpu"),
    )
    out = loop.run(engine, batch, SamplingParams(temperature=0.0, max_new_tokens=256), None, MetricBuffer())
    for i in range(len(rows)):
        ids, loss, _ = response(out, i)
        m = batch["prompt_mask_BP"][i].bool()
        alone, n, _ = generate_tokens(
            make_decoder(model),
            batch["prompts_BP"][i][m][None],
            torch.ones(1, int(m.sum()), dtype=torch.long),
            SamplingParams(temperature=0.0, max_new_tokens=len(ids)),
            eos_ids=torch.tensor([tok.eos_token_id]),
            pad_id=tok.pad_token_id,
            generator=None,
        )
        first = loss.index(0) if 0 in loss else len(loss)
        assert ids[:first] == alone[0, :first].tolist()


# -- multi-turn SFT demonstrations (the agent quickstart's warm start) -----------------------------------------------


def test_sft_conversations_are_tokenized_as_the_loop_builds_rollouts(tok, tmp_path):
    """A demonstration (user, assistant call, tool result, assistant answer) in an SFT parquet file gives the prompt,
    response ids and loss mask that the agent loop builds when the model generates the same two turns; a row that
    ends on a tool turn is refused naming the file and row."""
    import datasets

    from rlspmd.sft import SFTDataset

    loop = agent(tok, tools=["calculator"])
    user = {"role": "user", "content": "Calculate 4821 + 3907."}
    turns = [call("calculator", expression="4821 + 3907"), "#### 8728"]
    messages = [
        user,
        {"role": "assistant", "content": turns[0]},
        {"role": "tool", "content": "8728"},
        {"role": "assistant", "content": turns[1]},
    ]
    path = tmp_path / "sft.parquet"
    row = {
        "data_source": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": "8728"},
    }  # the SFT files' schema
    datasets.Dataset.from_list([{**row, "messages": messages}]).to_parquet(str(path))
    ds = SFTDataset(
        [str(path)],
        tok,
        prompt_key="prompt",
        response_key="response",
        max_length=512,
        messages_key="messages",
        tools=loop.tool_schemas,
    )

    batch = prompts(tok, loop, [{"messages": [user], "ground_truth": "8728"}])
    out = loop.run(ScriptedModel(tok, {0: turns}), batch, GREEDY, None, MetricBuffer())
    ids, loss, _ = response(out, 0)
    assert out["agent_tool_calls_BK"].sum() == 1 and "<tool_response>\n8728\n</tool_response>" in tok.decode(
        ids
    )  # the call ran
    prompt, resp, mask = ds.examples[0]
    assert prompt == batch["prompts_BP"][0][batch["prompt_mask_BP"][0].bool()].tolist()
    assert resp == ids and mask == loss and 0 < sum(mask) < len(mask)
    sft = ds.batch([0])
    assert sft["loss_mask_BR"][0].tolist() == loss and sft["response_mask_BR"][0].tolist() == [1] * len(ids)

    datasets.Dataset.from_list([{**row, "messages": messages[:3]}]).to_parquet(str(path))
    with pytest.raises(ValueError, match=r"sft.parquet row 0: a conversation must end with an assistant message"):
        SFTDataset(
            [str(path)],
            tok,
            prompt_key="prompt",
            response_key="response",
            max_length=512,
            messages_key="messages",
            tools=loop.tool_schemas,
        )
