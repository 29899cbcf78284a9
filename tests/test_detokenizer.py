"""IncrementalDetokenizer and StopStringMatcher against their oracles.

The detokenizer's oracle is the tokenizers library itself: streamed deltas must concatenate to
tokenizer.decode(ids), and every streamed prefix must be a prefix of it. The tokenizers are trained here
on a small multilingual corpus, one per decoder family: byte-level BPE (GPT-2 / Llama-3 / Qwen style) and
SentencePiece-style BPE with <0xNN> byte fallback (Llama-2 / Mistral style, two decoder variants).
"""

import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from blink.nic_service.detokenizer import IncrementalDetokenizer, StopStringMatcher

CORPUS = """The quick brown fox jumps over the lazy dog. Streaming text to clients, token by token.
Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Äpfel und Öl.
Le cœur a ses raisons que la raison ne connaît point. Café, naïve, déjà vu, garçon.
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир!
快速的棕色狐狸跳过了懒狗。你好，世界！我们喜欢机器学习和语言模型。
素早い茶色の狐がのろまな犬を飛び越える。こんにちは世界。
빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요.
Οι γρήγορες καφέ αλεπούδες. Γειά σου κόσμε. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया।
Emoji: 😀 👍 🎉 🚀 ❤️ 🇩🇪 👍🏽 👩‍💻. Numbers 0123456789 and symbols: ()[]{}<>+-*/=%$#@!?
"""

# Text the tokenizers must round-trip when encoded and streamed back, much of it outside their vocabulary.
ROUND_TRIP_TEXTS = [
    "Hello, world! The fox jumps.",
    "你好，世界！机器学习",
    "龍の子は龍。鬱蒼とした森",
    "family 👩‍👩‍👧‍👦 and 👨‍👩‍👧 ZWJ sequences",
    "thumbs 👍🏻👍🏼👍🏽👍🏾👍🏿 skin tones, flags 🇯🇵🇺🇦",
    "combining: e\u0301 a\u0300 n\u0303 o\u0308\u0304 Tiếng Việt",
    "Devanagari नमस्ते, Hangul 한국어, Thai ภาษาไทย, Arabic العربية",
    "  leading spaces\tand\nnewlines\n\n  end  ",
    "math 𝔸𝔹ℂ ∀x∈ℝ, music 𝄞, ancient 𐎀𐎁",
    "\ufffd a literal replacement char",
]

SPECIALS = ["<unk>", "<s>", "</s>"]


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    return tok


def _sentencepiece_style(decoder) -> Tokenizer:
    # Train merges on a small alphabet, then rebuild the model with the 256 <0xNN> pieces in its vocabulary
    # (as in Llama-2: real vocabulary entries, not added tokens), so characters it has not seen fall back
    # to byte pieces.
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, limit_alphabet=100, show_progress=False)
    trained.train_from_iterator([CORPUS], trainer)
    pieces = SPECIALS + [f"<0x{b:02X}>" for b in range(256)]
    learned = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    pieces += [piece for piece, _ in learned if piece not in SPECIALS]
    merges = [tuple(pair) for pair in _model_json(trained)["merges"]]
    model = models.BPE(
        vocab={piece: i for i, piece in enumerate(pieces)}, merges=merges, unk_token="<unk>", byte_fallback=True
    )
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoder
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tok


def _model_json(tok: Tokenizer) -> dict:
    return json.loads(tok.to_str())["model"]


TOKENIZERS = {
    "byte_level": _byte_level,
    # Llama-2's tokenizer.json decoder.
    "llama2": lambda: _sentencepiece_style(
        decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    ),
    # Newer SentencePiece conversions: Metaspace drops the space of the first token only.
    "metaspace": lambda: _sentencepiece_style(
        decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    ),
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tok(request) -> Tokenizer:
    return TOKENIZERS[request.param]()


def _byte_piece_ids(tok: Tokenizer) -> list[int]:
    # The 256 single-byte tokens, whatever the family spells them as.
    return [_byte_id(tok, b) for b in range(256)]


def _special_ids(tok: Tokenizer) -> list[int]:
    return [i for i, added in tok.get_added_tokens_decoder().items() if added.special]


def _random_ids(rng: random.Random, tok: Tokenizer, length: int) -> list[int]:
    # A mix that stresses the decoder: arbitrary ids, lone bytes (many of them pieces of multi-byte
    # characters), whole characters split into their byte pieces, special tokens, ids past the vocabulary
    # (an engine's padded embedding rows; decode() ignores them), and ordinary text.
    byte_ids, specials = _byte_piece_ids(tok), _special_ids(tok)
    vocab = tok.get_vocab_size()
    ids: list[int] = []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.02:
            ids.append(vocab + rng.randrange(64))
        elif kind < 0.25:
            ids.append(rng.randrange(vocab))
        elif kind < 0.45:
            ids.append(rng.choice(byte_ids))
        elif kind < 0.6:
            ids.append(rng.choice(specials))
        elif kind < 0.8:
            char = rng.choice("中é😀👍🏽ञ한\u0301𝄞")
            ids.extend(_byte_id(tok, b) for b in char.encode())
        else:
            ids.extend(tok.encode(rng.choice(ROUND_TRIP_TEXTS)[: rng.randrange(1, 12)], add_special_tokens=False).ids)
    return ids[:length]


def _byte_id(tok: Tokenizer, byte: int) -> int:
    # The token of one byte: "<0xNN>" with byte fallback, else GPT-2's printable stand-in for the byte.
    fallback = tok.token_to_id(f"<0x{byte:02X}>")
    return fallback if fallback is not None else tok.token_to_id(_BYTES_TO_UNICODE[byte])


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-ins for bytes, as the ByteLevel pre-tokenizer uses them.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTES_TO_UNICODE = _bytes_to_unicode()


def _stream(tok: Tokenizer, ids: list[int], rng: random.Random, skip_special_tokens: bool = True):
    """Pushes ids in random chunks of 1-5; returns (deltas, final decode) after checking every prefix."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    final = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    deltas, emitted, i = [], "", 0
    while i < len(ids):
        n = rng.randint(1, 5)
        delta = detok.push(ids[i : i + n])
        i += n
        deltas.append(delta)
        emitted += delta
        # Never emits text the final decode does not have at that place (a U+FFFD of a split character,
        # a byte run that a later byte turns into U+FFFD, a dropped or doubled space).
        assert final.startswith(emitted), (ids[:i], emitted, final)
    deltas.append(detok.flush())
    return deltas, final


def test_random_ids_stream_to_exact_decode(tok):
    rng = random.Random(1234)
    for trial in range(1000):
        ids = _random_ids(rng, tok, rng.randint(0, 60))
        skip = trial % 4 != 0  # mostly the server's setting, sometimes keeping special tokens
        deltas, final = _stream(tok, ids, rng, skip_special_tokens=skip)
        assert "".join(deltas) == final, ids


def test_long_random_stream_does_not_drift(tok):
    rng = random.Random(99)
    ids = _random_ids(rng, tok, 3000)
    deltas, final = _stream(tok, ids, rng)
    assert "".join(deltas) == final


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_encoded_text_streams_back_unchanged(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    if tok.decode(ids) != text:
        pytest.skip("the tokenizer does not round-trip this text (e.g. unknown characters)")
    rng = random.Random(len(text))
    for _ in range(10):
        deltas, _ = _stream(tok, ids, rng)
        assert "".join(deltas) == text
    # Hold back only the incomplete: a delta never has a replacement character the text does not have.
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


def test_round_trip_texts_are_mostly_covered(tok):
    # The round-trip test skips texts a tokenizer cannot reproduce; make sure that is rare.
    covered = sum(tok.decode(tok.encode(t, add_special_tokens=False).ids) == t for t in ROUND_TRIP_TEXTS)
    assert covered >= len(ROUND_TRIP_TEXTS) - 1


def test_split_character_is_held_back_until_complete(tok):
    ids = [_byte_id(tok, b) for b in "中😀".encode()]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids] + [detok.push(tok.encode("ok", add_special_tokens=False).ids)]
    assert "".join(deltas) + detok.flush() == tok.decode(ids + tok.encode("ok", add_special_tokens=False).ids)
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[:2] == ["", ""]


def test_byte_level_holds_back_only_the_unfinished_character():
    """Byte-level BPE merges across character boundaries (" \\xe4", "na\\xce": a letter and the
    first byte of the next one). Such a token's text before its split character is final, so it
    is emitted with that token: the whole token was held back, and a stop string it completes
    ended the stream a token or more late, counting tokens after the one that completed it. After
    every push the stream is the decode so far less only its trailing U+FFFD (the unfinished
    character; a literal U+FFFD there is held back too, until the next character)."""
    tok = TOKENIZERS["byte_level"]()
    straddling = [i for i in range(tok.get_vocab_size())
                  if tok.decode([i]).endswith("\ufffd") and tok.decode([i]).rstrip("\ufffd")]
    assert straddling  # the trained vocabulary has such merges
    rng = random.Random(7)
    for trial in range(200):
        ids = _random_ids(rng, tok, rng.randint(1, 40))
        ids[rng.randrange(len(ids))] = rng.choice(straddling)
        detok, emitted, i = IncrementalDetokenizer(tok), "", 0
        while i < len(ids):
            n = rng.randint(1, 3)
            emitted += detok.push(ids[i : i + n])
            i += n
            assert emitted == tok.decode(ids[:i]).rstrip("\ufffd"), ids[:i]
        assert emitted + detok.flush() == tok.decode(ids)


def test_flush_emits_invalid_bytes_that_decode_keeps(tok):
    ids = [_byte_id(tok, 0xE4), _byte_id(tok, 0xB8)]  # the first two of three bytes of "中"
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids) == ""
    tail = detok.flush()
    assert tail == tok.decode(ids) and "\ufffd" in tail


def test_first_token_space_matches_decode_of_generated_ids(tok):
    # Metaspace-style decoders drop the first token's space in decode(); the stream must do the same
    # for a continuation, since the contract is decode(generated ids).
    prompt = tok.encode("The quick", add_special_tokens=False).ids
    generated = tok.encode("The quick brown fox", add_special_tokens=False).ids[len(prompt) :]
    detok = IncrementalDetokenizer(tok)
    text = detok.push(generated) + detok.flush()
    assert text == tok.decode(generated)


def test_push_after_flush_is_an_error(tok):
    detok = IncrementalDetokenizer(tok)
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.push([1])


class _CountingTokenizer:
    """Passes calls through to a tokenizer, recording how many ids each decode() got."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self.decode_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.decode_lengths.append(len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_cost_per_token_is_bounded_by_the_window(tok):
    text = " ".join(ROUND_TRIP_TEXTS[:7]) * 20
    ids = tok.encode(text, add_special_tokens=False).ids
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    streamed = "".join(detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert streamed == tok.decode(ids)
    assert len(ids) > 1000
    # A window spans the previous emission plus what is held back: a character's byte pieces, or with byte
    # fallback a whole run of byte tokens (a ZWJ emoji family is 25 of them); never the whole stream.
    byte_ids = set(_byte_piece_ids(tok))
    longest_run = run = 0
    for i in ids:
        run = run + 1 if i in byte_ids else 0
        longest_run = max(longest_run, run)
    assert max(counting.decode_lengths) <= 2 * max(longest_run, 4) + 4
    assert len(counting.decode_lengths) <= 3 * len(ids)


# --- StopStringMatcher ------------------------------------------------------------------------------------


def _feed_all(matcher: StopStringMatcher, chunks: list[str]) -> tuple[str, str | None]:
    out = []
    for chunk in chunks:
        text, stop = matcher.feed(chunk)
        out.append(text)
        if stop is not None:
            return "".join(out), stop
    out.append(matcher.flush())
    return "".join(out), matcher.matched


def test_stop_spanning_several_deltas_is_never_emitted():
    for chunks in (["Hello wo", "rld<|e", "nd|>", " more"], ["Hello world<", "|", "end", "|> more"]):
        matcher = StopStringMatcher(["<|end|>"])
        emitted = []
        for chunk in chunks:
            text, stop = matcher.feed(chunk)
            emitted.append(text)
            assert "<" not in "".join(emitted)
            if stop:
                break
        assert "".join(emitted) == "Hello world" and stop == "<|end|>"


def test_stop_at_the_very_beginning():
    assert StopStringMatcher(["###"]).feed("### rest") == ("", "###")
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("#") == ("", None)
    assert matcher.feed("##x") == ("", "###")


def test_nothing_is_held_back_when_no_stop_could_start():
    matcher = StopStringMatcher(["STOP", "\n\n"])
    assert matcher.feed("hello world") == ("hello world", None)
    assert matcher.feed("ok\n") == ("ok", None)  # "\n" may start "\n\n"
    assert matcher.feed("x ST") == ("\nx ", None)  # "ST" may start "STOP"
    assert matcher.feed("AR") == ("STAR", None)
    assert matcher.flush() == ""
    assert matcher.matched is None


def test_held_back_text_is_returned_by_flush():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("the end ST") == ("the end ", None)
    assert matcher.flush() == "ST"
    assert matcher.matched is None


def test_overlapping_stops_earliest_start_wins():
    assert StopStringMatcher(["bc", "ab"]).feed("xabc") == ("x", "ab")
    matcher = StopStringMatcher(["bc", "ab"])
    assert matcher.feed("xa") == ("x", None)
    assert matcher.feed("bc") == ("", "ab")


def test_a_complete_stop_ends_the_stream_though_a_longer_one_could_still_complete():
    # "bc" is complete in "abc"; "abcd", which starts earlier, is not waited for (as vLLM stops
    # on the token that completes a stop); text that may start a stop is still held back
    assert StopStringMatcher(["bc", "abcd"]).feed("xabc") == ("xa", "bc")
    matcher = StopStringMatcher(["bc", "abcd"])
    assert matcher.feed("xab") == ("x", None)
    assert matcher.feed("cd") == ("", "abcd")  # both complete: the earlier start wins
    matcher = StopStringMatcher(["bc", "abcd"])
    assert matcher.feed("xa") == ("x", None)
    assert matcher.flush() == "a" and matcher.matched is None


def test_stops_that_are_prefixes_of_each_other():
    assert StopStringMatcher(["ab", "abc"]).feed("zabcz") == ("z", "abc")  # a tie: the longest
    for stops in (["ab", "abc"], ["abc", "ab"]):
        matcher = StopStringMatcher(stops)
        assert matcher.feed("za") == ("z", None)
        assert matcher.feed("b") == ("", "ab")  # complete: "abc" is not waited for


def test_repeated_partial_matches():
    matcher = StopStringMatcher(["aab"])
    assert matcher.feed("a") == ("", None)
    assert matcher.feed("a") == ("", None)
    assert matcher.feed("a") == ("a", None)  # "aaa": only the last "aa" can still start "aab"
    assert matcher.feed("b") == ("", "aab")
    assert _feed_all(StopStringMatcher(["aab"]), list("aaaab")) == ("aa", "aab")
    assert _feed_all(StopStringMatcher(["abab"]), ["a", "ab", "ab"]) == ("a", "abab")


def test_unicode_stops():
    assert _feed_all(StopStringMatcher(["。\n"]), ["你好", "。", "\n再见"]) == ("你好", "。\n")
    assert _feed_all(StopStringMatcher(["👩‍💻"]), ["hi 👩", "\u200d", "💻 there"]) == ("hi ", "👩‍💻")
    assert _feed_all(StopStringMatcher(["e\u0301"]), ["caf", "e", "\u0301!"]) == ("caf", "e\u0301")


def test_feed_after_match_is_an_error():
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax") == ("a", "x")
    with pytest.raises(RuntimeError):
        matcher.feed("more")
    assert matcher.flush() == ""


def test_invalid_stops_are_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])
    with pytest.raises(TypeError):
        StopStringMatcher("stop")


def test_no_stops_passes_everything_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


def _oracle(chunks: list[str], stops: list[str]) -> tuple[str, str | None]:
    """The stream ends at the first chunk after which some stop is complete; of those complete
    then, the earliest start (ties: the longest) says where the text ends."""
    full = ""
    for chunk in chunks:
        full += chunk
        found = [(full.find(s), -len(s), s) for s in stops if full.find(s) >= 0]
        if found:
            start, _, stop = min(found)
            return full[:start], stop
    return full, None


def test_random_chunking_matches_find_oracle():
    rng = random.Random(7)
    for _ in range(2000):
        full = "".join(rng.choice("aab c中") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("ab c中") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(full) + 1), rng.randint(0, min(6, len(full) + 1))))
        chunks = [full[a:b] for a, b in zip([0] + cuts, cuts + [len(full)])]
        matcher = StopStringMatcher(stops)
        emitted = []
        for chunk in chunks:
            text, stop = matcher.feed(chunk)
            emitted.append(text)
            if stop is not None:
                break
        else:
            emitted.append(matcher.flush())
        assert ("".join(emitted), matcher.matched) == _oracle(chunks, stops), (full, stops,
                                                                              chunks)
        if len(stops) == 1:  # one stop: where the stream is cut does not matter
            assert "".join(emitted) == (full[: full.find(stops[0])] if stops[0] in full else full)


# StopStringMatcher holds back exactly the text that could still start a stop string, after
# every feed (a brute-force oracle over the whole text so far); the stream ends once.
def _held_from(full: str, stops: list[str]) -> int:
    """Where the held-back tail starts: the smallest i such that full[i:] is a proper prefix of
    some stop (len(full) when none is)."""
    for i in range(len(full)):
        tail = full[i:]
        if any(len(s) > len(tail) and s.startswith(tail) for s in stops):
            return i
    return len(full)


def test_after_every_feed_exactly_the_possible_start_of_a_stop_is_held_back():
    rng = random.Random(8)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 5)))
                 for _ in range(rng.randint(1, 3))]
        matcher, full, emitted = StopStringMatcher(stops), "", ""
        for _ in range(rng.randint(1, 8)):
            chunk = "".join(rng.choice("aab cx") for _ in range(rng.randint(0, 4)))
            full += chunk
            text, stop = matcher.feed(chunk)
            emitted += text
            if stop is not None:
                break
            assert emitted == full[:_held_from(full, stops)], (stops, full, emitted)
        else:
            emitted += matcher.flush()
            assert emitted == full


def test_the_longest_proper_prefix_of_a_stop_is_held_back_and_nothing_else():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go STO") == ("go ", None)  # 3 of 4 characters: all held
    assert matcher.feed("x") == ("STOx", None)
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("SX") == ("SX", None)  # "S" then "X" cannot start "STOP"
    matcher = StopStringMatcher(["<|end|>", "\n\n"])
    assert matcher.feed("a<|end") == ("a", None)
    assert matcher.feed("|") == ("", None)
    assert matcher.feed("!") == ("<|end|!", None)


@pytest.mark.parametrize("family", sorted(TOKENIZERS))
def test_the_stream_ends_once_and_adds_up_to_the_decode(family):
    """flush() ends the stream: a second flush() adds nothing, so the concatenation of every
    delta and every flush() is still tokenizer.decode(ids) (here two of the three bytes of "中",
    which decode() keeps as U+FFFD, held back until the end)."""
    tok = TOKENIZERS[family]()
    ids = (tok.encode("Hi ", add_special_tokens=False).ids
           + [_byte_id(tok, 0xE4), _byte_id(tok, 0xB8)])
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push([i]) for i in ids)
    text += detok.flush()
    text += detok.flush()
    assert text == tok.decode(ids) and text.endswith("\ufffd")


class _Counting:
    """A tokenizer whose decode() records how many ids it was given."""

    def __init__(self, tok):
        self._tok, self.lengths = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.mark.parametrize("family", sorted(TOKENIZERS))
def test_an_invalid_byte_mid_stream_settles_and_the_window_stays_short(family):
    """A lone continuation byte decodes to U+FFFD for good (invalid UTF-8, not a character still
    arriving): once text follows it the window settles as usual, so each token still costs a
    decode of a few ids, not of everything since the bad byte; the stream is still exactly
    tokenizer.decode(ids)."""
    tok = TOKENIZERS[family]()
    text_ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 20,
                          add_special_tokens=False).ids
    ids = text_ids[:3] + [_byte_id(tok, 0x80)] + text_ids[3:]
    counting = _Counting(tok)
    detok = IncrementalDetokenizer(counting)
    streamed = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert streamed == tok.decode(ids) and "\ufffd" in streamed
    assert len(ids) > 100 and max(counting.lengths) <= 12
