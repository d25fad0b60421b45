"""Chat templates, as Hugging Face loads and renders them: a checkpoint's jinja template turns a list of
chat messages into the prompt text the model was trained on.

Loading (beside tokenizer.json, as ``transformers`` does): ``tokenizer_config.json``'s ``chat_template``, a
string or a list of ``{"name", "template"}`` entries (named templates; "default" is used unless a name is
asked for, "tool_use" when tools are given and it exists); a ``chat_template.jinja`` file replaces the
default one and ``additional_chat_templates/NAME.jinja`` files add named ones. The special tokens the
templates see (``bos_token``, ``eos_token``, ...) come from ``tokenizer_config.json`` and
``special_tokens_map.json``.

Rendering (jinja2, the ``text`` / ``server`` extra): an immutable sandboxed environment with
``trim_blocks`` and ``lstrip_blocks``, the loop controls (``break`` / ``continue``), HF's ``tojson`` filter
(non-ASCII kept), the globals ``raise_exception(message)`` and ``strftime_now(format)``, and the
``{% generation %}`` tag (rendered as its body). The template gets ``messages``, ``add_generation_prompt``,
``tools`` and ``documents`` when given, the special tokens and the caller's ``chat_template_kwargs``.
A message's content is a string, or a list of text parts joined with newlines (vLLM's "string" format).
Every failure, the template's own ``raise_exception`` included, is a ValueError naming the template.
"""

from __future__ import annotations

import datetime
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ._extras import require

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
                      "additional_special_tokens")
# names the caller sets through their own arguments, never through chat_template_kwargs
RESERVED_KWARGS = ("messages", "add_generation_prompt", "continue_final_message", "tools", "documents")


@dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template(s) and the special tokens its templates see."""

    templates: dict[str, str]  # name -> jinja source; a single template is "default"
    origin: str  # where it was read, for messages
    special_tokens: dict[str, Any] = field(default_factory=dict)  # bos_token, eos_token, ...

    def select(self, name: str | None = None, tools: Any = None) -> str:
        """HF's choice among named templates: `name` if given, else "tool_use" with tools, else "default"."""
        if name is not None:
            if name not in self.templates:
                raise ValueError(f"chat template {name!r} is not one of {sorted(self.templates)} ({self.origin})")
            return self.templates[name]
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        raise ValueError(f"{self.origin} names chat templates {sorted(self.templates)} but none is 'default'; "
                         f"ask for one by name")

    def render(self, messages: Any, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: Any = None, documents: Any = None, name: str | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text for one conversation (a list of messages)."""
        return render(self.select(name, tools), messages, origin=self.origin, special_tokens=self.special_tokens,
                      add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                      tools=tools, documents=documents, chat_template_kwargs=chat_template_kwargs)


# --------------------------------------------------------------------------- loading


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return value


def _token_text(value: Any) -> Any:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, Mapping):
        return value.get("content")
    if isinstance(value, list):
        return [_token_text(v) for v in value]
    return value


def read_special_tokens(folder: Path) -> dict[str, Any]:
    """bos_token, eos_token, ... from tokenizer_config.json, then special_tokens_map.json (HF's order)."""
    tokens: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = Path(folder) / name
        if path.is_file():
            config = _read_json(path)
            tokens.update({k: _token_text(config[k]) for k in SPECIAL_TOKEN_KEYS if config.get(k) is not None})
    return tokens


def _named_templates(value: Any, path: Path) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, Mapping) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(f"{path}: chat_template must be a string or a list of {{\"name\", \"template\"}} objects")


def load_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The chat template(s) in a tokenizer folder, or None when it has none."""
    folder = Path(folder)
    templates: dict[str, str] = {}
    origins = []
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        value = _read_json(config_path).get("chat_template")
        if value is not None:
            templates.update(_named_templates(value, config_path))
            origins.append(str(config_path))
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        templates["default"] = jinja_path.read_text()
        origins.append(str(jinja_path))
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.stem] = path.read_text()
            origins.append(str(path))
    if not templates:
        return None
    return ChatTemplate(templates, " + ".join(origins), read_special_tokens(folder))


def template_override(value: str, folder: str | Path | None) -> ChatTemplate:
    """``--chat-template``: a jinja file, or (as vLLM also takes) the template text itself; compiled now, so
    a broken one fails at startup. The special tokens stay the tokenizer folder's."""
    path = Path(value)
    looks_inline = any(c in value for c in "{}\n")
    if not looks_inline:
        if not path.is_file():
            raise ValueError(f"--chat-template {value!r}: no such file (give a jinja file, or the template text)")
        text, origin = path.read_text(), str(path)
    else:
        text, origin = value, "--chat-template"
    compile_template(text, origin)
    return ChatTemplate({"default": text}, origin, read_special_tokens(Path(folder)) if folder is not None else {})


def no_template_error(folder: Any, how_to_give: str) -> ValueError:
    """What a chat call on a model without a template gets."""
    where = f" in {folder}" if folder is not None else ""
    return ValueError(f"the model has no chat template (no chat_template in tokenizer_config.json and no "
                      f"chat_template.jinja{where}); {how_to_give}")


# --------------------------------------------------------------------------- rendering


def _jinja2() -> Any:
    """The jinja2 module, or MissingExtraError naming the extra that installs it."""
    return require("jinja2", "text", "rendering a chat template")


def _raise_exception(message: str) -> None:
    raise _jinja2().TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    _jinja2()
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (HF marks assistant tokens with it): its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def compile_template(source: str, origin: str = "the chat template") -> Any:
    """The compiled jinja template; ValueError for a syntax error."""
    env = _environment()
    try:
        return env.from_string(source)
    except _jinja2().TemplateError as exc:
        raise ValueError(f"chat template ({origin}) does not compile: {exc}") from None


def normalize_messages(messages: Any, where: str = "messages") -> list[dict[str, Any]]:
    """Check a conversation and give each message a string content (text parts joined with newlines)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise TypeError(f"{where} must be a non-empty list of messages ({{'role': ..., 'content': ...}} dicts)")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"{where}[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}[{i}].role must be a non-empty string (system, user, assistant, ...)")
        out.append({**message, "content": _content_text(message.get("content"), f"{where}[{i}].content")})
    return out


def _content_text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or isinstance(content, bytes):
        raise TypeError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{where}[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                             f"got {kind!r}")
    return "\n".join(texts)


def render(source: str, messages: Any, *, origin: str = "the chat template",
           special_tokens: Mapping[str, Any] | None = None,
           add_generation_prompt: bool = True, continue_final_message: bool = False, tools: Any = None,
           documents: Any = None, chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """Render one conversation with the jinja `source` (HF's apply_chat_template, tokenize=False)."""
    template_error = _jinja2().TemplateError
    chat = normalize_messages(messages)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true (continue the "
                         "last message, or open a new assistant message)")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & set(RESERVED_KWARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}: they have their own arguments")
    context = {**dict(special_tokens or {}), **kwargs, "messages": chat, "add_generation_prompt": add_generation_prompt}
    if tools is not None:
        context["tools"] = tools
    if documents is not None:
        context["documents"] = documents
    try:
        text = compile_template(source, origin).render(**context)
    except template_error as exc:
        raise ValueError(f"chat template ({origin}): {exc}") from None
    except TypeError as exc:  # e.g. the template adds a message's None content to a string
        empty = [i for i, m in enumerate(chat) if m["content"] is None]
        hint = f"; messages {empty} have no 'content' (give a string)" if empty else ""
        raise ValueError(f"chat template ({origin}) failed: {exc}{hint}") from None
    if continue_final_message:
        text = _cut_after_final_message(text, chat[-1]["content"])
    return text


def _cut_after_final_message(text: str, final: str | None) -> str:
    """HF's continue_final_message: end the prompt right after the last message's content."""
    if not final or final.strip() not in text:
        raise ValueError("continue_final_message: the last message's content does not appear in the rendered "
                         "chat, so there is nothing to continue")
    at = text.rindex(final.strip())
    if text[at:at + len(final.lstrip())] == final:  # the template kept the message's trailing spaces
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]


def conversations(messages: Any) -> list[Any]:
    """LLM.chat's argument: one conversation (a list of message dicts) or a list of them (vLLM's rule)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise TypeError("messages must be a non-empty list of messages, or a list of such lists")
    if isinstance(messages[0], Mapping):
        return [messages]
    return list(messages)
