"""Cluster entry points: multihost (the main job as N processes on this machine, each with its own fake devices)
and templates/ that start the main job on every host of a Cloud TPU pod slice or a SLURM GPU cluster."""
