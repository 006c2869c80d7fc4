"""Instruction-data formats of ``causal_lm`` (``task.options.format``; docs/data.md, "Instruction
formats"): how a row becomes a conversation, and how a conversation becomes the token segments
the loss is computed on.

========================  ==============================================================  ===================
format                    a row holds                                                     default columns
========================  ==============================================================  ===================
``alpaca``                an instruction, an optional input (empty, NaN or absent: none)  ``instruction``,
                          and the output                                                  ``input``, ``output``
``sharegpt``              ``[{from, value}, ...]``; ``from``: ``human`` / ``gpt`` /       ``conversations``
                          ``system`` (:data:`SHAREGPT_ROLES`)
``messages``              ``[{role, content}, ...]`` (OpenAI style)                       ``messages``
``prompt_response``       a prompt and a response                                         (named)
``template``              columns filled into a prompt template, and a response           (named)
========================  ==============================================================  ===================

**Rendering.** A conversation is rendered with the tokenizer's chat template; a tokenizer without
one (or ``chat_template: false``) renders ``sharegpt`` / ``messages`` with
:data:`PLAIN_CHAT_TEMPLATE` (``### User:`` / ``### Assistant:`` blocks) and ``alpaca`` with the
usual Alpaca prompt (:data:`ALPACA_PROMPT`, :data:`ALPACA_PROMPT_INPUT`). With a chat template an
Alpaca row is one user turn — the instruction, then a blank line and the input when there is one
— and one assistant turn.

**What the loss sees** (:func:`conversation_segments`). The last assistant turn is the response:
its content and the end-of-sequence token, after the prompt ``render(turns[:-1],
add_generation_prompt=True)`` — the text generation starts from. With ``train_on:
all_assistant_turns`` (the default) every earlier assistant turn is trained too: its content and
the end-of-turn token the template writes right after it (a special token such as ``<|im_end|>``;
none when the template writes plain text there); everything else — system and user turns, the
template's role headers — is context (label −100). The turns are found by rendering the
conversation's prefixes: ``render(turns[:k], add_generation_prompt=True)`` must be the start of
``render(turns[:k+1])``, which must start with turn ``k``'s content. A template that rewrites
earlier turns (some drop the reasoning of past answers) breaks that; the error says to use
``train_on: last``, which needs only the last prompt.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from fedgalore.tasks.base import TaskError

__all__ = ["FORMATS", "CHAT_FORMATS", "SHAREGPT_ROLES", "ALPACA_PROMPT", "ALPACA_PROMPT_INPUT", "PLAIN_CHAT_TEMPLATE",
           "FormatColumns", "alpaca_user_text", "alpaca_prompt", "to_turns", "guess_format", "conversation_segments",
           "end_of_turn_tokens"]

FORMATS = ("alpaca", "sharegpt", "messages", "prompt_response", "template")
#: the formats whose rows are conversations (a column of turns)
CHAT_FORMATS = ("sharegpt", "messages")
#: ShareGPT's speaker names (``from``) and the chat roles they become
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "model": "assistant", "system": "system"}
#: the Alpaca prompt of a row with an input (Stanford Alpaca's ``prompt_input``)
ALPACA_PROMPT_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                       "Write a response that appropriately completes the request.\n\n"
                       "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
#: the Alpaca prompt of a row without one (``prompt_no_input``)
ALPACA_PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Response:\n")
#: how a conversation is written for a tokenizer without a chat template
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n\n{% endfor %}"
                       "{% if add_generation_prompt %}### Assistant:\n{% endif %}")
_DEFAULT_COLUMNS = {"alpaca": ("instruction", "input", "output", None), "sharegpt": (None, None, None, "conversations"),
                    "messages": (None, None, None, "messages")}


@dataclass(frozen=True)
class FormatColumns:
    """The columns a format reads: the prompt (or the alpaca instruction), the alpaca input, the
    response, the conversation (each None where the format reads none)."""

    prompt: str | None
    input: str | None
    response: str | None
    messages: str | None

    @classmethod
    def of(cls, fmt: str, prompt: str | None, input_: str | None, response: str | None, messages: str | None) -> "FormatColumns":
        """The columns of format ``fmt``: the ones given, else the format's defaults."""
        d = _DEFAULT_COLUMNS.get(fmt, (None, None, None, None))
        return cls(prompt or d[0], input_ or d[1], response or d[2], messages or d[3])


def _text(value: Any) -> str | None:
    """A cell as text; None for an empty or NaN one."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    text = str(value)
    return text if text.strip() else None


def alpaca_user_text(instruction: Any, input_: Any) -> str:
    """The user turn of an Alpaca row (chat template): the instruction, and the input after a blank
    line when there is one."""
    extra = _text(input_)
    return str(instruction) + (f"\n\n{extra}" if extra is not None else "")


def alpaca_prompt(instruction: Any, input_: Any) -> str:
    """The usual Alpaca prompt of a row (no chat template): with or without its input section."""
    extra = _text(input_)
    if extra is None:
        return ALPACA_PROMPT.format(instruction=instruction)
    return ALPACA_PROMPT_INPUT.format(instruction=instruction, input=extra)


def _keys(turn: Any) -> str:
    if isinstance(turn, dict):
        return "{" + ", ".join(k for k, v in turn.items() if v is not None) + "}"
    return type(turn).__name__


def to_turns(chat: Any, fmt: str, where: str, option: str) -> list[dict[str, str]]:
    """The ``{role, content}`` turns of a ``sharegpt`` or ``messages`` cell ``chat``, which must
    end with an assistant turn. A cell in the other format (or none) is one line naming the format
    expected, the keys found and the option to set; ``where`` names the file and row. A cell
    holding the list as JSON text (a chat stored in a CSV column) is parsed first."""
    if isinstance(chat, str) and chat.lstrip().startswith("["):
        try:
            chat = json.loads(chat)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{where}: column {option} holds text that is not a JSON list of turns ({exc.msg} at "
                            f"character {exc.pos})") from None
    expect = "{from, value}" if fmt == "sharegpt" else "{role, content}"
    if not isinstance(chat, (list, tuple)) or not chat or not all(isinstance(t, dict) for t in chat):
        found = type(chat).__name__ if not isinstance(chat, (list, tuple)) else f"a list of {', '.join(sorted({_keys(t) for t in chat})) or 'nothing'}"
        raise TaskError(f"{where}: format {fmt} needs column {option} to hold a list of {expect} turns; found {found}")
    keys = {k for t in chat for k, v in t.items() if v is not None}
    if fmt == "messages" and not {"role", "content"} <= keys:
        hint = "; that looks like ShareGPT: set task.options.format: sharegpt" if {"from", "value"} <= keys else ""
        raise TaskError(f"{where}: format messages needs {{role, content}} turns in column {option}; found turns with keys "
                        f"{', '.join(sorted(keys))}{hint}")
    if fmt == "sharegpt" and not {"from", "value"} <= keys:
        hint = "; that looks like OpenAI messages: set task.options.format: messages" if {"role", "content"} <= keys else ""
        raise TaskError(f"{where}: format sharegpt needs {{from, value}} turns in column {option}; found turns with keys "
                        f"{', '.join(sorted(keys))}{hint}")
    turns = []
    for k, t in enumerate(chat, start=1):
        if fmt == "sharegpt":
            who = str(t.get("from")).strip().lower()
            if who not in SHAREGPT_ROLES:
                raise TaskError(f"{where}: turn {k} is from {t.get('from')!r}; ShareGPT speakers are "
                                f"{', '.join(SHAREGPT_ROLES)} (human: user, gpt: assistant)")
            role, content = SHAREGPT_ROLES[who], t.get("value")
        else:
            role, content = t.get("role"), t.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise TaskError(f"{where}: turn {k} needs a text {'value' if fmt == 'sharegpt' else 'content'} and "
                            f"{'from' if fmt == 'sharegpt' else 'role'}; found {_keys(t)}")
        turns.append({"role": role, "content": content})
    if turns[-1]["role"] != "assistant" or len(turns) < 2:
        raise TaskError(f"{where}: a conversation must end with an assistant turn after at least one other turn "
                        f"(it ends with a {turns[-1]['role']} turn, {len(turns)} turn(s))")
    return turns


def guess_format(columns: Sequence[str], first_row: dict[str, Any] | None) -> tuple[str, str] | None:
    """``(format, what to set)`` for rows that look like a known format (for messages), or None."""
    cols = set(columns)
    if {"instruction", "output"} <= cols:
        return "alpaca", "task.options.format: alpaca"
    for c in columns:
        v = (first_row or {}).get(c)
        if isinstance(v, list) and v and isinstance(v[0], dict):
            keys = {k for k, x in v[0].items() if x is not None}
            for fmt, need in (("sharegpt", {"from", "value"}), ("messages", {"role", "content"})):
                if need <= keys:
                    default = _DEFAULT_COLUMNS[fmt][3]
                    return fmt, f"task.options.format: {fmt}" + ("" if c == default else f" and messages_column: {c}")
    return None


def end_of_turn_tokens(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens (an end-of-turn marker is one of them), longest first."""
    special = {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            special.add(str(tok.content))
    return sorted((s for s in special if s), key=len, reverse=True)


def _render(render: Any, turns: list[dict[str, str]], generation: bool, where: str) -> str:
    try:
        return render(turns, generation)
    except Exception as exc:  # noqa: BLE001 - jinja2 template errors of any kind (e.g. roles must alternate)
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise TaskError(f"{where}: the chat template could not render this conversation ({type(exc).__name__}: {line})") from None


def conversation_segments(turns: list[dict[str, str]], render: Any, train_all: bool, eot: Sequence[str],
                          where: str) -> tuple[str, tuple[tuple[str, bool], ...] | None]:
    """``(prompt, segments)`` of a conversation ending with an assistant turn (module doc).

    ``render(turns, add_generation_prompt)`` renders turns as text. ``prompt`` is the text before
    the last turn's content (generation starts from it). ``segments`` splits ``prompt`` into
    ``(text, trained)`` pieces — the earlier assistant turns' content and end-of-turn token
    trained, the rest not — or is None when nothing before the last turn is trained (``train_all``
    False, or a single assistant turn): the prompt is then all context."""
    prompt = _render(render, turns[:-1], True, where)
    earlier = [k for k, t in enumerate(turns[:-1]) if t["role"] == "assistant"]
    if not train_all or not earlier:
        return prompt, None
    fix = "set task.options.train_on: last (loss on the last assistant turn only)"
    segs: list[tuple[str, bool]] = []
    done = ""
    for k in earlier:
        before = _render(render, turns[:k], True, where)
        upto = _render(render, turns[:k + 1], False, where)
        if not before.startswith(done) or not upto.startswith(before):
            raise TaskError(f"{where}: the chat template does not write this conversation's earlier turns as the start of its "
                            f"later ones, so assistant turn {k + 1} cannot be located to train on; {fix}")
        body, content = upto[len(before):], turns[k]["content"]
        if not content.strip():  # an empty answer: nothing to learn, context only
            segs.append((upto[len(done):], False))
            done = upto
            continue
        found = next((c for c in (content, content.strip()) if c and body.startswith(c)), None)
        if found is None:
            raise TaskError(f"{where}: the chat template does not write assistant turn {k + 1}'s content right after its "
                            f"generation prompt; {fix}")
        rest = body[len(found):]
        end = next((t for t in eot if rest.startswith(t)), "")
        segs += [(before[len(done):], False), (found + end, True), (rest[len(end):], False)]
        done = upto
    if not prompt.startswith(done):
        raise TaskError(f"{where}: the chat template does not write this conversation's earlier turns as the start of its "
                        f"last prompt; {fix}")
    segs.append((prompt[len(done):], False))
    merged: list[tuple[str, bool]] = []
    for text, trained in segs:
        if not text:
            continue
        if merged and merged[-1][1] == trained:
            merged[-1] = (merged[-1][0] + text, trained)
        else:
            merged.append((text, trained))
    assert "".join(t for t, _ in merged) == prompt
    return prompt, tuple(merged)
