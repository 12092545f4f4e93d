//! IsoQuant's pieces on the host: the Lloyd-Max levels, the quaternion
//! rotation (groups of 4 values, each left-multiplied by a fixed unit
//! quaternion), and a reference quantizer / dequantizer that the device
//! codec (codec.rs) is tested against and the rotation study runs on.
//!
//! Every rotation here is an orthogonal n×n matrix `R` (row-major, f64):
//! quantize rotates `y = R u`; dequantize applies `Rᵀ`. The quaternion one
//! is block diagonal (4×4 blocks `L(q)` with `q ⊗ v = L(q) v`, and
//! `conj(q) ⊗ v = L(q)ᵀ v`); trailing values of a head_dim that is not a
//! multiple of 4 are left unrotated.

use super::Rotation;

/// The 8 Lloyd-Max reconstruction levels of N(0, 1), ascending. For a block
/// of n values (unit vector, coordinates ~ N(0, 1/n)) divide by sqrt(n).
pub const LEVELS: [f64; 8] = [-2.151945, -1.343909, -0.756005, -0.245094, 0.245094, 0.756005, 1.343909, 2.151945];

/// Seed of the quaternion table (upstream also used 42).
pub const QUATERNION_SEED: u64 = 42;
/// Seed of the dense rotation.
pub const DENSE_SEED: u64 = 7;

/// The levels for a block of `n` values.
pub fn centroids(n: usize) -> [f64; 8] {
    let s = (n as f64).sqrt();
    LEVELS.map(|c| c / s)
}

/// Decision boundaries between consecutive centroids (7 values).
pub fn boundaries(n: usize) -> [f64; 7] {
    let c = centroids(n);
    std::array::from_fn(|i| 0.5 * (c[i] + c[i + 1]))
}

/// A small deterministic PRNG (splitmix64) with normal samples.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// The unit quaternions (w, x, y, z) for `groups` groups: normal samples,
/// L2-normalised. Asserts unit norm within 1e-6 (a non-unit table breaks
/// the inverse).
pub fn quaternion_table(groups: usize, seed: u64) -> Vec<[f64; 4]> {
    let mut rng = Rng::new(seed);
    (0..groups)
        .map(|_| {
            let q = [rng.normal(), rng.normal(), rng.normal(), rng.normal()];
            let n = q.iter().map(|v| v * v).sum::<f64>().sqrt();
            let q = q.map(|v| v / n);
            let norm = q.iter().map(|v| v * v).sum::<f64>().sqrt();
            assert!((norm - 1.0).abs() < 1e-6, "quaternion table entry is not unit norm: {norm}");
            q
        })
        .collect()
}

/// Hamilton product `q ⊗ v`.
pub fn hamilton(q: [f64; 4], v: [f64; 4]) -> [f64; 4] {
    let [a, b, c, d] = q;
    let [w, x, y, z] = v;
    [
        a * w - b * x - c * y - d * z,
        a * x + b * w + c * z - d * y,
        a * y - b * z + c * w + d * x,
        a * z + b * y - c * x + d * w,
    ]
}

pub fn conj(q: [f64; 4]) -> [f64; 4] {
    [q[0], -q[1], -q[2], -q[3]]
}

/// An orthogonal rotation of n-vectors, `R` row-major.
#[derive(Debug, Clone)]
pub struct HostRotation {
    pub n: usize,
    pub kind: Rotation,
    pub m: Vec<f64>,
}

impl HostRotation {
    pub fn new(kind: Rotation, n: usize) -> HostRotation {
        match kind {
            Rotation::Quaternion => Self::quaternion(n),
            Rotation::Dense => super::dense::random_orthogonal(n, DENSE_SEED),
        }
    }

    /// Block-diagonal `L(q_g)` for g = 0..n/4; identity on the trailing n % 4.
    pub fn quaternion(n: usize) -> HostRotation {
        let table = quaternion_table(n / 4, QUATERNION_SEED);
        let mut m = vec![0.0; n * n];
        for i in (n / 4) * 4..n {
            m[i * n + i] = 1.0;
        }
        for (g, q) in table.iter().enumerate() {
            let [a, b, c, d] = *q;
            let block = [[a, -b, -c, -d], [b, a, -d, c], [c, d, a, -b], [d, -c, b, a]];
            for (r, row) in block.iter().enumerate() {
                for (col, &v) in row.iter().enumerate() {
                    m[(4 * g + r) * n + 4 * g + col] = v;
                }
            }
        }
        HostRotation { n, kind: Rotation::Quaternion, m }
    }

    /// `R x`.
    pub fn apply(&self, x: &[f64]) -> Vec<f64> {
        let n = self.n;
        (0..n).map(|i| (0..n).map(|j| self.m[i * n + j] * x[j]).sum()).collect()
    }

    /// `Rᵀ x` (the inverse).
    pub fn apply_inv(&self, x: &[f64]) -> Vec<f64> {
        let n = self.n;
        (0..n).map(|i| (0..n).map(|j| self.m[j * n + i] * x[j]).sum()).collect()
    }

    /// The quaternion rotation written with Hamilton products (the
    /// definition), to check the matrix form against.
    pub fn quaternion_by_products(x: &[f64], inverse: bool) -> Vec<f64> {
        let n = x.len();
        let table = quaternion_table(n / 4, QUATERNION_SEED);
        let mut out = x.to_vec();
        for (g, q) in table.iter().enumerate() {
            let v = [x[4 * g], x[4 * g + 1], x[4 * g + 2], x[4 * g + 3]];
            let r = hamilton(if inverse { conj(*q) } else { *q }, v);
            out[4 * g..4 * g + 4].copy_from_slice(&r);
        }
        out
    }

    /// Row-major `R` as f32.
    pub fn matrix_f32(&self) -> Vec<f32> {
        self.m.iter().map(|&v| v as f32).collect()
    }

    /// Row-major `Rᵀ` as f32.
    pub fn transpose_f32(&self) -> Vec<f32> {
        let n = self.n;
        (0..n * n).map(|k| self.m[(k % n) * n + k / n] as f32).collect()
    }
}

/// One quantized block: level indices and the corrected norm.
#[derive(Debug, Clone, PartialEq)]
pub struct HostCode {
    pub idx: Vec<u8>,
    pub norm: f32,
}

/// Reference quantizer (f64): `r = ||x||`, `u = x / r`, `y = R u`, nearest
/// level per coordinate (ties to the lower index), norm correction so the
/// reconstruction has norm r exactly.
pub fn quantize_host(x: &[f32], rot: &HostRotation) -> HostCode {
    let n = x.len();
    assert_eq!(n, rot.n);
    let c = centroids(n);
    let b = boundaries(n);
    let r = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>().sqrt();
    let u: Vec<f64> = if r > 1e-10 { x.iter().map(|&v| v as f64 / r).collect() } else { vec![0.0; n] };
    let y = rot.apply(&u);
    let idx: Vec<u8> = y.iter().map(|&v| b.iter().filter(|&&t| v > t).count() as u8).collect();
    let cn = idx.iter().map(|&i| c[i as usize] * c[i as usize]).sum::<f64>().sqrt();
    let norm = if cn > 1e-10 { r / cn } else { r };
    HostCode { idx, norm: norm as f32 }
}

/// Reference dequantizer: `x̂ = norm · Rᵀ c`.
pub fn dequantize_host(code: &HostCode, rot: &HostRotation) -> Vec<f32> {
    let c = centroids(rot.n);
    let y: Vec<f64> = code.idx.iter().map(|&i| c[i as usize] * code.norm as f64).collect();
    rot.apply_inv(&y).into_iter().map(|v| v as f32).collect()
}

/// Mean over vectors of `||x - x̂||² / ||x||²`.
pub fn relative_mse(xs: &[Vec<f32>], rot: &HostRotation) -> f64 {
    let mut total = 0.0;
    let mut count = 0usize;
    for x in xs {
        let nx: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
        if nx <= 1e-20 {
            continue;
        }
        let xh = dequantize_host(&quantize_host(x, rot), rot);
        let e: f64 = x.iter().zip(&xh).map(|(&a, &b)| (a as f64 - b as f64).powi(2)).sum();
        total += e / nx;
        count += 1;
    }
    total / count.max(1) as f64
}
