"""The default run's pair (source + pruned target) with a residual that also learns long-range copies, so that the
target retrieves a needle through the mapped cache (issue 22 item 4).

    python -m kvjax.launch --config=toy_pruned_retrieval     # writes runs/toy_pruned_retrieval/

The default run's map retrieves nothing at 1K (0/200; the source 195/200): its residual is trained on 256 + 64-token
windows that never hold a copy from far back, and the pruned target lost the source layer that writes previous-token
information into the keys its reader layer attends with (WORKSPACE.md, "Retrieval through the mapped cache"). Here
every step also reads `residual.copy_batch` fact-copy windows (kvjax.mapper.copy_windows): 1,024 tokens of training
text with a 16-token "key = digits" fact written 64-960 tokens back, then repeated, scored by KL to the source on the
repeat; half the loss is theirs, half the ordinary windows' (4 per step from the default's pool of 1,536).
800 steps x (4 + 4) windows: the default's 3,200 ordinary window visits, plus 3,200 copy visits (a pool of 256).

The report scores retrieval on 100 of the shipped 1K items (the default: 10) for the native target, the source and
the map; the gate adds `min_retrieval` (the map's exact match at 1K >= 50%) to the default's goals. The per-head
peer and the throughput timing are the default run's (off here: they do not change with the residual).
"""

import dataclasses

from configs import toy_pruned_quick
from kvjax.run_config import PeerConfig


def get_config():
    base = toy_pruned_quick.get_config()
    ev = base.eval
    return dataclasses.replace(
        base,
        name="toy_pruned_retrieval",
        output_dir="runs/toy_pruned_retrieval",
        residual=dataclasses.replace(base.residual, steps=800, batch_size=4, copy_windows=256, copy_len=1024,
                                     copy_span=16, copy_batch=4, copy_weight=0.5),
        peers=PeerConfig(),
        eval=dataclasses.replace(
            ev, mc=dataclasses.replace(ev.mc, arms=("target", "source", "ridge", "residual")),
            retrieval=dataclasses.replace(ev.retrieval, lengths=(1024,), limit=100,
                                          arms=("target", "source", "residual")),
            throughput=dataclasses.replace(ev.throughput, enabled=False)),
        gate=dataclasses.replace(base.gate, min_retrieval=0.5),
    )
