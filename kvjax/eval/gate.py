"""The quality gate of a cache map: configurable thresholds checked against held-out metrics.

A map that fails its gate should not serve requests: `kvjax.split_generate(..., gate=result)` then lets the target
prefill the prompt itself (and says so). The launch job writes the result next to the map as gate.json.
"""

from __future__ import annotations

import dataclasses
import json
import os


@dataclasses.dataclass(frozen=True)
class GateConfig:
    """Thresholds on held-out metrics of the final map; None disables a check."""

    min_key_cos: float | None = 0.8  # mean key cosine to the native target cache (pre-RoPE)
    min_value_cos: float | None = 0.5  # mean value cosine
    # mean cosine of the target's attention outputs from the mapped vs its native cache, same queries (distances
    # evaluation, kvjax.eval.attention_fidelity); what the target reads, where key/value cosines score entries
    min_attn_cos: float | None = None
    max_kl: float | None = None  # source-teacher KL of the final map, nats/token
    # KL of the final map / KL of the native target (the target having read the prompt itself): above 1, the mapped
    # cache leaves the target further from the source than its own prefill would, so the split path only costs
    max_kl_vs_target: float | None = 1.0
    min_kl_reduction: float | None = 0.0  # 1 - KL(residual) / KL(ridge)
    min_mc_retention: float | None = 0.95  # mapped accuracy / native target accuracy, worst multiple-choice set
    min_retrieval_retention: float | None = None  # mapped / native target retrieval accuracy, worst length
    # exact-match retrieval of the gated map, worst length (0..1): where the native target retrieves nothing (a
    # target that cannot read its context alone) retention is undefined, and this is the check that can fail
    min_retrieval: float | None = None
    # RULER-style retrieval (evaluation `ruler`): the gated map's exact match on the worst needle format never shown in
    # training, at the shortest length scored (the goal: >= 0.5 at 1K on each unseen format)
    min_ruler_unseen: float | None = None
    # (mapped - target) / (source - target) accuracy, worst multiple-choice set (undefined where the source is not
    # ahead of the target: then the check is not measured)
    min_mc_gap_recovered: float | None = None
    min_mc_gain_ci_lo: float | None = None  # lower end of the paired 95% interval of mapped - target, worst set
    # chance-normalised retention (mapped - chance) / (native target - chance), worst multiple-choice set: the share
    # of the target's margin over guessing the mapped cache keeps (undefined where the target is at chance)
    min_chance_retention: float | None = None
    # next-token agreement with the source's argmax of the target reading the gated map's cache / that of the target
    # reading direct injection (evaluation `agreement`; the method's "30x over direct injection")
    min_agreement_vs_direct: float | None = None
    # end-to-end latency of a request on the split path (source prefill, map, target decode of the throughput
    # evaluation's new tokens) / the native source's, worst prefix length: above 1 the split path answers later than
    # the source would have (the method's "integrated end-to-end latency" gate)
    max_latency_vs_source: float | None = None
    # the arm whose cache distances min_key_cos / min_value_cos check (None: the gated map). A KL-trained residual
    # moves the cache away from the native target's on purpose, so a gate may hold the ridge to the cosine bounds
    cos_arm: str | None = None
    # audio transfer (evaluation `audio`): the paired 95% interval of (answerer on the mapped audio cache - the
    # answerer's own audio path), its lower end; the share of the gap to the listening source it recovers; each
    # model's spoken margin over chance kept from its transcript margin (the encoder hears, so the transfer is what is
    # measured); mapped decode tokens/s / the answerer's own audio path's, side by side
    min_audio_gain_ci_lo: float | None = None
    min_audio_gap_recovered: float | None = None
    min_audio_margin_kept: float | None = None
    min_audio_decode_ratio: float | None = None

    def hashed(self) -> dict:
        """The thresholds as the report stage's hash records them: checks added later only when set, so that runs
        made before they existed keep their report."""
        return {k: v for k, v in dataclasses.asdict(self).items() if not (k in ADDED_LATER and v is None)}


ADDED_LATER = ("min_ruler_unseen", "min_attn_cos", "min_retrieval", "min_audio_gain_ci_lo", "min_audio_gap_recovered",
               "min_audio_margin_kept", "min_audio_decode_ratio", "min_chance_retention",
               "min_agreement_vs_direct", "max_latency_vs_source")  # checks that did not exist in earlier runs (see GateConfig.hashed)


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    value: float | None  # None: not measured in this run
    threshold: float
    kind: str  # "min" or "max"
    note: str = ""

    @property
    def measured(self) -> bool:
        return self.value is not None

    @property
    def passed(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.threshold if self.kind == "min" else self.value <= self.threshold


@dataclasses.dataclass(frozen=True)
class GateResult:
    passed: bool  # every measured check passed, and at least one was measured (unless no threshold is set)
    map_arm: str  # the map the checks are about: the run's final map (kvjax.eval.arms: ridge + residual, or ridge)
    checks: tuple[Check, ...]
    thresholds: dict

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False]

    def summary(self) -> str:
        if not self.checks:
            return "PASS (no thresholds set)"
        if not any(c.measured for c in self.checks):
            return "FAIL: none of the gated metrics was measured"
        if self.passed:
            return f"PASS ({sum(c.measured for c in self.checks)} checks)"
        return "FAIL: " + "; ".join(f"{c.name} {c.value:.4g} {'<' if c.kind == 'min' else '>'} {c.threshold:.4g}"
                                    for c in self.failed)

    def to_json(self) -> dict:
        return {"passed": self.passed, "map": self.map_arm, "thresholds": self.thresholds,
                "checks": {c.name: {"value": c.value, "threshold": c.threshold, "kind": c.kind,
                                    "passed": c.passed, "note": c.note} for c in self.checks}}

    @classmethod
    def from_json(cls, d: dict) -> "GateResult":
        checks = tuple(Check(name, c["value"], c["threshold"], c["kind"], c.get("note", ""))
                       for name, c in d["checks"].items())
        return cls(bool(d["passed"]), d["map"], checks, dict(d["thresholds"]))


def check(name: str, value, threshold: float | None, kind: str, note: str = "") -> list[Check]:
    """The check of `value` against `threshold` ("min" or "max"), or none when the threshold is None (disabled);
    value None = not measured in this run. Each evaluation's gate (kvjax.eval.suite) returns a list of these."""
    if threshold is None:
        return []
    return [Check(name, None if value is None else float(value), float(threshold), kind, note)]


def retention(mapped: float, native: float) -> float | None:
    """mapped / native accuracy; undefined (None) when the native model scored 0."""
    return None if native <= 0 else mapped / native


def judge(checks: list[Check], config: GateConfig, map_arm: str) -> GateResult:
    """The verdict on `map_arm` from its checks (kvjax.eval.suite.evaluate_gate collects them from every
    evaluation's metrics)."""
    measured = [c for c in checks if c.measured]
    # no thresholds at all: nothing to fail; thresholds but no measurement: no evidence, so no pass
    passed = all(c.passed for c in measured) and (bool(measured) or not checks)
    return GateResult(passed, map_arm, tuple(checks), dataclasses.asdict(config))


def save_gate(path: str, result: GateResult) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result.to_json(), f, indent=2)
    os.replace(tmp, path)


def load_gate(path: str) -> GateResult:
    """The gate result a launch run wrote (RUN_DIR/gate.json)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no gate result at {path}; `python -m kvjax.launch` writes OUTPUT_DIR/gate.json in "
                                "its report stage")
    with open(path) as f:
        return GateResult.from_json(json.load(f))
