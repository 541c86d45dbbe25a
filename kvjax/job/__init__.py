"""The main job, `python -m kvjax.launch`: the command, the stages that make a run directory, and what they share.
It reads a run as kvjax.run describes it (the config, its checks, the directory's layout).

  command       the command line: flags and config read and checked without JAX, the run directory locked, the
                process restarted under the allocator settings, then the stages (`main`)
  stages        which stages a config runs and what each depends on (`plan`: their hashes, known before any work)
  markers       a run directory's stage markers: reuse, conflicts, --redo
  lock, disk    one job per run directory; the free space the stages need, and a write the disk refuses
  execute       the Job: runs the plan (resume, --redo, multi-process), and `start`, what the command hands over to
  context       what the stages share: the mesh, the models, the maps, the tokenizer, the calibration data
  calibration   stage calibrate -> data/: tokenized calibration text, calibration / lambda-selection / held-out windows
  maps          stages ridge, residual, perhead, bridge -> map_ridge/, map/ (+ residual/ checkpoints), map_perhead/, ...
  evaluations   one stage per evaluation of the registry (kvjax.eval.suite) -> eval/NAME.json
  reporting     stage report -> metrics.json, report.md, charts, gate.json

command, stages, markers, lock and disk import no JAX (the command line checks a config before JAX starts); the
others import it at the top, and the command imports them once its checks have passed.
"""
