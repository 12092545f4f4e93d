//! A prompt's causal attention with its lengths padded up to a multiple of
//! a bucket (`MLX_LFM_ATTENTION_BUCKET`: a number in 2..=4096, or 0 for
//! off; unset: 128 where MLX's CUDA attention runs, off elsewhere).
//!
//! Why: MLX's CUDA attention keys its cuDNN graphs by the query's and the
//! keys' lengths, and building one is what a prompt length never seen
//! before costs. Session 33 (an H100, `bench/results/2026-12-05-h100-session33.raw.jsonl`):
//! `shape-cost` timed causal attention at a new length at 67-129 ms against
//! 0.12 ms seen, while the products and RMSNorm at a new length cost 0-4 ms;
//! `new-lengths` put a new length's TTFT at 72 ms (1.2B, median of 8)
//! and 94 ms (8B-A1B) by default, 10 and 24 ms with a bucket of 128
//! (a seen length's: 6-7 and 23). With buckets a server meets a
//! bucket's graph again instead of building one for each new length. Other
//! backends plan nothing per length, so padding would only add work there.
//!
//! Both lengths grow by the same padding, at the end: the keys' length to
//! the next multiple of the bucket, the query by as many rows (a later
//! chunk, whose keys also hold the positions before it, keeps its offset
//! between the two, so where that offset is a multiple of the bucket, as
//! the prefill chunks are, both lengths land on buckets). MLX's causal
//! mask aligns the query's last row with the keys' last, so each real row
//! still attends exactly the real keys up to its own position; the padded
//! rows (zeros) are cut off. The sums over keys may group differently at
//! the padded length, so the rows agree with the unpadded attention to
//! rounding, not bit for bit (tests below and in src/cache/tests.rs).

use crate::error::{Error, Result};
use crate::mlx::{self, Array, Mask};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The largest bucket taken (larger values read as off).
const MAX_BUCKET: i32 = 4096;

/// The bucket in use: `MLX_LFM_ATTENTION_BUCKET` when set (0, or a value
/// outside 2..=4096, is off), else [`DEFAULT_BUCKET`] where MLX's CUDA
/// attention runs (the CUDA build with the GPU as the default device,
/// asked each time: a test may move the default device) and off elsewhere.
pub fn bucket() -> i32 {
    static B: OnceLock<Option<i32>> = OnceLock::new();
    let set = crate::knobs::cached("MLX_LFM_ATTENTION_BUCKET", &B, |v| {
        v.map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.parse::<i32>().ok().filter(|b| (2..=MAX_BUCKET).contains(b)).unwrap_or(0))
    });
    set.unwrap_or_else(|| {
        let cuda = mlx::runtime::backend() == mlx::runtime::Backend::Cuda
            && mlx::runtime::default_device() == mlx::runtime::DeviceType::Gpu;
        if cuda {
            DEFAULT_BUCKET
        } else {
            0
        }
    })
}

/// The bucket where it is on by default: session 33's `new-lengths` timed
/// 128 (a 512-token prompt pads nothing; a new length pads at most 127
/// rows, ~4 ms of the 1.2B's TTFT against the ~65 ms a new graph cost).
pub const DEFAULT_BUCKET: i32 = 128;

static PADDED: AtomicUsize = AtomicUsize::new(0);

/// How many attentions [`causal`] has padded in this process: the tests'
/// evidence that a path took the bucket.
pub fn padded() -> usize {
    PADDED.load(Ordering::Relaxed)
}

/// Causal attention of `q` over `k`, `v` (`[B, heads, L, head_dim]`,
/// `[B, kv_heads, L', head_dim]`, `L' >= L`): where a bucket is set and
/// `L'` is not a multiple of it, both lengths padded by the same rows
/// (`L'` to the next multiple), the padded rows cut off; MLX's causal
/// attention as it is otherwise.
pub fn causal(q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
    let b = bucket();
    // (Shapes checked before they are read: MLX's attention names a bad one.)
    if b == 0 || q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 {
        return mlx::sdpa(q, k, v, scale, Mask::Causal);
    }
    let (l, lk) = (q.dim(2), k.dim(2));
    if lk < l || v.dim(2) != lk || lk % b == 0 {
        return mlx::sdpa(q, k, v, scale, Mask::Causal);
    }
    let rows = lk
        .checked_add(b - 1)
        .map(|x| x / b * b - lk)
        .ok_or_else(|| Error::invalid(format!("attention over {lk} positions: past the largest length")))?;
    let pad = |x: &Array| -> Result<Array> {
        let mut shape = x.shape();
        shape[2] = rows;
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
        for (v, want) in [("0", 0), ("1", 0), ("2", 2), ("64", 64), ("4096", 4096), ("4097", 0), ("-8", 0), ("x", 0)] {
            assert_eq!(with_bucket(v, bucket), want, "MLX_LFM_ATTENTION_BUCKET={v:?}");
        }
        // Unset (or empty): the default, on only where MLX's CUDA attention
        // runs; these tests run on the CPU build or device.
        let unset = [("MLX_LFM_ATTENTION_BUCKET".to_string(), None)];
        let cuda = mlx::runtime::backend() == mlx::runtime::Backend::Cuda
            && mlx::runtime::default_device() == mlx::runtime::DeviceType::Gpu;
        let want = if cuda { DEFAULT_BUCKET } else { 0 };
        assert_eq!(with_overrides(&unset, bucket), want, "unset");
        assert_eq!(with_bucket("", bucket), want, "empty");
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
        // Keys past the query (a later chunk, or a prompt after a reused
        // prefix): both padded by the keys' rows to their bucket, the real
        // rows still MLX's own to rounding; keys already on a bucket unpadded.
        for (l, lk) in [(5, 9), (1, 3), (20, 50), (16, 48), (7, 64)] {
            let q = normal(&[1, 4, l, 16], Dtype::Float32, 0.0, 1.0, None).unwrap();
            let k = normal(&[1, 2, lk, 16], Dtype::Float32, 0.0, 1.0, None).unwrap();
            let v = normal(&[1, 2, lk, 16], Dtype::Float32, 0.0, 1.0, None).unwrap();
            let want = values(&mlx::sdpa(&q, &k, &v, 0.25, Mask::Causal).unwrap());
            let before = padded();
            let got = with_bucket("16", || causal(&q, &k, &v, 0.25).unwrap());
            assert_eq!(got.shape(), vec![1, 4, l, 16], "L={l}, L'={lk}");
            let worst = values(&got).iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-5, "L={l}, L'={lk}: the rows differ by {worst}");
            if lk % 16 == 0 {
                assert_eq!(worst, 0.0, "L={l}, L'={lk}: unpadded, so the same bits");
            } else {
                // (Tests beside this one may pad too: at least this one.)
                assert!(padded() > before, "L={l}, L'={lk}: not padded");
            }
        }
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
        let run = |block: Option<usize>, chunk: usize| -> (Vec<f32>, Vec<u32>) {
            let mut m = load_model(&dir, &LoadOptions::default()).unwrap().model;
            if let Some(bs) = block {
                m.use_paged_cache(PagedConfig { block_size: bs, budget_bytes: 64 << 20 }, 3).unwrap();
            }
            let mut cache = m.new_cache();
            let first = values(&crate::generate::prefill(&m, &mut cache, &prompt, chunk).unwrap());
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
        // One chunk (keys of the query's length), and chunks of 16 (later
        // chunks attend keys past their rows: 16 + 16, then 5 over 37).
        for (block, chunk) in [(None, 64), (Some(16), 64), (None, 16), (Some(16), 16)] {
            let (want, want_tokens) = with_bucket("0", || run(block, chunk));
            let before = padded();
            let (got, got_tokens) = with_bucket("16", || run(block, chunk));
            // (At least the prompt's attention layers; tests running
            // beside this one may pad too, so no exact count.)
            assert!(padded() > before, "{block:?}, chunk {chunk}: the prompt's attention was not bucketed");
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-4, "{block:?}, chunk {chunk}: the prompt's logits differ by {worst}");
            assert_eq!(got_tokens, want_tokens, "{block:?}, chunk {chunk}: the greedy tokens");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
