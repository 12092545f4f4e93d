//! The feed-forward's gate, `silu(gate) * x`, as one MLX compiled
//! (shapeless) function: one fused elementwise kernel where MLX's ops take
//! three (a sigmoid and two products, each reading and writing the whole
//! `[rows, ff]` activation), as mlx-lm's `swiglu` runs it. A compiled decode
//! step fused the three already; a prompt's pass (eager) did not: three
//! launches a layer over 512 x 8,192 elements on the 1.2B, and on the
//! 8B-A1B over every routed row of every MoE layer. Each fused value is
//! rounded to its dtype after each op, as the separate kernels round it:
//! the same bits (`fused_gate_equals_the_ops`).
//!
//! `MLX_LFM_FUSED_SWIGLU=0` runs the three ops, as the stock path does
//! (`MLX_LFM_KERNELS=0`, a test's `with_stock_ops`): the greedy test's
//! stock run on the H200 is then the three ops, and its default runs meet
//! the fused gate.

use crate::error::Result;
use crate::mlx::{Array, Compiled};
use std::cell::Cell;
use std::sync::OnceLock;

/// `silu(gate) * x` in MLX's ops (what the fused function traces).
pub fn swiglu_ops(gate: &Array, x: &Array) -> Result<Array> {
    gate.silu()?.mul(x)
}

fn fused_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_FUSED_SWIGLU", &ON, |v| !matches!(v.map(str::trim), Some("0")))
}

thread_local! {
    // One per thread (a model's arrays and traces stay on its worker; the
    // compile cache they go into is MLX's one map for the process, which
    // src/mlx/compile.rs serialises). Leaked, never freed: freeing erases
    // its traces from that cache, which a thread's exit could reach after
    // MLX's own statics are gone; it is one small closure and its trace (a
    // few per dtype and rank) a thread that ever ran a feed-forward.
    static FUSED: Cell<Option<&'static Compiled>> = const { Cell::new(None) };
}

fn fused() -> Result<&'static Compiled> {
    if let Some(f) = FUSED.with(Cell::get) {
        return Ok(f);
    }
    // Shapeless: one trace serves every prompt length and batch (MLX keys
    // it by dtype and rank), where a shaped one would trace each anew.
    let f: &'static Compiled = Box::leak(Box::new(Compiled::new(|ins| Ok(vec![swiglu_ops(&ins[0], &ins[1])?]), true)?));
    FUSED.with(|c| c.set(Some(f)));
    Ok(f)
}

/// `silu(gate) * x`, fused where the operands allow it: the same shape and
/// dtype (a shapeless trace replays its broadcasts as traced, so operands
/// that broadcast take the ops).
pub fn swiglu(gate: &Array, x: &Array) -> Result<Array> {
    if !fused_enabled() || crate::mlx::kernel::stock_ops_only() || gate.dtype() != x.dtype() || gate.shape() != x.shape() {
        return swiglu_ops(gate, x);
    }
    let mut out = fused()?.call(&[gate, x])?;
    Ok(out.pop().expect("the fused gate returns one array"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mlx::{self, random::normal, Dtype};

    fn bits(a: &Array) -> Vec<u32> {
        a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    /// The fused gate is one node and gives the ops' bits, for each float
    /// dtype, for prompt-sized and one-token operands, for strided views
    /// (a stacked product's halves), and after a trace of another shape.
    #[test]
    fn fused_gate_equals_the_ops() {
        for dt in [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32] {
            for shape in [vec![512, 4608], vec![1, 7, 8192], vec![1, 1, 256], vec![3, 5]] {
                let g = normal(&shape, dt, 0.0, 3.0, None).unwrap();
                let x = normal(&shape, dt, 0.0, 1.0, None).unwrap();
                mlx::eval(&[&g, &x]).unwrap();
                let fused = swiglu(&g, &x).unwrap();
                let ops = swiglu_ops(&g, &x).unwrap();
                let nodes: usize = mlx::graph_ops(&[&fused]).unwrap().iter().map(|(_, n)| n).sum();
                assert_eq!(nodes, 1, "{dt:?} {shape:?}: {:?}", mlx::graph_ops(&[&fused]).unwrap());
                assert_eq!(fused.shape(), shape);
                assert_eq!(fused.dtype(), dt);
                assert_eq!(bits(&fused), bits(&ops), "{dt:?} {shape:?}");
            }
            // The two halves of one `[rows, 2F]` product, as a stacked
            // w1/w3 leaves them: strided views.
            let both = normal(&[64, 2 * 96], dt, 0.0, 2.0, None).unwrap();
            let halves = both.split_equal(2, -1).unwrap();
            assert_eq!(bits(&swiglu(&halves[0], &halves[1]).unwrap()), bits(&swiglu_ops(&halves[0], &halves[1]).unwrap()), "{dt:?} views");
        }
    }

    /// Operands the fused trace cannot replay (broadcasting, mixed dtypes)
    /// take the ops, with their results.
    #[test]
    fn broadcast_or_mixed_operands_take_the_ops() {
        let g = normal(&[4, 8], Dtype::Float32, 0.0, 1.0, None).unwrap();
        let row = normal(&[1, 8], Dtype::Float32, 0.0, 1.0, None).unwrap();
        for (a, b) in [(&g, &row), (&row, &g)] {
            let y = swiglu(a, b).unwrap();
            assert_eq!(y.shape(), vec![4, 8]);
            assert_eq!(bits(&y), bits(&swiglu_ops(a, b).unwrap()));
        }
        let half = g.astype(Dtype::Bfloat16).unwrap();
        let y = swiglu(&g, &half).unwrap();
        assert_eq!(y.dtype(), Dtype::Float32);
        assert_eq!(bits(&y), bits(&swiglu_ops(&g, &half).unwrap()));
    }

    /// `MLX_LFM_FUSED_SWIGLU=0` runs the three ops, and so does the stock
    /// path.
    #[test]
    fn the_switch_turns_the_fused_gate_off() {
        let g = normal(&[2, 16], Dtype::Bfloat16, 0.0, 1.0, None).unwrap();
        let x = normal(&[2, 16], Dtype::Bfloat16, 0.0, 1.0, None).unwrap();
        mlx::eval(&[&g, &x]).unwrap();
        let off = crate::knobs::with_overrides(&[("MLX_LFM_FUSED_SWIGLU".into(), Some("0".into()))], || swiglu(&g, &x).unwrap());
        let nodes = |a: &Array| -> usize { mlx::graph_ops(&[a]).unwrap().iter().map(|(_, n)| n).sum() };
        assert_eq!(nodes(&off), 3);
        let stock = crate::mlx::kernel::with_stock_ops(|| swiglu(&g, &x).unwrap());
        assert_eq!(nodes(&stock), 3, "the stock path runs the ops");
        let fused = swiglu(&g, &x).unwrap();
        assert_eq!(nodes(&fused), 1);
        assert_eq!(bits(&off), bits(&fused));
    }
}
