"""One jitted program for a value and its gradients, for tests that compare both.

A test that jits `f` and then `jax.grad(loss of f)` compiles the forward twice;
here the value rides as the aux output of `jax.value_and_grad`, so each side
of a comparison is one compile (fresh_process_worker.py, multiprocess_programs.py).
"""

import jax


def with_grads(f, loss, argnums=0):
  """`jax.jit` of args -> (f(*args), the gradients of loss(f(*args)) with
  respect to `argnums`).

  >>> import jax.numpy as jnp
  >>> out, g = with_grads(jnp.sin, jnp.sum)(jnp.float32(0.0))
  >>> float(out), float(g)
  (0.0, 1.0)
  """
  def both(*args):
    def scalar(*a):
      out = f(*a)
      return loss(out), out
    (_, out), grads = jax.value_and_grad(scalar, argnums=argnums,
                                         has_aux=True)(*args)
    return out, grads
  return jax.jit(both)
