"""A small text corpus, generated here (no download), and its characters.

Sentences from a little grammar about the machines this library is for, so a
character-level model has real structure to learn: words, agreement, and
punctuation, with enough variety that the loss falls for a while.
"""

from __future__ import annotations

import random

import numpy as np

_SUBJECTS = ["the gather", "a reduce scatter", "the next layer", "each shard",
             "the scheduler", "every device", "the weights", "a collective",
             "the backward pass", "the matmul", "one ring step", "the compiler"]
_VERBS = ["hides behind", "waits for", "overlaps", "follows", "starts before",
          "finishes after", "runs beside", "feeds", "moves past", "keeps up with"]
_OBJECTS = ["the compute", "the next matmul", "its own shard", "the barrier",
            "a layer of weights", "the written order", "the interconnect",
            "the forward pass", "every other device", "the optimizer step"]
_ENDINGS = [".", ".", ".", "!", ", and nothing is exposed.",
            ", so the link is busy.", " while the cores work."]


def generate(n_chars: int = 60_000, seed: int = 0) -> str:
  """About `n_chars` of text, the same for the same seed."""
  rng = random.Random(seed)
  parts, size = [], 0
  while size < n_chars:
    sentence = (f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} "
                f"{rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}")
    sentence = sentence[0].upper() + sentence[1:] + " "
    parts.append(sentence)
    size += len(sentence)
  return "".join(parts)


class Corpus:
  """The text as integer ids, and batches of windows from it."""

  def __init__(self, text: str):
    self.chars = sorted(set(text))
    self.ids = np.array([self.chars.index(c) for c in text], np.int32)

  @property
  def vocab_size(self) -> int:
    return len(self.chars)

  def batch(self, rng: np.random.Generator, batch: int, seq: int):
    """(inputs, targets), each (batch, seq): targets are inputs shifted by one."""
    starts = rng.integers(0, len(self.ids) - seq - 1, size=batch)
    window = np.stack([self.ids[s:s + seq + 1] for s in starts])
    return window[:, :-1], window[:, 1:]

  def decode(self, ids) -> str:
    return "".join(self.chars[int(i)] for i in ids)
