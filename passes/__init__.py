"""partc's compiler passes, one file per pass; ``analyze`` runs the front half.

Installed as ``partc.passes`` (see pyproject.toml); the repository folder is ``passes/``.
"""

from partc.passes.pipeline import analyze

__all__ = ["analyze"]
