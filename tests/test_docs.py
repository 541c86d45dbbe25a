"""The documentation serves users: README.md is a short guide with the two quick-start commands, every link and
every `python -m` module the docs name exists, and no tracked file names a machine-local temporary path or an
internal session number a reader cannot look up. README.md and docs/ are written for a reader who does not know the
project's history: no line too long to read, a small budget of commit ids (a result names the commit it measured once,
and older runs live in WORKSPACE.md's history), and no label that only the project's history defines (a variant
code like S12, a column named after a run number, "the seed"). The code's comments and docstrings say what the code
does: none names the issue or the founding brief that asked for it, or a commit. Reads files only (no JAX): about a
second."""

from __future__ import annotations

import ast
import io
import pathlib
import re
import subprocess
import tokenize
import warnings

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
TMP = "/" + "tmp" + "/"  # spelled in pieces so that this file does not name it
SESSION = re.compile(r"\b[Ss]essions?[- ]?\d+")
S = "sess" + "ion"  # spelled in pieces too
QUICK_START = ("launch/venv python -m kvjax.launch", "launch/venv python -m pytest")
README_MAX_LINES = 220
DOC_MAX_LINE = 250  # characters in any line of README.md and docs/*.md: a results row is a headline, not a log
DOC_MAX_COMMITS = 30  # distinct commit ids named in README.md and docs/ together
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")
# labels only the project's history defines: variant codes (S12, S49), the founding brief's name and number
JARGON = re.compile(r"\bS\d{2,3}\b|\b[Tt]he seed['’]s\b|\b[Ss]eed \d{3}\b")
# Python whose comments and docstrings must name no CODE_LABEL and no commit id
CODE_DIRS = ("kvjax", "configs", "launch", "experiments", "tests")
# in code: the request behind it (an issue's number, the founding brief's name or number) instead of what it does
CODE_LABEL = re.compile(r"\b[Ii]ssues? #?\d+|\b[Tt]he seed['’]s\b|\b[Ss]eed \d{3}\b|\bseed paper\b")
# files another engineer was editing when the code check landed, skipped by it until that work is merged: the lead
# empties this set after merging it, and the check then covers them too
RUN_COLUMN = re.compile(r"^\s*run \d+\s*$|\(run \d+\)", re.IGNORECASE)  # a column headed "run 3", "4 layers (run 4)"
# tracked files allowed to contain TMP, each with its reason; keep this tiny
TMP_ALLOWED = {
    "checkpoints/toy/eval/hellaswag.jsonl": "an eval item's text quotes Python's documentation (data, not our path)",
}
# `python -m NAME` modules the docs may name that live outside the tree
EXTERNAL_MODULES = {"pytest"}
DOC_CODE_SUFFIXES = {".py", ".md", ".json", ".toml", ".cfg", ".txt", ".yaml", ".yml", ".sh", ".sbatch"}
DOC_CODE_FILES = {"launch/venv", ".ci/run"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PYTHON_M = re.compile(r"python3?\s+-m\s+([A-Za-z_][\w.]*)")


def tracked_text_files() -> dict[str, str]:
    """Tracked files present in the work tree (a file deleted but not yet committed is skipped), text only."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    out = {}
    for name in names.decode().split("\0"):
        path = REPO / name
        if not name or not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary: weights, arrays, images
        out[name] = data.decode("utf-8", errors="replace")
    return out


def tmp_paths(files: dict[str, str]) -> list[str]:
    return [f"{name}:{i}" for name, text in files.items() if name not in TMP_ALLOWED
            for i, line in enumerate(text.splitlines(), 1) if TMP in line]


def session_numbers(files: dict[str, str]) -> list[str]:
    return [f"{name}:{i}: {m.group(0)}" for name, text in files.items()
            if pathlib.PurePath(name).suffix in DOC_CODE_SUFFIXES or name in DOC_CODE_FILES
            for i, line in enumerate(text.splitlines(), 1) for m in SESSION.finditer(line)]


def broken_links(doc: pathlib.Path, text: str) -> list[str]:
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        if not (doc.parent / target.split("#", 1)[0]).exists():
            bad.append(f"{doc.relative_to(REPO)}: ({target})")
    return bad


def missing_modules(doc: pathlib.Path, text: str) -> list[str]:
    bad = []
    for module in PYTHON_M.findall(text):
        module = module.rstrip(".")
        base = REPO.joinpath(*module.split("."))
        if module in EXTERNAL_MODULES or base.with_suffix(".py").is_file() or (base / "__main__.py").is_file():
            continue
        bad.append(f"{doc.relative_to(REPO)}: python -m {module}")
    return bad


def long_lines(name: str, text: str) -> list[str]:
    return [f"{name}:{i}: {len(line)} characters" for i, line in enumerate(text.splitlines(), 1)
            if len(line) > DOC_MAX_LINE]


def commit_ids(texts: dict[str, str]) -> dict[str, set[str]]:
    """Each commit id (7-40 hex digits that git resolves to a commit of this repository) -> the files naming it."""
    found: dict[str, set[str]] = {}
    for name, text in texts.items():
        for h in HEX.findall(text):
            found.setdefault(h, set()).add(name)
    if not found:
        return {}
    query = "".join(f"{h}^{{commit}}\n" for h in found)
    out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=REPO, input=query, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return {h: names for (h, names), line in zip(found.items(), out) if line.split()[1:2] == ["commit"]}


def history_labels(name: str, text: str) -> list[str]:
    lines = text.splitlines()
    bad = [f"{name}:{i}: {m.group(0)}" for i, line in enumerate(lines, 1) for m in JARGON.finditer(line)]
    for i, line in enumerate(lines[:-1], 1):
        if line.startswith("|") and re.match(r"\|\s*:?-{3,}", lines[i]):  # a table's header row
            bad += [f"{name}:{i}: column '{cell.strip()}'" for cell in line.strip("|").split("|")
                    if RUN_COLUMN.search(cell)]
    return bad


def code_prose(source: str) -> dict[int, str]:
    """Line number -> the comments and docstrings on that line of a Python source (a docstring: any string standing
    as a statement, its lines taken whole)."""
    lines = source.splitlines()
    prose: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            prose.setdefault(tok.start[0], []).append(tok.string)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # an invalid escape in a string is not this check's business
        tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for i in range(node.lineno, node.end_lineno + 1):
                prose.setdefault(i, []).append(lines[i - 1])
    return {i: " ".join(parts) for i, parts in sorted(prose.items())}


def code_files(files: dict[str, str]) -> dict[str, str]:
    """The Python files under CODE_DIRS."""
    return {name: text for name, text in files.items()
            if name.endswith(".py") and name.split("/", 1)[0] in CODE_DIRS}


def code_history_labels(files: dict[str, str]) -> list[str]:
    """`file:line: label` for each CODE_LABEL match and each commit id in the comments and docstrings of `files`.
    Only a file with a candidate line is parsed (most have none: parsing them all would take seconds)."""
    candidates = {(name, i): line for name, text in files.items() for i, line in enumerate(text.splitlines(), 1)
                  if CODE_LABEL.search(line) or HEX.search(line)}
    commits = commit_ids({f"{name}:{i}": line for (name, i), line in candidates.items() if HEX.search(line)})
    found = []
    for name in sorted({name for name, _ in candidates}):
        for i, prose in code_prose(files[name]).items():
            if (name, i) in candidates:
                found += [(name, i, m.group(0)) for m in CODE_LABEL.finditer(prose)]
                found += [(name, i, h) for h in HEX.findall(prose) if h in commits]
    return [f"{name}:{i}: {label}" for name, i, label in sorted(found)]


def docs() -> list[pathlib.Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.fixture(scope="module")
def files() -> dict[str, str]:
    return tracked_text_files()


def test_no_tracked_file_names_a_temporary_path(files):
    assert files, "git ls-files found nothing"
    found = tmp_paths(files)
    assert not found, f"tracked files name a path under {TMP} (use runs/, which git ignores, or --out): {found}"


def test_no_doc_or_code_cites_a_session_number(files):
    found = session_numbers(files)
    assert not found, f"name a measurement by its date and commit, not by a session number: {found}"


def test_readme_is_a_short_guide_with_the_quick_start():
    text = (REPO / "README.md").read_text()
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    for command in QUICK_START:
        assert command in text, f"README.md lost the quick-start command `{command}`"


def test_no_doc_line_is_too_long_to_read():
    bad = [b for doc in docs() for b in long_lines(str(doc.relative_to(REPO)), doc.read_text())]
    assert not bad, f"lines over {DOC_MAX_LINE} characters (split the table, move detail to a footnote): {bad}"


def test_the_docs_name_few_commits():
    found = commit_ids({str(doc.relative_to(REPO)): doc.read_text() for doc in docs()})
    assert len(found) <= DOC_MAX_COMMITS, (
        f"README.md and docs/ name {len(found)} commits (at most {DOC_MAX_COMMITS}): state a result's commit once, and "
        f"move older runs to WORKSPACE.md's history: {sorted((h, sorted(n)) for h, n in found.items())}")


def test_the_docs_use_no_label_only_the_history_defines():
    bad = [b for doc in docs() for b in history_labels(str(doc.relative_to(REPO)), doc.read_text())]
    assert not bad, f"name the setting or the claim instead of the project's label for it: {bad}"


def test_no_code_comment_names_an_issue_the_brief_or_a_commit(files):
    code = code_files(files)
    assert len(code) > 100, f"found only {len(code)} Python files under {CODE_DIRS}"
    found = code_history_labels(code)
    assert not found, (
        "say what the code does, not which issue or brief asked for it (name the claim itself, e.g. \"the method's "
        f"claim\"), and date a measurement and give its command instead of naming a commit: {found}")


def test_every_relative_link_in_the_docs_exists():
    bad = [b for doc in docs() for b in broken_links(doc, doc.read_text())]
    assert not bad, f"links to files that do not exist: {bad}"


def test_every_python_m_module_in_the_docs_exists():
    bad = [b for doc in docs() for b in missing_modules(doc, doc.read_text())]
    assert not bad, f"`python -m` names a module that is not in the tree: {bad}"


def test_the_checks_catch_what_they_look_for():
    """Each checker finds a planted problem (so a passing run means something)."""
    readme = REPO / "README.md"
    assert tmp_paths({"x.py": f"out = '{TMP}x'\n"}) == ["x.py:1"]
    assert session_numbers({"x.md": f"measured in {S} 12\n", "y.jsonl": f"{S} 3\n"}) == [f"x.md:1: {S} 12"]
    assert broken_links(readme, "[a](docs/no_such_page.md) [b](https://x.org/y) [c](#top)") == [
        "README.md: (docs/no_such_page.md)"]
    assert missing_modules(readme, "python -m kvjax.no_such_module and python -m pytest") == [
        "README.md: python -m kvjax.no_such_module"]
    assert long_lines("x.md", "short\n" + "y" * (DOC_MAX_LINE + 1) + "\n" + "z" * DOC_MAX_LINE) == [
        f"x.md:2: {DOC_MAX_LINE + 1} characters"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert commit_ids({"a.md": f"at {head[:7]} and {head}; not a commit: 0123456789abcdef0", "b.md": head[:7]}) == {
        head[:7]: {"a.md", "b.md"}, head: {"a.md"}}
    table = "| set | 2 layers (run 3) | run 4 | run time |\n|---|---|---|---|\n| run 3 | a | b | c |"  # body cells pass
    prose = "with S49 and the seed's goal, seed 004; --seed 5, the seed, Qwen3, S3\n"
    source = (f'"""A module (seed 004\'s claim; issue 22).\n\nMeasured at {head[:7]}."""\n'
              "seed = 4  # the seed's draw, as issues 18-23 had it\n"
              "text = 'issue 5 of the seed paper'  # a string used as a value is neither\n"
              "def f():\n    '''Not a commit: 0123456789abcdef0; the seed paper.'''\n")
    assert code_history_labels({"x.py": source}) == [
        "x.py:1: issue 22", "x.py:1: seed 004", f"x.py:3: {head[:7]}", "x.py:4: issues 18", "x.py:4: the seed's",
        "x.py:7: seed paper"]
    assert list(code_files({name: "" for name in ("kvjax/a.py", "kvjax/serve/app.py", "docs/x.py", "tests/t.py",
                                                  "kvjax/b.md")})) == ["kvjax/a.py", "kvjax/serve/app.py", "tests/t.py"]
    assert history_labels("x.md", prose + table) == [
        "x.md:1: S49", "x.md:1: the seed's", "x.md:1: seed 004", "x.md:2: column '2 layers (run 3)'",
        "x.md:2: column 'run 4'"]
