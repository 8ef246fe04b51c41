"""The one hook around jax's compile: installed the first time the library
lowers a future or an ordered block, never at import.

Invariant: until `install()` runs, `pxla.create_compile_options` and
`compiler.compile_or_get_cached` are jax's own, so a program that never uses
the library compiles as it would without it; once installed, a module the
library does not own (`owns`) passes through at once. Why one hook: three
patches at import made every user's compile go through the library. Pinned
by tests/ordering/compile_hook_test.py (in a fresh process).

What it does for a module the library owns:
- `options` hooks add XLA options to its compile (the user's
  `compiler_options` win): `compile_options.py`;
- on a CPU compiler that drops barriers before scheduling, the barriers are
  kept (`keep_cpu_order`, set by `compiled_order.py`);
- `retry` hooks may rewrite a module the backend refused and have it
  compiled once more.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import numpy as np
from jax._src.interpreters import pxla
from jax._src.lib.mlir import ir

from jax_overlap._src import _compat
from jax_overlap._src.xla import module_marks

#: Set on a module by the library's lowering rules (futures, program_order).
OWNED_MODULE_ATTR = "jax_overlap.owned"

_OPTION_HOOKS: list[Callable] = []
_RETRY_HOOKS: list[Callable] = []
_KEEP_CPU_ORDER = [False]
#: jax's own functions while the hook is installed: {(module, name): fn}.
_ORIGINALS: dict[tuple[Any, str], Callable] = {}


def add_options_hook(hook: Callable) -> None:
  """`hook(computation, platform, user_options, device_kind=...) -> dict`
  of XLA options to add; `device_kind` is the target's (e.g. "TPU v5
  lite"), or None."""
  _OPTION_HOOKS.append(hook)


def add_retry_hook(hook: Callable) -> None:
  """`hook(computation, platform, error) -> bool`: True when it rewrote the
  refused module in place, to be compiled once more."""
  _RETRY_HOOKS.append(hook)


def keep_cpu_order(enabled: bool) -> bool:
  """Whether ordered CPU modules keep their barriers until scheduling; False
  where this jax has no `create_compile_options` to hook."""
  _KEEP_CPU_ORDER[0] = bool(enabled) and _hookable_create() is not None
  return _KEEP_CPU_ORDER[0]


def mark_owned(module_context) -> None:
  """Notes on the module being lowered that the library lowered part of it."""
  module_context.module.operation.attributes[OWNED_MODULE_ATTR] = \
      ir.UnitAttr.get()


def owns(computation) -> bool:
  """Whether the library lowered part of `computation`: its mark, or an
  `optimization_barrier` (jax >= 0.12 lowers ordered blocks through lojax,
  with no module to mark)."""
  try:
    attributes = computation.operation.attributes
  except AttributeError:  # not an MLIR module (e.g. a serialized one)
    return False
  if OWNED_MODULE_ATTR in attributes or module_marks.ORDERED_MODULE_ATTR in attributes:
    return True
  return module_marks.holds_op(computation, "stablehlo.optimization_barrier")


def installed() -> bool:
  return bool(_ORIGINALS)


def install() -> bool:
  """Wraps jax's two compile functions, once; False where this jax has
  neither in the form the hook knows."""
  if _ORIGINALS:
    return True
  from jax._src import compiler  # noqa: PLC0415 - jax's, imported lazily by jax too
  create = _hookable_create()
  if create is not None:
    _ORIGINALS[pxla, "create_compile_options"] = create
    pxla.create_compile_options = _hooked_create(create)
  compile_module = getattr(compiler, "compile_or_get_cached", None)
  parameters = inspect.signature(compile_module).parameters \
      if compile_module is not None else {}
  if "computation" in parameters and "backend" in parameters:
    _ORIGINALS[compiler, "compile_or_get_cached"] = compile_module
    compiler.compile_or_get_cached = _hooked_compile(compile_module)
  return bool(_ORIGINALS)


def uninstall() -> None:
  """Puts jax's own functions back (tests; the next lowering installs it
  again)."""
  for (module, name), fn in _ORIGINALS.items():
    setattr(module, name, fn)
  _ORIGINALS.clear()


def _hookable_create():
  create = _ORIGINALS.get((pxla, "create_compile_options")) or \
      getattr(pxla, "create_compile_options", None)
  if create is None or "compiler_options" not in inspect.signature(create).parameters:
    return None
  return create


def _first_device_kind(devices) -> str | None:
  try:
    return np.asarray(devices).flat[0].device_kind
  except Exception:  # noqa: BLE001 - no devices given, or no device_kind
    return None


def _hooked_create(create: Callable) -> Callable:
  signature = inspect.signature(create)

  @functools.wraps(create)
  def create_compile_options(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    computation = bound.arguments.get("computation")
    if not owns(computation):
      return create(*args, **kwargs)
    platform = getattr(bound.arguments.get("backend"), "platform", None)
    user_options = dict(bound.arguments.get("compiler_options") or {})
    device_kind = _first_device_kind(bound.arguments.get("np_dev"))
    added: dict[str, Any] = {}
    for hook in _OPTION_HOOKS:
      added.update(hook(computation, platform, user_options,
                        device_kind=device_kind))
    options = {**added, **user_options}
    passes = _cpu_passes_to_keep(computation, platform)
    if passes and "xla_disable_hlo_passes" in options:
      # A user's list replaces the default one when XLA applies it: add ours.
      options["xla_disable_hlo_passes"] = _with_passes(
          str(options["xla_disable_hlo_passes"]), passes)
      passes = []
    bound.arguments["compiler_options"] = options or \
        bound.arguments.get("compiler_options")
    result = create(*bound.args, **bound.kwargs)
    if passes:
      debug = result.executable_build_options.debug_options
      debug.xla_disable_hlo_passes = _with_passes(
          debug.xla_disable_hlo_passes, passes)
    return result

  return create_compile_options


def _cpu_passes_to_keep(computation, platform) -> list[str]:
  """The passes to disable so that a CPU compile keeps an ordered module's
  barriers until scheduling, where this jaxlib would drop them first."""
  if (not _KEEP_CPU_ORDER[0] or platform != "cpu"
      or not module_marks.is_marked_ordered(computation)
      or not _compat.cpu_expands_barriers_before_scheduling()):
    return []
  passes = [_compat.KEEP_BARRIERS_PASS]
  if module_marks.holds_op(computation, "stablehlo.while"):
    passes.append(_compat.LOOP_HOISTING_PASS)
  return passes


def _with_passes(passes: str, added) -> str:
  names = [p for p in passes.split(",") if p]
  return ",".join([*names, *(p for p in added if p not in names)])


def _hooked_compile(compile_module: Callable) -> Callable:
  signature = inspect.signature(compile_module)

  @functools.wraps(compile_module)
  def compile_or_get_cached(*args, **kwargs):
    try:
      return compile_module(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the hooks say which they take
      bound = signature.bind(*args, **kwargs)
      computation = bound.arguments.get("computation")
      platform = getattr(bound.arguments.get("backend"), "platform", None)
      if not owns(computation) or not any(
          hook(computation, platform, error) for hook in _RETRY_HOOKS):
        raise
    # The rewritten module has another cache key: the refused one is never
    # written to the persistent cache, the rewritten one is.
    return compile_module(*args, **kwargs)

  return compile_or_get_cached
