"""`Model`: a model as one value — its static config and its params — registered as a pytree (params are the
leaves, the config is static data), so it can be passed through jit, device_put or tree maps whole.

It unpacks like the (config, params) pair the library used before (`cfg, params = model`, `model[0]`), so code that
takes "a model" accepts either. The pure per-call functions (kvjax.prefill, decode_step, forward, ...) keep the
params-first order of functional JAX code: `fn(params, cfg, ...)`, with the config static.
"""

from __future__ import annotations

from typing import Any

from flax import struct

from kvjax.models.params import Params


@struct.dataclass
class Model:
    cfg: Any = struct.field(pytree_node=False)  # the family's config (static: a jit specialises on it)
    params: Params = None

    def __iter__(self):
        return iter((self.cfg, self.params))

    def __getitem__(self, i):
        return (self.cfg, self.params)[i]

    def __len__(self) -> int:
        return 2

    @property
    def family(self):
        from kvjax.models.family import family_of
        return family_of(self.cfg)

    def __repr__(self) -> str:
        return f"Model({type(self.cfg).__name__}, {self.cfg.num_layers} layers, {self.cfg.num_params() / 1e6:.2f}M)"


def as_model(model) -> Model:
    """A Model from a Model or a (config, params) pair."""
    if isinstance(model, Model):
        return model
    cfg, params = model
    return Model(cfg, params)
