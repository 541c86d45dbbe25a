"""A request's generated text as it grows: incremental detokenization with stop strings.

Each push decodes the whole answer so far (tokens can merge into one character, and a byte-level token may end
mid-character) and hands out only what is settled: text ending in an incomplete character, or in what could be the
start of a stop string, is held back until the next token decides it. A stop string ends the answer; the text stops
just before it (OpenAI semantics).
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.sent = ""  # text handed out so far
        self.text = ""  # the final text once stopped

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def push(self, tok: int, final: bool = False) -> tuple[str, bool]:
        """(new settled text, whether a stop string ended the answer). `final`: no token follows (release all)."""
        self.ids.append(tok)
        full = self._decode()
        for s in self.stop:
            at = full.find(s, max(0, len(self.sent) - len(s)))
            if at >= 0:
                self.text = full[:at]
                return self._hand_out(self.text), True
        if final:
            return self._hand_out(full), False
        keep = len(full)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            keep = len(full.rstrip("\ufffd"))
        for s in self.stop:  # the longest tail that could begin a stop string
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    keep = min(keep, len(full) - k)
                    break
        return self._hand_out(full[:keep]), False

    def flush(self) -> str:
        """Everything still held back (the answer ended by length)."""
        return self._hand_out(self._decode())

    def _hand_out(self, upto: str) -> str:
        if len(upto) <= len(self.sent):
            return ""
        delta = upto[len(self.sent):]
        self.sent = upto
        return delta
