"""Adding an evaluation or an arm is one module plus one registry line (kvjax.eval.suite says how). A throwaway
evaluation and a throwaway arm (a cache builder) are written as modules into a copy of the package and registered
with one line each (and its import); the main job, run from that copy, lists them, checks the arm as a known name,
runs the evaluation as a stage of its own and scores the arm through kvjax.eval.arms.make_arms. The installed
package, whose registries this never touches, knows neither."""

import json
import os
import shutil
import subprocess
import sys

from kvjax.job import command as launch
from kvjax.eval import suite

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BUILDER = '''"""A throwaway cache builder: the answering model's native cache with its values halved."""
from kvjax.builders.base import CacheBuilder
from kvjax.builders.native import NativePrefill


class HalvedValues(CacheBuilder):
    def __init__(self, model, name="halved"):
        self.model, self.name, self.native = tuple(model), name, NativePrefill(model)

    def build(self, tokens, lengths, capacity, clock):
        cache = self.native.build(tokens, lengths, capacity, clock)
        return cache.replace(values=tuple(v * 0.5 for v in cache.values))
'''

EVALUATION = '''"""A throwaway evaluation: the absolute sums of each arm's cache of the first held-out windows."""
import dataclasses

from kvjax.eval.suite.evaluation import Evaluation, unknown_arms


@dataclasses.dataclass(frozen=True)
class ThrowawayEval:
    enabled: bool = False
    windows: int = 2
    length: int = 16
    arms: tuple[str, ...] = ("target", "halved")


def run(ec, ctx):
    import numpy as np
    from kvjax.eval.arms import make_arms
    tokens = np.asarray(ctx.heldout[: ec.windows, : ec.length], np.int32)
    out = {}
    for arm in make_arms(ec.arms, ctx.source, ctx.target, ctx.map, ctx.final, ctx.cfg.arms):
        cache = arm.batch_fn(tokens, np.full(len(tokens), ec.length, np.int32))
        out[arm.name] = {kind: float(sum(np.abs(np.asarray(x)).sum() for x in getattr(cache, kind)))
                         for kind in ("keys", "values")}
    return out


def report(section, ctx):
    return ["## Throwaway", ""] + [f"- {arm}: {s}" for arm, s in section["sums"].items()] + [""]


EVALUATION = Evaluation(name="throwaway", settings=ThrowawayEval, run=run, metrics=lambda record, ctx: {"sums": record},
                        section=60, report=report, heldout=lambda ec, cfg: (ec.windows, ec.length),
                        preflight=lambda ec, cfg: unknown_arms("eval.throwaway", ec.arms))
'''

RUN = '''import json, sys
sys.path.insert(0, sys.argv[1])
import kvjax
assert kvjax.__file__.startswith(sys.argv[1]), kvjax.__file__
from kvjax import launch
from kvjax.eval import arms, suite
print(json.dumps({"evaluations": list(suite.NAMES), "arms": [a.name for a in arms.TABLE]}))
sys.exit(launch.main(sys.argv[2:]))
'''


def add_line(path: str, after: str, line: str) -> None:
    """Insert `line` after the line that starts with `after` (exactly one) in the file at `path`."""
    text = open(path).read()
    assert text.count("\n" + after) == 1, (path, after)
    head, tail = text.split("\n" + after, 1)
    first, rest = tail.split("\n", 1)
    open(path, "w").write(f"{head}\n{after}{first}\n{line}\n{rest}")


def test_an_evaluation_and_an_arm_are_a_module_and_a_registry_line_each(tmp_path, capsys):
    from test_launch import SMALL, tiny_pair
    pkg = tmp_path / "pkg"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(os.path.join(REPO, "kvjax"), pkg / "kvjax", ignore=ignore)
    shutil.copytree(os.path.join(REPO, "configs"), pkg / "configs", ignore=ignore)
    # the two modules
    (pkg / "kvjax" / "builders" / "throwaway.py").write_text(BUILDER)
    (pkg / "kvjax" / "eval" / "suite" / "throwaway.py").write_text(EVALUATION)
    # the two registry lines (each with its import)
    suite_init, arms = str(pkg / "kvjax" / "eval" / "suite" / "__init__.py"), str(pkg / "kvjax" / "eval" / "arms.py")
    add_line(suite_init, "from __future__ import annotations", "from kvjax.eval.suite import throwaway")
    add_line(suite_init, "EVALUATIONS: tuple[Evaluation, ...] = (", "    throwaway.EVALUATION,")
    add_line(arms, "from __future__ import annotations", "from kvjax.builders.throwaway import HalvedValues")
    add_line(arms, "TABLE = (", '    ArmSpec("halved", "halved values", "#000000", lambda c: HalvedValues(c.target)),')

    source, target = tiny_pair(str(tmp_path))
    out = tmp_path / "run"
    keep = {"--config.data.", "--config.map."}  # the tiny calibration; every evaluation but the throwaway one off
    argv = ["--config=toy", f"--config.output_dir={out}", f"--config.source.path={source}",
            f"--config.target.path={target}", *[a for a in SMALL if a.startswith(tuple(keep))],
            "--config.residual.steps=0", *[f"--config.eval.{e}.enabled=false" for e in suite.NAMES],
            "--config.eval.throwaway.enabled=true", "--config.eval.mc.arms=target,halved"]
    # the installed package has neither: the job refuses both names before any work
    assert launch.main(argv) == 2 and "unknown config field 'eval.throwaway.enabled'" in capsys.readouterr().err
    assert launch.main([a for a in argv if "throwaway" not in a]) == 2
    assert "unknown arms ['halved']" in capsys.readouterr().err and not out.exists()

    proc = subprocess.run([sys.executable, "-c", RUN, str(pkg), *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    listed = json.loads(proc.stdout.splitlines()[0])
    assert listed["evaluations"] == ["throwaway", *suite.NAMES] and listed["arms"][0] == "halved"
    assert [p.name for p in (out / "eval").glob("*.json")] == ["throwaway.json"]  # the only evaluation that ran
    assert "stage throwaway  done" in (out / "run.log").read_text()
    sums = json.loads((out / "metrics.json").read_text())["throwaway"]["sums"]
    assert set(sums) == {"target", "halved"} and sums["target"]["values"] > 0
    assert sums["halved"]["keys"] == sums["target"]["keys"]  # the builder's cache: the native one, values halved
    assert abs(sums["halved"]["values"] - 0.5 * sums["target"]["values"]) < 1e-4 * sums["target"]["values"]
    assert "## Throwaway" in (out / "report.md").read_text()
