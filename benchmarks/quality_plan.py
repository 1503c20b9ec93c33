"""What the quality benchmark runs: the systems (the baseline first), each one's arch, extra
fairseq-train options, seeds and the family whose learning rate it takes; the primary pair's
seeds that keep every checkpoint; the comparisons beside the baseline's; the learning rates tried (and
those tried beside them for the primary pair); the languages; the demo's budget
settings a results directory records; and the demo's translation options, here for the
validation set.
"""
BASELINE = "transformer_lite"
#: name -> (arch, extra fairseq-train options, seeds, the family whose learning rate it takes, or
#: None: its own, chosen on the validation set); the first is the baseline. The dropout a
#: mechanism defines itself: quality_results.OWN_DROPOUT. Seeds and the systems after the first
#: eight: the plan stated before their runs (quality/plan.md)
SYSTEMS = {
    "transformer_lite": ("transformer_lite", "", 10, None),
    "ea_transformer_lite": ("ea_transformer_lite", "", 10, None),
    "pa_transformer_lite": ("pa_transformer_lite", "", 3, None),
    "ran_d_lite": ("ran_d_lite", "", 3, None),
    "ran_all_lite": ("ran_all_lite", "", 3, None),
    "realformer_lite": ("realformer_lite", "", 3, None),
    "resformer_lite": ("resformer_lite", "", 3, None),
    # DropAttention(e) with the paper's MT setting (README: p 0.2, window 2)
    "transformer_lite_dropattention_e": ("transformer_lite", "--drop-attention element --drop-attention-p 0.2 "
                                                             "--drop-attention-window 2", 3, None),
    # the baseline given EA-Lite's CPU time per run (1.16 x: 1200 -> 1400 updates, the same schedule)
    "transformer_lite_1400_updates": ("transformer_lite", "--max-update 1400", 5, "transformer_lite"),
    # EA's two parts apart: the residual convolution alone (alpha 0), the alpha skip alone (beta 0)
    "ea_transformer_lite_alpha0": ("ea_transformer_lite", "--ea-alpha 0", 5, "ea_transformer_lite"),
    "ea_transformer_lite_beta0": ("ea_transformer_lite", "--ea-beta 0", 5, "ea_transformer_lite"),
    # RAN without the attention dropout its architectures set, as every other family trains
    "ran_d_lite_attention_dropout0": ("ran_d_lite", "--attention-dropout 0.0", 3, "ran_d_lite"),
    "ran_all_lite_attention_dropout0": ("ran_all_lite", "--attention-dropout 0.0", 3, "ran_all_lite"),
}
#: the comparisons beside each system's against the baseline, (system, against): EA-Lite against
#: the compute-matched baseline and against each of its ablations, in the same Holm family
#: (quality/plan.md); a results directory's config.json records them
COMPARISONS = (("ea_transformer_lite", "transformer_lite_1400_updates"),
               ("ea_transformer_lite", "ea_transformer_lite_alpha0"),
               ("ea_transformer_lite", "ea_transformer_lite_beta0"))
#: the plan's sensitivity analysis, (system, against, seeds): the primary comparison over the
#: seeds no run of which was seen before the plan (5 against 5), in the same Holm family
SENSITIVITY = (("ea_transformer_lite", "transformer_lite", (6, 7, 8, 9, 10)),)
#: (system, seed): the stored runs trained again at the current commit (``quality.py run --rerun``,
#: quality_reruns.py): the stored runs still describe the code
RERUNS = (("transformer_lite", 1), ("ea_transformer_lite", 1))
#: system -> its first seed whose every checkpoint is kept (in --work-dir), for learning curves
KEEP_CHECKPOINTS = {"transformer_lite": 6, "ea_transformer_lite": 6}
LRS = (0.001, 0.002)
#: system -> rates tried beside LRS, seed 1, on the validation set, where a run tries the plan's
#: LRS (quality/plan.md): reported beside the choice, which they never change; a rate of them
#: that beats the chosen one on validation sacreBLEU is reported as a finding
LRS_BESIDE = {"transformer_lite": (0.0005, 0.003), "ea_transformer_lite": (0.0005, 0.003)}
SRC, TGT = "es", "en"
BUDGET_ENV = {"updates": "DEMO_UPDATES", "max_tokens": "DEMO_MAX_TOKENS", "bpe_merges": "DEMO_BPE_MERGES",
              "avg": "DEMO_AVG", "warmup": "DEMO_WARMUP", "corpus": "DEMO_CORPUS", "dropout": "DEMO_DROPOUT"}
#: the demo's translation of the test set (scripts/demo.sh, gen_args), here of the validation set
GEN_ARGS = ["--source-lang", SRC, "--target-lang", TGT, "--beam", "5", "--remove-bpe", "--max-tokens", "6000",
            "--required-batch-size-multiple", "1", "--max-len-a", "1.5", "--max-len-b", "10", "--num-workers", "0",
            "--cpu"]
