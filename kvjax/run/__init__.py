"""A run of the method, as the commands read it before any work (no JAX): its settings (config: RunConfig, the
default run), their checks (preflight) and its directory's layout (layout: the stages, the maps' directories). The
job (kvjax.job, `python -m kvjax.launch`) makes a run; the server (kvjax.serve) and the compile-only plan
(kvjax.plan) read one."""
