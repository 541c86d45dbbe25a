"""Fitting the cache map: calibration statistics, the ridge fit (per layer or per head), the residual trained on
source-teacher KL, and the data its training reads (teacher pools, fact-copy windows). Empty on purpose: the
residual's settings (residual_config) are read without JAX."""
