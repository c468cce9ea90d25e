"""Chat templates and loss masks for instruction tuning (docs/instruction-tuning.md). A conversation is encoded
segment by segment between special tokens, as a Hugging Face tokenizer splits it, so training documents, inference
and the exported tokenizer's ``apply_chat_template`` give the same ids."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from fullband.data.sources import check_messages
from fullband.data.tokenizers import CHAT_TOKENS, Tokenizer
from fullband.errors import DataError

# The built-in template in Jinja, for tokenizers exported to Hugging Face (hf/export.py); it renders the
# same text that `_builtin_ids` encodes.
BUILTIN_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# End-of-turn tokens of common chat templates, recognised when a tokenizer's own template is used.
_KNOWN_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


def apply_chat_template(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation, starting with the tokenizer's bos token; with
    ``add_generation_prompt`` they end with the opening of an assistant turn, ready for generation."""
    messages = check_messages(messages)
    if tokenizer.chat_template is not None:
        return _with_bos(tokenizer, tokenizer.encode(_render(tokenizer, messages, add_generation_prompt)))
    ids, _ = _builtin_ids(tokenizer, messages, add_generation_prompt)
    return ids


def end_of_turn_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids that end an assistant turn (stop generating at any of them): the template's end-of-turn token
    and the tokenizer's eos."""
    ids = [tokenizer.eos_id]
    if tokenizer.chat_template is None:
        _require_chat_tokens(tokenizer)
        return [tokenizer.token_to_id(CHAT_TOKENS[1]), *ids]
    # The first token after an assistant message's content in the rendered template ends the turn.
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    rendered = _render(tokenizer, probe, False)
    after = rendered[rendered.rfind("ok") + 2 :]
    first = tokenizer.encode(after)[:1] if after else []
    known = [tokenizer.token_to_id(t) for t in _KNOWN_END_OF_TURN]
    candidates = [*first, *(i for i in known if i is not None)]
    # Only special tokens can end a turn; "\n" after the content (some templates) must not stop generation.
    return list(dict.fromkeys([*(i for i in candidates if _is_special(tokenizer, i)), *ids]))


def encode_record(tokenizer: Tokenizer, record: dict) -> tuple[list[int], list[bool]]:
    """A chat or prompt_answer record as a framed training document (bos ... eos) and its loss mask: True on the
    assistant turns' tokens and their end-of-turn token (chat), or on the answer and the final eos."""
    if "messages" in record:
        messages = check_messages(record["messages"])
        if tokenizer.chat_template is not None:
            ids, mask = _template_ids(tokenizer, messages)
        else:
            ids, mask = _builtin_ids(tokenizer, messages, False)
        return ids + [tokenizer.eos_id], mask + [False]
    prompt, answer = tokenizer.encode(record["prompt"]), tokenizer.encode(record["answer"])
    ids = [tokenizer.bos_id, *prompt, *answer, tokenizer.eos_id]
    return ids, [False] * (1 + len(prompt)) + [True] * (len(answer) + 1)


def _require_chat_tokens(tokenizer: Tokenizer) -> None:
    if not tokenizer.has_chat_tokens:
        raise DataError(
            f"this {tokenizer.kind} tokenizer has no chat template and lacks fullband's chat tokens "
            f"{', '.join(CHAT_TOKENS)}: the model was not instruction-tuned. Fine-tune it on chat data first "
            "(fullband train --data.format chat --init-from MODEL ..., see docs/instruction-tuning.md)."
        )


def _builtin_ids(
    tokenizer: Tokenizer, messages: Sequence[dict], add_generation_prompt: bool
) -> tuple[list[int], list[bool]]:
    _require_chat_tokens(tokenizer)
    start, end = (tokenizer.token_to_id(t) for t in CHAT_TOKENS)
    newline = tokenizer.encode("\n")
    ids, mask = [tokenizer.bos_id], [False]
    for m in messages:
        head = [start, *tokenizer.encode(m["role"] + "\n")]
        body = [*tokenizer.encode(m["content"]), end]
        trained = m["role"] == "assistant"
        ids += head + body + newline
        mask += [False] * len(head) + [trained] * len(body) + [False] * len(newline)
    if add_generation_prompt:
        head = [start, *tokenizer.encode("assistant\n")]
        ids += head
        mask += [False] * len(head)
    return ids, mask


@lru_cache(maxsize=8)
def _compiled(template: str):
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError("rendering the tokenizer's chat template needs jinja2: pip install jinja2") from None

    def raise_exception(message: str) -> None:
        raise DataError(f"the tokenizer's chat template refused the conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def _render(tokenizer: Tokenizer, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    def name(token_id: int) -> str:
        return tokenizer.id_to_token(token_id) or ""

    return _compiled(tokenizer.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        bos_token=name(tokenizer.bos_id), eos_token=name(tokenizer.eos_id), pad_token=name(tokenizer.pad_id),
    )


def _template_ids(tokenizer: Tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Ids of the rendered conversation and its loss mask: the tokens inside the text each assistant turn
    adds (its content and end-of-turn), found as the difference between renderings of the conversation up
    to that turn with and without it."""
    if not hasattr(tokenizer, "encode_with_offsets"):
        raise DataError(f"a {tokenizer.kind} tokenizer cannot locate assistant turns in a rendered template")
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataError(
                "the tokenizer's chat template does not render a conversation as a prefix of its continuation "
                "(it changes earlier turns when one is added), so assistant turns cannot be located for the "
                "loss mask. Use a tokenizer without this template (the built-in one is used then)."
            )
        spans.append((len(before), len(upto)))
    ids, offsets = tokenizer.encode_with_offsets(full)
    mask = [any(lo <= start < hi for lo, hi in spans) for start, _ in offsets]
    if ids[:1] != [tokenizer.bos_id]:
        ids, mask = [tokenizer.bos_id, *ids], [False, *mask]
    return ids, mask


def _with_bos(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    return ids if ids[:1] == [tokenizer.bos_id] else [tokenizer.bos_id, *ids]


def _is_special(tokenizer: Tokenizer, token_id: int) -> bool:
    backend = getattr(tokenizer, "_tok", None)
    if backend is None:
        return token_id >= 256
    added = backend.get_added_tokens_decoder()
    return token_id in added and added[token_id].special
