"""Small reads, large answers: the toy pair reversed. The 2-layer toy model prefills the prompt, the map
turns its cache into the 6-layer model's, and the 6-layer model answers; optionally repaired by recomputing some of
the 6-layer model's own layers (kvjax.builders.PartialRecompute, RunConfig.arms).

    python -m kvjax.launch --config=toy_reverse        # writes runs/toy_reverse/
    python -m kvjax.launch --config=toy_reverse --config.source.path=checkpoints/toy/pruned \\
        --config.output_dir=runs/toy_reverse_pruned   # the other candidate reader

"source" / "target" are roles (reader / answerer), not sizes: here source = checkpoints/toy/target (2 layers x 64,
one KV head of 32) and target = checkpoints/toy/source (6 layers x 256, two KV heads of 64).

The reader: the 2-layer model, not the pruned one (3 of the 6-layer model's layers at its width, so its cache is
already in nearly the right coordinates). Measured side by side on 2026-11-30 (shared, noisy machine: ridge
maps on 64 x 512 calibration tokens, depth pairing, KL over 32 held-out windows of 256 + 64 tokens, TTFT of one 4K
prompt, medians of 3 rounds); this job's `ttft` and `native_kl` sections measure the same, e.g. the two commands above
with `--config.residual.steps=0 --config.map.calib_windows=64 --config.eval.native_kl.windows=32`:

    reader              TTFT 4K vs the 6-layer prefill   KL to native: mapped   direct reuse   mapped - direct
    2-layer x 64        5.70x (0.80 s vs 4.55 s)                   0.339         0.448          -0.109
    pruned 3-layer x 256  1.48x (2.55 s vs 3.76 s)                 0.294         0.310          -0.016

The direction exists for the first token: only the 2-layer reader can make it >= 5x faster (the pruned one runs half
the 6-layer model's attention at full width, so it cannot pass 2x), and its map is clearly better than reusing its
layers as they are. The pruned reader gives the better cache (KL 0.294) but mostly through direct reuse, which the
map barely improves; run it with the second command above.

What this run measures (docs/metrics.md): `ttft` (reader prefill + map [+ repair] [+ native tail] [+ both] vs the
6-layer model's own prefill at 1K/2K/4K, one run, rotating order), `native_kl` (the 6-layer model's KL to its own
native predictions and agreement with them from the mapped cache vs direct reuse of the reader's layers vs the
repaired cache, the native tail and both, paired by window), `mc` (the 6-layer model answering from each cache vs
natively, paired by item), `retrieval` at
1K (the 6-layer model retrieves nothing past its 1K training length), `speculative` (the 2-layer model drafting for the
6-layer one: plain, and from the transferred cache, repaired, with the native tail too, vs native decoding at 1K
and 4000 tokens) and `distances`. The `kl`
evaluation (source-teacher KL: the reader as teacher) and `throughput` (the forward direction's decode speed) are off;
the residual learns the 6-layer model's own predictions (residual.teacher="target"). The gate holds the answerer's
multiple-choice accuracy from the mapped cache to >= 95% of its native accuracy.

Measured (2026-12-01, `taskset -c 1 python -m kvjax.launch --config=toy_reverse`, one pinned core): TTFT
at 4K 11.6x faster from the 2-layer prefill + map than the 6-layer prefill (7.5x at 1K), 1.46x with the bottom-4
repair; KL to the 6-layer model's own predictions (64 windows) 0.413 from the residual map vs 0.554 from direct reuse
(paired 95% CI of the difference [-0.157, -0.126]), 0.022 repaired. Multiple choice from the mapped cache collapses
(HellaSwag 29.0% vs 58.5% native, PIQA 61.0% vs 80.5%): the 2-layer reader's cache does not carry what the 6-layer
model needs to read a context. The repair depth decides it (one run per depth, `--config.arms.partial_k=K`):

    bottom layers recomputed     3                     4                      5
    HellaSwag - native, pts      -29.0 [-35.5, -22.5]   -4.0 [-7.0, -1.5]      -1.5 [-3.5, 0.0]
    PIQA - native, pts           -18.5 [-24.0, -13.5]   -2.0 [-4.0, -0.5]      -0.5 [-1.5, 0.0]
    retrieval at 1K              0%                     100%                   100% (native 100%)
    TTFT at 4K vs native         2.04x                  1.46x                  1.14x
    speculative KV transfer at 4000 tokens, end to end vs native (draft length 2 / 4 / 6):
                                 -35 / -38 / -33%       -25 / -20 / -16%       -2 / -1 / +10%

so with layers alone the toy cannot have both: accuracy within native's interval needs 5 of the 6 layers, which
leaves no latency to gain. Default: 4 (the knee: retrieval and nearly all of the accuracy come back; with the native
tail below, all of it). Plain drafting by the 2-layer model
is 7-37% slower end to end than native decoding (it agrees with the 6-layer model's next token 43% of the time, and a
verify round costs 1.7-2.6 decode steps on CPU); the 6-layer model drafting for itself by prompt lookup (lookup@G) is
11-22% faster end to end at 1K and at most 7% faster at 4000 tokens, where the prefill is most of the time.

The other repair, along positions (the `tail` arm, kvjax.builders.NativeTail, `arms.tail_tokens` = 64): the mapped cache
with the prompt's last 64 tokens read by the 6-layer model itself. Measured 2026-12-06 (this job; docs/method.md, "Small
reads, large answers (the reverse direction)", the tail arm): TTFT at 4K 8.0x the 6-layer prefill (the map alone 10.1x,
bottom 4 1.3x); HellaSwag -8.0 [-12.0, -4.5] and PIQA -7.0 [-11.0, -3.5] points vs native (bottom 4: -4.0 / -2.0, the
map alone: -29.5 / -19.5) on ~200-token contexts, of which 64 tokens are a third; at 4K they close 36% of the map's KL
gap to native predictions (76% at 256 tokens); retrieval 0/10 (the needle is in the mapped part).

Both repairs (the `partial_tail` arm: bottom 4 recomputed, then the last 64 tokens read natively; measured 2026-12-06
by this job, docs/method.md "Small reads, large answers (the reverse direction)"): the same ending as native on 200 /
200 HellaSwag and 199 / 200 PIQA items (0.0 [0.0, 0.0] and -0.5 [-1.5, 0.0] points), KL to native 0.0017 (bottom 4:
0.022), retrieval 10/10, TTFT at 4K 1.2x the 6-layer prefill (bottom 4: 1.3x): native accuracy and a faster first token
together. As speculative KV transfer (tail@4) it is 0.96x native end to end at 4000 tokens (repaired@4 0.89x): the
closer the verifier's answers are to its own, the fewer of the 2-layer drafter's tokens it accepts (1.20 a round against
1.55).

Sizes: the forward toy job's calibration (128 x 512 tokens) and residual (100 steps of 8 x (256 + 64)), 64 native-KL
windows, 200 items per multiple-choice set, 10 retrieval items, TTFT 5 timed rounds; about 9 minutes on 2 CPU cores
(2026-12-06: 7:18 before the partial_tail arm, whose scoring and timing added 1:39 to the stages from mc on).
"""

import dataclasses

from configs import toy
from kvjax.eval.arm_settings import ArmSettings
from kvjax.eval.gate import GateConfig
from kvjax.run.config import NativeKLEval, SpeculativeEval, TTFTEval

def get_config():
    base = toy.get_config()
    return dataclasses.replace(
        base,
        name="toy_reverse",
        source=dataclasses.replace(base.target, name="toy 2-layer (reader)"),
        target=dataclasses.replace(base.source, name="toy 6-layer (answerer)"),
        output_dir="runs/toy_reverse",
        residual=dataclasses.replace(base.residual, teacher="target"),
        arms=ArmSettings(partial_k=4, partial_mode="bottom", tail_tokens=64),
        eval=dataclasses.replace(
            base.eval,
            kl=dataclasses.replace(base.eval.kl, enabled=False),
            throughput=dataclasses.replace(base.eval.throughput, enabled=False),
            mc=dataclasses.replace(base.eval.mc, arms=(*base.eval.mc.arms, "tail", "partial_tail")),
            retrieval=dataclasses.replace(base.eval.retrieval, lengths=(1024,), limit=10,
                                          arms=("target", "source", "direct", "residual", "partial", "tail",
                                                "partial_tail")),
            native_kl=NativeKLEval(enabled=True, windows=64, prefix_len=256, cont_len=64,
                                   arms=(*NativeKLEval().arms, "tail", "partial_tail")),
            ttft=TTFTEval(enabled=True, lengths=(1024, 2048, 4096), repeats=5, tail=True, partial_tail=True),
            # 4000: the toy models' 4096 positions hold the prompt, 64 new tokens and a last verify round's 4 + 1
            speculative=SpeculativeEval(enabled=True, lengths=(1024, 4000), draft_lens=(4,), new_tokens=64, repeats=3,
                                        tail=True),
        ),
        gate=GateConfig(min_key_cos=None, min_value_cos=None, max_kl_vs_target=None, min_kl_reduction=None,
                        min_mc_retention=0.95),
    )
