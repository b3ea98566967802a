"""Pathfinder (Long Range Arena): small images of dashed curves; label 1 when the two marked dots lie on the
same curve.

Written from the published task description (Linsley et al. 2018; Tay et al. 2020), at 32 x 32 pixels. Every
image holds ``curves`` dashed curves. Positive: both ends of the first curve are marked. Negative: one end of
the first curve and one end of the second: the same number of curves and marks either way, so only following
a curve tells the classes apart. Curves are walks over the 8 neighbours of a pixel with a slowly turning
heading, drawn ``dash`` steps on and ``gap`` steps off. Distinct curves keep a Chebyshev distance of at
least ``gap + 2`` pixels, so joining pixels within ``gap + 1`` of each other joins exactly the pixels of one
curve (what the tests check with a flood fill). ``difficulty`` 1-3 lengthens the curves and adds distractors.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

SIZE = 32
# the 8 headings, in turning order: a step turns the heading by at most one place
HEADINGS = ((0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1), (-1, 0), (-1, 1))
MARK = 255
# (curves, shortest walk, longest walk) per difficulty
DIFFICULTIES = {1: (2, 8, 14), 2: (3, 12, 18), 3: (4, 12, 20)}


@dataclass(frozen=True)
class PathfinderSettings:
    difficulty: int = 2
    dash: int = 3
    gap: int = 1
    turn_prob: float = 0.35  # chance that a step turns the heading by one place (either way)

    @property
    def separation(self) -> int:
        """Chebyshev distance kept between distinct curves: more than a gap can bridge."""
        return self.gap + 2


class Rejected(Exception):
    pass


def marker_pixels(end: tuple[int, int]) -> list[tuple[int, int]]:
    """The dot drawn on a curve's end: the end pixel and its four neighbours (inside the image)."""
    y, x = end
    return [(y + dy, x + dx) for dy, dx in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1))
            if 0 <= y + dy < SIZE and 0 <= x + dx < SIZE]


def random_walk(rng: random.Random, s: PathfinderSettings, steps: int, taken: np.ndarray) -> list[tuple[int, int]]:
    """Pixels of one walk (consecutive pixels 8-adjacent, none repeated), kept two pixels from the border
    so that its marks fit and ``separation`` from the ``taken`` pixels; Rejected if it cannot be drawn."""
    y, x = rng.randrange(2, SIZE - 2), rng.randrange(2, SIZE - 2)
    if too_close([(y, x)], taken, s.separation):
        raise Rejected
    heading = rng.randrange(8)
    path = [(y, x)]
    for _ in range(steps):
        r = rng.random()
        if r < s.turn_prob:
            heading = (heading + (1 if r < s.turn_prob / 2 else -1)) % 8
        dy, dx = HEADINGS[heading]
        y, x = y + dy, x + dx
        if not (2 <= y < SIZE - 2 and 2 <= x < SIZE - 2) or too_close([(y, x)], taken, s.separation):
            raise Rejected
        # a walk may not touch its own earlier pixels (other than its last few): it stays one curve,
        # not a knot whose dashes could be read across
        if any(max(abs(y - py), abs(x - px)) < s.separation for py, px in path[:-s.separation]):
            raise Rejected
        path.append((y, x))
    return path


def too_close(pixels, taken: np.ndarray, separation: int) -> bool:
    """Whether any of ``pixels`` lies within Chebyshev distance ``separation - 1`` of a taken pixel."""
    r = separation - 1
    return any(taken[max(0, y - r):y + r + 1, max(0, x - r):x + r + 1].any() for y, x in pixels)


def draw_image(rng: random.Random, s: PathfinderSettings, positive: bool, max_tries: int = 200) -> np.ndarray:
    """One 32 x 32 uint8 image (0 background, curves at 96-200, marks at 255)."""
    n_curves, shortest, longest = DIFFICULTIES[s.difficulty]
    for _ in range(max_tries):
        image = np.zeros((SIZE, SIZE), dtype=np.uint8)
        taken = np.zeros((SIZE, SIZE), dtype=bool)  # every pixel of the curves drawn so far, gaps and marks too
        walks = []
        try:
            for c in range(n_curves):
                for _attempt in range(50):
                    try:
                        walk = random_walk(rng, s, rng.randint(shortest, longest), taken)
                    except Rejected:
                        continue
                    ends = [walk[0], walk[-1]]
                    occupied = set(walk) | {p for end in ends for p in marker_pixels(end)}
                    if not too_close(occupied, taken, s.separation):
                        break
                else:
                    raise Rejected
                for y, x in occupied:
                    taken[y, x] = True
                walks.append(walk)
        except Rejected:
            continue
        for walk in walks:
            shade = rng.randint(96, 200)
            period = s.dash + s.gap
            for i, (y, x) in enumerate(walk):
                if i % period < s.dash or i == len(walk) - 1:  # the last pixel is always drawn: it carries a mark
                    image[y, x] = shade
        if positive:
            marked = [walks[0][0], walks[0][-1]]
        else:
            marked = [rng.choice((walks[0][0], walks[0][-1])), rng.choice((walks[1][0], walks[1][-1]))]
        for end in marked:
            for y, x in marker_pixels(end):
                image[y, x] = MARK
        return image
    raise ValueError(f"Pathfinder: no image of difficulty {s.difficulty} fitted in {max_tries} tries")


def generate(count: int, seed: int, settings: PathfinderSettings = PathfinderSettings()
             ) -> tuple[list[np.ndarray], np.ndarray]:
    """``count`` images as 1,024-pixel sequences (uint8, row by row) and their labels, half of each class
    in a seeded order; the same for the same seed and settings."""
    rng = random.Random(seed)
    labels = np.array([i % 2 for i in range(count)], dtype=np.int64)
    rng.shuffle(labels)
    sequences = [draw_image(rng, settings, bool(label)).reshape(-1) for label in labels]
    return sequences, labels
