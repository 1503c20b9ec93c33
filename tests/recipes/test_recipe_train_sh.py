"""train.sh's commands, dry (DRY_RUN=1): the papers' settings per family and pair, devices,
precision and batch, the own-data direction, the log interval and --eval-bleu's options."""
import shlex

from support.recipe_support import RECIPES, dry_run, env, run  # noqa: F401  (fixture)


def test_train_sh_defaults_follow_the_papers(env, tmp_path):
    def dry(family, pair, **extra):
        return dry_run(env, tmp_path, family, pair, **extra)[0]

    cmd = dry("ea_lite", "wmt14_en_de", CPU="1")
    assert "--lr 1e-3" in cmd and "--dropout 0.3" in cmd and "--update-freq 128" in cmd
    assert "--ea-alpha 0.1 --ea-beta 0.1" in cmd and "--patience 5" in cmd and "--cpu" in cmd
    assert "--warmup-updates 4000" in cmd and "--label-smoothing 0.1" in cmd
    assert "--share-all-embeddings" in cmd and "--weight-decay 0.0" in cmd and "--fp16" not in cmd
    cmd = dry("ea_base", "wmt14_en_fr", NGPUS="2")
    assert "--update-freq 64" in cmd and "--dropout 0.1" in cmd and "--ea-alpha 0.5" in cmd
    assert "--distributed-world-size 2" in cmd and "--fp16" in cmd and "--cpu" not in cmd
    cmd = dry("pa_lite", "iwslt14_de_en", CPU="1")
    assert "--arch pa_transformer_lite" in cmd and "--lr 5e-4" in cmd and "--dropout 0.2" in cmd
    # IWSLT'14 as fairseq binarizes it: separate dictionaries, decoder embeddings shared
    assert "--share-decoder-input-output-embed" in cmd and "--share-all-embeddings" not in cmd
    cmd = dry("ran_d", "wmt17_tr_en", NGPUS="1")
    assert "--source-lang tr --target-lang en" in cmd and "data-bin/wmt17_en_tr" in cmd
    assert "--attention-dropout 0.2" in cmd and "--max-update 150000" in cmd
    assert "--update-freq 2" in cmd and "--patience" not in cmd
    cmd = dry("ran_all", "wmt14_en_fr", NGPUS="8", LR="5e-4", DROP_ATTENTION="element")
    assert "--max-update 250000" in cmd and "--lr 5e-4" in cmd and "--update-freq 1" in cmd
    assert "--drop-attention element --drop-attention-p 0.2 --drop-attention-window 2" in cmd
    cmd = dry("ea_lite", "iwslt14_de_en", WEIGHT_DECAY="0.0001", SEED="7")
    assert "--weight-decay 0.0001" in cmd and "--seed 7" in cmd
    proc = run(["bash", RECIPES / "train.sh", "pa_lite", "wmt14_en_de"], dict(env, DRY_RUN="1", PYTHON="true"),
               tmp_path, check=False)
    assert proc.returncode != 0 and "IWSLT" in proc.stderr


def test_train_sh_baselines_take_their_papers_settings(env, tmp_path):
    """One command per baseline row: RAN's and PA's Transformers, DropAttention's."""
    cmd, err = dry_run(env, tmp_path, "transformer_ran", "wmt17_tr_en")
    assert "--arch transformer " in cmd and "--dropout 0.1" in cmd and "--attention-dropout 0.0" in cmd
    assert "--max-update 150000" in cmd and "--lr 7e-4" in cmd and "--patience" not in cmd
    assert "--update-freq 1" in cmd and "--distributed-world-size 2" in cmd  # RAN: 2 GPUs for En-Tr
    assert "-s tr -t en --best --ran-wmt" in err  # best checkpoint, beam 4, length penalty 0.6
    cmd, _ = dry_run(env, tmp_path, "transformer_ran", "wmt14_en_de")
    assert "--max-update 250000" in cmd and "--distributed-world-size 8" in cmd
    cmd, _ = dry_run(env, tmp_path, "transformer_lite_pa", "iwslt14_de_en")
    assert "--arch transformer_lite " in cmd and "--lr 5e-4" in cmd and "--dropout 0.2" in cmd
    assert "--pa-alpha" not in cmd
    cmd, err = dry_run(env, tmp_path, "dropattn", "wmt14_en_de")
    assert "data-bin/wmt14_en_de_bpe32k" in cmd and "--arch transformer " in cmd  # DropAttention on the paper's model
    assert "--drop-attention element --drop-attention-p 0.2 --drop-attention-window 2" in cmd
    assert "--max-update 100000" in cmd and "--num-avg 5 --avg-by update --beam 4 --lenpen 0.6" in err
    cmd, _ = dry_run(env, tmp_path, "transformer_dropattn", "wmt14_en_de")
    assert "--arch transformer " in cmd and "--drop-attention" not in cmd and "--dropout 0.1" in cmd
    _, err = dry_run(env, tmp_path, "transformer_base", "wmt17_en_fi", check=False)
    assert "transformer_ran" in err  # the EA paper has no WMT'17 setting; RAN's baseline does
    for family in ("hcsa", "syn_r"):  # RAN's other baselines: its settings, no attention dropout
        cmd, err = dry_run(env, tmp_path, family, "wmt17_tr_en")
        assert f"--arch {family} " in cmd and "--attention-dropout 0.0" in cmd and "--lr 7e-4" in cmd
        assert "--max-update 150000" in cmd and "-s tr -t en --best --ran-wmt" in err
    cmd, _ = dry_run(env, tmp_path, "hcsa_lite", "iwslt14_de_en")
    assert "--arch hcsa_lite " in cmd and "--attention-dropout 0.0" in cmd and "--patience 5" in cmd


def test_train_sh_conv_transformers_and_cross_layer_baselines(env, tmp_path):
    """PA Table 1's Conv-Transformer rows take PA's settings; RealFormer and ResFormer (no
    translation row in the papers) take EA's settings of their size."""
    for family, arch in (("conv_lite_pa", "conv_transformer_lite"), ("pa_conv_lite", "pa_conv_transformer_lite")):
        cmd, _ = dry_run(env, tmp_path, family, "iwslt14_de_en")
        assert f"--arch {arch} " in cmd and "--lr 5e-4" in cmd and "--dropout 0.2" in cmd
        assert ("--pa-alpha 0.1" in cmd) == family.startswith("pa_")
    _, err = dry_run(env, tmp_path, "pa_conv_lite", "wmt14_en_de", check=False)
    assert "IWSLT" in err
    cmd, _ = dry_run(env, tmp_path, "realformer_lite", "iwslt14_de_en")
    assert "--arch realformer_lite " in cmd and "--lr 1e-3" in cmd and "--ea-alpha" not in cmd
    cmd, _ = dry_run(env, tmp_path, "resformer_base", "wmt14_en_de")
    assert "--arch resformer_base " in cmd and "--dropout 0.3" in cmd


def test_train_sh_devices_precision_and_batch(env, tmp_path):
    def dry(family, pair, check=True, **extra):
        return dry_run(env, tmp_path, family, pair, check=check, **extra)

    # the paper's single-GPU IWSLT batch: 1 GPU by default; spread over 8 it stays 4096 tokens
    cmd, err = dry("ea_lite", "iwslt14_de_en")
    assert "--distributed-world-size" not in cmd and "--max-tokens 4096 --update-freq 1" in cmd
    assert "precision: fp16" in err and "= 4096 tokens per update (paper: 1 GPU(s)" in err
    cmd, err = dry("ea_lite", "iwslt14_de_en", NGPUS="8")
    assert "--max-tokens 512 --update-freq 1" in cmd and "--distributed-world-size 8" in cmd
    assert "effective batch: 512 tokens x 8 device(s) x update-freq 1 = 4096 tokens per update" in err
    cmd, err = dry("ea_lite", "wmt14_en_de", NGPUS="4")
    assert "--update-freq 32" in cmd and "= 524288 tokens per update" in err
    cmd, err = dry("ea_lite", "iwslt14_de_en", UPDATE_FREQ="2")
    assert "note: the effective batch is not the paper's" in err
    assert "--bf16" in dry("ea_lite", "iwslt14_de_en", BF16="1")[0]
    cmd = dry("ea_lite", "iwslt14_de_en", FP16="0")[0]
    assert "--fp16" not in cmd and "--bf16" not in cmd
    _, err = dry("ea_lite", "iwslt14_de_en", check=False, CPU="1", FP16="1")
    assert "FP16=1 needs CUDA" in err
    _, err = dry("ea_lite", "iwslt14_de_en", check=False, CPU="1", NGPUS="1", SEED="x")
    assert "SEED must be an integer" in err
    for bad in (["--cpu"], ["--fp16"], ["--save-dir", "x"], ["--seed", "3"]):
        proc = run(["bash", RECIPES / "train.sh", "ea_lite", "iwslt14_de_en", *bad],
                   dict(env, DRY_RUN="1", PYTHON="true"), tmp_path, check=False)
        assert proc.returncode != 0 and "train.sh: error:" in proc.stderr, bad


def test_train_sh_refuses_cpu_without_cpu_1(env, tmp_path):
    """No CUDA device and no CPU=1: a clear refusal, before anything is written or trained."""
    proc = run(["bash", RECIPES / "train.sh", "ea_lite", "iwslt14_de_en"],
               dict(env, SAVE_DIR=str(tmp_path / "ck")), tmp_path, check=False)
    assert proc.returncode != 0
    assert "no CUDA device visible" in proc.stderr and "CPU=1" in proc.stderr, proc.stderr
    assert not (tmp_path / "ck").exists()


def test_train_sh_own_data_direction_and_settings(env, tmp_path):
    """PAIR own: the direction from DATA's file names (or SRC/TGT), the family's IWSLT'14
    settings, and a clear stop where DATA is missing or ambiguous."""
    data = tmp_path / "own"
    data.mkdir()
    for name in ("train.xx-yy.xx.idx", "train.xx-yy.yy.idx", "dict.xx.txt", "dict.yy.txt"):
        (data / name).write_text("a 1\n")
    cmd, err = dry_run(env, tmp_path, "pa_lite", "own", DATA=str(data))
    assert f"{data} --user-dir" in cmd and "--source-lang xx --target-lang yy" in cmd
    assert "--arch pa_transformer_lite" in cmd and "--lr 5e-4" in cmd and "--pa-alpha 0.1" in cmd
    assert "--share-all-embeddings" in cmd  # the dictionaries are equal: one joined dictionary
    assert f"evaluate.sh checkpoints/pa_lite.own {data} wmt" in err
    cmd, _ = dry_run(env, tmp_path, "ran_d", "own", DATA=str(data))
    assert "--lr 1e-3 --lr-scheduler" in cmd and "--attention-dropout 0.2" in cmd and "--patience 5" in cmd
    (data / "train.yy-xx.yy.idx").write_text("")
    _, err = dry_run(env, tmp_path, "ea_lite", "own", check=False, DATA=str(data))
    assert "holds several directions (xx yy yy xx): give SRC=.. TGT=.." in err
    cmd, _ = dry_run(env, tmp_path, "ea_lite", "own", DATA=str(data), SRC="yy", TGT="xx")
    assert "--source-lang yy --target-lang xx" in cmd


def test_train_sh_log_interval(env, tmp_path):
    assert "--log-interval 100" in dry_run(env, tmp_path, "ea_lite", "iwslt14_de_en")[0]
    assert "--log-interval 5" in dry_run(env, tmp_path, "ea_lite", "iwslt14_de_en", CPU="1")[0]
    assert "--log-interval 20" in dry_run(env, tmp_path, "ea_lite", "iwslt14_de_en", CPU="1", LOG_INTERVAL="20")[0]
    _, err = dry_run(env, tmp_path, "ea_lite", "iwslt14_de_en", check=False, LOG_INTERVAL="often")
    assert "LOG_INTERVAL must be a positive number of updates" in err
    tokens = shlex.split(dry_run(env, tmp_path, "ea_lite", "iwslt14_de_en", EVAL_BLEU="1")[0])
    at = tokens.index("--eval-bleu")
    assert tokens[at:at + 9] == ["--eval-bleu", "--eval-bleu-args", '{"beam": 5, "max_len_a": 1.2, "max_len_b": 10}',
                                 "--eval-bleu-detok", "moses", "--eval-bleu-remove-bpe",
                                 "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric"]
    assert "--eval-bleu" not in dry_run(env, tmp_path, "ea_lite", "iwslt14_de_en")[0]
