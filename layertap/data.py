"""Inputs: JSONL lines or Python objects -> token ids (+ assistant loss mask).

Accepted forms (one per JSONL line, or one per element of an ``inputs`` list):
    {"prompt": str}                                  tokenized as vLLM would (special tokens added)
    {"messages": [{"role", "content"}, ...]}         the model's chat template is applied
    {"conversations": [{"from", "value"}, ...]}      ShareGPT, mapped to messages
    {"token_ids": [int, ...]}                        used as is
    a bare str / list[int] / list[message dict]      in Python only

For conversations the loss mask marks assistant tokens. It is found by rendering growing prefixes of
the conversation and diffing token ids, which works for any chat template (no ``{% generation %}`` tags
needed); a template whose prefix rendering is not a token prefix is rejected with an error naming it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence


class InputError(ValueError):
    """Malformed input; the message names the line or position."""


@dataclass
class InputItem:
    index: int
    token_ids: list[int]
    loss_mask: list[int] | None = None
    """1 for assistant tokens (trainable), else 0; ``None`` for plain prompts."""
    messages: list[dict[str, str]] | None = None


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


def _messages_from(obj: dict[str, Any], where: str) -> list[dict[str, str]] | None:
    if "messages" in obj:
        msgs = obj["messages"]
    elif "conversations" in obj:
        msgs = []
        for turn in obj["conversations"]:
            role = _SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
            if role is None:
                raise InputError(f"{where}: unknown ShareGPT role {turn.get('from')!r}")
            msgs.append({"role": role, "content": turn.get("value", "")})
    else:
        return None
    if not isinstance(msgs, list) or not msgs:
        raise InputError(f"{where}: 'messages' must be a non-empty list")
    for m in msgs:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InputError(f"{where}: every message needs 'role' and 'content', got {m!r}")
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in msgs]


def _render(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def conversation_tokens(tokenizer, messages: list[dict[str, str]], where: str = "conversation") -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and its assistant loss mask (prefix-diff method)."""
    if tokenizer.chat_template is None:
        raise InputError(f"{where}: the tokenizer has no chat template; give 'prompt' or 'token_ids' instead")
    ids: list[int] = []
    mask: list[int] = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            # The assistant header belongs to the prompt side: render the generation prompt first.
            head = _render(tokenizer, messages[:k], add_generation_prompt=True) if k else []
            if head[: len(ids)] != ids:
                raise InputError(f"{where}: chat template is not prefix-stable at message {k}")
            mask += [0] * (len(head) - len(ids))
            ids = head
        full = _render(tokenizer, messages[: k + 1])
        if full[: len(ids)] != ids:
            raise InputError(f"{where}: chat template is not prefix-stable at message {k}")
        seg = [1 if m["role"] == "assistant" else 0] * (len(full) - len(ids))
        eos = getattr(tokenizer, "eos_token_id", None)
        if m["role"] == "assistant" and eos in full[len(ids):]:
            # Template text after the end-of-turn token (a newline, say) is not the model's output.
            last = len(full) - 1 - full[::-1].index(eos)
            seg = [1 if len(ids) + j <= last else 0 for j in range(len(seg))]
        mask += seg
        ids = full
    return ids, mask


def to_item(obj: Any, index: int, tokenizer, where: str | None = None, *, vocab_limit: int | None = None) -> InputItem:
    """One input (dict, str, token list or message list) -> ``InputItem``. ``vocab_limit``: the tokenizer's
    ``_vocab_limit``, when the caller converts many inputs (asked once, not per input)."""
    where = where or f"input {index}"
    if isinstance(obj, InputItem):  # already tokenized and checked (e.g. by the CLI, before the engine)
        return obj
    if isinstance(obj, str):
        obj = {"prompt": obj}
    elif isinstance(obj, (list, tuple)):
        if obj and all(isinstance(t, int) for t in obj):
            obj = {"token_ids": list(obj)}
        elif obj and all(isinstance(m, dict) for m in obj):
            obj = {"messages": list(obj)}
        else:
            raise InputError(f"{where}: a list input must hold token ids (int) or messages (dict)")
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected an object with 'prompt', 'messages' or 'token_ids', got {type(obj).__name__}")
    msgs = _messages_from(obj, where)
    if msgs is not None:
        ids, mask = conversation_tokens(tokenizer, msgs, where)
        item = InputItem(index, ids, mask, msgs)
    elif "token_ids" in obj:
        ids = obj["token_ids"]
        # exactly int (not bool, not numpy ints), checked by C loops: this runs for every input before the
        # first request is admitted, so its cost is engine idle time at the start of every capture call
        if not isinstance(ids, list) or (ids and set(map(type, ids)) != {int}):
            raise InputError(f"{where}: 'token_ids' must be a list of ints")
        item = InputItem(index, list(ids))
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise InputError(f"{where}: 'prompt' must be a string")
        item = InputItem(index, list(tokenizer(obj["prompt"])["input_ids"]))
    else:
        raise InputError(f"{where}: expected a key 'prompt', 'messages', 'conversations' or 'token_ids'; got {sorted(obj)}")
    if not item.token_ids:
        raise InputError(f"{where}: empty prompt (no tokens)")
    limit = vocab_limit if vocab_limit is not None else _vocab_limit(tokenizer)
    if limit is not None and (min(item.token_ids) < 0 or max(item.token_ids) >= limit):
        bad = [t for t in item.token_ids if t < 0 or t >= limit]
        raise InputError(f"{where}: token ids {bad[:5]} are outside the vocabulary (size {limit})")
    return item


def _vocab_limit(tokenizer) -> int | None:
    """One past the largest valid token id (added tokens included), or ``None`` if the tokenizer says not."""
    vocab = getattr(tokenizer, "vocab_size", None)
    return None if vocab is None else max(vocab, len(tokenizer))


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(0-based line number, parsed object) for every line; blank lines are errors (they shift indices)."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"input file {p} does not exist")
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if not line.strip():
                raise InputError(f"{p}:{n + 1}: blank line (every line is one input; indices follow lines)")
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{p}:{n + 1}: malformed JSON ({e.msg} at column {e.colno})") from None


def iter_inputs(source: str | os.PathLike | Sequence[Any] | Iterable[Any], tokenizer) -> Iterator[InputItem]:
    """Every input, tokenized and checked, one at a time as the caller takes them (``load_inputs`` takes them
    all): the first bad one raises ``InputError`` naming its line or index when it is reached."""
    limit = _vocab_limit(tokenizer)
    if isinstance(source, (str, os.PathLike)) and str(source).endswith((".jsonl", ".json")):
        for n, obj in read_jsonl(source):
            yield to_item(obj, n, tokenizer, f"{source}:{n + 1}", vocab_limit=limit)
        return
    if isinstance(source, (str, bytes)):
        source = [source]
    for n, obj in enumerate(source):
        yield to_item(obj, n, tokenizer, vocab_limit=limit)


def load_inputs(source: str | os.PathLike | Sequence[Any] | Iterable[Any], tokenizer) -> list[InputItem]:
    """All inputs, tokenized and checked up front, so bad input fails before any engine work."""
    return list(iter_inputs(source, tokenizer))
