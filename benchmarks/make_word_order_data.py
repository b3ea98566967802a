"""A word-order task made from GLUE SST-2's sentences, as an own-data folder (docs/own-data.md) for
``luna-convert run --data-dir``: is this sentence in its original order (label 1), or has it been shuffled a
little (label 0: two words swapped, or a clause moved to the front)?

Sentiment can mostly be read from a bag of words; this task cannot, so it tells whether a converted model
still uses token order. Every source sentence gives one example, originals and changed ones alternating after a
seeded shuffle (balanced); a changed sentence differs from its original and from every original. The dev split
is made from SST-2's dev.tsv, the train split from train.tsv less every sentence that is also in dev (SST-2's
train holds phrases of the same reviews): no sentence appears in both splits. Only sentences of at least
``--min-words`` words are used.

    python benchmarks/make_word_order_data.py ../shared/data/glue/SST-2 outputs/word-order/data
    luna-convert run --model PATH --data-dir outputs/word-order/data --method luna

Writes OUT_DIR/train.tsv and OUT_DIR/dev.tsv (header ``sentence<TAB>label``).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

CLAUSE_MARKS = (",", ";", "--", "but", "and", "because", "while", "although", "though", "so")


def read_sentences(path: Path, min_words: int) -> list[str]:
    """The distinct sentences of a GLUE TSV's ``sentence`` column (first seen first), whitespace normalised."""
    header, *rows = path.read_text(encoding="utf-8").splitlines()
    column = header.split("\t").index("sentence")
    seen: dict[str, None] = {}
    for row in rows:
        cells = row.split("\t")
        if len(cells) > column:
            sentence = " ".join(cells[column].split())
            if len(sentence.split()) >= min_words:
                seen.setdefault(sentence, None)
    return list(seen)


def swap_two_words(words: list[str], rng: random.Random) -> list[str] | None:
    """``words`` with two different words at two random positions exchanged (None: every word is the same)."""
    if len(set(words)) < 2:
        return None
    while True:
        i, j = sorted(rng.sample(range(len(words)), 2))
        if words[i] != words[j]:
            out = list(words)
            out[i], out[j] = out[j], out[i]
            return out


def move_clause(words: list[str], rng: random.Random) -> list[str] | None:
    """The part after a clause mark (a comma, ``but``, ``because``, ...) moved to the front, the mark kept
    between the two parts: "A , B" -> "B , A" (None: no mark with words on both sides)."""
    marks = [i for i, w in enumerate(words) if w.lower() in CLAUSE_MARKS and 0 < i < len(words) - 1]
    if not marks:
        return None
    i = rng.choice(marks)
    return words[i + 1:] + [words[i]] + words[:i]


def change_order(sentence: str, rng: random.Random) -> str | None:
    """The sentence with its word order changed: a clause moved (where it has one, half of the time) or two words
    swapped; None when no change gives a different sentence."""
    words = sentence.split()
    ways = [move_clause, swap_two_words] if rng.random() < 0.5 else [swap_two_words]
    for way in ways:
        changed = way(words, rng)
        if changed is not None and changed != words:
            return " ".join(changed)
    return None


def make_split(sentences: list[str], rng: random.Random, originals: set[str],
               limit: int | None) -> list[tuple[str, int]]:
    """One example per sentence, alternately the original (1) and a changed one (0) after a shuffle; a sentence
    whose change would equal an original (or give nothing) is left out, keeping the two labels balanced."""
    order = list(sentences)
    rng.shuffle(order)
    rows: list[tuple[str, int]] = []
    counts = [0, 0]
    for sentence in order:
        if limit is not None and len(rows) >= limit:
            break
        label = 0 if counts[0] < counts[1] else 1
        if label:
            rows.append((sentence, 1))
        else:
            changed = change_order(sentence, rng)
            if changed is None or changed in originals:
                continue
            rows.append((changed, 0))
        counts[label] += 1
    if counts[0] != counts[1]:  # an odd count: the last original goes
        rows.pop()
    return rows


def write_tsv(path: Path, rows: list[tuple[str, int]]) -> None:
    path.write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows), encoding="utf-8")


def make_word_order_data(src: Path, out: Path, seed: int = 0, min_words: int = 5, max_train: int | None = None,
                         max_dev: int | None = None) -> dict[str, int]:
    """Write the train and dev splits into ``out``; returns each split's example count."""
    dev = read_sentences(src / "dev.tsv", min_words)
    dev_set = set(dev)
    train = [s for s in read_sentences(src / "train.tsv", min_words) if s not in dev_set]
    originals = dev_set | set(train)
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, sentences, limit in (("dev", dev, max_dev), ("train", train, max_train)):
        rows = make_split(sentences, rng, originals, limit)
        write_tsv(out / f"{name}.tsv", rows)
        counts[name] = len(rows)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="a GLUE SST-2 folder (train.tsv, dev.tsv)")
    parser.add_argument("out", type=Path, help="the folder to write train.tsv and dev.tsv into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-words", type=int, default=5)
    parser.add_argument("--max-train", type=int, default=None, help="at most this many train examples")
    parser.add_argument("--max-dev", type=int, default=None, help="at most this many dev examples")
    args = parser.parse_args()
    counts = make_word_order_data(args.src, args.out, args.seed, args.min_words, args.max_train, args.max_dev)
    print(f"wrote {args.out}: " + ", ".join(f"{n} {name} examples (half original)" for name, n in counts.items()))


if __name__ == "__main__":
    main()
