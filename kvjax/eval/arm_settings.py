"""Settings of the arms that take any (`RunConfig.arms`, `--config.arms.FIELD=VALUE`). No JAX here: RunConfig reads
without an accelerator stack."""

from __future__ import annotations

import dataclasses

PARTIAL_MODES = ("bottom", "top")  # kvjax.builders.partial.MODES


@dataclasses.dataclass(frozen=True)
class ArmSettings:
    # the "partial" arm (kvjax.builders.PartialRecompute): the final map's cache with `partial_k` target layers
    # recomputed natively over the prompt; "bottom": the target's layers 0..k-1 run natively, the rest are mapped;
    # "top": the target reads the mapped lower layers and recomputes its top k (costs a pass of its queries and MLPs)
    partial_k: int = 1
    partial_mode: str = "bottom"
    # the "tail" arm (kvjax.builders.NativeTail): the final map's cache with each prompt's last `tail_tokens` tokens
    # read by the target itself (where a prompt's question is); costs a target prefill of that many tokens
    tail_tokens: int = 16

    def problems(self, target_layers: int | None = None) -> list[str]:
        """What preflight reports about these settings (`target_layers`: the answering model's depth, if known)."""
        out = []
        if self.partial_mode not in PARTIAL_MODES:
            out.append(f"arms.partial_mode={self.partial_mode!r}: pass one of {', '.join(PARTIAL_MODES)}")
        if self.partial_k < 0 or (target_layers is not None and self.partial_k > target_layers):
            top = "" if target_layers is None else f"..{target_layers} (the target's layers)"
            out.append(f"arms.partial_k={self.partial_k}: pass 0{top or ' or more'}")
        if self.tail_tokens < 0:
            out.append(f"arms.tail_tokens={self.tail_tokens}: pass 0 or more")
        return out
