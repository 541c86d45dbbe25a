"""Research probes: one-off measurements behind findings in WORKSPACE.md (each module's docstring gives its
command). Entry points of their own; nothing in kvjax or the main job imports them."""

from __future__ import annotations

import os


def model_dirs(parser, pairs: list[str]) -> dict[str, str]:
    """--models NAME=DIR pairs -> {name: dir}; a malformed pair or a directory without an HF checkpoint stops the
    command with a message that says what to pass."""
    models = dict(m.split("=", 1) for m in pairs if "=" in m)
    if len(models) != len(pairs):
        parser.error("--models takes NAME=DIR pairs, e.g. source=checkpoints/toy/source")
    for name, path in models.items():
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"--models {name}={path}: no HF checkpoint there (config.json missing)")
    return models
