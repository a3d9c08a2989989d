"""Chat conversations as prompt text: what `LLM.chat` and `deepinfer run` (its "messages" lines and
--chat) share.

A conversation is a list of messages {"role": str, "content": str} (an assistant message with
"tool_calls" may have content None; other keys, such as "name", reach the template as they are).
The chat template renders it: the one given for the call, else the tokenizer's
(deepinfer.model.tokenizer: tokenizer_config.json or chat_template.jinja), else the model's own
format where its checkpoint ships it as a program instead of a template (`built_in_format`:
DeepSeek-V4, deepinfer.engine.chat_dsv4). Every problem is an InvalidRequestError of one line naming
the conversation and the fix, in the words of the caller's interface (`FixNames`: the Python API's
arguments or the CLI's flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from deepinfer.engine.sampling_params import InvalidRequestError

# Variables the renderer sets itself: chat_template_kwargs may not set them.
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools")


@dataclass(frozen=True)
class FixNames:
    """How the caller's interface spells the two fixes a chat may need."""

    chat_template: str  # give a template for the call
    tokenizer: str  # load the tokenizer from another folder


PYTHON_API = FixNames(chat_template="pass chat_template=... (a Jinja chat template)", tokenizer="pass tokenizer=FOLDER (a folder that holds one)")


def conversations(messages) -> list[list[Mapping[str, Any]]]:
    """`messages` as a list of conversations: it is one conversation (a list of message dicts) or a
    list of them, as vLLM's LLM.chat takes."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError(f"messages must be a non-empty list of messages or of conversations, got {kind(messages)}")
    if all(isinstance(item, (list, tuple)) for item in messages):
        return [list(conversation) for conversation in messages]
    return [list(messages)]


def check_conversation(conversation, what: str) -> None:
    """A non-empty list of {"role": str, "content": str} messages; InvalidRequestError naming the first that is not."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise InvalidRequestError(f"{what} must be a non-empty list of {{'role': str, 'content': str}} messages, got {kind(conversation)}")
    for i, message in enumerate(conversation):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"{what}, message {i}: a message is a {{'role': str, 'content': str}} dict, got {kind(message)}")
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"{what}, message {i}: 'role' must be a string, got {kind(message.get('role'))}")
        calls_only = message.get("content") is None and message["role"] == "assistant" and message.get("tool_calls")
        if not isinstance(message.get("content"), str) and not calls_only:
            raise InvalidRequestError(f"{what}, message {i}: 'content' must be a string, got {kind(message.get('content'))}")


def render_chat(
    tokenizer,
    conversation,
    what: str,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: list | None = None,
    model_type: str | None = None,
    fixes: FixNames = PYTHON_API,
) -> str:
    """The prompt text of one conversation. add_generation_prompt: end with the header of the
    assistant's turn (the model answers); continue_final_message: end inside the last message (the
    model continues it; the two exclude each other, as in vLLM). chat_template: Jinja source used
    instead of the tokenizer's; chat_template_kwargs: more template variables (e.g. "thinking");
    tools: OpenAI's tool definitions (the template's `tools`). model_type: the model's, for its
    built-in format when neither a template for the call nor the tokenizer's is there."""
    from deepinfer.model.errors import LoadError

    check_conversation(conversation, what)
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError(
            f"{what}: add_generation_prompt and continue_final_message exclude each other (a new assistant turn, or the last message "
            "continued); set add_generation_prompt=False to continue the last message"
        )
    if continue_final_message and conversation[-1]["content"] is None:
        raise InvalidRequestError(f"{what}: continue_final_message continues the last message's content, and it has none (only tool calls)")
    kwargs = dict(chat_template_kwargs or {})
    reserved = [name for name in RESERVED_TEMPLATE_VARIABLES if name in kwargs]
    if reserved:
        raise InvalidRequestError(f"{what}: chat_template_kwargs may not set {reserved[0]!r}; it is an argument of its own")
    if tokenizer is None:
        raise InvalidRequestError(f"{what}: chat messages need a tokenizer, and this checkpoint has no tokenizer.json; {fixes.tokenizer}")
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
        raise InvalidRequestError(f"{what}: chat_template must be a non-empty Jinja template string, got {kind(chat_template)}")
    if chat_template is None and not tokenizer.has_chat_template:
        encode = built_in_format(model_type)
        if encode is None:
            raise InvalidRequestError(f"{what}: chat messages need a chat template, and this model's tokenizer has none; {fixes.chat_template}")
        return encode(conversation, what, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                      options=kwargs, tools=tools)  # fmt: skip
    try:
        return tokenizer.apply_chat_template(
            list(conversation), add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            continue_final_message=continue_final_message, tools=tools, **kwargs,
        )  # fmt: skip
    except LoadError as exc:  # the template failed (its raise_exception, a syntax error) or dropped the last message
        raise InvalidRequestError(f"{what}: {exc}") from None


def built_in_format(model_type: str | None):
    """The encoder of a model whose checkpoint ships its conversation format as a program, not as a
    chat template (DeepSeek-V4's encoding_dsv4.py, which deepinfer never runs: its own encoder);
    None for any other model. DeepSeek-V4.1 shares V4's tokenizer and special tokens, and no public
    source (NeMo Automodel's or ATOM's V4.1 code) shows a format of its own: it takes V4's
    (docs/models/deepseek_v41.md)."""
    if model_type in ("deepseek_v4", "deepseek_v41"):
        from deepinfer.engine.chat_dsv4 import encode_dsv4

        return encode_dsv4
    return None


def kind(value) -> str:
    """What a value is, for an error message: its type, and a short repr of a scalar."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"a {type(value).__name__}"
