"""Load and fault tooling for `python -m kvjax.serve`: N concurrent clients x M requests per topology, every answer
checked against offline `kvjax.split_generate`.

    python -m launch.bench.load                                   # toy: serial, batched, disaggregated x 1/8/32/128
    python -m launch.bench.load --topologies=disaggregated --concurrency=32 --kill-prefill   # fault run
    python -m launch.bench.load --topologies=batched --concurrency=32 --soak=600              # soak: RSS, slots

For each topology it starts the server as a subprocess on a free localhost port (warmed up: every prefill bucket
compiled before timing; JAX's persistent compilation cache shared between the servers), runs each concurrency level
(clients stream greedy completions of held-out toy prompts, 256-1K tokens, 64 new tokens; a 429 waits Retry-After
and retries), and stops the server. Prompts come from a pool of `--prompts` held-out windows cut at `--lengths`
distinct lengths, so the offline reference (one split_generate per prompt, alone, with the run's gate) compiles a
few programs; it is computed first and cached in the output directory.

Per level it records TTFT, inter-token latency, end-to-end latency (p50/p99), aggregate tokens/s (generated tokens /
wall time of the level), errors, lost or hung requests (no answer within --timeout) and answers that differ from
offline; the report is OUT/report.md (table), OUT/load.json (everything) and OUT/load.png (chart).

Bounded by construction: localhost only, a fixed number of requests, a client timeout on every request, a wall
limit per level (--level-timeout) after which the clients are cancelled and counted as hung.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST = "127.0.0.1"  # localhost only


def args_parser():
    p = argparse.ArgumentParser(prog="python -m launch.bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="toy")
    p.add_argument("--map", default="", help="serve this map directory (default: the config's run)")
    p.add_argument("--topologies", default="serial,batched,disaggregated")
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts in the pool")
    p.add_argument("--lengths", type=int, default=8, help="distinct prompt lengths in the pool")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--max-prefill-batch", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600.0, help="client timeout per request (s)")
    p.add_argument("--level-timeout", type=float, default=1800.0, help="wall limit per concurrency level (s)")
    p.add_argument("--kill-prefill", action="store_true",
                   help="disaggregated: kill the prefill worker once mid-level (POST /admin/faults)")
    p.add_argument("--soak", type=float, default=0.0, help="instead of levels: run for this many seconds")
    p.add_argument("--out", default="runs/serve_load")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for kvjax.serve")
    return p


# ---- prompts and the offline reference -------------------------------------------------------------------------

def prompt_pool(a) -> list[list[int]]:
    windows = np.load(os.path.join(REPO, "checkpoints/toy/eval/heldout_windows.npy"))  # held-out toy text
    lengths = np.linspace(a.min_len, a.max_len, a.lengths).astype(int)
    return [[int(t) for t in windows[i % len(windows), : lengths[i % len(lengths)]]] for i in range(a.prompts)]


def offline_reference(a, prompts, out_dir) -> tuple[list[list[int]], str]:
    """Greedy split_generate of each prompt alone (with the run's gate: the path the server takes), cut after the
    first EOS; cached by prompt pool, map and settings."""
    sys.path.insert(0, REPO)
    from kvjax.serve.cli import locate
    from kvjax.config_flags import build
    from kvjax.preflight import resolve_models
    from kvjax.run_config import RunConfig
    cfg = resolve_models(build(a.config, [], RunConfig))
    map_dir, gate_path = locate(cfg, a.config, a.map, "")
    key = hashlib.sha256(json.dumps([prompts, os.path.abspath(map_dir), a.new_tokens,
                                     os.path.getmtime(os.path.join(map_dir, "manifest.json"))]).encode()).hexdigest()
    cache = os.path.join(out_dir, "offline.json")
    if os.path.isfile(cache):
        with open(cache) as f:
            saved = json.load(f)
        if saved["key"] == key:
            return saved["answers"], saved["path"]
    import jax.numpy as jnp

    import kvjax
    source = kvjax.load_hf(cfg.source.path, dtype=jnp.dtype(cfg.source.dtype))
    target = kvjax.load_hf(cfg.target.path, dtype=jnp.dtype(cfg.target.dtype))
    kvmap = kvjax.load_map(map_dir, source.cfg, target.cfg)
    gate = kvjax.load_gate(gate_path) if gate_path else True
    eos = set(target.cfg.eos_token_ids)
    answers, path = [], "split"
    t0 = time.time()
    for i, p in enumerate(prompts):
        res = kvjax.split_generate(source, target, kvmap, [p], a.new_tokens, gate=gate)
        ids = [int(t) for t in np.asarray(res.tokens)[0]]
        cut = next((j + 1 for j, t in enumerate(ids) if t in eos), len(ids))
        answers.append(ids[:cut])
        path = res.path
        print(f"offline {i + 1}/{len(prompts)} ({len(p)} tokens, {time.time() - t0:.0f}s)", flush=True)
    with open(cache, "w") as f:
        json.dump({"key": key, "answers": answers, "path": path, "map": map_dir}, f)
    return answers, path


# ---- the server ------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, a, topology: str, out_dir: str, faults: bool):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        capacity = -(-(a.max_len + a.new_tokens) // 128) * 128
        cmd = [sys.executable, "-m", "kvjax.serve", f"--config={a.config}", "--host", HOST, "--port", str(self.port),
               "--topology", topology, "--slots", str(a.slots), "--capacity", str(capacity),
               "--max-prefill-batch", str(a.max_prefill_batch), "--warmup", f"{a.min_len}:{a.max_len}",
               "--request-timeout", str(a.timeout), "--max-queue", "1024", *a.server_arg]
        if a.map:
            cmd += ["--map", a.map]
        if faults:
            cmd.append("--enable-fault-injection")
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                                                       os.path.join(out_dir, "jax_cache")),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONPATH=REPO)
        self.log_path = os.path.join(out_dir, f"server_{topology}.log")
        self.log = open(self.log_path, "w")
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, seconds: float = 1200.0) -> None:
        import httpx
        deadline = time.time() + seconds
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"the server was not ready within {seconds:.0f}s; see {self.log_path}")

    def rss_mb(self) -> float:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---- clients ---------------------------------------------------------------------------------------------------

async def one_request(client, url, prompt, a, model) -> dict:
    """One streamed greedy completion: timings, token ids, and what went wrong."""
    body = {"model": model, "prompt": prompt, "max_tokens": a.new_tokens, "temperature": 0, "stream": True}
    rec = {"ids": [], "ttft": None, "itl": [], "e2e": None, "error": None, "retries": 0, "hung": False}
    while True:
        t0 = time.perf_counter()
        last = None
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code == 429:
                    await r.aread()
                    rec["retries"] += 1
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                    continue
                if r.status_code != 200:
                    rec["error"] = f"{r.status_code}: {(await r.aread()).decode()[:200]}"
                    return rec
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        rec["error"] = chunk["error"]["message"][:200]
                        break
                    ids = chunk["choices"][0].get("token_ids", []) if chunk["choices"] else []
                    if ids:
                        now = time.perf_counter()
                        if rec["ttft"] is None:
                            rec["ttft"] = now - t0
                        else:
                            rec["itl"].append(now - last)
                        last = now
                        rec["ids"] += ids
            rec["e2e"] = time.perf_counter() - t0
            return rec
        except Exception as e:  # noqa: BLE001 - recorded: a timeout is a hung request
            import httpx
            rec["hung"] = isinstance(e, httpx.TimeoutException)
            rec["error"] = f"{type(e).__name__}: {e}"[:200]
            return rec


async def run_level(url, prompts, answers, a, concurrency: int, model: str, kill_after: int = 0,
                    soak: float = 0.0, rss=None) -> dict:
    import httpx
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    records = []
    done_count = 0
    killed = asyncio.Event()
    t_end = time.perf_counter() + soak if soak else None

    async def client_loop(c, client):
        nonlocal done_count
        j = 0
        while (j < a.requests) if not soak else (time.perf_counter() < t_end):
            i = (c * a.requests + j) % len(prompts)
            rec = await one_request(client, url, prompts[i], a, model)
            rec["prompt"], rec["match"] = i, rec["ids"] == answers[i] and not rec["error"]
            records.append(rec)
            done_count += 1
            j += 1
            if kill_after and done_count >= kill_after and not killed.is_set():
                killed.set()
                await client.post(url + "/admin/faults", json={"stage": "worker", "kind": "kill", "times": 1})

    samples = []

    async def sampler():
        while True:
            samples.append((time.perf_counter(), rss()))
            await asyncio.sleep(10 if soak else 2)

    async with httpx.AsyncClient(timeout=httpx.Timeout(a.timeout, connect=30), limits=limits) as client:
        t0 = time.perf_counter()
        sampling = asyncio.ensure_future(sampler()) if rss else None
        tasks = [asyncio.ensure_future(client_loop(c, client)) for c in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=a.level_timeout + soak)
        for t in pending:  # past the level's wall limit: whatever is still running is hung
            t.cancel()
        wall = time.perf_counter() - t0
        if sampling:
            sampling.cancel()
        metrics = (await client.get(url + "/metrics")).text
        health = (await client.get(url + "/health")).json()
    return summarize(records, wall, concurrency, len(pending), metrics, health, samples)


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def summarize(records, wall, concurrency, hung_clients, metrics_text, health, samples) -> dict:
    ok = [r for r in records if not r["error"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    e2e = [r["e2e"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    tokens = sum(len(r["ids"]) for r in ok)
    active = next((float(line.split()[1]) for line in metrics_text.splitlines()
                   if line.startswith("kvjax_active_slots ")), float("nan"))
    return {"concurrency": concurrency, "requests": len(records), "ok": len(ok),
            "errors": len(records) - len(ok), "error_messages": sorted({r["error"] for r in records if r["error"]})[:5],
            "hung": sum(r["hung"] for r in records) + hung_clients,
            "mismatches": sum(1 for r in ok if not r["match"]), "retries_429": sum(r["retries"] for r in records),
            "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall if wall else 0.0,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99), "active_slots_after": active,
            "health_after": health.get("status"), "rss_mb": [(round(t, 1), round(m, 1)) for t, m in samples]}


# ---- report ----------------------------------------------------------------------------------------------------

def report(results: dict, out_dir: str, command: str) -> None:
    rows = ["| topology | clients | requests | ok | errors | hung | != offline | 429 retries | tokens/s | TTFT p50 (s) "
            "| TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) | e2e p50 (s) | e2e p99 (s) |", "|" + "---|" * 15]
    for topo, levels in results.items():
        for r in levels:
            rows.append(f"| {topo} | {r['concurrency']} | {r['requests']} | {r['ok']} | {r['errors']} | {r['hung']} | "
                        f"{r['mismatches']} | {r['retries_429']} | {r['tokens_per_s']:.0f} | {r['ttft_p50']:.3f} | "
                        f"{r['ttft_p99']:.3f} | {1e3 * r['itl_p50']:.1f} | {1e3 * r['itl_p99']:.1f} | "
                        f"{r['e2e_p50']:.2f} | {r['e2e_p99']:.2f} |")
    text = f"# kvjax.serve under load\n\n`{command}`\n\n" + "\n".join(rows) + "\n"
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(text)
    print(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for topo, levels in results.items():
            c = [r["concurrency"] for r in levels]
            axes[0].plot(c, [r["tokens_per_s"] for r in levels], "o-", label=topo)
            axes[1].plot(c, [r["ttft_p99"] for r in levels], "o-", label=topo)
        for ax, title in zip(axes, ("aggregate tokens/s", "TTFT p99 (s)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_title(title)
            ax.legend()
        axes[1].set_yscale("log")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "load.png"), dpi=100)
    except Exception as e:  # noqa: BLE001 - the table is the result; a chart failure must not lose it
        print(f"chart not drawn: {e}")


def main(argv=None) -> int:
    a = args_parser().parse_args(argv)
    out_dir = os.path.abspath(a.out)
    os.makedirs(out_dir, exist_ok=True)
    command = "python -m launch.bench.load " + " ".join(sys.argv[1:] if argv is None else argv)
    prompts = prompt_pool(a)
    answers, path = offline_reference(a, prompts, out_dir)
    print(f"offline reference: {len(prompts)} prompts, path {path}", flush=True)
    results_path = os.path.join(out_dir, "load.json")
    results = {}
    for topo in a.topologies.split(","):
        server = ServerProcess(a, topo, out_dir, faults=a.kill_prefill)
        try:
            t0 = time.time()
            server.wait_ready()
            print(f"{topo}: server ready in {time.time() - t0:.0f}s", flush=True)
            import httpx
            model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            results[topo] = []
            levels = [int(c) for c in a.concurrency.split(",")]
            for c in levels:
                kill_after = max(1, c * a.requests // 3) if a.kill_prefill and topo == "disaggregated" else 0
                r = asyncio.run(run_level(server.url, prompts, answers, a, c, model, kill_after, a.soak,
                                          rss=server.rss_mb))
                r["killed_prefill_worker"] = bool(kill_after)
                results[topo].append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "rss_mb"}), flush=True)
                with open(results_path, "w") as f:
                    json.dump({"command": command, "results": results}, f, indent=1)
        finally:
            server.stop()
    report(results, out_dir, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
