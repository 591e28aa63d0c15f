"""Writes sft_pairs.jsonl: short instruction/answer pairs from a few templates and word lists,
deterministic, so the dataset in the repository can be regenerated and checked.

    .venv/bin/python examples/data/make_sft_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
       "seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
WORDS = ("apple river stone cloud garden silver window candle forest orange pencil rocket castle dragon "
         "planet bridge flower summer winter market butter yellow purple guitar island jungle kettle ladder "
         "marble needle pepper rabbit saddle tunnel violin walnut zipper anchor basket copper desert engine "
         "falcon ginger hammer igloo jacket").split()
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
             ("open", "closed"), ("early", "late"), ("full", "empty"), ("strong", "weak"), ("young", "old"),
             ("rich", "poor"), ("hard", "soft"), ("high", "low"), ("wet", "dry"), ("long", "short"), ("near", "far"),
             ("clean", "dirty"), ("loud", "quiet"), ("thick", "thin"), ("first", "last"), ("inside", "outside")]
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = ("January February March April May June July August September October November December").split()


def in_words(n: int) -> str:
    if n < 20:
        return ONES[n]
    return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])


def pairs() -> list[dict[str, str]]:
    out = [{"instruction": f"Write the number {n} in words.", "answer": in_words(n)} for n in range(100)]
    for word in WORDS:
        out.append({"instruction": f"Spell the word '{word}' backwards.", "answer": word[::-1]})
        out.append({"instruction": f"Write the word '{word}' in capital letters.", "answer": word.upper()})
        out.append({"instruction": f"How many letters are in the word '{word}'?", "answer": str(len(word))})
    for a, b in OPPOSITES:
        out.append({"instruction": f"What is the opposite of '{a}'?", "answer": b})
        out.append({"instruction": f"What is the opposite of '{b}'?", "answer": a})
    for names in (DAYS, MONTHS):
        for i, name in enumerate(names):
            out.append({"instruction": f"Which comes right after {name}?", "answer": names[(i + 1) % len(names)]})
            out.append({"instruction": f"Which comes right before {name}?", "answer": names[i - 1]})
    random.Random(0).shuffle(out)
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("sft_pairs.jsonl")
    rows = pairs()
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} pairs -> {path}")
