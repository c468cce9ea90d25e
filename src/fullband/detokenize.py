"""Text of generated tokens as they stream, through ``tokenizers.decoders.DecodeStream`` (decoding the whole answer
at every token is quadratic), text ending in U+FFFD held until a character completes, or until more wait than one
character can span (ids that are not UTF-8 would be held forever)."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from fullband.data import Tokenizer

__all__ = ["StreamingDetokenizer"]

MAX_CHARACTER_IDS = 4  # the most bytes, hence byte-level ids, of one UTF-8 character


class StreamingDetokenizer:
    """``add`` each generated id; it returns the text that id completes (often "", while a character is split
    over ids). ``flush`` returns the rest at the end, an incomplete trailing character included; ``text`` is
    then the decoding of every id at once."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.text = ""  # the text released so far
        # `Tokenizer.decode` drops the framing ids even where they are not special tokens of the backend.
        self._framing = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id}
        self._restream([])

    def add(self, token: int) -> str:
        token = int(token)
        piece = "" if token in self._framing else self._step(token)
        if not piece and len(self._waiting) > MAX_CHARACTER_IDS:
            piece = self._release_before_tail()
        self.text += piece
        return piece

    def flush(self) -> str:
        decode = self.tokenizer.decode
        piece = decode(self._context + self._waiting)[len(decode(self._context)) :] if self._waiting else ""
        self.text += piece
        self._restream([])
        return piece

    def _restream(self, ids: list[int]) -> str:
        """Start a new stream with ``ids``; the text they release."""
        self._stream = DecodeStream(skip_special_tokens=True)
        # The stream's state: the ids of the last piece it released (its context) and those waiting after them.
        self._context: list[int] = []
        self._waiting: list[int] = []
        return "".join(self._step(token) for token in ids)

    def _step(self, token: int) -> str:
        self._waiting.append(token)
        try:
            piece = self._stream.step(self.tokenizer._tok, token)
        except Exception as exc:  # tokenizers raises a bare Exception when the decoder rewrote the context's text
            if not self._context:  # nothing released to rewrite: the ids themselves cannot be decoded
                raise ValueError(f"cannot decode token id {token}: {exc}") from None
            # E.g. a byte-fallback decoder that turns a whole run of byte tokens into U+FFFD once it is not UTF-8,
            # text already released included: that cannot be taken back, so the waiting ids stream anew after it.
            return self._restream(self._waiting)
        if piece is None:
            return ""
        self._context, self._waiting = self._waiting, []
        return piece

    def _release_before_tail(self) -> str:
        decode = self.tokenizer.decode
        context, waiting = self._context, self._waiting
        window = decode(context + waiting)
        for start in range(len(waiting) - 1, len(waiting) - MAX_CHARACTER_IDS, -1):
            head = decode(context + waiting[:start])
            if head + decode(waiting[start:]) == window:
                return head[len(decode(context)) :] + self._restream(waiting[start:])
        return ""
