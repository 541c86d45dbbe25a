"""The load tool's workloads (launch.bench.load): what each client sends, the answers it must get back, and what
the server must fit. Prompts are held-out toy text; the answers are offline greedy `kvjax.split_generate` with the
run's gate (the path the server takes), computed once and cached in the output directory.

- independent: a pool of `--prompts` held-out windows cut at `--lengths` lengths, `--requests` per client;
- conversation: a shared system prompt, then turns that resend the conversation (the history holds the OFFLINE
  answers, so every turn's prompt is fixed in advance and checked against offline);
- arrival: `--decoders` short prompts that decode long, and one long prompt that arrives among them;
- code: code editing: each request quotes a held-out file and asks for it back with an edit, and its answer starts
  the edited file, so the answer repeats the prompt's text (where speculative decoding's prompt lookup copies).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Callable, Iterator

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WINDOWS = "checkpoints/toy/eval/heldout_windows.npy"  # held-out toy text, [rows, 1025]
ALIGN = 128  # server capacities are multiples of this
LONG_NEW_TOKENS = 8  # max_tokens of the arrival workload's long request


# ---- prompts ---------------------------------------------------------------------------------------------------

def heldout_windows() -> np.ndarray:
    return np.load(os.path.join(REPO, WINDOWS))


def heldout_span(windows: np.ndarray, start: int, n: int) -> list[int]:
    """n tokens of held-out text from flat position `start` (row * width + offset), continuing into the next rows
    (and wrapping around the array)."""
    flat = windows.reshape(-1)
    return [int(t) for t in flat[(start + np.arange(n)) % flat.size]]


def prompt_pool(a) -> list[list[int]]:
    windows = heldout_windows()
    lengths = np.linspace(a.min_len, a.max_len, a.lengths).astype(int)
    return [[int(t) for t in windows[i % len(windows), : lengths[i % len(lengths)]]] for i in range(a.prompts)]


def conversation_parts(windows: np.ndarray, conversations: int, turns: int, system_tokens: int,
                       user_tokens: int) -> tuple[list[int], list[list[list[int]]]]:
    """(system prompt, users[conversation][turn]): the system prompt from the first rows, each user message from
    the rows after it (message u: row first + u % free, offset (u // free) * user_tokens)."""
    rows, width = windows.shape
    first = -(-system_tokens // width)  # rows the system prompt takes
    free = rows - first
    if free < 1 or (conversations * turns - 1) // free * user_tokens >= width:
        raise ValueError(f"{conversations} x {turns} user messages of {user_tokens} tokens do not fit the "
                         f"held-out windows {windows.shape} after a {system_tokens}-token system prompt")
    system = heldout_span(windows, 0, system_tokens)
    users = [[heldout_span(windows, (first + u % free) * width + (u // free) * user_tokens, user_tokens)
              for u in range(c * turns, (c + 1) * turns)] for c in range(conversations)]
    return system, users


def turn_prompt(system: list[int], users: list[list[int]], answers: list[list[int]], k: int) -> list[int]:
    """Turn k's prompt (0-based): system + user_0 + answer_0 + ... + user_k."""
    out = list(system)
    for j in range(k):
        out += users[j] + answers[j]
    return out + users[k]


def arrival_prompts(windows: np.ndarray, decoders: int, short_tokens: int,
                    long_tokens: int) -> tuple[list[list[int]], list[int]]:
    """(decoders' prompts, the long prompt): decoder i from row i (offset (i // rows) * short_tokens past the first
    pass), the long prompt from the row after the decoders' on."""
    rows, width = windows.shape
    short = [heldout_span(windows, (i % rows) * width + (i // rows) * short_tokens, short_tokens)
             for i in range(decoders)]
    return short, heldout_span(windows, (decoders % rows) * width, long_tokens)


def code_files(windows: np.ndarray, tokenizer, n: int, file_tokens: int) -> list[str]:
    """n held-out "files": file_tokens tokens of every (rows // n)-th window decoded, cut to whole lines."""
    step = max(1, len(windows) // max(n, 1))
    out = []
    for i in range(n):
        text = tokenizer.decode([int(t) for t in windows[(i * step) % len(windows), :file_tokens]])
        first, last = text.find("\n") + 1, text.rfind("\n") + 1
        out.append(text[first:last] if last > first else text)
    return out


def code_edit_prompt(text: str, name: str, lead_lines: int) -> str:
    """A request that quotes the file `text` and asks for all of it back with one word renamed (its most frequent
    word of 4+ letters); the prompt ends with the edited file's first `lead_lines` lines, as an answer would start."""
    words = [w for w in "".join(c if c.isalnum() or c == "_" else " " for c in text).split() if len(w) >= 4]
    old = max(sorted(set(words)), key=words.count) if words else "data"
    new = old + "_v2"
    lead = "".join(text.splitlines(keepends=True)[:lead_lines]).replace(old, new)
    return (f"# Task: give back the whole file below, with every `{old}` renamed to `{new}`.\n--- {name}\n{text}"
            f"--- {name} (edited)\n{lead}")


def code_prompts(windows: np.ndarray, tokenizer, n: int, file_tokens: int, lead_lines: int) -> list[list[int]]:
    """The code workload's n prompts, as token ids."""
    return [tokenizer.encode(code_edit_prompt(text, f"file{i}.py", lead_lines)).ids
            for i, text in enumerate(code_files(windows, tokenizer, n, file_tokens))]


# ---- the offline reference -------------------------------------------------------------------------------------

def cut_at_eos(ids, eos) -> list[int]:
    ids = [int(t) for t in ids]
    return ids[: next((j + 1 for j, t in enumerate(ids) if t in eos), len(ids))]


def equal_length_groups(prompts: list[list[int]], batch: int) -> list[list[int]]:
    """Indices of the prompts in groups of equal length, at most `batch` each (first-seen order)."""
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    return [idx[s: s + batch] for idx in by_len.values() for s in range(0, len(idx), max(1, batch))]


def padded_rows(n: int, batch: int) -> int:
    """The rows of a call for a group of n prompts: the next power of two (at most `batch`), so a few programs
    serve every group; the extra rows repeat the last prompt and are dropped."""
    return min(max(batch, 1), 1 << max(0, (n - 1).bit_length()))


class Offline:
    """Greedy split_generate with the run's gate (the path the server takes), answers cut after the first EOS. The
    models load on the first generate (a cached reference needs none)."""

    def __init__(self, a):
        sys.path.insert(0, REPO)
        from kvjax.config_flags import build
        from kvjax.run.preflight import resolve_models
        from kvjax.run.config import RunConfig
        from kvjax.serve.cli import locate
        self.cfg = resolve_models(build(a.config, [], RunConfig))
        self.map_dir, self.gate_path = locate(self.cfg, a.config, a.map, "")
        self.batch = a.offline_batch
        self.models = None
        self.path = "split"

    def key(self, *parts) -> str:
        mtime = os.path.getmtime(os.path.join(self.map_dir, "manifest.json"))
        return hashlib.sha256(json.dumps([*parts, os.path.abspath(self.map_dir), mtime]).encode()).hexdigest()

    def _load(self):
        import jax.numpy as jnp

        import kvjax
        source = kvjax.load_hf(self.cfg.source.path, dtype=jnp.dtype(self.cfg.source.dtype))
        target = kvjax.load_hf(self.cfg.target.path, dtype=jnp.dtype(self.cfg.target.dtype))
        kvmap = kvjax.load_map(self.map_dir, source.cfg, target.cfg)
        gate = kvjax.load_gate(self.gate_path) if self.gate_path else True
        self.models = (source, target, kvmap, gate, set(target.cfg.eos_token_ids))

    def generate(self, prompts: list[list[int]], new_tokens: int, what: str = "offline") -> list[list[int]]:
        import kvjax
        if self.models is None:
            self._load()
        source, target, kvmap, gate, eos = self.models
        answers: list = [None] * len(prompts)
        t0, done = time.time(), 0
        for group in equal_length_groups(prompts, self.batch):
            rows = [prompts[i] for i in group]
            rows += [rows[-1]] * (padded_rows(len(rows), self.batch) - len(rows))
            res = kvjax.split_generate(source, target, kvmap, rows, new_tokens, gate=gate)
            for i, ids in zip(group, np.asarray(res.tokens)):
                answers[i] = cut_at_eos(ids, eos)
            self.path = res.path
            done += len(group)
            print(f"{what} {done}/{len(prompts)} ({len(rows[0])} tokens, {time.time() - t0:.0f}s)", flush=True)
        return answers


def cached(out_dir: str, name: str, key: str, compute: Callable[[], dict]) -> dict:
    """compute() (a JSON-able dict), kept in OUT/name under `key` and reused while the key matches."""
    path = os.path.join(out_dir, name)
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        if saved.get("key") == key:
            return saved
    saved = dict(compute(), key=key)
    with open(path, "w") as f:
        json.dump(saved, f)
    return saved


def offline_reference(a, prompts, out_dir, offline: Offline | None = None,
                      name: str = "offline.json") -> tuple[list[list[int]], str]:
    """Greedy answers of each prompt (cut after the first EOS); cached by prompt pool, map and settings."""
    off = offline or Offline(a)

    def compute():
        return {"answers": off.generate(prompts, a.new_tokens), "path": off.path, "map": off.map_dir}
    saved = cached(out_dir, name, off.key(prompts, a.new_tokens), compute)
    return saved["answers"], saved["path"]


def conversation_reference(a, system, users, out_dir, offline: Offline | None = None):
    """(prompts[c][k], answers[c][k], path): turn by turn, every conversation's turn k answered offline before
    turn k + 1's prompts (which hold those answers) exist; cached like offline_reference."""
    off = offline or Offline(a)

    def compute():
        answers = [[] for _ in users]
        for k in range(len(users[0])):
            prompts = [turn_prompt(system, u, ans, k) for u, ans in zip(users, answers)]
            for ans, new in zip(answers, off.generate(prompts, a.new_tokens, f"offline turn {k + 1}")):
                ans.append(new)
        return {"answers": answers, "path": off.path, "map": off.map_dir}
    saved = cached(out_dir, "offline_conversation.json", off.key(system, users, a.new_tokens), compute)
    answers = saved["answers"]
    prompts = [[turn_prompt(system, u, ans, k) for k in range(len(u))] for u, ans in zip(users, answers)]
    return prompts, answers, saved["path"]


def arrival_reference(a, short, long, out_dir, offline: Offline | None = None):
    """(decoders' answers of --decode-tokens, the long prompt's answer of 8 tokens, path); cached."""
    off = offline or Offline(a)

    def compute():
        dec = off.generate(short, a.decode_tokens, "offline decoders")
        return {"decoders": dec, "long": off.generate([long], LONG_NEW_TOKENS, "offline long")[0],
                "path": off.path, "map": off.map_dir}
    saved = cached(out_dir, "offline_arrival.json", off.key(short, long, a.decode_tokens, LONG_NEW_TOKENS), compute)
    return saved["decoders"], saved["long"], saved["path"]


# ---- workloads: what each client sends, and what the server must fit ------------------------------------------

@dataclasses.dataclass
class Plan:
    """A workload ready to run: `jobs(concurrency)` gives each client c its requests, in order, as dicts (prompt,
    answer, max_tokens, tags: fields recorded with the request). `capacity` and `warmup` size the server."""

    jobs: Callable[[int], Callable[[int], Iterator[dict]]]
    per_client: int  # requests per client (a soak: open-ended)
    capacity: int
    warmup: tuple[int, int]  # prompt tokens MIN:MAX whose prefill shapes are compiled before timing
    max_tokens: int
    arrival: dict | None = None  # arrival: decoders, long, their answers


def aligned(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


def independent_plan(a, out_dir, offline=None) -> Plan:
    prompts = prompt_pool(a)
    answers, path = offline_reference(a, prompts, out_dir, offline)
    print(f"offline reference: {len(prompts)} prompts, path {path}", flush=True)
    return pool_plan(a, prompts, answers, aligned(a.max_len + a.new_tokens), (a.min_len, a.max_len))


def code_plan(a, out_dir, offline=None) -> Plan:
    from kvjax.config_flags import build
    from kvjax.hf import load_tokenizer
    from kvjax.run.preflight import resolve_models
    from kvjax.run.config import RunConfig
    tokenizer = load_tokenizer(resolve_models(build(a.config, [], RunConfig)).target.path)
    prompts = code_prompts(heldout_windows(), tokenizer, a.prompts, a.file_tokens, a.lead_lines)
    answers, path = offline_reference(a, prompts, out_dir, offline, "offline_code.json")
    lengths = [len(p) for p in prompts]
    print(f"offline reference: {len(prompts)} code-editing prompts ({min(lengths)}-{max(lengths)} tokens), "
          f"path {path}", flush=True)
    return pool_plan(a, prompts, answers, aligned(max(lengths) + a.new_tokens), (min(lengths), max(lengths)))


def pool_plan(a, prompts, answers, capacity: int, warmup: tuple[int, int]) -> Plan:
    """Each client sends `--requests` prompts of the pool (client c from prompt c * requests on), one after another;
    a soak runs until its time is up."""

    def jobs(concurrency):
        t_end = time.perf_counter() + a.soak

        def client(c):
            j = 0
            while (j < a.requests) if not a.soak else (time.perf_counter() < t_end):
                i = (c * a.requests + j) % len(prompts)
                yield {"prompt": prompts[i], "answer": answers[i], "tags": {"prompt": i}}
                j += 1
        return client
    return Plan(jobs, a.requests, capacity, warmup, a.new_tokens)


def conversation_plan(a, out_dir, offline=None) -> Plan:
    n = a.conversations or max(levels(a))
    system, users = conversation_parts(heldout_windows(), n, a.turns, a.system_tokens, a.user_tokens)
    prompts, answers, path = conversation_reference(a, system, users, out_dir, offline)
    lengths = [len(p) for conv in prompts for p in conv]
    print(f"offline reference: {n} conversations x {a.turns} turns ({min(lengths)}-{max(lengths)} tokens), "
          f"path {path}", flush=True)

    def jobs(concurrency):
        def client(c):
            conv = c % n
            for k in range(a.turns):
                yield {"prompt": prompts[conv][k], "answer": answers[conv][k],
                       "tags": {"conversation": conv, "turn": k + 1, "prompt_tokens": len(prompts[conv][k])}}
        return client
    return Plan(jobs, a.turns, aligned(max(lengths) + a.new_tokens), (min(lengths), max(lengths)), a.new_tokens)


def arrival_plan(a, out_dir, offline=None) -> Plan:
    short, long = arrival_prompts(heldout_windows(), a.decoders, a.short_tokens, a.long_tokens)
    dec_answers, long_answer, path = arrival_reference(a, short, long, out_dir, offline)
    print(f"offline reference: {len(short)} decoders x {a.decode_tokens} tokens, a {len(long)}-token prompt, "
          f"path {path}", flush=True)
    capacity = aligned(max(a.short_tokens + a.decode_tokens, a.long_tokens + LONG_NEW_TOKENS))
    return Plan(None, 1, capacity, (min(a.short_tokens, a.long_tokens), max(a.short_tokens, a.long_tokens)),
                max(a.decode_tokens, LONG_NEW_TOKENS),
                arrival={"short": short, "long": long, "short_answers": dec_answers, "long_answer": long_answer})


def levels(a) -> list[int]:
    return [int(c) for c in a.concurrency.split(",")]
