"""Direct injection as a map: the baseline every fitted map is measured against (the method's claim: "next-token
agreement 30x over direct injection"). Each target layer gets its nearest-depth source layer's keys and values as they
are (kvjax.mapper.kvmap.direct_map) or, when the KV widths differ, cut / zero-padded to the target's width."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from kvjax.mapper.kvmap import KVMap, LinearMap, direct_map, spec_for
from kvjax.mapper.pairing import depth_pairing
from kvjax.models.family import DecoderConfig


def injection_map(source: DecoderConfig, target: DecoderConfig) -> KVMap:
    """The direct-injection baseline as a map: each target layer gets its nearest-depth source layer's features
    unchanged (kvjax.mapper.kvmap.direct_map) or, when widths differ, cut / zero-padded to the target's width."""
    pairing = depth_pairing(source.num_layers, target.num_layers)
    if (source.num_kv_heads, source.head_dim) == (target.num_kv_heads, target.head_dim):
        return direct_map(source, target, pairing)
    fx, fy = source.num_kv_heads * source.head_dim, target.num_kv_heads * target.head_dim
    m = min(fx, fy)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    layer = LinearMap(mu=f32(np.zeros(fx)), scale=f32(1.0), w_in=f32(np.eye(fx, m)), w_out=f32(np.eye(m, fy)),
                      bias=f32(np.zeros(fy)), down=f32(np.zeros((fx, 1))), res_bias=f32(np.zeros(1)),
                      up=f32(np.zeros((1, fy))))
    layers = (layer,) * target.num_layers
    return KVMap(keys=layers, values=layers, spec=spec_for(source, target, pairing, None, 1))


def injection_kind(source: DecoderConfig, target: DecoderConfig) -> str:
    same = (source.num_kv_heads, source.head_dim) == (target.num_kv_heads, target.head_dim)
    return "copy" if same else "width-matched (cut / zero-padded)"
