"""What a sliding window saves `ring_attention`, read from its plan.

For a causal ring of 8 devices with Mistral's window (`window=(W - 1, 0)`),
each layout: the rotations of (k, v) the forward pass takes (without a
window, 7), and the score entries the busiest device computes over the
steps (each step runs the pairs its busiest device needs), as a fraction
of a causal attention's even share, seq^2 / (2 p). Counts from the plan
(`plan.ring_steps`), not timings: a chunk pair the window cuts is
computed whole, masked.

  python benchmarks/ring_window_plan.py [--devices 8] [--seqs 32768 131072]
      [--windows 4096 8192 16384]
"""

from __future__ import annotations

import argparse

from jax_overlap._src.patterns.attention.layout import chunks_per_device
from jax_overlap._src.patterns.attention.plan import relation, ring_steps


def row(layout: str, p: int, seq: int, window):
  chunk = seq // (p * chunks_per_device(layout))
  steps = ring_steps(layout, True, p, chunk, window)
  busiest = sum(max(sum(pair.blocks for pair in s.pairs[relation(d, s.offset)])
                    for d in range(p)) for s in steps)
  return len(steps) - 1, busiest * chunk * chunk / (seq * seq / (2 * p))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
  parser.add_argument("--windows", type=int, nargs="+",
                      default=[4096, 8192, 16384])
  args = parser.parse_args()
  p = args.devices
  print("| seq | window W | contiguous: rotations | contiguous: scores | "
        "zigzag: rotations | zigzag: scores |")
  print("|---|---|---|---|---|---|")
  for seq in args.seqs:
    for w in [*args.windows, None]:
      cells = [f"{seq // 1024}K", "none" if w is None else str(w)]
      for layout in ("contiguous", "zigzag"):
        rotations, scores = row(layout, p, seq, None if w is None else (w - 1, 0))
        cells += [str(rotations), f"{scores:.2f}"]
      print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
