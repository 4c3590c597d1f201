r"""longctx base config with presets.

Run (the CPU demo, 8 virtual devices, mesh dp=1 x fsdp=2 x sp=4):
  .venv/bin/python scripts/train.py --config=configs/base.py:tiny --workdir=runs/demo

Override anything from the command line:
  .venv/bin/python scripts/train.py --config=configs/base.py:tiny --workdir=runs/x \
      --config.model.num_layers=4 --config.attention.sliding_window=256

Ahead-of-time fit check of a Llama-3-8B-shaped model at 128K tokens on a v5p slice:
  .venv/bin/python scripts/estimate.py --config=configs/base.py:llama3_8b_128k --topology=v5p:4x4x4

Presets:
  tiny             the CPU demo: 2 layers, d=128, 1K-token sequences, 8 virtual devices.
  tiny_hybrid      tiny as a hybrid: 5 sliding-window layers to 1 global (Gemma 3's pattern), 6 layers.
  long_cpu         a few steps of a tiny model on one 65,536-token sequence over 8 CPU devices.
  long_mix_cpu     long_cpu's model on a ProLong-shaped mixture at 16,384 tokens (docs/data.md,
                   "Mixtures"): 60% whole stdlib packages, 40% single files, long files upsampled:
    .venv/bin/python scripts/train.py --config=configs/base.py:long_mix_cpu --workdir=runs/long_mix
  v5e_0p5b         a 0.5B model at 32,768 tokens on one TPU v5e chip (one host, mesh 1 x 1 x 1):
    .venv/bin/python scripts/estimate.py --config=configs/base.py:v5e_0p5b --topology=v5e:1x1
    .venv/bin/python scripts/train.py --config=configs/base.py:v5e_0p5b --workdir=runs/v5e_0p5b
  llama3_8b_128k   Llama-3-8B shape, 131,072 tokens per sequence, ring over sp=16 on v5p-128.
  llama3_8b_extend_128k   Llama-3-8B converted from Hugging Face, extended to 131,072 tokens with
                   llama3 RoPE scaling (docs/extend.md):
    .venv/bin/python scripts/convert_hf.py to-longctx --hf=Meta-Llama-3-8B --out=runs/llama3_8b_hf
    .venv/bin/python scripts/prepare_data.py --input long_docs.jsonl --tokenizer hf:Meta-Llama-3-8B \
        --output data/llama3_long
    .venv/bin/python scripts/train.py --config=configs/base.py:llama3_8b_extend_128k --workdir=runs/llama3_8b_extend
  llama3_8b_prolong_64k   ProLong's first stage: Llama-3-8B at 65,536 tokens on a mixture of four
                   prepared sources by ProLong's weights (docs/data.md, "A ProLong-style run"):
    .venv/bin/python scripts/estimate.py --config=configs/base.py:llama3_8b_prolong_64k --topology=v5p:4x4x4
"""

import ml_collections
from ml_collections import config_dict



# Placeholders keep the key (and its type) in the schema while its value is "unset", so
# `--config.attention.sliding_window=512` type-checks and `validate` sees every key. Each call makes
# a new reference: a shared one would tie every optional field to the same value.
def _optional_int():
    return config_dict.placeholder(int)


def _optional_float():
    return config_dict.placeholder(float)


# A key that takes an int or "auto" (the planner's choice when the run starts): typed `object`, so
# that `--config.attention.block_size=auto` and `=1024` both parse (as a Python literal, else a
# string) where an int field would refuse "auto"; config.validate checks what it holds.
def _int_or_auto(default: int):
    return config_dict.FieldReference(default, field_type=object)


def _base() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    # Mesh: (dp, fsdp, sp) sizes within a slice; at most one may be -1 (= the rest).
    # dcn_* are the sizes across slices (multi-slice over the data-centre network); 1 = one slice.
    c.mesh = ml_collections.ConfigDict(dict(dp=1, fsdp=-1, sp=1, dcn_dp=1, dcn_fsdp=1, dcn_sp=1))
    # Multi-process initialisation. Left empty, jax.distributed auto-detects on TPU pods and
    # single-process runs skip it; loopback runs set these (launch/local.py does).
    c.distributed = ml_collections.ConfigDict(
        dict(coordinator_address="", num_processes=0, process_id=-1, local_device_count=0)
    )

    c.model = ml_collections.ConfigDict(
        dict(
            vocab_size=512,
            d_model=256,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            mlp_dim=512,
            rope_theta=500_000.0,
            # RoPE context extension (longctx/model/rope.py); Hugging Face's names in parentheses.
            rope_scaling=ml_collections.ConfigDict(dict(
                type="none",  # none | linear | llama3 | yarn  (rope_type; "default" is none)
                factor=1.0,  # linear, llama3, yarn: how many times the trained context is stretched
                original_max_position=8192,  # llama3, yarn: the context the model was trained at
                # (original_max_position_embeddings)
                low_freq_factor=1.0,  # llama3: wavelengths above original/low are divided by factor
                high_freq_factor=4.0,  # llama3: wavelengths below original/high are kept
                beta_fast=32.0,  # yarn: rotations over the original context where the ramp starts
                beta_slow=1.0,  # yarn: ... and where it ends
                mscale=_optional_float(),  # yarn (DeepSeek): with mscale_all_dim, sets the attention factor
                mscale_all_dim=_optional_float(),
                attention_factor=_optional_float(),  # yarn: cos/sin scale; unset = 0.1*ln(factor)+1
                truncate=True,  # yarn: round the ramp's ends to whole dimensions
            )),
            norm_eps=1e-5,
            tie_embeddings=False,
            final_logits_soft_cap=_optional_float(),
            # The model families' block choices (longctx/model/block_options.py), Llama's by default:
            qk_norm="none",  # none | per_head (Qwen3, Gemma 3) | whole: over the whole projection (OLMo 2/3)
            qkv_bias=False,  # bias on the q/k/v projections (Qwen2 / 2.5)
            norm_position="pre",  # pre (Llama) | post: x + norm(f(x)) (OLMo 2/3) | sandwich: both (Gemma 2/3)
            norm_plus_one=False,  # RMSNorm scales by (1 + w) (Gemma)
            mlp_activation="silu",  # silu: SwiGLU (Llama) | gelu_tanh: GeGLU (Gemma)
            scale_embeddings=False,  # embeddings times sqrt(d_model) (Gemma)
            query_pre_attn_scalar=_optional_float(),  # logits scaled by it ** -0.5, not head_dim's (Gemma 2/3)
            dtype="bfloat16",  # compute dtype
            param_dtype="float32",
            scan_layers=True,
            # Tokens of each sequence shard per MLP chunk (model._mlp_in_chunks); None = all at
            # once. Long shards need it: the [tokens, mlp_dim] intermediates outgrow the rest.
            mlp_chunk_size=_optional_int(),
            # none | nothing_saveable | dots_saveable | dots_with_no_batch_dims_saveable | MaxText's
            # named ones: save_qkv_proj | save_out_proj | save_dot_except_mlp | save_dot_except_mlpwi |
            # minimal (longctx/model/remat.py says what each keeps)
            remat_policy="nothing_saveable",
        )
    )

    c.attention = ml_collections.ConfigDict(
        dict(
            impl="splash",  # splash (Pallas TPU kernel; interpret mode off TPU) | xla
            layout="auto",  # contiguous | zigzag | striped | auto (best schedule for the mask)
            causal=True,
            sliding_window=_optional_int(),  # causal window: token i sees [i - w, i]
            chunk_size=_optional_int(),  # chunked causal
            attention_sinks=False,  # one learned sink logit per head
            logits_soft_cap=_optional_float(),
            use_segment_ids=True,  # document masking: attend only within a packed document
            # q/kv block of the ring's tables and kernels; off TPU, 256 or 128 is faster on short
            # packed documents (skipping is per block: docs/attention.md, bench_ring_blocks.py);
            # auto: the planner's choice among 512, 1024 and 2048 when the run starts on TPU
            block_size=_int_or_auto(512),
            # What the ring's backward keeps per layer (longctx/model/attention.py): save_qkv |
            # recompute_qkv (q/k/v recomputed from the layer input) | offload_qkv (to host memory)
            residuals="save_qkv",
            # How attention is split over the sp axis (docs/attention.md): ring | all_gather |
            # ulysses (query heads divisible by sp) | usp (Ulysses inside groups of cp_ulysses
            # neighbouring devices, the ring across them) | halo (each device receives from each
            # shard only the blocks its mask reaches: a window's halo, not whole shards) | auto
            # (the planner chooses, with the mesh's -1 axes, when the run starts on TPU:
            # docs/planner.md)
            cp="ring",
            cp_ulysses=_optional_int(),  # usp's Ulysses degree: divides mesh sp and model.num_heads
            # Hybrid attention (longctx/model/layer_types.py): the layer types of one period, in
            # order ("local,local,local,local,local,global"), repeated over model.num_layers; each
            # type, defined in layer_types, sets any of its mask, strategy and RoPE keys, and the
            # rest come from attention.* / model.*. "" = one type, attention.* itself, every layer.
            pattern="",
            layer_types=ml_collections.ConfigDict(),
        )
    )

    c.data = ml_collections.ConfigDict(
        dict(
            path="",  # directory written by scripts/prepare_data.py; "" = embedded stdlib corpus
            # A mixture instead of path: {name: {path, weight, min_length, max_length,
            # upsample_factor, upsample_above}} (docs/data.md, "Mixtures"; preset long_mix_cpu).
            sources=ml_collections.ConfigDict(),
            cache_dir="",  # where the embedded corpus is prepared; "" = ~/.cache/longctx
            seq_len=2048,
            global_batch_size=8,
            packer="best_fit",  # first_fit | best_fit | concat_then_split | shard_balanced
            shuffle_seed=0,
            num_workers=0,
            prefetch_buffer_size=2,
        )
    )

    c.optimizer = ml_collections.ConfigDict(
        dict(
            learning_rate=3e-4,
            min_learning_rate_ratio=0.1,
            warmup_steps=100,
            weight_decay=0.1,
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            grad_clip_norm=1.0,
            # ZeRO-1: also split the AdamW state over dp (parameters are always split over fsdp x sp).
            shard_state_over_dp=False,
        )
    )

    c.train = ml_collections.ConfigDict(
        dict(
            num_steps=1000,
            log_every=10,
            eval_every=200,
            eval_steps=4,
            # Passkey retrieval (longctx/evals/needle.py) on validation haystacks every N steps; 0 = never.
            eval_needle_every=0,
            # RULER's synthetic tasks (longctx/evals/ruler.py) by task and length every N steps; 0 = never.
            eval_ruler_every=0,
            loss_chunk_size=512,  # tokens per chunk of the output projection + cross-entropy
            # Micro-batches each step's data.global_batch_size rows are split into: their gradients
            # are summed (float32) into one update, so a batch larger than a step can hold trains
            # as the whole batch would (each micro-batch a multiple of dp x fsdp rows).
            grad_accum_steps=1,
            on_nonfinite="stop",  # stop | skip
            # With skip: stop (as stop does) once this many steps in a row were non-finite. A bad
            # batch or two is data; ten in a row from unchanged parameters is a run that skipping
            # will not rescue. Checked at log, eval and save steps, so it stops at the first of them.
            max_consecutive_skips=10,
            profile_start=_optional_int(),
            profile_steps=3,
            peak_tflops_override=_optional_float(),  # for MFU on chips not in longctx's table
        )
    )

    c.checkpoint = ml_collections.ConfigDict(
        dict(
            every_steps=500,
            max_to_keep=3,
            keep_period=_optional_int(),  # also keep every keep_period-th step permanently
            init_from="",  # checkpoint directory to take parameters from on a fresh start
            # init_from's model must compute the same function (RoPE, norm_eps, mask: the keys in
            # longctx/train/checkpoint_compat.py INIT_FROM_KEYS); "key,key" accepts these differences.
            init_from_allow="",
            async_save=True,
        )
    )
    return c


def _tiny(c):
    c.mesh.update(dp=1, fsdp=2, sp=4)
    # CPU attention is bound by elementwise work on [batch, heads, L, S] scores, so the demo keeps
    # batch x seq^2 small; no remat (memory is plentiful at this size, recomputation is not free).
    c.model.update(vocab_size=512, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=32, mlp_dim=384, dtype="float32", remat_policy="none")
    c.attention.update(impl="xla", block_size=128)
    c.data.update(seq_len=1024, global_batch_size=2)
    c.optimizer.update(learning_rate=3e-3, warmup_steps=10)
    c.train.update(num_steps=200, log_every=10, eval_every=100, eval_steps=4, loss_chunk_size=256)
    c.checkpoint.update(every_steps=100)
    return c


def _tiny_hybrid(c):
    """The CPU demo as a hybrid model (attention.pattern, docs/attention.md): Gemma 3's shape of
    pattern, five sliding-window layers (window 128, RoPE theta 10,000, passing only their halo
    between devices: cp=halo) to one global layer (theta 1,000,000, the ring), over 6 layers."""
    c = _tiny(c)
    c.model.update(num_layers=6)
    c.attention.pattern = "local,local,local,local,local,global"
    c.attention.layer_types = ml_collections.ConfigDict({
        "local": dict(sliding_window=128, rope_theta=10_000.0, cp="halo"),
        "global": dict(rope_theta=1_000_000.0),
    })
    return c


def _long_cpu(c):
    c = _tiny(c)
    c.mesh.update(dp=1, fsdp=1, sp=8)
    # The corpus packs short documents, and skipping is per block: 128 took 0.80-0.86x the step
    # time of 512 here (docs/long_context.md, "The longest run here").
    c.attention.update(impl="xla", block_size=128)
    c.data.update(seq_len=65_536, global_batch_size=1)
    c.train.update(num_steps=4, log_every=1, eval_every=0, eval_steps=1, loss_chunk_size=1024)
    # The whole run warms up (tiny's 10 steps were cut to these 4 anyway: the same rates, and no
    # start-up note that the preset's warmup is longer than its run).
    c.optimizer.update(warmup_steps=c.train.num_steps)
    c.checkpoint.update(every_steps=0)
    return c


def _long_mix_cpu(c):
    """ProLong's shape of mixture (Gao et al. 2024: 60% long data, whole code repositories and
    books; 40% short, high-quality data, which they find necessary) from the embedded corpus:
    every top-level standard-library package as one document (long: median ~100K tokens) beside
    the per-file documents (short), and within the short source Fu et al.'s upsampling of its long
    documents (files of 8,192+ tokens read twice per epoch). Each source is evaluated apart."""
    c = _long_cpu(c)
    c.data.update(seq_len=16_384, global_batch_size=1)
    c.train.update(num_steps=4, eval_every=4, eval_steps=1)
    c.data.sources = ml_collections.ConfigDict({
        "packages": dict(path="embedded:packages", weight=0.6),
        "files": dict(path="embedded:files", weight=0.4, upsample_factor=2.0, upsample_above=8192),
    })
    return c


def _v5e_0p5b(c):
    """A 511.7M-parameter Llama-shaped model (8 layers, d_model 2,048, 16 heads of 128 over 8 K/V
    heads, MLP 5,632, vocabulary 32,768) at 32,768 tokens on one TPU v5e chip (15.75 GiB of HBM):
    one host, one process, mesh 1 x 1 x 1, bf16 compute over float32 parameters, the splash kernel
    with blocks of 2,048 (on the chip a causal row's step takes 1.57 s at 2,048 and 1.67 s at
    1,024, and the corpus's packed rows are faster at 2,048 too: docs/tpu.md), on the embedded
    corpus's packed documents. Parameters, AdamW state and gradients take 7.6 GiB; each layer
    keeps its input, q, k, v and the attention's output for the backward (nothing_saveable: 62%
    MFU on a causal row; keeping the projections' outputs took 1.82 s a step at blocks of 1,024
    against 1.69)."""
    c.mesh.update(dp=1, fsdp=1, sp=1)
    c.model.update(vocab_size=32_768, d_model=2048, num_layers=8, num_heads=16, num_kv_heads=8,
                   head_dim=128, mlp_dim=5632, dtype="bfloat16", param_dtype="float32",
                   remat_policy="nothing_saveable")
    c.attention.update(impl="splash", block_size=2048, layout="contiguous")
    c.data.update(seq_len=32_768, global_batch_size=1)
    c.optimizer.update(learning_rate=3e-4, warmup_steps=20)
    c.train.update(num_steps=200, log_every=10, eval_every=100, eval_steps=2, loss_chunk_size=1024)
    c.checkpoint.update(every_steps=100)
    return c


def _llama3_8b_128k(c):
    c.mesh.update(dp=1, fsdp=-1, sp=16)
    c.model.update(vocab_size=128_256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                   head_dim=128, mlp_dim=14_336, dtype="bfloat16")
    c.model.update(mlp_chunk_size=8192)
    c.attention.update(impl="splash", block_size=512)
    c.data.update(seq_len=131_072, global_batch_size=4)
    c.optimizer.update(learning_rate=3e-4, warmup_steps=2000)
    c.train.update(num_steps=100_000, log_every=10, eval_every=1000, loss_chunk_size=1024)
    c.checkpoint.update(every_steps=1000, keep_period=10_000)
    return c


def _llama3_70b_128k(c):
    """Llama-3-70B's shape at 131,072 tokens on 512 chips (v5p:8x8x8): sp=16 rings, fsdp=32.
    Parameters and AdamW state split over fsdp x sp (512 ways: 70.6B x 12 bytes / 512 = 1.6 GiB
    per chip); q/k/v recomputed in the backward, which at d_model 8192 keeps 80 layers x
    (64 + 2 x 8) heads x 128 x 2 bytes = 1.6 MiB per token less alive."""
    c = _llama3_8b_128k(c)
    c.model.update(vocab_size=128_256, d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                   head_dim=128, mlp_dim=28_672, dtype="bfloat16")
    c.mesh.update(dp=1, fsdp=-1, sp=16)
    c.attention.update(residuals="recompute_qkv")
    c.data.update(seq_len=131_072, global_batch_size=32)
    c.optimizer.update(learning_rate=1.5e-4, warmup_steps=2000)
    return c


def _llama3_8b_extend_128k(c):
    """Continued pretraining of Llama-3-8B (trained at 8,192 tokens) on 131,072-token documents:
    the converted weights (scripts/convert_hf.py to-longctx) via init_from, Llama 3.1's llama3
    RoPE scaling (factor 8 over the original 8,192), a lower peak learning rate than pretraining
    with a short warmup, as in published context-extension recipes (Llama 3.1; Fu et al. 2024,
    2e-5 over ~1B tokens). 2,000 steps of 4 x 131,072 tokens = 1.05B tokens."""
    c = _llama3_8b_128k(c)
    c.model.rope_scaling.update(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position=8192)
    c.data.update(path="data/llama3_long", seq_len=131_072, global_batch_size=4, packer="best_fit")
    c.optimizer.update(learning_rate=2e-5, min_learning_rate_ratio=0.1, warmup_steps=50, weight_decay=0.1)
    c.train.update(num_steps=2000, log_every=10, eval_every=200, eval_needle_every=500)
    c.checkpoint.update(every_steps=200, keep_period=1000, init_from="runs/llama3_8b_hf")
    return c


def _llama3_8b_prolong_64k(c):
    """ProLong's first stage (Gao et al. 2024) on Llama-3-8B converted from Hugging Face (init_from):
    65,536 tokens, RoPE theta raised from 500,000 to 8,000,000, learning rate 1e-5, and their mix of
    sources by tokens: 30% code repositories and 30% books (whole repositories and books, long),
    3% textbooks, 37% short high-quality data, each prepared by the user (docs/data.md, "A
    ProLong-style run", has the commands). One sequence per fsdp rank on v5p:4x4x4 (sp=8, fsdp=8:
    8 x 65,536 = 524,288 tokens a step, 8,192 per chip as llama3_8b_128k; ProLong's batch is 4M
    tokens: raise data.global_batch_size with more chips). 5,000 steps = 2.6B tokens."""
    c = _llama3_8b_128k(c)
    c.mesh.update(dp=1, fsdp=-1, sp=8)
    c.model.update(rope_theta=8_000_000.0)
    c.data.update(seq_len=65_536, global_batch_size=8, packer="best_fit")
    c.data.sources = ml_collections.ConfigDict({
        "code_repos": dict(path="data/prolong/code_repos", weight=0.30),
        "books": dict(path="data/prolong/books", weight=0.30),
        "textbooks": dict(path="data/prolong/textbooks", weight=0.03),
        "short": dict(path="data/prolong/short", weight=0.37),
    })
    c.optimizer.update(learning_rate=1e-5, min_learning_rate_ratio=0.1, warmup_steps=500, weight_decay=0.1)
    c.train.update(num_steps=5000, log_every=10, eval_every=500, eval_steps=4)
    c.checkpoint.update(every_steps=500, keep_period=2500, init_from="runs/llama3_8b_hf",
                        init_from_allow="model.rope_theta")
    return c


def _hybrid_at_scale(c, *, layers, d_model, heads, kv_heads, head_dim, mlp_dim, vocab, seq_len,
                     pattern, types, theta):
    """A hybrid model's shape for the fit check and the planner (no weights needed), on v5p-128
    (sp=16, fsdp=-1) as llama3_8b_128k: the families' own blocks (Gemma's GeGLU and norms, gpt-oss's
    experts, Llama 4's experts) are Llama blocks of the same widths here, the experts a dense MLP of
    the active experts' width."""
    c = _llama3_8b_128k(c)
    c.model.update(vocab_size=vocab, d_model=d_model, num_layers=layers, num_heads=heads,
                   num_kv_heads=kv_heads, head_dim=head_dim, mlp_dim=mlp_dim, rope_theta=theta)
    c.data.update(seq_len=seq_len, global_batch_size=4)
    c.attention.pattern = pattern
    c.attention.layer_types = ml_collections.ConfigDict(types)
    return c


def _gemma3_12b_128k(c):
    """Gemma-3-12B (text) at 131,072 tokens, its released context: 48 layers, five sliding-window
    layers (1,024 keys counting the query's own, window 1,023 here; RoPE theta 10,000; the halo) to
    one global (theta 1,000,000, linear scaling x8; the ring), in Gemma's block: QK-norm per head,
    sandwich norms with (1 + w) gains, GeGLU, embeddings scaled by sqrt(d_model), queries by
    256 ** -0.5, tied embeddings. A model converted from its config.json (scripts/convert_hf.py
    to-longctx) is this model, with the layer types named here local and global
    (tests/test_presets.py)."""
    c = _hybrid_at_scale(
        c, layers=48, d_model=3840, heads=16, kv_heads=8, head_dim=256, mlp_dim=15_360,
        vocab=262_208, seq_len=131_072, theta=1_000_000.0,
        pattern="local,local,local,local,local,global",
        types={"local": dict(sliding_window=1023, rope_theta=10_000.0, rope_scaling=dict(type="none"),
                             cp="halo"),
               "global": {}})
    c.model.update(qk_norm="per_head", norm_position="sandwich", norm_plus_one=True,
                   mlp_activation="gelu_tanh", scale_embeddings=True, query_pre_attn_scalar=256.0,
                   norm_eps=1e-6, tie_embeddings=True)
    c.model.rope_scaling.update(type="linear", factor=8.0)
    return c


def _gpt_oss_20b_128k(c):
    """gpt-oss-20b's attention at 131,072 tokens, its experts as a dense MLP of the 4 active ones'
    width: 24 layers alternating a 128-token window (the halo) and full attention, learned sinks
    on both."""
    c = _hybrid_at_scale(
        c, layers=24, d_model=2880, heads=64, kv_heads=8, head_dim=64, mlp_dim=4 * 2880,
        vocab=201_088, seq_len=131_072, theta=150_000.0, pattern="local,global",
        types={"local": dict(sliding_window=128, cp="halo"), "global": {}})
    c.attention.attention_sinks = True
    return c


def _llama4_scout_256k(c):
    """Llama-4-Scout's attention at 262,144 tokens, its experts as a dense MLP of the shared and
    the one routed expert's width: 48 layers, three chunked layers (chunks of 8,192, RoPE, the
    halo) to one full layer without RoPE, whose queries are scaled by position (temperature
    tuning: floor 8,192, scale 0.1). Chunks start at each document's start, so a chunked layer
    needs at most the last 8,191 tokens of the shard before its own (half of a 16,384-token
    shard); without document masking, chunks inside shards would need nothing."""
    return _hybrid_at_scale(
        c, layers=48, d_model=5120, heads=40, kv_heads=8, head_dim=128, mlp_dim=2 * 8192,
        vocab=202_048, seq_len=262_144, theta=500_000.0, pattern="chunked,chunked,chunked,global",
        types={"chunked": dict(chunk_size=8192, cp="halo"),
               "global": dict(rope=False, temperature_floor=8192, temperature_scale=0.1)})


def _qwen3_8b_128k(c):
    """Qwen3-8B (36 layers, GQA 32/8, head_dim 128, QK-norm per head, RoPE theta 1,000,000, untied
    embeddings) at 131,072 tokens, on v5p-128 as llama3_8b_128k: YaRN x4 over its native 32,768
    tokens, the extension its model card gives. A model converted from its config.json with that
    rope_scaling (scripts/convert_hf.py to-longctx) is this model (tests/test_presets.py)."""
    c = _llama3_8b_128k(c)
    c.model.update(vocab_size=151_936, d_model=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                   mlp_dim=12_288, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=False, qk_norm="per_head")
    c.model.rope_scaling.update(type="yarn", factor=4.0, original_max_position=32_768)
    c.data.update(seq_len=131_072, global_batch_size=4)
    return c


def _olmo3_7b_64k(c):
    """OLMo-3-7B (32 layers, 32 heads without GQA, QK-norm over the whole projection, norms after
    the sublayers) at 65,536 tokens, the length its long-context stage reached, on v5p-128 as
    llama3_8b_128k: three sliding-window layers (4,096 keys, RoPE theta 500,000, the halo) to one
    full layer (YaRN x8 over its 8,192-token pretraining, on the full layers only)."""
    c = _llama3_8b_128k(c)
    c.model.update(vocab_size=100_278, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                   mlp_dim=11_008, rope_theta=500_000.0, norm_eps=1e-6, tie_embeddings=False, qk_norm="whole",
                   norm_position="post")
    c.model.rope_scaling.update(type="yarn", factor=8.0, original_max_position=8192)
    c.data.update(seq_len=65_536, global_batch_size=4)
    c.attention.pattern = "sliding,sliding,sliding,full"
    c.attention.layer_types = ml_collections.ConfigDict({
        "sliding": dict(sliding_window=4095, rope_scaling=dict(type="none"), cp="halo"), "full": {}})
    return c


PRESETS = {"": lambda c: c, "base": lambda c: c, "tiny": _tiny, "tiny_hybrid": _tiny_hybrid, "long_cpu": _long_cpu,
           "long_mix_cpu": _long_mix_cpu, "v5e_0p5b": _v5e_0p5b,
           "llama3_8b_128k": _llama3_8b_128k, "llama3_70b_128k": _llama3_70b_128k,
           "llama3_8b_extend_128k": _llama3_8b_extend_128k, "llama3_8b_prolong_64k": _llama3_8b_prolong_64k,
           "gemma3_12b_128k": _gemma3_12b_128k,
           "gpt_oss_20b_128k": _gpt_oss_20b_128k, "llama4_scout_256k": _llama4_scout_256k,
           "qwen3_8b_128k": _qwen3_8b_128k, "olmo3_7b_64k": _olmo3_7b_64k}


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    if arg not in PRESETS:
        raise ValueError(f"configs/base.py: unknown preset {arg!r}; choose one of {sorted(k for k in PRESETS if k)}.")
    c = PRESETS[arg](_base())
    c.lock()  # unknown keys in overrides fail loudly instead of being silently added
    return c
