"""Context parallelism: attention over a sequence sharded along a mesh axis.

* `kernel.py`: the blockwise math (an online softmax in float32, its
  backward), for one block of queries against one block of keys.
* `flash_tpu.py`: the same contract as a Pallas TPU flash kernel (forward
  with the row log-sum-exp, backward with a given one).
* `dispatch.py`: which of the two computes a block (`implementation=`: the
  kernel on TPU, XLA's operations elsewhere).
* `layout.py`: which global chunks of the sequence each device holds
  (contiguous or zigzag), and the reordering helpers.
* `window.py`: sliding windows (`window=`): the argument, and what a pair of
  chunks is under one.
* `plan.py`: which (query chunk, key chunk) pairs each ring step computes;
  a pair that is fully masked is not in the plan, nor a step with none.
* `ring.py`: `ring_attention`, the key/value rotation as `ppermute_start`
  futures each in flight over one step's blocks, forward and backward.
* `ulysses.py`: `ulysses_attention`, two all-to-alls around attention on
  the whole sequence and a slice of the heads (or, with `ring_axis`, around
  `ring_attention` over a second axis).
"""
