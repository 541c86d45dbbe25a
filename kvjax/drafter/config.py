"""The block drafter's configuration: a frozen dataclass, hashable, so jitted functions specialise on it.

A drafter is built for one target (verifier) model: its layers have the target's layer shapes (so the target's
embedding and LM head are shared, and the family's layer pieces run them), it reads the target's hidden states at
`feature_layers`, and it is trained for the block sizes `block_sizes`. `target_fingerprint` (the target config's
`fingerprint()`) is recorded in the saved manifest, so a drafter cannot be run against another target unnoticed.
"""

from __future__ import annotations

import dataclasses

import numpy as np



@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    layer: object  # the target family's config with num_layers = the drafter's layers (its layer shapes)
    feature_layers: tuple[int, ...]  # target layers whose *outputs* (residual stream after the layer) it reads
    block_sizes: tuple[int, ...] = (4, 8, 16)  # drafted tokens per block it was trained for
    target_fingerprint: str = ""  # the target config's fingerprint() (DecoderConfig) it was built for

    def __post_init__(self):
        if not self.feature_layers or any(i < 0 for i in self.feature_layers):
            raise ValueError(f"feature_layers must be non-empty target layer indices, got {self.feature_layers}")
        if not self.block_sizes or min(self.block_sizes) < 1:
            raise ValueError(f"block_sizes must be positive, got {self.block_sizes}")

    @property
    def num_layers(self) -> int:
        return self.layer.num_layers

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def feature_size(self) -> int:
        """F: the concatenated target hidden states, one hidden_size per feature layer."""
        return len(self.feature_layers) * self.layer.hidden_size

    @property
    def max_block(self) -> int:
        return max(self.block_sizes)

    def check_target(self, target_cfg) -> None:
        """Raise if `target_cfg` is not the model this drafter was built for."""
        if self.target_fingerprint != target_cfg.fingerprint():
            raise ValueError(f"this drafter was trained for a target with config fingerprint "
                             f"{self.target_fingerprint}, not {target_cfg.fingerprint()} "
                             f"({target_cfg.num_layers} layers x {target_cfg.hidden_size}); train a drafter for this "
                             "target (python -m launch.toy.drafter for the toy source) or pass its own target")
        if max(self.feature_layers) >= target_cfg.num_layers:
            raise ValueError(f"feature_layers {self.feature_layers} exceed the target's {target_cfg.num_layers} "
                             "layers")

    def check_block(self, block: int) -> None:
        if block not in self.block_sizes:
            raise ValueError(f"block size {block} was not trained for: this drafter drafts blocks of "
                             f"{list(self.block_sizes)} tokens; pass one of them (draft_len=...) or train it for "
                             f"{block} (--block-sizes)")

    def to_dict(self) -> dict:
        return {"layer": self.layer.to_hf_dict(), "feature_layers": list(self.feature_layers),
                "block_sizes": list(self.block_sizes), "target_fingerprint": self.target_fingerprint}

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        import kvjax.models  # noqa: F401  (registers the families)
        from kvjax.models.family import family_for_model_type
        layer = family_for_model_type(d["layer"].get("model_type"), "drafter manifest").config
        return cls(layer=layer.from_hf_dict(d["layer"], source="drafter manifest"),
                   feature_layers=tuple(int(i) for i in d["feature_layers"]),
                   block_sizes=tuple(int(b) for b in d["block_sizes"]),
                   target_fingerprint=str(d["target_fingerprint"]))


def default_feature_layers(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """`count` target layers spread from the second to the last (the last one's output is closest to the next
    token; the lower ones carry what the top layer has already folded away): (1, 3, 5) for 6 layers."""
    lo = min(1, num_layers - 1)
    return tuple(sorted({int(round(x)) for x in np.linspace(lo, num_layers - 1, min(count, num_layers))}))


def drafter_config(target_cfg, num_layers: int = 1, feature_layers: tuple[int, ...] | None = None,
                   block_sizes: tuple[int, ...] = (4, 8, 16)) -> DrafterConfig:
    """A drafter config for `target_cfg`: its layers are the target's layer shape, num_layers of them."""
    layer = dataclasses.replace(target_cfg, num_layers=int(num_layers))
    feats = default_feature_layers(target_cfg.num_layers) if feature_layers is None else tuple(feature_layers)
    cfg = DrafterConfig(layer=layer, feature_layers=feats, block_sizes=tuple(sorted(set(block_sizes))),
                        target_fingerprint=target_cfg.fingerprint())
    cfg.check_target(target_cfg)
    return cfg
