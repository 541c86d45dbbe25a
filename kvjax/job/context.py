"""What the stages of one run share, loaded on first use: the mesh they run on, the two models, the maps (fitted
by this run, or the untrained injection), the tokenizer and the calibration data of data/."""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kvjax import distributed
from kvjax.hf import load_hf, load_hf_config, load_tokenizer
from kvjax.mapper.artifact import load_map
from kvjax.mapper.injection import injection_map
from kvjax.models.params import abstract_params, param_axes
from kvjax.run.preflight import make_mesh
from kvjax.run.config import RunConfig
from kvjax.sharding import tree_shardings
from kvjax.job.markers import RunDir
from kvjax.run.layout import MAP_DIRS

log = logging.getLogger("kvjax.launch")


class Context:
    """The shared resources of a run's stages. In a multi-process run the data-parallel stages use every device of
    every process, and process 0 runs the others alone on its own devices (`local`): the mesh, the models and the
    maps are those of the scope the current stage runs in."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.process_index = jax.process_index()
        self.run = RunDir(cfg.output_dir, writer=self.process_index == 0, sync=distributed.wait_all)
        self._models = {}  # scope ("global" / "local") -> (source, target)
        self._maps = {}
        self._mesh = None
        self._local = False  # running a stage on this process's devices only (multi-process: process 0 alone)

    def mesh(self):
        """The mesh the current stage runs on: every device of every process, or in a stage process 0 runs alone,
        its own part of that mesh."""
        if self._mesh is None:
            self._mesh = make_mesh(self.cfg)
        return self._mesh.local_mesh if self._local and jax.process_count() > 1 else self._mesh

    def parallel_mesh(self):
        """The mesh for the mapper's data-parallel paths (fit_map / train_residual mesh=), None on one device."""
        return self.mesh() if self.mesh().size > 1 else None

    def models(self):
        scope = "local" if self._local and jax.process_count() > 1 else "global"
        if scope not in self._models:
            if "global" in self._models:  # the same buffers, seen from this process alone
                self._models[scope] = distributed.local_view(self._models["global"], self._mesh)
            else:
                self._models[scope] = self._load_models()
        return self._models[scope]

    def _load_models(self):
        out = []
        for role in ("source", "target"):
            mc = getattr(self.cfg, role)
            mcfg = load_hf_config(mc.path)
            shardings = tree_shardings(abstract_params(mcfg), param_axes(mcfg), self.mesh())
            t0 = time.perf_counter()
            out.append(load_hf(mc.path, dtype=jnp.dtype(mc.dtype), shardings=shardings))
            log.info("loaded %s %s (%.1fM params, %d layers, %d kv heads x %d) in %.1fs", role, mc.path,
                     mcfg.num_params() / 1e6, mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim,
                     time.perf_counter() - t0)
        return tuple(out)

    def tokenizer(self):
        return load_tokenizer(self.cfg.target.path)

    def data(self, name: str):
        return np.load(self.run.path("data", f"{name}.npy"), mmap_mode="r")

    def replicated(self, tree):
        """`tree` replicated over the current mesh (which may span processes: every process passes the same)."""
        mesh = self.mesh()
        return tree if mesh.size == 1 else distributed.replicate(tree, mesh)

    def map(self, name: str):
        """A map by arm name (ridge, residual, perhead, bridge: fitted by this run; direct, raw: the untrained
        injection), replicated over the current mesh (the job empties this cache when the mesh changes)."""
        if name not in self._maps:
            source, target = self.models()
            if name in ("direct", "raw"):
                kvmap = self.replicated(injection_map(source[0], target[0]))
            else:
                kvmap = load_map(self.run.path(MAP_DIRS.get(name, MAP_DIRS["residual"])), source[0], target[0],
                                 sharding=NamedSharding(self.mesh(), PartitionSpec()))
            self._maps[name] = kvmap
        return self._maps[name]

    def forget_map(self, name: str) -> None:
        """Drop a map from the cache (its stage has just rewritten it)."""
        self._maps.pop(name, None)

    def scope(self, collective: bool) -> None:
        """Run the next stage on every process's devices (collective) or on this process's alone."""
        if self._local == collective and jax.process_count() > 1:
            self._maps.clear()  # maps placed on the other mesh
        self._local = not collective
