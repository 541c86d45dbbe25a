"""The drafters launch.bench.spec_cost prices: the toy source's own (prompt lookup, the block drafter and the two
combined, selected by --kinds), the small models of --models drafting one token a forward, and speculative KV transfer
through --transfer's map (the small model drafting while the verifier reads the cache the map made of the small
model's prefill). See launch.bench.spec_cost's docstring for how each is named, checked and priced."""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np

KINDS = ("lookup", "block", "combined")


def small_models(args, source) -> dict:
    """--models by their directory's names (the smoke run: one tiny random model of the verifier's vocabulary)."""
    if args.smoke:
        import jax

        import kvjax
        cfg = dataclasses.replace(source.cfg, num_layers=1, hidden_size=32, intermediate_size=64)
        return {"small": kvjax.Model(cfg, kvjax.init_params(cfg, jax.random.key(5)))}
    from kvjax.hf import load_hf
    out = {}
    for path in args.models:
        label = os.path.basename(os.path.normpath(path))
        model = load_hf(path)
        if model.cfg.vocab_size != source.cfg.vocab_size or label in KINDS or label in out:
            sys.exit(f"launch.bench.spec_cost: --models {path}: a drafter needs the verifier's vocabulary "
                     f"({source.cfg.vocab_size}; it has {model.cfg.vocab_size}) and a directory name of its own "
                     f"(not lookup, block, combined or another model's: {label!r})")
        out[label] = model
    return out


def transfer_map(args, source, models: dict):
    """(small model's label, map) of --transfer: the map checked against the verifier and one of --models."""
    import kvjax
    if args.smoke:
        rng = np.random.RandomState(0)
        windows = [rng.randint(1, source.cfg.vocab_size, (n, 32)).astype(np.int32) for n in (8, 4)]
        kvmap, _ = kvjax.fit_map(models["small"], source, *windows, batch_size=4, residual_rank=2)
        return "small", kvmap
    try:
        kvmap = kvjax.load_map(args.transfer)
    except (OSError, ValueError) as e:
        sys.exit(f"launch.bench.spec_cost: --transfer {args.transfer}: {e}")
    from kvjax.mapper.kvmap import check_models
    for label, model in models.items():
        try:
            check_models(kvmap, model.cfg, source.cfg)
            return label, kvmap
        except ValueError:
            continue
    sys.exit(f"launch.bench.spec_cost: --transfer {args.transfer} maps no model of --models into the verifier "
             f"{args.source} (fit one with python -m kvjax.launch --config=toy_reverse: runs/toy_reverse/map, and pass "
             "its reader, checkpoints/toy/target, in --models)")


def make_drafters(args, source):
    """(drafters, parts, calls, builders): name -> drafter; part name -> the drafter that is that part alone; name ->
    (Stats -> calls of each part); name -> the builder of the verifier's cache (transfers only)."""
    from kvjax.speculative import LookupDrafter, ModelDrafter, combined, transfer_builder
    vocab = source.cfg.vocab_size
    if not {"block", "combined"} & set(args.kinds):
        blocks = {}
    elif args.smoke:
        import jax

        from kvjax.drafter import block_drafter, drafter_config, init_drafter
        dcfg = drafter_config(source.cfg, num_layers=1, block_sizes=tuple(args.blocks))
        dparams = init_drafter(dcfg, jax.random.key(3), target_params=source.params)
        blocks = {b: block_drafter(source, dcfg, dparams, draft_len=b, refine=args.refine) for b in args.blocks}
    else:
        from kvjax.drafter import load_block_drafter
        blocks = {b: load_block_drafter(args.drafter, source, draft_len=b, refine=args.refine) for b in args.blocks}
    models = small_models(args, source)
    drafters, parts, calls, builders = {}, {}, {}, {}
    if args.transfer:
        small, kvmap = transfer_map(args, source, models)
        made = {k: transfer_builder(models[small], source, kvmap, k) for k in args.transfer_repair}
    for b in args.blocks:
        lookup = LookupDrafter(vocab, draft_len=b)
        if "lookup" in args.kinds or "combined" in args.kinds:  # combined's parts are lookup's and the block's
            parts[f"lookup-{b}"] = lookup
        if blocks:
            parts[f"block-{b}"] = blocks[b]
        if "lookup" in args.kinds:
            drafters[f"lookup-{b}"] = lookup
            calls[f"lookup-{b}"] = lambda st, b=b: {f"lookup-{b}": st.widths.sum()}
        if "block" in args.kinds:
            drafters[f"block-{b}"] = blocks[b]
            calls[f"block-{b}"] = lambda st, b=b: {f"block-{b}": st.widths.sum()}
        if "combined" in args.kinds:
            drafters[f"combined-{b}"] = combined(blocks[b], vocab, min_match=args.min_match, splice=args.splice,
                                                 overrule=args.overrule)
            calls[f"combined-{b}"] = lambda st, b=b: {f"lookup-{b}": st.widths.sum(),
                                                      f"block-{b}": int(st.drafter["model_rounds"])}
        for label, model in models.items():
            name = f"{label}-{b}"
            drafters[name] = parts[name] = ModelDrafter(model, draft_len=b)
            calls[name] = lambda st, name=name: {name: st.widths.sum()}
        if args.transfer:  # the small model's rounds, from a translated cache: its parts
            for k, builder in made.items():
                name = f"transfer{k}-{b}"
                drafters[name], builders[name] = ModelDrafter(models[small], draft_len=b), builder
                calls[name] = lambda st, part=f"{small}-{b}": {part: st.widths.sum()}
    return drafters, parts, calls, builders
