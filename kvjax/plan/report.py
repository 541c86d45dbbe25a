"""A plan's results: per program and per stage, whether it fits the slice and what it costs, as a record (JSON), a
markdown report and a chart."""

from __future__ import annotations

import dataclasses
import os

from kvjax.plan.hardware import Slice
from kvjax.plan.program import Compiled, Program

GB = 1e9
# what a device keeps free beside a program's own buffers (XLA's runtime, collectives' buffers, fragmentation): a
# plan calls a program that needs more than this share of HBM a risk, and more than HBM a refusal
MARGIN = 0.95


@dataclasses.dataclass
class StagePlan:
    name: str
    held: dict[str, int]  # the weights the stage holds, per device: model -> bytes
    programs: list[Compiled]

    @property
    def held_bytes(self) -> int:
        return sum(self.held.values())

    @property
    def largest(self) -> Compiled | None:
        ok = [c for c in self.programs if not c.error]
        return max(ok, key=lambda c: c.working_bytes, default=None)

    @property
    def peak_bytes(self) -> int:
        """The weights the stage holds and its largest program's working memory beside them, per device."""
        big = self.largest
        return self.held_bytes + (big.working_bytes if big is not None else 0)

    @property
    def errors(self) -> list[Compiled]:
        return [c for c in self.programs if c.error]


@dataclasses.dataclass
class Plan:
    """One config (the job or the server) on one slice."""

    config: str
    what: str  # "job" or "serve"
    slice: Slice
    stages: list[StagePlan]
    sources: dict  # role -> where the model's shapes came from
    mesh: dict  # axis -> size
    seconds: float = 0.0  # wall time of building and compiling the plan
    notes: dict = dataclasses.field(default_factory=dict)  # a server plan's slots, context and capacity table

    @property
    def hbm(self) -> float:
        return self.slice.hbm_bytes

    def fits(self) -> bool:
        return all(s.peak_bytes <= self.hbm and not s.errors for s in self.stages)

    def over(self) -> list[tuple[StagePlan, float]]:
        """The stages that do not fit, with how many bytes they are over."""
        return [(s, s.peak_bytes - self.hbm) for s in self.stages if s.peak_bytes > self.hbm]

    def compile_seconds(self) -> float:
        return sum(c.lower_seconds + c.compile_seconds for s in self.stages for c in s.programs if not c.reused)

    def to_json(self) -> dict:
        sl = self.slice
        return {
            "config": self.config, "what": self.what, "slice": sl.name, "devices": len(sl.devices),
            "chips": sl.chips, "hbm_bytes_per_device": sl.hbm_bytes, "hbm_bytes_per_s": sl.hbm_bytes_per_s,
            "flops_per_s": sl.flops_per_s, "mesh": self.mesh, "shapes_from": self.sources, "fits": self.fits(),
            "seconds": self.seconds, "compile_seconds": self.compile_seconds(), **self.notes,
            "stages": [{"stage": s.name, "held_bytes": s.held, "peak_bytes": s.peak_bytes,
                        "fits": s.peak_bytes <= self.hbm and not s.errors,
                        "largest": s.largest.program.name if s.largest else None,
                        "programs": [program_json(c, sl) for c in s.programs]} for s in self.stages],
        }


def program_json(c: Compiled, sl: Slice) -> dict:
    p: Program = c.program
    out = {"name": p.name, "function": p.program, "holds": list(p.holds), "note": p.note,
           "flops": p.flops, "hbm_bytes": p.hbm_bytes, "weight_bytes": p.weight_bytes,
           "compile_seconds": c.compile_seconds, "lower_seconds": c.lower_seconds, "reused": c.reused}
    if c.error:
        out["error"] = c.error
        return out
    out["compiled"] = c.compiled
    if not c.compiled:
        return out
    out.update(argument_bytes=c.argument_bytes, output_bytes=c.output_bytes, alias_bytes=c.alias_bytes,
               temp_bytes=c.temp_bytes, code_bytes=c.code_bytes, peak_bytes=c.peak_bytes,
               xla_flops=c.xla_flops, xla_bytes=c.xla_bytes, roofline_seconds=c.roofline_seconds(sl),
               bound=c.bound(sl))
    return out


def _gb(x: float) -> str:
    return f"{x / GB:.2f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g}" if s < 10 else f"{s:.1f} s"


def markdown(plan: Plan) -> str:
    sl = plan.slice
    verdict = "fits" if plan.fits() else "does NOT fit"
    lines = [f"# Plan: {plan.config} ({plan.what}) on {sl.name}", "",
             f"{sl.describe()}; mesh {' x '.join(f'{k} {v}' for k, v in plan.mesh.items())}. Shapes from "
             + ", ".join(f"{role}: {where}" for role, where in plan.sources.items()) + ".", "",
             f"**The {plan.what} {verdict}**: per device, the largest stage needs "
             f"{_gb(max(s.peak_bytes for s in plan.stages) if plan.stages else 0)} GB of {_gb(plan.hbm)} GB. "
             f"{sum(len(s.programs) for s in plan.stages)} programs, compiled in {plan.compile_seconds():.0f} s "
             f"on this machine ({plan.notes.get('compiled_at', 'full depth')}"
             + (f"; {plan.notes['compiled']}" if "compiled" in plan.notes else "") + ").", ""]
    for s, over in plan.over():
        lines.append(f"- {s.name}: {_gb(over)} GB over ({s.largest.program.name if s.largest else '?'}).")
    for s in plan.stages:
        for c in s.errors:
            lines.append(f"- {s.name}: the compiler refused {c.program.name}: {c.error}")
    if plan.over() or any(s.errors for s in plan.stages):
        lines.append("")
    if "capacity_table" in plan.notes:
        lines += ["## Slots x context", "", f"Compiled below: {plan.notes['slots']} slots of {plan.notes['context']} "
                  "tokens. The most slots (of 1, 2, 4, ... 512) whose cache fits per device beside the models and a "
                  "full prefill batch, from the shapes:", "", "| context | slots |", "|---|---|"]
        lines += [f"| {c} | {s} |" for c, s in plan.notes["capacity_table"].items()] + [""]
    lines += ["## Stages", "", "Per device: the weights the stage holds, its largest program's working memory beside "
              "them (arguments other than weights, outputs, temporaries: XLA's memory analysis), and the sum.", "",
              "| stage | weights GB | largest program | working GB | peak GB | of HBM | fits |",
              "|---|---|---|---|---|---|---|"]
    for s in plan.stages:
        big = s.largest
        lines.append(f"| {s.name} | {_gb(s.held_bytes)} | {big.program.name if big else '-'} | "
                     f"{_gb(big.working_bytes) if big else '0.00'} | {_gb(s.peak_bytes)} | "
                     f"{s.peak_bytes / plan.hbm:.0%} | {'yes' if s.peak_bytes <= plan.hbm and not s.errors else 'NO'} |")
    lines += ["", "## Programs", "",
              "Per device. FLOPs and bytes: what the shapes require (kvjax.plan.costs) and XLA's cost analysis of the "
              "compiled program (x: XLA / shapes; XLA counts every instruction's operands and each branch of a "
              "conditional, so it runs above the shapes' HBM bytes). Roofline: the shapes' FLOPs at the chip's peak or "
              "their bytes at its HBM bandwidth, whichever is longer; priced, not measured.", "",
              "| stage | program | peak GB | args / temp GB | GFLOP (x XLA) | GB moved (x XLA) | roofline ms | bound | "
              "compile s |", "|---|---|---|---|---|---|---|---|---|"]
    for s in plan.stages:
        for c in s.programs:
            p = c.program
            if c.error:
                lines.append(f"| {s.name} | {p.name} | refused | | | | | | {c.lower_seconds:.1f} |")
                continue
            if not c.compiled:
                lines.append(f"| {s.name} | {p.name} | {'lowered only' if c.lower_seconds else 'not compiled'} | | {p.flops / 1e9:.4g} | {_gb(p.hbm_bytes)} | "
                             f"{_ms(max(p.flops / sl.flops_per_s, p.hbm_bytes / sl.hbm_bytes_per_s))} | | "
                             f"{c.lower_seconds:.1f} |")
                continue
            lines.append(f"| {s.name} | {p.name} | {_gb(c.peak_bytes)} | {_gb(c.argument_bytes)} / {_gb(c.temp_bytes)} "
                         f"| {p.flops / 1e9:.4g} ({_ratio(c.xla_flops, p.flops)}) | {_gb(p.hbm_bytes)} "
                         f"({_ratio(c.xla_bytes, p.hbm_bytes)}) | {_ms(c.roofline_seconds(sl))} | {c.bound(sl)} | "
                         f"{'(same program)' if c.reused else f'{c.compile_seconds + c.lower_seconds:.1f}'} |")
    return "\n".join(lines) + "\n"


def chart(plan: Plan, path: str) -> str:
    """Per stage: the weights held and the largest program's working memory, stacked, against HBM."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [s.name for s in plan.stages]
    held = [s.held_bytes / GB for s in plan.stages]
    work = [(s.peak_bytes - s.held_bytes) / GB for s in plan.stages]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(names) + 2), 4))
    ax.bar(names, held, label="weights", color="#4C72B0")
    ax.bar(names, work, bottom=held, label="largest program's working memory", color="#DD8452")
    ax.axhline(plan.hbm / GB, color="#C44E52", ls="--", label=f"HBM per device ({plan.hbm / GB:.0f} GB)")
    ax.set_ylabel("GB per device")
    ax.set_title(f"{plan.config} ({plan.what}) on {plan.slice.name}")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
