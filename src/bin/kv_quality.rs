//! kv_quality: quality, size and speed of the quantized KV caches against
//! the default cache (GitHub issue 7). Runs on a generated checkpoint (real
//! weights cannot be downloaded here). Driven by scripts/kv-quality.cjs.
//!
//!   kv_quality [--preset lfm2-350m|tiny] [--dtype f32|bf16] [--mode quality,study,bench]
//!              [--context 4096] [--steps 64] [--backends default,affine4,...]
//!              [--bench-prompt 1024] [--bench-gen 32] [--reps 2]
//!
//! quality: one prefill of `--context` tokens (corpus text, repeated) with
//!   the default cache; the default cache then decodes `--steps` greedy
//!   tokens, recording its next-token distributions. Each backend starts from
//!   the same prefill (its pending state is exactly the default cache's K/V:
//!   deferred prefill keeps the prompt in full precision, which the unit
//!   tests prove logit-exact) and is fed the same tokens (teacher forcing);
//!   per step: top-1 agreement with the default and KL(default || backend).
//!   "leading" = steps before the first disagreement = how many tokens a
//!   free-running greedy decode reproduces exactly.
//! study: the rotation study: relative MSE of IsoQuant 3-bit with the dense
//!   and the quaternion rotation on this model's own K and V (every
//!   attention layer) and on synthetic isotropic / anisotropic /
//!   outlier-channel vectors; affine 4/8 for scale.
//! bench: prefill and decode tok/s per backend through the engine (default
//!   runs its compiled decode; "default (eager)" is listed for reference).

use mlx_lfm::engine::{DecodePath, Engine, EngineOptions, Prompt};
use mlx_lfm::generate::{prefill, GenerateParams, NoObserver};
use mlx_lfm::kvquant::rotor::{self, HostRotation, Rng};
use mlx_lfm::kvquant::{Codec, KvCacheConfig, KvKind, QuantKvCache, Rotation};
use mlx_lfm::mlx::{eval, Array, Dtype};
use mlx_lfm::cache::LayerCache;
use mlx_lfm::model::{load_model, Lfm2Model, LoadOptions, ModelCache};
use mlx_lfm::text::Tokenizer;
use mlx_lfm::Result;
use std::path::{Path, PathBuf};
use std::time::Instant;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("kv_quality: {e}");
        std::process::exit(1);
    }
}

const ALL: &str = "default,affine8,affine4,rotorquant-dense,rotorquant-quaternion,rotorquant-adaptive";

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let preset = arg(&args, "--preset").unwrap_or_else(|| "lfm2-350m".into());
    let dtype = arg(&args, "--dtype").unwrap_or_else(|| "f32".into());
    let modes = arg(&args, "--mode").unwrap_or_else(|| "study,quality,bench".into());
    let context: usize = arg(&args, "--context").map(|s| s.parse().expect("--context")).unwrap_or(4096);
    let steps: usize = arg(&args, "--steps").map(|s| s.parse().expect("--steps")).unwrap_or(64);
    let backends: Vec<String> = arg(&args, "--backends").unwrap_or_else(|| ALL.into()).split(',').map(String::from).collect();
    let bench_prompt: usize = arg(&args, "--bench-prompt").map(|s| s.parse().expect("--bench-prompt")).unwrap_or(1024);
    let bench_gen: usize = arg(&args, "--bench-gen").map(|s| s.parse().expect("--bench-gen")).unwrap_or(32);
    let reps: usize = arg(&args, "--reps").map(|s| s.parse().expect("--reps")).unwrap_or(2);
    let dir = PathBuf::from(arg(&args, "--model").unwrap_or_else(|| format!("/tmp/mlx-lfm-kvq-{preset}-{dtype}")));
    if !dir.join("config.json").exists() {
        let t = Instant::now();
        mlx_lfm::fixture::generate_named(&preset, &dir, &dtype, "hf", 0)?;
        eprintln!("generated {preset} {dtype} at {} in {:.1}s", dir.display(), t.elapsed().as_secs_f64());
    }
    println!("model: {preset} ({dtype}, generated random weights), MLX {} on {}", mlx_lfm::mlx::runtime::version(), mlx_lfm::mlx::runtime::device_name());
    let tokenizer = Tokenizer::load(&dir)?;
    let mut model = load_model(&dir, &LoadOptions::default())?.model;
    let tokens = corpus_tokens(&tokenizer, context)?;
    for mode in modes.split(',') {
        match mode {
            "study" => study(&model, &tokens[..context.min(2048)])?,
            "quality" => quality(&mut model, &tokens, steps, &backends)?,
            "bench" => bench(&dir, &tokens, bench_prompt, bench_gen, reps, &backends)?,
            m => return Err(mlx_lfm::Error::invalid(format!("--mode: unknown mode {m}"))),
        }
    }
    Ok(())
}

/// `n` tokens of the fixture corpus (English text), repeated as needed.
fn corpus_tokens(tok: &Tokenizer, n: usize) -> Result<Vec<u32>> {
    let once = tok.encode(mlx_lfm::fixture::CORPUS, false)?;
    Ok(once.iter().copied().cycle().take(n).collect())
}

fn cfg(name: &str) -> Result<KvCacheConfig> {
    KvCacheConfig::parse(name, None, "--backends")
}

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let m = l.iter().copied().fold(f32::MIN, f32::max) as f64;
    let z = l.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
    l.iter().map(|&x| x as f64 - z).collect()
}

fn argmax(l: &[f32]) -> u32 {
    l.iter().enumerate().fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32
}

/// A copy of `base` (a default-cache state after prefill) whose attention
/// layers hold the same K/V as `model`'s kvCache setting would after a
/// deferred prefill.
fn convert(model: &Lfm2Model, base: &ModelCache) -> Result<ModelCache> {
    let mut c = base.try_clone()?;
    let len = c.pos;
    for (i, lc) in c.layers.iter_mut().enumerate() {
        if let (LayerCache::Attention(kv), Some(Some(codec))) = (lc, model.kv_codecs.get(i)) {
            let (k, v) = kv.contents(len)?.expect("prefilled");
            kv.quant = Some(Box::new(QuantKvCache::with_pending(codec.clone(), &k, &v)?));
        }
    }
    Ok(c)
}

fn step(model: &Lfm2Model, cache: &mut ModelCache, tok: u32) -> Result<Vec<f32>> {
    let ids = Array::from_slice(&[tok], &[1, 1])?;
    model.forward(&ids, cache, true)?.astype(Dtype::Float32)?.to_vec()
}

fn quality(model: &mut Lfm2Model, tokens: &[u32], steps: usize, backends: &[String]) -> Result<()> {
    model.set_kv_cache(&KvCacheConfig::default())?;
    let t = Instant::now();
    let mut base = model.new_cache();
    let l0 = prefill(model, &mut base, tokens, 512)?.astype(Dtype::Float32)?.to_vec::<f32>()?;
    eval(&base.arrays())?;
    let prefill_s = t.elapsed().as_secs_f64();
    // The default cache's greedy continuation and its distributions.
    let t = Instant::now();
    let mut ref_tokens = vec![argmax(&l0)];
    let mut ref_logp: Vec<Vec<f64>> = vec![];
    let mut c = base.try_clone()?;
    let mut default_bytes = 0;
    for s in 0..steps {
        let l = step(model, &mut c, ref_tokens[s])?;
        ref_tokens.push(argmax(&l));
        ref_logp.push(log_softmax(&l));
        default_bytes = c.kv_used_bytes();
    }
    let default_s = t.elapsed().as_secs_f64();
    let ctx = tokens.len() + steps;
    println!(
        "\nquality: context {} tokens (prefill {:.1}s), {} decode steps teacher-forced on the default cache's greedy tokens ({:.2}s/step default)",
        tokens.len(),
        prefill_s,
        steps,
        default_s / steps as f64
    );
    println!(
        "{:<24} {:>9} {:>8} {:>10} {:>10} {:>12} {:>8} {:>9}",
        "kvCache", "top1 agr", "leading", "mean KL", "max KL", "KV B/1k tok", "vs dflt", "s/step"
    );
    println!(
        "{:<24} {:>8.1}% {:>8} {:>10.2e} {:>10.2e} {:>12} {:>7.2}x {:>9.3}",
        "default", 100.0, steps, 0.0, 0.0, default_bytes * 1000 / ctx, 1.0, default_s / steps as f64
    );
    for name in backends.iter().filter(|b| b.as_str() != "default") {
        model.set_kv_cache(&cfg(name)?)?;
        let mut c = convert(model, &base)?;
        let t = Instant::now();
        let (mut agree, mut leading, mut first_miss, mut kl_sum, mut kl_max) = (0usize, 0usize, false, 0.0f64, 0.0f64);
        for s in 0..steps {
            let l = step(model, &mut c, ref_tokens[s])?;
            let lp = log_softmax(&l);
            let kl: f64 = ref_logp[s].iter().zip(&lp).map(|(&p, &q)| p.exp() * (p - q)).sum();
            kl_sum += kl;
            kl_max = kl_max.max(kl);
            if argmax(&l) == ref_tokens[s + 1] {
                agree += 1;
                if !first_miss {
                    leading += 1;
                }
            } else {
                first_miss = true;
            }
        }
        let secs = t.elapsed().as_secs_f64();
        let bytes = c.kv_used_bytes();
        println!(
            "{:<24} {:>8.1}% {:>8} {:>10.2e} {:>10.2e} {:>12} {:>7.2}x {:>9.3}",
            name,
            100.0 * agree as f64 / steps as f64,
            leading,
            kl_sum / steps as f64,
            kl_max,
            bytes * 1000 / ctx,
            default_bytes as f64 / bytes as f64,
            secs / steps as f64
        );
    }
    model.set_kv_cache(&KvCacheConfig::default())?;
    Ok(())
}

/// Channel spread of a set of vectors: max over channels of the RMS divided
/// by the median channel RMS.
fn outlier_ratio(xs: &[Vec<f32>]) -> f64 {
    let n = xs[0].len();
    let mut rms: Vec<f64> = (0..n).map(|j| (xs.iter().map(|x| (x[j] as f64).powi(2)).sum::<f64>() / xs.len() as f64).sqrt()).collect();
    let max = rms.iter().copied().fold(0.0, f64::max);
    rms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    max / rms[n / 2]
}

fn device_rel_mse(kind: KvKind, xs: &[Vec<f32>]) -> Result<f64> {
    let n = xs[0].len();
    let codec = Codec::new(kind, n)?;
    let flat: Vec<f32> = xs.iter().flatten().copied().collect();
    let x = Array::from_slice(&flat, &[1, 1, xs.len() as i32, n as i32])?;
    let y = codec.roundtrip(&x)?.to_vec::<f32>()?;
    let mut tot = 0.0;
    for (i, v) in xs.iter().enumerate() {
        let nx: f64 = v.iter().map(|&a| (a as f64).powi(2)).sum();
        if nx > 1e-20 {
            tot += v.iter().zip(&y[i * n..(i + 1) * n]).map(|(&a, &b)| (a as f64 - b as f64).powi(2)).sum::<f64>() / nx;
        }
    }
    Ok(tot / xs.len() as f64)
}

fn study_row(label: &str, xs: &[Vec<f32>]) -> Result<(f64, f64)> {
    let n = xs[0].len();
    let dense = rotor::relative_mse(xs, &HostRotation::new(Rotation::Dense, n));
    let quat = rotor::relative_mse(xs, &HostRotation::new(Rotation::Quaternion, n));
    let a4 = device_rel_mse(KvKind::Affine { bits: 4 }, xs)?;
    let a8 = device_rel_mse(KvKind::Affine { bits: 8 }, xs)?;
    println!(
        "{:<34} {:>6} {:>8.1} {:>10.4} {:>10.4} {:>8.2}x {:>10.4} {:>10.5}",
        label,
        xs.len(),
        outlier_ratio(xs),
        dense,
        quat,
        quat / dense,
        a4,
        a8
    );
    Ok((dense, quat))
}

fn study(model: &Lfm2Model, tokens: &[u32]) -> Result<()> {
    let mut c = model.new_cache();
    prefill(model, &mut c, tokens, 512)?.eval()?;
    println!("\nrotation study: relative MSE ||x - x̂||²/||x||² of 3-bit IsoQuant (lower is better); K after RoPE, {} tokens", tokens.len());
    println!(
        "{:<34} {:>6} {:>8} {:>10} {:>10} {:>9} {:>10} {:>10}",
        "vectors", "count", "max/med", "dense", "quaternion", "q/d", "affine4", "affine8"
    );
    let n = model.config.head_dim;
    let (mut sd, mut sq, mut rows) = (0.0, 0.0, 0);
    for (i, lc) in c.layers.iter().enumerate() {
        if let LayerCache::Attention(kv) = lc {
            let (k, v) = kv.contents(c.pos)?.expect("prefilled");
            for (label, a) in [("K", k), ("V", v)] {
                let data = a.astype(Dtype::Float32)?.to_vec::<f32>()?;
                let all: Vec<Vec<f32>> = data.chunks(n).map(|c| c.to_vec()).collect();
                let stride = (all.len() / 4096).max(1);
                let xs: Vec<Vec<f32>> = all.into_iter().step_by(stride).collect();
                let (d, q) = study_row(&format!("model layer {i} {label}"), &xs)?;
                sd += d;
                sq += q;
                rows += 1;
            }
        }
    }
    println!("{:<34} {:>6} {:>8} {:>10.4} {:>10.4} {:>8.2}x", "model K/V mean", "", "", sd / rows as f64, sq / rows as f64, sq / sd);
    let mut rng = Rng::new(99);
    let gauss: Vec<Vec<f32>> = (0..4096).map(|_| (0..n).map(|_| rng.normal() as f32).collect()).collect();
    study_row("synthetic isotropic Gaussian", &gauss)?;
    let scales: Vec<f64> = (0..n).map(|_| rng.normal().exp()).collect();
    let aniso: Vec<Vec<f32>> = (0..4096).map(|_| scales.iter().map(|s| (rng.normal() * s) as f32).collect()).collect();
    study_row("synthetic anisotropic (lognormal)", &aniso)?;
    let outl: Vec<Vec<f32>> = (0..4096)
        .map(|_| (0..n).map(|j| (rng.normal() * if j % 16 == 3 { 20.0 } else { 1.0 }) as f32).collect())
        .collect();
    study_row("synthetic 4 outlier channels x20", &outl)?;
    let mut both = aniso.clone();
    for x in &mut both {
        for j in (3..n).step_by(16) {
            x[j] *= 20.0;
        }
    }
    study_row("synthetic anisotropic + outliers", &both)?;
    Ok(())
}

fn bench(dir: &Path, tokens: &[u32], prompt: usize, gen: usize, reps: usize, backends: &[String]) -> Result<()> {
    let prompt: Vec<u32> = tokens.iter().copied().cycle().take(prompt).collect();
    println!("\nbenchmark: prompt {} tokens, {} generated (greedy, ignore EOS), best of {reps}", prompt.len(), gen);
    println!("{:<24} {:>9} {:>12} {:>12} {:>14}", "kvCache", "decode", "prefill t/s", "decode t/s", "KV B/token");
    let mut rows: Vec<(String, Option<DecodePath>)> = vec![];
    for b in backends {
        rows.push((b.clone(), None));
        if b == "default" {
            rows.push((b.clone(), Some(DecodePath::Eager)));
        }
    }
    for (name, path) in rows {
        let opts = EngineOptions { kv_cache: Some(name.clone()), decode_path: path, ..Default::default() };
        let mut eng = Engine::load(dir, &opts)?;
        let info = eng.info();
        let warm = GenerateParams { max_tokens: 4, ignore_eos: true, ..Default::default() };
        eng.generate(Prompt::Tokens(prompt[..64.min(prompt.len())].to_vec()), warm, &mut NoObserver)?;
        let (mut pre, mut dec) = (0f64, 0f64);
        for _ in 0..reps.max(1) {
            let params = GenerateParams { max_tokens: gen, ignore_eos: true, ..Default::default() };
            let g = eng.generate(Prompt::Tokens(prompt.clone()), params, &mut NoObserver)?;
            pre = pre.max(g.metrics.prefill_tokens_per_second);
            dec = dec.max(g.metrics.decode_tokens_per_second);
        }
        println!("{:<24} {:>9} {:>12.1} {:>12.2} {:>14}", name, info.decode_path, pre, dec, info.kv_bytes_per_token);
    }
    Ok(())
}
