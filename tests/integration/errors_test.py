"""`jax_overlap.errors` holds every public exception and warning class."""

import inspect
import pkgutil
import importlib

import jax_overlap
import jax_overlap._src
from jax_overlap import errors


def _defined_in_src():
  found = {}
  for info in pkgutil.walk_packages(jax_overlap._src.__path__,
                                    "jax_overlap._src."):
    module = importlib.import_module(info.name)
    for name, obj in vars(module).items():
      if (inspect.isclass(obj) and issubclass(obj, BaseException)
          and obj.__module__ == module.__name__ and not name.startswith("_")):
        found[name] = obj
  return found


def test_every_exception_and_warning_class_is_in_errors():
  defined = _defined_in_src()
  assert len(defined) >= 7
  assert sorted(defined) == sorted(errors.__all__)
  for name, cls in defined.items():
    assert getattr(errors, name) is cls
    # the top-level names stay, the same classes
    if hasattr(jax_overlap, name):
      assert getattr(jax_overlap, name) is cls
