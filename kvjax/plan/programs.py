"""The programs a plan compiles, each built from the library function the job calls (its `kvjax.aot.jit`), the
abstract arguments the job would pass on the slice's mesh, and its arithmetic (kvjax.plan.costs) per device.

A builder here knows how the job calls one library program (which arguments, which are static, what is donated);
kvjax.plan.job and kvjax.plan.serve say which programs each stage and the server run, at which shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.builders.mapped import map_jit, span_jit
from kvjax.builders.partial import recompute_jit
from kvjax.models.decoder import decode_jit, prefill_jit
from kvjax.models.model import Model
from kvjax.plan import costs, shapes
from kvjax.plan.program import Program


@dataclasses.dataclass
class Builder:
    """What every program of one plan shares: the two models (abstract, sharded), the mesh, the cache dtype."""

    source: Model
    target: Model
    mesh: jax.sharding.Mesh
    dtype: str  # the caches' dtype (the job's: the source's parameter dtype)
    sources: dict = dataclasses.field(default_factory=dict)  # role -> where its shapes were read
    stage: str = ""
    mesh_memory: float = 0.0  # the memory per device of the slice (the server's capacity table reads it)

    @property
    def devices(self) -> int:
        return self.mesh.size

    def model(self, who: str) -> Model:
        return {"source": self.source, "target": self.target}[who]

    def at(self, stage: str) -> "Builder":
        return dataclasses.replace(self, stage=stage)

    def weights(self, who: str) -> int:
        return shapes.nbytes_per_device(self.model(who).params)

    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    def tokens(self, rows: int, length: int) -> jax.ShapeDtypeStruct:
        return shapes.batch_sharded((rows, length), jnp.int32, self.mesh) if self._splits(rows) else \
            shapes.replicated((rows, length), jnp.int32, self.mesh)

    def rows(self, rows: int, dtype=jnp.int32) -> jax.ShapeDtypeStruct:
        return shapes.batch_sharded((rows,), dtype, self.mesh) if self._splits(rows) else \
            shapes.replicated((rows,), dtype, self.mesh)

    def _splits(self, rows: int) -> bool:
        return rows % self.mesh.shape["data"] == 0

    def cache(self, who: str, rows: int, capacity: int, keys_transposed: bool = False):
        return shapes.cache(self.model(who).cfg, rows, capacity, self.dtype, self.mesh, keys_transposed)

    def kv_share(self, who: str, rows: int) -> float:
        """The share of a cache's bytes one device holds (kv heads over 'model', rows over 'data')."""
        c = self.cache(who, rows, 128)
        return shapes.nbytes_per_device(c) / max(shapes.nbytes(c), 1)

    def program(self, name: str, fn, args: tuple, kwargs: dict, flops: float, hbm_bytes: float,
                holds: tuple[str, ...], extra_weights: int = 0, note: str = "", kept: int = 0) -> Program:
        """A Program of this stage; `flops` and `hbm_bytes` per device; `kept`: bytes per device the stage keeps
        alive beside it (Program.kept_bytes)."""
        weight_bytes = sum(self.weights(w) for w in holds if w in ("source", "target")) + extra_weights
        return Program(self.stage, name, fn, args, kwargs, self.mesh, flops, hbm_bytes, holds, weight_bytes, note,
                       kept)

    def keeping(self, program: Program, *trees) -> Program:
        """`program` with the per-device bytes of `trees` (abstract arrays the stage holds meanwhile) kept beside it."""
        program.kept_bytes += sum(shapes.nbytes_per_device(t) for t in trees)
        return program

    @property
    def data(self) -> int:
        return self.mesh.shape["data"]

    def fwd(self, who: str, rows: int, tokens: int, context: float, logit_tokens: int) -> float:
        """Per-device FLOPs of a forward pass of `who` (kvjax.plan.costs.device_forward_flops)."""
        return costs.device_forward_flops(self.model(who), rows, tokens, context, logit_tokens, self.data)

    def wbytes(self, who: str, tokens: int | None = None, logits: bool = True) -> float:
        """Per-device weight bytes a call of `who` reads."""
        return costs.device_weight_bytes(self.model(who), self.itemsize(), tokens, logits)

    def per_row(self, rows: int) -> float:
        """The share of `rows` one device computes (the data axis splits rows it divides)."""
        return 1.0 / self.data if rows % self.data == 0 else 1.0

    # ---- the decoder's programs --------------------------------------------------------------------------------

    def prefill(self, who: str, rows: int, length: int, capacity: int | None = None, *, logits: bool = False,
                last_only: bool = True, feature_layers: tuple[int, ...] = (), cache: bool = False,
                context: int = 0, what: str = "prefill") -> Program:
        """prefill_jit as kvjax.builders.native.prefill_cache calls it (a new cache of `capacity`), or (`cache`)
        over an existing cache holding `context` positions: `rows` x `length` tokens."""
        m = self.model(who)
        capacity = capacity or length
        args = (m.params, m.cfg, self.tokens(rows, length), self.rows(rows))
        kwargs = dict(logits=("last" if last_only else "all") if logits else None, features=tuple(feature_layers))
        if cache:
            args += (self.cache(who, rows, capacity),)
        else:
            kwargs.update(capacity=capacity, dtype=jnp.dtype(self.dtype))
        flops = self.fwd(who, rows, length, context + (length + 1) / 2, 1 if logits and last_only
                         else (length if logits else 0))
        share = self.kv_share(who, rows)
        moved = (self.wbytes(who, rows * length, logits)
                 + share * costs.kv_bytes(m.cfg, rows, context + length, self.itemsize()))
        return self.program(f"{who} {what} {rows} x {length}" + (f" after {context}" if context else ""),
                            prefill_jit, args, kwargs, flops, moved, (who,))

    def decode(self, who: str, rows: int, capacity: int, context: int | None = None) -> Program:
        """decode_jit: one token per row over a cache of `capacity` (priced at `context` live positions)."""
        m = self.model(who)
        context = capacity if context is None else context
        args = (m.params, m.cfg, self.rows(rows), self.cache(who, rows, capacity))
        flops = self.fwd(who, rows, 1, context, 1)
        moved = (self.wbytes(who, rows)
                 + self.kv_share(who, rows) * costs.kv_bytes(m.cfg, rows, context + 1, self.itemsize()))
        return self.program(f"{who} decode step {rows} x {capacity}", decode_jit, args, {}, flops, moved, (who,))

    # ---- the map's programs ------------------------------------------------------------------------------------

    def apply_map(self, kvmap, rows: int, length: int, capacity: int | None = None, impl: str = "xla",
                  name: str = "map") -> Program:
        """map_jit as kvjax.builders.Mapped calls it: the source's cache of `length` positions (held at the
        answerer's capacity) into a new target cache."""
        capacity = capacity or length
        src = self.cache("source", rows, capacity)
        args = (kvmap, src)
        kwargs = dict(capacity=capacity, length=length, impl=impl)
        it = self.itemsize()
        moved = (self.kv_share("source", rows) * costs.kv_bytes(self.source.cfg, rows, length, it)
                 * _paired_share(kvmap, self.source.cfg)
                 + self.kv_share("target", rows) * costs.kv_bytes(self.target.cfg, rows, capacity, it)
                 + costs.map_weight_bytes(kvmap))
        return self.program(f"{name} {rows} x {length}" + (" (Pallas)" if impl == "pallas" else ""), map_jit, args,
                            kwargs, costs.map_flops(kvmap, rows, length) * self.per_row(rows), moved, ())

    def map_span(self, kvmap, rows: int, width: int, capacity: int) -> Program:
        """span_jit: the positions a row's source cache gained (a prompt read in pieces) mapped into its target
        cache in place."""
        args = (kvmap, self.cache("source", rows, capacity), self.cache("target", rows, capacity),
                self.rows(rows))
        it = self.itemsize()
        moved = (self.kv_share("source", rows) * costs.kv_bytes(self.source.cfg, rows, width, it)
                 + self.kv_share("target", rows) * costs.kv_bytes(self.target.cfg, rows, width, it)
                 + costs.map_weight_bytes(kvmap))
        return self.program(f"map span {rows} x {width}", span_jit, args, dict(width=width),
                            costs.map_flops(kvmap, rows, width) * self.per_row(rows), moved, ())

    def recompute(self, layers: tuple[int, ...], rows: int, length: int, capacity: int) -> Program:
        """recompute_jit (kvjax.builders.partial): the target's own layers `layers` recomputed over a mapped cache."""
        m = self.target
        args = (m.params, m.cfg, self.tokens(rows, length), self.rows(rows), self.cache("target", rows, capacity))
        frac = (max(layers) + 1) / m.cfg.num_layers  # the pass runs every layer up to the top recomputed one
        flops = frac * self.fwd("target", rows, length, (length + 1) / 2, 0)
        moved = frac * self.wbytes("target", rows * length, False)
        return self.program(f"target recompute {len(layers)} layers {rows} x {length}", recompute_jit, args,
                            dict(layers=tuple(layers)), flops, moved, ("target",))


def _paired_share(kvmap, scfg) -> float:
    """How many source layers' keys and values the map reads, as a share of the source's (each at most once)."""
    layers = {s for p in kvmap.spec.pairing for s in p}
    return len(layers) / scfg.num_layers


def heldout_rows(n: int, batch: int) -> list[int]:
    """The batch sizes a loop over n items in batches of `batch` runs: the full one and the last, smaller one."""
    sizes = [batch] if n >= batch else []
    if n % batch:
        sizes.append(n % batch)
    return sizes


def np_int(x) -> int:
    return int(np.asarray(x))
