"""`LLM.chat` as vLLM's: conversations rendered by the chat template exactly as Hugging Face
transformers renders them (a DeepSeek-V3 conversation: system prompt, several turns), then generated
as `generate` would; `tokenizer=` / `--tokenizer` loads the tokenizer and its template from another
folder; `--chat-template` gives the CLI a template; every problem is one line naming the fix."""

from __future__ import annotations

import json
import shutil

import pytest

from deepinfer.cli.main import main
from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import InvalidRequestError, SamplingParams
from deepinfer.model.embedded import BOS, EOS
from deepinfer.model.errors import LoadError

from cli_helpers import write_lines

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
]
# DeepSeek-V3's format, written out: BOS, the system text, <｜User｜> / <｜Assistant｜> turns, EOS after each answer.
RENDERED = f"{BOS}You are a helpful assistant.<｜User｜>What is 2 + 2?<｜Assistant｜>4.{EOS}<｜User｜>And 3 + 3?"
# Another folder's template: a plain "role: content" transcript.
OTHER_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


pytestmark = pytest.mark.usefixtures("model_cache")  # tests/engine/conftest.py


@pytest.fixture(scope="module")
def hf_tokenizer(api):
    """transformers' tokenizer over the same folder: an independent renderer of its chat template."""
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(api.model_path)


def tokenizer_folder(api, path, chat_template: str | None):
    """A folder with the model's tokenizer.json and a tokenizer_config.json of our own (`chat_template` None: none)."""
    path.mkdir()
    shutil.copyfile(f"{api.model_path}/tokenizer.json", path / "tokenizer.json")
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def other_folder(api, tmp_path_factory):
    return tokenizer_folder(api, tmp_path_factory.mktemp("other") / "tokenizer", OTHER_TEMPLATE)


@pytest.fixture(scope="module")
def api_other_tokenizer(cache, other_folder):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        return LLM(backend="reference", announce=False, num_kv_blocks=64, tokenizer=str(other_folder))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_renders_a_deepseek_v3_conversation_as_transformers_does(api, hf_tokenizer, add_generation_prompt):
    conversation = CONVERSATION if add_generation_prompt else [*CONVERSATION, {"role": "assistant", "content": "6."}]
    want = RENDERED + ("<｜Assistant｜>" if add_generation_prompt else f"<｜Assistant｜>6.{EOS}")
    (out,) = api.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=add_generation_prompt)
    assert out.prompt == want
    assert out.prompt == hf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    hf_ids = hf_tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert out.prompt_token_ids == hf_ids and out.prompt_token_ids.count(api.tokenizer.bos_token_id) == 1  # the template's BOS, not doubled


def test_continue_final_message_ends_inside_the_last_message(api, hf_tokenizer):
    conversation = [*CONVERSATION, {"role": "assistant", "content": "The answer is"}]
    (out,) = api.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt == f"{RENDERED}<｜Assistant｜>The answer is"  # no EOS: the model goes on with the answer
    assert out.prompt == hf_tokenizer.apply_chat_template(conversation, tokenize=False, continue_final_message=True)


def test_chat_generates_what_generate_does_for_the_rendered_prompts(api):
    conversations = [CONVERSATION, [{"role": "user", "content": "Hello"}], CONVERSATION[:2]]
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), SamplingParams(temperature=0.8, seed=3, max_tokens=3)]
    chats = api.chat(conversations, params, use_tqdm=False)
    prompts = [api.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
    plain = api.generate(prompts, params, use_tqdm=False)
    assert [c.prompt for c in chats] == prompts
    assert chats[1].prompt == f"{BOS}<｜User｜>Hello<｜Assistant｜>"
    assert [c.outputs[0].token_ids for c in chats] == [p.outputs[0].token_ids for p in plain]
    assert [len(c.outputs[0].token_ids) for c in chats] == [4, 2, 3]
    assert all(c.outputs[0].text == p.outputs[0].text for c, p in zip(chats, plain))
    # One conversation (a list of messages) and a list of one conversation are the same request.
    assert api.chat(CONVERSATION, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == chats[0].outputs[0].token_ids


def test_a_template_and_its_variables_given_for_the_call(api):
    template = "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}]{% endfor %}{{ suffix }}"
    (out,) = api.chat(CONVERSATION[:2], GREEDY, use_tqdm=False, chat_template=template, chat_template_kwargs={"suffix": "=>"})
    assert out.prompt == "[system|You are a helpful assistant.][user|What is 2 + 2?]=>"
    assert out.prompt_token_ids == api.tokenizer.encode(out.prompt)
    assert api.chat(CONVERSATION[:2], GREEDY, use_tqdm=False)[0].prompt.startswith(BOS)  # the checkpoint's template is untouched


@pytest.mark.parametrize(
    "messages, kwargs, needle",
    [
        ([], {}, "messages must be a non-empty list"),
        ("hello", {}, "messages must be a non-empty list"),
        ([{"role": "user"}], {}, "conversation 0, message 0: 'content' must be a string, got None"),
        ([[{"role": "user", "content": "ok"}], [{"role": 1, "content": "x"}]], {}, "conversation 1, message 0: 'role' must be a string"),
        ([{"role": "user", "content": "ok"}, "not a message"], {}, "conversation 0, message 1: a message is a {'role': str, 'content': str} dict"),
        ([[]], {}, "conversation 0 must be a non-empty list"),
        (CONVERSATION, {"continue_final_message": True}, "add_generation_prompt and continue_final_message exclude each other"),
        (CONVERSATION, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs may not set 'messages'"),
        (CONVERSATION, {"chat_template": "{{ raise_exception('system messages are not supported') }}"}, "system messages are not supported"),
        (CONVERSATION, {"chat_template": "{% for %}"}, "the chat template does not parse"),
        # An assistant message with only tool calls has content None; a template that cannot take it fails in one line.
        ([*CONVERSATION, {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
         {"add_generation_prompt": False}, "the chat template failed on this conversation (TypeError: "),
        (CONVERSATION, {"chat_template": ""}, "chat_template must be a non-empty Jinja template string"),
        (CONVERSATION, {"chat_template": "{{ messages[0]['content'] }}", "add_generation_prompt": False, "continue_final_message": True},
         "the last message's content does not appear in the rendered chat"),
    ],
)
def test_bad_chats_are_one_line(api, messages, kwargs, needle):
    with pytest.raises(InvalidRequestError) as info:
        api.chat(messages, GREEDY, use_tqdm=False, **kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert not api.engine.has_unfinished()  # nothing was queued


def test_a_tokenizer_without_a_chat_template_names_the_fix(api, monkeypatch):
    monkeypatch.setattr(api.tokenizer, "chat_template", None)
    with pytest.raises(InvalidRequestError, match=r"conversation 0: chat messages need a chat template.*pass chat_template=\.\.\."):
        api.chat(CONVERSATION, GREEDY, use_tqdm=False)
    (out,) = api.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template=OTHER_TEMPLATE)  # the fix works
    assert out.prompt.startswith("system: You are a helpful assistant.\nuser: What is 2 + 2?\n")


def test_the_tokenizer_comes_from_another_folder(api, api_other_tokenizer, other_folder):
    llm = api_other_tokenizer
    assert llm.tokenizer.chat_template == OTHER_TEMPLATE and api.tokenizer.chat_template != OTHER_TEMPLATE
    assert llm.model_path == api.model_path  # same model, weights from its own folder
    (out,) = llm.chat(CONVERSATION[:2], GREEDY, use_tqdm=False)
    assert out.prompt == "system: You are a helpful assistant.\nuser: What is 2 + 2?\nassistant:"
    # Its tokenizer_config says add_bos_token false; the model's own adds a BOS to plain prompts.
    assert llm.generate("hi", GREEDY, use_tqdm=False)[0].prompt_token_ids == api.tokenizer.encode("hi", add_bos=False)
    assert api.generate("hi", GREEDY, use_tqdm=False)[0].prompt_token_ids[0] == api.tokenizer.bos_token_id
    plain = api.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids  # the same model runs either way


def test_a_tokenizer_folder_without_a_tokenizer_is_one_line(api, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    cases = [
        (tmp_path / "empty", "has no tokenizer.json; pass a folder that holds the tokenizer"),
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "file", "is a file; pass the folder that holds tokenizer.json"),
    ]
    for path, needle in cases:
        with pytest.raises(LoadError) as info:
            LLM(backend="reference", announce=False, num_kv_blocks=64, tokenizer=str(path))
        assert "tokenizer" in str(info.value) and str(path) in str(info.value) and needle in str(info.value) and "\n" not in str(info.value)


def test_the_cli_chats_with_another_folders_tokenizer_and_template(tmp_path, capsys, api, other_folder):
    out = tmp_path / "out.jsonl"
    src = write_lines(tmp_path / "in.jsonl", [{"id": "m", "messages": CONVERSATION[:2], "max_tokens": 2}])
    assert main(["run", "--backend", "reference", "--no-progress", "--num-kv-blocks", "64", "-i", str(src), "-o", str(out),
                 "--tokenizer", str(other_folder)]) == 0  # fmt: skip
    (row,) = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert row["prompt"] == "system: You are a helpful assistant.\nuser: What is 2 + 2?\nassistant:"
    capsys.readouterr()


@pytest.mark.parametrize(
    "as_file, padding", [(True, ""), (False, ""), (False, "{# a comment longer than a file name may be #}" * 8)], ids=["file", "inline", "inline-long"]
)
def test_the_cli_chat_template_flag(tmp_path, capsys, as_file, padding):
    template = padding + "<<{% for m in messages %}{{ m['content'] }}{% endfor %}>>"
    if as_file:
        (tmp_path / "t.jinja").write_text(template, encoding="utf-8")
    out = tmp_path / "out.jsonl"
    value = str(tmp_path / "t.jinja") if as_file else template
    assert main(["run", "--backend", "reference", "--no-progress", "--num-kv-blocks", "64", "--chat", "--prompt", "Say hi",
                 "--max-tokens", "1", "-o", str(out), "--chat-template", value]) == 0  # fmt: skip
    assert json.loads(out.read_text(encoding="utf-8"))["prompt"] == "<<Say hi>>"
    capsys.readouterr()


def test_the_cli_names_its_own_fix_for_a_missing_template(tmp_path, capsys, api):
    bare = tokenizer_folder(api, tmp_path / "bare", None)
    out = tmp_path / "out.jsonl"
    src = write_lines(tmp_path / "in.jsonl", [{"id": "m", "messages": CONVERSATION[:2]}, {"id": "p", "prompt": "plain", "max_tokens": 1}])
    code = main(["run", "--backend", "reference", "--no-progress", "--num-kv-blocks", "64", "-i", str(src), "-o", str(out), "--tokenizer", str(bare)])
    assert code == 1  # the chat line failed alone
    rows = {row["id"]: row for row in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    assert "chat messages need a chat template" in rows["m"]["error"]["message"] and "--chat-template FILE" in rows["m"]["error"]["message"]
    assert rows["p"]["prompt"] == "plain" and "error" not in rows["p"]
    capsys.readouterr()
