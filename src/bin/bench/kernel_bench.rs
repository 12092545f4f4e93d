//! `--kernel-bench`: the decode step's dense GEMV shapes, one product a
//! launch, through MLX's own GEMV and each walk of ours (and the 8B-A1B's
//! 4-bit shapes through MLX's qmv and our two quantized GEMVs), so that `ncu` over
//! this process (`bench/h200/run.py kernel-bench`) times every kernel alone
//! on identical operands. The question it answers: on the 1.2B's 2,048-wide
//! rows our GEMV, which walks a row as MLX's `gemv_single` does, has read
//! them more slowly than MLX's (sessions 19-24), and an in-step A/B cannot
//! say by how much, nor which walk loses least. The 1.2B's stacked w1/w3
//! through MLX's GEMV and through our SwiGLU GEMV (a default: 46% of that
//! model's bytes a step, and no arm timed it alone before) follow.
//!
//! Then the scalar arms (where a kernel's scalar operand lives), the
//! decode attention's variants on the 1.2B's shape, and last the 8B-A1B's
//! routed experts for one decode row (MLX's gathered products and our two
//! expert kernels, the down kernel also with its loads issued first):
//! session 22's ncu of a whole step put our down kernel at 23 µs a launch
//! (0.36 TB/s), a quarter of the step's GPU time, and an in-step A/B
//! cannot tell GPU time from a host-bound step's. (Its 2- and 4-columns-a-
//! warp variants, 30.0 and 23.9 µs against 24.2 in session 26, were
//! retired in session 27.)
//!
//! Prints the plan first (`kernel_bench_plan`: each arm's shape and how many
//! launches, in launch order, which is the order ncu lists the kernels in),
//! then each arm's wall time a product with its wait (launch and sync
//! included: not the kernel's time, which only ncu gives).

use mlx_lfm::mlx::kernel::cuda_kernels_enabled;
use mlx_lfm::mlx::{self, random::normal, Array, Dtype};
use std::time::Instant;

/// `(name, the switches it runs under)`: MLX's matmul, then our GEMV as it
/// ships for wide rows (opt-in there), MLX's own loop, no prefetch, two
/// and four columns a warp.
fn arms() -> Vec<(&'static str, Vec<(&'static str, &'static str)>)> {
    let ours = ("MLX_LFM_GEMV_KERNEL", "1");
    vec![
        ("mlx", vec![]),
        ("ours", vec![ours]),
        ("ours-plain", vec![ours, ("MLX_LFM_GEMV_LOOP", "plain")]),
        ("ours-nopf", vec![ours, ("MLX_LFM_GEMV_LOOP", "nopf")]),
        ("ours-c2", vec![ours, ("MLX_LFM_GEMV_COLS", "2")]),
        ("ours-c4", vec![ours, ("MLX_LFM_GEMV_COLS", "4")]),
    ]
}

/// The 1.2B's decode GEMVs `[N, K]` (out_proj, in_proj, q/k/v, w2, the
/// tied LM head, a ninth of a step's bytes) and the 350M's out_proj.
const SHAPES: [(i32, i32); 6] = [(2048, 2048), (6144, 2048), (3072, 2048), (2048, 8192), (65536, 2048), (1024, 1024)];

/// The 1.2B's stacked w1/w3 `[2F, K]`: 46% of its step's bytes, read by
/// our SwiGLU GEMV (a default since session 23: the GEMV of both halves
/// and the gate in one launch) where the stock path runs MLX's GEMV, a
/// Split, a copy and the gate. `mlx-w13` is MLX's GEMV of it alone (what
/// the bytes cost MLX), `ours-swiglu` the kernel.
const SWIGLU_SHAPES: [(i32, i32); 1] = [(16384, 2048)];
const SWIGLU_ARMS: [&str; 2] = ["mlx-w13", "ours-swiglu"];

/// The 8B-A1B's quantized decode GEMVs (affine 4-bit, groups of 64): its
/// conv layers' in_proj and out_proj, and its dense layers' w2; and (since
/// session 38) its LM head, the tied embedding (65,536 x 2,048, ~75 MB),
/// which MLX's `qmv` read at ~0.97 TB/s in that session's profile of the
/// step (77.9 µs of its 1,597), the attention layers' out_proj (2,048 x
/// 2,048) at ~0.38 in 6.2 µs each.
const QUANT_SHAPES: [(i32, i32); 4] = [(6144, 2048), (2048, 2048), (2048, 7168), (65536, 2048)];

/// The quantized arms: MLX's `quantized_matmul` (its qmv: our kernel off)
/// and ours in MLX's arithmetic (a CUDA default since session 39), the
/// switch set either way so the arms mean the same whatever the defaults.
/// (`ours-q4`, the float32 sums, retired in session 56; the arm in MLX's
/// arithmetic keeps its name, `ours-q4-exact`, as earlier records have it.)
fn quant_arms() -> Vec<(&'static str, Vec<(&'static str, &'static str)>)> {
    vec![
        ("mlx-q4", vec![("MLX_LFM_QGEMV_KERNEL", "0")]),
        ("ours-q4-exact", vec![("MLX_LFM_QGEMV_KERNEL", "1")]),
    ]
}

/// Bytes of distinct weights each shape cycles through, more than the
/// H200's 50 MB L2, so that a product's weights come from DRAM as a
/// step's do (ncu flushes the caches itself; the wall times need this).
const CYCLE_BYTES: usize = 96 << 20;

/// `w` quantized as the 8B-A1B's projections are: affine 4-bit, groups of 64.
fn q4_of(w: &Array) -> mlx_lfm::Result<mlx_lfm::model::linear::Quantized> {
    use mlx_lfm::mlx::{QuantMode, QuantSpec};
    let spec = QuantSpec { mode: QuantMode::Affine, bits: 4, group_size: 64 };
    let (weight, scales, biases) = mlx::quantize(w, spec)?;
    Ok(mlx_lfm::model::linear::Quantized { weight, scales, biases, spec })
}

/// A random bf16 weight of `shape` (normal, deviation `std`), [`q4_of`].
fn q4_random(shape: &[i32], std: f32) -> mlx_lfm::Result<mlx_lfm::model::linear::Quantized> {
    q4_of(&normal(shape, Dtype::Bfloat16, 0.0, std, None)?)
}

/// One shape's operands: the row and the weights it cycles through.
enum Weights {
    Dense(Vec<Array>),
    Quant(Vec<mlx_lfm::model::linear::Quantized>),
}

impl Weights {
    fn len(&self) -> usize {
        match self {
            Weights::Dense(ws) => ws.len(),
            Weights::Quant(qs) => qs.len(),
        }
    }

    /// `x` times weight `i`: MLX's product (`stock`), else our kernel under
    /// the caller's switches (an error where it does not serve them); the
    /// SwiGLU GEMV where `swiglu`.
    fn product(&self, i: usize, x: &Array, stock: bool, swiglu: bool) -> mlx_lfm::Result<Array> {
        let unserved = || mlx_lfm::Error::invalid(format!("our kernel does not serve {:?} @ {i}", x.shape()));
        match self {
            Weights::Dense(ws) if swiglu && !stock => {
                if !mlx_lfm::kernels::gemv::swiglu_available(x, &ws[i]) {
                    return Err(unserved());
                }
                mlx_lfm::kernels::gemv::gemv_swiglu(x, &ws[i])
            }
            Weights::Dense(ws) if stock => x.matmul(&ws[i].transpose(&[1, 0])?),
            Weights::Dense(ws) if mlx_lfm::kernels::gemv::available(x, &ws[i]) => mlx_lfm::kernels::gemv::gemv(x, &ws[i]),
            Weights::Quant(qs) if stock => {
                let q = &qs[i];
                mlx::quantized_matmul(x, &q.weight, &q.scales, q.biases.as_ref(), true, q.spec)
            }
            Weights::Quant(qs) if mlx_lfm::kernels::quant_gemv::available(x, &qs[i]) => mlx_lfm::kernels::quant_gemv::qgemv(x, &qs[i]),
            _ => Err(unserved()),
        }
    }
}

/// `only`: the arms so named (`--arms a,b`, e.g. for ncu's detail
/// sections over a few launches); None runs them all.
pub fn run(reps: usize, only: Option<&[String]>) -> mlx_lfm::Result<()> {
    let bf = Dtype::Bfloat16;
    let cuda = cuda_kernels_enabled();
    // (Our kernels' arms only where they run; the stock arms everywhere.)
    let chosen = |name: &str| (cuda || name.starts_with("mlx")) && only.is_none_or(|a| a.iter().any(|x| x == name));
    if let Some(a) = only {
        let known: Vec<&str> = arms()
            .iter()
            .chain(quant_arms().iter())
            .map(|(n, _)| *n)
            .chain(SWIGLU_ARMS)
            .chain(SCALAR_ARMS)
            .chain(ATT_ARMS.iter().map(|(n, ..)| *n))
            .chain(EXPERT_ARMS.iter().map(|(n, ..)| *n))
            .chain(FOLD_ARMS.iter().map(|(n, ..)| *n))
            .chain(LAYER_ARMS.iter().map(|(n, ..)| *n))
            .chain(CONV_ARMS.iter().map(|(n, ..)| *n))
            .chain(FFN_ARMS.iter().map(|(n, ..)| *n))
            .chain(QKV_ARMS.iter().map(|(n, _)| *n))
            .chain([TIMELINE_ARM, CONV_TIMELINE_ARM, FFN_TIMELINE_ARM, CHAIN_ARM])
            .collect();
        if let Some(bad) = a.iter().find(|x| !known.contains(&x.as_str())) {
            return Err(mlx_lfm::Error::invalid(format!("--arms: no arm named {bad:?} (the arms: {})", known.join(", "))));
        }
    }
    let timelines: Vec<&String> =
        only.unwrap_or(&[]).iter().filter(|x| [TIMELINE_ARM, CONV_TIMELINE_ARM, FFN_TIMELINE_ARM, CHAIN_ARM].contains(&x.as_str())).collect();
    if !timelines.is_empty() {
        // (The chains' stock forms run anywhere; their kernels' forms say
        // they are unserved where they are not CUDA's.)
        if !cuda && timelines.iter().any(|a| a.as_str() != CHAIN_ARM) {
            return Err(mlx_lfm::Error::invalid("--arms: the timeline forms run on CUDA only".to_string()));
        }
        if only.is_some_and(|a| a.len() > timelines.len()) {
            return Err(mlx_lfm::Error::invalid("--arms: the timeline arms run without the others (no plan: they are not for ncu)".to_string()));
        }
        // (One arm's failure is its line; the next still runs.)
        for arm in timelines {
            let done = match arm.as_str() {
                TIMELINE_ARM => timeline(reps),
                CONV_TIMELINE_ARM => conv_timeline(reps),
                CHAIN_ARM => layer_chains(reps),
                _ => ffn_timeline(reps),
            };
            if let Err(e) = done {
                println!("{}", serde_json::json!({"timeline_error": arm, "error": e.to_string()}));
            }
        }
        return Ok(());
    }
    let keep = |arms: Vec<(&'static str, Vec<(&'static str, &'static str)>)>| -> Vec<_> { arms.into_iter().filter(|(name, _)| chosen(name)).collect() };
    let (dense_arms, quant_arms) = (keep(arms()), keep(quant_arms()));
    // (Ours under its switch, as the dense arms are, so a picked setting of
    // the session cannot leave it unserved.)
    let swiglu_arms = keep(SWIGLU_ARMS.iter().map(|n| (*n, if n.starts_with("ours") { vec![("MLX_LFM_GEMV_KERNEL", "1")] } else { vec![] })).collect());
    let mut plan = vec![];
    let mut sets = vec![];
    #[derive(Clone, Copy, PartialEq)]
    enum Kind {
        Dense,
        Quant,
        Swiglu,
    }
    let shapes = SHAPES
        .iter()
        .map(|s| (*s, Kind::Dense))
        .chain(QUANT_SHAPES.iter().map(|s| (*s, Kind::Quant)))
        .chain(SWIGLU_SHAPES.iter().map(|s| (*s, Kind::Swiglu)));
    for ((n, k), kind) in shapes {
        let quant = kind == Kind::Quant;
        let arms = match kind {
            Kind::Dense => &dense_arms,
            Kind::Quant => &quant_arms,
            Kind::Swiglu => &swiglu_arms,
        };
        if arms.is_empty() {
            continue;
        }
        let bytes = if quant { n as usize * k as usize / 2 } else { n as usize * k as usize * 2 };
        let copies = CYCLE_BYTES.div_ceil(bytes).clamp(1, 16);
        let x = normal(&[1, k], bf, 0.0, 1.0, None)?;
        let dense = (0..copies)
            .map(|_| normal(&[n, k], bf, 0.0, 1.0 / (k as f32).sqrt(), None))
            .collect::<mlx_lfm::Result<Vec<Array>>>()?;
        let weights = if quant {
            let q = dense.iter().map(q4_of).collect::<mlx_lfm::Result<Vec<_>>>()?;
            let mut held: Vec<&Array> = q.iter().flat_map(|q| [&q.weight, &q.scales]).collect();
            held.extend(q.iter().filter_map(|q| q.biases.as_ref()));
            held.push(&x);
            mlx::eval(&held)?;
            Weights::Quant(q)
        } else {
            let mut held: Vec<&Array> = dense.iter().collect();
            held.push(&x);
            mlx::eval(&held)?;
            Weights::Dense(dense)
        };
        for (name, _) in arms {
            plan.push(serde_json::json!({"arm": name, "n": n, "k": k, "launches": copies * reps}));
        }
        sets.push((n, k, x, weights, arms.clone()));
    }
    let scalar_arms: Vec<&str> = SCALAR_ARMS.into_iter().filter(|n| chosen(n)).collect();
    let scalar = if scalar_arms.is_empty() { None } else { Some(ScalarReads::new()?) };
    if scalar.is_some() {
        for name in &scalar_arms {
            plan.push(serde_json::json!({"arm": name, "n": SCALAR_N, "k": 1, "launches": SCALAR_LAUNCHES * reps}));
        }
    }
    let att_arms: Vec<_> = ATT_ARMS.into_iter().filter(|(n, ..)| chosen(n)).collect();
    let attention = if att_arms.is_empty() { None } else { Some(Attention::new()?) };
    if attention.is_some() {
        for (name, _, kernels) in &att_arms {
            plan.push(serde_json::json!({"arm": name, "n": ATT_POSITIONS, "k": ATT_HD, "launches": ATT_LAUNCHES * reps * kernels}));
        }
    }
    let expert_arms: Vec<_> = EXPERT_ARMS.iter().filter(|(name, ..)| chosen(name)).collect();
    let experts = if expert_arms.is_empty() { None } else { Some(Experts::new()?) };
    for (name, _, gate_up) in &expert_arms {
        let (n, k) = Experts::plan_shape(*gate_up);
        plan.push(serde_json::json!({"arm": name, "n": n, "k": k, "launches": EXPERT_LAUNCHES * reps}));
    }
    let fold_arms: Vec<_> = FOLD_ARMS.iter().filter(|(name, ..)| chosen(name)).collect();
    let folds = if fold_arms.is_empty() { None } else { Some(Folds::new()?) };
    for (name, _, kernels, swiglu) in &fold_arms {
        let (n, k) = Folds::shape(*swiglu);
        plan.push(serde_json::json!({"arm": name, "n": n, "k": k, "launches": FOLD_LAUNCHES * reps * kernels}));
    }
    let layer_arms: Vec<_> = LAYER_ARMS.iter().filter(|(name, ..)| chosen(name)).collect();
    let layer = if layer_arms.is_empty() { None } else { Some(Layer::new()?) };
    for (name, _, kernels) in &layer_arms {
        plan.push(serde_json::json!({"arm": name, "n": LAYER_N, "k": EXPERT_D, "launches": LAYER_LAUNCHES * reps * kernels}));
    }
    let conv_arms: Vec<_> = CONV_ARMS.iter().filter(|(name, ..)| chosen(name)).collect();
    let conv = if conv_arms.is_empty() { None } else { Some(ConvLayer::new()?) };
    for (name, _, kernels) in &conv_arms {
        plan.push(serde_json::json!({"arm": name, "n": 4 * CONV_D, "k": CONV_D, "launches": CONV_LAUNCHES * reps * kernels}));
    }
    let joined_arms: Vec<_> = JOINED_ARMS.iter().filter(|(name, ..)| chosen(name)).collect();
    let ffn_arms: Vec<_> = FFN_ARMS.iter().filter(|(name, ..)| chosen(name)).collect();
    // (The joined arms run the conv layer's, the feed-forward's and the MoE
    // layer's operands.)
    let conv = match conv {
        None if !joined_arms.is_empty() => Some(ConvLayer::new()?),
        c => c,
    };
    let layer = match layer {
        None if !joined_arms.is_empty() => Some(Layer::new()?),
        l => l,
    };
    let ffn = if ffn_arms.is_empty() && joined_arms.is_empty() { None } else { Some(FfnLayer::new()?) };
    let joined_counters = mlx_lfm::kernels::stages::new_counters_of(mlx_lfm::kernels::conv_layer_fused::COUNTER_WORDS)?;
    // (The plan in the order the arms run below: ncu lists their kernels so.)
    for (name, _, kernels) in &ffn_arms {
        plan.push(serde_json::json!({"arm": name, "n": 3 * ffn_width(name), "k": FFN_D, "launches": FFN_LAUNCHES * reps * kernels}));
    }
    let qkv_arms: Vec<_> = QKV_ARMS.iter().filter(|(name, _)| chosen(name)).collect();
    let qkv = if qkv_arms.is_empty() { None } else { Some(QkvLayer::new()?) };
    for (name, _) in &qkv_arms {
        let (qh, kvh, hd) = QKV_HEADS;
        plan.push(serde_json::json!({"arm": name, "n": (qh + 2 * kvh) * hd, "k": QKV_D, "launches": QKV_LAUNCHES * reps}));
    }
    for (name, _, kernels) in &joined_arms {
        plan.push(serde_json::json!({"arm": name, "n": 4 * CONV_D, "k": CONV_D, "launches": JOINED_LAUNCHES * reps * kernels}));
    }
    println!("{}", serde_json::json!({"kernel_bench_plan": plan}));
    for (n, k, x, weights, arms) in &sets {
        for (name, switches) in arms {
            let walls = timed(switches, reps * weights.len(), |i| {
                weights
                    .product(i % weights.len(), x, name.starts_with("mlx"), *name == "ours-swiglu")
                    .map_err(|e| mlx_lfm::Error::invalid(format!("{name} {n}x{k}: {e}")))
            });
            print_walls(name, *n, *k, walls);
        }
    }
    if let Some(s) = &scalar {
        for name in scalar_arms {
            print_walls(name, SCALAR_N, 1, timed(&[], reps * SCALAR_LAUNCHES, |_| s.launch(name)));
        }
    }
    if let Some(a) = &attention {
        for (name, switches, _) in att_arms {
            print_walls(name, ATT_POSITIONS, ATT_HD, timed(switches, reps * ATT_LAUNCHES, |_| a.launch()));
        }
    }
    for (name, switches, gate_up) in expert_arms {
        let experts = experts.as_ref().expect("made where an expert arm runs");
        let (n, k) = Experts::plan_shape(*gate_up);
        let walls = timed(switches, reps * EXPERT_LAUNCHES, |i| {
            experts
                .launch(name.starts_with("mlx"), *gate_up, name.ends_with("-f32-score"), i)
                .map_err(|e| mlx_lfm::Error::invalid(format!("{name}: {e}")))
        });
        print_walls(name, n, k, walls);
    }
    for (name, switches, _, swiglu) in fold_arms {
        let folds = folds.as_ref().expect("made where a fold arm runs");
        let (n, k) = Folds::shape(*swiglu);
        let walls = timed(switches, reps * FOLD_LAUNCHES, |i| {
            folds.launch(name, *swiglu, i).map_err(|e| mlx_lfm::Error::invalid(format!("{name}: {e}")))
        });
        print_walls(name, n, k, walls);
    }
    for (name, switches, kernels) in layer_arms {
        let layer = layer.as_ref().expect("made where a layer arm runs");
        // (A state of its own an arm: the kernel finds its launch and part
        // from a ticket over its block count, which two gate/up outputs a
        // warp change; the joined arms keep the layer's own.)
        let walls = match Layer::new_state() {
            Ok(state) => timed(switches, reps * LAYER_LAUNCHES, |i| {
                layer.launch(*kernels == 1, &state, i).map_err(|e| mlx_lfm::Error::invalid(format!("{name}: {e}")))
            }),
            Err(e) => (vec![], Some(e)),
        };
        print_walls(name, LAYER_N, EXPERT_D, walls);
    }
    for (name, switches, _) in conv_arms {
        let conv = conv.as_ref().expect("made where a conv arm runs");
        let walls = timed(switches, reps * CONV_LAUNCHES, |i| {
            conv.launch(name.contains("-fused"), name.contains("-q4-"), i).map_err(|e| mlx_lfm::Error::invalid(format!("{name}: {e}")))
        });
        print_walls(name, 4 * CONV_D, CONV_D, walls);
    }
    for (name, switches, _) in ffn_arms {
        let ffn = ffn.as_ref().expect("made where a feed-forward arm runs");
        let walls = timed(switches, reps * FFN_LAUNCHES, |i| {
            ffn.launch(name.contains("-fused"), name.contains("-q4-"), name.contains("-g2"), i)
                .map_err(|e| mlx_lfm::Error::invalid(format!("{name}: {e}")))
        });
        print_walls(name, 3 * ffn_width(name), FFN_D, walls);
    }
    for (name, switches) in qkv_arms {
        let qkv = qkv.as_ref().expect("made where a q/k/v arm runs");
        let (qh, kvh, hd) = QKV_HEADS;
        let walls = match QkvLayer::state() {
            Ok(ctr) => timed(switches, reps * QKV_LAUNCHES, |i| {
                qkv.launch(name.contains("-q4-"), &ctr, i).map_err(|e| mlx_lfm::Error::invalid(format!("{name}: {e}")))
            }),
            Err(e) => (vec![], Some(e)),
        };
        print_walls(name, (qh + 2 * kvh) * hd, QKV_D, walls);
    }
    for (name, switches, _) in joined_arms {
        let (conv, ffn, moe) = (conv.as_ref(), ffn.as_ref(), layer.as_ref());
        let (Some(conv), Some(ffn), Some(moe)) = (conv, ffn, moe) else { unreachable!("made where a joined arm runs") };
        let walls = timed(switches, reps * JOINED_LAUNCHES, |i| {
            joined_launch(name, conv, ffn, moe, &joined_counters, i).map_err(|e| mlx_lfm::Error::invalid(format!("{name}: {e}")))
        });
        print_walls(name, 4 * CONV_D, CONV_D, walls);
    }
    Ok(())
}

/// A conv layer and what follows it for one decode row: the two one-launch
/// kernels (`-two`: the conv layer's, then the feed-forward's or the MoE
/// layer's on its output and sum) against the joined one
/// (src/kernels/conv_layer_fused.rs). The `-bf16-` arms: the 1.2B's conv
/// layer and feed-forward (dense); the `-moe-q4-` arms: the 8B-A1B's conv
/// layer and MoE (4-bit). `(arm, its switches, kernels a product)`.
const JOINED_ARMS: [(&str, Switches, usize); 4] = [
    ("conv-ffn-layer-bf16-two", &[("MLX_LFM_CONV_FUSED", "1"), ("MLX_LFM_FFN_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1")], 2),
    ("conv-ffn-layer-bf16-joined", &[("MLX_LFM_CONV_LAYER_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1")], 1),
    ("conv-moe-layer-q4-two", &[("MLX_LFM_CONV_FUSED", "1"), ("MLX_LFM_MOE_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1")], 2),
    ("conv-moe-layer-q4-joined", &[("MLX_LFM_CONV_LAYER_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1")], 1),
];
const JOINED_LAUNCHES: usize = 16;

/// The one-launch q/k/v stage (src/kernels/qkv_fused.rs) of the 1.2B
/// (`-bf16-`: 32 query heads and 8 KV heads of 64 over 2,048-wide rows,
/// 12.6 MB a launch) and the 8B-A1B (`-q4-`: the same heads, 4-bit, group
/// 64), a launch a product: one block a head (`-fused`; `-w32`: a head
/// over 32 warps, `MLX_LFM_QKV_WARPS`) against each head's rows over 2 or
/// 4 blocks (`-split2`, `-split4`: `MLX_LFM_QKV_SPLIT`). Session 40's
/// profile had the 1.2B's at ~15 µs a launch (~0.85 TB/s). Each arm on a
/// state of its own (a launch's tickets count its blocks). `(arm, its
/// switches)`. `-every-norm`: every head's block computes the norm itself
/// (`MLX_LFM_QKV_EVERY_NORM`, session 46), no handoff.
const QKV_ARMS: [(&str, Switches); 10] = [
    ("qkv-bf16-fused", &[("MLX_LFM_QKV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_QKV_WARPS", "16"), ("MLX_LFM_QKV_SPLIT", "1"), ("MLX_LFM_QKV_EVERY_NORM", "0")]),
    ("qkv-bf16-fused-w32", &[("MLX_LFM_QKV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_QKV_WARPS", "32"), ("MLX_LFM_QKV_SPLIT", "1"), ("MLX_LFM_QKV_EVERY_NORM", "0")]),
    ("qkv-bf16-split2", &[("MLX_LFM_QKV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_QKV_WARPS", "16"), ("MLX_LFM_QKV_SPLIT", "2"), ("MLX_LFM_QKV_EVERY_NORM", "0")]),
    ("qkv-bf16-split4", &[("MLX_LFM_QKV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_QKV_WARPS", "16"), ("MLX_LFM_QKV_SPLIT", "4"), ("MLX_LFM_QKV_EVERY_NORM", "0")]),
    ("qkv-bf16-split2-w32", &[("MLX_LFM_QKV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_QKV_WARPS", "32"), ("MLX_LFM_QKV_SPLIT", "2"), ("MLX_LFM_QKV_EVERY_NORM", "0")]),
    ("qkv-q4-fused", &[("MLX_LFM_QKV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_QKV_WARPS", "16"), ("MLX_LFM_QKV_SPLIT", "1"), ("MLX_LFM_QKV_EVERY_NORM", "0")]),
    ("qkv-q4-split2", &[("MLX_LFM_QKV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_QKV_WARPS", "16"), ("MLX_LFM_QKV_SPLIT", "2"), ("MLX_LFM_QKV_EVERY_NORM", "0")]),
    ("qkv-q4-split4", &[("MLX_LFM_QKV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_QKV_WARPS", "16"), ("MLX_LFM_QKV_SPLIT", "4"), ("MLX_LFM_QKV_EVERY_NORM", "0")]),
    (
        "qkv-bf16-every-norm",
        &[("MLX_LFM_QKV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_QKV_WARPS", "16"), ("MLX_LFM_QKV_SPLIT", "1"), ("MLX_LFM_QKV_EVERY_NORM", "1")],
    ),
    (
        "qkv-q4-every-norm",
        &[("MLX_LFM_QKV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_QKV_WARPS", "16"), ("MLX_LFM_QKV_SPLIT", "1"), ("MLX_LFM_QKV_EVERY_NORM", "1")],
    ),
];
const QKV_LAUNCHES: usize = 16;
const QKV_D: i32 = 2048;
const QKV_HEADS: (i32, i32, i32) = (32, 8, 64);
/// Copies (~100 MB dense, ~28 MB 4-bit: over the L2 either way).
const QKV_COPIES: usize = 8;

struct QkvLayer {
    /// The stacked q/k/v projection `[(H + 2 KVH) HD, D]`, each copy,
    /// dense and 4-bit.
    dense: Vec<Array>,
    quant: Vec<mlx_lfm::model::linear::Quantized>,
    h: Array,
    r: Array,
    wn: Array,
    eps: Array,
    qw: Array,
    kw: Array,
    offset: Array,
}

impl QkvLayer {
    fn new() -> mlx_lfm::Result<QkvLayer> {
        let bf = Dtype::Bfloat16;
        let (qh, kvh, hd) = QKV_HEADS;
        let rows = (qh + 2 * kvh) * hd;
        let scale = 1.0 / (QKV_D as f32).sqrt();
        let dense = (0..QKV_COPIES).map(|_| normal(&[rows, QKV_D], bf, 0.0, scale, None)).collect::<mlx_lfm::Result<Vec<_>>>()?;
        let quant = (0..QKV_COPIES).map(|_| q4_random(&[rows, QKV_D], scale)).collect::<mlx_lfm::Result<Vec<_>>>()?;
        let h = normal(&[1, QKV_D], bf, 0.0, 4.0, None)?;
        let r = normal(&[1, QKV_D], bf, 0.0, 1.0, None)?;
        let wn = normal(&[QKV_D], Dtype::Float32, 1.0, 0.2, None)?.astype(bf)?;
        let qw = normal(&[hd], Dtype::Float32, 1.0, 0.2, None)?.astype(bf)?;
        let kw = normal(&[hd], Dtype::Float32, 1.0, 0.2, None)?.astype(bf)?;
        let eps = Array::from_slice(&[LAYER_EPS], &[1])?;
        let offset = Array::from_slice(&[550i32], &[1])?;
        let mut held: Vec<&Array> = dense.iter().collect();
        for q in &quant {
            held.extend([&q.weight, &q.scales]);
            held.extend(q.biases.iter());
        }
        held.extend([&h, &r, &wn, &eps, &qw, &kw, &offset]);
        mlx::eval(&held)?;
        Ok(QkvLayer { dense, quant, h, r, wn, eps, qw, kw, offset })
    }

    /// A state for one arm's launches (the model's size: counters, the
    /// scratch row, the split form's words).
    fn state() -> mlx_lfm::Result<Array> {
        let (qh, kvh, _) = QKV_HEADS;
        mlx_lfm::kernels::stages::new_counters_of(mlx_lfm::kernels::qkv_fused::state_words(QKV_D as usize, (qh + 2 * kvh) as usize))
    }

    /// Copy `i` (in turn) of the dense or the 4-bit projection.
    fn projection(&self, q4: bool, i: usize) -> mlx_lfm::kernels::qkv_fused::Projection<'_> {
        use mlx_lfm::kernels::qkv_fused::Projection;
        if q4 {
            Projection::Quant(&self.quant[i % self.quant.len()])
        } else {
            Projection::Dense(&self.dense[i % self.dense.len()])
        }
    }

    /// The stage's q for launch `i` (copy `i` of the dense or the 4-bit
    /// projection, in turn) on `ctr`.
    fn launch(&self, q4: bool, ctr: &Array, i: usize) -> mlx_lfm::Result<Array> {
        self.launch_on(&self.h, q4, ctr, i)
    }

    /// [`QkvLayer::launch`] on the row `h` (a chain's previous output).
    fn launch_on(&self, h: &Array, q4: bool, ctr: &Array, i: usize) -> mlx_lfm::Result<Array> {
        use mlx_lfm::kernels::qkv_fused;
        use mlx_lfm::model::linear::Normed;
        let p = self.projection(q4, i);
        let x = Normed { h, r: Some(&self.r), w: &self.wn, eps: LAYER_EPS, eps_array: &self.eps };
        if !qkv_fused::available(&x, p, &self.qw, &self.kw, QKV_HEADS, &self.offset) {
            return Err(mlx_lfm::Error::invalid("kernel-bench: the q/k/v stage's kernel does not serve its operands here"));
        }
        Ok(qkv_fused::forward(&x, p, &self.qw, &self.kw, QKV_HEADS, &self.offset, (1e-6, 1_000_000.0), ctr)?.1)
    }
}

/// The joined arm `name`'s output for launch `i` (the conv's copy `i`, the
/// feed-forward's or the MoE layer's row `i`, in turn).
fn joined_launch(name: &str, conv: &ConvLayer, ffn: &FfnLayer, moe: &Layer, ctr: &Array, i: usize) -> mlx_lfm::Result<Array> {
    use mlx_lfm::kernels::{conv_fused, conv_layer_fused as joined, ffn_fused, moe_fused, norm_gemv::NormIn, stages::Projections};
    use mlx_lfm::model::linear::Normed;
    let unserved = || mlx_lfm::Error::invalid("kernel-bench: the joined layer's kernels do not serve their operands here");
    let with_moe = name.contains("-moe-");
    let p = if with_moe {
        let (wi, wo) = &conv.projections[i % conv.projections.len()];
        Projections::Quant(wi, wo)
    } else {
        let (wi, wo) = &conv.dense[i % conv.dense.len()];
        Projections::Dense(wi, wo)
    };
    let x = Normed { h: &moe.hs[i % moe.hs.len()], r: Some(&conv.r), w: &conv.wn, eps: LAYER_EPS, eps_array: &conv.eps };
    let (w13, w2) = &ffn.weights[i % ffn.weights.len()];
    let tail = Projections::Dense(w13, w2);
    let (g, gu, down) = (&moe.gate, &moe.experts.gate_up, &moe.experts.down);
    let k = EXPERTS_A_ROW as usize;
    if name.ends_with("-joined") {
        let out = if with_moe {
            let m = joined::Moe { gate: g, bias: &moe.bias, gate_up: gu, down, k, norm: true, scale: 1.0 };
            let l = joined::ConvMoeLayer { x: &x, conv: p, state: &conv.state, cw: &conv.cw, ffn_norm: &moe.wn, moe: m };
            if !joined::available_moe(&l, false) {
                return Err(unserved());
            }
            joined::forward_moe(&l, ctr)?
        } else {
            let l = joined::ConvLayer { x: &x, conv: p, state: &conv.state, cw: &conv.cw, ffn_norm: &ffn.wn, ffn: tail };
            if !joined::available(&l, false) {
                return Err(unserved());
            }
            joined::forward(&l, ctr)?
        };
        return Ok(out.out);
    }
    if !conv_fused::available(&x, p, &conv.state, &conv.cw, false) {
        return Err(unserved());
    }
    let (s1, o1, _) = conv_fused::forward(&x, p, &conv.state, &conv.cw, &conv.counters)?;
    if with_moe {
        let n = NormIn { h: &o1, r: &s1, wn: &moe.wn, eps: &moe.eps, eps_value: Some(LAYER_EPS) };
        if !moe_fused::available(&n, g, gu, down, k) {
            return Err(unserved());
        }
        return Ok(moe_fused::forward(&n, g, &moe.bias, gu, down, &moe.state, k, true, LAYER_EPS, 1.0)?.1);
    }
    let x2 = Normed { h: &o1, r: Some(&s1), w: &ffn.wn, eps: LAYER_EPS, eps_array: &ffn.eps };
    if !ffn_fused::available(&x2, tail) {
        return Err(unserved());
    }
    Ok(ffn_fused::forward(&x2, tail, &ffn.counters[usize::from(matches!(tail, ffn_fused::Projections::Quant(..)))][0])?.1)
}

/// The 8B-A1B's routed experts for one decode row: `(arm, its switches,
/// whether it is the gate/up product (else the down product))`. The `mlx-`
/// arms are MLX's gathered quantized products (`gather_qmm`, what the
/// stock path runs: the gate/up arm without the SwiGLU gate, which the
/// stock path launches apart); the others our kernels (src/kernels/moe_experts.rs).
/// A plan's `n` is the rows read (the row's 4 experts' rows together), `k`
/// their width, so that `n * k` 4-bit values are the bytes an arm moves.
const EXPERT_ARMS: [(&str, Switches, bool); 7] = [
    ("mlx-moe-q4-gate-up", &[], true),
    ("moe-q4-gate-up", &[], true),
    ("mlx-moe-q4-down", &[], false),
    ("moe-q4-down", &[], false),
    ("moe-q4-down-early", &[("MLX_LFM_MOE_DOWN_LOADS", "early")], false),
    // The row's weights as float32, 16 bytes in device memory (what the
    // router writes under MLX_LFM_ROUTER_SCORES_F32), not the 8 bytes of
    // bf16 that MLX keeps in its managed scalar pool.
    ("moe-q4-down-f32-score", &[], false),
    ("moe-q4-down-early-f32-score", &[("MLX_LFM_MOE_DOWN_LOADS", "early")], false),
];
const EXPERTS: i32 = 32;
const EXPERTS_A_ROW: i32 = 4;
const EXPERT_D: i32 = 2048;
const EXPERT_F: i32 = 1792;
/// Launches an arm and rep; each launch takes the next of the `EXPERTS /
/// EXPERTS_A_ROW` disjoint expert sets, so eight launches in a row read
/// the arm's whole stack once (gate/up ~132 MB, down ~66 MB with scales and
/// biases, against the H200's ~50 MB of L2) and none finds its experts
/// cached from the one before (ncu flushes the caches itself; the wall
/// times need this).
const EXPERT_LAUNCHES: usize = 16;

struct Experts {
    gate_up: mlx_lfm::model::linear::Quantized,
    down: mlx_lfm::model::linear::Quantized,
    /// The row `[1, D]` and the gated activations `[1, k, F]`.
    x: Array,
    h: Array,
    /// The row's weights in bf16 (8 bytes: MLX's managed scalar pool, as
    /// the router's bf16 output is) and in float32 (16 bytes: device memory).
    score: Array,
    score_f32: Array,
    /// One `[1, k]` uint32 expert set a launch, in turn.
    sets: Vec<Array>,
}

impl Experts {
    fn new() -> mlx_lfm::Result<Experts> {
        let bf = Dtype::Bfloat16;
        let quant = |rows: i32, width: i32| q4_random(&[EXPERTS, rows, width], 1.0 / (width as f32).sqrt());
        let gate_up = quant(2 * EXPERT_F, EXPERT_D)?;
        let down = quant(EXPERT_D, EXPERT_F)?;
        let x = normal(&[1, EXPERT_D], bf, 0.0, 1.0, None)?;
        let h = normal(&[1, EXPERTS_A_ROW, EXPERT_F], bf, 0.0, 1.0, None)?;
        let score = mlx::full(&[1, EXPERTS_A_ROW], 1.0 / EXPERTS_A_ROW as f64, bf)?;
        let sets = (0..EXPERTS / EXPERTS_A_ROW)
            .map(|s| {
                let ids: Vec<u32> = (0..EXPERTS_A_ROW).map(|j| (s * EXPERTS_A_ROW + j) as u32).collect();
                Array::from_slice(&ids, &[1, EXPERTS_A_ROW])
            })
            .collect::<mlx_lfm::Result<Vec<_>>>()?;
        // (A GPU op's 16-byte output: device memory.)
        let score_f32 = score.astype(Dtype::Float32)?;
        let mut held: Vec<&Array> = vec![&gate_up.weight, &gate_up.scales, &down.weight, &down.scales, &x, &h, &score, &score_f32];
        held.extend(gate_up.biases.iter().chain(down.biases.iter()));
        held.extend(sets.iter());
        mlx::eval(&held)?;
        Ok(Experts { gate_up, down, x, h, score, score_f32, sets })
    }

    /// The plan's `(n, k)` of an arm: rows read and their width.
    fn plan_shape(gate_up: bool) -> (i32, i32) {
        if gate_up {
            (EXPERTS_A_ROW * 2 * EXPERT_F, EXPERT_D)
        } else {
            (EXPERTS_A_ROW * EXPERT_D, EXPERT_F)
        }
    }

    fn launch(&self, stock: bool, gate_up: bool, f32_score: bool, i: usize) -> mlx_lfm::Result<Array> {
        use mlx_lfm::kernels::moe_experts;
        let idx = &self.sets[i % self.sets.len()];
        let (w, spec) = if gate_up { (&self.gate_up, self.gate_up.spec) } else { (&self.down, self.down.spec) };
        if stock {
            // As the stock decode step gathers: `[1, 1, 1, 1, K]` rows
            // against `[1, 1, k]` experts.
            let rows = if gate_up { self.x.reshape(&[1, 1, 1, 1, EXPERT_D])? } else { self.h.reshape(&[1, 1, EXPERTS_A_ROW, 1, EXPERT_F])? };
            let idx = idx.reshape(&[1, 1, EXPERTS_A_ROW])?;
            return mlx::gather_qmm(&rows, &w.weight, &w.scales, w.biases.as_ref(), None, Some(&idx), true, spec, false);
        }
        if !moe_experts::available(1, EXPERTS_A_ROW as usize, Dtype::Bfloat16, &self.gate_up, &self.down) {
            return Err(mlx_lfm::Error::invalid("kernel-bench: the MoE expert kernels do not serve their operands"));
        }
        if gate_up {
            moe_experts::gate_up(&self.x, idx, w)
        } else {
            moe_experts::down(&self.h, idx, if f32_score { &self.score_f32 } else { &self.score }, w)
        }
    }
}

/// The 8B-A1B's whole MoE layer for one decode row, from the residual's
/// add + RMSNorm through the experts' weighted sum: the three launches the
/// step runs by default (the router + norm fold, the experts' gate/up and
/// down kernels) against the one of src/kernels/moe_fused.rs. `(arm, its
/// switches, kernels a product)`. Each launch routes another of
/// [`LAYER_ROWS`] rows, so the chosen experts change from one to the next.
/// (Session 35's arms of the one launch in blocks of 16 or 8 warps and
/// of its router's rows asked of L2 first, 41.60 / 44.61 / 41.70 µs
/// against 41.57 on an H100, retired; session 36's experts over x staged
/// in float32, 59.36 against 41.63, retired; session 37's over x
/// chunk-interleaved, 42.40 against 41.47, retired.) `moe-layer-q4-fused`
/// is the one launch as it ships: since session 38 its experts in MLX's
/// arithmetic, their 4-bit rows in pairs (37.66 µs on the H100 there);
/// `moe-layer-q4-float-fused` the float form before it
/// (`MLX_LFM_MOE_EXACT=0`, 41.57); `moe-layer-q4-pf-fused` and
/// `moe-layer-q4-pfa-fused` its down rows asked of L2 by the gate/up blocks
/// before their own rows and after them (`MLX_LFM_MOE_DOWN_PREFETCH=1|after`,
/// session 38; 39.68 and 37.73 against 37.31 in session 39);
/// `moe-layer-q4-g2-fused` its gate/up warps two outputs each
/// (`MLX_LFM_MOE_GATE_ROWS=2`, session 51: half the gate/up blocks, one
/// wave on an H100), `moe-layer-q4-d2-fused` its down warps two columns
/// each (`MLX_LFM_MOE_DOWN_COLS=2`), `moe-layer-q4-g2d2-fused` both (the
/// default since session 53: 35.20, 35.52 and 34.78 µs against 37.66 on
/// the H100 there; `moe-layer-q4-fused` pins the one-output form).
/// (Session 37's
/// route in every gate/up block, 41.86 against 37.66 with the experts exact
/// in pairs, retired; session 38's two down columns a warp, 268 ms in
/// session 39, its waits giving up, retired.) An arm of one kernel a
/// product runs the one launch.
const LAYER_ARMS: [(&str, Switches, usize); 8] = [
    ("moe-layer-q4-three", &[("MLX_LFM_MOE_FUSED", "0"), ("MLX_LFM_EPS_CONST", "1")], 3),
    ("moe-layer-q4-fused", &[("MLX_LFM_MOE_FUSED", "1"), ("MLX_LFM_MOE_GATE_ROWS", "1"), ("MLX_LFM_MOE_DOWN_COLS", "1"), ("MLX_LFM_EPS_CONST", "1")], 1),
    (
        "moe-layer-q4-float-fused",
        &[("MLX_LFM_MOE_FUSED", "1"), ("MLX_LFM_MOE_EXACT", "0"), ("MLX_LFM_MOE_GATE_ROWS", "1"), ("MLX_LFM_MOE_DOWN_COLS", "1"), ("MLX_LFM_EPS_CONST", "1")],
        1,
    ),
    (
        "moe-layer-q4-pf-fused",
        &[("MLX_LFM_MOE_FUSED", "1"), ("MLX_LFM_MOE_DOWN_PREFETCH", "1"), ("MLX_LFM_MOE_GATE_ROWS", "1"), ("MLX_LFM_MOE_DOWN_COLS", "1"), ("MLX_LFM_EPS_CONST", "1")],
        1,
    ),
    (
        "moe-layer-q4-pfa-fused",
        &[("MLX_LFM_MOE_FUSED", "1"), ("MLX_LFM_MOE_DOWN_PREFETCH", "after"), ("MLX_LFM_MOE_GATE_ROWS", "1"), ("MLX_LFM_MOE_DOWN_COLS", "1"), ("MLX_LFM_EPS_CONST", "1")],
        1,
    ),
    (
        "moe-layer-q4-g2-fused",
        &[("MLX_LFM_MOE_FUSED", "1"), ("MLX_LFM_MOE_GATE_ROWS", "2"), ("MLX_LFM_MOE_DOWN_COLS", "1"), ("MLX_LFM_EPS_CONST", "1")],
        1,
    ),
    (
        "moe-layer-q4-d2-fused",
        &[("MLX_LFM_MOE_FUSED", "1"), ("MLX_LFM_MOE_GATE_ROWS", "1"), ("MLX_LFM_MOE_DOWN_COLS", "2"), ("MLX_LFM_EPS_CONST", "1")],
        1,
    ),
    (
        "moe-layer-q4-g2d2-fused",
        &[("MLX_LFM_MOE_FUSED", "1"), ("MLX_LFM_MOE_GATE_ROWS", "2"), ("MLX_LFM_MOE_DOWN_COLS", "2"), ("MLX_LFM_EPS_CONST", "1")],
        1,
    ),
];
const LAYER_ROWS: usize = 8;
const LAYER_LAUNCHES: usize = 16;
const LAYER_EPS: f32 = 1e-5;
/// A plan's `n` at `k` = D: the 4-bit values a row reads (its 4 experts'
/// gate/up and down rows and the router's gate), so the GB/s compare.
const LAYER_N: i32 = EXPERTS_A_ROW * 2 * EXPERT_F + EXPERTS_A_ROW * EXPERT_F + EXPERTS;

/// A timeline launch's stamps, the index after its first stage's parts
/// and its block count (as `moe_fused::forward_timeline` gives them).
type Stamps = (Array, usize, usize);

struct Layer {
    experts: Experts,
    gate: mlx_lfm::model::linear::Quantized,
    /// The residual's rows (one a launch, in turn) and the stream's.
    hs: Vec<Array>,
    r: Array,
    wn: Array,
    eps: Array,
    bias: Array,
    scale: Array,
    state: Array,
}

impl Layer {
    fn new() -> mlx_lfm::Result<Layer> {
        let bf = Dtype::Bfloat16;
        let experts = Experts::new()?;
        let gate = q4_random(&[EXPERTS, EXPERT_D], 0.04)?;
        let hs = (0..LAYER_ROWS).map(|_| normal(&[1, EXPERT_D], bf, 0.0, 4.0, None)).collect::<mlx_lfm::Result<Vec<_>>>()?;
        let r = normal(&[1, EXPERT_D], bf, 0.0, 1.0, None)?;
        let wn = normal(&[EXPERT_D], Dtype::Float32, 1.0, 0.2, None)?.astype(bf)?;
        let eps = Array::from_slice(&[LAYER_EPS], &[1])?;
        let bias = mlx::zeros(&[EXPERTS], Dtype::Float32)?;
        let scale = Array::from_slice(&[1.0f32], &[1])?;
        let state = Layer::new_state()?;
        let mut held: Vec<&Array> = hs.iter().collect();
        held.extend([&gate.weight, &gate.scales, &r, &wn, &eps, &bias, &scale]);
        held.extend(gate.biases.iter());
        mlx::eval(&held)?;
        Ok(Layer { experts, gate, hs, r, wn, eps, bias, scale, state })
    }

    /// A layer's state (its counters), with room for the scratch rows, as
    /// the model's layers are made: the form a step runs, its rows in the
    /// state since session 39.
    fn new_state() -> mlx_lfm::Result<Array> {
        let words = mlx_lfm::kernels::moe_fused::state_words(EXPERT_D as usize, EXPERT_F as usize, EXPERTS_A_ROW as usize);
        mlx_lfm::kernels::stages::new_counters_of(words)
    }

    /// One selection bias `[E]` a set of [`EXPERTS_A_ROW`] experts, as
    /// [`Experts::sets`] takes them in turn: +8 on the set's experts, 0
    /// elsewhere (a routing probability is at most 1, so the set is chosen
    /// whatever the row). A chained launch's row is the launch before's
    /// output, which would choose whatever experts it happened to; with
    /// these, launch `i` reads set `i % 8`, and none finds its experts'
    /// rows in L2 from the launch before (the 8B-A1B's 4 experts are ~22
    /// MB, within the H100's L2; a step's layers never share them).
    fn set_biases() -> mlx_lfm::Result<Vec<Array>> {
        let biases = (0..EXPERTS / EXPERTS_A_ROW)
            .map(|s| {
                let v: Vec<f32> = (0..EXPERTS).map(|e| if e / EXPERTS_A_ROW == s { 8.0 } else { 0.0 }).collect();
                Array::from_slice(&v, &[EXPERTS])
            })
            .collect::<mlx_lfm::Result<Vec<_>>>()?;
        mlx::eval(&biases.iter().collect::<Vec<_>>())?;
        Ok(biases)
    }

    /// The bytes a launch reads: its experts' gate/up and down rows with
    /// their scales and biases, and the router's gate.
    fn launch_bytes(&self) -> usize {
        use mlx_lfm::model::linear::Quantized;
        let qb = |q: &Quantized| q.weight.nbytes() + q.scales.nbytes() + q.biases.as_ref().map_or(0, |b| b.nbytes());
        let per_expert = (qb(&self.experts.gate_up) + qb(&self.experts.down)) / EXPERTS as usize;
        EXPERTS_A_ROW as usize * per_expert + qb(&self.gate)
    }

    /// The one-launch layer over row `h` (chained: the launch before's
    /// output) with selection bias `bias` ([`Layer::set_biases`]), on
    /// `state`; with `timeline`, through the kernel's timeline form (its
    /// stamps and the gate/up blocks' and all blocks' counts, as
    /// `moe_fused::forward_timeline` gives them).
    fn chained(&self, h: &Array, bias: &Array, state: &Array, timeline: bool) -> mlx_lfm::Result<(Array, Option<Stamps>)> {
        use mlx_lfm::kernels::{moe_fused, norm_gemv::NormIn};
        let n = NormIn { h, r: &self.r, wn: &self.wn, eps: &self.eps, eps_value: Some(LAYER_EPS) };
        let (g, gu, down) = (&self.gate, &self.experts.gate_up, &self.experts.down);
        let k = EXPERTS_A_ROW as usize;
        if !moe_fused::available(&n, g, gu, down, k) {
            return Err(mlx_lfm::Error::invalid("kernel-bench: the one-launch MoE kernel does not serve the layer's operands"));
        }
        if timeline {
            let (out, times, gate_up, nb) = moe_fused::forward_timeline(&n, g, bias, gu, down, state, k, true, LAYER_EPS, 1.0)?;
            return Ok((out, Some((times, gate_up, nb))));
        }
        Ok((moe_fused::forward(&n, g, bias, gu, down, state, k, true, LAYER_EPS, 1.0)?.1, None))
    }

    /// The layer's output for launch `i`'s row, as the arm's switches say,
    /// the one-launch form on `state` (the arm's: [`Layer::new_state`]).
    fn launch(&self, fused: bool, state: &Array, i: usize) -> mlx_lfm::Result<Array> {
        use mlx_lfm::kernels::{moe_experts, moe_fused, moe_router, norm_gemv::NormIn};
        let n = NormIn { h: &self.hs[i % self.hs.len()], r: &self.r, wn: &self.wn, eps: &self.eps, eps_value: Some(LAYER_EPS) };
        let (g, gu, down) = (&self.gate, &self.experts.gate_up, &self.experts.down);
        let k = EXPERTS_A_ROW as usize;
        let unserved = || mlx_lfm::Error::invalid("kernel-bench: the MoE layer's kernels do not serve their operands here");
        if fused {
            if !moe_fused::available(&n, g, gu, down, k) {
                return Err(unserved());
            }
            return Ok(moe_fused::forward(&n, g, &self.bias, gu, down, state, k, true, LAYER_EPS, 1.0)?.1);
        }
        if !moe_router::gate_norm_available(&n, g, k) || !moe_experts::available(1, k, Dtype::Bfloat16, gu, down) {
            return Err(unserved());
        }
        let (_, y, idx, scores) = moe_router::route_gate_norm(&n, g, &self.bias, &self.scale, k, true, Some((LAYER_EPS, 1.0)))?;
        moe_experts::down(&moe_experts::gate_up(&y, &idx, gu)?, &idx, &scores, down)
    }
}

/// `--arms moe-layer-q4-timeline` (alone, without ncu): the 8B-A1B's
/// one-launch MoE layer through its timeline form
/// (src/kernels/stages.rs `TIMELINE_HEADER`): for each launch, when the
/// router's block ends, when the gate/up blocks start and end and when
/// the down blocks do, from the launch's first block, with each kind's
/// median wait, staging and work. Session 33's ncu had the launch at 40 µs
/// in the step (~0.6 TB/s of its ~25 MB), and one duration cannot say
/// whether the route, the blocks' waves or a stage's handoff takes it.
/// Before each launch a read of 160 MB evicts L2, so the experts come
/// from DRAM as a step's do. Each launch's output is checked against the
/// plain kernel's on the same row (the stamps change no sum). Each form of
/// the layer in turn (`form` in the records): as it ships, one output a
/// warp, in float32, with the down rows' prefetch, each two-outputs form
/// alone.
const TIMELINE_ARM: &str = "moe-layer-q4-timeline";

fn timeline(reps: usize) -> mlx_lfm::Result<()> {
    let layer = Layer::new()?;
    let scrub = scrub_rows()?;
    let switches = [
        ("MLX_LFM_MOE_FUSED".to_string(), Some("1".to_string())),
        ("MLX_LFM_EPS_CONST".to_string(), Some("1".to_string())),
    ];
    // The layer as it ships (its experts in MLX's walk since session 38,
    // two gate/up outputs and two down columns a warp since session 53),
    // and in one output and one column a warp, the form each other form
    // varies: in float32 as before, with its down rows asked of L2 by the
    // gate/up blocks before their rows and after them, and with one of the
    // two-outputs forms alone.
    let set_to = |var: &str, value: &str| (var.to_string(), Some(value.to_string()));
    let one = |var: &str| set_to(var, "1");
    let (rows, cols) = ("MLX_LFM_MOE_GATE_ROWS", "MLX_LFM_MOE_DOWN_COLS");
    for (form, vars) in [
        ("default", vec![set_to("MLX_LFM_MOE_DOWN_PREFETCH", "0"), set_to(rows, "2"), set_to(cols, "2")]),
        ("one-output", vec![one(rows), one(cols)]),
        ("float", vec![set_to("MLX_LFM_MOE_EXACT", "0"), one(rows), one(cols)]),
        ("down-prefetch", vec![set_to("MLX_LFM_MOE_DOWN_PREFETCH", "1"), one(rows), one(cols)]),
        ("down-prefetch-after", vec![set_to("MLX_LFM_MOE_DOWN_PREFETCH", "after"), one(rows), one(cols)]),
        ("gate-rows-2", vec![set_to(rows, "2"), one(cols)]),
        ("down-cols-2", vec![one(rows), set_to(cols, "2")]),
    ] {
        let mut set = switches.to_vec();
        set.extend(vars);
        mlx_lfm::knobs::with_overrides(&set, || timeline_of(&layer, &scrub, form, reps))?;
    }
    Ok(())
}

/// 160 MB of values read whole before each timed launch, so that L2 holds
/// none of the launch's weights (drawn, not `zeros`: MLX makes a constant
/// array a broadcast of one value, whose read touches one line).
fn scrub_rows() -> mlx_lfm::Result<Array> {
    let scrub = normal(&[1, 80 << 20], Dtype::Bfloat16, 0.0, 1.0, None)?;
    scrub.eval()?;
    Ok(scrub)
}

/// [`timeline`] of one form (`form` names it in the records).
fn timeline_of(layer: &Layer, scrub: &Array, form: &str, reps: usize) -> mlx_lfm::Result<()> {
    use mlx_lfm::kernels::{moe_fused, norm_gemv::NormIn};
    let (g, gu, down) = (&layer.gate, &layer.experts.gate_up, &layer.experts.down);
    let k = EXPERTS_A_ROW as usize;
    // (Each form's plain and timeline launches on states of their own: a
    // layer's state serves one form.)
    let (plain_state, timed_state) = (mlx_lfm::kernels::stages::new_counters()?, mlx_lfm::kernels::stages::new_counters()?);
    let row = |i: usize| NormIn { h: &layer.hs[i % layer.hs.len()], r: &layer.r, wn: &layer.wn, eps: &layer.eps, eps_value: Some(LAYER_EPS) };
    stamp_launches(
        ("moe_timeline", form, ["router", "gate_up", "down"]),
        reps.max(1) * LAYER_LAUNCHES,
        false,
        scrub,
        |i| {
            let n = row(i);
            if !moe_fused::available(&n, g, gu, down, k) {
                return Err(mlx_lfm::Error::invalid("kernel-bench: the one-launch MoE kernel does not serve the layer's operands"));
            }
            Ok(moe_fused::forward(&n, g, &layer.bias, gu, down, &plain_state, k, true, LAYER_EPS, 1.0)?.1)
        },
        |i| moe_fused::forward_timeline(&row(i), g, &layer.bias, gu, down, &timed_state, k, true, LAYER_EPS, 1.0),
    )
}

/// `launches` launches of a layer through its timeline form, each after a
/// plain launch of the same operands (`plain(i)`: its output is what the
/// stamped one must equal; the stamps change no sum), L2 evicted between
/// them unless `warm`: each launch's line and then the medians, printed
/// under `key` (`key`, `{key}_summary`), the parts named `parts` (the
/// first block's, the first stage's, the rest's). `timed(i)` gives the
/// output, the stamps, the first stage's blocks and the launch's.
fn stamp_launches(
    (key, form, parts): (&str, &str, [&str; 3]),
    launches: usize,
    warm: bool,
    scrub: &Array,
    mut plain: impl FnMut(usize) -> mlx_lfm::Result<Array>,
    mut timed: impl FnMut(usize) -> mlx_lfm::Result<(Array, Array, usize, usize)>,
) -> mlx_lfm::Result<()> {
    use mlx_lfm::kernels::stages::timeline_summary;
    let mut lines = Vec::new();
    for i in 0..launches {
        let want = plain(i)?;
        want.eval()?;
        if !warm {
            scrub.argmax(1, false)?.eval()?;
        }
        let t = Instant::now();
        let (out, times, first, nb) = timed(i)?;
        mlx::eval(&[&out, &times])?;
        let wall = t.elapsed().as_secs_f64() * 1e6;
        let same = out.astype(Dtype::Float32)?.to_vec::<f32>()? == want.astype(Dtype::Float32)?.to_vec::<f32>()?;
        let times = times.to_vec::<i64>()?;
        let mut line = serde_json::json!({
            key: i,
            "form": form,
            "blocks": nb,
            "wall_us": wall,
            "same_as_plain": same,
        });
        for (part, (from, to)) in parts.iter().zip([(0, 1), (1, first + 1), (first + 1, nb)]) {
            line[*part] = timeline_summary(&times, from, to).into();
        }
        println!("{line}");
        lines.push(line);
    }
    let all_same = lines.iter().all(|l| l["same_as_plain"] == true);
    println!(
        "{}",
        serde_json::json!({format!("{key}_summary"): medians(&lines, &parts), "form": form, "launches": lines.len(), "all_same_as_plain": all_same})
    );
    Ok(())
}

/// `--arms conv-layer-timeline` (alone, without ncu): the 8B-A1B's 4-bit
/// and the 1.2B's dense one-launch conv layer through its timeline form,
/// by default and with its rows asked for before its waits
/// (`MLX_LFM_EARLY_PREFETCH=conv`): when the norm's block ends, when the
/// channels' blocks start and end, when out_proj's do (session 33's ncu:
/// the 8B-A1B's launch 25 µs for ~9.4 MB, every block resident). L2 is
/// evicted before each launch, but for the `-warm` forms (session 38),
/// whose launches read one copy of the weights, already in L2 from the
/// plain launch just before: how fast the layer runs where its weights
/// were asked for earlier, as a launch before it could. Each launch's
/// output is checked against the plain form's.
const CONV_TIMELINE_ARM: &str = "conv-layer-timeline";

fn conv_timeline(reps: usize) -> mlx_lfm::Result<()> {
    use mlx_lfm::kernels::conv_fused;
    use mlx_lfm::model::linear::Normed;
    let conv = ConvLayer::new()?;
    let scrub = scrub_rows()?;
    for (form, quant, early, warm) in [
        ("q4", true, "", false),
        ("q4-early", true, "conv", false),
        ("q4-warm", true, "", true),
        ("bf16", false, "", false),
        ("bf16-early", false, "conv", false),
        ("bf16-warm", false, "", true),
    ] {
        let switches = [
            ("MLX_LFM_CONV_FUSED".to_string(), Some("1".to_string())),
            ("MLX_LFM_EPS_CONST".to_string(), Some("1".to_string())),
            ("MLX_LFM_EARLY_PREFETCH".to_string(), Some(early.to_string())),
        ];
        mlx_lfm::knobs::with_overrides(&switches, || -> mlx_lfm::Result<()> {
            let (plain_ctr, timed_ctr) = (mlx_lfm::kernels::stages::new_counters()?, mlx_lfm::kernels::stages::new_counters()?);
            // (Warm: one copy, the plain launch just before having read it,
            // and no eviction: its weights in L2.)
            let projections = |i: usize| conv.projections(quant, if warm { 0 } else { i });
            let x = Normed { h: &conv.h, r: Some(&conv.r), w: &conv.wn, eps: LAYER_EPS, eps_array: &conv.eps };
            stamp_launches(
                ("conv_timeline", form, ["norm", "channels", "out_proj"]),
                reps.max(1) * CONV_LAUNCHES,
                warm,
                &scrub,
                |i| {
                    let p = projections(i);
                    if !conv_fused::available(&x, p, &conv.state, &conv.cw, false) {
                        return Err(mlx_lfm::Error::invalid("kernel-bench: the one-launch conv kernel does not serve the layer's operands"));
                    }
                    Ok(conv_fused::forward(&x, p, &conv.state, &conv.cw, &plain_ctr)?.1)
                },
                |i| {
                    let (out, _, times, channels, nb) = conv_fused::forward_timeline(&x, projections(i), &conv.state, &conv.cw, &timed_ctr)?;
                    Ok((out, times, channels, nb))
                },
            )
        })?;
    }
    Ok(())
}

/// `--arms ffn-layer-timeline` (alone, without ncu): the 1.2B's dense
/// one-launch feed-forward (2,048 wide, a gate of 8,192: ~100 MB, more
/// than L2 holds) and the 8B-A1B's 4-bit dense layers' (~25 MB), cold (L2
/// evicted before each launch) and, the 4-bit one, warm (one copy, already
/// in L2): when the norm's block ends, when the gate's blocks start and
/// end, when w2's do. The 1.2B's feed-forwards are most of its step (16
/// a token, ~47 µs each in kernel-bench on the H100, ~2.15 TB/s). Each
/// launch's output is checked against the plain form's.
const FFN_TIMELINE_ARM: &str = "ffn-layer-timeline";

fn ffn_timeline(reps: usize) -> mlx_lfm::Result<()> {
    use mlx_lfm::kernels::ffn_fused;
    use mlx_lfm::model::linear::Normed;
    let ffn = FfnLayer::new()?;
    let scrub = scrub_rows()?;
    let switches = [("MLX_LFM_FFN_FUSED".to_string(), Some("1".to_string())), ("MLX_LFM_EPS_CONST".to_string(), Some("1".to_string()))];
    for (form, q4, warm) in [("bf16", false, false), ("q4", true, false), ("q4-warm", true, true)] {
        mlx_lfm::knobs::with_overrides(&switches, || -> mlx_lfm::Result<()> {
            let (plain_ctr, timed_ctr) = (mlx_lfm::kernels::stages::new_counters()?, mlx_lfm::kernels::stages::new_counters()?);
            let projections = |i: usize| ffn.projections(q4, if warm { 0 } else { i });
            let x = Normed { h: &ffn.h, r: Some(&ffn.r), w: &ffn.wn, eps: LAYER_EPS, eps_array: &ffn.eps };
            stamp_launches(
                ("ffn_timeline", form, ["norm", "gate", "w2"]),
                reps.max(1) * FFN_LAUNCHES,
                warm,
                &scrub,
                |i| {
                    let p = projections(i);
                    if !ffn_fused::available(&x, p) {
                        return Err(mlx_lfm::Error::invalid("kernel-bench: the one-launch feed-forward kernel does not serve the layer's operands"));
                    }
                    Ok(ffn_fused::forward(&x, p, &plain_ctr)?.1)
                },
                |i| ffn_fused::forward_timeline(&x, projections(i), &timed_ctr),
            )
        })?;
    }
    Ok(())
}

/// `--arms layer-chains` (alone, without ncu): the one-launch layers as
/// a decode step runs them, back to back in one stream, each launch's row
/// the one before's output (the step's own dependence), against the stock
/// launches they replace and MLX's GEMV of the q/k/v rows. ncu times each
/// launch alone at its locked clocks after an idle gap, and the
/// kernel-bench arms read the q/k/v stage at ~19-20 µs however its 12.6 MB
/// were split (session 41, an H100), the conv layer ~10 and the
/// feed-forward ~13 µs over their bytes at 3 TB/s: a cost fixed a launch
/// (the norm's handoff, the waits) would be ~190 µs of the 1.2B's 1,335
/// µs step, an artifact of timing launches alone nothing. Each chain's
/// wall at two lengths, a launch's time the slope between them (the
/// eval's fixed host cost cancels; the host builds a launch in far less
/// than these layers' GPU time, which `floor-mul`, one multiply over the
/// row a launch, bounds). The 8B-A1B's one-launch MoE layer too (since
/// session 51: ~59% of that model's step, ~38 µs a launch in ncu's
/// profile of the step for its ~25 MB), each launch reading the next of
/// eight disjoint expert sets. Then the conv layer's, the feed-forward's,
/// the q/k/v stage's and the MoE layer's timeline forms in a chain: each launch's span from its first block's
/// start to its last block's end on the GPU's global timer, the gap to
/// the next launch's first block, and the parts' medians, launch 0 (an
/// idle GPU's) left out.
const CHAIN_ARM: &str = "layer-chains";
const CHAIN_LENGTHS: [usize; 2] = [8, 40];

type ChainStep<'a> = Box<dyn Fn(&Array, usize) -> mlx_lfm::Result<Array> + 'a>;

fn layer_chains(reps: usize) -> mlx_lfm::Result<()> {
    use mlx_lfm::model::linear::Quantized;
    let (conv, ffn, qkv) = (ConvLayer::new()?, FfnLayer::new()?, QkvLayer::new()?);
    let (moe, moe_biases) = (Layer::new()?, Layer::set_biases()?);
    let scrub = scrub_rows()?;
    let qkv_states = [QkvLayer::state()?, QkvLayer::state()?];
    let qb = |q: &Quantized| q.weight.nbytes() + q.scales.nbytes() + q.biases.as_ref().map_or(0, |b| b.nbytes());
    let (conv_q4, conv_bf16) = (qb(&conv.projections[0].0) + qb(&conv.projections[0].1), conv.dense[0].0.nbytes() + conv.dense[0].1.nbytes());
    let (ffn_q4, ffn_bf16) = (qb(&ffn.quant[0].0) + qb(&ffn.quant[0].1), ffn.weights[0].0.nbytes() + ffn.weights[0].1.nbytes());
    let (qkv_q4, qkv_bf16) = (qb(&qkv.quant[0]), qkv.dense[0].nbytes());
    let switches_of = |arms: &[(&'static str, Switches, usize)], name: &str| arms.iter().find(|(n, ..)| *n == name).map_or(&[][..], |a| a.1);
    // The MoE layer's chain in the arm's form, on a state of its own (a
    // form's launches count their own tickets); the row is the conv
    // layer's width, and each launch reads the next of eight disjoint
    // expert sets (`Layer::set_biases`).
    let moe_chain = |name: &'static str| -> mlx_lfm::Result<(&'static str, Switches, usize, ChainStep)> {
        let state = Layer::new_state()?;
        let (moe, biases) = (&moe, &moe_biases);
        let step: ChainStep = Box::new(move |h: &Array, i| Ok(moe.chained(h, &biases[i % biases.len()], &state, false)?.0));
        Ok((name, switches_of(&LAYER_ARMS, name), moe.launch_bytes(), step))
    };
    let qkv_switches = |name: &str| QKV_ARMS.iter().find(|(n, _)| *n == name).map_or(&[][..], |a| a.1);
    let row = |a: Array| a.reshape(&[1, QKV_D]);
    let forms: Vec<(&str, Switches, usize, ChainStep)> = vec![
        ("floor-mul", &[], 2 * conv.h.nbytes(), Box::new(|h: &Array, _| h.mul_scalar(1.0))),
        (
            "gemv-bf16-qkv-rows",
            &[],
            qkv_bf16,
            Box::new(|h: &Array, i| h.matmul(&qkv.dense[i % qkv.dense.len()].t()?)?.slice_axis(1, 0, QKV_D)),
        ),
        ("qkv-bf16-fused", qkv_switches("qkv-bf16-fused"), qkv_bf16, Box::new(|h: &Array, i| row(qkv.launch_on(h, false, &qkv_states[0], i)?))),
        ("qkv-q4-fused", qkv_switches("qkv-q4-fused"), qkv_q4, Box::new(|h: &Array, i| row(qkv.launch_on(h, true, &qkv_states[1], i)?))),
        ("conv-layer-bf16-four", switches_of(&CONV_ARMS, "conv-layer-bf16-four"), conv_bf16, Box::new(|h: &Array, i| conv.launch_on(h, false, false, i))),
        ("conv-layer-bf16-fused", switches_of(&CONV_ARMS, "conv-layer-bf16-fused"), conv_bf16, Box::new(|h: &Array, i| conv.launch_on(h, true, false, i))),
        ("conv-layer-q4-four", switches_of(&CONV_ARMS, "conv-layer-q4-four"), conv_q4, Box::new(|h: &Array, i| conv.launch_on(h, false, true, i))),
        ("conv-layer-q4-fused", switches_of(&CONV_ARMS, "conv-layer-q4-fused"), conv_q4, Box::new(|h: &Array, i| conv.launch_on(h, true, true, i))),
        ("ffn-layer-bf16-three", switches_of(&FFN_ARMS, "ffn-layer-bf16-three"), ffn_bf16, Box::new(|h: &Array, i| ffn.launch_on(h, false, false, false, i))),
        ("ffn-layer-bf16-fused", switches_of(&FFN_ARMS, "ffn-layer-bf16-fused"), ffn_bf16, Box::new(|h: &Array, i| ffn.launch_on(h, true, false, false, i))),
        ("ffn-layer-bf16-fused-g2", switches_of(&FFN_ARMS, "ffn-layer-bf16-fused-g2"), ffn_bf16, Box::new(|h: &Array, i| ffn.launch_on(h, true, false, true, i))),
        ("ffn-layer-q4-four", switches_of(&FFN_ARMS, "ffn-layer-q4-four"), ffn_q4, Box::new(|h: &Array, i| ffn.launch_on(h, false, true, false, i))),
        ("ffn-layer-q4-fused", switches_of(&FFN_ARMS, "ffn-layer-q4-fused"), ffn_q4, Box::new(|h: &Array, i| ffn.launch_on(h, true, true, false, i))),
        moe_chain("moe-layer-q4-fused")?,
        moe_chain("moe-layer-q4-g2-fused")?,
        moe_chain("moe-layer-q4-g2d2-fused")?,
    ];
    let start = conv.h.clone();
    for (name, switches, bytes, step) in &forms {
        let overrides: mlx_lfm::knobs::Overrides = switches.iter().map(|(k, v)| (k.to_string(), Some(v.to_string()))).collect();
        let done = mlx_lfm::knobs::with_overrides(&overrides, || -> mlx_lfm::Result<serde_json::Value> {
            let mut walls = [vec![], vec![]];
            // (Rep 0 warms up: NVRTC's compile, MLX's graph caches.)
            for rep in 0..=reps.max(3) {
                for (w, len) in walls.iter_mut().zip(CHAIN_LENGTHS) {
                    scrub.argmax(1, false)?.eval()?;
                    let t = Instant::now();
                    let mut h = start.clone();
                    for i in 0..len {
                        h = step(&h, i)?;
                    }
                    h.eval()?;
                    if rep > 0 {
                        w.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                }
            }
            let med = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (a, b) = (med(&mut walls[0]), med(&mut walls[1]));
            let launch = (b - a) / (CHAIN_LENGTHS[1] - CHAIN_LENGTHS[0]) as f64;
            Ok(serde_json::json!({
                "layer_chain": name,
                "lengths": CHAIN_LENGTHS,
                "wall_us_median": [a, b],
                "launch_us": launch,
                "bytes": bytes,
                "tb_s": *bytes as f64 / launch / 1e6,
                "chains_a_length": walls[0].len(),
            }))
        });
        match done {
            Ok(line) => println!("{line}"),
            Err(e) => println!("{}", serde_json::json!({"layer_chain": name, "error": e.to_string()})),
        }
    }
    chain_timelines(&conv, &ffn, &qkv, (&moe, &moe_biases), [conv_q4, conv_bf16, ffn_bf16, ffn_q4, qkv_bf16, qkv_q4, moe.launch_bytes()], reps)
}

/// [`layer_chains`]' timeline chains: the conv layer's (4-bit, dense), the
/// feed-forward's (dense, 4-bit; and the dense one with two gate outputs
/// a warp, `MLX_LFM_FFN_GATE_ROWS=2`, and in two rounds,
/// `MLX_LFM_FFN_GATE_ROUNDS=2`, plain and with its rows asked for early, and
/// in four), the q/k/v stage's (dense, 4-bit: one block a head) and the
/// 8B-A1B's MoE layer's (as it ships: it has no every-norm form; each
/// launch the next of eight disjoint expert sets, [`Layer::set_biases`])
/// timeline forms, `CHAIN_LENGTHS[1]` launches a chain, `reps` chains
/// each, each form on a state of its own. `bytes`: the conv layer's 4-bit
/// and dense, the feed-forward's dense and 4-bit, the q/k/v stage's dense
/// and 4-bit, the MoE layer's. (Session 35's timelines of the MoE layer,
/// each launch after an idle wait, ran at idle clocks and were not read:
/// in a chain its stages' times are a step's.)
fn chain_timelines(
    conv: &ConvLayer,
    ffn: &FfnLayer,
    qkv: &QkvLayer,
    (moe, moe_biases): (&Layer, &[Array]),
    bytes: [usize; 7],
    reps: usize,
) -> mlx_lfm::Result<()> {
    use mlx_lfm::kernels::{conv_fused, ffn_fused, qkv_fused, stages::timeline_summary};
    use mlx_lfm::model::linear::Normed;
    #[derive(Clone, Copy, PartialEq)]
    enum Kind {
        Conv,
        Ffn,
        Qkv,
        Moe,
    }
    let len = CHAIN_LENGTHS[1];
    // (form, layer, 4-bit, its gate outputs a warp (MLX_LFM_FFN_GATE_ROWS,
    // or the MoE layer's MLX_LFM_MOE_GATE_ROWS), MLX_LFM_FFN_GATE_ROUNDS,
    // rows asked for early, `bytes`' index, the MoE layer's down columns a
    // warp (MLX_LFM_MOE_DOWN_COLS))
    let forms = [
        ("conv-q4", Kind::Conv, true, "1", "0", false, 0, "1"),
        ("conv-bf16", Kind::Conv, false, "1", "0", false, 1, "1"),
        ("ffn-bf16", Kind::Ffn, false, "1", "0", false, 2, "1"),
        ("ffn-q4", Kind::Ffn, true, "1", "0", false, 3, "1"),
        ("ffn-bf16-g2", Kind::Ffn, false, "2", "0", false, 2, "1"),
        ("ffn-bf16-g2r", Kind::Ffn, false, "2", "2", false, 2, "1"),
        ("ffn-bf16-g2r-early", Kind::Ffn, false, "2", "2", true, 2, "1"),
        ("ffn-bf16-r4", Kind::Ffn, false, "1", "4", false, 2, "1"),
        ("qkv-bf16", Kind::Qkv, false, "1", "0", false, 4, "1"),
        ("qkv-q4", Kind::Qkv, true, "1", "0", false, 5, "1"),
        ("moe-q4", Kind::Moe, true, "1", "0", false, 6, "1"),
        ("moe-q4-g2", Kind::Moe, true, "2", "0", false, 6, "1"),
        ("moe-q4-g2d2", Kind::Moe, true, "2", "0", false, 6, "2"),
    ];
    for (form, kind, q4, rows, rounds, early, k, cols) in forms {
        let on = match kind {
            Kind::Conv => "MLX_LFM_CONV_FUSED",
            Kind::Ffn => "MLX_LFM_FFN_FUSED",
            Kind::Qkv => "MLX_LFM_QKV_FUSED",
            Kind::Moe => "MLX_LFM_MOE_FUSED",
        };
        let switches: mlx_lfm::knobs::Overrides = [
            (on.to_string(), Some("1".to_string())),
            ("MLX_LFM_EPS_CONST".to_string(), Some("1".to_string())),
            ("MLX_LFM_EARLY_PREFETCH".to_string(), Some((if early { "ffn" } else { "" }).to_string())),
            ("MLX_LFM_FFN_GATE_ROWS".to_string(), Some((if kind == Kind::Ffn { rows } else { "1" }).to_string())),
            ("MLX_LFM_MOE_GATE_ROWS".to_string(), Some((if kind == Kind::Moe { rows } else { "1" }).to_string())),
            ("MLX_LFM_MOE_DOWN_COLS".to_string(), Some(cols.to_string())),
            ("MLX_LFM_FFN_GATE_ROUNDS".to_string(), Some(rounds.to_string())),
            ("MLX_LFM_QKV_WARPS".to_string(), Some("16".to_string())),
        ]
        .to_vec();
        let parts = match kind {
            Kind::Conv => ["norm", "channels", "out_proj"],
            Kind::Ffn => ["norm", "gate", "w2"],
            Kind::Qkv => ["norm", "heads", "none"],
            Kind::Moe => ["router", "gate_up", "down"],
        };
        let done = mlx_lfm::knobs::with_overrides(&switches, || -> mlx_lfm::Result<serde_json::Value> {
            let ctr = match kind {
                Kind::Conv => mlx_lfm::kernels::stages::new_counters_of(conv_fused::state_words(CONV_D as usize, CONV_D as usize))?,
                Kind::Ffn => mlx_lfm::kernels::stages::new_counters_of(ffn_fused::state_words(FFN_D as usize, FFN_F.max(FFN_Q4_F) as usize))?,
                Kind::Qkv => QkvLayer::state()?,
                Kind::Moe => Layer::new_state()?,
            };
            let (mut spans, mut gaps, mut lines) = (vec![], vec![], vec![]);
            for _ in 0..reps.max(1) {
                let mut h = conv.h.clone();
                let mut stamps = vec![];
                for i in 0..len {
                    let (r, wn, eps) = match kind {
                        Kind::Conv => (&conv.r, &conv.wn, &conv.eps),
                        Kind::Ffn => (&ffn.r, &ffn.wn, &ffn.eps),
                        Kind::Qkv => (&qkv.r, &qkv.wn, &qkv.eps),
                        Kind::Moe => (&moe.r, &moe.wn, &moe.eps),
                    };
                    let x = Normed { h: &h, r: Some(r), w: wn, eps: LAYER_EPS, eps_array: eps };
                    let unserved = || mlx_lfm::Error::invalid(format!("kernel-bench: the {form} timeline's kernel does not serve its operands"));
                    let (out, times, first, nb) = match kind {
                        Kind::Conv => {
                            let p = conv.projections(q4, i);
                            if !conv_fused::available(&x, p, &conv.state, &conv.cw, false) {
                                return Err(unserved());
                            }
                            let (out, _, times, channels, nb) = conv_fused::forward_timeline(&x, p, &conv.state, &conv.cw, &ctr)?;
                            (out, times, channels, nb)
                        }
                        Kind::Ffn => {
                            let p = ffn.projections(q4, i);
                            if !ffn_fused::available(&x, p) {
                                return Err(unserved());
                            }
                            ffn_fused::forward_timeline(&x, p, &ctr)?
                        }
                        Kind::Qkv => {
                            let p = qkv.projection(q4, i);
                            if !qkv_fused::available(&x, p, &qkv.qw, &qkv.kw, QKV_HEADS, &qkv.offset) {
                                return Err(unserved());
                            }
                            let (q, times, nb) =
                                qkv_fused::forward_timeline(&x, p, &qkv.qw, &qkv.kw, QKV_HEADS, &qkv.offset, (1e-6, 1_000_000.0), &ctr)?;
                            (q.reshape(&[1, QKV_D])?, times, nb - 1, nb)
                        }
                        Kind::Moe => match moe.chained(&h, &moe_biases[i % moe_biases.len()], &ctr, true)? {
                            (out, Some((times, gate_up, nb))) => (out, times, gate_up, nb),
                            (_, None) => return Err(unserved()),
                        },
                    };
                    stamps.push((times, first, nb));
                    h = out;
                }
                let mut held: Vec<&Array> = stamps.iter().map(|(t, ..)| t).collect();
                held.push(&h);
                mlx::eval(&held)?;
                // (A stage whose wait gave up poisons its output with NaN,
                // and a poisoned MoE route reads no expert: such a chain's
                // times are not a layer's.)
                if h.astype(Dtype::Float32)?.to_vec::<f32>()?.iter().any(|v| !v.is_finite()) {
                    return Err(mlx_lfm::Error::invalid(format!("kernel-bench: the {form} chain's last output is not finite")));
                }
                let mut bounds = vec![];
                for (i, (times, first, nb)) in stamps.iter().enumerate() {
                    let t = times.to_vec::<i64>()?;
                    let start = t.iter().step_by(4).copied().min().unwrap_or(0);
                    let end = t.chunks_exact(4).map(|b| b[3]).max().unwrap_or(0);
                    bounds.push((start, end));
                    if i > 0 {
                        let mut line = serde_json::json!({});
                        for (part, (from, to)) in parts.iter().zip([(0, 1), (1, first + 1), (first + 1, *nb)]) {
                            line[*part] = timeline_summary(&t, from, to).into();
                        }
                        lines.push(line);
                    }
                }
                // (Launch 0 follows an idle GPU: its span is left out.)
                for w in bounds.windows(2) {
                    spans.push((w[1].1 - w[1].0) as f64 / 1000.0);
                    gaps.push((w[1].0 - w[0].1) as f64 / 1000.0);
                }
            }
            let med = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                (v.first().copied(), v.get(v.len() / 2).copied())
            };
            let ((span_min, span), (gap_min, gap)) = (med(spans.clone()), med(gaps.clone()));
            Ok(serde_json::json!({
                "layer_chain_timeline": form,
                "launches": spans.len(),
                "bytes": bytes[k],
                "span_us_median": span,
                "span_us_min": span_min,
                "gap_us_median": gap,
                "gap_us_min": gap_min,
                "tb_s_at_span": span.map(|s| bytes[k] as f64 / s / 1e6),
                "parts": medians(&lines, &parts),
            }))
        });
        match done {
            Ok(line) => println!("{line}"),
            Err(e) => println!("{}", serde_json::json!({"layer_chain_timeline": form, "error": e.to_string()})),
        }
    }
    Ok(())
}

/// The medians over a timeline's launches (`lines`) of each figure of
/// each of its `parts`.
fn medians(lines: &[serde_json::Value], parts: &[&str]) -> serde_json::Value {
    let mut summary = serde_json::Map::new();
    for part in parts {
        let mut fields = serde_json::Map::new();
        for f in ["first_start_us", "last_start_us", "last_end_us", "wait_us_median", "stage_us_median", "work_us_median"] {
            let mut v: Vec<f64> = lines.iter().filter_map(|l| l[*part][f].as_f64()).collect();
            v.sort_by(f64::total_cmp);
            if let Some(m) = v.get(v.len() / 2) {
                fields.insert(f.to_string(), (*m).into());
            }
        }
        summary.insert(part.to_string(), fields.into());
    }
    summary.into()
}

/// The 8B-A1B's short-conv layer for one decode row, from the residual's
/// add + RMSNorm through out_proj: the four launches the step runs by
/// default (the add + RMSNorm kernel, MLX's `qmv` of in_proj, the
/// short-conv kernel, MLX's `qmv` of out_proj) against the one of
/// src/kernels/conv_fused.rs. `(arm, its switches, kernels a product)`.
/// Launches cycle through [`CONV_COPIES`] copies of the projections
/// (~75 MB, over the H200's L2), so each reads its weights from DRAM.
/// The `-bf16-` arms: the 1.2B's layer, its projections dense (MLX's GEMV).
/// The `-early` arms: the one launch with its rows asked of L2 before its
/// waits (`MLX_LFM_EARLY_PREFETCH`, src/kernels/stages.rs `early_prefetch`);
/// (Session 40's `-out` arms, out_proj asked of L2 by the channel
/// blocks, read no faster in session 41 and are retired with their switch.)
/// The `-every-norm` arms: in_proj's blocks each computing the norm
/// (`MLX_LFM_CONV_EVERY_NORM`, session 48, the CUDA default since session
/// 50), against `-fused` (the waiting form, `=0`, as the `-early` arms).
const CONV_ARMS: [(&str, Switches, usize); 8] = [
    ("conv-layer-q4-four", &[("MLX_LFM_CONV_FUSED", "0"), ("MLX_LFM_EPS_CONST", "1")], 4),
    ("conv-layer-q4-fused", &[("MLX_LFM_CONV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_CONV_EVERY_NORM", "0")], 1),
    ("conv-layer-q4-fused-early", &[("MLX_LFM_CONV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_EARLY_PREFETCH", "conv"), ("MLX_LFM_CONV_EVERY_NORM", "0")], 1),
    ("conv-layer-bf16-four", &[("MLX_LFM_CONV_FUSED", "0"), ("MLX_LFM_EPS_CONST", "1")], 4),
    ("conv-layer-bf16-fused", &[("MLX_LFM_CONV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_CONV_EVERY_NORM", "0")], 1),
    ("conv-layer-bf16-fused-early", &[("MLX_LFM_CONV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_EARLY_PREFETCH", "conv"), ("MLX_LFM_CONV_EVERY_NORM", "0")], 1),
    ("conv-layer-q4-fused-every-norm", &[("MLX_LFM_CONV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_CONV_EVERY_NORM", "1")], 1),
    ("conv-layer-bf16-fused-every-norm", &[("MLX_LFM_CONV_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_CONV_EVERY_NORM", "1")], 1),
];
const CONV_COPIES: usize = 8;
/// Dense copies (~33 MB each: three are over the L2 too).
const CONV_DENSE_COPIES: usize = 3;
const CONV_LAUNCHES: usize = 16;
const CONV_D: i32 = 2048;
const CONV_WINDOW: i32 = 3;

struct ConvLayer {
    /// in_proj `[3D, D]` and out_proj `[D, D]`, each copy.
    projections: Vec<(mlx_lfm::model::linear::Quantized, mlx_lfm::model::linear::Quantized)>,
    dense: Vec<(Array, Array)>,
    h: Array,
    r: Array,
    wn: Array,
    eps: Array,
    state: Array,
    cw: Array,
    counters: Array,
}

impl ConvLayer {
    fn new() -> mlx_lfm::Result<ConvLayer> {
        let bf = Dtype::Bfloat16;
        let quant = |rows: i32| q4_random(&[rows, CONV_D], 1.0 / (CONV_D as f32).sqrt());
        let projections = (0..CONV_COPIES).map(|_| Ok((quant(3 * CONV_D)?, quant(CONV_D)?))).collect::<mlx_lfm::Result<Vec<_>>>()?;
        let scale = 1.0 / (CONV_D as f32).sqrt();
        let dense = (0..CONV_DENSE_COPIES)
            .map(|_| Ok((normal(&[3 * CONV_D, CONV_D], bf, 0.0, scale, None)?, normal(&[CONV_D, CONV_D], bf, 0.0, scale, None)?)))
            .collect::<mlx_lfm::Result<Vec<_>>>()?;
        let h = normal(&[1, CONV_D], bf, 0.0, 4.0, None)?;
        let r = normal(&[1, CONV_D], bf, 0.0, 1.0, None)?;
        let wn = normal(&[CONV_D], Dtype::Float32, 1.0, 0.2, None)?.astype(bf)?;
        let eps = Array::from_slice(&[LAYER_EPS], &[1])?;
        let state = normal(&[1, CONV_WINDOW - 1, CONV_D], bf, 0.0, 1.0, None)?;
        let cw = normal(&[CONV_D, CONV_WINDOW], bf, 0.0, 0.5, None)?;
        // (With room for the scratch rows, as the model's layers are made.)
        let counters = mlx_lfm::kernels::stages::new_counters_of(mlx_lfm::kernels::conv_fused::state_words(CONV_D as usize, CONV_D as usize))?;
        let mut held: Vec<&Array> = vec![&h, &r, &wn, &eps, &state, &cw];
        for (i, o) in &projections {
            held.extend([&i.weight, &i.scales, &o.weight, &o.scales]);
            held.extend(i.biases.iter().chain(o.biases.iter()));
        }
        held.extend(dense.iter().flat_map(|(i, o)| [i, o]));
        mlx::eval(&held)?;
        Ok(ConvLayer { projections, dense, h, r, wn, eps, state, cw, counters })
    }

    /// Copy `i` (in turn) of the quantized or the dense projections.
    fn projections(&self, quant: bool, i: usize) -> mlx_lfm::kernels::conv_fused::Projections<'_> {
        use mlx_lfm::kernels::conv_fused::Projections;
        if quant {
            let (wi, wo) = &self.projections[i % self.projections.len()];
            Projections::Quant(wi, wo)
        } else {
            let (wi, wo) = &self.dense[i % self.dense.len()];
            Projections::Dense(wi, wo)
        }
    }

    /// The layer's output for launch `i` (copy `i` of the quantized or the
    /// dense projections, in turn).
    fn launch(&self, fused: bool, quant: bool, i: usize) -> mlx_lfm::Result<Array> {
        self.launch_on(&self.h, fused, quant, i)
    }

    /// [`ConvLayer::launch`] on the row `h` (a chain's previous output).
    fn launch_on(&self, h: &Array, fused: bool, quant: bool, i: usize) -> mlx_lfm::Result<Array> {
        use mlx_lfm::kernels::{add_rms_norm, conv_fused, short_conv};
        use mlx_lfm::model::linear::Normed;
        let p = self.projections(quant, i);
        let x = Normed { h, r: Some(&self.r), w: &self.wn, eps: LAYER_EPS, eps_array: &self.eps };
        let unserved = || mlx_lfm::Error::invalid("kernel-bench: the conv layer's kernels do not serve their operands here");
        if fused {
            if !conv_fused::available(&x, p, &self.state, &self.cw, false) {
                return Err(unserved());
            }
            return Ok(conv_fused::forward(&x, p, &self.state, &self.cw, &self.counters)?.1);
        }
        let product = |a: &Array, which: usize| match p {
            conv_fused::Projections::Quant(wi, wo) => {
                let q = if which == 0 { wi } else { wo };
                mlx::quantized_matmul(a, &q.weight, &q.scales, q.biases.as_ref(), true, q.spec)
            }
            conv_fused::Projections::Dense(wi, wo) => a.matmul(&(if which == 0 { wi } else { wo }).transpose(&[1, 0])?),
        };
        let (_, y) = add_rms_norm::add_rms_norm_with(h, &self.r, &self.wn, &self.eps, LAYER_EPS)?;
        let bcx = product(&y, 0)?;
        if !short_conv::available(&bcx, &self.state, &self.cw, false) {
            return Err(unserved());
        }
        let (_, yc) = short_conv::conv_step(&bcx, &self.state, &self.cw)?;
        product(&yc, 1)
    }
}

/// The 1.2B's dense feed-forward for one decode row, from the residual's
/// add + RMSNorm through w2: the three launches the step runs by default
/// (the add + RMSNorm kernel, the SwiGLU GEMV, MLX's GEMV of w2) against
/// the one of src/kernels/ffn_fused.rs; the `-q4-` arms the 8B-A1B's two
/// dense layers (4-bit, group 64, a 7,168-wide gate): the four launches
/// (the add + RMSNorm kernel, MLX's `qmv` of w1/w3, the gate, `qmv` of w2)
/// against the one. `(arm, its switches, kernels a product)`. Launches
/// cycle through [`FFN_COPIES`] copies (~100 MB each dense, ~25 MB 4-bit,
/// of which [`FFN_Q4_COPIES`]: every launch reads its weights from DRAM).
/// (Session 40's `-w2` arms, w2 asked of L2 by the gate blocks, read 5-8
/// µs slower in session 41 and are retired with their switch.)
/// (Every fused arm with the gate's rounds off, `MLX_LFM_FFN_GATE_ROUNDS=0`:
/// the CUDA default since session 44 on the dense gate, which a counters
/// slot here would mix with these forms; `layer-chains`' `ffn-bf16-g2r`
/// times the rounds form.)
const FFN_ARMS: [(&str, Switches, usize); 11] = [
    ("ffn-layer-bf16-three", &[("MLX_LFM_FFN_FUSED", "0"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_GEMV_KERNEL", "1")], 3),
    ("ffn-layer-bf16-fused", &[("MLX_LFM_FFN_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_FFN_GATE_ROUNDS", "0"), ("MLX_LFM_FFN_EVERY_NORM", "0")], 1),
    (
        "ffn-layer-bf16-fused-early",
        &[("MLX_LFM_FFN_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_EARLY_PREFETCH", "ffn"), ("MLX_LFM_FFN_GATE_ROUNDS", "0"), ("MLX_LFM_FFN_EVERY_NORM", "0")],
        1,
    ),
    ("ffn-layer-q4-four", &[("MLX_LFM_FFN_FUSED", "0"), ("MLX_LFM_EPS_CONST", "1")], 4),
    ("ffn-layer-q4-fused", &[("MLX_LFM_FFN_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_FFN_EVERY_NORM", "0")], 1),
    ("ffn-layer-q4-fused-early", &[("MLX_LFM_FFN_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_EARLY_PREFETCH", "ffn"), ("MLX_LFM_FFN_EVERY_NORM", "0")], 1),
    (
        "ffn-layer-bf16-fused-g2",
        &[("MLX_LFM_FFN_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_FFN_GATE_ROWS", "2"), ("MLX_LFM_FFN_GATE_ROUNDS", "0"), ("MLX_LFM_FFN_EVERY_NORM", "0")],
        1,
    ),
    (
        "ffn-layer-bf16-fused-g2-early",
        &[
            ("MLX_LFM_FFN_FUSED", "1"),
            ("MLX_LFM_EPS_CONST", "1"),
            ("MLX_LFM_FFN_GATE_ROWS", "2"),
            ("MLX_LFM_EARLY_PREFETCH", "ffn"),
            ("MLX_LFM_FFN_GATE_ROUNDS", "0"),
            ("MLX_LFM_FFN_EVERY_NORM", "0"),
        ],
        1,
    ),
    ("ffn-layer-q4-fused-g2", &[("MLX_LFM_FFN_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_FFN_GATE_ROWS", "2"), ("MLX_LFM_FFN_EVERY_NORM", "0")], 1),
    // (The gate's blocks each computing the norm, MLX_LFM_FFN_EVERY_NORM,
    // session 48: against `-fused`, the same form otherwise.)
    (
        "ffn-layer-bf16-fused-every-norm",
        &[("MLX_LFM_FFN_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_FFN_GATE_ROUNDS", "0"), ("MLX_LFM_FFN_EVERY_NORM", "1")],
        1,
    ),
    ("ffn-layer-q4-fused-every-norm", &[("MLX_LFM_FFN_FUSED", "1"), ("MLX_LFM_EPS_CONST", "1"), ("MLX_LFM_FFN_EVERY_NORM", "1")], 1),
];
const FFN_COPIES: usize = 2;
const FFN_Q4_COPIES: usize = 4;
const FFN_LAUNCHES: usize = 8;
const FFN_D: i32 = 2048;
const FFN_F: i32 = 8192;
const FFN_Q4_F: i32 = 7168;

/// An arm's gate width.
fn ffn_width(arm: &str) -> i32 {
    if arm.contains("-q4-") {
        FFN_Q4_F
    } else {
        FFN_F
    }
}

struct FfnLayer {
    /// The stacked w1/w3 `[2F, D]` and w2 `[D, F]`, each copy, dense and
    /// 4-bit.
    weights: Vec<(Array, Array)>,
    quant: Vec<(mlx_lfm::model::linear::Quantized, mlx_lfm::model::linear::Quantized)>,
    h: Array,
    r: Array,
    wn: Array,
    eps: Array,
    /// The counters of each form, `[4-bit][two gate outputs a warp]`: a
    /// launch's tickets count its blocks (641 dense, 577 4-bit; 385 and
    /// 353 with `MLX_LFM_FFN_GATE_ROWS=2`), so launches of another count
    /// must not run on them.
    counters: [[Array; 2]; 2],
}

impl FfnLayer {
    fn new() -> mlx_lfm::Result<FfnLayer> {
        let bf = Dtype::Bfloat16;
        let weights = (0..FFN_COPIES)
            .map(|_| {
                Ok((
                    normal(&[2 * FFN_F, FFN_D], bf, 0.0, 1.0 / (FFN_D as f32).sqrt(), None)?,
                    normal(&[FFN_D, FFN_F], bf, 0.0, 1.0 / (FFN_F as f32).sqrt(), None)?,
                ))
            })
            .collect::<mlx_lfm::Result<Vec<_>>>()?;
        let quant = |rows: i32, cols: i32| q4_random(&[rows, cols], 1.0 / (cols as f32).sqrt());
        let quant = (0..FFN_Q4_COPIES)
            .map(|_| Ok((quant(2 * FFN_Q4_F, FFN_D)?, quant(FFN_D, FFN_Q4_F)?)))
            .collect::<mlx_lfm::Result<Vec<_>>>()?;
        let h = normal(&[1, FFN_D], bf, 0.0, 4.0, None)?;
        let r = normal(&[1, FFN_D], bf, 0.0, 1.0, None)?;
        let wn = normal(&[FFN_D], Dtype::Float32, 1.0, 0.2, None)?.astype(bf)?;
        let eps = Array::from_slice(&[LAYER_EPS], &[1])?;
        // (With room for the scratch rows of the wider of the two forms, as
        // the model's layers are made.)
        let words = mlx_lfm::kernels::ffn_fused::state_words(FFN_D as usize, FFN_F.max(FFN_Q4_F) as usize);
        let state = || mlx_lfm::kernels::stages::new_counters_of(words);
        let counters = [[state()?, state()?], [state()?, state()?]];
        let mut held: Vec<&Array> = weights.iter().flat_map(|(a, b)| [a, b]).collect();
        for (i, o) in &quant {
            held.extend([&i.weight, &i.scales, &o.weight, &o.scales]);
            held.extend(i.biases.iter().chain(o.biases.iter()));
        }
        held.extend([&h, &r, &wn, &eps]);
        mlx::eval(&held)?;
        Ok(FfnLayer { weights, quant, h, r, wn, eps, counters })
    }

    /// Copy `i` (in turn) of the dense or the 4-bit weights.
    fn projections(&self, q4: bool, i: usize) -> mlx_lfm::kernels::ffn_fused::Projections<'_> {
        use mlx_lfm::kernels::ffn_fused::Projections;
        if q4 {
            let (w13, w2) = &self.quant[i % self.quant.len()];
            Projections::Quant(w13, w2)
        } else {
            let (w13, w2) = &self.weights[i % self.weights.len()];
            Projections::Dense(w13, w2)
        }
    }

    /// The layer's output for launch `i` (copy `i` of the dense or the
    /// 4-bit weights, in turn). (`g2`: the two-gate-outputs-a-warp form's
    /// counters, which its switch must be set for.)
    fn launch(&self, fused: bool, q4: bool, g2: bool, i: usize) -> mlx_lfm::Result<Array> {
        self.launch_on(&self.h, fused, q4, g2, i)
    }

    /// [`FfnLayer::launch`] on the row `h` (a chain's previous output).
    fn launch_on(&self, h: &Array, fused: bool, q4: bool, g2: bool, i: usize) -> mlx_lfm::Result<Array> {
        use mlx_lfm::kernels::{add_rms_norm, ffn_fused, gemv};
        use mlx_lfm::model::linear::Normed;
        let p = self.projections(q4, i);
        let unserved = || mlx_lfm::Error::invalid("kernel-bench: the feed-forward's kernels do not serve their operands here");
        if fused {
            let x = Normed { h, r: Some(&self.r), w: &self.wn, eps: LAYER_EPS, eps_array: &self.eps };
            if !ffn_fused::available(&x, p) {
                return Err(unserved());
            }
            return Ok(ffn_fused::forward(&x, p, &self.counters[usize::from(q4)][usize::from(g2)])?.1);
        }
        let (_, y) = add_rms_norm::add_rms_norm_with(h, &self.r, &self.wn, &self.eps, LAYER_EPS)?;
        match p {
            ffn_fused::Projections::Dense(w13, w2) => {
                if !gemv::swiglu_available(&y, w13) {
                    return Err(unserved());
                }
                let gate = gemv::gemv_swiglu(&y, w13)?;
                // (MLX's GEMV for w2, as the step runs it: K = 8,192 is past
                // our GEMV's default width, whose switch this arm sets for
                // the SwiGLU.)
                gate.matmul(&w2.transpose(&[1, 0])?)
            }
            ffn_fused::Projections::Quant(w13, w2) => {
                // (MLX's qmv of the stacked w1/w3, the compiled gate on its
                // halves, qmv: the step's 4-bit layer before the one-launch
                // layer and our quantized GEMV became CUDA defaults.)
                let gu = mlx::quantized_matmul(&y, &w13.weight, &w13.scales, w13.biases.as_ref(), true, w13.spec)?;
                let halves = gu.split_equal(2, -1)?;
                let gate = mlx_lfm::model::activations::swiglu(&halves[0], &halves[1])?;
                mlx::quantized_matmul(&gate, &w2.weight, &w2.scales, w2.biases.as_ref(), true, w2.spec)
            }
        }
    }
}

/// The decode attention's variants on the 1.2B's shape (32 query heads, 8
/// KV heads of 64, a 1,024-position buffer filled to 550, bf16), a launch
/// (or, chunked, a part and a join) a product, so that ncu times each
/// alone: `(arm, its switches, kernels a product)`.
type Switches = &'static [(&'static str, &'static str)];

/// The 1.2B's norm and the projection after it, as the step runs them
/// (the add + RMSNorm kernel, then MLX's GEMV of the conv's in_proj, or
/// our SwiGLU GEMV of the stacked w1/w3: two launches a product) against
/// one fold of both: the prologue fold (each block's norm before its
/// weight loads; session 20 found it slower at K = 2048) and the deferred
/// one (src/kernels/norm_gemv.rs, `DEFERRED_HEADER`: no prologue, the norm's
/// scale applied to the sums). `(arm, its switches, launches a product,
/// whether the SwiGLU's stacked w1/w3)`.
/// (Each fold's switches pinned, eps compiled in as in the add + RMSNorm
/// kernel, so a picked or exported setting cannot swap one fold for the
/// other.)
const FOLD_ARMS: [(&str, Switches, usize, bool); 6] = [
    ("norm-then-gemv", &[], 2, false),
    ("fold-prologue", PROLOGUE_FOLD, 1, false),
    ("fold-deferred", DEFERRED_FOLD, 1, false),
    ("norm-then-swiglu", &[], 2, true),
    ("fold-prologue-swiglu", PROLOGUE_FOLD, 1, true),
    ("fold-deferred-swiglu", DEFERRED_FOLD, 1, true),
];
const PROLOGUE_FOLD: Switches =
    &[("MLX_LFM_NORM_GEMV_KERNEL", "1"), ("MLX_LFM_NORM_GEMV_DEFERRED", "0"), ("MLX_LFM_FOLD_EPS_CONST", "1")];
const DEFERRED_FOLD: Switches = &[("MLX_LFM_NORM_GEMV_KERNEL", "1"), ("MLX_LFM_NORM_GEMV_DEFERRED", "1")];
/// The in_proj `[6144, 2048]` and the stacked w1/w3 `[16384, 2048]`.
const FOLD_SHAPES: [(i32, i32); 2] = [(6144, 2048), (16384, 2048)];
const FOLD_EPS: f32 = 1e-5;

struct Folds {
    h: Array,
    r: Array,
    wn: Array,
    eps: Array,
    /// Per shape, the weights a product cycles through.
    weights: [Vec<Array>; 2],
}

impl Folds {
    fn new() -> mlx_lfm::Result<Folds> {
        let bf = Dtype::Bfloat16;
        let k = FOLD_SHAPES[0].1;
        let h = normal(&[1, k], bf, 0.0, 4.0, None)?;
        let r = normal(&[1, k], bf, 0.0, 1.0, None)?;
        let wn = normal(&[k], Dtype::Float32, 1.0, 0.2, None)?.astype(bf)?;
        let eps = Array::from_slice(&[FOLD_EPS], &[1])?;
        let make = |(n, k): (i32, i32)| -> mlx_lfm::Result<Vec<Array>> {
            let copies = CYCLE_BYTES.div_ceil(n as usize * k as usize * 2).clamp(1, 16);
            (0..copies).map(|_| normal(&[n, k], bf, 0.0, 1.0 / (k as f32).sqrt(), None)).collect()
        };
        let weights = [make(FOLD_SHAPES[0])?, make(FOLD_SHAPES[1])?];
        let mut held: Vec<&Array> = weights.iter().flatten().collect();
        held.extend([&h, &r, &wn, &eps]);
        mlx::eval(&held)?;
        Ok(Folds { h, r, wn, eps, weights })
    }

    fn shape(swiglu: bool) -> (i32, i32) {
        FOLD_SHAPES[usize::from(swiglu)]
    }

    fn launch(&self, arm: &str, swiglu: bool, i: usize) -> mlx_lfm::Result<Array> {
        use mlx_lfm::kernels::{add_rms_norm, gemv, norm_gemv};
        let ws = &self.weights[usize::from(swiglu)];
        let w = &ws[i % ws.len()];
        if arm.starts_with("norm-then") {
            let (_, y) = add_rms_norm::add_rms_norm_with(&self.h, &self.r, &self.wn, &self.eps, FOLD_EPS)?;
            return if swiglu { gemv::gemv_swiglu(&y, w) } else { y.matmul(&w.transpose(&[1, 0])?) };
        }
        let n = norm_gemv::NormIn { h: &self.h, r: &self.r, wn: &self.wn, eps: &self.eps, eps_value: Some(FOLD_EPS) };
        let unserved = || mlx_lfm::Error::invalid("the fold does not serve these operands here");
        let (_, y) = if swiglu {
            if !norm_gemv::swiglu_available(&n, w) {
                return Err(unserved());
            }
            norm_gemv::norm_gemv_swiglu(&n, w)?
        } else {
            if !norm_gemv::dense_available(&n, w) {
                return Err(unserved());
            }
            norm_gemv::norm_gemv(&n, w)?
        };
        Ok(y)
    }
}
const FOLD_LAUNCHES: usize = 16;
const ATT_ARMS: [(&str, Switches, usize); 6] = [
    ("att-default", &[], 1),
    ("att-smem", &[("MLX_LFM_DECODE_ATTENTION_SMEM", "1")], 1),
    ("att-split", &[("MLX_LFM_DECODE_ATTENTION_SPLIT", "1")], 1),
    ("att-chunks-8", &[("MLX_LFM_DECODE_ATTENTION_CHUNKS", "8")], 2),
    ("att-chunks-4", &[("MLX_LFM_DECODE_ATTENTION_CHUNKS", "4")], 2),
    ("att-wide", &[("MLX_LFM_DECODE_ATTENTION_WIDE", "1")], 1),
];
const ATT_POSITIONS: i32 = 550;
const ATT_HD: i32 = 64;
const ATT_LAUNCHES: usize = 20;

struct Attention {
    q: Array,
    k: Array,
    v: Array,
    upto: Array,
}

impl Attention {
    fn new() -> mlx_lfm::Result<Attention> {
        let bf = Dtype::Bfloat16;
        let q = normal(&[1, 32, 1, ATT_HD], bf, 0.0, 1.0, None)?;
        let k = normal(&[1, 8, 1024, ATT_HD], bf, 0.0, 1.0, None)?;
        let v = normal(&[1, 8, 1024, ATT_HD], bf, 0.0, 1.0, None)?;
        let upto = Array::scalar((ATT_POSITIONS - 1) as f64, Dtype::Int32)?;
        mlx::eval(&[&q, &k, &v, &upto])?;
        Ok(Attention { q, k, v, upto })
    }

    fn launch(&self) -> mlx_lfm::Result<Array> {
        let (q, k, v) = (&self.q, &self.k, &self.v);
        if !mlx_lfm::kernels::decode_attention::upto_available(q, k, v, &self.upto) {
            return Err(mlx_lfm::Error::invalid("kernel-bench: the decode attention kernel does not serve its operands"));
        }
        mlx_lfm::kernels::decode_attention::sdpa_upto(q, k, v, 1.0 / (ATT_HD as f32).sqrt(), &self.upto, true)
    }
}

/// `launches` products of `product(i)` under `switches` (this thread's
/// overrides), each evaluated at once: each one's wall time in µs, launch
/// and wait included, up to the first that failed, and its error.
fn timed(
    switches: &[(&str, &str)],
    launches: usize,
    mut product: impl FnMut(usize) -> mlx_lfm::Result<Array>,
) -> (Vec<f64>, Option<mlx_lfm::Error>) {
    let overrides: mlx_lfm::knobs::Overrides = switches.iter().map(|(k, v)| (k.to_string(), Some(v.to_string()))).collect();
    mlx_lfm::knobs::with_overrides(&overrides, || {
        let mut walls = Vec::with_capacity(launches);
        for i in 0..launches {
            let t = Instant::now();
            if let Err(e) = product(i).and_then(|y| mlx::eval(&[&y])) {
                return (walls, Some(e));
            }
            walls.push(t.elapsed().as_secs_f64() * 1e6);
        }
        (walls, None)
    })
}

/// One arm's line. An arm that failed says so with the products that
/// completed before it (`launches`), and the next arms still run: ncu's
/// list of kernels then departs from the plan from this arm on, which
/// `run.py` reads from the error (a failure used to end the process, and
/// with it every arm's figures).
fn print_walls(name: &str, n: i32, k: i32, (mut walls, error): (Vec<f64>, Option<mlx_lfm::Error>)) {
    let backend = mlx_lfm::mlx::runtime::backend().name();
    walls.sort_by(f64::total_cmp);
    let mut line = serde_json::json!({"kernel_bench": name, "n": n, "k": k, "launches": walls.len(), "backend": backend});
    if let (Some(median), Some(min)) = (walls.get(walls.len() / 2), walls.first()) {
        line["wall_us_median"] = (*median).into();
        line["wall_us_min"] = (*min).into();
    }
    if let Some(e) = error {
        line["error"] = e.to_string().into();
    }
    println!("{line}");
}

/// Where a kernel's scalar operand lives, and whether that costs the GPU:
/// MLX 0.32.4's CUDA allocator puts every array of at most 8 bytes, and
/// every array made from host data, in managed memory (a small pool of
/// pages the GPU maps, `cudaMemAdviseSetAccessedBy`), and a decode step's
/// kernels read such scalars (the position, made on the host each token;
/// the norms' eps, made once). The same small kernel (`y = x * s[0]` over
/// one row) with its scalar as a template constant, from a 16-byte array
/// the GPU wrote (device memory), from a 4-byte one it wrote (the pool),
/// from a 4-byte host array made once, from one made anew each launch,
/// and from the one made once right after the host wrote a new scalar into
/// the pool (a step's eps, beside the position the host writes each
/// token: the pool's pages, not its arrays, are what moves); and from a
/// one-element view into a longer array the GPU wrote, as a lone sequence's
/// decode position has been since session 28 (src/compiled/positions.rs).
const SCALAR_ARMS: [&str; 7] = [
    "scalar-const",
    "scalar-device16",
    "scalar-device4",
    "scalar-host-kept",
    "scalar-host-fresh",
    "scalar-kept-after-host-write",
    "scalar-table-view",
];
const SCALAR_N: i32 = 2048;
const SCALAR_LAUNCHES: usize = 20;

struct ScalarReads {
    read: mlx_lfm::mlx::kernel::CudaKernel,
    constant: mlx_lfm::mlx::kernel::CudaKernel,
    x: Array,
    device16: Array,
    device4: Array,
    kept: Array,
    view: Array,
}

impl ScalarReads {
    fn new() -> mlx_lfm::Result<ScalarReads> {
        use mlx_lfm::mlx::kernel::CudaKernel;
        let body = "const int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[0]) y[i] = x[i] * S;";
        let read = CudaKernel::new("lfm_bench_scale_read", &["x", "s"], &["y"], &body.replace("S;", "s[0];"), "")?;
        let constant = CudaKernel::new("lfm_bench_scale_const", &["x"], &["y"], &body.replace("S;", "1.5f;"), "")?;
        let x = normal(&[SCALAR_N], Dtype::Float32, 0.0, 1.0, None)?;
        let ones4 = mlx::full(&[4], 1.5, Dtype::Float32)?;
        let device16 = ones4.mul_scalar(1.0)?;
        let device4 = device16.slice_axis(0, 0, 1)?.add_scalar(0.0)?;
        let kept = Array::from_slice(&[1.5f32], &[1])?;
        let view = mlx::full(&[4096], 1.5, Dtype::Float32)?.mul_scalar(1.0)?.slice_axis(0, 517, 518)?.reshape(&[])?;
        mlx::eval(&[&x, &device16, &device4, &kept, &view])?;
        Ok(ScalarReads { read, constant, x, device16, device4, kept, view })
    }

    fn launch(&self, arm: &str) -> mlx_lfm::Result<Array> {
        let out = [(&[SCALAR_N][..], Dtype::Float32)];
        let (grid, block) = ([SCALAR_N, 1, 1], [256, 1, 1]);
        // (A new host scalar, written into the pool, for the two arms that
        // follow a host write; the others make none.)
        let fresh = match arm {
            "scalar-host-fresh" | "scalar-kept-after-host-write" => Some(Array::from_slice(&[1.5f32], &[1])?),
            _ => None,
        };
        let s = match (arm, &fresh) {
            ("scalar-const", _) => return Ok(self.constant.call(&[&self.x], &out, grid, block, &[])?.remove(0)),
            ("scalar-device16", _) => &self.device16,
            ("scalar-device4", _) => &self.device4,
            ("scalar-table-view", _) => &self.view,
            ("scalar-host-fresh", Some(f)) => f,
            _ => &self.kept,
        };
        Ok(self.read.call(&[&self.x, s], &out, grid, block, &[])?.remove(0))
    }
}
