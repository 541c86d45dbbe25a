"""Load and fault tooling for `python -m kvjax.serve`: N concurrent clients x M requests per topology, every answer
checked against offline `kvjax.split_generate`.

    python -m launch.bench.load                                   # toy: serial, batched, disaggregated x 1/8/32/128
    python -m launch.bench.load --topologies=disaggregated --concurrency=32 --kill-prefill   # fault run
    python -m launch.bench.load --topologies=batched --concurrency=32 --soak=600              # soak: RSS, slots
    python -m launch.bench.load --workload=conversation --topologies=batched,batched+prefix  # multi-turn chats
    python -m launch.bench.load --workload=arrival --topologies=batched,batched+chunked       # a long prompt arrives
    python -m launch.bench.load --workload=code --topologies=batched,batched+lookup --repeats 3  # speculative decoding

For each topology it starts the server as a subprocess on a free localhost port (warmed up: every prefill bucket
compiled before timing; JAX's persistent compilation cache shared between the servers), runs each concurrency level
(clients stream greedy completions of held-out toy prompts, 256-1K tokens, 64 new tokens; a 429 waits Retry-After
and retries), and stops the server. Prompts come from a pool of `--prompts` held-out windows cut at `--lengths`
distinct lengths, so the offline reference (split_generate with the run's gate, prompts of equal length batched
`--offline-batch` at a time: the same answers as one call per prompt, which `--offline-batch=1` makes) compiles a
few programs; it is computed first and cached in the output directory (offline*.json).

A `--topologies` entry is an arm: a topology with server features after a plus, `batched+prefix` (the server's
prefix cache of transferred caches, reused by token-block prefix: `--prefix-cache-mb` of our `--prefix-mb`, and
`--prefix-block` if ours is given), `batched+chunked` (chunked prefill, long prompts prefilled in chunks between
decode steps: the server's `--max-step-tokens` of ours) or both (`batched+prefix+chunked`); results are named by the
whole entry. Speculative decoding is a feature too: `+lookup`, `+block` or `+combined` (the server's `--speculative`,
with our `--draft-len`, `--drafter` and `--draft-policy` when given), e.g. `batched+lookup`, `batched+prefix+lookup`.

With `--repeats N` (N > 1) every arm's server is started first and stays up, and each level runs N times with the
arms interleaved (level 1: arm 1, arm 2, ..., arm 1, arm 2, ...; then level 2): on a shared, noisy machine the arms
then see the same conditions, and the report gives each arm's medians and its tokens/s as a ratio to the first arm's
in the same repeat (median over the repeats).

Workloads (`--workload`):
- independent (default): each client sends `--requests` prompts of the pool, one after another.
- conversation: each client runs one `--turns`-turn conversation (client c: conversation c % `--conversations`,
  default the largest concurrency level; `--requests` is ignored). Every conversation opens with the same
  `--system-tokens` system prompt, then turn k sends system + user_1 + answer_1 + ... + user_k, the user messages
  (`--user-tokens`, distinct per conversation and turn) held-out text, answer_j the OFFLINE greedy answer of turn j:
  the prompts are fixed in advance, each turn is checked against offline, and a conversation whose answer differed
  goes on with the offline one. Reported besides the above: TTFT p50/p99 of turn 1 and of turns >= 2, per turn,
  and the server's prefix-cache counters over the level (hit rate, reused / looked-up tokens, evictions, bytes).
  An arm's server, and so its prefix cache, lives through all its levels: a level after the first finds the
  earlier levels' conversations cached (one level per run measures a cold cache).
- code (code editing): each client sends `--requests` prompts of a pool of `--prompts`: a request quotes a held-out
  "file" (`--file-tokens` tokens of held-out text, cut to whole lines) and asks for all of it back with one word
  renamed, and ends with the edited file's first `--lead-lines` lines, as the answer would start: the answer
  repeats the prompt's text, which is what prompt lookup drafts from. Every answer is checked against offline greedy.
- arrival (chunked prefill): `--decoders` clients each stream `--decode-tokens` greedy tokens after a
  `--short-tokens` prompt; once all decode (each has a token, or `--first-token-wait` s passed) and each has
  `--lead-tokens` (default a quarter of them; at most `--settle` s more), one client sends a `--long-tokens` prompt
  (max_tokens 8). Reported per arm: the decoders' inter-token latency p50/p99 from the long
  request's submission to its first token ("during") and in an equal window just before ("before"), the p99 ratio
  during / before, the long request's TTFT and the server's slowest steps during it (`load_report.slow_steps`);
  `--concurrency` is not used.

Per level it records TTFT, inter-token latency (between two chunks of tokens a client receives: with speculative
decoding a round's tokens arrive together), time per output token (TPOT: a request's time after its first token
over its later tokens), end-to-end latency (p50/p99), aggregate tokens/s (generated tokens / wall time of the level),
errors, lost or hung requests (no answer within --timeout) and answers that differ from offline, and from the
server's /metrics over the level its decode steps by kind and, per drafter, drafted and accepted tokens and the
acceptance length (tokens a request emitted per verify round); the report is OUT/report.md (table), OUT/load.json (everything) and OUT/load.png (chart).

The workloads' prompts, their offline answers and the server sizes they need are launch.bench.load_workloads; the
summaries, tables and charts launch.bench.load_report.

Bounded by construction: localhost only, a fixed number of requests, a client timeout on every request, a wall
limit per level (--level-timeout) after which the clients are cancelled and counted as hung.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

from kvjax.serve.config import TOPOLOGIES, EngineConfig
from launch.bench.load_report import arrival_summary, report, summarize, turn_summary
from launch.bench.load_workloads import (LONG_NEW_TOKENS, REPO, Plan, arrival_plan, code_plan, conversation_plan,
                                         independent_plan, levels)

HOST = "127.0.0.1"  # localhost only
WORKLOADS = ("independent", "conversation", "arrival", "code")
DRAFTERS = ("lookup", "block", "combined")  # arm features: the server's --speculative
# the server's prefix-cache counters (Prometheus counters: NAME_total) and gauges
PREFIX_COUNTERS = ("lookups", "hits", "lookup_tokens", "reused_tokens", "evictions")
PREFIX_GAUGES = ("bytes", "blocks")


def args_parser():
    p = argparse.ArgumentParser(prog="python -m launch.bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="toy")
    p.add_argument("--map", default="", help="serve this map directory (default: the config's run)")
    p.add_argument("--workload", choices=WORKLOADS, default="independent",
                   help="independent prompts, multi-turn conversations, a long prompt arriving during decode, or "
                   "code editing (a file quoted and asked for back with an edit)")
    p.add_argument("--topologies", default="serial,batched,disaggregated",
                   help="arms: TOPOLOGY[+prefix][+chunked][+lookup|+block|+combined], comma-separated")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each level this many times with the arms interleaved (every server up at once); "
                   "report medians and ratios to the first arm")
    p.add_argument("--concurrency", default="1,8,32,128", help="client counts (levels); not used by arrival")
    p.add_argument("--requests", type=int, default=4, help="requests per client (the independent and code workloads)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts in the pool (independent, code)")
    p.add_argument("--lengths", type=int, default=8, help="distinct prompt lengths in the pool")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--max-prefill-batch", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600.0, help="client timeout per request (s)")
    p.add_argument("--level-timeout", type=float, default=1800.0, help="wall limit per concurrency level (s)")
    p.add_argument("--kill-prefill", action="store_true",
                   help="disaggregated: kill the prefill worker once mid-level (POST /admin/faults)")
    p.add_argument("--soak", type=float, default=0.0,
                   help="independent: instead of levels, run for this many seconds")
    g = p.add_argument_group("conversation")
    g.add_argument("--turns", type=int, default=4, help="turns per conversation, one request each (default 4)")
    g.add_argument("--conversations", type=int, default=0,
                   help="distinct conversations (default 0: the largest --concurrency level)")
    g.add_argument("--system-tokens", type=int, default=512, help="the shared system prompt (default 512)")
    g.add_argument("--user-tokens", type=int, default=96, help="each user message (default 96)")
    g = p.add_argument_group("code")
    g.add_argument("--file-tokens", type=int, default=384, help="tokens of held-out text per quoted file (default "
                   "384, cut to whole lines)")
    g.add_argument("--lead-lines", type=int, default=2,
                   help="the edited file's first lines that end the prompt (default 2)")
    g = p.add_argument_group("arrival")
    g.add_argument("--decoders", type=int, default=32,
                   help="clients decoding when the long prompt arrives (default 32)")
    g.add_argument("--short-tokens", type=int, default=256, help="each decoder's prompt (default 256)")
    g.add_argument("--decode-tokens", type=int, default=512,
                   help="each decoder's max_tokens (default 512: enough to stream through a 2K prompt read in "
                   "16-token pieces)")
    g.add_argument("--long-tokens", type=int, default=2000, help="the long prompt, max_tokens 8 (default 2000)")
    g.add_argument("--first-token-wait", type=float, default=30.0,
                   help="at most this long (s) for every decoder's first token before the long prompt (default 30)")
    g.add_argument("--lead-tokens", type=int, default=0,
                   help="then until every decoder has this many tokens (default 0: --decode-tokens / 4) ...")
    g.add_argument("--settle", type=float, default=2.0,
                   help="... or this long (s) has passed, the long prompt is sent (default 2)")
    g = p.add_argument_group("arms (+prefix, +chunked)")
    g.add_argument("--prefix-mb", type=int, default=1024,
                   help="+prefix: the server's --prefix-cache-mb (default 1024)")
    g.add_argument("--prefix-block", type=int, default=0,
                   help="+prefix: the server's --prefix-block (default 0: the server's default)")
    g.add_argument("--max-step-tokens", type=int, default=256,
                   help="+chunked: the server's --max-step-tokens (default 256)")
    g.add_argument("--draft-len", type=int, default=0,
                   help="+lookup/+block/+combined: the server's --draft-len (default 0: the server's default)")
    g.add_argument("--drafter", default="", help="+block/+combined: the server's --drafter (a block drafter "
                   "trained for the answering model)")
    g.add_argument("--draft-policy", default="", help="+lookup/+block/+combined: the server's --draft-policy "
                   "(default: the server's, auto)")
    p.add_argument("--offline-batch", type=int, default=8,
                   help="offline reference: equal-length prompts per split_generate call (default 8; 1: one call per "
                   "prompt)")
    p.add_argument("--out", default="runs/serve_load")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for kvjax.serve")
    return p


def check_args(a) -> list[str]:
    out = []
    if a.soak and a.workload != "independent":
        out.append("--soak runs the independent workload only")
    if a.workload == "conversation" and (a.turns < 1 or a.system_tokens + a.user_tokens < 2 or a.user_tokens < 1):
        out.append("conversation: --turns >= 1, --user-tokens >= 1 and a prompt of >= 2 tokens")
    if a.workload == "arrival" and (a.decoders < 1 or a.short_tokens < 2 or a.long_tokens < 2):
        out.append("arrival: --decoders >= 1, --short-tokens and --long-tokens >= 2")
    if a.workload == "code" and (a.file_tokens < 8 or a.lead_lines < 0):
        out.append("code: --file-tokens >= 8 and --lead-lines >= 0")
    if a.repeats < 1:
        out.append("--repeats must be >= 1")
    if a.repeats > 1 and (a.soak or a.kill_prefill or a.workload == "arrival"):
        out.append("--repeats interleaves the levels of --concurrency: not with --soak, --kill-prefill or arrival")
    return out


# ---- arms and the server ---------------------------------------------------------------------------------------

def parse_arm(entry: str, a) -> tuple[str, list[str]]:
    """'batched+prefix+chunked' -> ('batched', the server flags of its features)."""
    topology, *features = entry.strip().split("+")
    if topology not in TOPOLOGIES:
        raise ValueError(f"arm {entry!r}: topology {topology!r} is not one of {', '.join(TOPOLOGIES)}")
    flags, drafter = [], "none"
    for f in features:
        if f == "prefix":
            flags += ["--prefix-cache-mb", str(a.prefix_mb)]
            flags += ["--prefix-block", str(a.prefix_block)] if a.prefix_block else []
        elif f == "chunked":
            flags += ["--max-step-tokens", str(a.max_step_tokens)]
        elif f in DRAFTERS and drafter == "none":
            drafter = f
            flags += ["--speculative", f] + (["--draft-len", str(a.draft_len)] if a.draft_len else [])
            flags += ["--drafter", a.drafter] if a.drafter and f != "lookup" else []
            flags += ["--draft-policy", a.draft_policy] if a.draft_policy else []
        else:
            raise ValueError(f"arm {entry!r}: feature {f!r} is not prefix, chunked or one drafter of "
                             f"{', '.join(DRAFTERS)}")
    # the server's own checks, before minutes of offline reference decoding (kvjax.serve would refuse at start)
    engine = EngineConfig(topology=topology,
                          prefix_cache_mb=a.prefix_mb if "prefix" in features else 0.0,
                          prefix_block=a.prefix_block or EngineConfig.prefix_block,
                          max_step_tokens=a.max_step_tokens if "chunked" in features else 0,
                          speculative=drafter, draft_len=a.draft_len if drafter != "none" else 0,
                          drafter=a.drafter if drafter in ("block", "combined") else "",
                          draft_policy=a.draft_policy or EngineConfig.draft_policy)
    if engine.problems():
        raise ValueError(f"arm {entry!r}: " + "; ".join(engine.problems()))
    return topology, flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, a, arm: str, out_dir: str, faults: bool, plan: Plan):
        topology, flags = parse_arm(arm, a)
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        cmd = [sys.executable, "-m", "kvjax.serve", f"--config={a.config}", "--host", HOST, "--port", str(self.port),
               "--topology", topology, "--slots", str(a.slots), "--capacity", str(plan.capacity),
               "--max-prefill-batch", str(a.max_prefill_batch), "--warmup", "%d:%d" % plan.warmup,
               "--request-timeout", str(a.timeout), "--max-queue", "1024", *flags, *a.server_arg]
        if plan.max_tokens > 1024:  # the server's default limit
            cmd += ["--max-tokens", str(plan.max_tokens)]
        if a.map:
            cmd += ["--map", a.map]
        if faults:
            cmd.append("--enable-fault-injection")
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                                                       os.path.join(out_dir, "jax_cache")),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONPATH=REPO)
        self.log_path = os.path.join(out_dir, f"server_{arm}.log")
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


# ---- /metrics --------------------------------------------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value}, samples of one name summed over their labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def labelled(text: str, name: str, label: str) -> dict[str, float]:
    """Prometheus text -> {value of `label`: sample} of metric `name` (samples without the label: key "")."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        head, _, labels = name_labels.partition("{")
        if head != name:
            continue
        found = dict(kv.split("=", 1) for kv in labels.rstrip("}").split(",") if "=" in kv)
        out[found.get(label, '""').strip('"')] = float(value)
    return out


def draft_stats(before: str, after: str) -> dict:
    """Speculative decoding over a level, from the server's /metrics: decode steps by kind, and per drafter drafted
    and accepted tokens, verify rounds (a request's) and the mean acceptance length (tokens a request emitted per
    round). Empty for a server that does not draft."""
    def delta(name, label):
        b, a = labelled(before, name, label), labelled(after, name, label)
        return {k: v - b.get(k, 0.0) for k, v in a.items()}
    steps = delta("kvjax_decode_steps_total", "kind")
    if not steps:
        return {}
    drafted, accepted = delta("kvjax_drafted_tokens_total", "drafter"), delta("kvjax_accepted_tokens_total", "drafter")
    total, count = delta("kvjax_acceptance_length_sum", "drafter"), delta("kvjax_acceptance_length_count", "drafter")
    per = {d: {"drafted": drafted.get(d, 0.0), "accepted": accepted.get(d, 0.0), "rounds": count[d],
               "acceptance_length": total.get(d, 0.0) / count[d]} for d in sorted(count) if count[d]}
    rounds = sum(count.values())
    return {"draft_steps": steps.get("draft", 0.0), "plain_steps": steps.get("plain", 0.0), "drafters": per,
            "acceptance_length": sum(total.values()) / rounds if rounds else float("nan"),
            "step_costs": step_costs(after)}


def step_costs(text: str) -> dict[str, float]:
    """The drafting policy's step costs at the end of a level, from /metrics: {"ROWSxWIDTH": seconds} (width 0: a
    plain step), what it chose each step's width from."""
    out = {}
    for line in text.splitlines():
        if line.startswith("kvjax_step_cost_seconds{"):
            labels, _, value = line.rpartition(" ")
            found = dict(kv.split("=", 1) for kv in labels.partition("{")[2].rstrip("}").split(",") if "=" in kv)
            out[f'{found["rows"].strip(chr(34))}x{found["width"].strip(chr(34))}'] = float(value)
    return dict(sorted(out.items(), key=lambda kv: tuple(map(int, kv[0].split("x")))))


def prefix_stats(before: dict[str, float], after: dict[str, float]) -> dict:
    """The prefix cache over a level: counter deltas (0 when the server has none), hit rate = hits / lookups,
    reused / looked-up prompt tokens, and the gauges after (NaN when absent)."""
    d = {k: after.get(f"kvjax_prefix_{k}_total", 0.0) - before.get(f"kvjax_prefix_{k}_total", 0.0)
         for k in PREFIX_COUNTERS}
    out = {f"prefix_{k}": v for k, v in d.items()}
    out["prefix_hit_rate"] = d["hits"] / d["lookups"] if d["lookups"] else float("nan")
    out["prefix_reused_frac"] = d["reused_tokens"] / d["lookup_tokens"] if d["lookup_tokens"] else float("nan")
    for k in PREFIX_GAUGES:
        out[f"prefix_{k}_after"] = after.get(f"kvjax_prefix_{k}", float("nan"))
    return out


# ---- clients ---------------------------------------------------------------------------------------------------

async def one_request(client, url, prompt, a, model, max_tokens: int | None = None, on_token=None) -> dict:
    """One streamed greedy completion: timings (and each token chunk's arrival time, perf_counter), token ids, and
    what went wrong. `on_token(rec)` is called after each chunk of tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens or a.new_tokens, "temperature": 0,
            "stream": True}
    rec = {"ids": [], "ttft": None, "itl": [], "e2e": None, "error": None, "retries": 0, "hung": False,
           "t0": None, "times": []}
    while True:
        t0 = rec["t0"] = time.perf_counter()
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
                        rec["times"].append(now)
                        rec["ids"] += ids
                        if on_token:
                            on_token(rec)
            rec["e2e"] = time.perf_counter() - t0
            return rec
        except Exception as e:  # noqa: BLE001 - recorded: a timeout is a hung request
            import httpx
            rec["hung"] = isinstance(e, httpx.TimeoutException)
            rec["error"] = f"{type(e).__name__}: {e}"[:200]
            return rec


def checked(rec: dict, job: dict) -> dict:
    rec.update(job.get("tags", {}))
    rec["match"] = rec["ids"] == job["answer"] and not rec["error"]
    return rec


async def rss_sampler(samples: list, rss, every: float):
    while True:
        samples.append((time.perf_counter(), rss()))
        await asyncio.sleep(every)


async def run_level(url, plan: Plan, a, concurrency: int, model: str, kill_after: int = 0,
                    soak: float = 0.0, rss=None) -> dict:
    import httpx
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    records = []
    done_count = 0
    killed = asyncio.Event()
    jobs = plan.jobs(concurrency)

    async def client_loop(c, client):
        nonlocal done_count
        for job in jobs(c):
            rec = await one_request(client, url, job["prompt"], a, model, job.get("max_tokens"))
            records.append(checked(rec, job))
            done_count += 1
            if kill_after and done_count >= kill_after and not killed.is_set():
                killed.set()
                await client.post(url + "/admin/faults", json={"stage": "worker", "kind": "kill", "times": 1})

    samples = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.timeout, connect=30), limits=limits) as client:
        before = (await client.get(url + "/metrics")).text
        t0 = time.perf_counter()
        sampling = asyncio.ensure_future(rss_sampler(samples, rss, 10 if soak else 2)) if rss else None
        tasks = [asyncio.ensure_future(client_loop(c, client)) for c in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=a.level_timeout + soak)
        for t in pending:  # past the level's wall limit: whatever is still running is hung
            t.cancel()
        wall = time.perf_counter() - t0
        if sampling:
            sampling.cancel()
        metrics = (await client.get(url + "/metrics")).text
        health = (await client.get(url + "/health")).json()
    out = summarize(records, wall, concurrency, len(pending), metrics, health, samples)
    out.update(prefix_stats(parse_metrics(before), parse_metrics(metrics)), **draft_stats(before, metrics))
    if any("turn" in r for r in records):
        out.update(turn_summary(records))
        out["detail"] = [{k: r.get(k) for k in ("conversation", "turn", "prompt_tokens", "ttft", "e2e", "match",
                                                 "error")} for r in records]
    return out


class Progress:
    """How far the decoders are: set `first` once every one has a token, `lead` once every one has `lead` tokens."""

    def __init__(self, n: int, lead: int):
        self.n, self.lead, self.tokens = n, lead, {}
        self.first, self.led = asyncio.Event(), asyncio.Event()

    def __call__(self, rec):
        self.tokens[id(rec)] = len(rec["ids"])
        if len(self.tokens) == self.n:
            self.first.set()
            if min(self.tokens.values()) >= self.lead:
                self.led.set()


async def run_arrival(url, plan: Plan, a, model: str, rss=None) -> dict:
    """The decoders start; once each has a token (or --first-token-wait passed), and then each has --lead-tokens
    (or --settle passed), the long prompt."""
    import httpx
    arr, n = plan.arrival, len(plan.arrival["short"])
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    lead = a.lead_tokens or max(1, a.decode_tokens // 4)
    progress = Progress(n, min(lead, *map(len, arr["short_answers"])))  # one stopping at EOS has fewer

    samples = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.timeout, connect=30), limits=limits) as client:
        before = (await client.get(url + "/metrics")).text
        t0 = time.perf_counter()
        sampling = asyncio.ensure_future(rss_sampler(samples, rss, 2)) if rss else None
        tasks = [asyncio.ensure_future(one_request(client, url, p, a, model, a.decode_tokens, progress))
                 for p in arr["short"]]
        for event, wait, what in ((progress.first, a.first_token_wait, "a token"),
                                  (progress.led, a.settle, f"{progress.lead} tokens")):
            try:
                await asyncio.wait_for(event.wait(), wait)
            except asyncio.TimeoutError:
                print(f"arrival: not every decoder had {what} after {wait:.1f}s", flush=True)
        long = await one_request(client, url, arr["long"], a, model, LONG_NEW_TOKENS)
        _, pending = await asyncio.wait(tasks, timeout=a.level_timeout)
        for t in pending:
            t.cancel()
        wall = time.perf_counter() - t0
        if sampling:
            sampling.cancel()
        metrics = (await client.get(url + "/metrics")).text
        health = (await client.get(url + "/health")).json()
    decs = [checked(t.result(), {"answer": ans, "tags": {"role": "decoder"}})
            for t, ans in zip(tasks, arr["short_answers"]) if t not in pending]
    long = checked(long, {"answer": arr["long_answer"], "tags": {"role": "long"}})
    out = summarize(decs + [long], wall, n + 1, len(pending), metrics, health, samples)
    out.update(prefix_stats(parse_metrics(before), parse_metrics(metrics)))
    out.update(arrival_summary(decs, long), long_tokens=len(arr["long"]), decode_tokens=a.decode_tokens)
    return out


# ---- summaries -------------------------------------------------------------------------------------------------

# ---- main ------------------------------------------------------------------------------------------------------

PLANS = {"independent": independent_plan, "conversation": conversation_plan, "arrival": arrival_plan,
         "code": code_plan}


def run_arm(a, arm: str, plan: Plan, server: ServerProcess, out: list, save: Callable[[], None]) -> None:
    """Every level of one arm (arrival: its one run), each appended to `out` and saved as it finishes."""
    import httpx
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    if plan.arrival is not None:
        out.append(asyncio.run(run_arrival(server.url, plan, a, model, rss=server.rss_mb)))
        print(json.dumps({k: v for k, v in out[-1].items() if k not in ("rss_mb", "decoder_times")}), flush=True)
        return save()
    for c in levels(a):
        kill = a.kill_prefill and parse_arm(arm, a)[0] == "disaggregated"
        kill_after = max(1, c * plan.per_client // 3) if kill else 0
        r = asyncio.run(run_level(server.url, plan, a, c, model, kill_after, a.soak, rss=server.rss_mb))
        r["killed_prefill_worker"] = bool(kill_after)
        out.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("rss_mb", "detail")}), flush=True)
        save()


def run_interleaved(a, arms: list[str], plan: Plan, servers: dict, results: dict, save: Callable[[], None]) -> None:
    """Each level `--repeats` times, the arms interleaved within each repeat (every server already up)."""
    import httpx
    models = {arm: httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"] for arm, srv in servers.items()}
    for c in levels(a):
        for rep in range(a.repeats):
            for arm in arms:
                srv = servers[arm]
                r = asyncio.run(run_level(srv.url, plan, a, c, models[arm], rss=srv.rss_mb))
                r["repeat"] = rep
                results[arm].append(r)
                print(json.dumps({"arm": arm, **{k: v for k, v in r.items() if k not in ("rss_mb", "detail")}}),
                      flush=True)
                save()


def main(argv=None) -> int:
    a = args_parser().parse_args(argv)
    arms = a.topologies.split(",")
    try:
        for arm in arms:
            parse_arm(arm, a)
    except ValueError as e:
        args_parser().error(str(e))
    if check_args(a):
        args_parser().error("; ".join(check_args(a)))
    out_dir = os.path.abspath(a.out)
    os.makedirs(out_dir, exist_ok=True)
    command = "python -m launch.bench.load " + " ".join(sys.argv[1:] if argv is None else argv)
    plan = PLANS[a.workload](a, out_dir)
    results = {}

    def save():
        with open(os.path.join(out_dir, "load.json"), "w") as f:
            json.dump({"command": command, "workload": a.workload, "results": results}, f, indent=1)
    if a.repeats > 1:  # every server up at once, the arms interleaved level by level
        servers = {}
        try:
            for arm in arms:
                t0 = time.time()
                servers[arm] = ServerProcess(a, arm, out_dir, faults=False, plan=plan)
                servers[arm].wait_ready()
                print(f"{arm}: server ready in {time.time() - t0:.0f}s", flush=True)
                results[arm] = []
            run_interleaved(a, arms, plan, servers, results, save)
        finally:
            for server in servers.values():
                server.stop()
        report(results, out_dir, command, a.workload)
        return 0
    for arm in arms:
        server = ServerProcess(a, arm, out_dir, faults=a.kill_prefill, plan=plan)
        try:
            t0 = time.time()
            server.wait_ready()
            print(f"{arm}: server ready in {time.time() - t0:.0f}s", flush=True)
            results[arm] = []
            run_arm(a, arm, plan, server, results[arm], save)
        finally:
            server.stop()
    report(results, out_dir, command, a.workload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
