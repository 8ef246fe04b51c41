"""Two independent parts of one traced function, zipped at their futures.

`interleaved(fn, parts)` runs `fn` with the equations traced under the named
scopes `parts[0]` and `parts[1]` (two computations that read nothing of each
other, say a DualPipeV F&B tick's forward and backward) written in one
`program_order(enforce=True)` block, in which each part's collective futures
are in flight while the other part computes (at least one matmul of it a
window where it has one), and no more than one future of the two parts is in
flight at a time (the TPU v5e takes one all-to-all in flight; a part's own
futures keep their written overlap). `zip_order` says how the next start is
chosen. Left to themselves the compilers keep each part's pieces together
(the v5e: 1 of 48 F&B all-to-alls with the other part's matmul in flight).

How: `fn` is traced once, its ordered blocks, jit calls, custom-derivative
calls and `jax.checkpoint` calls inlined (each part's starts and dones keep
their written order); the equations between two consecutive starts/dones of
the zipped order become one free block (XLA fuses inside it as it would
unordered), the starts and dones steps of the ordered block. Equations of
neither part (the glue around them) go as early as their inputs allow.
Values are `fn`'s: the same equations, in an order their data allows. Where
a part has no future, `fn` runs as written.

Pinned by tests/ordering/interleave_test.py (the order, values, the
fallback) and tests/aot/dualpipev_moe_compiled_test.py (the windows on the
real compilers).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax._src import core
from jax._src import source_info_util
from jax._src.pjit import jit_p

from jax_overlap._src import _compat
from jax_overlap._src.ordering.decorator import program_order
from jax_overlap._src.ordering.primitive import body_of, program_order_p

#: The future's halves (collectives/primitives.py), by name: this layer is
#: below the collectives'.
_START, _DONE = "collective_start", "collective_done"


def interleaved(fn: Callable, parts: tuple[str, str]) -> Callable:
  """`fn` with the equations of its two named scopes `parts` zipped at their
  futures (module docstring); `fn` unchanged where either has none.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax_overlap._src.ordering.interleave import interleaved
    >>> def f(x, y):
    ...   with jax.named_scope("a"):
    ...     u = jnp.sin(x)
    ...   with jax.named_scope("b"):
    ...     v = jnp.cos(y)
    ...   return u + v
    >>> print(jax.jit(interleaved(f, ("a", "b")))(0., 0.))
    1.0
  """
  def run(*args):
    flat, tree = jax.tree.flatten(args)
    unflat = lambda *a: fn(*jax.tree.unflatten(tree, a))
    traced, shapes = jax.make_jaxpr(unflat, return_shape=True)(*flat)
    out_tree = jax.tree.structure(shapes)
    closed = jax.make_jaxpr(_inlining(traced))(*flat)
    jaxpr, consts = _compat.open_jaxpr(closed), _compat.jaxpr_consts(closed)
    label = [_part(eqn, parts) for eqn in jaxpr.eqns]
    kind = [_kind(eqn) for eqn in jaxpr.eqns]
    if not all(any(k == _START and l == p for k, l in zip(kind, label))
               for p in (0, 1)):   # fn as written: its trace, replayed
      return jax.tree.unflatten(out_tree, _closed_eval(traced, flat))
    order = zip_order(jaxpr, label, kind)
    outs = program_order(enforce=True)(
        lambda *a: _emit(jaxpr, consts, order, kind, a))(*flat)
    return jax.tree.unflatten(out_tree, outs)
  return run


def zip_order(jaxpr, label: Sequence, kind: Sequence) -> list[int]:
  """The equations' indices in the zipped order: `label[i]` is 0, 1 (the
  part) or None (glue), `kind[i]` `_START`, `_DONE` or None.

  One future of the two parts is in flight at a time (a part's own
  futures keep their written overlap: its starts and dones keep their
  written order). While one is, the other part computes up to one matmul
  (its ready work in written order), then the next start is chosen: one
  whose window the other part can fill, needing the fewest matmuls of its
  own part first where more would leave it fewer than the other part's
  windows to come (a part with few matmuls spends them one a window;
  tests/aot/dualpipev_moe_compiled_test.py's recomputing v5e case), the
  other part than the one in flight on a tie, then the part with more
  futures left. Its needs go, the futures in flight finish, it starts. What
  no window took goes last, in written order."""
  eqns = jaxpr.eqns
  coll = [[i for i in range(len(eqns)) if label[i] == p and kind[i]]
          for p in (0, 1)]
  comp = [[i for i in range(len(eqns)) if label[i] == p and not kind[i]]
          for p in (0, 1)]
  glue = [i for i, l in enumerate(label) if l is None]
  matmul = {i for i, eqn in enumerate(eqns) if _is_matmul(eqn)}
  made_by = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
  defined = set(jaxpr.constvars) | set(jaxpr.invars)
  order: list[int] = []
  emitted: set[int] = set()
  flying: list[int] = []     # the parts of the futures in flight, oldest first

  def ready(i):
    return all(_is_literal(v) or v in defined for v in eqns[i].invars)

  def emit(i):
    order.append(i)
    emitted.add(i)
    defined.update(eqns[i].outvars)
    if label[i] is None:   # glue: not a part's future
      return
    if kind[i] == _START:
      flying.append(label[i])
    elif kind[i] == _DONE:
      flying.remove(label[i])

  def run_glue():
    for i in glue:
      if i not in emitted and ready(i):
        emit(i)

  def needs(c, allow):
    """The unemitted equations `c` reads from, transitively, in written
    order; None if one is a start or done not in `allow`."""
    seen, todo = set(), [c]
    while todo:
      for v in eqns[todo.pop()].invars:
        j = None if _is_literal(v) else made_by.get(v)
        if j is None or j in emitted or j in seen:
          continue
        if kind[j] and j not in allow:
          return None
        seen.add(j)
        if not kind[j]:
          todo.append(j)
    return sorted(seen)

  def dones():
    """The dones that finish what is in flight (each part's leading ones)."""
    out = set()
    for p in (0, 1):
      for i in coll[p]:
        if kind[i] != _DONE:
          break
        out.add(i)
    return out

  def fill(p):
    """p's ready work in written order up to its first matmul; True if one
    went."""
    for i in comp[p]:
      if i not in emitted and ready(i):
        emit(i)
        if i in matmul:
          return True
    return False

  def fillable(p, allow):
    return any(i not in emitted and needs(i, allow) is not None
               for i in comp[p] if i in matmul)

  def emit_in_order(items):
    for i in sorted(items):
      if i not in emitted:
        emit(i)
        p = label[i]
        if p is not None and kind[i]:
          coll[p].remove(i)

  p_first = _first(coll, comp, matmul, len(eqns))
  while coll[0] or coll[1]:
    run_glue()
    allow = dones()
    options = []
    for x in (0, 1):
      c = next((i for i in coll[x] if kind[i] == _START), None)
      need = None if c is None else needs(c, allow)
      if need is not None:
        options.append((x, c, need))
    if not options:
      # No start can go: the other part's ready work in the window (no
      # later window needs it), then the oldest future finishes.
      if flying:
        while fill(1 - flying[-1]):
          pass
      waiting = [coll[q][0] for q in flying[:1] if coll[q] and ready(coll[q][0])]
      if not waiting:
        break
      emit_in_order(waiting)
      continue
    last = flying[-1] if flying else None

    def free_of(need):
      return [i for i in need if not kind[i] and needs(i, set()) is not None]

    def score(option, last=last, allow=allow):
      x, c, need = option
      # matmuls more than one that x's needs would put in the window, where
      # spending them leaves x fewer than the other part has windows to fill
      spent = len(matmul.intersection(free_of(need)))
      scarce = (sum(i not in emitted for i in comp[x] if i in matmul) - spent
                < sum(kind[i] == _START for i in coll[1 - x]))
      extra = (max(0, spent - 1)
               if scarce and last is not None and x != last else 0)
      return (fillable(1 - x, allow | {c}), -extra,
              x != last if last is not None else x == p_first, len(coll[x]))
    x, c, need = max(options, key=score)
    # In the window in flight: x's needs that wait on no future, if x is
    # the other part, and one matmul of the other part if they hold none.
    free = free_of(need)
    if last is not None and x != last:    # x's needs fill the window
      emit_in_order(free)
      if not matmul.intersection(free):
        fill(x)
    elif last is not None:                # x's own: the other part fills it
      fill(1 - last)
    emit_in_order(free)
    emit_in_order(sorted(allow))   # the futures in flight finished
    emit_in_order(need + [c])
    run_glue()
  # The work no window took, and anything left: written order.
  order += [i for i in range(len(eqns)) if i not in emitted]
  return order


def _first(coll, comp, matmul, n) -> int:
  """The part that starts first where nothing else decides: the one with
  more futures (its windows are the more to fill), else the one with fewer
  matmuls before its first start."""
  def lead(p):
    first = coll[p][0] if coll[p] else n
    return sum(i in matmul for i in comp[p] if i < first)
  return min((0, 1), key=lambda p: (-len(coll[p]), lead(p), p))


def _emit(jaxpr, consts, order, kind, args):
  """Evaluates the equations in `order`: each run of equations between two
  starts/dones as one free block, each start and done as itself."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  last_read = _last_reads(jaxpr, order)
  k = 0
  while k < len(order):
    if kind[order[k]] is not None:
      _eval([jaxpr.eqns[order[k]]], env)
      k += 1
      continue
    end = k
    while end < len(order) and kind[order[end]] is None:
      end += 1
    gap = [jaxpr.eqns[j] for j in order[k:end]]
    made = {v for eqn in gap for v in eqn.outvars}
    ins = list(dict.fromkeys(v for eqn in gap for v in eqn.invars
                             if not _is_literal(v) and v not in made))
    outs = [v for v in dict.fromkeys(v for eqn in gap for v in eqn.outvars)
            if not isinstance(v, core.DropVar) and last_read.get(v, -1) >= end]
    vals = program_order(enforce=False)(
        lambda *a, gap=gap, ins=ins, outs=outs: _eval(gap, dict(zip(ins, a)), outs))(
            *[env[v] for v in ins])
    _write(env, outs, vals)
    k = end
  return [_read(env, v) for v in jaxpr.outvars]


def _last_reads(jaxpr, order) -> dict:
  """Each variable's last position in `order` that reads it (`len(order)`
  for a returned one)."""
  last = {}
  for k, i in enumerate(order):
    last.update((v, k) for v in jaxpr.eqns[i].invars if not _is_literal(v))
  last.update((v, len(order)) for v in jaxpr.outvars if not _is_literal(v))
  return last


def _eval(eqns, env, outs=(), inline=False):
  """Binds `eqns` on the values in `env` (each in its source context),
  writing their outputs there; with `inline`, evaluates the body of each
  call `_call_body` names in its place. Returns `outs` read from `env`."""
  for eqn in eqns:
    invals = [_read(env, v) for v in eqn.invars]
    body = _call_body(eqn) if inline else None
    if body is None:
      outvals = _compat.bind_eqn(eqn, invals)
    else:
      stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
      with source_info_util.user_context(eqn.source_info.traceback,
                                         name_stack=stack):
        outvals = _closed_eval(body, invals, inline=True)
    _write(env, eqn.outvars, outvals)
  return [_read(env, v) for v in outs]


def _closed_eval(closed, args, inline=False):
  jaxpr = _compat.open_jaxpr(closed)
  env = dict(zip(jaxpr.constvars, _compat.jaxpr_consts(closed)))
  env.update(zip(jaxpr.invars, args))
  return _eval(jaxpr.eqns, env, jaxpr.outvars, inline)


def _read(env, v):
  return v.val if _is_literal(v) else env[v]


def _write(env, outvars, vals):
  for v, x in zip(outvars, vals, strict=True):
    if not isinstance(v, core.DropVar):
      env[v] = x


def _is_literal(v) -> bool:
  return isinstance(v, core.Literal) or not isinstance(v, core.Var)


def _is_matmul(eqn) -> bool:
  """A dot_general with a free dimension on both sides: one the compilers
  keep a matmul (a side with none, as an einsum "td,tkd->tk", becomes a
  multiply and a reduction)."""
  if eqn.primitive.name != "dot_general":
    return False
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = (v.aval.ndim for v in eqn.invars[:2])
  return lhs > len(lc) + len(lb) and rhs > len(rc) + len(rb)


def _kind(eqn):
  return eqn.primitive.name if eqn.primitive.name in (_START, _DONE) else None


def _part(eqn, parts) -> int | None:
  scopes = str(eqn.source_info.name_stack).split("/")
  found = [p for p, name in enumerate(parts) if name in scopes]
  return found[0] if len(found) == 1 else None


def _inlining(closed):
  """A function evaluating `closed` with the calls `_call_body` names
  inlined, each inner equation in its call's name scope."""
  return lambda *args: _closed_eval(closed, args, inline=True)


#: Calls whose body holds a part's futures out of the zip's sight: a
#: custom_vjp/custom_jvp function's primal body (an MoE layer's exchanges
#: in `expert_parallel`) stands in for the call, so the zipped program is
#: for running, not for differentiating again (a DualPipeV tick runs inside
#: `pipeline_loss`'s own forward rule).
_CUSTOM_CALLS = ("custom_vjp_call", "custom_jvp_call")
#: `jax.checkpoint`'s call: a backward under a recompute policy runs its
#: recompute and its exchanges' transposes inside one.
_REMAT = "remat2"


def _call_body(eqn):
  """The closed body of an ordered or free block, a jit call or a custom
  derivative's primal function; else None."""
  if eqn.primitive is program_order_p:
    return body_of(eqn)
  if eqn.primitive is jit_p:
    return eqn.params["jaxpr"]
  if eqn.primitive.name in _CUSTOM_CALLS:
    return eqn.params["call_jaxpr"]
  if eqn.primitive.name == _REMAT:
    return _compat.close_jaxpr(eqn.params["jaxpr"], ())
  return None
