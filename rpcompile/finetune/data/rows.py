"""Rows: what one data row means, as a `Document` (its text and the characters it trains on).

    >>> row_document({"prompt": "Q: ", "completion": "A"}, "prompt/completion", "line 1",   # no tokenizer:
    ...              tokenizer=None, train_on=None, text_field="text", template=None)  # only conversations need one
    Document(text='Q: A', templated=False, spans=((3, 4),), train_eos=True)

The row kinds and the rules of what is trained (the chat template's replies,
prompt/completion, text) are in `rpcompile.finetune.data`'s module docstring; the
file reading around them (lines, UTF-8, one kind per file) is there too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Document", "TRAIN_ON", "CONVERSATIONAL", "row_kind", "row_document", "text_only"]

TRAIN_ON = ("assistant", "last", "all")  # --train-on choices (None: assistant for conversations, all for text)
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user",
                  "assistant": "assistant", "tool": "tool"}  # sharegpt "from" -> messages "role"
CONVERSATIONAL = ("messages", "sharegpt")  # row kinds rendered with the chat template


@dataclass(frozen=True, slots=True)
class Document:
    """One training document as text, with how it was made and which of its characters are trained."""

    text: str  # the document
    templated: bool  # True: made by the chat template, which adds its own special tokens
    spans: tuple[tuple[int, int], ...] | None = None  # trained character ranges [start, end); None: all
    train_eos: bool = True  # the EOS packed after the document is a target


def text_only(train_on: str | None, path: str) -> None:
    """Refuse assistant/last for text data (there is no reply to pick)."""
    if train_on not in (None, "all"):
        raise ValueError(f"--train-on {train_on} needs conversations or prompt/completion rows, and data file "
                         f"{path!r} holds text; use --train-on all")


def row_kind(obj: Any, text_field: str) -> str | None:
    """The kind of one JSON row: text, messages, sharegpt, prompt/completion, or None."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get(text_field), str):
        return "text"
    if isinstance(obj.get("messages"), list):
        return "messages"
    if isinstance(obj.get("conversations"), list):
        return "sharegpt"
    if isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"), str):
        return "prompt/completion"
    return None


def row_document(obj: dict, kind: str, where: str, tokenizer: Any, train_on: str | None, text_field: str,
              template: str | None) -> Document:
    """One row of a known kind as a Document; ValueError naming `where` and the field of a string that is not text."""
    if kind == "text":
        return Document(_text(obj[text_field], where, repr(text_field)), False)
    if kind == "prompt/completion":
        text = _text(obj["prompt"], where, "'prompt'") + _text(obj["completion"], where, "'completion'")
        return Document(text, False) if train_on == "all" else Document(text, False, ((len(obj["prompt"]),
                                                                                       len(text)),), True)
    messages = _messages(obj["messages"], where) if kind == "messages" else _sharegpt(obj["conversations"], where)
    return _conversation(messages, where, tokenizer, template, train_on or "assistant")


def _messages(messages: list, where: str) -> list[dict]:
    """A 'messages' list, checked: each a {"role": str, "content": str} dict."""
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: each message must be {{'role': str, 'content': str}}, got {m!r}")
    return [{"role": _text(m["role"], where, f"message {i} 'role'"),
             "content": _text(m["content"], where, f"message {i} 'content'")} for i, m in enumerate(messages, 1)]


def _sharegpt(turns: list, where: str) -> list[dict]:
    """A sharegpt 'conversations' list as messages (human -> user, gpt -> assistant)."""
    out = []
    for i, t in enumerate(turns, 1):
        if not (isinstance(t, dict) and t.get("from") in SHAREGPT_ROLES and isinstance(t.get("value"), str)):
            raise ValueError(f"{where}: each sharegpt turn must be {{'from': one of {sorted(SHAREGPT_ROLES)}, "
                             f"'value': str}}, got {t!r}")
        out.append({"role": SHAREGPT_ROLES[t["from"]], "content": _text(t["value"], where, f"turn {i} 'value'")})
    return out


def _text(value: str, where: str, field: str) -> str:
    """`value` if it is text (encodable as UTF-8); ValueError naming the field and the character otherwise.

    JSON can spell a lone UTF-16 surrogate ("\\ud800" without its pair): Python reads it into a str that no
    tokenizer can encode.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where}: {field} holds a lone UTF-16 surrogate {value[exc.start]!r} at character "
                         f"{exc.start}, which is not text (a JSON \\u escape without its pair)") from None
    return value


def _conversation(messages: list[dict], where: str, tokenizer: Any, template: str, train_on: str) -> Document:
    """A conversation rendered with the chat template, its trained spans by the module docstring's rule."""
    def render(msgs: list[dict], prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt,
                                                 chat_template=template)
        except Exception as exc:  # jinja's TemplateError and whatever the template raises itself
            text = str(exc).strip().splitlines()
            raise ValueError(f"{where}: the chat template failed: {text[0] if text else type(exc).__name__}") \
                from None

    full = render(messages)
    if train_on == "all":
        return Document(full, True)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies:
        raise ValueError(f"{where}: the conversation has no assistant message, so --train-on {train_on} trains "
                         f"nothing in it")
    spans = []
    for i in replies[-1:] if train_on == "last" else replies:
        start, end = render(messages[:i], prompt=True), render(messages[:i + 1])
        if not (end.startswith(start) and full.startswith(end)):
            raise ValueError(f"{where}: the chat template renders message {i + 1} (assistant) so that the "
                             f"conversation up to it is not a prefix of the whole; the trained span is undefined "
                             f"(use --train-on all, or a template that renders turns in order)")
        spans.append((len(start), len(end)))
    return Document(full, True, tuple(spans), False)
