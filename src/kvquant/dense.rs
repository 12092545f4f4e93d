//! The dense rotation: a seeded random orthogonal matrix over the whole
//! head vector (Haar-distributed: Gram-Schmidt on a Gaussian matrix). Unlike
//! the 4-D quaternion blocks it mixes every coordinate with every other, so
//! an outlier channel's energy is spread over the whole vector before the
//! per-coordinate quantizer sees it (the TurboQuant argument).

use super::rotor::{HostRotation, Rng};
use super::Rotation;

/// A random orthogonal `n × n` matrix from `seed` (rows orthonormal).
pub fn random_orthogonal(n: usize, seed: u64) -> HostRotation {
    let mut rng = Rng::new(seed);
    let mut rows: Vec<Vec<f64>> = Vec::with_capacity(n);
    while rows.len() < n {
        let mut v: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
        // Modified Gram-Schmidt, twice for numerical orthogonality.
        for _ in 0..2 {
            for r in &rows {
                let d: f64 = r.iter().zip(&v).map(|(a, b)| a * b).sum();
                for (x, a) in v.iter_mut().zip(r) {
                    *x -= d * a;
                }
            }
        }
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        if norm < 1e-6 {
            continue; // (practically never) a dependent draw: draw again
        }
        rows.push(v.into_iter().map(|x| x / norm).collect());
    }
    HostRotation { n, kind: Rotation::Dense, m: rows.into_iter().flatten().collect() }
}
