"""Experiments: the measurements behind numbers and findings in README.md and docs/ that are no benchmark a user
runs (each module's docstring gives its command; run it from the repository root, `python -m experiments.NAME`).
They use kvjax and launch/; nothing in kvjax/, launch/ or tests/ imports them (tests/test_layout.py)."""

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
