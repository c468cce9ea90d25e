"""Text of generated tokens as they stream, for ``fullband generate --stream``, ``fullband chat`` and the server.

Decoding the whole answer again at every token costs time quadratic in its length. ``StreamingDetokenizer``
decodes a short window of recent ids instead: the ids of the last released piece (as context) and those after
it. A window's new text is released only once it does not end in U+FFFD, so a character split over several
byte-level tokens appears whole; and it is the window's text minus the text of its context ids alone, so
tokenizers that decode a piece differently at the start of a text (a SentencePiece leading space) give the same
text as decoding every id at once.

Ids that are not UTF-8 (a model can emit any bytes) keep the window's text ending in U+FFFD. Once more ids wait
than one character can span, the window is split before its incomplete tail where the text of the ids before it
plus that of the tail is the window's text: the decoder starts a new character there, so what comes before is
final and can be released, and the window stays short whatever the model emits.
"""

from __future__ import annotations

from fullband.data import Tokenizer

__all__ = ["StreamingDetokenizer"]

INCOMPLETE = "\ufffd"  # what a decoder gives for bytes that do not (yet) form a whole UTF-8 character
MAX_CHARACTER_IDS = 4  # the most bytes, hence byte-level ids, of one UTF-8 character


class StreamingDetokenizer:
    """``add`` each generated id; it returns the text that id completes (often "", while a character is split
    over ids). ``flush`` returns the rest at the end, an incomplete trailing character included; ``text`` is
    then the decoding of every id at once."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # the text released so far
        # ids[_context:_released] decoded to the last released piece; ids[_released:] are not released yet.
        self._context = 0
        self._released = 0

    def add(self, token: int) -> str:
        self.ids.append(int(token))
        return self._release(final=False)

    def flush(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        decode = self.tokenizer.decode
        context = decode(self.ids[self._context : self._released])
        window = decode(self.ids[self._context :])
        end = len(self.ids)
        if not final and (len(window) <= len(context) or window.endswith(INCOMPLETE)):
            if end - self._released <= MAX_CHARACTER_IDS:
                return ""
            # Not UTF-8: release up to the start of the incomplete tail, if the decoder starts a character there.
            tails = range(end - 1, end - MAX_CHARACTER_IDS, -1)
            end = next((j for j in tails if decode(self.ids[self._context : j]) + decode(self.ids[j:]) == window), None)
            window = decode(self.ids[self._context : end]) if end is not None else ""
            if len(window) <= len(context):
                return ""
        piece = window[len(context) :]
        self.text += piece
        self._context, self._released = self._released, end
        return piece
