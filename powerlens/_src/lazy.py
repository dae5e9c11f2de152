"""Names of a package resolved on first use (PEP 562), so that importing it stays cheap."""
from __future__ import annotations

import importlib
from typing import Callable, Dict, List, Mapping, Optional, Tuple


def lazy_exports(package: str, exports: Mapping[str, Tuple[str, Optional[str]]],
                 namespace: Dict[str, object]) -> Tuple[Callable[[str], object], Callable[[], List[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` whose public names are ``exports``:
    name -> (module, attribute), attribute None for the module itself. A name is imported on
    first use and kept in ``namespace`` (the package's globals), so it is resolved once."""

    def __getattr__(name: str):
        try:
            module, attr = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = importlib.import_module(module)
        value = value if attr is None else getattr(value, attr)
        namespace[name] = value
        return value

    def __dir__() -> List[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
