"""DeepSeek-V4's chat format (deepinfer.engine.chat_dsv4): LLM.chat on a V4 model whose tokenizer has no
chat template (the embedded tiny-v4, as real V4 checkpoints) renders conversations in DeepSeek's V4
format; `deepinfer run` and `run-batch` render chat lines the same way; a template for the call, or
the tokenizer's own, still wins.

The expected texts are written by hand from the format as DeepSeek's reference encoder defines it
(`encode_messages` of encoding/encoding_dsv4.py, read at supermy/ds4rs commit 2ecc534c, and vLLM's copy
vllm/tokenizers/deepseek_v4_encoding.py at 591f7b5e): BOS; a system message's text; `<｜User｜>` and
a user message's text, then `<｜Assistant｜>` and `<think>` (thinking mode, the turn being answered)
or `</think>`; an assistant message's [reasoning `</think>`] text, then EOS.
"""

from __future__ import annotations

import json

import pytest

from deepinfer.cli.main import main
from deepinfer.engine.chat_dsv4 import MAX_EFFORT_PROMPT, encode_dsv4
from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import InvalidRequestError, SamplingParams
from deepinfer.model.embedded import BOS, EOS

from cli_helpers import write_lines

U, A, T, ET = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

CONVERSATION = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "2+2?"},
]
ANSWERED = [*CONVERSATION, {"role": "assistant", "content": "4", "reasoning_content": "Add."}]
HEAD = f"{BOS}You are brief.{U}Hi{A}"  # every mode starts so

pytestmark = pytest.mark.usefixtures("model_cache")  # tests/engine/conftest.py


def render(conversation, add_generation_prompt=True, continue_final_message=False, tools=None, **options) -> str:
    return encode_dsv4(conversation, "conversation 0", add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       options=options, tools=tools)  # fmt: skip


@pytest.mark.parametrize(
    "conversation, kwargs, want",
    [
        # Chat mode (the default): no reasoning anywhere, `</think>` opens every answer.
        (CONVERSATION, {}, f"{HEAD}{ET}Hello!{EOS}{U}2+2?{A}{ET}"),
        (CONVERSATION, {"thinking": False}, f"{HEAD}{ET}Hello!{EOS}{U}2+2?{A}{ET}"),
        # Thinking mode: the answer starts thinking; earlier turns' reasoning is dropped (drop_thinking).
        (CONVERSATION, {"thinking": True}, f"{HEAD}{ET}Hello!{EOS}{U}2+2?{A}{T}"),
        (CONVERSATION, {"enable_thinking": True}, f"{HEAD}{ET}Hello!{EOS}{U}2+2?{A}{T}"),
        # ... or kept: every turn thinks.
        (CONVERSATION, {"thinking": True, "drop_thinking": False}, f"{HEAD}{T}Greet back.{ET}Hello!{EOS}{U}2+2?{A}{T}"),
        # Effort "max" puts DeepSeek's prompt first; "high" adds nothing.
        (CONVERSATION, {"thinking": True, "reasoning_effort": "max"}, f"{BOS}{MAX_EFFORT_PROMPT}You are brief.{U}Hi{A}{ET}Hello!{EOS}{U}2+2?{A}{T}"),
        (CONVERSATION, {"thinking": True, "reasoning_effort": "high"}, f"{HEAD}{ET}Hello!{EOS}{U}2+2?{A}{T}"),
        # No generation prompt: the text ends with the user's message.
        (CONVERSATION, {"add_generation_prompt": False}, f"{HEAD}{ET}Hello!{EOS}{U}2+2?"),
        # A whole conversation: the last answer (after the last user turn) keeps its reasoning in thinking mode.
        (ANSWERED, {"add_generation_prompt": False, "thinking": True}, f"{HEAD}{ET}Hello!{EOS}{U}2+2?{A}{T}Add.{ET}4{EOS}"),
        (ANSWERED, {"add_generation_prompt": False}, f"{HEAD}{ET}Hello!{EOS}{U}2+2?{A}{ET}4{EOS}"),
        # continue_final_message: no EOS; with no content yet, inside the reasoning.
        (ANSWERED, {"add_generation_prompt": False, "continue_final_message": True, "thinking": True}, f"{HEAD}{ET}Hello!{EOS}{U}2+2?{A}{T}Add.{ET}4"),
        (ANSWERED, {"add_generation_prompt": False, "continue_final_message": True}, f"{HEAD}{ET}Hello!{EOS}{U}2+2?{A}{ET}4"),
        ([*CONVERSATION, {"role": "assistant", "content": "", "reasoning_content": "First, "}],
         {"add_generation_prompt": False, "continue_final_message": True, "thinking": True}, f"{HEAD}{ET}Hello!{EOS}{U}2+2?{A}{T}First, "),
        # vLLM's name for the reasoning works too.
        ([*CONVERSATION, {"role": "assistant", "content": "4", "reasoning": "Add."}], {"add_generation_prompt": False, "thinking": True},
         f"{HEAD}{ET}Hello!{EOS}{U}2+2?{A}{T}Add.{ET}4{EOS}"),
        # Consecutive user messages are one turn; a developer message is a user turn, dropped before the last user turn in thinking mode.
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], {}, f"{BOS}{U}a\n\nb{A}{ET}"),
        ([{"role": "developer", "content": "D"}, *CONVERSATION[1:]], {}, f"{BOS}{U}D{U}Hi{A}{ET}Hello!{EOS}{U}2+2?{A}{ET}"),
        ([{"role": "developer", "content": "D"}, *CONVERSATION[1:]], {"thinking": True}, f"{BOS}{U}Hi{A}{ET}Hello!{EOS}{U}2+2?{A}{T}"),
    ],
)  # fmt: skip
def test_conversations_render_in_deepseek_v4s_format(conversation, kwargs, want):
    assert render(conversation, **kwargs) == want


TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Ask the tools.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "forecast", "arguments": '{"city": "Paris", "days": 2}'}},
        {"id": "c2", "type": "function", "function": {"name": "clock", "arguments": {}}},
    ]},
    {"role": "tool", "tool_call_id": "c2", "content": "noon"},  # answered out of order: sorted back by the calls
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]  # fmt: skip
CALLS = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="forecast">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="clock">\n\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>"
)
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "Weather", "parameters": {"type": "object"}}}]


def test_tool_calls_and_results():
    results = f"{U}<tool_result>sunny</tool_result>\n\n<tool_result>noon</tool_result>"
    # The tool results are the last user turn: the call's reasoning is dropped, the answer thinks.
    assert render(TOOL_CONVERSATION, thinking=True) == f"{BOS}{U}Weather in Paris?{A}{ET}{CALLS}{EOS}{results}{A}{T}"
    # With tools defined, no reasoning is dropped; the tools prompt follows the system message.
    with_tools = render([{"role": "system", "content": "Be exact."}, *TOOL_CONVERSATION], tools=TOOLS, thinking=True)
    system, rest = with_tools.split(U, 1)
    assert system.startswith(f"{BOS}Be exact.\n\n## Tools\n\nYou have access to a set of tools")
    assert system.endswith('### Available Tool Schemas\n\n{"name": "forecast", "description": "Weather", "parameters": {"type": "object"}}\n\n'
                           "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n")  # fmt: skip
    assert U + rest == f"{U}Weather in Paris?{A}{T}Ask the tools.{ET}{CALLS}{EOS}{results}{A}{T}"
    # Without a system message the tools prompt is one of its own.
    assert render(TOOL_CONVERSATION[:1], tools=TOOLS).startswith(f"{BOS}\n\n## Tools\n\n")


@pytest.mark.parametrize(
    "conversation, kwargs, needle",
    [
        (ANSWERED, {}, "the last message's role is 'assistant', and DeepSeek-V4's format opens the assistant's turn only after a user message"),
        ([{"role": "critic", "content": "x"}], {}, "message 0: role 'critic' is not in DeepSeek-V4's chat format"),
        ([{"role": "user", "content": "x", "name": "bob"}], {}, "message 0: DeepSeek-V4's chat format has no place for 'name'"),
        ([{"role": "user", "content": "x", "tool_call_id": "1"}], {}, "'tool_call_id' belongs to tool messages, not to user messages"),
        ([{"role": "developer", "content": ""}], {}, "a developer message needs content"),
        (CONVERSATION, {"chat_template_kwargs": {"thinkng": True}}, "chat_template_kwargs 'thinkng' is not an option of DeepSeek-V4's chat format"),
        (CONVERSATION, {"chat_template_kwargs": {"thinking": "yes"}}, "'thinking' must be true or false"),
        (CONVERSATION, {"chat_template_kwargs": {"thinking": True, "enable_thinking": False}}, "'thinking' and 'enable_thinking' disagree"),
        (CONVERSATION, {"chat_template_kwargs": {"reasoning_effort": "max"}}, "'reasoning_effort' applies in thinking mode"),
        (CONVERSATION, {"chat_template_kwargs": {"thinking": True, "reasoning_effort": "low"}}, "'reasoning_effort' must be 'high' or 'max'"),
        ([*TOOL_CONVERSATION[:1], {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
         {"add_generation_prompt": False}, "message 1, tool call 0: the arguments of 'f' are not JSON text"),
        # deeper than Python's JSON parser goes: a RecursionError traceback aborted the whole run
        ([*TOOL_CONVERSATION[:1], {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[" * 50_000}}]}],
         {"add_generation_prompt": False}, "message 1, tool call 0: the arguments of 'f' are nested too deeply to read"),
        (CONVERSATION, {"tools": [{"name": "f"}]}, "tools must be a list of"),
        (TOOL_CONVERSATION[:2], {"add_generation_prompt": False, "continue_final_message": True}, "it has none (only tool calls)"),
    ],
)  # fmt: skip
def test_what_the_format_has_no_place_for_is_one_line(v4, conversation, kwargs, needle):
    with pytest.raises(InvalidRequestError) as info:
        v4.chat(conversation, GREEDY, use_tqdm=False, **kwargs)
    assert str(info.value).startswith("conversation 0") and needle in str(info.value) and "\n" not in str(info.value)


# ---- end to end on the embedded tiny-v4 ------------------------------------------------------------


@pytest.fixture(scope="module")
def v4(cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        return LLM(model="tiny-v4", backend="reference", dtype="float32", announce=False, num_kv_blocks=64)


def test_llm_chat_on_a_v4_model_uses_the_v4_format(v4):
    assert not v4.tokenizer.has_chat_template  # as DeepSeek-V4 checkpoints
    want = f"{HEAD}{ET}Hello!{EOS}{U}2+2?{A}{T}"
    (out,) = v4.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template_kwargs={"thinking": True})
    assert out.prompt == want
    ids = out.prompt_token_ids
    assert ids == v4.tokenizer.encode(want) and ids.count(v4.tokenizer.bos_token_id) == 1  # the format's BOS, not doubled
    for token in (U, A, T, ET, EOS):  # the format's markers are single special tokens
        assert ids.count(v4.tokenizer.token_to_id(token)) == want.count(token), token
    plain = v4.generate(want, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids and len(out.outputs[0].token_ids) == 3


def test_a_template_still_wins_over_the_v4_format(v4, monkeypatch):
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert v4.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template=template)[0].prompt == "[You are brief.][Hi][Hello!][2+2?]"
    monkeypatch.setattr(v4.tokenizer, "chat_template", template)  # a tokenizer folder with a template of its own
    assert v4.chat(CONVERSATION, GREEDY, use_tqdm=False)[0].prompt == "[You are brief.][Hi][Hello!][2+2?]"


def test_run_and_run_batch_render_chat_lines_in_the_v4_format(v4, tmp_path, capsys):
    """The CLI's chat lines go through the same rendering: `run` writes the prompt, `run-batch` the
    same tokens and answer as LLM.chat."""
    options = {"chat_template_kwargs": {"thinking": True, "reasoning_effort": "max"}}
    want = f"{BOS}{MAX_EFFORT_PROMPT}You are brief.{U}Hi{A}{ET}Hello!{EOS}{U}2+2?{A}{T}"
    (chat,) = v4.chat(CONVERSATION, GREEDY, use_tqdm=False, **options)
    assert chat.prompt == want
    flags = ["--model", "tiny-v4", "--backend", "reference", "--dtype", "float32", "--no-progress", "--num-kv-blocks", "64"]
    src = write_lines(tmp_path / "run.jsonl", [{"id": "m", "messages": CONVERSATION, "temperature": 0, "max_tokens": 3, "ignore_eos": True, **options}])
    assert main(["run", *flags, "-i", str(src), "-o", str(tmp_path / "run_out.jsonl")]) == 0
    (row,) = map(json.loads, (tmp_path / "run_out.jsonl").read_text(encoding="utf-8").splitlines())
    assert row["prompt"] == want and row["token_ids"] == chat.outputs[0].token_ids
    body = {"messages": CONVERSATION, "temperature": 0, "max_tokens": 3, "ignore_eos": True, **options}
    src = write_lines(tmp_path / "batch.jsonl", [{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}])
    assert main(["run-batch", *flags, "-i", str(src), "-o", str(tmp_path / "batch_out.jsonl")]) == 0
    (row,) = map(json.loads, (tmp_path / "batch_out.jsonl").read_text(encoding="utf-8").splitlines())
    answer = row["response"]["body"]
    assert answer["usage"]["prompt_tokens"] == len(chat.prompt_token_ids)
    assert answer["choices"][0]["message"]["content"] == chat.outputs[0].text
    capsys.readouterr()


def test_a_v41_model_renders_conversations_in_the_v4_format(cache, monkeypatch):
    """DeepSeek-V4.1 (the embedded tiny-v41: DeepSeek's tokenizer, no chat template) takes V4's encoder,
    thinking mode and tool results included: the same prompt text and token ids as tiny-v4's."""
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    v41 = LLM(model="tiny-v41", backend="reference", dtype="float32", announce=False)
    assert not v41.tokenizer.has_chat_template
    want = f"{HEAD}{ET}Hello!{EOS}{U}2+2?{A}{T}"
    (out,) = v41.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template_kwargs={"thinking": True})
    assert out.prompt == want and out.prompt_token_ids == v41.tokenizer.encode(want)
    for token in (U, A, T, ET, EOS):
        assert out.prompt_token_ids.count(v41.tokenizer.token_to_id(token)) == want.count(token), token
