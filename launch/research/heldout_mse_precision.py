"""Held-out MSE from float32 statistics vs a float64 reference (issue 24): the ridge module of a commit before the
fix (statistics of y itself) against the current one (statistics of the residual around ridge.reference).

    .venv/bin/python -m launch.research.heldout_mse_precision                 # synthetic data of the mapper test
    .venv/bin/python -m launch.research.heldout_mse_precision --toy 64 --held 16   # + the toy pair (~1 min)

"exact" is the float64 MSE of the same fit on the same float32 features; "lambda f64" is the lambda that exact MSE
picks, and "f64 e2e" the one a float64 fit + float64 held-out statistics pick.
"""

import argparse
import importlib.util
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.mapper import ridge as new

BEFORE = "ce69783"  # the commit issue 24 was filed at


def load_old(commit: str):
    src = subprocess.run(["git", "show", f"{commit}:kvjax/mapper/ridge.py"], capture_output=True, text=True,
                         check=True).stdout
    spec = importlib.util.spec_from_loader("ridge_before", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ridge_before"] = mod  # dataclasses look their module up
    exec(compile(src, f"{commit}:kvjax/mapper/ridge.py", "exec"), mod.__dict__)
    return mod


def stats_of(mod, x, y, chunk, ref=None):
    acc = None
    for i in range(0, len(x), chunk):
        xs, ys = jnp.asarray(x[i:i + chunk], jnp.float32), jnp.asarray(y[i:i + chunk], jnp.float32)
        if ref is None:
            s = mod.to_stats(mod.chunk_stats(xs, ys, jnp.ones(len(xs))))
        else:
            s = mod.to_stats(mod.chunk_stats(xs, ys, jnp.ones(len(xs)), jnp.asarray(ref)), ref)
        acc = s if acc is None else acc.__iadd__(s)
    return acc


def f64_stats(x, y):
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    return new.Stats(float(len(x)), mx, my, xc.T @ xc, xc.T @ yc, (yc * yc).sum(0), np.zeros((x.shape[1], y.shape[1])))


def true_mse(fit, x, y):
    return float(np.mean(np.sum((y - (x - fit.mu) @ fit.weight - fit.bias) ** 2, 1)))


def compare(mods, x, y, xh, yh, train_chunk, held_chunk):
    """{name: (lambda chosen, {lam: relative error of held-out MSE})}, {lam: exact MSE of the new train fit}."""
    out, exact = {}, {}
    for name, mod in mods.items():
        train = stats_of(mod, x, y, train_chunk)
        ref = new.reference(train) if mod is new else None
        held = stats_of(mod, xh, yh, held_chunk, ref)
        errs = {}
        for lam in new.LAMBDAS:
            fit = mod.solve(train, lam)
            e = true_mse(fit, xh, yh)
            errs[lam] = abs(mod.mse(fit, held) / e - 1)
            if mod is new:
                exact[lam] = e
        out[name] = (mod.select(train, held, new.LAMBDAS)[0].lam, errs)
    return out, exact


def report(out, exact, extra=""):
    best = min(exact, key=exact.get)
    gaps = sorted(exact.values())
    cols = [f"{name}: err at best {errs[best]:.1e}, worst {max(errs.values()):.1e}, lambda {lam:g}"
            for name, (lam, errs) in out.items()]
    print("    " + "; ".join(cols) + f"; lambda f64 {best:g}{extra}; best two MSEs differ by {gaps[1] / gaps[0] - 1:.1e}")


def synthetic(mods):
    print("synthetic (the mapper test): x = randn(2000, 6) * [1, 2, 3, 0.1, 1, 1] + offset, y = x @ w + noise + 2")
    for offset, noise in ((5, 0.05), (5, 1e-2), (5, 1e-3), (5, 1e-4), (100, 1e-3)):
        rng = np.random.RandomState(0)
        w = rng.randn(6, 4)
        x = rng.randn(2000, 6) * [1, 2, 3, 0.1, 1, 1] + offset
        y = x @ w + noise * rng.randn(2000, 4) + 2
        x, y = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)  # what f32 sees
        print(f"  offset {offset} noise {noise:g} (held-out MSE {4 * noise ** 2:.1e}):")
        report(*compare(mods, x[:1000], y[:1000], x[1000:], y[1000:], 250, 1000))


def toy(mods, n_calib: int, n_held: int):
    import kvjax
    from kvjax.mapper.calibrate import native_cache
    from kvjax.mapper.features import layer_features, paired_features
    from kvjax.mapper.pairing import depth_pairing
    (scfg, sp), (tcfg, tp) = kvjax.load_hf("checkpoints/toy/source"), kvjax.load_hf("checkpoints/toy/target")
    pairing = depth_pairing(scfg.num_layers, tcfg.num_layers)  # the toy config's pairing
    windows = np.load("checkpoints/toy/eval/heldout_windows.npy").astype(np.int32)[:, :512]  # real text
    calib, held = windows[:n_calib], windows[n_calib:n_calib + n_held]

    @jax.jit
    def features(tokens):
        src, tgt = native_cache(sp, scfg, tokens), native_cache(tp, tcfg, tokens)
        out = []
        for t, layers in enumerate(pairing):
            xk, xv = paired_features(src, layers, scfg.rope)
            yk, yv = layer_features(tgt, t, tcfg.rope)
            out.append([a.reshape(-1, a.shape[-1]) for a in (xk, yk, xv, yv)])
        return out

    def gather(win):
        parts = [jax.device_get(features(jnp.asarray(win[i:i + 8]))) for i in range(0, len(win), 8)]
        return [[np.concatenate([p[t][j] for p in parts]).astype(np.float64) for j in range(4)]
                for t in range(len(pairing))]

    t0 = time.time()
    tr, ho = gather(calib), gather(held)
    print(f"toy pair, depth pairing {pairing}: {n_calib} calib / {n_held} held-out windows of 512 tokens "
          f"(features in {time.time() - t0:.0f}s), chunks of 8 windows as collect_stats sums them")
    chunk = 8 * 512
    for t in range(len(pairing)):
        for kind, (x, y), (xh, yh) in (("key", tr[t][:2], ho[t][:2]), ("value", tr[t][2:], ho[t][2:])):
            out, exact = compare(mods, x, y, xh, yh, chunk, chunk)
            e2e = new.select(f64_stats(x, y), f64_stats(xh, yh))[0].lam
            r2 = 1 - min(exact.values()) / float(np.sum(np.var(yh, 0)))
            print(f"  layer {t} {kind} (held-out R^2 {r2:.3f}, Fx {x.shape[1]}):")
            report(out, exact, f", f64 e2e {e2e:g}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", type=int, default=0, help="calibration windows for the toy pair (0: skip)")
    ap.add_argument("--held", type=int, default=16)
    ap.add_argument("--before", default=BEFORE)
    args = ap.parse_args()
    mods = {f"before ({args.before})": load_old(args.before), "now": new}
    synthetic(mods)
    if args.toy:
        toy(mods, args.toy, args.held)
