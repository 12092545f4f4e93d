//! `--kernel-bench`: the decode step's dense GEMV shapes, one product a
//! launch, through MLX's own GEMV and each walk of ours, so that `ncu` over
//! this process (`bench/h200/run.py kernel-bench`) times every kernel alone
//! on identical operands. The question it answers: on the 1.2B's 2,048-wide
//! rows our GEMV, which walks a row as MLX's `gemv_single` does, has read
//! them more slowly than MLX's (sessions 19-24), and an in-step A/B cannot
//! say by how much, nor which walk loses least.
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

/// The 1.2B's decode GEMVs `[N, K]` (out_proj, in_proj, q/k/v, w2) and the
/// 350M's out_proj.
const SHAPES: [(i32, i32); 5] = [(2048, 2048), (6144, 2048), (3072, 2048), (2048, 8192), (1024, 1024)];

/// Bytes of distinct weights each shape cycles through, more than the
/// H200's 50 MB L2, so that a product's weights come from DRAM as a
/// step's do (ncu flushes the caches itself; the wall times need this).
const CYCLE_BYTES: usize = 96 << 20;

pub fn run(reps: usize) -> mlx_lfm::Result<()> {
    let bf = Dtype::Bfloat16;
    let cuda = cuda_kernels_enabled();
    let arms: Vec<_> = arms().into_iter().filter(|(name, _)| cuda || *name == "mlx").collect();
    let mut plan = vec![];
    let mut sets = vec![];
    for (n, k) in SHAPES {
        let bytes = n as usize * k as usize * 2;
        let copies = CYCLE_BYTES.div_ceil(bytes).clamp(1, 16);
        let x = normal(&[1, k], bf, 0.0, 1.0, None)?;
        let ws = (0..copies)
            .map(|_| normal(&[n, k], bf, 0.0, 1.0 / (k as f32).sqrt(), None))
            .collect::<mlx_lfm::Result<Vec<Array>>>()?;
        let mut held: Vec<&Array> = ws.iter().collect();
        held.push(&x);
        mlx::eval(&held)?;
        for (name, _) in &arms {
            plan.push(serde_json::json!({"arm": name, "n": n, "k": k, "launches": copies * reps}));
        }
        sets.push((n, k, x, ws));
    }
    println!("{}", serde_json::json!({"kernel_bench_plan": plan}));
    for (n, k, x, ws) in &sets {
        for (name, switches) in &arms {
            let overrides: mlx_lfm::knobs::Overrides = switches.iter().map(|(k, v)| (k.to_string(), Some(v.to_string()))).collect();
            let mut walls = vec![];
            mlx_lfm::knobs::with_overrides(&overrides, || -> mlx_lfm::Result<()> {
                for _ in 0..reps {
                    for w in ws {
                        let t = Instant::now();
                        let y = if *name == "mlx" {
                            x.matmul(&w.transpose(&[1, 0])?)?
                        } else {
                            if !mlx_lfm::kernels::gemv::available(x, w) {
                                return Err(mlx_lfm::Error::invalid(format!("{name}: the GEMV kernel does not serve {n}x{k}")));
                            }
                            mlx_lfm::kernels::gemv::gemv(x, w)?
                        };
                        mlx::eval(&[&y])?;
                        walls.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                }
                Ok(())
            })?;
            walls.sort_by(f64::total_cmp);
            let median = walls[walls.len() / 2];
            println!(
                "{}",
                serde_json::json!({"kernel_bench": name, "n": n, "k": k, "launches": walls.len(),
                    "wall_us_median": median, "wall_us_min": walls[0], "backend": mlx_lfm::mlx::runtime::backend().name()})
            );
        }
    }
    Ok(())
}
