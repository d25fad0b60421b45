"""The guard on ourobatch's two generic import roots: ``scheduler`` and ``engine`` are top-level packages
(docs/architecture.md, "Layout"), so another package of the same name earlier on ``sys.path`` (a project's
own ``scheduler/`` in the current directory, say) would be imported in their place. ``import ourobatch``
checks both first and raises an ImportError naming the foreign module's file, instead of failing later
on a missing attribute deep inside the engine.

A root is ours when, already imported, it carries the marker (``__ourobatch_layer__`` = its name, set in
its ``__init__``), or, not yet imported, when the file Python would import is the one beside this
package (one distribution installs all three side by side). The second check imports nothing: a
foreign package's code never runs, and ``import ourobatch`` stays torch-free (``engine`` imports torch).
Torch-free and import-free beyond the standard library.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

IMPORT_ROOTS = ("scheduler", "engine")
MARKER = "__ourobatch_layer__"
HOME = Path(__file__).resolve().parent.parent  # where ourobatch/ lies, and scheduler/ and engine/ beside it


def foreign_origin(name: str) -> str | None:
    """None when `name` is ourobatch's own package; else where the module Python imports for it comes from."""
    module = sys.modules.get(name)
    if module is not None:
        if getattr(module, MARKER, None) == name:
            return None
        return str(getattr(module, "__file__", None) or module)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:  # a broken parent or a blocked entry: report, never mask
        return f"<{name} cannot be found: {exc}>"
    if spec is None:
        return f"<no module named {name!r}>"
    origin = spec.origin or (list(spec.submodule_search_locations or ()) or [None])[0]  # a namespace package
    if origin is not None and Path(origin).resolve() == HOME / name / "__init__.py":
        return None
    return str(origin)


def check_import_roots() -> None:
    """Raise ImportError if `scheduler` or `engine` would not be ourobatch's own packages."""
    for name in IMPORT_ROOTS:
        origin = foreign_origin(name)
        if origin is not None:
            raise ImportError(
                f"ourobatch needs its own top-level `{name}` package ({HOME / name}), but `import {name}` "
                f"finds {origin}: another module of that name comes first on sys.path. Rename or move that "
                f"module, or take its folder off sys.path (PYTHONPATH, the current directory), then import "
                f"ourobatch again", name=name, path=origin)
