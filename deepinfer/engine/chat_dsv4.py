"""DeepSeek-V4's conversation format, written by deepinfer's own encoder.

DeepSeek-V4 checkpoints ship no Jinja chat template: their tokenizer's format is a Python program,
`encoding/encoding_dsv4.py` (`encode_messages`), which deepinfer never runs (code from a model
folder). This module writes the same text from the format, read in DeepSeek's encoder as
supermy/ds4rs carries it (encoding/encoding_dsv4.py at commit 2ecc534c) and in vLLM's copy
(vllm/tokenizers/deepseek_v4_encoding.py at 591f7b5e). `render_chat` uses it for a deepseek_v4 model
whose tokenizer has no chat template.

The text, message by message after a BOS:
- system: its content; developer: `<｜User｜>` and its content (a user-side message);
- user: `<｜User｜>` and its content. Consecutive user and tool messages make one user turn: their
  parts joined by a blank line, a tool message as `<tool_result>content</tool_result>`, the tool
  results in the order of the calls of the assistant message before them (by tool_call_id);
- assistant: [its reasoning and `</think>`] its content [its tool calls, in DeepSeek's DSML block]
  and EOS;
- a user turn followed by an assistant message, or last with add_generation_prompt, is followed by
  `<｜Assistant｜>` and `<think>` where the assistant's reasoning follows, else `</think>`.

Modes (chat_template_kwargs, the keys vLLM passes): "thinking" (or "enable_thinking") true is
thinking mode, where the answer starts with `<think>` and assistant messages carry their
reasoning_content; default false, chat mode, where no reasoning is written (`</think>` opens every
answer). In thinking mode, "drop_thinking" (default true) leaves out the reasoning of the turns
before the last user turn (and the developer messages there), as DeepSeek's models were trained;
with tools it is off. "reasoning_effort": "high" (adds nothing) or "max" (DeepSeek's effort prompt
at the start), in thinking mode only. `tools` (OpenAI's [{"type": "function", "function": {...}}])
become DeepSeek's tools prompt, after the leading system (or developer) message's content, or as a
system message of their own.

deepinfer's choices where the encoder has no argument: add_generation_prompt=False leaves out the
final `<｜Assistant｜>` header, and True needs the conversation to end with a user turn (one line
otherwise: the format opens the assistant's turn only after a user turn). continue_final_message
ends the text inside the last message: an assistant message without its EOS (DeepSeek's `wo_eos`),
or, in thinking mode, inside its reasoning when it has no content yet. Anything else the format has
no place for (another role, an unknown message key or option) is a one-line InvalidRequestError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from deepinfer.engine.sampling_params import InvalidRequestError

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"

OPTIONS = ("thinking", "enable_thinking", "drop_thinking", "reasoning_effort")
EFFORTS = ("high", "max")
ROLES = ("system", "developer", "user", "assistant", "tool")
USER_ROLES = ("user", "developer")  # turns the assistant answers
MESSAGE_KEYS = {"role": None, "content": None, "reasoning_content": "assistant", "reasoning": "assistant", "tool_calls": "assistant", "tool_call_id": "tool"}

MAX_EFFORT_PROMPT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously "
    "stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and "
    "rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

TOOLS_PROMPT_HEAD = "\n".join([
    "## Tools",
    "",
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f'"<{DSML}tool_calls>" block like the following:',
    "",
    f"<{DSML}tool_calls>",
    f'<{DSML}invoke name="$TOOL_NAME">',
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>',
    "...",
    f"</{DSML}invoke>",
    f'<{DSML}invoke name="$TOOL_NAME2">',
    "...",
    f"</{DSML}invoke>",
    f"</{DSML}tool_calls>",
    "",
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), '
    'pass the value in JSON format and set `string="false"`.',
    "",
    f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside {THINK}...{END_THINK} "
    "BEFORE any tool calls or final response.",
    "",
    f"Otherwise, output directly after {END_THINK} with tool calls or final response.",
    "",
    "### Available Tool Schemas",
    "",
    "",
])  # fmt: skip
TOOLS_PROMPT_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


@dataclass(frozen=True)
class Mode:
    thinking: bool
    effort: str | None
    drop_thinking: bool  # thinking mode: leave out the reasoning before the last user turn


@dataclass
class Turn:
    """One message as the format writes it (consecutive user and tool messages merged)."""

    role: str
    content: str = ""
    reasoning: str = ""
    calls: str = ""  # an assistant's tool calls, as DSML
    parts: list = field(default_factory=list)  # a user turn's (text, tool-call position or None)


def encode_dsv4(
    conversation, what: str, *, add_generation_prompt: bool, continue_final_message: bool, options: Mapping[str, Any], tools=None,
) -> str:  # fmt: skip
    """The prompt text of one conversation (already checked by chat.check_conversation) in
    DeepSeek-V4's format; `options`: chat_template_kwargs."""
    if tools is not None:
        _check_tools(tools, what)
    mode = _mode(options, what, bool(tools))
    turns = _turns(conversation, what)
    if tools:
        schemas = "\n".join(_json(tool["function"]) for tool in tools)
        if turns[0].role not in ("system", "developer"):
            turns.insert(0, Turn("system"))
        turns[0].content += "\n\n" + TOOLS_PROMPT_HEAD + schemas + TOOLS_PROMPT_TAIL
    if mode.thinking and mode.drop_thinking:  # developer messages before the last user turn go with the old reasoning
        last = _last_user(turns)
        turns = [turn for i, turn in enumerate(turns) if turn.role != "developer" or i >= last]
    if add_generation_prompt and turns[-1].role not in USER_ROLES:
        raise InvalidRequestError(
            f"{what}: the last message's role is {turns[-1].role!r}, and DeepSeek-V4's format opens the assistant's turn only "
            "after a user message; set add_generation_prompt=False (and continue_final_message=True to continue an assistant message)"
        )
    return _render(turns, mode, add_generation_prompt, continue_final_message)


def _render(turns: list[Turn], mode: Mode, add_generation_prompt: bool, continue_final_message: bool) -> str:
    last_user = _last_user(turns)
    text = [BOS, MAX_EFFORT_PROMPT if mode.thinking and mode.effort == "max" else ""]
    for i, turn in enumerate(turns):
        final = i == len(turns) - 1
        if turn.role == "assistant":
            shows_reasoning = mode.thinking and (not mode.drop_thinking or i > last_user)
            text.append(_assistant(turn, shows_reasoning, continued=final and continue_final_message))
        elif turn.role == "user":
            text.append(USER + "\n\n".join(part for part, _ in _ordered(turn.parts)))
        elif turn.role == "developer":
            text.append(USER + turn.content)
        else:
            text.append(turn.content)
        answered = turns[i + 1].role == "assistant" if not final else add_generation_prompt
        if turn.role in USER_ROLES and answered:
            thinks = mode.thinking and (not mode.drop_thinking or i >= last_user)
            text.append(ASSISTANT + (THINK if thinks else END_THINK))
    return "".join(text)


def _assistant(turn: Turn, shows_reasoning: bool, continued: bool) -> str:
    """An assistant message; `continued`: without its EOS, and ending inside its reasoning when it
    has nothing after it yet (the model goes on thinking)."""
    if continued and shows_reasoning and not turn.content and not turn.calls:
        return turn.reasoning
    reasoning = turn.reasoning + END_THINK if shows_reasoning else ""
    return reasoning + turn.content + turn.calls + ("" if continued else EOS)


def _ordered(parts: list) -> list:
    """A user turn's parts with its tool results in the order of their calls (a result whose id
    names no call counts as the first call); the text parts keep their places."""
    results = iter(sorted((p for p in parts if p[1] is not None), key=lambda p: p[1]))
    return [next(results) if p[1] is not None else p for p in parts]


def _last_user(turns: list[Turn]) -> int:
    return max((i for i, turn in enumerate(turns) if turn.role in USER_ROLES), default=-1)


def _turns(conversation, what: str) -> list[Turn]:
    """The conversation's turns: each message checked, consecutive user and tool messages merged."""
    turns: list[Turn] = []
    call_order: dict[str, int] = {}  # the last assistant message's tool calls: id -> position
    for i, message in enumerate(conversation):
        where = f"{what}, message {i}"
        role = _check_message(message, where)
        content = message.get("content") or ""
        if role in ("user", "tool"):
            part = (content, None) if role == "user" else (f"<tool_result>{content}</tool_result>", call_order.get(message.get("tool_call_id"), 0))
            if turns and turns[-1].role == "user":
                turns[-1].parts.append(part)
            else:
                turns.append(Turn("user", parts=[part]))
        elif role == "assistant":
            reasoning = message.get("reasoning_content", message.get("reasoning")) or ""
            calls = message.get("tool_calls") or []
            if calls:
                call_order = {call["id"]: k for k, call in enumerate(calls) if isinstance(call, Mapping) and isinstance(call.get("id"), str) and call["id"]}
            turns.append(Turn("assistant", content, reasoning, _tool_calls(calls, where)))
        else:
            if role == "developer" and not content:
                raise InvalidRequestError(f"{where}: a developer message needs content")
            turns.append(Turn(role, content))
    return turns


def _check_message(message: Mapping, where: str) -> str:
    """The message's role, after checking that the format has a place for each of its keys."""
    role = message["role"]
    if role not in ROLES:
        raise InvalidRequestError(f"{where}: role {role!r} is not in DeepSeek-V4's chat format (it has {', '.join(ROLES)})")
    for key, value in message.items():
        if key not in MESSAGE_KEYS:
            raise InvalidRequestError(f"{where}: DeepSeek-V4's chat format has no place for {key!r} (a message holds {', '.join(MESSAGE_KEYS)})")
        owner = MESSAGE_KEYS[key]
        if owner is not None and owner != role:
            raise InvalidRequestError(f"{where}: {key!r} belongs to {owner} messages, not to {role} messages")
    for key in ("reasoning_content", "reasoning", "tool_call_id"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise InvalidRequestError(f"{where}: {key!r} must be a string, got {type(message[key]).__name__}")
    if message.get("tool_calls") is not None and not isinstance(message["tool_calls"], list):
        raise InvalidRequestError(f"{where}: 'tool_calls' must be a list of tool calls, got {type(message['tool_calls']).__name__}")
    return role


def _tool_calls(calls: list, where: str) -> str:
    """An assistant's tool calls as DeepSeek's DSML block (empty for none): per call an invoke with
    a parameter per argument, a string as it is, any other value as JSON."""
    if not calls:
        return ""
    invokes = []
    for k, call in enumerate(calls):
        name, arguments = _call(call, f"{where}, tool call {k}")
        params = "\n".join(
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else _json(value)}</{DSML}parameter>"
            for key, value in arguments.items()
        )
        invokes.append(f'<{DSML}invoke name="{name}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _call(call, where: str) -> tuple[str, Mapping]:
    """An OpenAI tool call's function name and arguments (a JSON object, or its JSON text)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or "arguments" not in function:
        raise InvalidRequestError(f"{where}: a tool call is {{'id': str, 'type': 'function', 'function': {{'name': str, 'arguments': str}}}}")
    arguments = function["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise InvalidRequestError(f"{where}: the arguments of {function['name']!r} are not JSON text") from None
        except RecursionError:  # deeper than Python's parser goes (thousands of "[")
            raise InvalidRequestError(f"{where}: the arguments of {function['name']!r} are nested too deeply to read") from None
    if not isinstance(arguments, Mapping):
        raise InvalidRequestError(f"{where}: the arguments of {function['name']!r} must be a JSON object, got {type(arguments).__name__}")
    return function["name"], arguments


def _check_tools(tools, what: str) -> None:
    if not isinstance(tools, (list, tuple)) or not all(
        isinstance(t, Mapping) and isinstance(t.get("function"), Mapping) and isinstance(t["function"].get("name"), str) for t in tools
    ):
        raise InvalidRequestError(f"{what}: tools must be a list of {{'type': 'function', 'function': {{'name': str, ...}}}} dicts (OpenAI's)")


def _mode(options: Mapping[str, Any], what: str, has_tools: bool) -> Mode:
    """The mode chat_template_kwargs ask for (null values count as not given)."""
    options = {key: value for key, value in options.items() if value is not None}
    unknown = next((key for key in options if key not in OPTIONS), None)
    if unknown is not None:
        raise InvalidRequestError(f"{what}: chat_template_kwargs {unknown!r} is not an option of DeepSeek-V4's chat format (it takes {', '.join(OPTIONS)})")
    for key in ("thinking", "enable_thinking", "drop_thinking"):
        if key in options and not isinstance(options[key], bool):
            raise InvalidRequestError(f"{what}: chat_template_kwargs {key!r} must be true or false, got {options[key]!r}")
    given = [options[key] for key in ("thinking", "enable_thinking") if key in options]
    if len(set(given)) > 1:
        raise InvalidRequestError(f"{what}: chat_template_kwargs 'thinking' and 'enable_thinking' disagree; give one")
    thinking = given[0] if given else False
    effort = options.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequestError(f"{what}: chat_template_kwargs 'reasoning_effort' must be {' or '.join(map(repr, EFFORTS))}, got {effort!r}")
    if effort is not None and not thinking:
        raise InvalidRequestError(f"{what}: chat_template_kwargs 'reasoning_effort' applies in thinking mode; add 'thinking': True")
    return Mode(thinking, effort, options.get("drop_thinking", True) and not has_tools)


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)
