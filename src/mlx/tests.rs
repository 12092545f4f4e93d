//! Bridge tests: results checked against hand-computed values, and MLX
//! failures arriving as errors carrying MLX's text instead of aborting.

use super::*;
use crate::error::ErrorKind;

fn arr(v: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(v, shape).unwrap()
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= tol, "{a:?} vs {b:?}");
    }
}

#[test]
fn matmul_and_elementwise() {
    let a = arr(&[1., 2., 3., 4.], &[2, 2]);
    let b = arr(&[5., 6., 7., 8.], &[2, 2]);
    assert_eq!(a.matmul(&b).unwrap().to_vec::<f32>().unwrap(), vec![19., 22., 43., 50.]);
    assert_eq!(a.add(&b).unwrap().to_vec::<f32>().unwrap(), vec![6., 8., 10., 12.]);
    assert_eq!(a.mul_scalar(0.5).unwrap().to_vec::<f32>().unwrap(), vec![0.5, 1., 1.5, 2.]);
    assert_eq!(a.sum(&[1], false).unwrap().to_vec::<f32>().unwrap(), vec![3., 7.]);
    assert_eq!(a.max(&[], false).unwrap().item::<f32>().unwrap(), 4.);
    let s = arr(&[0.0], &[1]).sigmoid().unwrap().item::<f32>().unwrap();
    assert_eq!(s, 0.5);
}

#[test]
fn shapes_slices_and_concat() {
    let a = arange(0., 12., 1., Dtype::Float32).unwrap().reshape(&[3, 4]).unwrap();
    assert_eq!(a.shape(), vec![3, 4]);
    let s = a.slice(&[1, 1], &[3, 3], &[1, 1]).unwrap();
    assert_eq!(s.to_vec::<f32>().unwrap(), vec![5., 6., 9., 10.]);
    let t = a.t().unwrap();
    assert_eq!(t.shape(), vec![4, 3]);
    assert_eq!(t.to_vec::<f32>().unwrap()[..3], [0., 4., 8.]);
    let c = concatenate(&[&s, &s], 0).unwrap();
    assert_eq!(c.shape(), vec![4, 2]);
    let z = zeros(&[2, 2], Dtype::Float32).unwrap();
    let u = z.slice_update(&arr(&[7.], &[1, 1]), &[1, 0], &[2, 1]).unwrap();
    assert_eq!(u.to_vec::<f32>().unwrap(), vec![0., 0., 7., 0.]);
    let parts = arange(0., 6., 1., Dtype::Float32).unwrap().split_equal(3, 0).unwrap();
    assert_eq!(parts[2].to_vec::<f32>().unwrap(), vec![4., 5.]);
    let idx = Array::from_slice(&[2i32, 0], &[2]).unwrap();
    assert_eq!(a.take(&idx, 0).unwrap().to_vec::<f32>().unwrap()[..4], [8., 9., 10., 11.]);
}

#[test]
fn dtype_casts_round_trip() {
    let a = arr(&[1.5, -2.25, 3.0], &[3]);
    let b = a.astype(Dtype::Bfloat16).unwrap();
    assert_eq!(b.dtype(), Dtype::Bfloat16);
    assert_eq!(b.nbytes(), 6);
    assert_eq!(b.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap(), vec![1.5, -2.25, 3.0]);
    let bytes = b.to_bytes().unwrap();
    let c = Array::from_bytes(&bytes, &[3], Dtype::Bfloat16).unwrap();
    assert_eq!(c.to_vec::<f32>().unwrap(), vec![1.5, -2.25, 3.0]);
    assert_eq!(a.to_vec::<i32>().unwrap(), vec![1, -2, 3]);
}

#[test]
fn softmax_argmax_and_sampling() {
    let l = arr(&[0., 0., 10., 0.], &[1, 4]);
    let p = l.softmax(-1, true).unwrap().to_vec::<f32>().unwrap();
    let e = 10f32.exp();
    close(&p, &[1. / (3. + e), 1. / (3. + e), e / (3. + e), 1. / (3. + e)], 1e-6);
    assert_eq!(l.argmax(-1, false).unwrap().to_vec::<u32>().unwrap(), vec![2]);
    let part = arr(&[5., 1., 4., 2.], &[4]).argpartition(1, 0).unwrap().to_vec::<u32>().unwrap();
    let mut low: Vec<u32> = part[..2].to_vec();
    low.sort();
    assert_eq!(low, vec![1, 3]);
    let big = arr(&[-1e9, -1e9, 0., -1e9], &[1, 4]);
    let key = random::key(7).unwrap();
    assert_eq!(random::categorical(&big, -1, Some(&key)).unwrap().to_vec::<u32>().unwrap(), vec![2]);
}

#[test]
fn nn_kernels_against_hand_values() {
    // rms_norm([3, 4]) = x / sqrt(mean(x^2)) = x / sqrt(12.5)
    let x = arr(&[3., 4.], &[1, 2]);
    let w = arr(&[1., 2.], &[2]);
    let r = rms_norm(&x, Some(&w), 0.0).unwrap().to_vec::<f32>().unwrap();
    let d = 12.5f32.sqrt();
    close(&r, &[3. / d, 8. / d], 1e-5);
    // RoPE at offset 0 is the identity.
    let q = arange(0., 4., 1., Dtype::Float32).unwrap().reshape(&[1, 1, 1, 4]).unwrap();
    close(&rope(&q, 4, false, 10000., 1., 0).unwrap().to_vec::<f32>().unwrap(), &q.to_vec::<f32>().unwrap(), 1e-6);
    // At position 1 with dims 2 the pair (x0, x1) turns by 1 radian.
    let r = rope(&arr(&[1., 0.], &[1, 1, 1, 2]), 2, false, 10000., 1., 1).unwrap().to_vec::<f32>().unwrap();
    close(&r, &[1f32.cos(), 1f32.sin()], 1e-6);
    // Causal SDPA over one key returns that key's value.
    let k = arr(&[1., 0., 0., 0.], &[1, 1, 1, 4]);
    let v = arr(&[9., 8., 7., 6.], &[1, 1, 1, 4]);
    let o = sdpa(&k, &k, &v, 0.5, Mask::Causal).unwrap().to_vec::<f32>().unwrap();
    close(&o, &[9., 8., 7., 6.], 1e-6);
    // Depthwise conv: kernel [1, 2] over [1, 2, 3] (valid) = [1*1+2*2, 2*1+3*2].
    let xs = arr(&[1., 2., 3.], &[1, 3, 1]);
    let k = arr(&[1., 2.], &[1, 2, 1]);
    assert_eq!(conv1d(&xs, &k, 1, 0, 1, 1).unwrap().to_vec::<f32>().unwrap(), vec![5., 8.]);
}

#[test]
fn quantize_round_trip_and_qmm() {
    let w = random::normal(&[64, 128], Dtype::Float32, 0., 1., Some(&random::key(1).unwrap())).unwrap();
    let x = random::normal(&[2, 128], Dtype::Float32, 0., 1., Some(&random::key(2).unwrap())).unwrap();
    for (mode, bits, gs) in [(QuantMode::Affine, 8, 64), (QuantMode::Affine, 4, 32), (QuantMode::Mxfp4, 4, 32), (QuantMode::Mxfp8, 8, 32), (QuantMode::Nvfp4, 4, 16)] {
        let q = QuantSpec { mode, bits, group_size: gs };
        let (wq, s, b) = quantize(&w, q).unwrap();
        assert_eq!(b.is_some(), mode.has_biases(), "{mode:?}");
        let wd = dequantize(&wq, &s, b.as_ref(), q, None).unwrap();
        let err = wd.sub(&w).unwrap().abs().unwrap().max(&[], false).unwrap().item::<f32>().unwrap();
        assert!(err < 1.5, "{mode:?} {bits}: max err {err}");
        let y = quantized_matmul(&x, &wq, &s, b.as_ref(), true, q).unwrap();
        let y_ref = x.matmul(&wd.t().unwrap()).unwrap();
        let d = y.sub(&y_ref).unwrap().abs().unwrap().max(&[], false).unwrap().item::<f32>().unwrap();
        assert!(d < 1e-2, "{mode:?}: qmm vs dequantized matmul differ by {d}");
    }
}

#[test]
fn gather_mm_selects_experts() {
    // Two "experts": identity and 2*identity; route row 0 to expert 1.
    let eye = arr(&[1., 0., 0., 1.], &[2, 2]);
    let w = stack(&[&eye, &eye.mul_scalar(2.).unwrap()], 0).unwrap();
    let x = arr(&[3., 4.], &[1, 1, 2]);
    let rhs = Array::from_slice(&[1u32], &[1]).unwrap();
    let y = gather_mm(&x, &w, None, Some(&rhs), false).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![6., 8.]);
}

#[test]
fn compile_matches_eager() {
    let f = Compiled::new(|ins| Ok(vec![ins[0].mul(&ins[1])?.add_scalar(1.0)?.exp()?]), false).unwrap();
    let a = arr(&[0.1, 0.2], &[2]);
    let b = arr(&[3., 4.], &[2]);
    let c = f.call(&[&a, &b]).unwrap();
    let e = a.mul(&b).unwrap().add_scalar(1.0).unwrap().exp().unwrap();
    close(&c[0].to_vec::<f32>().unwrap(), &e.to_vec::<f32>().unwrap(), 1e-6);
    // A failing trace is an error, not an abort.
    let bad = Compiled::new(|ins| Ok(vec![ins[0].reshape(&[7])?]), false).unwrap();
    assert!(bad.call(&[&a]).is_err());
}

#[test]
fn mlx_errors_carry_mlx_text() {
    let a = arr(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let e = a.reshape(&[4, 2]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Mlx);
    assert!(e.message.contains("reshape"), "{}", e.message);
    let b = arr(&[1., 2.], &[1, 2]);
    let e = a.matmul(&b).unwrap_err();
    assert!(e.message.contains("matmul") || e.message.contains("shape"), "{}", e.message);
    let e = a.add(&arr(&[1., 2.], &[2])).unwrap_err();
    assert!(e.message.contains("broadcast"), "{}", e.message);
    // The thread keeps working after errors.
    assert_eq!(a.sum(&[], false).unwrap().item::<f32>().unwrap(), 21.);
}

#[test]
fn safetensors_round_trip() {
    let dir = std::env::temp_dir().join(format!("mlxlfm-st-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("t.safetensors");
    let a = arr(&[1., 2., 3.], &[3]).astype(Dtype::Bfloat16).unwrap();
    save_safetensors(&p, &[("x.weight".into(), a)], &[("format".into(), "mlx".into())]).unwrap();
    let (arrs, meta) = load_safetensors(&p).unwrap();
    assert_eq!(meta.get("format").map(String::as_str), Some("mlx"));
    assert_eq!(arrs[0].0, "x.weight");
    assert_eq!(arrs[0].1.dtype(), Dtype::Bfloat16);
    assert_eq!(arrs[0].1.to_vec::<f32>().unwrap(), vec![1., 2., 3.]);
    let e = load_safetensors(&dir.join("missing.safetensors")).unwrap_err();
    assert!(e.message.contains("missing.safetensors"), "{}", e.message);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn runtime_facts() {
    assert_eq!(runtime::version(), "0.32.4");
    let m = runtime::memory();
    let _ = zeros(&[1024], Dtype::Float32).unwrap().eval();
    assert!(runtime::memory().peak >= m.active);
    assert!(["cpu", "cuda", "metal"].contains(&runtime::backend().name()));
}

/// `split_at` cuts where asked, as slices would, in one node of the graph.
#[test]
fn split_at_cuts_like_slices_in_one_node() {
    use crate::mlx::random::normal;
    let y = normal(&[2, 3, 10], Dtype::Float32, 0.0, 1.0, None).unwrap();
    crate::mlx::eval(&[&y]).unwrap();
    let parts = y.split_at(&[4, 7], -1).unwrap();
    assert_eq!(parts.iter().map(|p| p.shape()).collect::<Vec<_>>(), vec![vec![2, 3, 4], vec![2, 3, 3], vec![2, 3, 3]]);
    for (p, (a, b)) in parts.iter().zip([(0, 4), (4, 7), (7, 10)]) {
        let want: Vec<f32> = y.slice_axis(-1, a, b).unwrap().to_vec().unwrap();
        assert_eq!(p.to_vec::<f32>().unwrap(), want);
    }
    let parts = y.split_at(&[4, 7], -1).unwrap();
    let refs: Vec<&Array> = parts.iter().collect();
    assert_eq!(crate::mlx::graph_ops(&refs).unwrap(), vec![("Split".to_string(), 1)]);
    assert!(y.split_at(&[7, 4], -1).is_err(), "indices out of order");
}

/// `count_ops` tallies what every eval, async eval and host read hands MLX
/// while it runs, each node once (an evaluated node is not walked again),
/// and nothing outside it.
#[test]
fn count_ops_tallies_each_evaluated_graph_once() {
    let a = arr(&[1., 2.], &[2]);
    let b = arr(&[3., 4.], &[2]);
    let ((), ops) = count_ops(|| {
        let s = a.add(&b).unwrap();
        eval(&[&s]).unwrap();
        // `s` is evaluated: only the multiply is new.
        let m = s.mul(&b).unwrap();
        async_eval(&[&m]).unwrap();
        eval(&[&m]).unwrap();
        // A host read evaluates too.
        assert_eq!(m.sub(&a).unwrap().to_vec::<f32>().unwrap(), vec![11., 22.]);
    });
    assert_eq!(ops, vec![("Add".to_string(), 1), ("Multiply".to_string(), 1), ("Subtract".to_string(), 1)]);
    // Outside it nothing is tallied, and a nested count is its own.
    let ((), outer) = count_ops(|| {
        eval(&[&a.add(&a).unwrap()]).unwrap();
        let ((), inner) = count_ops(|| eval(&[&b.mul(&b).unwrap()]).unwrap());
        assert_eq!(inner, vec![("Multiply".to_string(), 1)]);
    });
    assert_eq!(outer, vec![("Add".to_string(), 1)]);
}

/// What the decode step's cache writes rely on to spare view nodes: a
/// scatter at a 0-d index takes the update in the buffer's own rank (no
/// reshape of K/V to `[1, B, H, 1, D]`, nor of the position to `[1]`), and a
/// slice over a whole axis is no node at all.
#[test]
fn scatter_at_a_scalar_index_and_whole_slices_add_no_nodes() {
    let buf = zeros(&[1, 2, 4, 3], Dtype::Float32).unwrap();
    let upd = arange(1., 7., 1., Dtype::Float32).unwrap().reshape(&[1, 2, 1, 3]).unwrap();
    let pos = Array::scalar(2.0, Dtype::Int32).unwrap();
    let out = buf.scatter(&[&pos], &[2], &upd).unwrap();
    let v = out.to_vec::<f32>().unwrap();
    // Head h's row 2 holds its update; everything else stays zero.
    for h in 0..2 {
        for r in 0..4 {
            let row = &v[(h * 4 + r) * 3..(h * 4 + r) * 3 + 3];
            let want: Vec<f32> = if r == 2 { (0..3).map(|c| (h * 3 + c + 1) as f32).collect() } else { vec![0.; 3] };
            assert_eq!(row, want.as_slice(), "head {h} row {r}");
        }
    }
    let ops = graph_ops(&[&out]).unwrap();
    assert!(!ops.iter().any(|(n, _)| n == "Reshape"), "{ops:?}");
    let s = arange(0., 6., 1., Dtype::Float32).unwrap().reshape(&[1, 2, 3]).unwrap();
    eval(&[&s]).unwrap();
    let whole = s.slice_axis(1, 0, 2).unwrap();
    assert!(graph_ops(&[&whole]).unwrap().iter().all(|(n, _)| n != "Slice"), "{:?}", graph_ops(&[&whole]).unwrap());
}

/// The allocator named is the one serving malloc: the C library's here,
/// unless the test binary was started with a mimalloc preloaded (the JS
/// suite checks the relaunched CLI's answer). A name taken from malloc's
/// address would be the executable's wherever it takes that address.
#[test]
fn malloc_library_names_the_allocator_that_serves_malloc() {
    let lib = runtime::malloc_library().expect("the loader names malloc's library");
    let preloaded = std::env::var("LD_PRELOAD").unwrap_or_default();
    if preloaded.contains("mimalloc") {
        assert!(lib.contains("mimalloc"), "{lib} under LD_PRELOAD={preloaded}");
    } else {
        assert!(lib.contains("libc.so") || lib.contains("libsystem_malloc"), "{lib}");
    }
    let exe = std::env::current_exe().unwrap();
    assert_ne!(std::path::Path::new(&lib), exe.as_path());
}

/// A kernel's name for MLX carries a hash of its whole text: MLX keys its
/// compiled kernels (in memory, and on disk across processes) by name and
/// template values only, so a changed body under the same name would run
/// the cubin an earlier body left. Each part of the text, and the MLX
/// version that wraps it, moves the name;
/// the same text gives the same name; the base stays its prefix (what the
/// profilers match).
#[test]
fn kernel_names_change_with_their_text() {
    use kernel::module_name;
    let base = module_name("lfm_k", &["x", "w"], &["y"], "y[0] = x[0];", "", "0.32.4");
    assert_eq!(base, module_name("lfm_k", &["x", "w"], &["y"], "y[0] = x[0];", "", "0.32.4"));
    assert!(base.starts_with("lfm_k_") && base.len() == "lfm_k_".len() + 16, "{base}");
    let others = [
        module_name("lfm_j", &["x", "w"], &["y"], "y[0] = x[0];", "", "0.32.4"),
        module_name("lfm_k", &["x", "v"], &["y"], "y[0] = x[0];", "", "0.32.4"),
        module_name("lfm_k", &["x", "w"], &["z"], "y[0] = x[0];", "", "0.32.4"),
        module_name("lfm_k", &["x", "w"], &["y"], "y[0] = x[1];", "", "0.32.4"),
        module_name("lfm_k", &["x", "w"], &["y"], "y[0] = x[0];", "#define LFM_VARIANT 1\n", "0.32.4"),
        // (The parts are hashed apart: text moved from the body to the
        // header is another kernel's text.)
        module_name("lfm_k", &["x", "w"], &["y"], "", "y[0] = x[0];", "0.32.4"),
        module_name("lfm_k", &["x", "w"], &["y"], "y[0] = x[0];", "", "0.33.0"),
    ];
    for o in &others {
        assert_ne!(&base, o);
    }
}

/// Each call names its operands' dtypes in template values, inputs then
/// outputs, four bits each and seven a value, so MLX compiles (and keeps)
/// a kernel per dtype combination.
#[test]
fn kernel_calls_name_their_operands_dtypes() {
    let x = Array::scalar(1.0, Dtype::Bfloat16).unwrap();
    let i = Array::scalar(2.0, Dtype::Uint32).unwrap();
    let args: Vec<_> = kernel::dtype_args(&[&x, &i], &[(&[4][..], Dtype::Float32)]).collect();
    let packed = ((Dtype::Bfloat16 as i32) << 8) | ((Dtype::Uint32 as i32) << 4) | Dtype::Float32 as i32;
    assert!(matches!(args.as_slice(), [("LFM_IO0", kernel::TemplateArg::Int(v))] if *v == packed), "{args:?}");
    // Another dtype anywhere is another value; eight operands take two.
    let h = Array::scalar(1.0, Dtype::Float16).unwrap();
    let other: Vec<_> = kernel::dtype_args(&[&h, &i], &[(&[4][..], Dtype::Float32)]).collect();
    assert!(!matches!(other.as_slice(), [(_, kernel::TemplateArg::Int(v))] if *v == packed));
    let eight: Vec<&Array> = std::iter::repeat_n(&x, 7).collect();
    let two: Vec<_> = kernel::dtype_args(&eight, &[(&[4][..], Dtype::Float32)]).collect();
    assert!(matches!(two.as_slice(), [("LFM_IO0", _), ("LFM_IO1", kernel::TemplateArg::Int(10))]), "{two:?}");
}

/// `depends` hands back its inputs' values, as nodes of their own after
/// the dependencies (a Depends node in the graph, not the inputs
/// themselves), and refuses an empty list.
#[test]
fn depends_gives_the_inputs_after_the_dependencies() {
    let a = arr(&[1.0, 2.0, 3.0], &[3]);
    let b = arr(&[4.0, 5.0], &[2]);
    let d = a.add(&a).unwrap();
    let out = depends(&[&a, &b], &[&d]).unwrap();
    assert_eq!(out.len(), 2);
    let ops = graph_ops(&[&out[0]]).unwrap();
    assert!(ops.iter().any(|(n, _)| n == "Depends"), "no Depends node: {ops:?}");
    assert!(ops.iter().any(|(n, _)| n == "Add"), "the dependency is not in the graph: {ops:?}");
    assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
    assert_eq!(out[1].to_vec::<f32>().unwrap(), vec![4.0, 5.0]);
    assert_eq!(out[1].shape(), vec![2]);
    assert!(depends(&[], &[&d]).is_err());
    assert!(depends(&[&a], &[]).is_err());
}

/// A compiled function may hand an input back through `depends` (the
/// compiled decode step that writes K/V in place does): the same values
/// come out, beside the dependency's.
#[test]
fn depends_inside_a_compiled_function() {
    let f = Compiled::new(
        |ins| {
            let y = ins[1].mul_scalar(2.0)?;
            let mut out = depends(&[&ins[0]], &[&y])?;
            out.insert(0, y);
            Ok(out)
        },
        false,
    )
    .unwrap();
    let (a, b) = (arr(&[1.0, 2.0], &[2]), arr(&[3.0], &[1]));
    let outs = f.call(&[&a, &b]).unwrap();
    assert_eq!(outs.len(), 2);
    assert_eq!(outs[0].to_vec::<f32>().unwrap(), vec![6.0]);
    assert_eq!(outs[1].to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
}
