"""Fine-tuning data: documents from a .txt or .jsonl file, each with the characters it trains on.

    >>> docs = read_documents("chat.jsonl", tokenizer)             # doctest: +SKIP
    >>> data = pack(docs, tokenizer, seq=512)                      # doctest: +SKIP (rpcompile.cli.packing)
    >>> data.batch(step=0, size=8, seed=0).keys()                  # doctest: +SKIP
    dict_keys(['input_ids', 'labels', 'position_ids'])

Formats (the kind of row is detected per file; a file mixes no kinds):
    .txt        one document per non-blank line, or the whole file as one document (`whole_file=True`).
    .jsonl      one JSON object per line, one of:
        text               {"text": "..."} (another key with `text_field`, `--text-field NAME`);
        messages           {"messages": [{"role": "system|user|assistant", "content": "..."}, ...]};
        sharegpt           {"conversations": [{"from": "system|human|gpt", "value": "..."}, ...]},
                           read as messages (human -> user, gpt -> assistant);
        prompt/completion  {"prompt": "...", "completion": "..."}: the text prompt + completion.

Conversations (messages and sharegpt rows) are rendered with the chat template
(the tokenizer's, or `chat_template`); without one they are refused: there is no
"role: content" fallback.

What is trained (`train_on`; None picks "assistant" for conversations and
"all" for text):
    assistant  every assistant message. For assistant message i the trained characters run
               from the end of render(messages[:i], add_generation_prompt=True) to the end of
               render(messages[:i+1]): the reply and whatever the template closes it with (the
               end-of-turn marker). Both renders must be prefixes of render(messages).
    last       only the final assistant message, by the same rule.
    all        every token of the rendered conversation.
A token is trained when its first character lies in a trained span (the fast
tokenizer's offsets, `return_offsets_mapping`); the tokens a tokenizer adds
itself (a BOS: empty offsets) are not. A conversation with no assistant message
is refused under assistant and last (it has nothing to train). The EOS that
packing puts after each document is trained under all, never after a masked
conversation (its closing marker ends it).

Prompt/completion rows train the completion and the EOS after it, every prompt
token -100 (under `all`: everything). Text rows train everything; assistant and
last are refused for them.

Files are read as UTF-8 (a leading BOM is skipped) and split into lines at "\n"
only, dropping one trailing "\r" per line: U+2028, U+2029 and U+0085 are
characters inside a line, as JSON allows them unescaped in strings (not
`str.splitlines`, which splits at them).

Packing into sequences (positions, document boundaries, truncation) is
`rpcompile.cli.packing`; `pack`, `Packed` and `IGNORE` are re-exported here.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from rpcompile.cli.packing import IGNORE, PACKINGS, Packed, pack  # re-exported

__all__ = ["Document", "read_documents", "read_template", "pack", "Packed", "IGNORE", "TRAIN_ON", "PACKINGS"]

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


def read_documents(path: str, tokenizer: Any = None, *, whole_file: bool = False, train_on: str | None = None,
                   text_field: str = "text", chat_template: str | None = None) -> list[Document]:
    """The documents of a .txt or .jsonl file, with their trained characters (see the module docstring).

    Args:
        path: the data file.
        tokenizer: renders conversations with its chat template (needed only for those).
        whole_file: .txt only: the whole file is one document instead of one per line.
        train_on: "assistant", "last" or "all"; None: assistant for conversations, all for text.
        text_field: the key of the text in text rows.
        chat_template: a jinja chat template used instead of the tokenizer's.
    Returns:
        The documents, one per row, in file order.
    Raises:
        FileNotFoundError: no such file.
        ValueError: an unknown extension, bytes that are not UTF-8, no document at all, a line that
            is not JSON, a row of no known kind or of another kind than the file's first, a bad
            message, conversations without a chat template, a conversation with no assistant
            message under assistant/last, or assistant/last on text (each names the file, and the
            line where there is one).

    Example:
        >>> d = read_documents("chat.jsonl", tok)[0]; d.text[slice(*d.spans[0])]   # doctest: +SKIP
        'Paris.<|im_end|>\\n'
    """
    if train_on not in (None, *TRAIN_ON):
        raise ValueError(f"--train-on must be one of {TRAIN_ON}, got {train_on!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    ext = os.path.splitext(path)[1].lower()
    raw = _read_text(path)
    if ext == ".txt":
        _text_only(train_on, path)
        if whole_file:
            docs = [Document(raw, False)] if raw.strip() else []
        else:
            docs = [Document(line, False) for line in _lines(raw) if line.strip()]
    elif ext == ".jsonl":
        if whole_file:
            raise ValueError(f"--whole-file applies to .txt files, not {path!r}")
        docs = _jsonl_documents(raw, path, tokenizer, train_on, text_field, chat_template)
    else:
        raise ValueError(f"data file {path!r}: unknown extension {ext!r}; use .txt (text) or .jsonl "
                         f"(text, messages, sharegpt or prompt/completion rows)")
    if not docs:
        raise ValueError(f"data file {path!r} holds no documents (it is empty or blank)")
    return docs


def read_template(path: str) -> str:
    """The jinja chat template in file `path` (--chat-template); FileNotFoundError or ValueError naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--chat-template {path!r} does not exist")
    text = _read_text(path)
    if not text.strip():
        raise ValueError(f"--chat-template {path!r} is empty")
    return text


def _text_only(train_on: str | None, path: str) -> None:
    """Refuse assistant/last for text data (there is no reply to pick)."""
    if train_on not in (None, "all"):
        raise ValueError(f"--train-on {train_on} needs conversations or prompt/completion rows, and data file "
                         f"{path!r} holds text; use --train-on all")


def _read_text(path: str) -> str:
    """The file decoded as UTF-8 (BOM skipped); ValueError naming the file and the line of a bad byte."""
    with open(path, "rb") as f:
        blob = f.read()
    try:
        return blob.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = blob[:exc.start].count(b"\n") + 1
        raise ValueError(f"data file {path!r} line {line}: not UTF-8 text (byte {blob[exc.start]:#04x}: "
                         f"{exc.reason}); save it as UTF-8") from None


def _lines(text: str) -> list[str]:
    """`text` split at "\n" only, one trailing "\r" dropped per line (U+2028 and the like stay inside)."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _row_kind(obj: Any, text_field: str) -> str | None:
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


def _jsonl_documents(raw: str, path: str, tokenizer: Any, train_on: str | None, text_field: str,
                     chat_template: str | None) -> list[Document]:
    """Every non-blank .jsonl line as a Document; the first row fixes the file's kind."""
    docs, kind, first = [], None, 0
    for lineno, line in enumerate(_lines(raw), 1):
        if not line.strip():
            continue
        where = f"data file {path!r} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not JSON: {exc.msg} (column {exc.colno})") from None
        this = _row_kind(obj, text_field)
        if this is None:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"{where}: needs a {text_field!r} string, a 'messages' list, a sharegpt "
                             f"'conversations' list, or 'prompt' and 'completion' strings; found {keys}")
        if kind is None:
            kind, first = this, lineno
            if kind == "text":
                _text_only(train_on, path)
            template = chat_template or getattr(tokenizer, "chat_template", None)
            if kind in CONVERSATIONAL and not template:
                raise ValueError(f"{where}: {kind} rows are rendered with a chat template and the tokenizer has "
                                 f"none; give one with --chat-template FILE")
        elif this != kind:
            raise ValueError(f"{where} is a {this} row, but line {first} is a {kind} row (one kind of row per "
                             f"file)")
        docs.append(_document(obj, kind, where, tokenizer, train_on, text_field, template))
    return docs


def _document(obj: dict, kind: str, where: str, tokenizer: Any, train_on: str | None, text_field: str,
              template: str | None) -> Document:
    """One row of a known kind as a Document."""
    if kind == "text":
        return Document(obj[text_field], False)
    if kind == "prompt/completion":
        text = obj["prompt"] + obj["completion"]
        return Document(text, False) if train_on == "all" else Document(text, False, ((len(obj["prompt"]),
                                                                                       len(text)),), True)
    messages = _messages(obj["messages"], where) if kind == "messages" else _sharegpt(obj["conversations"], where)
    return _conversation(messages, where, tokenizer, template, train_on or "assistant")


def _messages(messages: list, where: str) -> list[dict]:
    """A 'messages' list, checked: each a {"role": str, "content": str} dict."""
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: each message must be {{'role': str, 'content': str}}, got {m!r}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _sharegpt(turns: list, where: str) -> list[dict]:
    """A sharegpt 'conversations' list as messages (human -> user, gpt -> assistant)."""
    out = []
    for t in turns:
        if not (isinstance(t, dict) and t.get("from") in SHAREGPT_ROLES and isinstance(t.get("value"), str)):
            raise ValueError(f"{where}: each sharegpt turn must be {{'from': one of {sorted(SHAREGPT_ROLES)}, "
                             f"'value': str}}, got {t!r}")
        out.append({"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]})
    return out


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

