"""How fast the two commands report a mistake: a bad flag, an unknown config field and a missing checkpoint, each for
`python -m kvjax.launch` and `python -m kvjax.serve`, and a real config's hub corpus with the hub offline
(`python -m kvjax.launch --config=qwen32_8` with HF_HUB_OFFLINE=1, the toy checkpoints standing in for the real
ones: the fast checks read their headers only), run as the user runs them (a fresh process each), beside the floor
of `python -c pass`.

    launch/venv python -m launch.bench.fail_fast                  # 3 runs of each, the median
    launch/venv python -m launch.bench.fail_fast --repeats 5 --json runs/fail_fast.json

Prints per case the median wall seconds, the exit code, whether the process imported JAX (one extra run under
`python -X importtime`) and the first line of its message. Every case should exit non-zero with a message naming the
fix, without JAX, and write nothing (each run gets an --config.output_dir that must not exist afterwards). Run from
the repository root (the shipped configs name repository-relative paths).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax")
COMMANDS = ("kvjax.launch", "kvjax.serve")
CASES = {  # name -> (arguments, words its message must hold)
    "bad flag": (["--bogus"], ("--bogus",)),
    "unknown config field": (["--config.eval.mc.limt=3"], ("unknown config field 'eval.mc.limt'", "eval.mc.limit")),
    "missing checkpoint": (["--config.source.path=/nonexistent/checkpoint"],
                           ("/nonexistent/checkpoint", "does not exist", "--config.source.path")),
    "hub corpus offline": (["--config=qwen32_8"], ("fineweb-edu", "HF_HUB_OFFLINE=1 is set", "stdlib:train")),
}
# cases of one command only, and the environment they run in (beside this process's)
ONLY = {"hub corpus offline": "kvjax.launch"}
ENV = {"hub corpus offline": {"HF_HUB_OFFLINE": "1", "KVJAX_SOURCE": "checkpoints/toy/source",
                              "KVJAX_TARGET": "checkpoints/toy/pruned"}}


def run(argv: list[str], importtime: bool = False, env: dict | None = None) -> tuple[float, int, str, set[str]]:
    """(wall seconds, exit code, stderr without -X importtime's lines, modules imported (with importtime))."""
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), *argv]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - t0
    lines = proc.stderr.splitlines()
    modules = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")} - {"package"}
    message = "\n".join(line for line in lines if not line.startswith("import time:"))
    return seconds, proc.returncode, message, modules


def case_argv(command: str, args: list[str], out_dir: str) -> list[str]:
    return ["-m", command, *args, f"--config.output_dir={out_dir}"]


def measure(repeats: int) -> dict:
    floor = [run(["-c", "pass"])[0] for _ in range(repeats)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for command in COMMANDS:
            for name, (args, words) in CASES.items():
                if ONLY.get(name, command) != command:
                    continue
                out_dir = os.path.join(tmp, f"{command}_{name.replace(' ', '_')}")
                argv = case_argv(command, args, out_dir)
                times, codes, message = [], set(), ""
                for _ in range(repeats):
                    seconds, code, message, _ = run(argv, env=ENV.get(name))
                    times.append(seconds)
                    codes.add(code)
                _, _, _, modules = run(argv, importtime=True, env=ENV.get(name))
                jax = sorted(m for m in modules if m.split(".")[0] in HEAVY)
                rows.append({"command": command, "case": name, "seconds": statistics.median(times),
                             "exit": sorted(codes), "jax_imported": bool(jax),
                             "message_ok": all(w in message for w in words), "wrote": os.path.exists(out_dir),
                             "traceback": "Traceback" in message,
                             "first_line": message.strip().splitlines()[0] if message.strip() else ""})
    return {"python_c_pass_s": statistics.median(floor), "repeats": repeats, "cases": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="runs of each case (the median is reported)")
    p.add_argument("--json", default="", help="also write the results here")
    a = p.parse_args(argv)
    res = measure(a.repeats)
    print(f"python -c pass: {res['python_c_pass_s']:.2f} s (median of {a.repeats})")
    print(f"{'command':<14} {'case':<22} {'s':>6} {'exit':>5} {'jax':>4}  first line of the message")
    bad = 0
    for r in res["cases"]:
        ok = (0 not in r["exit"] and r["message_ok"] and not r["jax_imported"] and not r["wrote"]
              and not r["traceback"])
        bad += not ok
        print(f"{r['command']:<14} {r['case']:<22} {r['seconds']:6.2f} {','.join(map(str, r['exit'])):>5} "
              f"{'yes' if r['jax_imported'] else 'no':>4}  {r['first_line'][:110]}{'' if ok else '   <-- NOT OK'}")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
