"""Cluster entry points: multihost (the main job as N processes on this machine, each with its own fake devices),
fit_distributed (the old fit command's flags onto `python -m kvjax.launch --config=fit`) and templates/ that start the
main job on every host of a Cloud TPU pod slice or a SLURM GPU cluster."""
