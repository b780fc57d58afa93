import pytest

from diffusion_rl.rewards.text_match import (
    levenshtein,
    normalize_text,
    quoted_text,
    target_text,
    text_match_score,
)


def test_normalize_drops_all_whitespace_and_lowercases():
    assert normalize_text(" Open\tLATE\n 24/7 ") == "openlate24/7"


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ('A sign that says "OPEN LATE" in red', "OPEN LATE"),
        ('Two signs: "FIRST" and "SECOND"', "FIRST"),
        ("A mug with “Good Morning” on it", "Good Morning"),
        ('An empty "" pair, then "TEXT"', "TEXT"),
        ("no quotes here", None),
        ('one lone " quote', None),
    ],
)
def test_quoted_text_is_the_first_quoted_string(prompt, expected):
    assert quoted_text(prompt) == expected


def test_target_prefers_ground_truth_and_falls_back_to_the_quote():
    prompt = 'A sign that says "FROM PROMPT"'
    assert target_text(prompt, {"ground_truth": "FROM METADATA"}) == "FROM METADATA"
    assert target_text(prompt, {"ground_truth": "  "}) == "FROM PROMPT"
    assert target_text(prompt, {}) == "FROM PROMPT"
    assert target_text("no quotes", {}) is None
    assert target_text('blank " " quote', {}) is None


@pytest.mark.parametrize(
    "a, b, distance",
    [("kitten", "sitting", 3), ("", "abc", 3), ("abc", "", 3), ("flaw", "lawn", 2), ("same", "same", 0)],
)
def test_levenshtein_known_values(a, b, distance):
    assert levenshtein(a, b) == distance
    assert levenshtein(b, a) == distance


def test_score_is_one_when_the_target_is_inside_the_recognised_text():
    assert text_match_score("WELCOME! Open Late today", "open late") == 1.0


def test_score_is_one_minus_distance_over_target_length():
    # "openlake" vs "openlate": one substitution, target length 8
    assert text_match_score("OPEN LAKE", "OPEN LATE") == pytest.approx(1 - 1 / 8)
    # "hello" vs "help": substitute l->p, delete o: distance 2, target length 4
    assert text_match_score("HELLO", "HELP") == pytest.approx(0.5)


def test_score_clamps_the_distance_at_the_target_length():
    assert text_match_score("a very long unrelated transcription", "ok") == 0.0
    assert text_match_score("", "abc") == 0.0


def test_score_rejects_a_target_without_visible_characters():
    with pytest.raises(ValueError, match="no visible character"):
        text_match_score("anything", " \t")
