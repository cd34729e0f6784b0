"""The layout docs/architecture.md describes, held by tests that read the source.

- The runtime only runs what lowering made: nothing under ``partc/runtime/`` imports
  ``partc.passes``, directly or through another partc module it imports.
- No hidden state: no ``global`` statement; what lives as long as the process and can
  change (:func:`process_wide_state`: module-level mutable containers that are not
  constant tables, module-level instances of partc classes that are not frozen, context
  variables, cached functions) is exactly what docs/architecture.md lists under
  "Process-wide state" (tests/test_docs.py compares the two).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "partc").rglob("*.py")) + sorted((ROOT / "passes").rglob("*.py"))
_MUTABLE_CALLS = {"dict", "list", "set", "Counter", "OrderedDict", "defaultdict", "deque"}
_CACHING_DECORATORS = {"cache", "lru_cache"}


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


def _globals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.relative_to(ROOT)}:{node.lineno}: global {', '.join(node.names)}"
            for node in ast.walk(tree) if isinstance(node, ast.Global)]


def _frozen_classes() -> set[str]:
    """Names of the classes partc defines whose instances cannot change: frozen
    dataclasses, enums and named tuples."""
    frozen = set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            marks = [ast.unparse(d) for d in node.decorator_list] + \
                [ast.unparse(b) for b in node.bases]
            if any("frozen=True" in m or "Enum" in m or "NamedTuple" in m for m in marks):
                frozen.add(node.name)
    return frozen


def _class_instance(value: ast.expr, classes: set[str], frozen: set[str]) -> bool:
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    return name == "ContextVar" or (name in classes and name not in frozen)


def _decorator_name(decorator: ast.expr) -> str:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")


def _cached(node: ast.AST) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
        _decorator_name(d) in _CACHING_DECORATORS for d in node.decorator_list)


def process_wide_state() -> list[tuple[str, str]]:
    """(file, name) of everything that lives as long as the process and can change:
    module-level names bound to mutable containers that are not constant tables (an
    UPPER_CASE name nothing assigns to again), or to instances of partc classes that are
    not frozen, or to context variables; and functions whose results are cached
    (``functools.cache``, ``lru_cache``), named with "()"."""
    classes = {node.name for path in SOURCES for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ClassDef)}
    frozen, found = _frozen_classes(), []
    for path in SOURCES:
        tree, where = ast.parse(path.read_text()), str(path.relative_to(ROOT))
        found += [(where, f"{node.name}()") for node in ast.walk(tree) if _cached(node)]
        for node in tree.body:
            targets, value = [], None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            for target in targets:
                if not isinstance(target, ast.Name):
                    continue
                table = _is_mutable(value) and (target.id.lstrip("_").isupper()
                                                or target.id == "__all__")
                if (_is_mutable(value) and not table) or \
                        _class_instance(value, classes, frozen):
                    found.append((where, target.id))
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


def test_no_global_statements():
    found = [entry for path in SOURCES for entry in _globals(path)]
    assert not found, "global statements:\n" + "\n".join(found)


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
