"""Stage NAME for each enabled evaluation of the registry (kvjax.eval.suite) -> eval/NAME.json: its record, from
the models, the maps by arm name and the held-out windows of data/."""

from __future__ import annotations

import numpy as np

from kvjax.eval import suite
from kvjax.job.markers import Stage, write_json
from kvjax.run.layout import fitted_maps


def run(job, stage: Stage) -> None:
    """One evaluation of the registry: its record to eval/NAME.json. `job`: the run's kvjax.job.context.Context."""
    source, target = job.models()
    ctx = suite.EvalContext(cfg=job.cfg, source=source, target=target, map=job.map,
                            fitted=fitted_maps(job.cfg), heldout=np.asarray(job.data("heldout")),
                            tokenizer=job.tokenizer, artifacts=job.run.path("eval", stage.name))
    write_json(job.run.path("eval", f"{stage.name}.json"), suite.run(suite.BY_NAME[stage.name], job.cfg, ctx))
