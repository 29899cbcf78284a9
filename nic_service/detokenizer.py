"""Generated token ids -> streamed text deltas, and stop strings over those deltas.

Contract of IncrementalDetokenizer: the deltas of every push() plus flush() concatenate to exactly
`tokenizer.decode(generated_ids, skip_special_tokens=...)`, and every prefix of that concatenation is a
prefix of the final decode (so no delta holds a U+FFFD from a character split across tokens, or any other
text a later token would change).

How: the usual prefix-offset / read-offset technique over a short window of token ids.

    window = ids[prefix_offset:]            (the only ids kept; a few tokens long)
    window[:read] is settled: its text is emitted
    _shown == decode(window[:read]) + what the ids after read show before a character they split

Each new token decodes the window and emits what the decode adds after _shown. Decoding a window
instead of all ids keeps a token at O(window) work; the window starts at a settled boundary and its first
part (window[:read]) has text, so start-of-text effects of the decoder (Metaspace and Strip drop the first
space, WordPiece treats its first token differently) fall on text already emitted, identically in both
decodes, and the difference is exactly what the full decode would add.

A boundary is settled when no later token can change the text before it:
  - the decode does not end in U+FFFD: byte-level decoders decode all bytes at once, lossily, so a trailing
    U+FFFD may be a character whose remaining bytes are still to come. The text before it cannot
    change (UTF-8 decodes a byte sequence's prefix alike), and a byte-level token can end inside a
    character after text of its own (a space and the first byte of "你"): that text is shown at
    once (_shown), so a stop string it completes ends the stream on that token;
  - with a ByteFallback decoder, the last visible token is not a <0xNN> byte token: ByteFallback decodes a
    whole run of byte tokens together and turns *every* byte of the run into U+FFFD when any of it is not
    UTF-8, so even a finished character can still turn into U+FFFD until a normal token closes the run.

Cost: one decode of the window per token (per push when the ids of one push end settled, as they usually
do), and a second one each time the window is re-anchored (moved up to the start of the last emission),
which waits until it holds more than _ANCHOR_AFTER ids: a decode costs mostly its call, so a few more ids in
it are cheaper than a second decode on every token. The window is at most that plus what is held back: a
run of byte tokens is held whole (with ByteFallback an emoji family is 25 of them), so a pathological run of
k undecodable tokens costs O(k) per token until it ends.
"""

import json
from collections.abc import Sequence

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"
_ANCHOR_AFTER = 8  # ids in the window before an emission re-anchors it


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        # No prompt context: the contract is decode(generated ids), as transformers decodes, and
        # prompt context would change the first token's text (Metaspace/Strip decoders drop the
        # leading space only at the start of a decode: decode(["▁Hi"]) == "Hi", after a prompt " Hi").
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._byte_fallback = _has_byte_fallback(tokenizer)
        self._window: list[int] = []  # ids[prefix_offset:]
        self._read = 0  # window[:read] is settled and emitted
        self._shown = ""  # the window's text emitted (decode(window[:read]), and more: _show)
        self._byte_run_open = False  # ByteFallback only: the last visible token is a byte token
        self._finished = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Takes the next generated ids; returns the text they complete (may be empty)."""
        if self._finished:
            raise RuntimeError("push() after flush(): the stream has already ended")
        if len(token_ids) == 1:  # the usual push: one engine step's token
            return self._step(token_ids[0])
        if len(token_ids) > 1 and not self._byte_fallback:
            # Several at once (a stream that was behind): one decode for all when they end settled.
            window = self._window + list(token_ids)
            text = self._decode(window)
            if not text.endswith(_REPLACEMENT):
                return self._settle(window, text)
        # One token at a time, so text settled before a trailing partial character is not held back.
        return "".join(self._step(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """Ends the stream; returns the text still held back (e.g. a U+FFFD that decode() keeps)."""
        if self._finished:
            return ""
        self._finished = True
        text = self._decode(self._window)
        self._check_prefix(text)
        return text[len(self._shown) :]

    def _step(self, token_id: int) -> str:
        window = self._window
        window.append(token_id)
        if self._byte_fallback:
            self._track_byte_run(token_id)
        text = self._decode(window)
        if self._byte_run_open:
            return ""  # not settled yet: the window grows until it is
        if text.endswith(_REPLACEMENT):  # nor this, but the text before the split character is
            return self._show(text.rstrip(_REPLACEMENT))
        return self._settle(window, text)

    def _show(self, final: str) -> str:
        """`final` is the window's decode up to a character its last ids split, which no later token
        changes: returns what it adds to the emitted text (the window stays unsettled)."""
        if len(final) <= len(self._shown):
            return ""
        self._check_prefix(final)
        delta, self._shown = final[len(self._shown) :], final
        return delta

    def _settle(self, window: list[int], text: str) -> str:
        """The window (the current one plus the ids pushed since) decodes to `text`, which is settled:
        returns what it adds to the emitted text, and makes the whole window settled."""
        self._check_prefix(text)
        delta = text[len(self._shown) :]
        if delta and len(window) > _ANCHOR_AFTER:
            # Re-anchor: the ids just emitted (they have text) become the window's settled start.
            # Tokens without text (skipped specials, ids past the vocabulary) cannot anchor one: the window
            # keeps its start, and they are just settled.
            window = window[self._read :]
            self._shown = self._decode(window)
        else:
            self._shown = text  # decode(window[:read]) with read = len(window)
        self._window, self._read = window, len(window)
        return delta

    def _track_byte_run(self, token_id: int) -> None:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is not None and _is_byte_piece(piece):
            self._byte_run_open = True
        elif self._byte_run_open and self._decode([token_id]) != "":
            # A token with text ends the run. Tokens without text (skipped specials, which the decoder
            # never sees) leave it open; a real token that decodes alone to "" (a lone "▁") is treated the
            # same, which only holds text back one token longer.
            self._byte_run_open = False

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _check_prefix(self, text: str) -> None:
        if not text.startswith(self._shown):
            raise RuntimeError(
                f"the tokenizer's decoder changed already settled text ({self._shown!r} became "
                f"{text!r} when more tokens followed); it cannot be decoded incrementally"
            )


def _has_byte_fallback(tokenizer: Tokenizer) -> bool:
    # The decoder's own JSON is small (unlike Tokenizer.to_str(), which holds the whole vocabulary).
    if tokenizer.decoder is None:
        return False
    pending = [json.loads(tokenizer.decoder.__getstate__())]
    while pending:
        decoder = pending.pop()
        if decoder.get("type") == "ByteFallback":
            return True
        pending.extend(decoder.get("decoders", []))
    return False


def _is_byte_piece(piece: str) -> bool:
    # The same test the ByteFallback decoder applies to a token: "<0xNN>" with NN hexadecimal.
    if len(piece) != 6 or not piece.startswith("<0x") or not piece.endswith(">"):
        return False
    try:
        int(piece[3:5], 16)
    except ValueError:
        return False
    return True


class StopStringMatcher:
    """Cuts a text stream before the first stop string, holding back only text that could start one.

    The stream ends at the first feed() after which a stop string is complete, as vLLM and OpenAI
    end generation on the token that completes a stop (the server feeds a token's text at a time):
    a longer stop that started earlier and could still complete is not waited for. Of the stops
    complete then, the one that starts earliest wins (ties: the longest), so the text returned
    never holds a whole stop string. Text that could be the start of a stop is held back until it
    is not; flush() returns it when the stream ends first.
    """

    def __init__(self, stops: Sequence[str]):
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not a single string")
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self._stops = tuple(dict.fromkeys(stops))  # unique, in the caller's order
        self._pending = ""  # held back: it may be the start of a stop string
        self.matched: str | None = None  # the stop string that ended the stream, once known
        self._finished = False

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, matched stop string or None). Call no more once matched."""
        if self.matched is not None or self._finished:
            raise RuntimeError("feed() after the stream ended (a stop string matched, or flush() was called)")
        buf = self._pending + text
        match = self._earliest_match(buf)
        if match is not None:
            start, stop = match
            self._pending = ""
            self.matched = stop
            return buf[:start], stop
        cut = self._first_partial(buf)
        if cut is None:
            cut = len(buf)
        self._pending = buf[cut:]
        return buf[:cut], None

    def flush(self) -> str:
        """Ends the stream; returns the held-back text (cut before a stop that matched, see `matched`)."""
        if self._finished:
            return ""
        self._finished = True
        buf, self._pending = self._pending, ""
        return buf  # partial matches only (a complete one ended the stream in feed)

    def _earliest_match(self, buf: str) -> tuple[int, str] | None:
        # (start, stop) of the occurrence starting earliest, the longest stop on a tie.
        found = [(buf.find(stop), -len(stop), stop) for stop in self._stops]
        found = [entry for entry in found if entry[0] >= 0]
        if not found:
            return None
        start, _, stop = min(found)
        return start, stop

    def _first_partial(self, buf: str) -> int | None:
        # The smallest i such that buf[i:] is a proper prefix of some stop: text from i on may start a stop.
        longest = max(len(stop) for stop in self._stops) if self._stops else 0
        for start in range(max(0, len(buf) - longest + 1), len(buf)):
            tail = buf[start:]
            if any(len(stop) > len(tail) and stop.startswith(tail) for stop in self._stops):
                return start
        return None
