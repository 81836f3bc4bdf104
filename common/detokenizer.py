"""Incremental detokenization and stop strings for one request (torch-free)."""

from __future__ import annotations

from collections.abc import Callable

Decode = Callable[[list[int]], str]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Decodes a short window of recent tokens and emits what it adds beyond the previous window, so
    multi-token characters (a UTF-8 sequence split over byte-level tokens) appear only once
    complete. Stop strings are cut off; up to len(longest stop) - 1 trailing characters are held
    back until it is certain they do not start a stop string.
    """

    def __init__(self, decode: Decode, stop: list[str] | None = None) -> None:
        self._decode = decode
        self._stop = list(stop or [])
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def add(self, token_ids: list[int]) -> None:
        """Account for new token ids (token_ids is the whole output so far)."""
        prefix_text = self._decode(token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(token_ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        new_text = window_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        search_from = max(0, len(self.text) - self._hold)
        self.text += new_text
        for stop in self._stop:
            at = self.text.find(stop, search_from)
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
                search_from = 0  # an earlier stop may now be the first; text is already cut

    def take(self, final: bool) -> str:
        """Text not yet handed out; keeps back a possible stop-string prefix unless final."""
        end = len(self.text) if (final or self.stopped) else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
