"""The compile hook: jax's own compile functions until the library first
lowers a future or an ordered block; then modules it does not own pass
through (compile_hook.py)."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap._src.xla import compile_hook

_FRESH = textwrap.dedent("""
    import os
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp
    jax.config.update("jax_num_cpu_devices", 2)
    from jax._src import compiler
    from jax._src.interpreters import pxla
    from jax.sharding import PartitionSpec as P
    own = (pxla.create_compile_options, compiler.compile_or_get_cached)
    now = lambda: (pxla.create_compile_options, compiler.compile_or_get_cached)

    import jax_overlap
    from jax_overlap._src.xla import compile_hook
    assert now() == own, "import jax_overlap changed jax's compile functions"
    jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(4)).compile()
    assert now() == own, "a program without the library installed the hook"

    mesh = jax.make_mesh((2,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    def step(x):
      return jax_overlap.all_gather_start(x, "i", tiled=True).done() + 1
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    lowered = f.lower(jnp.ones(4))
    assert compile_hook.installed() and now() != own, "not installed at lowering"
    assert (lowered.compile()(jnp.ones(4)) == 2).all()

    compile_hook.uninstall()
    assert now() == own, "uninstall left jax's functions replaced"
    ordered = jax_overlap.program_order(lambda x: jnp.sin(x) * 2, enforce=True)
    jax.jit(ordered).lower(jnp.ones(4)).compile()
    assert compile_hook.installed(), "an ordered block did not install it"
    print("ok")
    """)


@pytest.mark.subprocess
def test_jax_is_its_own_until_the_library_lowers_something():
  out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_a_module_the_library_does_not_own_passes_through(monkeypatch):
  seen = []
  monkeypatch.setattr(compile_hook, "_OPTION_HOOKS",
                      [lambda c, *a, **k: seen.append(c) or {}])
  jax.jit(lambda x: jnp.cos(x) + 3).lower(jnp.ones(3)).compile()
  plain = jax.jit(lambda x: jnp.cos(x) + 3).lower(jnp.ones(3)).compiler_ir()
  assert not compile_hook.owns(plain)
  assert not seen
  mesh = jax.make_mesh((2,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
  f = jax.jit(jax.shard_map(
      lambda x: jax_overlap.all_gather_start(x, "i", tiled=True).done(),
      mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  lowered = f.lower(jnp.ones(4))
  assert compile_hook.owns(lowered.compiler_ir())
  lowered.compile()
  assert len(seen) == 1


def test_compiles_are_not_cached_here():
  # conftest's `shared_compiles` turns jax's persistent cache on for the
  # modules that ask for it and off after them: the compiles these tests watch
  # must be real ones. With no directory, jax's cache reads and writes nothing.
  assert jax.config.jax_compilation_cache_dir is None
