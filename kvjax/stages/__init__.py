"""The main job's stages (`python -m kvjax.launch`): what they are, their markers, and the code that runs them.

  markers     a run directory's stage markers: hashes of what each stage depends on; reuse, conflicts, --redo
  plan        which stages a config runs and their hashes (plan.plan), MAP_DIRS (the maps' directories)
  context     what the stages share: the mesh, the models, the maps, the tokenizer, the calibration data
  job         the Job: runs the plan (resume, --redo, multi-process), and `start`, what the command hands over to
  calibrate   data/: tokenized calibration text, calibration / lambda-selection / held-out windows
  fit         map_ridge/, map/ (+ residual/ checkpoints), map_perhead/, map_bridge/: the maps
  evaluate    eval/NAME.json: one evaluation of the registry (kvjax.eval.suite)
  report      metrics.json, report.md, charts, gate.json

This package and its markers and plan import no JAX (the command line checks a config before JAX starts); context,
job and the stage modules import it at the top, and the command imports them once its checks have passed.
"""

from kvjax.stages.markers import RunDir, Stage, StageConflict, digest, model_identity, read_json, write_json
from kvjax.stages.plan import COLLECTIVE, EVALS, MAP_DIRS, STAGES, final_arm, fitted_maps

__all__ = ["RunDir", "Stage", "StageConflict", "digest", "model_identity", "read_json", "write_json", "COLLECTIVE",
           "EVALS", "MAP_DIRS", "STAGES", "final_arm", "fitted_maps"]
