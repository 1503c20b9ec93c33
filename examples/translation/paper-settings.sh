# shellcheck shell=bash disable=SC2034  # (the variables set here are train.sh's)
# train.sh's table of the papers' settings: each PAIR's data set and direction, and each
# FAMILY's architecture and its paper's hyper-parameters for the pair (learning rate, dropout,
# attention dropout, EA's and PA's alpha/beta, GPUs x accumulation, tokens per GPU, patience,
# update budget, the checkpoints kept, and the evaluate.sh options its paper scores with).
# Where each value comes from: train.sh's header and README.md, "Defaults, and where they
# come from". Sourced by train.sh, not run: its functions read and set train.sh's variables
# (family, pair, DATA, SRC, TGT, LR, DROPOUT) and stop through its die.

# pair_data_set: the data set of $pair: data_dir, src, tgt, size (iwslt, wmt14, wmt17, own), mode
# (evaluate.sh's), other (a WMT'17 pair's language beside English)
pair_data_set() {
  case "$pair" in
    iwslt14_de_en) data_dir=iwslt14.tokenized.de-en; src=de; tgt=en; size=iwslt; mode=iwslt ;;
    wmt14_en_de)   data_dir=wmt14_en_de; src=en; tgt=de; size=wmt14; mode=wmt14-en-de ;;
    wmt14_en_fr)   data_dir=wmt14_en_fr; src=en; tgt=fr; size=wmt14; mode=wmt ;;
    wmt17_en_lv|wmt17_lv_en|wmt17_en_fi|wmt17_fi_en|wmt17_en_tr|wmt17_tr_en)
      src="${pair:6:2}"; tgt="${pair:9:2}"
      other="$src"; [ "$src" = en ] && other="$tgt"
      data_dir="wmt17_en_$other"; size=wmt17; mode=wmt ;;
    own)
      [ -n "${DATA:-}" ] || die "PAIR own trains on the data set in DATA: DATA=data-bin/NAME bash $0 $family own
  (examples/translation/prepare-own.sh makes one from your own parallel text)"
      [ -d "$DATA" ] || die "DATA=$DATA is not a directory (prepare it with examples/translation/prepare-own.sh)"
      src="${SRC:-}"; tgt="${TGT:-}"
      if [ -z "$src" ] || [ -z "$tgt" ]; then
        ea_direction "$DATA" train "SRC=.. TGT=.."
        src="$ea_src" tgt="$ea_tgt"
      fi
      for l in "$src" "$tgt"; do
        ea_is_name "$l" || die "SRC and TGT take a language code ([A-Za-z0-9_@-]+), not $(ea_shown "$l")"
      done
      data_dir=""; size=own; mode=wmt ;;
    *) die "unknown PAIR '$pair' (see --help)" ;;
  esac
}

# family_settings: $family's architecture (arch), its paper (kind) and that paper's settings for
# $pair: lr, dropout, attn_dropout, alpha, beta, pa_alpha, paper_gpus, paper_accum, max_tokens,
# patience, max_update, keep_updates, drop_default, eval_opts (and data_dir, for DropAttention)
family_settings() {
  alpha=""; beta=""; pa_alpha=""; attn_dropout=0.0; patience=5; max_update=""; keep_updates=""
  drop_default=""
  eval_opts=()  # how the paper evaluates (examples/translation/evaluate.sh options)
  case "$family" in
    transformer_lite) arch=transformer_lite; kind=ea_lite ;;
    ea_lite)          arch=ea_transformer_lite; kind=ea_lite; alpha=0.1; beta=0.1 ;;
    transformer_base) arch=transformer; kind=ea_base ;;
    ea_base)          arch=ea_transformer_base; kind=ea_base; alpha=0.5; beta=0.1 ;;
    transformer_lite_pa) arch=transformer_lite; kind=pa_lite ;;
    pa_lite)          arch=pa_transformer_lite; kind=pa_lite; pa_alpha=0.1 ;;
    conv_lite_pa)     arch=conv_transformer_lite; kind=pa_lite ;;
    pa_conv_lite)     arch=pa_conv_transformer_lite; kind=pa_lite; pa_alpha=0.1 ;;
    realformer_lite|resformer_lite) arch="$family"; kind=ea_lite ;;
    realformer_base|resformer_base) arch="$family"; kind=ea_base ;;
    transformer_ran)  arch=transformer; kind=ran ;;
    ran_e|ran_d|ran_all) arch="$family"; kind=ran ;;
    ran_e_lite|ran_d_lite|ran_all_lite) arch="$family"; kind=ran_lite ;;
    hcsa|syn_r)       arch="$family"; kind=ran ;;
    hcsa_lite|syn_r_lite) arch="$family"; kind=ran_lite ;;
    transformer_dropattn) arch=transformer; kind=vaswani ;;
    dropattn)         arch=transformer; kind=vaswani; drop_default=element ;;
    *) die "unknown FAMILY '$family' (see --help)" ;;
  esac

  max_tokens=4096
  case "$kind" in
    ea_lite|ea_base) ea_table ;;
    pa_lite)
      [ "$pair" = iwslt14_de_en ] || [ "$pair" = own ] \
        || die "the PA paper trains translation on IWSLT'14 De-En only (PAIR own: your data, its settings)"
      lr=5e-4; dropout=0.2; paper_gpus=1; paper_accum=1 ;;
    ran|ran_lite)
      [ "$family" != transformer_ran ] || [ "$size" != iwslt ] \
        || die "the RAN paper has no IWSLT'14 setting; its Transformer baseline runs on WMT pairs"
      case "$family" in ran_*) attn_dropout=0.2 ;; esac  # "As for RANs"; TransF, HC-SA, Syn-R: 0
      if [ "$size" = iwslt ] || [ "$size" = own ]; then
        ea_table  # RAN has no IWSLT setting: the EA table's values, RAN's attention dropout
      else
        if [ "$kind" = ran ]; then
          lr=7e-4; dropout=0.1; paper_gpus=8; paper_accum=1
          case "$pair" in wmt17_en_tr|wmt17_tr_en) paper_gpus=2 ;; esac
          eval_opts=(--best --ran-wmt)
        else
          ea_table  # RAN-Lite: the Lite values of the EA table
        fi
        case "$pair" in wmt14_en_fr) attn_dropout=0.0 ;; esac  # "0.2 ... except on En-Fr"
        if [ "$size" = wmt14 ]; then max_update=250000; else max_update=150000; fi
        patience=-1  # RAN trains for a fixed number of steps and picks the best checkpoint
        keep_updates=10
      fi ;;
    vaswani)
      [ "$pair" = wmt14_en_de ] || [ "$pair" = own ] \
        || die "the DropAttention paper trains translation on WMT En-De only (PAIR own: your data, its settings)"
      [ "$pair" = own ] || data_dir=wmt14_en_de_bpe32k
      lr=7e-4; dropout=0.1; paper_gpus=8; paper_accum=1; max_update=100000; patience=-1
      keep_updates=10; eval_opts=(--num-avg 5 --avg-by update --beam 4 --lenpen 0.6) ;;
  esac
}

# EA Table 10 (also used for the Transformer baselines, and for RAN outside its WMT tasks)
ea_table() {
  case "$pair" in
    iwslt14_de_en|own) lr=1e-3; dropout=0.2; paper_gpus=1; paper_accum=1 ;;
    wmt14_en_de)   lr=1e-3; dropout=0.3; paper_gpus=8; paper_accum=16 ;;
    wmt14_en_fr)   lr=1e-3; dropout=0.1; paper_gpus=8; paper_accum=16 ;;
    *) if [ "$family" = transformer_base ] || [ "$family" = transformer_lite ]; then
         die "the EA paper has no $pair setting; RAN's Transformer baseline on WMT'17 is FAMILY transformer_ran"
       fi
       [ -n "${LR:-}" ] && [ -n "${DROPOUT:-}" ] \
         || die "no paper gives a $family setting for $pair: set LR, DROPOUT (and UPDATE_FREQ)"
       lr="$LR"; dropout="$DROPOUT"; paper_gpus=1; paper_accum=1 ;;
  esac
}
