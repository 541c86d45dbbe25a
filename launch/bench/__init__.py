"""Benchmarks: foundation (prefill / decode vs transformers), map (fitting and applying the cache map), kernel (the
Pallas map kernel vs XLA, on a device), fit_scaling (the data-parallel fit over devices). Each module's docstring
gives its command; the measured numbers are in WORKSPACE.md."""
