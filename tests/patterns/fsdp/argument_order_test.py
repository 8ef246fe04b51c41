"""`fsdp_scan(..., params_first=True)` calls `layer(params, x)`, as every
pattern calls its function; the old `layer(x, params)` stays the default,
with a `LayerArgumentOrderWarning` at the user's call
(src/jax_overlap/_src/patterns/fsdp/argument_order.py).

x and each layer's weights have the same shape here (8 x 8 on each device),
so a call with its arguments swapped runs, and gives other values: each case
checks that it would. Values and gradients against a plain `lax.scan`.
"""

from __future__ import annotations

import ast
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo
from jax_overlap import errors

ROOT = pathlib.Path(__file__).parents[3]
HAS_EXPLICIT = hasattr(jax.sharding, "AxisType") and hasattr(jax, "reshard")
L, D = 3, 8          # layers; x is (2 * D, D) globally, (D, D) on each device
V = 5                # vocabulary of before='s embedding


def old_layer(x, w):
  return x + jnp.tanh(x @ w)


def new_layer(w, x):
  return x + jnp.tanh(x @ w)


def _inputs():
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(k[0], (2 * D, D))
  ws = jax.random.normal(k[1], (L, D, D)) * 0.5
  return x, ws, k[2]


def _reference(layer, x, ws, xs=None):
  """The stack as a plain `lax.scan` over the full weights (x first)."""
  if xs is None:
    return lax.scan(lambda x, w: (layer(x, w), None), x, ws)[0]
  return lax.scan(lambda x, wx: (layer(x, *wx), None), x, (ws, xs))[0]


def _stack(layer, params_first, mesh, jit=True, **kwargs):
  specs = (P("i"), P(None, "i"))

  def model(x, ws):
    return jo.fsdp_scan(layer, x, ws, axis="i", params_first=params_first,
                        **kwargs)
  f = jax.shard_map(model, mesh=mesh, in_specs=specs, out_specs=P("i"))
  return jax.jit(f) if jit else f


def _value_and_grads(f, x, ws):
  return jax.value_and_grad(lambda x, ws: jnp.sum(f(x, ws) ** 2),
                            argnums=(0, 1))(x, ws)


def _close(a, b):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5,
                                                       atol=1e-6), a, b)


def _far(a, b):
  assert not np.allclose(a, b, rtol=1e-2), "a swapped call would not show"


# --- the two orders give the same stack ------------------------------------------

@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_the_new_order_equals_the_old_in_values_and_gradients(mesh2, jit):
  x, ws, _ = _inputs()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", errors.LayerArgumentOrderWarning)
    old = _value_and_grads(_stack(old_layer, False, mesh2, jit), x, ws)
  new = _value_and_grads(_stack(new_layer, True, mesh2, jit), x, ws)
  ref = _value_and_grads(lambda x, ws: _reference(old_layer, x, ws), x, ws)
  _close(new, old)
  _close(new, ref)
  # The flag is what decides: the old layer given params_first=True is
  # called with its arguments swapped, and gives another stack.
  swapped = _value_and_grads(_stack(old_layer, True, mesh2, jit), x, ws)
  _far(swapped[0], ref[0])


@pytest.mark.skipif(not HAS_EXPLICIT,
                    reason="this jax lacks AxisType.Explicit or jax.reshard")
def test_the_new_order_on_an_explicit_mesh():
  import meshes  # noqa: PLC0415
  mesh = meshes.make((2,), ("i",), explicit=True)
  x, ws, _ = _inputs()
  with jax.set_mesh(mesh):
    xg = jax.device_put(x, NamedSharding(mesh, P("i")))
    wg = jax.device_put(ws, NamedSharding(mesh, P(None, "i")))
    stack = jax.jit(lambda x, ws: jo.fsdp_scan(new_layer, x, ws, axis="i",
                                               params_first=True))
    got = _value_and_grads(stack, xg, wg)
  _close(got, _value_and_grads(lambda x, ws: _reference(old_layer, x, ws),
                               x, ws))


# --- each feature, in the new order ----------------------------------------------

def test_xs_come_after_the_params_and_x(mesh2):
  x, ws, key = _inputs()
  scales = jax.random.uniform(key, (L, D), minval=0.5, maxval=1.5)

  def layer(w, x, s):                 # the params, the carry, then xs[i]
    return x + jnp.tanh(x @ w) * s

  def f(x, ws, scales):
    return jax.shard_map(
        lambda x, ws, s: jo.fsdp_scan(layer, x, ws, axis="i", xs=s,
                                      params_first=True),
        mesh=mesh2, in_specs=(P("i"), P(None, "i"), P()),
        out_specs=P("i"))(x, ws, scales)

  ref_f = lambda x, ws, s: _reference(lambda x, w, s: layer(w, x, s), x, ws, s)
  grad = lambda f: jax.value_and_grad(
      lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(x, ws, scales)
  _close(grad(jax.jit(f)), grad(ref_f))


def test_before_and_after_take_one_argument_as_before(mesh2):
  x, ws, key = _inputs()
  table = jax.random.normal(key, (V, D))
  tokens = jnp.arange(2 * D) % V

  def f(table, ws, tokens):
    return jax.shard_map(
        lambda table, ws, t: lax.pmean(jo.fsdp_scan(
            new_layer, t, ws, axis="i", before=lambda t: table[t],
            after=lambda y: jnp.mean(y ** 2), params_first=True), "i"),
        mesh=mesh2, in_specs=(P(), P(None, "i"), P("i")),
        out_specs=P())(table, ws, tokens)

  def ref(table, ws, tokens):
    return jnp.mean(_reference(old_layer, table[tokens], ws) ** 2)
  grads = lambda f: jax.value_and_grad(f, argnums=(0, 1))(table, ws, tokens)
  _close(grads(jax.jit(f)), grads(ref))


def test_has_ys_with_the_params_first(mesh2):
  x, ws, _ = _inputs()

  def layer(w, x):
    y = x @ w
    return x + jnp.tanh(y), jnp.sum(y, axis=-1)

  def f(x, ws):
    return jax.shard_map(
        lambda x, ws: jo.fsdp_scan(layer, x, ws, axis="i", has_ys=True,
                                   params_first=True),
        mesh=mesh2, in_specs=(P("i"), P(None, "i")),
        out_specs=(P("i"), P(None, "i")))(x, ws)

  ref = lambda x, ws: lax.scan(lambda x, w: layer(w, x), x, ws)
  loss = lambda f: lambda x, ws: (lambda o: jnp.sum(o[0] ** 2)
                                  + jnp.sum(jnp.sin(o[1])))(f(x, ws))
  got = jax.value_and_grad(loss(jax.jit(f)), argnums=(0, 1))(x, ws)
  _close(got, jax.value_and_grad(loss(ref), argnums=(0, 1))(x, ws))
  assert f(x, ws)[1].shape == (L, 2 * D)


# --- the warning -----------------------------------------------------------------

def _trace(layer, params_first, mesh, x=None):
  x0, ws, _ = _inputs()
  jax.make_jaxpr(_stack(layer, params_first, mesh))(x0 if x is None else x, ws)


def test_the_old_order_warns_at_the_users_call_naming_params_first(mesh2):
  with pytest.warns(errors.LayerArgumentOrderWarning) as caught:
    _trace(old_layer, False, mesh2)
  assert issubclass(errors.LayerArgumentOrderWarning, DeprecationWarning)
  (w,) = [w for w in caught if w.category is errors.LayerArgumentOrderWarning]
  message = str(w.message)
  assert "layer(x, params) is deprecated" in message
  assert "Write layer(params, x) and pass params_first=True" in message
  assert "pipeline_loss" in message
  # said where the user wrote the call (stacklevel), not in the library
  assert pathlib.Path(w.filename) == pathlib.Path(__file__), w.filename
  src = pathlib.Path(__file__).read_text().splitlines()[w.lineno - 1]
  assert "jo.fsdp_scan(" in src, src


def test_an_eager_call_warns_once_at_the_users_call(mesh2):
  x, ws, _ = _inputs()
  with pytest.warns(errors.LayerArgumentOrderWarning) as caught:
    _stack(old_layer, False, mesh2, jit=False)(x, ws)
  ours = [w for w in caught if w.category is errors.LayerArgumentOrderWarning]
  assert len(ours) == 1, [str(w.message) for w in ours]
  assert pathlib.Path(ours[0].filename) == pathlib.Path(__file__)


def test_the_new_order_does_not_warn(mesh2):
  x, ws, _ = _inputs()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _trace(new_layer, True, mesh2)
    _stack(new_layer, True, mesh2, jit=False)(x, ws)
  assert not [w for w in caught
              if issubclass(w.category, errors.LayerArgumentOrderWarning)]


def test_the_warning_is_said_once_a_call_site(mesh2):
  # Python's default action for it: once per place it is said from.
  x, _, _ = _inputs()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default", errors.LayerArgumentOrderWarning)
    _trace(old_layer, False, mesh2)
    _trace(old_layer, False, mesh2, x=jnp.concatenate([x, x]))  # a retrace
  ours = [w for w in caught if w.category is errors.LayerArgumentOrderWarning]
  assert len(ours) == 1, [(w.filename, w.lineno) for w in ours]


def test_params_first_must_be_a_bool(mesh2):
  with pytest.raises(TypeError, match=r"fsdp_scan\(params_first=...\) must "
                                      r"be True or False, got 'yes'"):
    _trace(new_layer, "yes", mesh2)


def test_a_failing_layer_is_told_in_the_order_it_is_called(mesh2):
  def layer(w, x):
    return x @ w["missing"]
  with pytest.raises(ValueError, match=re.escape("calls layer(params[i], x)")):
    _trace(layer, True, mesh2)
  with pytest.raises(TypeError, match=re.escape(
      "must be a function layer(params[i], x) -> x")):
    _trace(3, True, mesh2)


# --- what users read writes the new order ---------------------------------------

def _python_sources():
  """(where, source) of every example users read: the docs' Python blocks,
  examples/, benchmarks/, the demo, and the library's docstrings."""
  docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
  for path in docs:
    for k, block in enumerate(re.findall(r"```python\n(.*?)```",
                                         path.read_text(), re.S)):
      yield f"{path.relative_to(ROOT)} block {k}", block
  scripts = [*sorted((ROOT / "examples").glob("*.py")),
             *sorted((ROOT / "benchmarks").glob("*.py")),
             *sorted((ROOT / "src/jax_overlap/_src/demo").glob("*.py"))]
  for path in scripts:
    yield str(path.relative_to(ROOT)), path.read_text()
  for path in sorted((ROOT / "src/jax_overlap").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      doc = (ast.get_docstring(node, clean=True)
             if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module))
             else None)
      if doc and ">>>" in doc:
        lines = [ln.strip()[4:] for ln in doc.splitlines()
                 if ln.strip().startswith((">>> ", "... ", ">>>", "..."))]
        yield f"{path.relative_to(ROOT)} docstring", "\n".join(lines)


def _forwarded(call: ast.Call, parents: dict) -> bool:
  """Whether `call` forwards its settings (`**kwargs`) to a function its
  enclosing function was given by that name (a wrapper around whichever
  fsdp_scan it is handed, benchmarks/bench_fsdp_knobs.py)."""
  if not isinstance(call.func, ast.Name) or not any(
      k.arg is None for k in call.keywords):
    return False
  node = call
  while node in parents:
    node = parents[node]
    if isinstance(node, (ast.FunctionDef, ast.Lambda)):
      if call.func.id in [a.arg for a in node.args.args + node.args.kwonlyargs]:
        return True
  return False


def _old_calls(source: str) -> list[int]:
  """Lines of the calls to `fsdp_scan` without `params_first=True`."""
  try:
    tree = ast.parse(source)
  except SyntaxError:
    return []
  parents = {child: node for node in ast.walk(tree)
             for child in ast.iter_child_nodes(node)}
  found = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
      continue
    name = getattr(node.func, "attr", getattr(node.func, "id", None))
    if name != "fsdp_scan" or _forwarded(node, parents):
      continue
    first = [k for k in node.keywords if k.arg == "params_first"]
    if not (first and isinstance(first[0].value, ast.Constant)
            and first[0].value.value is True):
      found.append(node.lineno)
  return found


def test_docs_examples_benchmarks_and_the_demo_use_the_new_order():
  sources = list(_python_sources())
  calls = sum(isinstance(node, ast.Call)
              and getattr(node.func, "attr", getattr(node.func, "id", None))
              == "fsdp_scan"
              for _, source in sources if "fsdp_scan(" in source
              for node in ast.walk(ast.parse(source)))
  assert calls >= 20, calls        # (the check reads what it should)
  old = {where: lines for where, source in sources
         if (lines := _old_calls(source))}
  assert not old, old
