//! The quantizer suite, the ten deferred-prefill regression tests of the
//! spec (numbered as there), and model-level checks on a generated fixture.

use super::cache::{Phase, QuantKvCache};
use super::codec::Codec;
use super::pack;
use super::rotor::{self, HostRotation, Rng};
use super::{KvCacheConfig, KvKind, Rotation};
use crate::mlx::{random, Array, Dtype};

const KINDS: [KvKind; 4] =
    [KvKind::Affine { bits: 4 }, KvKind::Affine { bits: 8 }, KvKind::Rotor(Rotation::Dense), KvKind::Rotor(Rotation::Quaternion)];

fn gaussian(count: usize, n: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(seed);
    (0..count).map(|_| (0..n).map(|_| rng.normal() as f32).collect()).collect()
}

/// Anisotropic with outlier channels: per-channel scales spread over two
/// decades, plus 4 channels 20x larger (the shape real K vectors have).
fn outlier_heavy(count: usize, n: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(seed);
    let scales: Vec<f64> = (0..n).map(|i| if i % 16 == 3 { 20.0 } else { (rng.normal() * 1.0).exp() }).collect();
    (0..count).map(|_| scales.iter().map(|s| (rng.normal() * s) as f32).collect()).collect()
}

fn norm(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

fn randn(shape: &[i32], seed: u64) -> Array {
    let k = random::key(seed).unwrap();
    random::normal(shape, Dtype::Float32, 0.0, 1.0, Some(&k)).unwrap()
}

fn max_diff(a: &Array, b: &Array) -> f32 {
    let a = a.to_vec::<f32>().unwrap();
    let b = b.to_vec::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn rotor_cache(n: usize) -> QuantKvCache {
    QuantKvCache::new(Codec::new(KvKind::Rotor(Rotation::Dense), n).unwrap())
}

// ---------------------------------------------------------------------------
// Test 10 and the quantizer suite
// ---------------------------------------------------------------------------

#[test]
fn quaternion_table_is_unit_norm() {
    for q in rotor::quaternion_table(32, rotor::QUATERNION_SEED) {
        let n = q.iter().map(|v| v * v).sum::<f64>().sqrt();
        assert!((n - 1.0).abs() < 1e-6);
    }
}

#[test]
fn rotations_preserve_norms_and_invert() {
    for kind in [Rotation::Dense, Rotation::Quaternion] {
        for n in [16, 24, 64, 80, 128] {
            let r = HostRotation::new(kind, n);
            for x in gaussian(50, n, n as u64) {
                let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
                let y = r.apply(&x);
                assert!((norm(&y) / norm(&x) - 1.0).abs() < 1e-4, "{kind:?} n={n}: norm not preserved");
                let back = r.apply_inv(&y);
                let err = x.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                assert!(err < 1e-9, "{kind:?} n={n}: inverse∘forward off by {err}");
            }
        }
    }
}

#[test]
fn quaternion_matrix_is_the_hamilton_product() {
    let n = 64;
    let r = HostRotation::quaternion(n);
    for x in gaussian(10, n, 3) {
        let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let a = r.apply(&x);
        let b = HostRotation::quaternion_by_products(&x, false);
        let c = HostRotation::quaternion_by_products(&b, true);
        for i in 0..n {
            assert!((a[i] - b[i]).abs() < 1e-12);
            assert!((c[i] - x[i]).abs() < 1e-12);
        }
    }
}

#[test]
fn quantizer_indices_norm_ratio_and_gaussian_mse() {
    for kind in [Rotation::Dense, Rotation::Quaternion] {
        for n in [64, 128] {
            let r = HostRotation::new(kind, n);
            let xs = gaussian(2000, n, 11);
            for x in xs.iter().take(200) {
                let code = rotor::quantize_host(x, &r);
                assert!(code.idx.iter().all(|&i| i < 8));
                let xh = rotor::dequantize_host(&code, &r);
                let ratio = xh.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt()
                    / x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
                assert!((ratio - 1.0).abs() < 1e-5, "norm ratio {ratio}");
            }
            let mse = rotor::relative_mse(&xs, &r);
            assert!((0.030..0.038).contains(&mse), "{kind:?} n={n}: relative MSE {mse} on Gaussian input, expected ≈ 0.034");
        }
    }
}

#[test]
fn zero_vector_and_ties() {
    let r = HostRotation::new(Rotation::Dense, 64);
    let code = rotor::quantize_host(&[0.0; 64], &r);
    assert!(code.idx.iter().all(|&i| i < 8));
    assert!(rotor::dequantize_host(&code, &r).iter().all(|v| v.abs() < 1e-9));
    // A coordinate exactly on a boundary goes to the lower level.
    let b = rotor::boundaries(64);
    assert_eq!(b.iter().filter(|&&t| b[5] > t).count(), 5);
}

#[test]
fn dense_beats_quaternion_on_outlier_channels() {
    let n = 64;
    let xs = outlier_heavy(2000, n, 5);
    let dense = rotor::relative_mse(&xs, &HostRotation::new(Rotation::Dense, n));
    let quat = rotor::relative_mse(&xs, &HostRotation::new(Rotation::Quaternion, n));
    assert!(dense < 0.04, "dense relative MSE {dense}");
    assert!(quat > 2.0 * dense, "quaternion {quat} vs dense {dense}");
}

#[test]
fn pack3_matches_host_layout() {
    for n in [16, 24, 64, 80, 128] {
        let l = pack::lanes(n);
        let g = pack::words(n);
        let idx: Vec<i32> = (0..3 * l).map(|i| ((i * 5 + i / 7) % 8) as i32).collect();
        let a = Array::from_slice(&idx, &[3, l as i32]).unwrap();
        let (lo, hi) = pack::pack3(&a).unwrap();
        assert_eq!((lo.shape(), lo.dtype()), (vec![3, g as i32], Dtype::Uint16));
        assert_eq!((hi.shape(), hi.dtype()), (vec![3, g as i32], Dtype::Uint8));
        let lo_b = lo.to_bytes().unwrap();
        let lo_w: Vec<u16> = lo_b.chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        let hi_b = hi.to_bytes().unwrap();
        for row in 0..3 {
            let host_idx: Vec<u8> = idx[row * l..(row + 1) * l].iter().map(|&v| v as u8).collect();
            let (hl, hh) = pack::pack3_host(&host_idx);
            assert_eq!(&lo_w[row * g..(row + 1) * g], hl.as_slice(), "n={n}");
            assert_eq!(&hi_b[row * g..(row + 1) * g], hh.as_slice(), "n={n}");
            assert_eq!(pack::unpack3_host(&hl, &hh, l), host_idx);
        }
        // The device unpack gives back each lane's level (at scale 1).
        let tables = pack::tables([rotor::LEVELS[4], rotor::LEVELS[5], rotor::LEVELS[6], rotor::LEVELS[7]]).unwrap();
        let levels = pack::unpack_scaled(&lo, &hi, &Array::from_slice(&[1f32; 3], &[3, 1]).unwrap(), &tables)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        for (v, &i) in levels.iter().zip(&idx) {
            assert!((*v as f64 - rotor::LEVELS[i as usize]).abs() < 1e-6, "{v} vs level {i}");
        }
    }
}

#[test]
fn device_codec_matches_host_reference() {
    for kind in [Rotation::Dense, Rotation::Quaternion] {
        for n in [64, 128, 80] {
            let codec = Codec::new(KvKind::Rotor(kind), n).unwrap();
            let hr = HostRotation::new(kind, n);
            let xs = gaussian(64, n, 21);
            let flat: Vec<f32> = xs.iter().flatten().copied().collect();
            let x = Array::from_slice(&flat, &[1, 2, 32, n as i32]).unwrap();
            let parts = codec.encode(&x).unwrap();
            let g = pack::words(n);
            assert_eq!(parts[0].shape(), vec![1, 2, 32, g as i32]);
            assert_eq!(parts[2].dtype(), Dtype::Float16);
            let lo: Vec<u16> = parts[0].to_bytes().unwrap().chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
            let hi = parts[1].to_bytes().unwrap();
            let norms = parts[2].to_vec::<f32>().unwrap();
            let mut mismatched = 0;
            for (i, v) in xs.iter().enumerate() {
                let h = rotor::quantize_host(v, &hr);
                let d = pack::unpack3_host(&lo[i * g..(i + 1) * g], &hi[i * g..(i + 1) * g], n);
                mismatched += d.iter().zip(&h.idx).filter(|(a, b)| a != b).count();
                assert!((norms[i] / h.norm - 1.0).abs() < 1e-3, "norm {} vs {}", norms[i], h.norm);
            }
            // f32 device vs f64 host may split a value sitting on a boundary.
            assert!(mismatched <= 2, "{kind:?} n={n}: {mismatched} indices differ from the host reference");
            // Reconstruction: norm ratio 1 (fp16 norm) and ≈ 0.034 relative error.
            let xh = codec.roundtrip(&x).unwrap().to_vec::<f32>().unwrap();
            let mut err = 0.0;
            for (i, v) in xs.iter().enumerate() {
                let r = &xh[i * n..(i + 1) * n];
                let nx: f64 = v.iter().map(|&a| (a as f64).powi(2)).sum();
                let nr: f64 = r.iter().map(|&a| (a as f64).powi(2)).sum();
                assert!(((nr / nx).sqrt() - 1.0).abs() < 1e-3);
                err += v.iter().zip(r).map(|(&a, &b)| (a as f64 - b as f64).powi(2)).sum::<f64>() / nx;
                let hx = rotor::dequantize_host(&rotor::quantize_host(v, &hr), &hr);
                let dh = hx.iter().zip(r).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                let scale = (nx as f32).sqrt();
                assert!(dh / scale < 2e-3 || mismatched > 0, "device vs host reconstruction differ by {dh}");
            }
            let mse = err / xs.len() as f64;
            assert!(mse < 0.05, "{kind:?} n={n}: device relative MSE {mse}");
        }
    }
}

#[test]
fn bytes_per_vector() {
    let rq = Codec::new(KvKind::Rotor(Rotation::Dense), 64).unwrap();
    assert_eq!(rq.bytes_per_vector(Dtype::Bfloat16), 26); // 3.25 bits/value incl. norm
    assert_eq!(Codec::new(KvKind::Rotor(Rotation::Dense), 128).unwrap().bytes_per_vector(Dtype::Bfloat16), 50);
    assert_eq!(Codec::new(KvKind::Affine { bits: 4 }, 64).unwrap().bytes_per_vector(Dtype::Bfloat16), 36);
    assert_eq!(Codec::new(KvKind::Affine { bits: 8 }, 64).unwrap().bytes_per_vector(Dtype::Bfloat16), 68);
    // The bytes the cache actually holds after going live.
    let mut c = rotor_cache(64);
    c.update(&randn(&[1, 8, 300, 64], 1), &randn(&[1, 8, 300, 64], 2)).unwrap();
    c.update(&randn(&[1, 8, 1, 64], 3), &randn(&[1, 8, 1, 64], 4)).unwrap();
    assert_eq!(c.phase(), Phase::Live);
    assert_eq!(c.used_bytes(), 301 * 8 * 2 * 26);
    assert_eq!(Codec::new(KvKind::Rotor(Rotation::Dense), 16).unwrap().bytes_per_vector(Dtype::Bfloat16), 8);
    let cap = c.nbytes() / (8 * 2 * 26);
    assert!(cap >= 301 && cap.is_multiple_of(crate::cache::KV_STEP));
}

#[test]
fn every_head_size_works_for_every_codec() {
    for kind in KINDS {
        for n in [16usize, 24, 32, 64, 80, 96, 128, 256] {
            let codec = Codec::new(kind, n).unwrap();
            let x = randn(&[1, 2, 5, n as i32], n as u64);
            let y = codec.roundtrip(&x).unwrap();
            assert_eq!(y.shape(), x.shape());
            let num = x.sub(&y).unwrap().square().unwrap().sum(&[], false).unwrap().item::<f32>().unwrap();
            let den = x.square().unwrap().sum(&[], false).unwrap().item::<f32>().unwrap();
            let limit = match kind {
                KvKind::Affine { bits: 8 } => 1e-3,
                KvKind::Affine { .. } => 0.03,
                _ => 0.08,
            };
            assert!(num / den < limit, "{kind:?} n={n}: relative error {}", num / den);
        }
    }
}

// ---------------------------------------------------------------------------
// Deferred prefill: tests 1-9
// ---------------------------------------------------------------------------

/// Test 7 (and the prefill half of 1): a prefill call returns its own inputs.
#[test]
fn t7_prefill_returns_its_inputs() {
    for kind in KINDS {
        let mut c = QuantKvCache::new(Codec::new(kind, 64).unwrap());
        let (k, v) = (randn(&[1, 2, 100, 64], 1), randn(&[1, 2, 100, 64], 2));
        let f = c.update(&k, &v).unwrap();
        assert!(!f.rotated);
        assert!(max_diff(&f.keys, &k) <= 1e-3 && max_diff(&f.values, &v) <= 1e-3);
        let (k2, v2) = (randn(&[1, 2, 50, 64], 3), randn(&[1, 2, 50, 64], 4));
        let f = c.update(&k2, &v2).unwrap();
        assert!(max_diff(&f.keys.slice_axis(2, 100, 150).unwrap(), &k2) <= 1e-3);
        assert!(max_diff(&f.values.slice_axis(2, 0, 100).unwrap(), &v) <= 1e-3);
        assert_eq!(c.stats.quantized_tokens, 0);
    }
}

/// Test 1: offset advances on every prefill chunk; one decode -> +1.
#[test]
fn t1_offset_advances_over_chunks() {
    let mut c = rotor_cache(64);
    c.update(&randn(&[1, 2, 100, 64], 1), &randn(&[1, 2, 100, 64], 2)).unwrap();
    assert_eq!(c.offset(), 100);
    c.update(&randn(&[1, 2, 150, 64], 3), &randn(&[1, 2, 150, 64], 4)).unwrap();
    assert_eq!(c.offset(), 250);
    assert_eq!(c.phase(), Phase::Pending);
    let f = c.update(&randn(&[1, 2, 1, 64], 5), &randn(&[1, 2, 1, 64], 6)).unwrap();
    assert_eq!(c.offset(), 251);
    assert_eq!(f.keys.dim(2), 251);
    assert_eq!(c.phase(), Phase::Live);
    assert_eq!(c.stats.bulk_quantizations, 1);
    assert_eq!(c.stats.quantized_tokens, 251);
}

/// A prompt's chunks over a quantized cache attend through the attention
/// buckets (`MLX_LFM_ATTENTION_BUCKET`): the rows to rounding of the
/// unbucketed attention's, for every codec, over the first chunk (keys of
/// the query's length) and a later one (keys past it), and the padded
/// path taken.
#[test]
fn prefill_chunks_take_the_attention_buckets() {
    for kind in KINDS {
        let chunks = [(37, 1u64), (21, 5)];
        let run = |bucket: &str| -> Vec<Array> {
            let set = [("MLX_LFM_ATTENTION_BUCKET".to_string(), Some(bucket.to_string()))];
            crate::knobs::with_overrides(&set, || {
                let mut c = QuantKvCache::new(Codec::new(kind, 64).unwrap());
                chunks
                    .iter()
                    .map(|&(t, seed)| {
                        let (q, k, v) = (randn(&[1, 4, t, 64], seed), randn(&[1, 2, t, 64], seed + 1), randn(&[1, 2, t, 64], seed + 2));
                        let o = c.attend(&q, &k, &v, 0.125).unwrap();
                        o.eval().unwrap();
                        o
                    })
                    .collect()
            })
        };
        let want = run("0");
        let before = crate::cache::bucket::padded();
        let got = run("16");
        assert!(crate::cache::bucket::padded() >= before + 2, "{kind:?}: the chunks were not bucketed");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.shape(), w.shape(), "{kind:?}: chunk {i}");
            let d = max_diff(g, w);
            assert!(d <= 1e-4, "{kind:?}: chunk {i}: {d} from the unbucketed rows");
        }
    }
}

/// Test 2: a 1-token first call with nothing pending.
#[test]
fn t2_one_token_first_call() {
    for kind in KINDS {
        let mut c = QuantKvCache::new(Codec::new(kind, 64).unwrap());
        let k = randn(&[1, 2, 1, 64], 1);
        let q = randn(&[1, 4, 1, 64], 9);
        let o = c.attend(&q, &k, &k, 0.125).unwrap();
        assert_eq!(o.shape(), vec![1, 4, 1, 64]);
        assert_eq!(c.offset(), 1);
        assert_eq!(c.phase(), Phase::Pending);
        c.attend(&q, &k, &k, 0.125).unwrap();
        assert_eq!((c.offset(), c.phase()), (2, Phase::Live));
    }
}

fn same_contents(a: &QuantKvCache, b: &QuantKvCache) {
    assert_eq!(a.offset(), b.offset());
    assert_eq!(a.phase(), b.phase());
    assert_eq!(a.used_bytes(), b.used_bytes());
    let (fa, fb) = (a.fetch(Dtype::Float32).unwrap(), b.fetch(Dtype::Float32).unwrap());
    assert_eq!(fa.keys.to_bytes().unwrap(), fb.keys.to_bytes().unwrap());
    assert_eq!(fa.values.to_bytes().unwrap(), fb.values.to_bytes().unwrap());
}

/// Test 3: state round trip in the pending and the live phase.
#[test]
fn t3_state_round_trip() {
    for kind in KINDS {
        let codec = Codec::new(kind, 64).unwrap();
        let mut c = QuantKvCache::new(codec.clone());
        c.update(&randn(&[1, 2, 40, 64], 1), &randn(&[1, 2, 40, 64], 2)).unwrap();
        let mut r = QuantKvCache::new(codec.clone());
        r.restore(&c.state().unwrap()).unwrap();
        same_contents(&c, &r);
        assert_eq!(r.nbytes(), r.used_bytes());
        for s in 0..3 {
            c.update(&randn(&[1, 2, 1, 64], 10 + s), &randn(&[1, 2, 1, 64], 20 + s)).unwrap();
        }
        assert_eq!(c.phase(), Phase::Live);
        let mut r = QuantKvCache::new(codec.clone());
        r.restore(&c.state().unwrap()).unwrap();
        same_contents(&c, &r);
        // Both keep working identically after the restore.
        let (k, v) = (randn(&[1, 2, 1, 64], 40), randn(&[1, 2, 1, 64], 41));
        c.update(&k, &v).unwrap();
        r.update(&k, &v).unwrap();
        same_contents(&c, &r);
    }
}

/// Test 4: appends are amortised O(n): geometric growth, no concat per chunk.
#[test]
fn t4_appends_are_amortised() {
    let mut c = rotor_cache(64);
    let (k, v) = (randn(&[1, 2, 7, 64], 1), randn(&[1, 2, 7, 64], 2));
    for _ in 0..300 {
        c.update(&k, &v).unwrap();
    }
    let n = 2100;
    assert_eq!(c.offset(), n);
    // Capacities 256, 512, 768, 1280, 2048, 3072: 6 allocations, and the
    // copies sum to less than 3n (x1.5 growth), not ~n²/(2·chunk).
    assert_eq!(c.stats.allocations, 6, "{:?}", c.stats);
    assert!(c.stats.copied_tokens <= 3 * n, "{:?}", c.stats);
    // Decode: the same for one token at a time.
    let before = c.stats.clone();
    let (k1, v1) = (randn(&[1, 2, 1, 64], 3), randn(&[1, 2, 1, 64], 4));
    for _ in 0..1000 {
        c.update(&k1, &v1).unwrap();
    }
    // The bulk quantization allocates the quantized region once (2304
    // tokens) and it grows once more (3456): 2 allocations, 2304 copied.
    assert_eq!(c.stats.allocations - before.allocations, 2, "{:?}", c.stats);
    assert!(c.stats.copied_tokens - before.copied_tokens <= 3 * 3100);
}

/// Test 5: head sizes are per layer, checked on every attention layer, and
/// every size is supported (no fallback).
#[test]
fn t5_head_sizes_every_layer() {
    // Every attention layer builds its own codec from its own head_dim.
    let cfg = KvCacheConfig::parse("rotorquant", None, "kvCache").unwrap();
    let kinds = cfg.layer_kinds(&[false, true, false, true, true]).unwrap();
    for (layer, hd) in [(1, 64usize), (3, 80), (4, 16)] {
        let kind = kinds[layer].unwrap();
        let mut c = QuantKvCache::new(Codec::new(kind, hd).unwrap());
        c.update(&randn(&[1, 2, 9, hd as i32], 1), &randn(&[1, 2, 9, hd as i32], 2)).unwrap();
        c.update(&randn(&[1, 2, 1, hd as i32], 3), &randn(&[1, 2, 1, hd as i32], 4)).unwrap();
        assert_eq!(c.phase(), Phase::Live);
        // A K/V of another head size than the layer's codec is an error, not garbage.
        let mut c = QuantKvCache::new(Codec::new(kind, hd).unwrap());
        assert!(c.update(&randn(&[1, 2, 3, 32], 1), &randn(&[1, 2, 3, 32], 2)).is_err());
    }
    assert!(Codec::new(KvKind::Rotor(Rotation::Dense), 0).is_err());
}

/// Test 6: restoring a live state drops pending buffers and vice versa.
#[test]
fn t6_restore_drops_the_other_region() {
    let mut live = rotor_cache(64);
    live.update(&randn(&[1, 2, 30, 64], 1), &randn(&[1, 2, 30, 64], 2)).unwrap();
    live.update(&randn(&[1, 2, 1, 64], 3), &randn(&[1, 2, 1, 64], 4)).unwrap();
    let live_state = live.state().unwrap();
    assert!(live_state.pending.is_none());
    let mut pend = rotor_cache(64);
    pend.update(&randn(&[1, 2, 50, 64], 5), &randn(&[1, 2, 50, 64], 6)).unwrap();
    let pend_state = pend.state().unwrap();
    assert!(pend_state.keys.is_empty());

    // A mixed cache (live prefix + a new pending prompt).
    let mut c = rotor_cache(64);
    c.update(&randn(&[1, 2, 20, 64], 7), &randn(&[1, 2, 20, 64], 8)).unwrap();
    c.update(&randn(&[1, 2, 1, 64], 9), &randn(&[1, 2, 1, 64], 10)).unwrap();
    c.update(&randn(&[1, 2, 10, 64], 11), &randn(&[1, 2, 10, 64], 12)).unwrap();
    assert_eq!(c.phase(), Phase::Mixed);

    let mut m = c.clone();
    m.restore(&live_state).unwrap();
    assert_eq!((m.phase(), m.offset(), m.pending_len()), (Phase::Live, 31, 0));
    assert_eq!(m.nbytes(), 31 * 2 * 2 * 26);
    assert_eq!(m.nbytes(), m.used_bytes());
    same_contents(&m, &live);

    let mut m = c.clone();
    m.restore(&pend_state).unwrap();
    assert_eq!((m.phase(), m.offset(), m.quantized_len()), (Phase::Pending, 50, 0));
    assert_eq!(m.nbytes(), 50 * 2 * 2 * 64 * 4);
    assert_eq!(m.nbytes(), m.used_bytes());
    same_contents(&m, &pend);
}

/// Test 8: trim in both phases.
#[test]
fn t8_trim_both_phases() {
    let mut c = rotor_cache(64);
    let (k, v) = (randn(&[1, 2, 100, 64], 1), randn(&[1, 2, 100, 64], 2));
    c.update(&k, &v).unwrap();
    assert_eq!(c.trim(30), 30);
    assert_eq!((c.offset(), c.phase()), (70, Phase::Pending));
    let f = c.fetch(Dtype::Float32).unwrap();
    assert_eq!(f.keys.to_bytes().unwrap(), k.slice_axis(2, 0, 70).unwrap().contiguous().unwrap().to_bytes().unwrap());
    // Go live at 71, trim 11 (quantized tokens), then keep decoding.
    c.update(&randn(&[1, 2, 1, 64], 3), &randn(&[1, 2, 1, 64], 4)).unwrap();
    let before = c.fetch(Dtype::Float32).unwrap().keys.slice_axis(2, 0, 60).unwrap().to_bytes().unwrap();
    assert_eq!(c.trim(11), 11);
    assert_eq!((c.offset(), c.phase()), (60, Phase::Live));
    let (k1, v1) = (randn(&[1, 2, 1, 64], 5), randn(&[1, 2, 1, 64], 6));
    let f = c.update(&k1, &v1).unwrap();
    assert_eq!(f.keys.dim(2), 61);
    assert_eq!(f.keys.slice_axis(2, 0, 60).unwrap().to_bytes().unwrap(), before);
    // The new token sits at position 60 and decodes to about its input.
    let last = c.codec().from_space(&f.keys.slice_axis(2, 60, 61).unwrap()).unwrap();
    let rel = last.sub(&k1).unwrap().square().unwrap().sum(&[], false).unwrap().item::<f32>().unwrap()
        / k1.square().unwrap().sum(&[], false).unwrap().item::<f32>().unwrap();
    assert!(rel < 0.1, "{rel}");
    // Trimming more than held empties it; a 1-token call then starts pending.
    assert_eq!(c.trim(1000), 61);
    assert_eq!(c.phase(), Phase::Empty);
    c.update(&k1, &v1).unwrap();
    assert_eq!(c.phase(), Phase::Pending);
}

/// Test 9: a 1-token warm-up does not disable deferral for the real prompt.
#[test]
fn t9_warm_up_keeps_deferral() {
    let mut c = rotor_cache(64);
    let w = randn(&[1, 2, 1, 64], 1);
    c.update(&w, &w).unwrap();
    let (k, v) = (randn(&[1, 2, 64, 64], 2), randn(&[1, 2, 64, 64], 3));
    let f = c.update(&k, &v).unwrap();
    assert_eq!(c.phase(), Phase::Pending);
    assert_eq!(c.stats.quantized_tokens, 0);
    assert!(max_diff(&f.keys.slice_axis(2, 1, 65).unwrap(), &k) == 0.0);
    // A warm-up on another cache object changes nothing here either.
    let mut other = rotor_cache(64);
    other.update(&w, &w).unwrap();
    other.update(&w, &w).unwrap();
    let mut fresh = rotor_cache(64);
    fresh.update(&k, &v).unwrap();
    assert_eq!(fresh.phase(), Phase::Pending);
    c.update(&w, &w).unwrap();
    assert_eq!(c.stats.bulk_quantizations, 1);
    assert_eq!(c.stats.quantized_tokens, 66);
}

// ---------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------

#[test]
fn config_names_and_errors() {
    for n in super::VALID_NAMES {
        KvCacheConfig::parse(n, None, "kvCache").unwrap();
    }
    let e = KvCacheConfig::parse("rotorquant3", None, "kvCache").unwrap_err();
    assert!(e.message.contains("kvCache `rotorquant3` is not valid; use one of: default, affine4"), "{}", e.message);
    assert!(e.message.contains("rotorquant-adaptive"));
    assert!(KvCacheConfig::parse("affine4", Some(2), "kvCache").is_err());
    let a = KvCacheConfig::parse("rotorquant-adaptive", None, "kvCache").unwrap();
    assert_eq!(a.full_precision_layers, super::DEFAULT_FULL_PRECISION_LAYERS);
    // LFM2-350M: 16 layers, attention at 2, 5, 8, 10, 12, 14.
    let mut attn = vec![false; 16];
    for i in [2, 5, 8, 10, 12, 14] {
        attn[i] = true;
    }
    let kinds = a.layer_kinds(&attn).unwrap();
    let names: Vec<String> = kinds.iter().flatten().map(|k| k.name()).collect();
    assert_eq!(names, ["default", "rotorquant-dense", "rotorquant-dense", "rotorquant-dense", "rotorquant-dense", "default"]);
    let two = KvCacheConfig::parse("rotorquant-adaptive", Some(2), "kvCache").unwrap().layer_kinds(&attn).unwrap();
    assert_eq!(two.iter().flatten().filter(|k| k.is_quantized()).count(), 2);
    let e = KvCacheConfig::parse("rotorquant-adaptive", Some(4), "kvCache").unwrap().layer_kinds(&attn).unwrap_err();
    assert!(e.message.contains("would keep all 6 attention layers in full precision"), "{}", e.message);
}

// ---------------------------------------------------------------------------
// Model level (generated tiny checkpoint)
// ---------------------------------------------------------------------------

mod model {
    use super::*;
    use crate::fixture::{self, DType, FixtureSpec, Preset};
    use crate::generate::prefill;
    use crate::cache::LayerCache;
    use crate::model::{load_model, Lfm2Model, LoadOptions};

    fn tiny(name: &str) -> Lfm2Model {
        let dir = std::env::temp_dir().join(format!("mlxlfm-kvq-{}-{name}", std::process::id()));
        let mut spec = FixtureSpec::new(Preset::Tiny);
        spec.dtype = DType::F32;
        fixture::generate(&spec, &dir).unwrap();
        let m = load_model(&dir, &LoadOptions::default()).unwrap().model;
        std::fs::remove_dir_all(&dir).ok();
        m
    }

    fn quant_offsets(c: &crate::model::ModelCache) -> Vec<usize> {
        c.layers
            .iter()
            .filter_map(|l| match l {
                LayerCache::Attention(kv) => Some(kv.quant.as_ref().map(|q| q.offset()).unwrap_or(usize::MAX)),
                _ => None,
            })
            .collect()
    }

    /// Test 1 at model level: chunks of 100 then 150 give exactly the
    /// default cache's logits (RoPE positions right), offsets 250 then 251.
    #[test]
    fn chunked_prefill_matches_default_and_offsets_advance() {
        let mut m = tiny("chunks");
        let prompt: Vec<u32> = (0..250).map(|i| (i * 37 + 11) % 700 + 1).collect();
        let mut d = m.new_cache();
        let ld = prefill(&m, &mut d, &prompt, 100).unwrap();
        for name in ["affine4", "rotorquant", "rotorquant-quaternion"] {
            m.set_kv_cache(&KvCacheConfig::parse(name, None, "kvCache").unwrap()).unwrap();
            let mut c = m.new_cache();
            let ids = Array::from_slice(&prompt[..100], &[1, 100]).unwrap();
            m.forward_hidden(&ids, &mut c).unwrap();
            assert_eq!(quant_offsets(&c), vec![100, 100]);
            let ids = Array::from_slice(&prompt[100..], &[1, 150]).unwrap();
            let l = m.forward(&ids, &mut c, true).unwrap().reshape(&[1, -1]).unwrap();
            assert_eq!(quant_offsets(&c), vec![250, 250]);
            assert!(max_diff(&l, &ld) < 1e-4, "{name}: deferred prefill differs from the default cache");
            let tok = Array::from_slice(&[5u32], &[1, 1]).unwrap();
            m.forward(&tok, &mut c, true).unwrap().eval().unwrap();
            assert_eq!(quant_offsets(&c), vec![251, 251]);
            assert_eq!(c.pos, 251);
        }
    }

    /// Greedy decode with each quantized cache stays close to the default
    /// one, and a one-token prompt works.
    #[test]
    fn greedy_decode_and_one_token_prompt() {
        let mut m = tiny("greedy");
        let prompt: Vec<u32> = (0..40).map(|i| (i * 13 + 7) % 700 + 1).collect();
        let run = |m: &Lfm2Model, prompt: &[u32], steps: usize| -> Vec<u32> {
            let mut c = m.new_cache();
            let mut l = prefill(m, &mut c, prompt, 16).unwrap();
            let mut out = vec![];
            for _ in 0..steps {
                let t: u32 = l.argmax(-1, false).unwrap().astype(Dtype::Uint32).unwrap().item().unwrap();
                out.push(t);
                let ids = Array::from_slice(&[t], &[1, 1]).unwrap();
                l = m.forward(&ids, &mut c, true).unwrap().reshape(&[1, -1]).unwrap();
            }
            out
        };
        let base = run(&m, &prompt, 24);
        for name in super::super::VALID_NAMES.iter().filter(|n| !n.ends_with("adaptive")) {
            m.set_kv_cache(&KvCacheConfig::parse(name, None, "kvCache").unwrap()).unwrap();
            let got = run(&m, &prompt, 24);
            assert_eq!(got.len(), 24);
            assert_eq!(got[0], base[0], "{name}: the first token comes from the exact prefill");
            let one = run(&m, &[7], 4);
            assert_eq!(one.len(), 4);
        }
    }

    #[test]
    fn adaptive_layers_and_byte_counts() {
        let mut m = tiny("adaptive");
        // tiny has 2 attention layers: adaptive with N=1 would keep both.
        let e = m.set_kv_cache(&KvCacheConfig::parse("rotorquant-adaptive", None, "kvCache").unwrap()).unwrap_err();
        assert!(e.message.contains("would keep all 2 attention layers"));
        assert!(m.kv_codecs.is_empty(), "a failed setting changed the model");
        m.set_kv_cache(&KvCacheConfig::parse("rotorquant", None, "kvCache").unwrap()).unwrap();
        let mut c = m.new_cache();
        let prompt: Vec<u32> = (1..60).collect();
        prefill(&m, &mut c, &prompt, 64).unwrap().eval().unwrap();
        let ids = Array::from_slice(&[3u32], &[1, 1]).unwrap();
        m.forward(&ids, &mut c, true).unwrap().eval().unwrap();
        // tiny: head_dim 16 -> 6 bytes of codes + 2 of norm; 2 kv heads; K and V; 2 layers.
        assert_eq!(c.kv_used_bytes(), 60 * 2 * 2 * 2 * 8);
        m.set_kv_cache(&KvCacheConfig::default()).unwrap();
        assert!(m.kv_codecs.is_empty());
        assert!(m.new_cache().layers.iter().all(|l| !matches!(l, LayerCache::Attention(kv) if kv.quant.is_some())));
    }
}

/// Per-step decode cost of each codec at 4k tokens × 8 heads × 64 (run
/// with --ignored --nocapture).
#[test]
#[ignore]
fn micro_decode_cost() {
    use std::time::Instant;
    let x = randn(&[1, 8, 4096, 64], 1);
    for kind in KINDS {
        let codec = Codec::new(kind, 64).unwrap();
        let parts = codec.encode(&x).unwrap();
        crate::mlx::eval(&parts.iter().collect::<Vec<_>>()).unwrap();
        for dt in [Dtype::Float32, Dtype::Bfloat16] {
            codec.decode(&parts, dt).unwrap().eval().unwrap();
            let s = Instant::now();
            for _ in 0..10 {
                codec.decode(&parts, dt).unwrap().eval().unwrap();
            }
            println!("{kind:?} decode {dt}: {:.2} ms", s.elapsed().as_secs_f64() * 100.0);
        }
        let s = Instant::now();
        for _ in 0..10 {
            let p = codec.encode(&x.slice_axis(2, 0, 1).unwrap()).unwrap();
            crate::mlx::eval(&p.iter().collect::<Vec<_>>()).unwrap();
        }
        println!("{kind:?} encode one token: {:.3} ms", s.elapsed().as_secs_f64() * 100.0);
    }
}

/// Attending in the rotated space (query rotated, output rotated back)
/// equals attending over the inverse-rotated reconstruction.
#[test]
fn rotated_space_attention_equals_original_space() {
    for rot in [Rotation::Dense, Rotation::Quaternion] {
        let mut c = QuantKvCache::new(Codec::new(KvKind::Rotor(rot), 64).unwrap());
        c.update(&randn(&[1, 2, 40, 64], 1), &randn(&[1, 2, 40, 64], 2)).unwrap();
        let q = randn(&[1, 4, 1, 64], 3);
        let o = c.attend(&q, &randn(&[1, 2, 1, 64], 4), &randn(&[1, 2, 1, 64], 5), 0.125).unwrap();
        let f = c.fetch(Dtype::Float32).unwrap();
        assert!(f.rotated);
        let k = c.codec().from_space(&f.keys).unwrap();
        let v = c.codec().from_space(&f.values).unwrap();
        let o2 = crate::mlx::sdpa(&q, &k, &v, 0.125, crate::mlx::Mask::None).unwrap();
        assert!(max_diff(&o, &o2) < 1e-5, "{rot:?}: {}", max_diff(&o, &o2));
    }
}

/// The affine decode path (quantized matmuls over the packed K/V) agrees
/// with attending over the dequantized K/V.
#[test]
fn affine_quantized_attention_matches_dequantized() {
    for (bits, n) in [(4, 64), (8, 64), (4, 16), (8, 80)] {
        let mut c = QuantKvCache::new(Codec::new(KvKind::Affine { bits }, n).unwrap());
        let ni = n as i32;
        c.update(&randn(&[1, 2, 30, ni], 1), &randn(&[1, 2, 30, ni], 2)).unwrap();
        let q = randn(&[1, 4, 1, ni], 3);
        let o = c.attend(&q, &randn(&[1, 2, 1, ni], 4), &randn(&[1, 2, 1, ni], 5), 0.125).unwrap();
        assert_eq!(o.shape(), vec![1, 4, 1, ni]);
        let f = c.fetch(Dtype::Float32).unwrap();
        let o2 = crate::mlx::sdpa(&q, &f.keys, &f.values, 0.125, crate::mlx::Mask::None).unwrap();
        assert!(max_diff(&o, &o2) < 1e-4, "affine{bits} n={n}: {}", max_diff(&o, &o2));
    }
}
