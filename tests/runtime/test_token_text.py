"""TokenText: the text of a request's tokens as they come, and its stop strings, at a cost per token that does not
grow with the answer."""

import random

import pytest

from rolecall.runtime.engine.text import TokenText, cut_at_stop

SPECIAL = 256  # an id past the bytes: skipped in the text, as skip_special_tokens does


class Bytes:
    """A byte-level tokenizer: an id is a byte, a character of several bytes spans ids (and decodes to U+FFFD
    while cut); it counts the ids it decodes."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=False):
        self.decoded += len(ids)
        return bytes(i for i in ids if i < SPECIAL).decode("utf-8", errors="replace")


TEXTS = ["plain ascii words", "héllo wörld ñ", "数学 问题 の 答え", "emoji 🙂 and 🚀 here", "a\n\nb END c", "ß🙂数"]


@pytest.mark.parametrize("seed", range(20))
def test_the_pieces_join_to_the_text_of_all_the_tokens_in_any_split(seed):
    rng = random.Random(seed)
    text = rng.choice(TEXTS) * rng.randint(1, 3)
    ids = list(text.encode())
    ids.insert(rng.randrange(len(ids) + 1), SPECIAL)
    tt, pieces, i = TokenText(Bytes()), [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        pieces.append(tt.add(ids[i:i + n]))
        assert "\ufffd" not in pieces[-1]  # a cut character waits for its other bytes
        i += n
    pieces.append(tt.add([], final=True))
    assert "".join(pieces) == tt.text == text


def test_a_cut_character_at_the_end_goes_out_when_final():
    tt = TokenText(Bytes())
    assert tt.add(list(b"ok ")) == "ok "
    assert tt.add(list("é".encode())[:1]) == ""  # half a character waits
    assert tt.add([], final=True) == "\ufffd"
    assert tt.text == "ok \ufffd"


@pytest.mark.parametrize("seed", range(20))
def test_the_stop_cut_is_the_fewest_tokens_that_hold_the_first_stop_string(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(["ab", "é", "\n", "END", "🙂", " x"]) for _ in range(30))
    stops = ["\n\n", "END"]
    ids = list(text.encode())
    tt, i = TokenText(Bytes(), stops), 0
    while i < len(ids) and tt.stop_cut() is None:
        n = rng.randint(1, 5)
        tt.add(ids[i:i + n])
        i += n
    tt.add([], final=True)
    assert tt.stop_cut() == cut_at_stop(Bytes(), ids, stops)
    if tt.stop_cut() is not None:
        kept = bytes(ids[:tt.stop_cut()]).decode("utf-8", errors="replace")
        assert any(kept.endswith(s) for s in stops)  # the token that completes the stop string ends the answer


def test_decoding_costs_the_same_per_token_late_in_a_long_answer():
    """16,000 tokens added four at a time decode about two windows each: linear in the answer, where decoding
    everything at every delivery would decode 32 million ids."""
    tok = Bytes()
    tt = TokenText(tok, ["never appears"])
    ids = list(("word " * 3200).encode())
    for i in range(0, len(ids), 4):
        tt.add(ids[i:i + 4])
    assert tt.text == "word " * 3200 and tt.stop_cut() is None
    assert tok.decoded <= 3 * len(ids)
