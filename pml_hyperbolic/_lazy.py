"""Lazy package attributes (PEP 562), so that importing a light submodule loads no torch.

The recipes parse and check their command line with ``pml_hyperbolic.training.cli`` before torch,
PML and timm are imported (``--help`` and argument errors answer in a fraction of a second); a
package ``__init__`` that imported everything eagerly would defeat that. Each package lists its
public names and the submodule that defines them; the first access imports that submodule.
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict, Tuple


def lazy_exports(package: str, exports: Dict[str, str]) -> Tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a public name to the relative
    module that defines it (a name equal to its module's last part is the module itself)."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = importlib.import_module(module, package)
        value = loaded if module.rsplit(".", 1)[-1] == name else getattr(loaded, name)
        namespace[name] = value  # cached: later accesses do not come back here
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
