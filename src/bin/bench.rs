//! mlx-lfm-bench: the engine without Node, for machines that have none (the
//! H200 box) and for profiling. Prints one JSON object per measurement.
//!
//!   mlx-lfm-bench [--model DIR | --preset P --dtype D [--quantize MODE:BITS:GROUP [--from DIR]] --out DIR]
//!                 [--device cpu|gpu]
//!                 [--prompts 512,4096] [--gen 256] [--paths compiled,eager] [--reps 3]
//!                 [--cache paged|flat] [--cold-first]
//!     each prompt length after an untimed pass at that length (its
//!     figures printed as `cold_prefill_tps` / `cold_ttft_ms`), as
//!     llama-bench warms up; `--cold-first` times that pass as the first rep
//!   mlx-lfm-bench --concurrent N [--prompts 128] [--gen 64] [--reps 2] [model args]
//!     aggregate tok/s of N requests run together (continuous batching)
//!     against the same N one after another, same run; with
//!     MLX_LFM_COUNT_STEP_NODES=1 also the nodes a stacked step hands MLX.
//!   mlx-lfm-bench --constrained [--gen 128] [--reps 3] [--batch 4] [model args]
//!     decode tok/s under a JSON schema and a regex (llguidance masks)
//!     against free sampling, same engine, same run: one request alone,
//!     then `--batch` requests together (each row its own mask); and, without
//!     the model, the parser work of `--batch` rows per step done one row
//!     after another against all rows at once (as a batch step does).
//!   mlx-lfm-bench --new-lengths N [--prompts 512] [model args]
//!   mlx-lfm-bench --step-ops [--prompts 16] [model args]   (the primitives of one compiled decode step)
//!   mlx-lfm-bench --prefill-ops [--prompts 512] [--cache paged|flat] [model args]
//!     the primitives a prompt hands MLX up to its first token (as the prefill figures run it)
//!     TTFT of N prompts of lengths never seen before (512, 513, ...) against
//!     the same N prompts' first length again (every shape seen): what a
//!     server pays per new prompt length for the backend's per-shape setup.
//!   mlx-lfm-bench --ab "NAME:MLX_LFM_X=1,MLX_LFM_Y=0;NAME2:..." [--prompts 512] [--gen 128] [--reps 6] [model args]
//!     the defaults (`all`) and each variant (its MLX_LFM_* switches set on
//!     this thread while it loads and runs) as engines of one process, run
//!     in alternation (the order rotated each rep): each rep's figure beside
//!     the defaults' of the same rep, so the host's drift over minutes
//!     (2x within one device call on 2026-12-03) falls out of the ratio.
//!   mlx-lfm-bench --host-profile HZ [the first form's args]
//!     the first form, with the host's CPU time sampled HZ times a second
//!     over the measured reps (a SIGPROF timer, Linux x86_64): the
//!     decoding thread's samples by function (nearest exported symbol) and
//!     by library, and the other threads' by library, as one JSON line.
//!   mlx-lfm-bench --dispatch-cost [--device gpu] [--reps 5]   (one row, and 16 rows for the products, adds and norms)
//!     no model: what one node of each kind costs the host (chains of 200
//!     adds, views, GEMVs, 4-bit GEMVs, RMSNorms and, on CUDA, custom
//!     kernels, alone, with 8 inputs and with 6 outputs, each built, handed
//!     to MLX and waited for; µs per node).
//!   mlx-lfm-bench --shape-cost [--device gpu] [--reps 8]
//!     no model: what a length never seen before costs one op of a
//!     prompt's pass (causal attention, the bf16 and 4-bit products, RMSNorm,
//!     at the 1.2B's widths): each timed with its wait at `--reps` new
//!     lengths (512, 513, ...), then as often at 512 again (ms each).
//!   mlx-lfm-bench --kernel-bench [--device gpu] [--reps 3] [--arms a,b]
//!     no model: the decode step's dense GEMV shapes one product a launch,
//!     MLX's GEMV and each walk of ours (for ncu to time each kernel
//!     alone: `bench/h200/run.py kernel-bench`); the plan in launch order,
//!     then each arm's wall time a product with its wait.
//!   mlx-lfm-bench --tensor-parallel N [--backend ring] [any of the above]
//!     the same measurement with the model split over N ranks: N local
//!     processes of this binary joined by MLX's `ring` backend over
//!     loopback (MLX_HOSTFILE / MLX_RANK, as mlx.launch sets them); rank 0
//!     prints. N = 1 is the plain single process.
//!   mlx-lfm-bench --turns N [--system 1024] [--user 64] [--reply 64] [model args]
//!     a token-level conversation: a system prompt, then N turns of user
//!     tokens and a greedy reply; per turn the TTFT of a warm paged engine
//!     (the conversation so far is in its prefix cache), a cold one (prefix
//!     cache cleared before the turn) and a flat one.
//!   mlx-lfm-bench --disk-admission [--prompts 4096] [--block 16] [--reps 3] [model args]
//!     a request decoding while another, whose prompt's blocks are all in
//!     the prefix cache's disk tier, is admitted: the running request's
//!     longest gap between tokens meanwhile, and the arrival's wall time.
//!     `inline`: the scheduler stepped directly, the blocks read at
//!     admission on the stepping thread (what the worker did before);
//!     `worker`: through the model worker, read ahead off it.

#[path = "bench/host_profile.rs"]
mod host_profile;
#[path = "bench/kernel_bench.rs"]
mod kernel_bench;

use mlx_lfm::engine::{DecodePath, Engine, EngineOptions, Prompt};
use mlx_lfm::generate::{GenerateParams, NoObserver};
use mlx_lfm::mlx::runtime;
use std::path::PathBuf;
use std::time::Instant;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("mlx-lfm-bench: {e}");
        std::process::exit(1);
    }
}

/// Every flag and whether it takes a value: anything else is refused (a
/// mistyped flag used to run the default benchmark, minutes of it).
const FLAGS: &[(&str, bool)] = &[
    ("--model", true),
    ("--preset", true),
    ("--dtype", true),
    ("--quantize", true),
    ("--from", true),
    ("--out", true),
    ("--device", true),
    ("--prompts", true),
    ("--gen", true),
    ("--paths", true),
    ("--reps", true),
    ("--cache", true),
    ("--concurrent", true),
    ("--constrained", false),
    ("--batch", true),
    ("--new-lengths", true),
    ("--step-ops", false),
    ("--prefill-ops", false),
    ("--dispatch-cost", false),
    ("--kernel-bench", false),
    ("--arms", true),
    ("--tensor-parallel", true),
    ("--backend", true),
    ("--turns", true),
    ("--system", true),
    ("--user", true),
    ("--reply", true),
    ("--disk-admission", false),
    ("--block", true),
    ("--ab", true),
    ("--host-profile", true),
    ("--cold-first", false),
    ("--shape-cost", false),
];

/// The usage (this file's opening comment), for `--help`.
fn usage() -> String {
    include_str!("bench.rs").lines().take_while(|l| l.starts_with("//!")).map(|l| l.strip_prefix("//! ").unwrap_or(l.trim_start_matches("//!"))).collect::<Vec<_>>().join("\n")
}

/// `Ok(false)` after printing the usage for `--help`; an error naming an
/// unknown flag or one missing its value.
fn check_flags(args: &[String]) -> mlx_lfm::Result<bool> {
    let mut i = 1;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "--help" || a == "-h" {
            println!("{}", usage());
            return Ok(false);
        }
        match FLAGS.iter().find(|(name, _)| *name == a) {
            Some((_, true)) if i + 1 >= args.len() => return Err(mlx_lfm::Error::invalid(format!("{a} takes a value"))),
            Some((_, takes)) => i += if *takes { 2 } else { 1 },
            None => return Err(mlx_lfm::Error::invalid(format!("unknown argument {a:?} (--help lists them)"))),
        }
    }
    Ok(true)
}

fn run() -> mlx_lfm::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if !check_flags(&args)? {
        return Ok(());
    }
    let device = match arg(&args, "--device").as_deref() {
        Some("gpu") => Some(runtime::DeviceType::Gpu),
        Some("cpu") => Some(runtime::DeviceType::Cpu),
        None => None,
        Some(d) => return Err(mlx_lfm::Error::invalid(format!("--device {d}: use cpu or gpu"))),
    };
    if let Some(d) = device {
        runtime::set_default_device(d)?;
    }
    if args.iter().any(|a| a == "--dispatch-cost") {
        return dispatch_cost(arg(&args, "--reps").map(|s| s.parse().expect("--reps")).unwrap_or(5));
    }
    if args.iter().any(|a| a == "--shape-cost") {
        return shape_cost(arg(&args, "--reps").map(|s| s.parse().expect("--reps")).unwrap_or(8));
    }
    if args.iter().any(|a| a == "--kernel-bench") {
        let arms: Option<Vec<String>> = arg(&args, "--arms").map(|s| s.split(',').map(|a| a.trim().to_string()).filter(|a| !a.is_empty()).collect());
        return kernel_bench::run(arg(&args, "--reps").map(|s| s.parse().expect("--reps")).unwrap_or(3), arms.as_deref());
    }
    let dir = match arg(&args, "--model") {
        Some(m) => PathBuf::from(m),
        None => {
            let preset = arg(&args, "--preset").unwrap_or_else(|| "lfm2-350m".into());
            let dtype = arg(&args, "--dtype").unwrap_or_else(|| "bf16".into());
            let quant = arg(&args, "--quantize");
            let name = match &quant {
                Some(q) => format!("/tmp/mlx-lfm-bench-{preset}-{dtype}-{}", q.replace(':', "-")),
                None => format!("/tmp/mlx-lfm-bench-{preset}-{dtype}"),
            };
            let out = PathBuf::from(arg(&args, "--out").unwrap_or(name));
            if !out.join("config.json").exists() {
                let t = Instant::now();
                // --from DIR: quantize a checkpoint generated before (the
                // same preset and dtype) instead of generating it again.
                let from = arg(&args, "--from").map(PathBuf::from);
                let src = match (&quant, &from) {
                    (Some(_), Some(f)) => f.clone(),
                    (Some(_), None) => out.with_extension("src"),
                    (None, _) => out.clone(),
                };
                if from.is_none() || quant.is_none() {
                    mlx_lfm::fixture::generate_named(&preset, &src, &dtype, "hf", 0)?;
                    eprintln!("generated {preset} {dtype} at {} in {:.1}s", src.display(), t.elapsed().as_secs_f64());
                }
                if let Some(q) = &quant {
                    // MODE:BITS:GROUP, e.g. affine:4:64, as our converter (and mlx-lm's) writes it.
                    let parts: Vec<&str> = q.split(':').collect();
                    let bad = || mlx_lfm::Error::invalid(format!("--quantize {q}: use MODE:BITS:GROUP, e.g. affine:4:64"));
                    let (mode, bits, gs) = match parts.as_slice() {
                        [m, b, g] => (
                            mlx_lfm::mlx::QuantMode::parse(m).ok_or_else(bad)?,
                            b.parse().map_err(|_| bad())?,
                            g.parse().map_err(|_| bad())?,
                        ),
                        _ => return Err(bad()),
                    };
                    let recipe = mlx_lfm::convert::ConvertRecipe::quantized(mode, Some(bits), Some(gs))?;
                    mlx_lfm::convert::convert(&src, &out, &recipe)?;
                    if from.is_none() {
                        std::fs::remove_dir_all(&src).ok();
                    }
                    eprintln!("quantized to {q} at {} ({:.1}s in all)", out.display(), t.elapsed().as_secs_f64());
                }
            }
            out
        }
    };
    let tp: usize = arg(&args, "--tensor-parallel").map(|s| s.parse().expect("--tensor-parallel takes a count")).unwrap_or(1);
    if tp == 0 {
        return Err(mlx_lfm::Error::invalid("--tensor-parallel must be at least 1"));
    }
    let group = if tp > 1 {
        if std::env::var("MLX_RANK").is_err() {
            return launch(&args, &dir, tp);
        }
        let backend = arg(&args, "--backend").unwrap_or_else(|| "ring".into());
        Some(mlx_lfm::mlx::distributed::Group::init_within(&backend, std::time::Duration::from_secs(120))?)
    } else {
        None
    };
    let rank0 = group.as_ref().is_none_or(|g| g.rank() == 0);
    let prompts: Vec<usize> = arg(&args, "--prompts")
        .unwrap_or_else(|| "512".into())
        .split(',')
        .map(|s| s.parse().expect("--prompts takes comma-separated integers"))
        .collect();
    let gen: usize = arg(&args, "--gen").map(|s| s.parse().expect("--gen")).unwrap_or(128);
    let paged = match arg(&args, "--cache").as_deref() {
        None => None,
        Some("paged") => Some(true),
        Some("flat") => Some(false),
        Some(c) => return Err(mlx_lfm::Error::invalid(format!("--cache {c}: use paged or flat"))),
    };
    if let Some(n) = arg(&args, "--concurrent") {
        let reps: usize = arg(&args, "--reps").map(|s| s.parse().expect("--reps")).unwrap_or(2);
        return concurrent(&dir, device, paged, n.parse().expect("--concurrent"), prompts[0], gen, reps, group);
    }
    if args.iter().any(|a| a == "--constrained") {
        let num = |k: &str, d: usize| arg(&args, k).map(|s| s.parse().expect("a number")).unwrap_or(d);
        return constrained(&dir, device, paged, num("--gen", 128), num("--reps", 3), num("--batch", 4));
    }
    if args.iter().any(|a| a == "--step-ops") {
        // The primitives one compiled decode step hands MLX, by name (what
        // the host encodes and launches one at a time), after a prompt of
        // the first --prompts length.
        let eng = Engine::load(&dir, &EngineOptions { device, decode_path: Some(DecodePath::Compiled), ..Default::default() })?;
        let vocab = eng.info().vocab_size as u32;
        let ops = mlx_lfm::generate::decode_step_ops(&eng.model, eng.compiled.as_ref(), &ids(prompts[0], vocab, 1))?;
        let total: usize = ops.iter().map(|(_, n)| n).sum();
        println!("{}", serde_json::json!({"step_ops": total, "by_primitive": ops.iter().map(|(k, n)| serde_json::json!([k, n])).collect::<Vec<_>>(),
            "backend": runtime::backend().name(), "model": dir}));
        return Ok(());
    }
    if args.iter().any(|a| a == "--prefill-ops") {
        return prefill_ops(&dir, device, paged, prompts[0]);
    }
    if let Some(spec) = arg(&args, "--ab") {
        let reps: usize = arg(&args, "--reps").map(|s| s.parse().expect("--reps")).unwrap_or(6);
        return ab(&dir, device, paged, &spec, prompts[0], gen, reps);
    }
    if let Some(n) = arg(&args, "--new-lengths") {
        return new_lengths(&dir, device, paged, n.parse().expect("--new-lengths takes a count"), prompts[0]);
    }
    if args.iter().any(|a| a == "--disk-admission") {
        let num = |name: &str, d: usize| arg(&args, name).map(|s| s.parse().expect(name)).unwrap_or(d);
        return disk_admission(&dir, device, prompts[0], num("--block", 16), num("--reps", 3));
    }
    if let Some(n) = arg(&args, "--turns") {
        let num = |k: &str, d: usize| arg(&args, k).map(|s| s.parse().expect("a number")).unwrap_or(d);
        return turns(&dir, device, n.parse().expect("--turns"), num("--system", 1024), num("--user", 64), num("--reply", 64));
    }
    let reps: usize = arg(&args, "--reps").map(|s| s.parse().expect("--reps")).unwrap_or(2);
    let paths = arg(&args, "--paths").unwrap_or_else(|| "compiled,eager".into());
    if rank0 {
        println!(
            "{}",
            serde_json::json!({"mlx": runtime::version(), "backend": runtime::backend().name(), "device": runtime::device_name(), "allocator": runtime::malloc_library(), "model": dir, "tensor_parallel": tp})
        );
    }
    for path in paths.split(',') {
        let decode_path = match path {
            "compiled" => DecodePath::Compiled,
            "eager" => DecodePath::Eager,
            p => return Err(mlx_lfm::Error::invalid(format!("--paths: unknown path {p}"))),
        };
        let t = Instant::now();
        let mut eng = Engine::load(
            &dir,
            &EngineOptions { device, decode_path: Some(decode_path), paged_cache: paged, group: group.clone(), ..Default::default() },
        )?;
        let load_s = t.elapsed().as_secs_f64();
        let info = eng.info();
        let vocab = info.vocab_size as u32;

        // Warm-up (compiles kernels and the decode graph).
        let warm = GenerateParams { max_tokens: 8, ignore_eos: true, ..Default::default() };
        eng.generate(Prompt::Tokens(ids(64, vocab, 1)), warm, &mut NoObserver)?;
        // MLXLFM_PROFILE_PREFILL=1: one prefill per prompt length (after an
        // unmeasured one of the same shape) wrapped in cudaProfilerStart/Stop,
        // for `ncu --profile-from-start off`.
        let profile_prefill = std::env::var("MLXLFM_PROFILE_PREFILL").is_ok_and(|v| v == "1");
        for &p in &prompts {
            if profile_prefill {
                let one = GenerateParams { max_tokens: 1, ignore_eos: true, ..Default::default() };
                eng.generate(Prompt::Tokens(ids(p, vocab, 3)), one.clone(), &mut NoObserver)?;
                runtime::synchronize()?;
                cuda_profiler(true);
                eng.generate(Prompt::Tokens(ids(p, vocab, 5)), one, &mut NoObserver)?;
                runtime::synchronize()?;
                cuda_profiler(false);
            }
            // The first pass at a new prompt length pays MLX's per-shape
            // setup (~100 ms on the H100/H200: 5-7k tok/s at P=512 against
            // ~100k warm): untimed, as llama-bench's warm-up run, and
            // reported apart (`cold_*`) so what a server pays for a length
            // it has not seen stays in view (`--new-lengths` measures that
            // over many lengths). `--cold-first` times it as the first rep,
            // as runs before session 32's rounds did.
            let cold = if args.iter().any(|a| a == "--cold-first") {
                None
            } else {
                let params = GenerateParams { max_tokens: 2, ignore_eos: true, ..Default::default() };
                let g = eng.generate(Prompt::Tokens(ids(p, vocab, 4)), params, &mut NoObserver)?;
                Some((g.metrics.prefill_tokens_per_second, g.metrics.ttft_ms))
            };
            let mut best_prefill = 0f64;
            let mut best_ttft = f64::MAX;
            let mut best_decode = 0f64;
            // Every rep's figures too, so a caller can take a median (the
            // same-run H200 benchmark compares medians across engines).
            let (mut prefills, mut decodes) = (vec![], vec![]);
            // Per token of each rep, in µs: the host building the step, MLX
            // encoding and launching it, the wait for the token, and with
            // MLX_LFM_SYNC_STEPS=1 the wait right after each dispatch
            // (`generate::timing`, `host_us`).
            let mut host = vec![];
            let profile_hz: Option<u32> = arg(&args, "--host-profile").map(|s| s.parse().expect("--host-profile"));
            if let Some(hz) = profile_hz {
                host_profile::start(hz);
            }
            for r in 0..reps {
                let params = GenerateParams { max_tokens: gen, ignore_eos: true, ..Default::default() };
                mlx_lfm::generate::timing::take();
                let g = eng.generate(Prompt::Tokens(ids(p, vocab, 7 + r as u32)), params, &mut NoObserver)?;
                let times = mlx_lfm::generate::timing::take();
                host.push(host_us(&times));
                best_prefill = best_prefill.max(g.metrics.prefill_tokens_per_second);
                best_ttft = best_ttft.min(g.metrics.ttft_ms);
                best_decode = best_decode.max(g.metrics.decode_tokens_per_second);
                prefills.push(g.metrics.prefill_tokens_per_second);
                decodes.push(g.metrics.decode_tokens_per_second);
            }
            if profile_hz.is_some() {
                // (This thread ran every generate call above.)
                let prof = host_profile::report(host_profile::this_thread());
                if rank0 {
                    println!("{}", serde_json::json!({"host_profile": prof, "path": path, "prompt": p, "gen": gen, "reps": reps}));
                }
            }
            if !rank0 {
                continue;
            }
            println!(
                "{}",
                serde_json::json!({
                    "tensor_parallel": tp, "weight_bytes_per_rank": info.weight_bytes,
                    "path": path, "cache": info.cache_kind, "dtype": info.dtype, "quantization": info.quantization.iter().map(|q| format!("{}:{}:{}", q.mode, q.bits, q.group_size)).collect::<Vec<_>>(),
                    "params": info.parameter_count, "prompt": p, "gen": gen, "load_s": load_s,
                    "prefill_tps": best_prefill, "ttft_ms": best_ttft, "decode_tps": best_decode,
                    "decode_ms_per_token": 1000.0 / best_decode,
                    "prefill_tps_runs": prefills, "decode_tps_runs": decodes,
                    "host_build_dispatch_wait_us_runs": host,
                    "cold_prefill_tps": cold.map(|c| c.0), "cold_ttft_ms": cold.map(|c| c.1),
                })
            );
        }
    }
    Ok(())
}

/// A rep's per-token µs, to a tenth: build, dispatch, wait, and the
/// synchronous tail (0 unless `MLX_LFM_SYNC_STEPS=1`; see
/// `generate::timing::sync_steps`: a wait near zero in the pipelined loop
/// alone does not tell a host-bound step, as MLX's dispatch itself can wait
/// on the device).
fn host_us(t: &mlx_lfm::generate::timing::StepTimes) -> [f64; 4] {
    let (b, d, w) = t.per_token_us();
    [b, d, w, t.sync_us()].map(|x| (x * 10.0).round() / 10.0)
}

/// The middle value (the mean of the middle two for an even count); 0 for none.
fn median_of(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// `NAME:VAR=V,VAR=V;NAME2:...` as (name, overrides), the defaults first
/// under the name `all`.
fn ab_variants(spec: &str) -> mlx_lfm::Result<Vec<(String, mlx_lfm::knobs::Overrides)>> {
    let mut out = vec![("all".to_string(), vec![])];
    for v in spec.split(';').filter(|v| !v.trim().is_empty()) {
        let (name, vars) = v.split_once(':').ok_or_else(|| mlx_lfm::Error::invalid(format!("--ab {v:?}: expected NAME:VAR=VALUE,...")))?;
        let name = name.trim().to_string();
        if out.iter().any(|(n, _)| *n == name) {
            return Err(mlx_lfm::Error::invalid(format!("--ab: {name} is named twice")));
        }
        out.push((name, mlx_lfm::knobs::parse_assignments(vars)?));
    }
    Ok(out)
}

/// See `--ab` in the usage.
#[allow(clippy::too_many_arguments)]
fn ab(
    dir: &std::path::Path,
    device: Option<runtime::DeviceType>,
    paged: Option<bool>,
    spec: &str,
    prompt: usize,
    gen: usize,
    reps: usize,
) -> mlx_lfm::Result<()> {
    use mlx_lfm::knobs::with_overrides;
    let variants = ab_variants(spec)?;
    let opts = EngineOptions { device, decode_path: Some(DecodePath::Compiled), paged_cache: paged, ..Default::default() };
    let mut engines = vec![];
    let mut step_ops = vec![];
    for (name, vars) in &variants {
        let loaded = with_overrides(vars, || -> mlx_lfm::Result<(Engine, usize)> {
            let mut eng = Engine::load(dir, &opts)?;
            let vocab = eng.info().vocab_size as u32;
            // Warm: the decode graph traced, the kernels built, and the
            // prompt's shapes seen once (MLX's per-shape setup).
            let warm = GenerateParams { max_tokens: 8, ignore_eos: true, ..Default::default() };
            eng.generate(Prompt::Tokens(ids(64, vocab, 1)), warm.clone(), &mut NoObserver)?;
            eng.generate(Prompt::Tokens(ids(prompt, vocab, 2)), warm, &mut NoObserver)?;
            let ops = mlx_lfm::generate::decode_step_ops(&eng.model, eng.compiled.as_ref(), &ids(16, vocab, 1))?;
            Ok((eng, ops.iter().map(|(_, n)| n).sum()))
        });
        let (eng, ops) = loaded.map_err(|e| mlx_lfm::Error::invalid(format!("--ab variant {name}: {}", e.message)))?;
        engines.push(eng);
        step_ops.push(ops);
    }
    let n = variants.len();
    let (mut prefill, mut decode, mut host) = (vec![vec![]; n], vec![vec![]; n], vec![vec![]; n]);
    for r in 0..reps {
        for k in 0..n {
            let i = (k + r) % n;
            let eng = &mut engines[i];
            let vocab = eng.info().vocab_size as u32;
            let params = GenerateParams { max_tokens: gen, ignore_eos: true, ..Default::default() };
            let g = with_overrides(&variants[i].1, || {
                mlx_lfm::generate::timing::take();
                eng.generate(Prompt::Tokens(ids(prompt, vocab, 7 + r as u32)), params, &mut NoObserver)
            })?;
            let times = mlx_lfm::generate::timing::take();
            host[i].push(host_us(&times));
            prefill[i].push(g.metrics.prefill_tokens_per_second);
            decode[i].push(g.metrics.decode_tokens_per_second);
        }
    }
    let ratios = |xs: &[f64], base: &[f64]| -> Vec<f64> { xs.iter().zip(base).map(|(x, b)| if *b > 0.0 { x / b } else { 0.0 }).collect() };
    for (i, (name, vars)) in variants.iter().enumerate() {
        let dr = ratios(&decode[i], &decode[0]);
        let pr = ratios(&prefill[i], &prefill[0]);
        println!(
            "{}",
            serde_json::json!({
                "ab_variant": name, "switches": vars.iter().map(|(k, v)| format!("{k}={}", v.as_deref().unwrap_or(""))).collect::<Vec<_>>(),
                "prompt": prompt, "gen": gen, "reps": reps, "step_ops": step_ops[i],
                "prefill_tps_runs": prefill[i], "decode_tps_runs": decode[i], "host_build_dispatch_wait_us_runs": host[i],
                "decode_ratio_runs": dr, "prefill_ratio_runs": pr,
                "decode_ratio_median": median_of(&dr), "prefill_ratio_median": median_of(&pr),
                "backend": runtime::backend().name(),
            })
        );
    }
    Ok(())
}

fn ids(n: usize, vocab: u32, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(salt.wrapping_mul(40503)) % (vocab.min(60000) - 10)) + 5).collect()
}

/// The primitives a prompt of `n` tokens hands MLX from the request to its
/// first token (every prefill chunk, the cache's writes, the draw), by name,
/// through `Engine::generate` as the prefill figures time it, after one
/// prompt of the same length (so the
/// shapes and the weights' load-time views are built): on CUDA nearly one
/// kernel launch each (views aside), the host's share of a short prompt's
/// TTFT.
fn prefill_ops(dir: &std::path::Path, device: Option<runtime::DeviceType>, paged: Option<bool>, n: usize) -> mlx_lfm::Result<()> {
    let mut eng = Engine::load(dir, &EngineOptions { device, paged_cache: paged, ..Default::default() })?;
    let vocab = eng.info().vocab_size as u32;
    let params = || GenerateParams { max_tokens: 1, ignore_eos: true, ..Default::default() };
    eng.generate(Prompt::Tokens(ids(n, vocab, 1)), params(), &mut NoObserver)?;
    let (g, ops) = mlx_lfm::mlx::count_ops(|| eng.generate(Prompt::Tokens(ids(n, vocab, 2)), params(), &mut NoObserver));
    let g = g?;
    let total: usize = ops.iter().map(|(_, k)| k).sum();
    println!(
        "{}",
        serde_json::json!({"prefill_ops": total, "prompt": n, "cached_tokens": g.metrics.cached_tokens, "cache": eng.info().cache_kind,
            "by_primitive": ops.iter().map(|(k, c)| serde_json::json!([k, c])).collect::<Vec<_>>(),
            "backend": runtime::backend().name(), "model": dir})
    );
    Ok(())
}

/// Warm multi-turn TTFT against cold and flat, on the same conversation.
fn turns(dir: &std::path::Path, device: Option<runtime::DeviceType>, n: usize, system: usize, user: usize, reply: usize) -> mlx_lfm::Result<()> {
    let load = |paged: bool| Engine::load(dir, &EngineOptions { device, paged_cache: Some(paged), ..Default::default() });
    let (mut warm, mut cold, mut flat) = (load(true)?, load(true)?, load(false)?);
    let vocab = warm.info().vocab_size as u32;
    let params = GenerateParams { max_tokens: reply, ignore_eos: true, ..Default::default() };
    // Warm-up at the conversation's sizes (kernels are built per shape), on
    // ids the conversation never uses.
    for e in [&mut warm, &mut cold, &mut flat] {
        for len in [64, system + user, user + reply] {
            e.generate(Prompt::Tokens(ids(len, vocab, 999)), GenerateParams { max_tokens: 8, ..params.clone() }, &mut NoObserver)?;
        }
        e.clear_prefix_cache();
    }
    let mut history = ids(system, vocab, 1);
    for t in 0..n {
        history.extend(ids(user, vocab, 100 + t as u32));
        let w = warm.generate(Prompt::Tokens(history.clone()), params.clone(), &mut NoObserver)?;
        cold.clear_prefix_cache();
        let c = cold.generate(Prompt::Tokens(history.clone()), params.clone(), &mut NoObserver)?;
        let f = flat.generate(Prompt::Tokens(history.clone()), params.clone(), &mut NoObserver)?;
        println!(
            "{}",
            serde_json::json!({
                "turn": t + 1, "prompt": history.len(),
                "warm_ttft_ms": w.metrics.ttft_ms, "warm_cached": w.metrics.cached_tokens, "warm_run": w.metrics.prefill_tokens,
                "cold_ttft_ms": c.metrics.ttft_ms, "flat_ttft_ms": f.metrics.ttft_ms,
                "warm_decode_tps": w.metrics.decode_tokens_per_second, "flat_decode_tps": f.metrics.decode_tokens_per_second,
                "same_tokens": w.tokens == c.tokens && c.tokens == f.tokens,
            })
        );
        history.extend(&w.tokens);
    }
    Ok(())
}

/// Free sampling against two constraints: a JSON object with a long
/// string (nearly every token allowed inside it: the costliest masks) and
/// a regex of words. Temperature 1, ignore_eos; a constraint's output may
/// end before `gen` tokens (its grammar complete), so each figure is tokens
/// after the first over the time after the first (the engine's decode
/// tok/s), the median of `reps` runs; batched, the tokens all requests
/// made after their first over the decode steps' wall time.
fn constrained(
    dir: &std::path::Path,
    device: Option<runtime::DeviceType>,
    paged: Option<bool>,
    gen: usize,
    reps: usize,
    batch: usize,
) -> mlx_lfm::Result<()> {
    use mlx_lfm::engine::{Request, Scheduler};
    use mlx_lfm::generate::constraint::Grammar;
    use std::sync::{Arc, Mutex};
    let mut eng = Engine::load(dir, &EngineOptions { device, paged_cache: paged, ..Default::default() })?;
    let info = eng.info();
    let vocab = info.vocab_size as u32;
    println!(
        "{}",
        serde_json::json!({"mlx": runtime::version(), "backend": runtime::backend().name(), "device": runtime::device_name(),
            "model": dir, "params": info.parameter_count, "dtype": info.dtype, "vocab": vocab, "decode_path": info.decode_path})
    );
    let cases: Vec<(&str, Option<Grammar>)> = vec![
        ("free", None),
        ("json_schema", Some(Grammar::JsonSchema(serde_json::json!({
            "type": "object",
            "properties": { "title": { "type": "string", "maxLength": 8 }, "body": { "type": "string" } },
            "required": ["title", "body"], "additionalProperties": false
        })))),
        ("regex", Some(Grammar::Regex("([a-z]+ )+".into()))),
    ];
    let params = |g: &Option<Grammar>, seed: u64| {
        let mut p = GenerateParams { max_tokens: gen, ignore_eos: true, grammar: g.clone(), ..Default::default() };
        p.sampling.temperature = 1.0;
        p.sampling.seed = Some(seed);
        p
    };
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    // Warm-up: kernels, the compiled steps, the llguidance vocabulary.
    for (_, g) in &cases {
        eng.generate(Prompt::Tokens(ids(32, vocab, 999)), GenerateParams { max_tokens: 8, ..params(g, 1) }, &mut NoObserver)?;
    }
    // Cases interleaved rep by rep, so a load that drifts during the run
    // (a shared machine) weighs on all of them alike.
    let n = cases.len();
    let (mut tps, mut toks, mut batch_tps) = (vec![vec![]; n], vec![vec![]; n], vec![vec![]; n]);
    for r in 0..reps {
        for (c, (_, g)) in cases.iter().enumerate() {
            eng.clear_prefix_cache();
            let out = eng.generate(Prompt::Tokens(ids(32, vocab, 7 + r as u32)), params(g, r as u64), &mut NoObserver)?;
            tps[c].push(out.metrics.decode_tokens_per_second);
            toks[c].push(out.completion_tokens as f64);
        }
        // `batch` requests together: tokens after each one's first over
        // the wall time of the decode steps.
        for (c, (_, g)) in cases.iter().enumerate() {
            eng.clear_prefix_cache();
            let made = Arc::new(Mutex::new(0usize));
            let mut sched = Scheduler::new();
            for i in 0..batch {
                let made = made.clone();
                let seed = (r * batch + i) as u64;
                let req = Request::tokens(ids(32, vocab, 50 + seed as u32), params(g, seed), move |res| match res {
                    Ok(o) => *made.lock().unwrap() += o.completion_tokens.saturating_sub(1),
                    Err(e) => eprintln!("mlx-lfm-bench: a request failed: {e}"),
                });
                sched.submit(&mut eng, req);
            }
            while sched.prefilling() > 0 {
                sched.prefill_next(&mut eng);
            }
            // The first decode step samples nothing new for a request's count.
            let t = Instant::now();
            while sched.running() > 0 {
                sched.step_active(&mut eng);
            }
            batch_tps[c].push(*made.lock().unwrap() as f64 / t.elapsed().as_secs_f64());
        }
    }
    // The CPU cost of the constraint alone, without the model: per step,
    // the mask (llguidance's computation and the array handed to MLX) and
    // the commit of a token drawn uniformly from the allowed ones.
    let mut mask_ms = vec![None; n];
    for (c, (_, g)) in cases.iter().enumerate() {
        let Some(g) = g else { continue };
        let guide = eng.guide_for(&params(&Some(g.clone()), 0))?.expect("a grammar");
        let mut con = mlx_lfm::generate::constraint::Constraint::compile(&guide, g)?;
        let (mut spent, mut steps, mut rng) = (0f64, 0usize, 0x9E37_79B9_7F4A_7C15u64);
        while steps < 200 {
            let t = Instant::now();
            let Some(mask) = con.mask()? else { break };
            mask.eval()?;
            spent += t.elapsed().as_secs_f64();
            let allowed: Vec<u32> =
                mask.to_vec::<bool>()?.iter().enumerate().filter(|(_, &b)| b).map(|(i, _)| i as u32).collect();
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let tok = allowed[(rng >> 33) as usize % allowed.len()];
            let t = Instant::now();
            con.commit(tok)?;
            spent += t.elapsed().as_secs_f64();
            steps += 1;
            if con.is_done() {
                con = mlx_lfm::generate::constraint::Constraint::compile(&guide, g)?;
            }
        }
        mask_ms[c] = Some(spent * 1000.0 / steps.max(1) as f64);
    }
    // A batch step's parser work without the model: `batch` rows each
    // commit a token and compute their next mask, one row after another on
    // this thread (what the worker did before) against all rows at once on
    // rayon's pool (`prepare_rows`, what a batch step does now). Two sets of
    // rows walk the same tokens, the two ways interleaved step by step;
    // their masks must agree.
    let mut rows_ms = vec![None; n];
    for (c, (_, g)) in cases.iter().enumerate() {
        use mlx_lfm::generate::constraint::{prepare_rows, Constraint};
        let Some(g) = g else { continue };
        let guide = eng.guide_for(&params(&Some(g.clone()), 0))?.expect("a grammar");
        let fresh = || Constraint::compile(&guide, g);
        let mut one: Vec<Constraint> = (0..batch).map(|_| fresh()).collect::<mlx_lfm::Result<_>>()?;
        let mut all = one.clone();
        let mut rng: Vec<u64> = (0..batch as u64).map(|i| 0x9E37_79B9_7F4A_7C15 ^ i.wrapping_mul(0x2545_F491_4F6C_DD1D)).collect();
        let mut toks = vec![0u32; batch];
        let (mut t_one, mut t_all) = (0f64, 0f64);
        for step in 0..=200 {
            if step > 0 {
                let t = Instant::now();
                for (con, &tok) in one.iter_mut().zip(&toks) {
                    con.prepare(tok, true);
                }
                t_one += t.elapsed().as_secs_f64();
                let t = Instant::now();
                let mut work: Vec<_> = all.iter_mut().zip(&toks).map(|(con, &tok)| (con, tok, true)).collect();
                prepare_rows(&mut work);
                t_all += t.elapsed().as_secs_f64();
            }
            // Untimed: take the prepared work over and draw each row's next token.
            for i in 0..batch {
                if step > 0 {
                    one[i].commit(toks[i])?;
                    all[i].commit(toks[i])?;
                }
                let (a, b) = match one[i].is_done() {
                    true => (None, None),
                    false => (one[i].mask()?, all[i].mask()?),
                };
                let (a, b) = match (a, b) {
                    (Some(a), Some(b)) => (a.to_vec::<bool>()?, b.to_vec::<bool>()?),
                    (None, None) => {
                        (one[i], all[i]) = (fresh()?, fresh()?);
                        (one[i].mask()?.expect("a first mask").to_vec::<bool>()?, all[i].mask()?.expect("a first mask").to_vec::<bool>()?)
                    }
                    _ => return Err(mlx_lfm::Error::invalid("rows prepared together went another way than one by one")),
                };
                if a != b {
                    return Err(mlx_lfm::Error::invalid("rows prepared together got another mask than one by one"));
                }
                let allowed: Vec<u32> = a.iter().enumerate().filter(|(_, &x)| x).map(|(k, _)| k as u32).collect();
                rng[i] = rng[i].wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                toks[i] = allowed[(rng[i] >> 33) as usize % allowed.len()];
            }
        }
        rows_ms[c] = Some((t_one * 1000.0 / 200.0, t_all * 1000.0 / 200.0));
    }
    for (c, (name, _)) in cases.iter().enumerate() {
        println!(
            "{}",
            serde_json::json!({
                "case": name, "gen": gen, "reps": reps, "decode_tps": median(&mut tps[c].clone()), "decode_tps_runs": tps[c],
                "completion_tokens_runs": toks[c], "batch": batch, "batch_decode_tps": median(&mut batch_tps[c].clone()),
                "batch_decode_tps_runs": batch_tps[c],
                "vs_free_decode": median(&mut tps[c].clone()) / median(&mut tps[0].clone()),
                "vs_free_batch": median(&mut batch_tps[c].clone()) / median(&mut batch_tps[0].clone()),
                "mask_and_commit_ms_per_token": mask_ms[c],
                "batch_rows_parser_ms_per_step_one_by_one": rows_ms[c].map(|r| r.0),
                "batch_rows_parser_ms_per_step_together": rows_ms[c].map(|r| r.1),
                "parser_threads": rayon::current_num_threads(),
            })
        );
    }
    Ok(())
}

/// N requests together (the engine's scheduler, as the worker drives it)
/// against the same N sequentially.
fn concurrent(
    dir: &std::path::Path,
    device: Option<runtime::DeviceType>,
    paged: Option<bool>,
    n: usize,
    prompt: usize,
    gen: usize,
    reps: usize,
    group: Option<mlx_lfm::mlx::distributed::Group>,
) -> mlx_lfm::Result<()> {
    use mlx_lfm::engine::{Request, Scheduler};
    let rank0 = group.as_ref().is_none_or(|g| g.rank() == 0);
    let tp = group.as_ref().map(|g| g.size()).unwrap_or(1);
    let mut eng = Engine::load(dir, &EngineOptions { device, paged_cache: paged, group, ..Default::default() })?;
    let info = eng.info();
    let vocab = info.vocab_size as u32;
    let params = GenerateParams { max_tokens: gen, ignore_eos: true, ..Default::default() };
    // MLXLFM_PROFILE_STEP=k: step k of the first measured run is wrapped in
    // cudaProfilerStart/Stop (for `ncu --profile-from-start off`).
    let profile_step: Option<usize> = std::env::var("MLXLFM_PROFILE_STEP").ok().and_then(|v| v.parse().ok());
    let profiling = std::cell::Cell::new(false);
    // Returns the wall time of every scheduler step (all requests decoding
    // together after their prefills).
    let run_together = |eng: &mut Engine, prompts: &[Vec<u32>]| -> mlx_lfm::Result<Vec<f64>> {
        // As the model's worker schedules them: all arrive at once; short
        // fresh prompts are prefilled together, the rest a chunk per step.
        let mut sched = Scheduler::new();
        for p in prompts {
            let req = Request::tokens(p.clone(), params.clone(), |r| {
                if let Err(e) = r {
                    eprintln!("mlx-lfm-bench: a request failed: {e}");
                }
            });
            sched.submit(eng, req);
        }
        while sched.prefilling() > 0 {
            sched.prefill_next(eng);
        }
        let mut steps = vec![];
        while sched.running() > 0 {
            let profiled = profile_step.is_some_and(|k| k == steps.len()) && profiling.get();
            if profiled {
                runtime::synchronize()?;
                cuda_profiler(true);
            }
            let t = Instant::now();
            sched.step_active(eng);
            if profiled {
                runtime::synchronize()?;
                cuda_profiler(false);
            }
            steps.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        Ok(steps)
    };
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let warm: Vec<Vec<u32>> = (0..n).map(|i| ids(prompt, vocab, 900 + i as u32)).collect();
    // The first step at a new batch size traces the compiled step for it.
    let first = run_together(&mut eng, &warm)?;
    if rank0 {
        println!(
            "{}",
            serde_json::json!({"concurrent": n, "tensor_parallel": tp, "first_step_ms": first.first(), "median_step_ms_in_first_run": median(&first)})
        );
    }
    eng.generate(Prompt::Tokens(warm[0].clone()), params.clone(), &mut NoObserver)?;
    for r in 0..reps {
        let prompts: Vec<Vec<u32>> = (0..n).map(|i| ids(prompt, vocab, 1 + (r * 100 + i) as u32)).collect();
        eng.clear_prefix_cache();
        let t = Instant::now();
        let mut solo = vec![];
        for p in &prompts {
            let g = eng.generate(Prompt::Tokens(p.clone()), params.clone(), &mut NoObserver)?;
            solo.push(1000.0 / g.metrics.decode_tokens_per_second.max(1e-9));
        }
        let seq_s = t.elapsed().as_secs_f64();
        eng.clear_prefix_cache();
        profiling.set(r == 0);
        mlx_lfm::generate::timing::take_batch();
        mlx_lfm::generate::timing::take_batch_nodes();
        let t = Instant::now();
        let steps = run_together(&mut eng, &prompts)?;
        let times = mlx_lfm::generate::timing::take_batch();
        let nodes = mlx_lfm::generate::timing::take_batch_nodes();
        profiling.set(false);
        let par_s = t.elapsed().as_secs_f64();
        let total = (n * gen) as f64;
        if !rank0 {
            continue;
        }
        println!(
            "{}",
            serde_json::json!({
                "concurrent": n, "tensor_parallel": tp, "prompt": prompt, "gen": gen, "cache": info.cache_kind, "dtype": info.dtype,
                "sequential_tps": total / seq_s, "concurrent_tps": total / par_s, "ratio": seq_s / par_s,
                "median_step_ms": median(&steps), "solo_step_ms": median(&solo),
                // µs a step: building the stacked step, dispatching it, the
                // wait right after (MLX_LFM_SYNC_STEPS=1 only), and the rows'
                // reads and deliveries (`generate::timing::BatchTimes`).
                "batch_build_dispatch_sync_accept_us": times.per_step_us().map(|x| (x * 10.0).round() / 10.0),
                "stacked_steps": times.stacked,
                // Nodes a stacked step handed MLX (MLX_LFM_COUNT_STEP_NODES=1
                // only; the least is a steady step's).
                "batch_step_nodes": (nodes.steps > 0).then(|| serde_json::json!({
                    "steps": nodes.steps, "min": nodes.min, "mean": (nodes.mean() * 10.0).round() / 10.0, "max": nodes.max,
                })),
            })
        );
    }
    Ok(())
}

/// TTFT at `n` new prompt lengths from `base` up (each a shape the engine has
/// not run), then at `base` again `n` times (a seen shape), prefix cache
/// cleared before each; one token generated.
fn new_lengths(
    dir: &std::path::Path,
    device: Option<runtime::DeviceType>,
    paged: Option<bool>,
    n: usize,
    base: usize,
) -> mlx_lfm::Result<()> {
    let mut eng = Engine::load(dir, &EngineOptions { device, paged_cache: paged, ..Default::default() })?;
    let vocab = eng.info().vocab_size as u32;
    let one = GenerateParams { max_tokens: 1, ignore_eos: true, ..Default::default() };
    // Warm-up at an unrelated length (kernels, first allocations).
    eng.generate(Prompt::Tokens(ids(64, vocab, 1)), one.clone(), &mut NoObserver)?;
    let mut run = |len: usize, seed: u32| -> mlx_lfm::Result<f64> {
        eng.clear_prefix_cache();
        Ok(eng.generate(Prompt::Tokens(ids(len, vocab, seed)), one.clone(), &mut NoObserver)?.metrics.ttft_ms)
    };
    let new: Vec<f64> = (0..n).map(|i| run(base + i, 10 + i as u32)).collect::<mlx_lfm::Result<_>>()?;
    let seen: Vec<f64> = (0..n).map(|i| run(base, 100 + i as u32)).collect::<mlx_lfm::Result<_>>()?;
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    println!(
        "{}",
        serde_json::json!({"new_lengths": n, "from": base, "device": runtime::device_name(),
            "ttft_ms_new": new, "ttft_ms_seen": seen, "median_new_ms": median(&new), "median_seen_ms": median(&seen)})
    );
    Ok(())
}

/// `--shape-cost`: a prompt length never seen before costs ~70-140 ms of
/// TTFT on the GPU against 4-60 ms warm (session 32's rounds), a cost a
/// server meets at every new length. Which op pays it: each of a prompt's
/// kinds alone, at the 1.2B's widths, timed with its wait at `reps` new
/// lengths and then at a seen one as often (MLX keeps per-shape plans:
/// its attention's graphs and its matmuls' are keyed by the lengths).
fn shape_cost(reps: usize) -> mlx_lfm::Result<()> {
    if !(1..64).contains(&reps) {
        return Err(mlx_lfm::Error::invalid(format!("--shape-cost: --reps {reps} (1 to 63: each kind has 64 lengths of its own)")));
    }
    use mlx_lfm::mlx::{self, random::normal, Array, Dtype, Mask, QuantMode, QuantSpec};
    let bf = Dtype::Bfloat16;
    let (d, heads, kv_heads, hd) = (2048, 32, 8, 64);
    let w = normal(&[d, d], bf, 0.0, 0.02, None)?;
    let wt = w.transpose(&[1, 0])?;
    let spec = QuantSpec { mode: QuantMode::Affine, bits: 4, group_size: 64 };
    let (qw, qs, qb) = mlx::quantize(&w, spec)?;
    let norm_w = mlx::full(&[d], 1.0, bf)?;
    let mut held = vec![&w, &wt, &qw, &qs, &norm_w];
    if let Some(b) = &qb {
        held.push(b);
    }
    mlx::eval(&held)?;
    // Each kind: its inputs at a length (evaluated before the clock
    // starts), then the op on them.
    type Inputs = Box<dyn Fn(i32) -> mlx_lfm::Result<Vec<Array>>>;
    type Op<'a> = Box<dyn Fn(&[Array]) -> mlx_lfm::Result<Array> + 'a>;
    let rows = move |l: i32| -> mlx_lfm::Result<Vec<Array>> { Ok(vec![normal(&[l, d], bf, 0.0, 1.0, None)?]) };
    let kinds: Vec<(&str, Inputs, Op)> = vec![
        (
            "attention_causal",
            Box::new(move |l: i32| {
                Ok(vec![
                    normal(&[1, heads, l, hd], bf, 0.0, 1.0, None)?,
                    normal(&[1, kv_heads, l, hd], bf, 0.0, 1.0, None)?,
                    normal(&[1, kv_heads, l, hd], bf, 0.0, 1.0, None)?,
                ])
            }),
            Box::new(|x: &[Array]| mlx::sdpa(&x[0], &x[1], &x[2], 0.125, Mask::Causal)),
        ),
        ("matmul", Box::new(rows), Box::new(|x: &[Array]| x[0].matmul(&wt))),
        ("quantized_matmul", Box::new(rows), Box::new(|x: &[Array]| mlx::quantized_matmul(&x[0], &qw, &qs, qb.as_ref(), true, spec))),
        ("rms_norm", Box::new(rows), Box::new(|x: &[Array]| mlx::rms_norm(&x[0], Some(&norm_w), 1e-5))),
    ];
    // Each kind first at a length no kind times, so that a first launch
    // (a kernel's load) is not counted as a length's cost.
    for (i, (_, inputs, op)) in kinds.iter().enumerate() {
        op(&inputs(64 + i as i32)?)?.eval()?;
    }
    for (i, (name, inputs, op)) in kinds.iter().enumerate() {
        // Lengths no kind has seen: this kind's own range, near 512 for
        // every kind (64 lengths apart; at most 63 reps).
        let base = 512 + 64 * i as i32;
        let time = |l: i32| -> mlx_lfm::Result<f64> {
            let x = inputs(l)?;
            mlx::eval(&x.iter().collect::<Vec<_>>())?;
            runtime::synchronize()?;
            let t = Instant::now();
            op(&x)?.eval()?;
            runtime::synchronize()?;
            Ok(t.elapsed().as_secs_f64() * 1e3)
        };
        let new: Vec<f64> = (0..reps as i32).map(|j| time(base + 1 + j)).collect::<mlx_lfm::Result<_>>()?;
        time(base)?;
        let seen: Vec<f64> = (0..reps).map(|_| time(base)).collect::<mlx_lfm::Result<_>>()?;
        let round = |v: Vec<f64>| v.into_iter().map(|x| (x * 1000.0).round() / 1000.0).collect::<Vec<_>>();
        println!(
            "{}",
            serde_json::json!({"shape_cost": name, "from": base + 1, "new_ms": round(new), "seen_ms": round(seen),
                "backend": runtime::backend().name()})
        );
    }
    Ok(())
}

/// cudaProfilerStart / Stop through the CUDA runtime MLX loaded (nothing
/// when there is none): marks a region for `ncu --profile-from-start off`.
fn cuda_profiler(start: bool) {
    use std::ffi::{c_char, c_int, c_void};
    extern "C" {
        fn dlopen(name: *const c_char, flag: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    }
    unsafe {
        let h = dlopen(c"libcudart.so.13".as_ptr(), 2);
        if h.is_null() {
            eprintln!("mlx-lfm-bench: no libcudart.so.13 to profile with");
            return;
        }
        let name = if start { c"cudaProfilerStart" } else { c"cudaProfilerStop" };
        let f = dlsym(h, name.as_ptr());
        if !f.is_null() {
            let f: extern "C" fn() -> c_int = std::mem::transmute(f);
            f();
        }
    }
}

/// Starts `n` ranks of this same command over MLX's ring backend on
/// loopback and waits for them; rank 0's output is ours. Every rank must
/// finish: one that fails fails the run.
fn launch(args: &[String], dir: &std::path::Path, n: usize) -> mlx_lfm::Result<()> {
    use std::process::{Command, Stdio};
    let ports: Vec<u16> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()))
        .collect::<std::io::Result<_>>()?;
    let hosts: Vec<Vec<String>> = ports.iter().map(|p| vec![format!("127.0.0.1:{p}")]).collect();
    let hostfile = std::env::temp_dir().join(format!("mlx-lfm-bench-hosts-{}.json", std::process::id()));
    std::fs::write(&hostfile, serde_json::to_string(&hosts).unwrap())?;
    // The checkpoint exists by now: the ranks read it rather than generate it.
    let mut child_args: Vec<String> = args[1..].to_vec();
    child_args.extend(["--model".into(), dir.display().to_string()]);
    let exe = std::env::current_exe()?;
    let mut children = vec![];
    for r in 0..n {
        let child = Command::new(&exe)
            .args(&child_args)
            .env("MLX_HOSTFILE", &hostfile)
            .env("MLX_RANK", r.to_string())
            .stdout(if r == 0 { Stdio::inherit() } else { Stdio::null() })
            .spawn()?;
        children.push(child);
    }
    let mut failed = vec![];
    for (r, mut c) in children.into_iter().enumerate() {
        let status = c.wait()?;
        if !status.success() {
            failed.push(format!("rank {r}: {status}"));
        }
    }
    std::fs::remove_file(&hostfile).ok();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(mlx_lfm::Error::mlx(format!("tensor-parallel ranks failed: {}", failed.join(", "))))
    }
}

/// Token times of a running request (one per text delta).
struct Stamps(std::sync::Arc<std::sync::Mutex<Vec<Instant>>>);

impl mlx_lfm::generate::Observer for Stamps {
    fn on_text(&mut self, _delta: &str) -> bool {
        self.0.lock().unwrap().push(Instant::now());
        true
    }
}

/// The longest gap between consecutive times that overlaps `from..to`,
/// and the median gap of all of them (ms).
fn gaps(stamps: &[Instant], from: Instant, to: Instant) -> (f64, f64) {
    let ms = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64() * 1000.0;
    let mut all: Vec<f64> = stamps.windows(2).map(|w| ms(w[0], w[1])).collect();
    let worst = stamps.windows(2).filter(|w| w[1] > from && w[0] < to).map(|w| ms(w[0], w[1])).fold(0.0, f64::max);
    all.sort_by(|a, b| a.total_cmp(b));
    (worst, all.get(all.len() / 2).copied().unwrap_or(0.0))
}

fn disk_admission(
    dir: &std::path::Path,
    device: Option<runtime::DeviceType>,
    len: usize,
    block: usize,
    reps: usize,
) -> mlx_lfm::Result<()> {
    use mlx_lfm::engine::worker::ModelWorker;
    use mlx_lfm::engine::{Request, Scheduler};
    use std::sync::mpsc::channel;
    use std::sync::{Arc, Mutex};
    let cache = std::env::temp_dir().join(format!("mlx-lfm-bench-disk-{}", std::process::id()));
    std::fs::remove_dir_all(&cache).ok();
    let opts = EngineOptions { device, paged_block_size: Some(block), prefix_cache_dir: Some(cache.clone()), ..Default::default() };
    let one = GenerateParams { max_tokens: 1, ignore_eos: true, ..Default::default() };
    let running = GenerateParams { max_tokens: 200, ignore_eos: true, ..Default::default() };
    let (long, short, vocab) = {
        let mut e = Engine::load(dir, &opts)?;
        let vocab = e.info().vocab_size as u32;
        let long = ids(len, vocab, 5);
        e.generate(Prompt::Tokens(long.clone()), one.clone(), &mut NoObserver)?;
        e.persist_prefix_cache();
        (long, ids(16, vocab, 9), vocab)
    };
    let files = std::fs::read_dir(&cache).map(|d| d.count()).unwrap_or(0);
    let bytes: u64 = std::fs::read_dir(&cache).map(|d| d.flatten().filter_map(|f| f.metadata().ok()).map(|m| m.len()).sum()).unwrap_or(0);
    let stamped = |stamps: &Arc<Mutex<Vec<Instant>>>, p: Vec<u32>, done: std::sync::mpsc::Sender<()>| Request {
        prepare: None,
        render: Some({
            let params = running.clone();
            Box::new(move || Ok((p, params)))
        }),
        observer: Box::new(Stamps(stamps.clone())),
        reply: Some(Box::new(move |r| {
            if let Err(e) = r {
                eprintln!("mlx-lfm-bench: the running request failed: {e}");
            }
            done.send(()).ok();
        })),
        resume: None,
    };
    let mut rows = vec![];
    for rep in 0..reps {
        for mode in ["inline", "worker"] {
            let stamps = Arc::new(Mutex::new(vec![]));
            let (rtx, rrx) = channel();
            let (ltx, lrx) = channel::<Option<usize>>();
            let reply = move |r: mlx_lfm::Result<mlx_lfm::generate::Generation>| {
                ltx.send(r.ok().map(|g| g.metrics.cached_tokens)).ok();
            };
            let (t0, t1, cached);
            if mode == "inline" {
                let mut e = Engine::load(dir, &opts)?;
                e.generate(Prompt::Tokens(ids(16, vocab, 3)), one.clone(), &mut NoObserver)?;
                let mut s = Scheduler::new();
                s.submit(&mut e, stamped(&stamps, short.clone(), rtx));
                while stamps.lock().unwrap().len() < 20 {
                    s.step(&mut e);
                }
                t0 = Instant::now();
                s.submit(&mut e, Request::tokens(long.clone(), one.clone(), reply));
                let got = loop {
                    if let Ok(c) = lrx.try_recv() {
                        break c;
                    }
                    s.step(&mut e);
                };
                t1 = Instant::now();
                cached = got;
                while !s.is_idle() {
                    s.step(&mut e);
                }
            } else {
                let (wtx, wrx) = channel();
                ModelWorker::spawn(dir.to_path_buf(), opts.clone(), move |r| {
                    wtx.send(r.map(|(w, _, _)| w)).ok();
                });
                let w = wrx.recv().expect("the worker answers")?;
                let (dtx, drx) = channel();
                w.generate(Request::tokens(ids(16, vocab, 3), one.clone(), move |_| {
                    dtx.send(()).ok();
                }));
                drx.recv().ok();
                w.generate(stamped(&stamps, short.clone(), rtx));
                while stamps.lock().unwrap().len() < 20 {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                t0 = Instant::now();
                w.generate(Request::tokens(long.clone(), one.clone(), reply));
                cached = lrx.recv().ok().flatten();
                t1 = Instant::now();
                w.close();
            }
            rrx.recv().ok();
            let (worst, median) = gaps(&stamps.lock().unwrap(), t0, t1);
            let row = serde_json::json!({"rep": rep, "mode": mode, "cached_tokens": cached,
                "arrival_wall_ms": t1.duration_since(t0).as_secs_f64() * 1000.0,
                "running_worst_gap_ms": worst, "running_median_gap_ms": median});
            eprintln!("{row}");
            rows.push(row);
        }
    }
    let med = |mode: &str, k: &str| {
        let mut v: Vec<f64> = rows.iter().filter(|r| r["mode"] == mode).map(|r| r[k].as_f64().unwrap_or(0.0)).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let summary: serde_json::Map<String, serde_json::Value> = ["inline", "worker"]
        .iter()
        .map(|m| {
            (m.to_string(), serde_json::json!({"running_worst_gap_ms": med(m, "running_worst_gap_ms"),
                "running_median_gap_ms": med(m, "running_median_gap_ms"), "arrival_wall_ms": med(m, "arrival_wall_ms")}))
        })
        .collect();
    println!(
        "{}",
        serde_json::json!({"disk_admission": len, "block": block, "files": files, "file_bytes": bytes,
            "device": runtime::device_name(), "summary": summary, "rows": rows})
    );
    std::fs::remove_dir_all(&cache).ok();
    Ok(())
}

/// The host's cost of one node by kind: a chain of `N` nodes of one kind
/// on a one-row activation (what a decode step's nodes are), timed while
/// built, while MLX encodes and launches it (`async_eval`) and while waited
/// for; the median of `reps` chains, in µs per node. A decode step on the
/// H200 is bound by the first two (src/generate/timing.rs), and how much
/// each kind of node costs tells which nodes are worth fusing away.
fn dispatch_cost(reps: usize) -> mlx_lfm::Result<()> {
    use mlx_lfm::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
    use mlx_lfm::mlx::{self, async_eval, random::normal, Array, Dtype, QuantMode, QuantSpec};
    const N: usize = 200;
    const K: i32 = 2048;
    let bf = Dtype::Bfloat16;
    let x0 = normal(&[1, 1, K], bf, 0.0, 1.0, None)?;
    // And 16 rows, as a stacked 16-sequence step's nodes are: at 16 rows no
    // one-launch layer serves, and MLX's products run as GEMMs (session
    // 57: that step's dispatch 4-10x the one-row step's).
    let x16 = normal(&[16, 1, K], bf, 0.0, 1.0, None)?;
    let w = normal(&[K, K], bf, 0.0, 1.0 / (K as f32).sqrt(), None)?;
    // Held as the model holds a dense weight: its transpose, evaluated.
    let wt = w.transpose(&[1, 0])?;
    let spec = QuantSpec { mode: QuantMode::Affine, bits: 4, group_size: 64 };
    let (qw, qs, qb) = mlx::quantize(&w, spec)?;
    let norm_w = mlx::full(&[K], 1.0, bf)?;
    let one = Array::scalar(1.0, bf)?;
    let mut held = vec![&x0, &x16, &w, &wt, &qw, &qs, &norm_w, &one];
    if let Some(b) = &qb {
        held.push(b);
    }
    mlx::eval(&held)?;
    let add_kernel = |name: &str, inputs: &[&str], outputs: &[&str]| -> mlx_lfm::Result<Option<CudaKernel>> {
        if !cuda_kernels_enabled() {
            return Ok(None);
        }
        let body = "const int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[x_ndim - 1]) y[i] = x[i] + T(1.0f);";
        Ok(Some(CudaKernel::new(name, inputs, outputs, body, "")?))
    };
    let add_one = add_kernel("lfm_bench_add_one", &["x"], &["y"])?;
    // The same launch with seven more inputs it never reads (held weights,
    // as a fused kernel's are): whether MLX's cost is per node or grows
    // with its inputs (the 8B-A1B's step cut 23% of its nodes, dispatch 2%).
    let add_one_wide = add_kernel("lfm_bench_add_one_wide", &["x", "a1", "a2", "a3", "a4", "a5", "a6", "a7"], &["y"])?;
    // And with five more outputs it never writes, as the one-launch layers'
    // scratch rows are outputs (the MoE layer's six, ~140 scratch arrays a
    // step of the 8B-A1B, each allocated at dispatch): whether an output
    // costs what a node does (session 32: its dispatch fell ~4.3 µs a node
    // removed, yet ~1,500 µs a token remained).
    let add_one_outs = add_kernel("lfm_bench_add_one_outs", &["x"], &["y", "z1", "z2", "z3", "z4", "z5"])?;
    let qb_or_w = qb.clone().unwrap_or_else(|| w.clone());
    let wide_inputs = [&w, &wt, &qw, &qs, &qb_or_w, &norm_w, &one];
    type Node<'a> = Box<dyn Fn(&Array) -> mlx_lfm::Result<Array> + 'a>;
    // (Each kind with the activation its chain starts from.)
    let mut kinds: Vec<(&str, &Array, Node)> = vec![
        ("add", &x0, Box::new(|x: &Array| x.add(&one))),
        ("reshape", &x0, Box::new(|x: &Array| x.reshape(&[1, K, 1])?.reshape(&[1, 1, K]))),
        ("matmul", &x0, Box::new(|x: &Array| x.matmul(&wt))),
        ("quantized_matmul", &x0, Box::new(|x: &Array| mlx::quantized_matmul(x, &qw, &qs, qb.as_ref(), true, spec))),
        ("rms_norm", &x0, Box::new(|x: &Array| mlx::rms_norm(x, Some(&norm_w), 1e-5))),
        ("add_16_rows", &x16, Box::new(|x: &Array| x.add(&one))),
        ("matmul_16_rows", &x16, Box::new(|x: &Array| x.matmul(&wt))),
        ("quantized_matmul_16_rows", &x16, Box::new(|x: &Array| mlx::quantized_matmul(x, &qw, &qs, qb.as_ref(), true, spec))),
        ("rms_norm_16_rows", &x16, Box::new(|x: &Array| mlx::rms_norm(x, Some(&norm_w), 1e-5))),
    ];
    for (name, kernel, extra, outs) in [
        ("custom_kernel", &add_one, &wide_inputs[..0], 1),
        ("custom_kernel_8_inputs", &add_one_wide, &wide_inputs[..], 1),
        ("custom_kernel_6_outputs", &add_one_outs, &wide_inputs[..0], 6),
    ] {
        if let Some(k) = kernel {
            kinds.push((
                name,
                &x0,
                Box::new(move |x: &Array| {
                    let shape = x.shape();
                    let ins: Vec<&Array> = std::iter::once(x).chain(extra.iter().copied()).collect();
                    let specs: Vec<(&[i32], Dtype)> = (0..outs).map(|_| (&shape[..], x.dtype())).collect();
                    let mut out = k.call(&ins, &specs, [K, 1, 1], [256, 1, 1], &[("T", TemplateArg::Dtype(x.dtype()))])?;
                    // The chain goes on through the first output (the rest
                    // are dropped here, as a layer's scratch rows are).
                    out.truncate(1);
                    Ok(out.pop().expect("one output"))
                }),
            ));
        }
    }
    for (name, start, node) in &kinds {
        // The reshape pair is two nodes a link.
        let per_link = if *name == "reshape" { 2.0 } else { 1.0 };
        let mut samples: Vec<[f64; 3]> = Vec::new();
        for rep in 0..reps + 1 {
            let t0 = Instant::now();
            let mut x = (*start).clone();
            for _ in 0..N {
                x = node(&x)?;
            }
            let t1 = Instant::now();
            async_eval(&[&x])?;
            let t2 = Instant::now();
            x.eval()?;
            let t3 = Instant::now();
            // The first chain meets each kernel's first launch (JIT, tuning).
            if rep > 0 {
                let us = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e6 / (N as f64 * per_link);
                samples.push([us(t0, t1), us(t1, t2), us(t2, t3)]);
            }
        }
        let med = |i: usize| {
            let mut v: Vec<f64> = samples.iter().map(|s| s[i]).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            (v[v.len() / 2] * 100.0).round() / 100.0
        };
        println!(
            "{}",
            serde_json::json!({"dispatch_cost": name, "nodes": N as f64 * per_link, "build_us": med(0), "dispatch_us": med(1),
                "wait_us": med(2), "backend": runtime::backend().name()})
        );
    }
    Ok(())
}
