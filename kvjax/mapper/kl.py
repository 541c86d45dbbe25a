"""KL(teacher || student) between two models' next-token distributions: the residual map's training loss
(``kvjax.fitting.residual``) and the evaluations' measure of how far a cache moves the answering model
(``kvjax.eval.token_agreement``, ``kvjax.eval.reading``). Its own module so that measuring does not import training."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kl(teacher_logits: jax.Array, student_logits: jax.Array) -> jax.Array:
    """KL(teacher || student) per position, in nats: [..., V] -> [...]."""
    p_log = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), -1)
    q_log = jax.nn.log_softmax(student_logits.astype(jnp.float32), -1)
    return jnp.sum(jnp.exp(p_log) * (p_log - q_log), -1)
