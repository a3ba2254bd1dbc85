"""The text of a request's tokens as they come: decoded a few tokens at a time, and stop strings found as they
appear, so a long answer costs the same per token at its end as at its start.

Decoding all of a request's tokens at every delivery (and again for every stop-string check) costs time that
grows with the answer: for a 16K-token trace, tens of milliseconds per delivery per request. :class:`TokenText`
decodes only a window: the tokens since the last text it gave out, behind a few tokens already read (their text is
decoded again only to see where the new text starts: a tokenizer may write a token differently at the start of a
text). A text that ends in the replacement character (a multi-byte character cut between tokens) is held back
until the next tokens complete it. For a byte-level tokenizer the pieces it gives out join to the decode of all the
tokens, which the tests check.
"""

from __future__ import annotations

from typing import Any


class TokenText:
    """The text of a growing list of token ids (``tokenizer.decode`` with ``skip_special_tokens``) and the first
    ``stops`` string in it.

    :meth:`add` takes the next ids and returns the text they complete; ``text`` is all the text given out so far.
    :meth:`stop_cut` says, once a stop string has appeared, the fewest ids whose text holds it."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...] | list[str] = ()) -> None:
        self.tokenizer, self.stops = tokenizer, tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] decoded again, only to see where the new text starts
        self._read = 0  # ids[:_read] are in ``text``
        self._cut: int | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int], final: bool = False) -> str:
        """Append ``ids``; return the text they complete (held back while it ends inside a multi-byte character,
        unless ``final``)."""
        self.ids.extend(ids)
        if self._read == len(self.ids):
            return ""
        window = self._decode(self.ids[self._prefix:])
        before = self._decode(self.ids[self._prefix:self._read])
        new = window[len(before):] if window.startswith(before) else window
        if self.stops and self._cut is None and new:  # the held-back text too: a stop string ends the answer now
            self._find_stop(new)
        if window.endswith("\ufffd") and not final:
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new

    def _find_stop(self, new: str) -> None:
        """A stop string in ``new`` text (or reaching back into the text before it): the fewest ids that hold it,
        by bisection over decodes of prefixes (once per request)."""
        reach = max(map(len, self.stops)) - 1
        tail = self.text[max(0, len(self.text) - reach):] + new
        if any(s in tail for s in self.stops):
            self._cut = cut_at_stop(self.tokenizer, self.ids, list(self.stops))

    def stop_cut(self) -> int | None:
        """How many ids the answer keeps: through the first stop string (kept), or None while none appeared."""
        return self._cut

    def stop_text(self) -> str:
        """The text of the ids :meth:`stop_cut` keeps (all of them while no stop string appeared)."""
        return self._decode(self.ids[:self._cut])


def cut_at_stop(tokenizer: Any, ids: list[int], stops: list[str]) -> int | None:
    """The shortest prefix length of ``ids`` whose text contains a stop string, or None."""
    def hit(n: int) -> bool:
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        return any(s in text for s in stops)

    if not stops or not hit(len(ids)):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hit(mid) else (mid + 1, hi)
    return lo


__all__ = ["TokenText", "cut_at_stop"]
