//! 3-bit codes: 3 bits per value plus the fp16 norm (a 64-value head vector
//! takes 16 + 8 bytes of codes + 2 bytes of norm = 26 bytes, 3.25 bits per
//! value all in; upstream's 50 bytes per 128 values is the same rate).
//!
//! Each level index `i` (0..8, ascending levels) is split like upstream's
//! layout into a sign bit `s = i >= 4` and a 2-bit magnitude
//! `k = s ? i - 4 : 3 - i` (k = 0 is the level nearest 0), so the level is
//! `(2s - 1) · g(k)` with `g` the 4 positive Lloyd-Max levels. With
//! `lanes = head_dim` rounded up to 8, lane `j = 8a + b` keeps its magnitude
//! in bits `2b..2b+2` of uint16 word `lo[a]` and its sign in bit `b` of byte
//! `hi[a]`.
//!
//! Unpacking on the device is two row gathers from small tables: `lo[a]`
//! indexes a 65536 × 8 table of the 8 lanes' magnitudes, `hi[a]` a 256 × 8
//! table of their signs (MLX's CPU backend gathers 8-value rows about four
//! times faster than it runs the same unpacking as shift/mask arithmetic).
//! Packing uses integer multiply-and-sum (the shifted fields never overlap,
//! so a sum is an OR; the bridge has no bitwise ops).

use crate::error::Result;
use crate::mlx::{where_, Array, Dtype};

/// Index lanes per vector: `n` rounded up to a multiple of 8.
pub fn lanes(n: usize) -> usize {
    n.div_ceil(8) * 8
}

/// Words per vector (`lo` uint16 and `hi` uint8 each).
pub fn words(n: usize) -> usize {
    lanes(n) / 8
}

/// Bytes of codes per vector (3 bits per lane).
pub fn code_bytes(n: usize) -> usize {
    3 * words(n)
}

/// Packs level indices `idx` (`[..., lanes]`, int32 in 0..8) into
/// (`lo` `[..., G]` uint16, `hi` `[..., G]` uint8), `G = lanes / 8`.
pub fn pack3(idx: &Array) -> Result<(Array, Array)> {
    let shape = idx.shape();
    let l = *shape.last().unwrap();
    debug_assert!(l % 8 == 0);
    let mut grouped = shape.clone();
    *grouped.last_mut().unwrap() = l / 8;
    grouped.push(8);
    let idx = idx.reshape(&grouped)?; // [..., G, 8]: lane 8a + b at [a, b]
    let sign = idx.ge_scalar(4.0)?;
    let mag = where_(&sign, &idx.sub_scalar(4.0)?, &Array::scalar(3.0, Dtype::Int32)?.sub(&idx)?)?;
    let pow4 = Array::from_slice(&[1i32, 4, 16, 64, 256, 1024, 4096, 16384], &[8])?;
    let pow2 = Array::from_slice(&[1i32, 2, 4, 8, 16, 32, 64, 128], &[8])?;
    let lo = mag.mul(&pow4)?.sum(&[-1], false)?.astype(Dtype::Uint16)?;
    let hi = sign.astype(Dtype::Int32)?.mul(&pow2)?.sum(&[-1], false)?.astype(Dtype::Uint8)?;
    Ok((lo, hi))
}

/// The unpacking tables: (`[65536, 8]` magnitudes `g(k)` of the 8 lanes of
/// a `lo` word, `[256, 8]` signs ±1 of a `hi` byte), f32.
pub fn tables(positive_levels: [f64; 4]) -> Result<(Array, Array)> {
    let mags: Vec<f32> = (0..65536usize * 8).map(|i| positive_levels[((i / 8) >> (2 * (i % 8))) & 3] as f32).collect();
    let signs: Vec<f32> = (0..256usize * 8).map(|i| if ((i / 8) >> (i % 8)) & 1 == 1 { 1.0 } else { -1.0 }).collect();
    Ok((Array::from_slice(&mags, &[65536, 8])?, Array::from_slice(&signs, &[256, 8])?))
}

/// `lo`, `hi` (`[..., G]`) and `scale` (`[..., 1]`) -> `[..., 8G]` f32 values
/// `scale · (2s - 1) · g(k)`.
pub fn unpack_scaled(lo: &Array, hi: &Array, scale: &Array, tables: &(Array, Array)) -> Result<Array> {
    let mut shape = lo.shape();
    *shape.last_mut().unwrap() *= 8;
    let g = tables.0.take(lo, 0)?.reshape(&shape)?;
    let s = tables.1.take(hi, 0)?.reshape(&shape)?;
    g.mul(&s)?.mul(&scale.astype(Dtype::Float32)?)
}

/// Host packing of one vector's level indices (padded with 0 to `lanes(n)`):
/// (`lo` words, `hi` bytes).
pub fn pack3_host(idx: &[u8]) -> (Vec<u16>, Vec<u8>) {
    let l = lanes(idx.len());
    let mut padded = idx.to_vec();
    padded.resize(l, 0);
    let mut lo = vec![0u16; l / 8];
    let mut hi = vec![0u8; l / 8];
    for (j, &i) in padded.iter().enumerate() {
        let (a, b) = (j / 8, j % 8);
        let (s, k) = if i >= 4 { (1u8, i - 4) } else { (0u8, 3 - i) };
        lo[a] |= (k as u16) << (2 * b);
        hi[a] |= s << b;
    }
    (lo, hi)
}

/// Host unpacking of `n` level indices.
pub fn unpack3_host(lo: &[u16], hi: &[u8], n: usize) -> Vec<u8> {
    (0..n)
        .map(|j| {
            let (a, b) = (j / 8, j % 8);
            let k = ((lo[a] >> (2 * b)) & 3) as u8;
            if (hi[a] >> b) & 1 == 1 {
                4 + k
            } else {
                3 - k
            }
        })
        .collect()
}
