"""The checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` library, the chat template
(jinja2) from `tokenizer_config.json` (or `chat_template.jinja`), BOS/EOS from the tokenizer and model configs.
"""

from __future__ import annotations

import functools
import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping

from deepinfer.model.errors import CheckpointError, LoadError
from deepinfer.model.folder import folder_file, read_json_object, read_text
from deepinfer.model.schema import BOOLEAN, STRING, Field, Kind, any_of, check_fields

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
LONG_TEXT_CHARS = 1 << 16  # texts at least this long are tokenized without holding the GIL


def _token_text(value: Any) -> str | None:
    """tokenizer_config writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(
        self,
        backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
    ):
        self._tk = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        eos_ids = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos_ids, *extra_eos_ids]))
        if self.eos_token_id is None and self.eos_token_ids:
            self.eos_token_id = self.eos_token_ids[0]
        self.add_bos = add_bos and self.bos_token_id is not None
        self.chat_template = chat_template

    @classmethod
    def from_folder(cls, folder: str | Path, bos_token_id: int | None = None, eos_token_ids: Iterable[int] = ()) -> "Tokenizer | None":
        """The tokenizer of a checkpoint folder, or None when it has no tokenizer.json.

        bos_token_id / eos_token_ids come from config.json and fill in what tokenizer_config lacks.
        Files are read only if they are regular files inside the folder (see folder.py).
        """
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(folder)
        path = folder_file(folder, TOKENIZER_FILE)
        if path is None:
            log.warning("%s has no %s: prompts must be given as token ids", folder, TOKENIZER_FILE)
            return None
        text = read_text(path)
        try:
            backend = HFTokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise CheckpointError(f"{path}: cannot load the tokenizer ({_first_line(exc)})", "re-download it") from None
        config_path = folder_file(folder, TOKENIZER_CONFIG)
        config = {} if config_path is None else read_json_object(config_path)
        config = check_fields(config, TOKENIZER_CONFIG_FIELDS, str(folder / TOKENIZER_CONFIG))
        bos = _token_text(config["bos_token"])
        eos = _token_text(config["eos_token"])
        if bos is None and bos_token_id is not None:
            bos = backend.id_to_token(bos_token_id)
        eos_ids = list(eos_token_ids)
        if eos is None and eos_ids:
            eos = backend.id_to_token(eos_ids[0])
        if config["add_bos_token"] is not None:
            add_bos = config["add_bos_token"]
        else:  # no explicit flag: follow what the tokenizer's own post-processor does
            bos_id = backend.token_to_id(bos) if bos else None
            first = backend.encode("a", add_special_tokens=True).ids[:1]
            add_bos = bos_id is not None and first == [bos_id]
        return cls(backend, bos_token=bos, eos_token=eos, add_bos=add_bos, chat_template=_chat_template(folder, config), extra_eos_ids=eos_ids)

    @classmethod
    def from_other_folder(cls, path: str | Path, bos_token_id: int | None = None, eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        """The tokenizer of a folder other than the checkpoint's (vLLM's tokenizer=): it must hold a
        tokenizer.json (a LoadError naming the folder otherwise; check_tokenizer_folder says so
        before the weights load). bos_token_id / eos_token_ids: the model's, as in from_folder."""
        folder = check_tokenizer_folder(path)
        try:
            tokenizer = cls.from_folder(folder, bos_token_id, eos_token_ids)
        except CheckpointError as exc:  # a broken file of that folder, not of the checkpoint (the loader's fix for those does not apply)
            raise LoadError(exc.problem, exc.fix) from None
        assert tokenizer is not None  # check_tokenizer_folder found its tokenizer.json
        return tokenizer

    # ---- text <-> ids --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer serialized as tokenizer.json (what llguidance builds its own from)."""
        return self._tk.to_str()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised.

        add_bos=None follows tokenizer_config's add_bos_token. A BOS is never doubled: text that
        already starts with the BOS token (a rendered chat template) gets none added.
        """
        if len(text) < LONG_TEXT_CHARS:
            ids = self._tk.encode(text, add_special_tokens=False).ids
        else:  # the same tokens; encode_batch lets go of the GIL meanwhile, so a server's other threads keep running
            ids = self._tk.encode_batch([text], add_special_tokens=False)[0].ids
        add = self.add_bos if add_bos is None else add_bos
        if add and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token of the vocabulary spells (its longest piece, special tokens
        included): a text of C characters is at least C / max_token_chars tokens, for a tokenizer
        that keeps every character of its input, as DeepSeek's byte-level ones do (a piece is
        written one character per byte)."""
        return max(1, max((len(piece) for piece in self._tk.get_vocab(with_added_tokens=True)), default=1))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    # ---- chat ----------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the checkpoint's chat template, or
        with `chat_template` (Jinja source) given for this call; `kwargs` reach the template as
        variables. continue_final_message: cut the text right after the last message's content (no
        end-of-turn marker follows it), for the model to continue that message; as transformers
        does, the content, stripped of outer spacing, must appear in the rendered text."""
        template = chat_template or self.chat_template
        if not template:
            raise LoadError("this checkpoint's tokenizer_config.json has no chat_template; run without --chat or add one")
        from jinja2 import TemplateError

        try:
            text = _compile(template).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as exc:
            raise LoadError(f"the chat template failed: {exc}") from None
        except Exception as exc:  # its operations on this conversation's values (a null content, 1/0, a range past the sandbox's bound, recursion)
            raise LoadError(f"the chat template failed on this conversation ({type(exc).__name__}: {_first_line(exc)})") from None
        return _cut_after_final_message(text, messages[-1]["content"]) if continue_final_message else text


def _cut_after_final_message(text: str, final: str) -> str:
    """`text` up to the end of the last message's content (transformers' continue_final_message:
    the spacing the template kept is kept; where it stripped the content, the stripped form counts)."""
    if final.strip() not in text:
        raise LoadError("continue_final_message: the last message's content does not appear in the rendered chat (the template drops it)")
    start = text.rindex(final.strip())
    if text[start : start + len(final.lstrip())] == final:  # the template kept the content's trailing spacing
        return text[: start + len(final.lstrip())]
    return text[: start + len(final.strip())]


def check_tokenizer_folder(path: str | Path) -> Path:
    """`path` as a folder that holds a tokenizer.json; a LoadError saying what is wrong otherwise."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise LoadError(f"tokenizer path {path} does not exist", f"pass a folder that holds {TOKENIZER_FILE}")
    if not folder.is_dir():
        raise LoadError(f"tokenizer path {path} is a file", f"pass the folder that holds {TOKENIZER_FILE} (and {TOKENIZER_CONFIG})")
    if folder_file(folder, TOKENIZER_FILE) is None:
        raise LoadError(f"tokenizer folder {path} has no {TOKENIZER_FILE}", f"pass a folder that holds the tokenizer ({TOKENIZER_FILE}, {TOKENIZER_CONFIG})")
    return folder


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if not template:
        path = folder_file(folder, CHAT_TEMPLATE_FILE)
        if path is not None:
            template = read_text(path)
    return template or None


def _is_token(value: Any) -> bool:
    """A special token as tokenizer_config writes it: a string, or an AddedToken dict with its content."""
    return isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str))


def _is_named_templates(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    )


# tokenizer_config.json's fields the tokenizer reads (absent or null: not set).
TOKENIZER_CONFIG_FIELDS = (
    Field("bos_token", Kind('a string or an object with a "content" string', _is_token)),
    Field("eos_token", Kind('a string or an object with a "content" string', _is_token)),
    Field("add_bos_token", BOOLEAN),
    Field("chat_template", any_of(STRING, Kind('a list of {"name": ..., "template": ...} objects', _is_named_templates))),
)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    """A sandboxed jinja2 template with the globals HF chat templates use (compiled once per source)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        from jinja2 import TemplateError

        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateSyntaxError as exc:
        raise LoadError(f"the chat template does not parse: {exc}") from None
