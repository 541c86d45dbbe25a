"""The layout as a checked rule (README, "Layout"): kvjax/ is built in floors and a module imports only from its own
floor or below; launch/ is split into rooms that share no private names and import one another without a cycle;
experiments/ stands apart (nothing in kvjax/, launch/ or tests/ imports it); tests check the library and the commands
users run, never an experiment's internals; configs/ holds only run configs of the main job. The import checks read
the source (ast), so they run nothing and take well under a second."""

from __future__ import annotations

import ast
import os
import pathlib



REPO = pathlib.Path(__file__).resolve().parent.parent

# The floors, lowest first. A module's floor is that of the longest prefix below naming it (a package name covers
# its modules); that prefix is also its unit. Lazy imports inside functions count: they are dependencies all the
# same, only deferred.
FLOOR_NAMES = ("base", "models", "kernels", "map", "builders", "generation", "training", "decoding", "eval", "run",
               "commands")
FLOORS = {
    # 0 base: the vocabulary every floor uses; knows no kvjax type. Logical-axis rules and meshes, processes,
    # token windows, safetensors files, text sources, dataclass <-> flags, the host allocator, orbax checkpoints
    "kvjax.sharding": 0, "kvjax.distributed": 0, "kvjax.windows": 0, "kvjax.tensorfile": 0, "kvjax.corpus": 0,
    "kvjax.config_flags": 0, "kvjax.allocator": 0, "kvjax.checkpointing": 0, "kvjax.aot": 0,
    # 1 models: the families (config, params, rope, the one forward pass, prefill, decode), the KVCache pytree they
    # read and write, HF checkpoints <-> params (kvjax.hf, Whisper and Ultravox's included)
    "kvjax.models": 1, "kvjax.cache": 1, "kvjax.hf": 1,
    # 2 kernels: the map's map-and-insert kernel (XLA reference and Pallas bodies) and the features it works in
    "kvjax.kernels": 2,
    # 3 map: the map itself: pairing, ridge solves, the KVMap pytree and apply_map, its artifact, direct injection
    "kvjax.mapper": 3,
    # 4 builders: every way to give an answering model the cache of a prompt (native, mapped, pipelined, partial)
    "kvjax.builders": 4,
    # 5 generation: sampling, the one prompt preparation, the compiled decode loop, generate / generate_from
    "kvjax.generation": 5,
    # 6 training: fitting the map (calibration, ridge fit, residual on source-teacher KL), LM pretraining
    "kvjax.fitting": 6, "kvjax.pretrain": 6, "kvjax.pretrain_config": 6,
    # 7 decoding systems: the split path, speculative decoding and speculative KV transfer, the block drafter
    "kvjax.split": 7, "kvjax.speculative": 7, "kvjax.drafter": 7,
    # 8 eval: the evaluations, their arms and registry, the report, the quality gate that judges their metrics
    "kvjax.eval": 8,
    # 9 run: a run as the commands read it: its config, the checks before any work, its directory's layout
    "kvjax.run": 9,
    # 10 commands: the job that makes a run (`python -m kvjax.launch`: kvjax.job), the server and the compile-only
    # plan that read one, and the package's public API (kvjax)
    "kvjax.launch": 10, "kvjax.job": 10,
    "kvjax.serve": 10,  # `python -m kvjax.serve`: the OpenAI-compatible server over a run's map
    "kvjax.plan": 10,  # `python -m kvjax.plan`: every program of the job and the server compiled ahead of time
    "kvjax.audio": 10,  # the audio front end's public names (a facade over kvjax.models.whisper, .audio_lm, kvjax.hf)
}
# floors whose units are peers: a unit there imports no other unit of its floor (only lower floors)
STRICT = tuple(range(2, 8))
FACADE = "kvjax"  # kvjax/__init__.py re-exports every floor: only the job may import names from it
FACADE_FLOOR = 10

# launch/: what users run outside the library, one room per purpose
ROOMS = ("cluster", "bench", "toy")
# the measurements behind the docs' findings that are no benchmark: a room of its own, outside launch/, that nothing
# in kvjax/, launch/ or tests/ imports (git keeps the probes no current number needs)
EXPERIMENTS = "experiments"
# what no test may import: an experiment is checked by the number it gives, not by a test of its internals
NOT_FOR_TESTS = (EXPERIMENTS, "launch.research")
# the job (`python -m kvjax.launch`): the command and its stages, which the server must not import
JOB = ("kvjax.launch", "kvjax.job")

# modules that hold settings only: they must not import JAX (or optax, orbax, flax), directly or through what they
# import, so that a config can be built and checked without the machinery that runs it
JAX_FREE = ("kvjax.run.config", "kvjax.run.layout", "kvjax.run.preflight", "kvjax.fitting.residual_config",
            "kvjax.pretrain_config", "kvjax.eval.gate", "kvjax.config_flags", "kvjax.job.command", "kvjax.job.stages")
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax")


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def imports(name: str, path: pathlib.Path, known: set[str]) -> list[tuple[int, str, str, bool]]:
    """(line, imported module, imported name or "", at module level) for every import statement of a module; `from
    pkg import x` imports the module pkg.x when there is one, else the name x of pkg."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    top |= {id(n) for stmt in tree.body if isinstance(stmt, (ast.If, ast.Try)) for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "", id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub, "", id(node) in top) if sub in known
                           else (node.lineno, base, a.name, id(node) in top))
    return out


def unit_of(module: str) -> str | None:
    """The FLOORS entry a module belongs to; a settings module NAME_config belongs to NAME's unit."""
    best = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len, default=None)
    return None if best is None else best.removesuffix("_config")


def floor_of(module: str) -> int | None:
    if module == FACADE:
        return FACADE_FLOOR
    best = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len, default=None)
    return None if best is None else FLOORS[best]


def floor_violations(root: pathlib.Path) -> list[str]:
    mods = modules(root, "kvjax")
    out = []
    for name, path in mods.items():
        mine = floor_of(name)
        if mine is None:
            out.append(f"{path.relative_to(root)}: {name} has no floor; add it to FLOORS in tests/test_layout.py "
                       "(and to the README's Layout section)")
            continue
        for line, target, what, _ in imports(name, path, set(mods)):
            if target.split(".")[0] in ("launch", "configs", "tests", EXPERIMENTS):
                out.append(f"{path.relative_to(root)}:{line}: {name} imports {target}: the library must not "
                           "depend on entry points, experiments, run configs or tests")
            if target.split(".")[0] != "kvjax":
                continue
            theirs = floor_of(target)
            named = f"{target}.{what}" if what else target
            if theirs is not None and theirs > mine:
                out.append(f"{path.relative_to(root)}:{line}: {name} (floor {mine} {FLOOR_NAMES[mine]}) imports "
                           f"{named} (floor {theirs} {FLOOR_NAMES[theirs]}); move what it needs down a floor or "
                           "pass it in")
            elif theirs == mine and mine in STRICT and target != FACADE and unit_of(target) != unit_of(name):
                out.append(f"{path.relative_to(root)}:{line}: {name} imports {named}, a peer on its own floor "
                           f"({mine} {FLOOR_NAMES[mine]}); move what both need down a floor")
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node of `graph` (Tarjan), each sorted."""
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def import_cycles(root: pathlib.Path, packages: tuple[str, ...] = ("kvjax",)) -> list[list[str]]:
    """The import cycles among the modules of `packages` (lazy imports included), each as its modules sorted; a
    package importing its own submodules (a re-exporting __init__) is no cycle."""
    mods = {name: path for package in packages for name, path in modules(root, package).items()}
    return _cycles({name: {t for _, t, _, _ in imports(name, path, set(mods))
                           if t in mods and t != name and not name.startswith(t + ".") and t != FACADE}
                    for name, path in mods.items()})


def unit_cycles(root: pathlib.Path) -> list[list[str]]:
    """The import cycles among kvjax's units (FLOORS' entries: a package with all its modules, or a top-level
    module), function-level imports included: two units that import each other, however deep inside, are one unit
    in disguise. The facade (kvjax/__init__.py) is no unit."""
    mods = modules(root, "kvjax")
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        mine = unit_of(name)
        if mine is None:
            continue
        for _, target, _, _ in imports(name, path, set(mods)):
            theirs = unit_of(target) if target.startswith("kvjax.") else None
            if theirs is not None and theirs != mine:
                graph.setdefault(mine, set()).add(theirs)
    return _cycles(graph)


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == EXPERIMENTS:
        return EXPERIMENTS
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ROOMS) else ""


def private_crossings(root: pathlib.Path) -> list[str]:
    """`from launch.a.m import _x` (or `m._x` after importing m) where launch.a.m is in another room (experiments/
    is one room more)."""
    mods = {**modules(root, "launch"), **modules(root, EXPERIMENTS)}
    out = []
    for name, path in mods.items():
        bound = {}  # local name -> launch module it refers to
        for line, target, what, _ in imports(name, path, set(mods)):
            if not target.startswith("launch.") or room_of(target) == room_of(name):
                continue
            if what.startswith("_"):
                out.append(f"{path.relative_to(root)}:{line}: {name} imports {target}.{what}, a private name of the "
                           f"{room_of(target) or 'launch'} room; make it public or move it to kvjax")
            elif not what:
                bound[target.rpartition(".")[2]] = target
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in bound):
                out.append(f"{path.relative_to(root)}:{node.lineno}: {name} uses {bound[node.value.id]}.{node.attr}, "
                           "a private name of another room; make it public or move it to kvjax")
    return out


def forbidden_imports(root: pathlib.Path, package: str, forbidden: tuple[str, ...]) -> list[str]:
    """Every import (lazy ones included) in `package`'s modules of a module named by `forbidden` or under it."""
    mods = modules(root, package)
    return [f"{path.relative_to(root)}:{line}: {name} imports {target}{'.' + what if what else ''}"
            for name, path in mods.items() for line, target, what, _ in imports(name, path, set(mods))
            if any(target == f or target.startswith(f + ".") for f in forbidden)]


def heavy_imports(root: pathlib.Path, module: str) -> list[str]:
    """The chains by which `module` imports JAX & co. at module level (through kvjax modules too)."""
    mods = modules(root, "kvjax")
    out, seen, todo = [], set(), [(module, [module])]
    while todo:
        name, chain = todo.pop()
        if name in seen or name not in mods:
            continue
        seen.add(name)
        for _, target, _, top in imports(name, mods[name], set(mods)):
            if not top:
                continue
            if target.split(".")[0] in HEAVY:
                out.append(" -> ".join(chain + [target]))
            elif target.startswith("kvjax.") and target != FACADE:
                todo.append((target, chain + [target]))
    return out


# the pieces of one decoder layer (kvjax.models.decoder and the families): a loop over a model's layers that calls
# one of them is a forward pass written out again
LAYER_PIECES = ("qkv", "finish", "attend", "attend_block", "causal_attention", "layer_forward")
FORWARD_HOME = "kvjax/models/"  # where the one forward pass (and its layer loop) lives


def layer_loops(root: pathlib.Path, packages: tuple[str, ...] = ("kvjax", "launch")) -> list[str]:
    """Loops (for statements and comprehensions) over a model's layers (the iterable reads a `layers` attribute or
    name) whose body computes a layer (calls one of LAYER_PIECES), outside FORWARD_HOME."""

    def reads_layers(node) -> bool:
        return any((isinstance(n, ast.Attribute) and n.attr == "layers") or (isinstance(n, ast.Name) and n.id ==
                   "layers") for n in ast.walk(node))

    def computes_a_layer(nodes) -> bool:
        for node in nodes:
            for n in ast.walk(node):
                if isinstance(n, ast.Call):
                    f = n.func
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                    if name in LAYER_PIECES:
                        return True
        return False

    out = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(FORWARD_HOME):
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, (ast.For, ast.AsyncFor)):
                    hit = reads_layers(node.iter) and computes_a_layer(node.body)
                elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
                    body = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
                    hit = any(reads_layers(g.iter) for g in node.generators) and computes_a_layer(body)
                else:
                    continue
                if hit:
                    out.append(f"{rel}:{node.lineno}: a loop over a model's layers that computes them; compose "
                               "kvjax.models.decoder.forward (its taps, features, depth, reads) instead")
    return out


def test_no_module_imports_from_a_higher_floor():
    problems = floor_violations(REPO)
    assert not problems, "\n".join(problems)


def test_every_floor_is_used_and_every_table_entry_exists():
    mods = set(modules(REPO, "kvjax"))
    missing = [p for p in FLOORS if p not in mods]
    assert not missing, f"FLOORS names modules that do not exist: {missing}; update the table and the README"
    assert {floor_of(m) for m in mods} == set(range(len(FLOOR_NAMES)))


def test_no_import_cycles():
    cycles = import_cycles(REPO)
    assert not cycles, "import cycles (break each by moving what both need into a lower module): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_checks_catch_a_sideways_import_and_a_cycle(tmp_path):
    for pkg in ("builders", "mapper", "kernels", "models"):
        (tmp_path / "kvjax" / pkg).mkdir(parents=True)
        (tmp_path / "kvjax" / pkg / "__init__.py").write_text("")
    (tmp_path / "kvjax" / "__init__.py").write_text("")
    (tmp_path / "kvjax" / "split.py").write_text("from kvjax.speculative import api\n")  # decoding peer: sideways
    (tmp_path / "kvjax" / "speculative.py").write_text("from kvjax.builders import base\n")  # downward: fine
    (tmp_path / "kvjax" / "pretrain.py").write_text("from kvjax.pretrain_config import C\n")  # its own settings
    (tmp_path / "kvjax" / "pretrain_config.py").write_text("C = 1\n")
    (tmp_path / "kvjax" / "builders" / "base.py").write_text("X = 1\n")
    (tmp_path / "kvjax" / "models" / "config.py").write_text("def f():\n    from kvjax.models import rope\n")
    (tmp_path / "kvjax" / "models" / "rope.py").write_text("from kvjax.models.config import f\n")
    problems = floor_violations(tmp_path)
    assert len(problems) == 1 and problems[0].startswith("kvjax/split.py:1: kvjax.split imports kvjax.speculative"), \
        problems
    assert import_cycles(tmp_path) == [["kvjax.models.config", "kvjax.models.rope"]]


def test_the_check_catches_a_lazy_upward_import(tmp_path):
    (tmp_path / "kvjax" / "eval").mkdir(parents=True)
    (tmp_path / "kvjax" / "__init__.py").write_text("")
    (tmp_path / "kvjax" / "eval" / "__init__.py").write_text("")
    (tmp_path / "kvjax" / "eval" / "report.py").write_text("X = 1\n")
    (tmp_path / "kvjax" / "sharding.py").write_text("def f():\n    from .eval.report import X\n    return X\n")
    (tmp_path / "kvjax" / "windows.py").write_text("from kvjax import sharding\nfrom kvjax.eval import report\n")
    (tmp_path / "kvjax" / "elsewhere.py").write_text("")
    problems = floor_violations(tmp_path)
    assert len(problems) == 3, problems
    assert problems[0].startswith("kvjax/elsewhere.py: kvjax.elsewhere has no floor")
    assert ("kvjax/sharding.py:2: kvjax.sharding (floor 0 base) imports kvjax.eval.report.X (floor 8 eval)"
            in problems[1])
    assert "kvjax/windows.py:2: kvjax.windows (floor 0 base) imports kvjax.eval.report (floor 8 eval)" in problems[2]


def test_no_import_cycles_inside_launch_and_experiments():
    cycles = import_cycles(REPO, ("launch", EXPERIMENTS))
    assert not cycles, ("import cycles (function-level imports included; move what both need into the lower module, "
                        "or into kvjax where it is library behaviour): " + "; ".join(" <-> ".join(c) for c in cycles))


def test_nothing_in_launch_imports_an_experiment():
    problems = forbidden_imports(REPO, "launch", (EXPERIMENTS,))
    assert not problems, "launch/ holds what users run; move what both need into launch/ or kvjax:\n" + "\n".join(
        problems)


def test_no_test_imports_an_experiment():
    problems = forbidden_imports(REPO, "tests", NOT_FOR_TESTS)
    assert not problems, ("tests check the library and the commands users run: test the library behaviour in kvjax, "
                          "or run the command as a user does (subprocess):\n" + "\n".join(problems))


def test_the_launch_checks_catch_a_cycle_and_an_experiment_import(tmp_path):
    for pkg in ("launch", "launch/toy", "launch/bench", EXPERIMENTS, "tests"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        if pkg != "tests":
            (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "launch" / "toy" / "a.py").write_text("def f():\n    from launch.toy.b import g\n")  # lazy, still
    (tmp_path / "launch" / "toy" / "b.py").write_text("from launch.toy import a\ng = 1\n")
    (tmp_path / "launch" / "bench" / "c.py").write_text("from launch.toy.b import g\n")  # downward: fine
    (tmp_path / "launch" / "bench" / "d.py").write_text("def f():\n    from experiments import probe\n")
    (tmp_path / EXPERIMENTS / "probe.py").write_text("from launch.bench import c\nfrom launch.toy.b import g\n")
    (tmp_path / "tests" / "test_x.py").write_text(
        "import subprocess\nfrom launch.bench import c\n\ndef test_f():\n    from experiments.probe import g\n"
        "    import launch.research.old\n")
    assert import_cycles(tmp_path, ("launch", EXPERIMENTS)) == [["launch.toy.a", "launch.toy.b"]]
    assert forbidden_imports(tmp_path, "launch", (EXPERIMENTS,)) == [
        "launch/bench/d.py:2: launch.bench.d imports experiments.probe"]
    assert forbidden_imports(tmp_path, "tests", NOT_FOR_TESTS) == [
        "tests/test_x.py:5: tests.test_x imports experiments.probe.g", "tests/test_x.py:6: tests.test_x imports "
        "launch.research.old"]


def test_launch_rooms_share_no_private_names():
    problems = private_crossings(REPO)
    assert not problems, "\n".join(problems)


def test_the_room_check_catches_a_private_import(tmp_path):
    for room in ("launch/toy", "launch/bench", EXPERIMENTS):
        (tmp_path / room).mkdir(parents=True)
        (tmp_path / room / "__init__.py").write_text("")
    (tmp_path / "launch" / "__init__.py").write_text("")
    (tmp_path / "launch" / "toy" / "train.py").write_text("def _load():\n    pass\n")
    (tmp_path / "launch" / "toy" / "pruned.py").write_text("from launch.toy.train import _load\n")  # same room
    (tmp_path / "launch" / "bench" / "probe.py").write_text(
        "from launch.toy.train import _load\nfrom launch.toy import train\ntrain._load()\n")
    (tmp_path / EXPERIMENTS / "probe.py").write_text("from launch.toy.train import _load\n")
    problems = private_crossings(tmp_path)
    where = sorted(p.split(":")[:2] for p in problems)
    assert where == [["experiments/probe.py", "1"], ["launch/bench/probe.py", "1"], ["launch/bench/probe.py", "3"]], \
        problems


def test_launch_holds_rooms_only():
    loose = [p.name for p in (REPO / "launch").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"launch/{loose}: put each entry point in a room ({', '.join(ROOMS)}) and say so in the README"
    rooms = sorted(p.name for p in (REPO / "launch").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert rooms == sorted(ROOMS), (f"launch/ holds the rooms {', '.join(ROOMS)}; a measurement that is no benchmark "
                                    f"belongs in {EXPERIMENTS}/ (found {rooms})")


def test_settings_modules_do_not_import_jax():
    problems = [chain for m in JAX_FREE for chain in heavy_imports(REPO, m)]
    assert not problems, "settings modules import JAX & co.: " + "; ".join(problems)
    assert heavy_imports(REPO, "kvjax.fitting.residual")  # the check sees what it is meant to see


def test_configs_hold_only_run_configs_of_the_main_job(monkeypatch):
    from kvjax import config_flags
    from kvjax.run.config import RunConfig
    for var in ("KVJAX_SOURCE", "KVJAX_TARGET"):
        monkeypatch.setenv(var, "/nonexistent")  # configs that read model paths from the environment
    names = config_flags.available_configs()
    assert "toy" in names
    for name in names:
        assert isinstance(config_flags.load_named(name)[0], RunConfig), f"configs/{name}.py is not a RunConfig"
    assert not [f for f in os.listdir(REPO / "configs") if f.endswith(".py") and f.startswith("_") and
                f != "__init__.py"], "configs/ holds run configs only; helpers belong to the code that uses them"


def test_no_import_cycle_between_units():
    cycles = unit_cycles(REPO)
    assert not cycles, ("units that import each other (function-level imports included); move what both need into "
                        "the lower one: " + "; ".join(" <-> ".join(c) for c in cycles))


def test_the_unit_check_catches_a_lazy_cycle(tmp_path):
    for pkg in ("models", "mapper"):
        (tmp_path / "kvjax" / pkg).mkdir(parents=True)
        (tmp_path / "kvjax" / pkg / "__init__.py").write_text("")
    (tmp_path / "kvjax" / "__init__.py").write_text("")
    (tmp_path / "kvjax" / "hf.py").write_text("from kvjax.models.config import C\n")
    (tmp_path / "kvjax" / "models" / "config.py").write_text("C = 1\n")
    (tmp_path / "kvjax" / "models" / "audio.py").write_text("def load():\n    from kvjax.hf import load_hf\n")
    (tmp_path / "kvjax" / "mapper" / "kvmap.py").write_text("from kvjax.models import config\n")  # downward: fine
    assert unit_cycles(tmp_path) == [["kvjax.hf", "kvjax.models"]]
    assert import_cycles(tmp_path) == []  # no cycle between modules: only between their units


def test_no_layer_loop_outside_the_models():
    problems = layer_loops(REPO)
    assert not problems, "\n".join(problems)


def test_the_layer_loop_check_catches_a_forward_written_out(tmp_path):
    for pkg in ("kvjax/eval", "kvjax/models", "launch/bench"):
        (tmp_path / pkg).mkdir(parents=True)
    (tmp_path / "kvjax" / "eval" / "fidelity.py").write_text(
        "def f(params, cfg, x, cos, sin):\n"
        "    for i, lp in enumerate(params.layers):\n"
        "        q, k, v = qkv(lp, cfg, x, cos, sin)\n"
        "        x = finish(lp, cfg, x, causal_attention(q, k, v))\n"
        "    return x\n"
        "def g(params):\n"
        "    return [lp.q.shape for lp in params.layers]\n")  # reads the parameters, computes no layer: fine
    (tmp_path / "launch" / "bench" / "probe.py").write_text(
        "import kvjax.models.decoder as D\n"
        "def kv(layers, cfg, h, cos, sin):\n"
        "    return [D.qkv(lp, cfg, h, cos, sin)[1:] for lp in layers]\n")
    (tmp_path / "kvjax" / "models" / "decoder.py").write_text(
        "def forward(params, x):\n    for lp in params.layers:\n        x = finish(lp, x)\n")  # its home: fine
    assert [p.split(": ")[0] for p in layer_loops(tmp_path)] == ["kvjax/eval/fidelity.py:2",
                                                                  "launch/bench/probe.py:3"]


def test_the_server_does_not_import_the_job():
    problems = forbidden_imports(REPO, "kvjax/serve", JOB)
    assert not problems, ("the server reads a run (kvjax.run: its config, checks and directory layout), it does not "
                          "import the job that makes one:\n" + "\n".join(problems))


def test_the_server_check_catches_a_job_import(tmp_path):
    (tmp_path / "kvjax" / "serve").mkdir(parents=True)
    (tmp_path / "kvjax" / "serve" / "cli.py").write_text(
        "from kvjax.run.config import RunConfig\n"
        "def f():\n    from kvjax.launch import DEFAULT_CONFIG\n    from kvjax.job.command import main\n")
    assert forbidden_imports(tmp_path, "kvjax/serve", JOB) == [
        "kvjax/serve/cli.py:3: kvjax.serve.cli imports kvjax.launch.DEFAULT_CONFIG",
        "kvjax/serve/cli.py:4: kvjax.serve.cli imports kvjax.job.command.main"]


def registry_twins(root: pathlib.Path) -> list[str]:
    """Modules of kvjax/eval/ named as an evaluation's module in kvjax/eval/suite/ (the registry): one name, one
    module."""
    suite = {p.stem for p in (root / "kvjax" / "eval" / "suite").glob("*.py")} - {"__init__"}
    return sorted(f"kvjax/eval/{p.name}" for p in (root / "kvjax" / "eval").glob("*.py") if p.stem in suite)


def test_the_evaluation_registry_has_no_twins(tmp_path):
    twins = registry_twins(REPO)
    assert not twins, (f"{twins} share a name with an evaluation of kvjax/eval/suite/; name the computation after "
                       "what it computes (e.g. kvjax.eval.needle_retrieval beside the evaluation `retrieval`)")
    for d in ("kvjax/eval/suite",):
        (tmp_path / d).mkdir(parents=True)
    for f in ("kvjax/eval/suite/__init__.py", "kvjax/eval/suite/kl.py", "kvjax/eval/__init__.py", "kvjax/eval/kl.py",
              "kvjax/eval/stats.py"):
        (tmp_path / f).write_text("")
    assert registry_twins(tmp_path) == ["kvjax/eval/kl.py"]
