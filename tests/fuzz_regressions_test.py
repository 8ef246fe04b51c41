"""Programs the differential fuzzer (tests/fuzz_test.py) found, shrunk.

Each test is one failure, written out as its shrunk program (shrunk by
hypothesis, then by hand where hypothesis gave up), run through the same
checks as the fuzzer plus an assertion on the behaviour that failed. A failure that is not fixed yet is an
`xfail(strict=True)` whose reason says what is wrong.
"""

from __future__ import annotations

import jax
from jax._src import config as jax_config

from jax_overlap import program_order

import fuzz_programs as fp
from fuzz_programs import Block, Op, Program
from fuzz_test import check_against_unordered, saved_residual_types


def _counts(program, po=program_order):
  """(lowered counts, contract counts) of the program's values."""
  traced = jax.jit(fp.build(program, po=po)).trace(*fp.inputs(program))
  return (fp.stablehlo_counts(traced.lower().as_text()),
          fp.contract_counts(traced.jaxpr))


# --- fixed -------------------------------------------------------------------------

# A dead ordered block inside a jit inside a free block. The DCE rule of
# `program_order` kept the original equation whenever all its outputs and
# inputs were used, dropping the dead-code-eliminated body; jax 0.10.2 and
# 0.11.0 inline a free block as it is, so the dead ordered block was lowered
# with its strict_out barrier (1 barrier where the contract gives 0).
DEAD_BLOCK_IN_JIT_IN_FREE_BLOCK = Program(
    inputs=((4,),), sharded=False, remat3=False,
    top=Block('free',
        args=(0,),
        body=(
          Block('jit',
              args=(0,),
              body=(
                Block('ordered',
                    args=(),
                    body=(
                      Op('full', (), ((4,), 2.0)),
                    ),
                    outs=(0,),
                    param=True),
                Op('unary', (0,), 'neg'),
              ),
              outs=(1, 2)),
        ),
        outs=(2,),
        param=((), False)))


def test_dead_block_in_jit_in_free_block_gets_no_barrier():
  got, want = _counts(DEAD_BLOCK_IN_JIT_IN_FREE_BLOCK)
  assert want == fp.Counts(0, 0)
  assert got == want
  check_against_unordered(DEAD_BLOCK_IN_JIT_IN_FREE_BLOCK)


# An ordered block inside jax.checkpoint, fed a value it never reads (m =
# sin(x), closed over by the checkpointed function). The block's equation
# took every argument as an input, so with jax_remat3 the checkpoint took m
# as an input too and autodiff kept cos(x) for m's tangent: one residual
# more than the undecorated function, on every jax. Unread arguments are
# now left out of the equation.
UNREAD_INPUT_UNDER_REMAT3 = Program(
    inputs=((4,), (4,)), sharded=False, remat3=True,
    top=Block('plain',
        args=(0, 1),
        body=(
          Op('unary', (0,), 'sin'),
          Block('checkpoint',
              args=(1,),
              body=(
                Block('ordered',
                    args=(1, 0),
                    body=(
                      Op('unary', (1,), 'sin'),
                    ),
                    outs=(2,),
                    param=False),
              ),
              outs=(2,),
              param='default',
              closure=(2,)),
        ),
        outs=(3,)))


def test_unread_block_input_is_not_saved_under_remat3():
  program = UNREAD_INPUT_UNDER_REMAT3
  xs = fp.inputs(program)
  with jax_config.remat3(True):
    got = saved_residual_types(fp.build(program), xs)
    want = saved_residual_types(
        fp.build(program, po=fp.identity_decorator, futures=False), xs)
  assert got == want == ["float32[4]"]
  check_against_unordered(program)
