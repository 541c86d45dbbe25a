"""launch/venv, the README's two commands' wrapper: which extra it installs for which command, against a stub
environment (its python records what it is asked to do, so nothing is downloaded)."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def repo(tmp_path):
    """A copy of launch/venv beside a pyproject.toml and a .venv whose python logs its arguments."""
    (tmp_path / "launch").mkdir()
    shutil.copy(os.path.join(ROOT, "launch", "venv"), tmp_path / "launch" / "venv")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'stub'\n")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    stub = bin_dir / "python"
    stub.write_text(f'#!/usr/bin/env bash\necho "$*" >> "{tmp_path}/calls"\n')
    stub.chmod(0o755)
    return tmp_path


def run(repo, *command, extra=None):
    env = {k: v for k, v in os.environ.items() if k != "KVJAX_EXTRA"}
    if extra is not None:
        env["KVJAX_EXTRA"] = extra
    return subprocess.run([str(repo / "launch" / "venv"), *command], env=env, capture_output=True, text=True)


def calls(repo) -> list[str]:
    path = repo / "calls"
    return path.read_text().splitlines() if path.exists() else []


def installs(repo) -> list[str]:
    """What was installed, in order: the -e target of each pip or uv install of kvjax."""
    return [c.split("-e ")[1] for c in calls(repo) if " install " in f"{c} " and "-e " in c]


def with_uv(repo, code: int = 0):
    """A stub uv in the venv that logs its arguments and exits with `code`."""
    uv = repo / ".venv" / "bin" / "uv"
    uv.write_text(f'#!/usr/bin/env bash\necho "uv $*" >> "{repo}/calls"\nexit {code}\n')
    uv.chmod(0o755)


def test_kvjax_entry_points_get_the_audio_extra_and_everything_else_the_test_extra(repo):
    root = str(repo)
    assert run(repo, "python", "-m", "kvjax.launch", "--help").returncode == 0
    assert installs(repo) == [f"{root}[audio]"]  # no torch for the main job
    assert calls(repo)[-1] == "-m kvjax.launch --help"  # then the command itself, in the environment
    assert run(repo, "python", "-m", "kvjax.serve").returncode == 0
    assert installs(repo) == [f"{root}[audio]"]  # installed once
    assert run(repo, "python", "-m", "pytest", "-q").returncode == 0
    assert installs(repo) == [f"{root}[audio]", f"{root}[test]"]
    assert run(repo, "python", "-m", "kvjax.launch").returncode == 0  # the test extra holds the audio extra's
    assert run(repo, "python", "-m", "launch.bench.foundation").returncode == 0
    assert len(installs(repo)) == 2
    os.utime(repo / "pyproject.toml", (2e9, 2e9))  # pyproject.toml changed since: reinstalled
    assert run(repo, "python", "-m", "kvjax.launch").returncode == 0
    assert installs(repo)[-1] == f"{root}[audio]"


def test_a_fresh_venv_installs_the_test_extra_for_any_other_command_or_when_asked(repo):
    assert run(repo, "python", "-c", "print(1)").returncode == 0
    assert installs(repo) == [f"{repo}[test]"]
    (repo / ".venv" / ".kvjax-installed-test").unlink()
    assert run(repo, "python", "-m", "kvjax.launch", extra="test").returncode == 0
    assert installs(repo)[-1] == f"{repo}[test]"


def test_bad_use_exits_2_naming_the_fix_before_installing_anything(repo):
    got = run(repo)
    assert got.returncode == 2 and "usage: launch/venv COMMAND" in got.stderr
    got = run(repo, "python", "-m", "kvjax.launch", extra="gpu")
    assert got.returncode == 2 and "KVJAX_EXTRA=gpu: use test, audio or plan" in got.stderr
    assert calls(repo) == []


def test_the_audio_extra_goes_in_through_uv_and_the_test_extra_through_pip(repo):
    with_uv(repo)
    assert run(repo, "python", "-m", "kvjax.launch").returncode == 0
    bootstrap, install = calls(repo)[:2]
    assert bootstrap.startswith("-m pip install") and bootstrap.endswith(" uv")  # uv from PyPI, as a pip package
    assert install.startswith("uv pip install") and f"--python {repo}/.venv/bin/python" in install
    assert installs(repo) == [f"{repo}[audio]"]
    assert run(repo, "python", "-m", "pytest").returncode == 0
    test_install = [c for c in calls(repo) if c.endswith("[test]")]
    assert len(test_install) == 1 and test_install[0].startswith("-m pip install")


def test_pip_installs_the_audio_extra_when_uv_fails(repo):
    with_uv(repo, code=1)
    assert run(repo, "python", "-m", "kvjax.launch").returncode == 0
    # uv from pip, uv's install, pip's, the check that kvjax imports, the command
    assert [c.split()[0] for c in calls(repo)] == ["-m", "uv", "-m", "-c", "-m"]
    assert installs(repo) == [f"{repo}[audio]", f"{repo}[audio]"] and calls(repo)[2].startswith("-m pip install")
