"""A user's own data, written for the tests from a few words, seeded: prompt/completion pairs, labelled rows,
plain text."""

from __future__ import annotations

import json
import random

WORDS = "the cat sat on a mat while dogs ran in the park and birds sang over green hills".split()


def write_pairs(path, n: int = 64, seed: int = 0):
    """Prompt/completion pairs of unlike lengths (some completions cut off at the sequence's end)."""
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": " ".join(r.choices(WORDS, k=r.randint(2, 14))),
                                "completion": " ".join(r.choices(WORDS, k=r.randint(1, 10)))}) + "\n")
    return path


def write_labelled(path, n: int = 48, labels: int = 3, seed: int = 0):
    """Texts of unlike lengths with a label each (a regression's: a number)."""
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            label = r.randrange(labels) if labels > 1 else r.uniform(-1, 1)
            f.write(json.dumps({"text": " ".join(r.choices(WORDS, k=r.randint(2, 30))), "label": label}) + "\n")
    return path


def text_file(path, lines: int, seed: int):
    """``lines`` paragraphs of 5-40 words."""
    r = random.Random(seed)
    path.write_text("\n\n".join(" ".join(r.choices(WORDS, k=r.randint(5, 40))) for _ in range(lines)))
    return path
