"""ListOps (Long Range Arena): nested prefix expressions over digits, label = the expression's value.

Written from the published task description (Nangia and Bowman 2018; Tay et al. 2020): operators MAX, MIN,
MED (median) and SM (sum modulo 10) over the digits 0-9, trees of depth at most ``max_depth`` with at most
``max_args`` arguments per operator, brackets kept as tokens, e.g. ``[MAX 4 3 [MIN 2 3 ] 1 0 ]`` -> 4.
Only expressions whose token count lies in [``min_length``, ``max_length``] are kept (500-2,000 in LRA).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

OPERATORS = ("[MAX", "[MIN", "[MED", "[SM")
CLOSE = "]"
DIGITS = tuple(str(d) for d in range(10))
# id 0 is padding; the attention mask marks real tokens, so no id needs to be reserved for anything else
VOCAB = ("<pad>", *DIGITS, *OPERATORS, CLOSE)
TOKEN_ID = {token: i for i, token in enumerate(VOCAB)}
NUM_CLASSES = 10


def median_value(values: list[int]) -> int:
    """The median, rounded down when the count is even (the floor of the two middle values' mean)."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) // 2


def apply_operator(op: str, values: list[int]) -> int:
    if op == "[MAX":
        return max(values)
    if op == "[MIN":
        return min(values)
    if op == "[MED":
        return median_value(values)
    if op == "[SM":
        return sum(values) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


def evaluate(tokens: list[str]) -> int:
    """The value of a tokenised expression (a digit alone, or an operator, its arguments and ``]``)."""
    stack: list[tuple[str, list[int]]] = []
    value = None
    for token in tokens:
        if token in OPERATORS:
            stack.append((token, []))
        elif token == CLOSE:
            op, args = stack.pop()
            if not args:
                raise ValueError("an operator without arguments")
            value = apply_operator(op, args)
            if stack:
                stack[-1][1].append(value)
        else:
            digit = int(token)
            if stack:
                stack[-1][1].append(digit)
            else:
                value = digit
    if stack or value is None:
        raise ValueError("unbalanced ListOps expression")
    return value


@dataclass(frozen=True)
class ListOpsSettings:
    min_length: int = 500
    max_length: int = 2000
    max_depth: int = 10
    max_args: int = 10
    # chance that an argument below the root is itself an operator (else a digit); the root always is one
    branch_prob: float = 0.25


class TooLong(Exception):
    pass


def random_tree(rng: random.Random, s: ListOpsSettings) -> list[str]:
    """One expression as tokens, the root an operator; TooLong as soon as it passes ``max_length`` (so
    rejected draws cost at most that many tokens)."""
    tokens: list[str] = []

    def grow(depth: int) -> None:
        if depth > 1 and (depth >= s.max_depth or rng.random() >= s.branch_prob):
            tokens.append(DIGITS[rng.randrange(10)])
        else:
            tokens.append(OPERATORS[rng.randrange(len(OPERATORS))])
            for _ in range(rng.randint(2, s.max_args)):
                grow(depth + 1)
            tokens.append(CLOSE)
        if len(tokens) > s.max_length:
            raise TooLong

    grow(1)
    return tokens


def generate(count: int, seed: int, settings: ListOpsSettings = ListOpsSettings(),
             max_draws: int = 10_000_000) -> tuple[list[np.ndarray], np.ndarray]:
    """``count`` expressions (token ids, uint8) and their values, the same for the same seed and settings."""
    rng = random.Random(seed)
    sequences, labels = [], []
    draws = 0
    while len(sequences) < count:
        draws += 1
        if draws > max_draws:
            raise ValueError(f"ListOps: {max_draws} draws gave only {len(sequences)} expressions of "
                             f"{settings.min_length}-{settings.max_length} tokens; widen the length range")
        try:
            tokens = random_tree(rng, settings)
        except TooLong:
            continue
        if len(tokens) < settings.min_length:
            continue
        sequences.append(np.array([TOKEN_ID[t] for t in tokens], dtype=np.uint8))
        labels.append(evaluate(tokens))
    return sequences, np.array(labels, dtype=np.int64)


def decode(ids) -> list[str]:
    return [VOCAB[int(i)] for i in ids if int(i) != 0]
