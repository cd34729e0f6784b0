"""``partc train --wandb PROJECT`` in one process: what the launcher hands ``wandb.init``.
(The logging itself is tests/runtime/test_telemetry.py's, with a stand-in module.)"""

from __future__ import annotations

import types

from partc.cli import launcher
from partc.cli.config import parse_config


def test_wandb_gets_the_runs_flags_and_mesh():
    """``--wandb PROJECT``: wandb.init's project, directory and config (the flags, the
    pins, the mesh the plan chose)."""
    config = parse_config(["m.py:f", "--steps", "3", "--wandb", "proj", "--log-dir", "logs",
                           "--tp", "2"])
    mesh = types.SimpleNamespace(pp=1, dp=1, tp=2)
    module = types.SimpleNamespace(plan=types.SimpleNamespace(mesh=mesh),
                                   global_batch_size=8)
    settings = launcher._wandb_settings(config, module)
    assert (settings["project"], settings["dir"]) == ("proj", "logs")
    assert {k: settings["config"][k] for k in ("steps", "lr", "tp", "pp",
                                                "global_batch_size")} == \
        {"steps": 3, "lr": 3e-4, "tp": 2, "pp": 1, "global_batch_size": 8}
    assert launcher._wandb_settings(parse_config(["m.py:f", "--steps", "3"]), module) is None
