"""Encoding: documents to token ids and targets, and what decides how a tokenizer encodes (its fingerprint).

    >>> encode([Document("hello", False)], tok, tok.eos_token_id)   # doctest: +SKIP
    (array([72, 79, 2], dtype=int32), array([0, 1, 1], dtype=uint8), array([3]))

The rule (`rpcompile.finetune.data.packing`'s module docstring has the why): each
document's ids are followed by the EOS; a token is a target (its label is its
id) unless it is untrained: a document's first token never is one, the EOS is
one when the document trains it (`Document.train_eos`), and a token of a masked
document (`Document.spans`) is one when its first character lies in a trained
span (the fast tokenizer's offsets; a token it adds itself has empty offsets
and is not). Used by `rpcompile.finetune.data.token_cache`, one chunk of documents per
batched tokenizer call.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import itertools
import json
from typing import Any

import numpy as np

__all__ = ["special_ids", "tokenizer_fingerprint", "encode"]


def special_ids(tokenizer: Any) -> tuple[int, int]:
    """(EOS id, pad id: the pad token's, else EOS); ValueError for a tokenizer without EOS."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has no EOS token to separate documents; "
                         f"set eos_token in its tokenizer_config.json")
    return eos, (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A sha256 of everything that decides how `tokenizer` encodes; it reads attributes, never encodes.

    Example:
        >>> tokenizer_fingerprint(AutoTokenizer.from_pretrained("tiny/"))[:12]   # doctest: +SKIP
        '5f0c3d9e21ab'
    """
    cls = type(tokenizer)
    parts: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}",
                             "fast": bool(getattr(tokenizer, "is_fast", False))}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        parts["backend"] = backend.to_str()  # vocabulary, merges, normalizer, pre-tokenizer, post-processor
    else:  # a slow tokenizer: its vocabulary, and a sentencepiece model where it has one
        parts["vocab"] = sorted(tokenizer.get_vocab().items())
        sp = getattr(tokenizer, "sp_model", None)
        if sp is not None and hasattr(sp, "serialized_model_proto"):
            parts["sentencepiece"] = hashlib.sha256(sp.serialized_model_proto()).hexdigest()
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id"):
        parts[name] = getattr(tokenizer, name, None)
    parts["added"] = sorted((int(i), str(t)) for i, t in (getattr(tokenizer, "added_tokens_decoder", None)
                                                          or {}).items())
    parts["flags"] = sorted((k, v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
                            if isinstance(v, bool))  # add_bos_token, add_prefix_space, do_lower_case, ...
    parts["versions"] = [_version(p) for p in ("tokenizers", "transformers", "sentencepiece")]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _version(package: str) -> str | None:
    """The installed version of `package` (None when it is not installed)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def encode(docs: list[Any], tokenizer: Any, eos: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids int32, trained uint8, lengths int64) of `docs` end to end: EOS after each, first token untrained.

    One batched tokenizer call per kind of document in `docs` (a chat template adds its own special
    tokens, so templated documents are encoded without the tokenizer's).

    Example:
        >>> encode([Document("hello", False)], tok, tok.eos_token_id)   # doctest: +SKIP
        (array([72, 79, 2], dtype=int32), array([0, 1, 1], dtype=uint8), array([3]))
    """
    groups = []
    for templated in (False, True):
        idx = [i for i, d in enumerate(docs) if d.templated == templated]
        if not idx:
            continue
        masked = any(docs[i].spans is not None for i in idx)
        if masked and not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"masking the untrained tokens needs a fast tokenizer (character offsets); "
                             f"{type(tokenizer).__name__} is not one (use --train-on all)")
        enc = tokenizer([docs[i].text for i in idx], add_special_tokens=not templated,
                        return_offsets_mapping=masked)
        groups.append((idx, enc["input_ids"], enc["offset_mapping"] if masked else None))
    lengths = np.zeros(len(docs), np.int64)
    for idx, ids, _ in groups:
        lengths[idx] = [len(x) + 1 for x in ids]  # + the EOS
    start = np.cumsum(lengths) - lengths
    out_ids = np.full(int(lengths.sum()), eos, np.int32)  # the EOS where no token goes
    out_trained = np.ones(len(out_ids), np.uint8)
    for idx, ids, offsets in groups:
        n = lengths[idx] - 1
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, count=int(n.sum()))
        within = np.arange(len(flat)) - np.repeat(np.cumsum(n) - n, n)
        dest = np.repeat(start[idx], n) + within
        out_ids[dest] = flat
        if offsets is not None:
            out_trained[dest] = _span_mask([docs[i] for i in idx], offsets, n)
    out_trained[start + lengths - 1] = [d.train_eos for d in docs]  # the EOS
    out_trained[start] = 0  # the previous document's last token does not predict this one
    return out_ids, out_trained, lengths


def _span_mask(docs: list[Any], offsets: list, n: np.ndarray) -> np.ndarray:
    """1 where a token's first character lies in one of its document's spans (an empty offset: never)."""
    pairs = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(offsets)), np.int64,
                        count=2 * int(n.sum())).reshape(-1, 2)
    first, end = pairs[:, 0], pairs[:, 1]
    mask = np.ones(len(pairs), bool)
    at = 0
    for d, k in zip(docs, n.tolist()):
        if d.spans is not None:
            s = first[at:at + k]
            hit = np.zeros(k, bool)
            for a, b in d.spans:
                hit |= (a <= s) & (s < b)
            mask[at:at + k] = hit & (s < end[at:at + k])
        at += k
    return mask
