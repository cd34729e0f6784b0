"""How the code is laid out, in the figures the "one home for each fact" work is held to.

    python benchmarks/architecture_metrics.py            # this checkout
    python benchmarks/architecture_metrics.py --at REV   # another commit (git worktree)

Prints: modules directly in partc/, modules over 900 lines, imports inside function
bodies (and how many carry a comment naming the cycle they break), hand-written
serializers (``to_dict``/``from_dict``/``to_json``/``from_json`` methods), classes that
carry device figures, process-wide state (as tests/test_architecture.py finds it), and
the files that name one device figure (``--figure``, default fsdp_step_overhead_s).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERIALIZERS = {"to_dict", "from_dict", "to_json", "from_json"}
# A class carries device figures when it has this many of the preset's figure fields.
DEVICE_FIELDS = {"hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth",
                 "link_latency_s", "op_overhead_s", "fsdp_step_overhead_s",
                 "flops_efficiency", "devices_per_node", "comm_overlap"}


def sources(root: Path) -> list[Path]:
    return sorted((root / "partc").rglob("*.py")) + sorted((root / "passes").rglob("*.py"))


def nested_imports(tree: ast.AST, lines: list[str]) -> tuple[int, int]:
    """Imports inside function bodies, and how many of them have a comment on their
    line or the line above (the cycle they break, or why they wait)."""
    total = commented = 0
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                total += 1
                near = lines[node.lineno - 1] + lines[max(node.lineno - 2, 0)]
                commented += "#" in near
    return total, commented


def device_classes(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names = {t.target.id for t in node.body
                     if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
            if len(names & DEVICE_FIELDS) >= 4:
                found.append(node.name)
    return found


def measure(root: Path, figure: str) -> dict[str, object]:
    files = sources(root)
    trees = {path: ast.parse(path.read_text()) for path in files}
    nested = [nested_imports(tree, path.read_text().splitlines())
              for path, tree in trees.items()]
    serializers = {path: sum(isinstance(node, ast.FunctionDef) and node.name in SERIALIZERS
                             for node in ast.walk(tree)) for path, tree in trees.items()}
    profile = root / "partc" / "calibrate"
    of_profile = sum(n for path, n in serializers.items() if profile in path.parents
                     or path == root / "partc" / "calibrate.py")
    big = sorted(f"{path.relative_to(root)} ({len(path.read_text().splitlines())})"
                 for path in files if len(path.read_text().splitlines()) > 900)
    naming = sorted(str(path.relative_to(root)) for path in
                    [*files, *sorted((root / "tests").rglob("*.py"))]
                    if figure in path.read_text())
    return {
        "modules directly in partc/": len(list((root / "partc").glob("*.py"))),
        "modules over 900 lines": f"{len(big)} {big}" if big else 0,
        "imports inside functions (with a comment)":
            f"{sum(n for n, _ in nested)} ({sum(c for _, c in nested)})",
        "hand-written serializers (plan, budget, spec)": sum(serializers.values()) - of_profile,
        "  and of the calibrate profile": of_profile,
        "  where": ", ".join(sorted(f"{path.relative_to(root)} {n}" for path, n
                                    in serializers.items() if n and path.parent != profile)),
        "device-figure classes": ", ".join(sorted(
            name for tree in trees.values() for name in device_classes(tree))),
        "process-wide state": len(process_state(root)),
        f"files naming {figure}": f"{len(naming)}: {', '.join(naming)}",
    }


def process_state(root: Path) -> list[tuple[str, str]]:
    """tests/test_architecture.py's finder (this checkout's), run on ``root``'s sources."""
    sys.path.insert(0, str(REPO))
    from tests import test_architecture as architecture

    architecture.ROOT, architecture.SOURCES = root, sources(root)
    try:
        return architecture.process_wide_state()
    finally:
        architecture.ROOT, architecture.SOURCES = REPO, sources(REPO)


def at_commit(rev: str, figure: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["git", "worktree", "add", "--detach", "-q", tmp, rev], cwd=REPO,
                       check=True)
        try:
            return measure(Path(tmp), figure)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tmp], cwd=REPO,
                           check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", help="a commit to measure instead of the checkout")
    parser.add_argument("--figure", default="fsdp_step_overhead_s")
    args = parser.parse_args()
    figures = at_commit(args.at, args.figure) if args.at else measure(REPO, args.figure)
    for name, value in figures.items():
        print(f"{name:45} {value}")


if __name__ == "__main__":
    main()
