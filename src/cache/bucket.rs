//! A prompt's causal attention over its own K/V (the query and the keys of
//! one length: a fresh prompt, a prompt's first chunk, a batch's padded
//! rows) with that length padded up to a multiple of
//! `MLX_LFM_ATTENTION_BUCKET` (opt-in; unset or 0 off). Session 32's rounds
//! on an H100 paid 68-137 ms of TTFT at a prompt length never seen before
//! against 4-60 ms warm, and MLX's CUDA attention keys its cuDNN graphs by
//! the query's and the keys' lengths: with buckets, a server meets a
//! bucket's graph again instead of building one for each new length.
//! Whether attention is what that cost is made of is `run.py shape-cost`'s
//! question; `new-lengths` times this switch against the default.
//!
//! Padding follows the tokens (zeros), so causally no real row sees it:
//! row `i` attends keys `0..=i`, all real; the padded rows are cut off.
//! The sums over keys may group differently at the padded length, so the
//! rows agree with the unpadded attention to rounding, not bit for bit
//! (tests in src/cache/tests.rs).

use crate::error::{Error, Result};
use crate::mlx::{self, Array, Mask};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The largest bucket taken (larger values read as off).
const MAX_BUCKET: i32 = 4096;

/// The bucket `MLX_LFM_ATTENTION_BUCKET` names: 0 (off) unless a number in
/// 2..=4096.
pub fn bucket() -> i32 {
    static B: OnceLock<i32> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_ATTENTION_BUCKET", &B, |v| {
        v.and_then(|s| s.trim().parse::<i32>().ok()).filter(|b| (2..=MAX_BUCKET).contains(b)).unwrap_or(0)
    })
}

static PADDED: AtomicUsize = AtomicUsize::new(0);

/// How many attentions [`causal`] has padded in this process: the tests'
/// evidence that a path took the bucket.
pub fn padded() -> usize {
    PADDED.load(Ordering::Relaxed)
}

/// Causal attention of `q` over `k`, `v` (`[B, heads, L, head_dim]`,
/// `[B, kv_heads, L', head_dim]`): where `L == L'` and a bucket is set,
/// over the length padded to the bucket, the padded rows cut off; MLX's
/// causal attention as it is otherwise.
pub fn causal(q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
    let b = bucket();
    let l = q.dim(2);
    if b == 0 || q.ndim() != 4 || k.dim(2) != l || v.dim(2) != l || l % b == 0 {
        return mlx::sdpa(q, k, v, scale, Mask::Causal);
    }
    let padded = l
        .checked_add(b - 1)
        .map(|x| x / b * b)
        .ok_or_else(|| Error::invalid(format!("attention over {l} positions: past the largest length")))?;
    let pad = |x: &Array| -> Result<Array> {
        let mut shape = x.shape();
        shape[2] = padded - l;
        let zeros = mlx::zeros(&shape, x.dtype())?;
        mlx::concatenate(&[x, &zeros], 2)
    };
    let o = mlx::sdpa(&pad(q)?, &pad(k)?, &pad(v)?, scale, Mask::Causal)?.slice_axis(2, 0, l)?;
    PADDED.fetch_add(1, Ordering::Relaxed);
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::PagedConfig;
    use crate::fixture::{self, FixtureSpec, Preset};
    use crate::knobs::with_overrides;
    use crate::mlx::{random::normal, Dtype};
    use crate::model::{load_model, LoadOptions};

    fn with_bucket<T>(b: &str, f: impl FnOnce() -> T) -> T {
        with_overrides(&[("MLX_LFM_ATTENTION_BUCKET".to_string(), Some(b.to_string()))], f)
    }

    fn values(a: &Array) -> Vec<f32> {
        a.astype(Dtype::Float32).unwrap().to_vec().unwrap()
    }

    #[test]
    fn the_bucket_reads_only_sane_values() {
        for (v, want) in [("0", 0), ("1", 0), ("2", 2), ("64", 64), ("4096", 4096), ("4097", 0), ("-8", 0), ("x", 0), ("", 0)] {
            assert_eq!(with_bucket(v, bucket), want, "MLX_LFM_ATTENTION_BUCKET={v:?}");
        }
    }

    /// The real rows of the padded attention are the unpadded attention's,
    /// to rounding (float32, heads sharing keys as the models' do); a length
    /// already a multiple, or keys longer than the query, run unpadded.
    #[test]
    fn bucketed_rows_are_the_unpadded_rows() {
        for l in [2, 37, 64, 100] {
            let q = normal(&[1, 4, l, 16], Dtype::Float32, 0.0, 1.0, None).unwrap();
            let k = normal(&[1, 2, l, 16], Dtype::Float32, 0.0, 1.0, None).unwrap();
            let v = normal(&[1, 2, l, 16], Dtype::Float32, 0.0, 1.0, None).unwrap();
            let want = values(&mlx::sdpa(&q, &k, &v, 0.25, Mask::Causal).unwrap());
            for b in ["16", "64", "0"] {
                let got = with_bucket(b, || causal(&q, &k, &v, 0.25).unwrap());
                assert_eq!(got.shape(), vec![1, 4, l, 16], "L={l}, bucket {b}");
                let worst = values(&got).iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst <= 1e-5, "L={l}, bucket {b}: the rows differ by {worst}");
                if b == "0" || l % b.parse::<i32>().unwrap() == 0 {
                    assert_eq!(worst, 0.0, "L={l}, bucket {b}: unpadded, so the same bits");
                }
            }
        }
        // Keys past the query (a later chunk): bucketed or not, MLX's own.
        let q = normal(&[1, 4, 5, 16], Dtype::Float32, 0.0, 1.0, None).unwrap();
        let k = normal(&[1, 2, 9, 16], Dtype::Float32, 0.0, 1.0, None).unwrap();
        let want = values(&mlx::sdpa(&q, &k, &k, 0.25, Mask::Causal).unwrap());
        assert_eq!(values(&with_bucket("16", || causal(&q, &k, &k, 0.25).unwrap())), want);
    }

    /// A prompt prefilled with its attention bucketed leaves the caches the
    /// unbucketed prefill leaves: the same greedy tokens after it, the
    /// logits to rounding, on the flat and the paged caches (its padding
    /// never reaches a cache: the K/V stored are the prompt's own).
    #[test]
    fn a_bucketed_prompt_decodes_the_same_tokens() {
        let dir = std::env::temp_dir().join(format!("mlxlfm-bucket-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        let mut spec = FixtureSpec::new(Preset::Tiny);
        spec.dtype = crate::fixture::DType::F32;
        fixture::generate(&spec, &dir).unwrap();
        let prompt: Vec<u32> = (0..37).map(|i| (i * 29 + 11) % 700 + 3).collect();
        let argmax = |v: &[f32]| (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32;
        let run = |block: Option<usize>| -> (Vec<f32>, Vec<u32>) {
            let mut m = load_model(&dir, &LoadOptions::default()).unwrap().model;
            if let Some(bs) = block {
                m.use_paged_cache(PagedConfig { block_size: bs, budget_bytes: 64 << 20 }, 3).unwrap();
            }
            let mut cache = m.new_cache();
            let first = values(&crate::generate::prefill(&m, &mut cache, &prompt, 64).unwrap());
            cache.note_tokens(&prompt);
            let mut tokens = vec![argmax(&first[first.len() - m.config.vocab_size..])];
            for _ in 0..16 {
                let id = *tokens.last().unwrap();
                let ids = Array::from_slice(&[id], &[1, 1]).unwrap();
                let logits = values(&m.forward(&ids, &mut cache, true).unwrap());
                cache.note_tokens(&[id]);
                tokens.push(argmax(&logits[logits.len() - m.config.vocab_size..]));
            }
            (first, tokens)
        };
        for block in [None, Some(16)] {
            let (want, want_tokens) = with_bucket("0", || run(block));
            let before = padded();
            let (got, got_tokens) = with_bucket("16", || run(block));
            // (At least the prompt's attention layers; tests running
            // beside this one may pad too, so no exact count.)
            assert!(padded() > before, "{block:?}: the prompt's attention was not bucketed");
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-4, "{block:?}: the prompt's logits differ by {worst}");
            assert_eq!(got_tokens, want_tokens, "{block:?}: the greedy tokens");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
