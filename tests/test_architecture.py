"""The layout docs/architecture.md describes, held by tests that read the source.

- The runtime only runs what lowering made: nothing under ``partc/runtime/`` imports
  ``partc.passes``, directly or through another partc module it imports.
- No module-level mutable state: no ``global`` statement, and no module-level name bound
  to a mutable container unless it is a constant table (an UPPER_CASE name that nothing
  assigns to again). The one documented exception is the plan cache, ``cache.DEFAULT``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "partc").rglob("*.py")) + sorted((ROOT / "passes").rglob("*.py"))
_MUTABLE_CALLS = {"dict", "list", "set", "Counter", "OrderedDict", "defaultdict", "deque"}
# the documented plan cache; the process groups made once per world
_ALLOWED_STATE = {("partc/cache.py", "DEFAULT"), ("partc/runtime/topology.py", "GROUPS")}


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[0] == "passes":
        parts = ["partc", "passes", *parts[1:]]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, modules: set[str], nested: bool) -> set[str]:
    """The partc modules ``path`` imports (relative imports resolved): at module level
    only, or (``nested``) in function bodies too."""
    tree = ast.parse(path.read_text())
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    nodes = ast.walk(tree) if nested else tree.body
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = node.module or ""
            name = f"{base}.{module}".strip(".") if node.level else module
            submodules = {f"{name}.{alias.name}" for alias in node.names} & modules
            found.update(submodules or {name})
    return found & modules


def _partc_imports(nested: bool) -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in SOURCES}
    return {name: _imports(path, set(paths), nested) for name, path in paths.items()}


def test_the_runtime_imports_nothing_from_the_passes():
    """Directly (anywhere in a runtime module) or through the partc modules it loads."""
    direct, loaded = _partc_imports(nested=True), _partc_imports(nested=False)
    for start in [name for name in direct if name.startswith("partc.runtime")]:
        seen, stack = {start}, list(direct[start])
        while stack:
            imported = stack.pop()
            assert not imported.startswith("partc.passes"), (
                f"{start} reaches {imported}: the runtime must run what lowering made, "
                "without the compiler's passes")
            for following in loaded[imported] - seen:
                seen.add(following)
                stack.append(following)


def test_importing_the_runtime_loads_no_pass():
    code = ("import sys, partc.runtime; "
            "print(sorted(m for m in sys.modules if m.startswith('partc.passes')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def _module_state(path: Path) -> list[str]:
    """Module-level mutable state in ``path``: ``global`` statements, and names bound to
    mutable containers that are not constant tables."""
    tree = ast.parse(path.read_text())
    where = str(path.relative_to(ROOT))
    found = [f"{where}:{node.lineno}: global {', '.join(node.names)}"
             for node in ast.walk(tree) if isinstance(node, ast.Global)]
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            if not isinstance(target, ast.Name) or not _is_mutable(value):
                continue
            constant = target.id.lstrip("_").isupper() or target.id == "__all__"
            if not constant and (where, target.id) not in _ALLOWED_STATE:
                found.append(f"{where}:{node.lineno}: {target.id}")
    return found


def _is_mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp,
                          ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        return name in _MUTABLE_CALLS
    return False


def test_no_module_level_mutable_state():
    found = [entry for path in SOURCES for entry in _module_state(path)]
    assert not found, "module-level mutable state:\n" + "\n".join(found)


def test_constant_tables_are_never_assigned_again():
    """An UPPER_CASE table is a constant: no function rebinds or mutates it in place."""
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        tables = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                  for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                  if isinstance(t, ast.Name) and t.id.lstrip("_").isupper()}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id in tables \
                    and node.func.attr in {"append", "update", "clear", "pop", "popitem",
                                           "setdefault", "add", "extend", "remove",
                                           "insert", "discard"}:
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno}: "
                                     f"{node.func.value.id}.{node.func.attr}(...) changes "
                                     "a module-level table")
