"""`levenshtein` (rapidfuzz) against the textbook dynamic programme, on random strings with non-ASCII characters."""

import random

from diffusion_rl.rewards.text_match import levenshtein


def _edit_distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def test_levenshtein_equals_the_dynamic_programme():
    rng = random.Random(0)
    for _ in range(3000):
        a = "".join(rng.choice("abcé漢 0") for _ in range(rng.randint(0, 14)))
        b = "".join(rng.choice("abcé漢 0") for _ in range(rng.randint(0, 14)))
        assert levenshtein(a, b) == _edit_distance(a, b), (a, b)
