//! The caches' side of the fused conv step: handed the state after a
//! one-token call instead of its padded input
//! ([`ForwardCache::conv_step_update`]), every cache must end as it does
//! from the padded input: the same logits after, the same conv states, the
//! same snapshots at block ends (a later prompt's prefix hit restores them).
//! The kernel that hands states over runs only on CUDA, so here the stock
//! step's padded input is split into both states by a wrapper.

use super::*;
use crate::fixture::{self, FixtureSpec, Preset};
use crate::model::lfm2::Lfm2Model;
use crate::model::{load_model, LoadOptions};

/// Passes everything through to `0`, but a one-token call's conv update
/// as the fused step makes it.
struct StepUpdating<'a>(&'a mut dyn ForwardCache);

impl ForwardCache for StepUpdating<'_> {
    fn offset(&self) -> Offset<'_> {
        self.0.offset()
    }
    fn attend(&mut self, layer: usize, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        self.0.attend(layer, q, k, v, scale)
    }
    fn conv_state(&mut self, layer: usize, shape: ConvShape) -> Result<Array> {
        self.0.conv_state(layer, shape)
    }
    fn conv_update(&mut self, layer: usize, padded: &Array, keep: i32) -> Result<()> {
        if padded.dim(1) != keep + 1 {
            return self.0.conv_update(layer, padded, keep);
        }
        let prev = padded.slice_axis(1, 0, keep)?;
        let next = padded.slice_axis(1, 1, keep + 1)?;
        self.0.conv_step_update(layer, &prev, &next)
    }
}

fn model(dir: &std::path::Path, paged_block: Option<usize>) -> Lfm2Model {
    let mut m = load_model(dir, &LoadOptions::default()).unwrap().model;
    if let Some(bs) = paged_block {
        m.use_paged_cache(PagedConfig { block_size: bs, budget_bytes: 64 << 20 }, 3).unwrap();
    }
    m
}

fn values(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec().unwrap()
}

fn states(c: &ModelCache) -> Vec<Vec<f32>> {
    c.layers
        .iter()
        .filter_map(|l| match l {
            LayerCache::Conv(Some(s)) => Some(values(s)),
            _ => None,
        })
        .collect()
}

/// One eager decode token through `cache`, the conv updates as the fused
/// step makes them with `step_updating`: the token's logits.
fn decode(m: &Lfm2Model, cache: &mut ModelCache, id: u32, step_updating: bool) -> Array {
    let ids = Array::from_slice(&[id], &[1, 1]).unwrap();
    if !step_updating {
        return m.forward(&ids, cache, true).unwrap();
    }
    let mut pass = cache.pass(1).unwrap();
    let h = m.hidden(&ids, &mut StepUpdating(&mut pass)).unwrap();
    pass.finish().unwrap();
    m.head(&h).unwrap()
}

#[test]
fn a_conv_state_handed_over_leaves_every_cache_as_the_padded_input_does() {
    let dir = std::env::temp_dir().join(format!("mlxlfm-cache-step-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    fixture::generate(&FixtureSpec::new(Preset::Tiny), &dir).unwrap();
    let prompt: Vec<u32> = (0..6).map(|i| 17 + 29 * i).collect();
    let fed: Vec<u32> = (0..11).map(|i| 5 + 41 * i).collect();
    // Flat, and paged with blocks of 4 (three block ends while decoding,
    // each a snapshot taken from the padded input or the handed state).
    for block in [None, Some(4)] {
        let (a, b) = (model(&dir, block), model(&dir, block));
        let (mut ca, mut cb) = (a.new_cache(), b.new_cache());
        crate::generate::prefill(&a, &mut ca, &prompt, 16).unwrap();
        crate::generate::prefill(&b, &mut cb, &prompt, 16).unwrap();
        for (i, &id) in fed.iter().enumerate() {
            let (la, lb) = (decode(&a, &mut ca, id, false), decode(&b, &mut cb, id, true));
            ca.note_tokens(&[id]);
            cb.note_tokens(&[id]);
            assert_eq!(values(&la), values(&lb), "{block:?}: token {i}'s logits");
        }
        assert_eq!(states(&ca), states(&cb), "{block:?}: the conv states after the decode");
        if block.is_some() {
            // A new sequence whose prompt continues the decoded one takes
            // its blocks and the snapshot after them, then runs the rest.
            let mut full = prompt.clone();
            full.extend(&fed);
            full.push(7);
            let (mut na, mut nb) = (a.new_cache(), b.new_cache());
            let hit = (na.attach_prefix(&full).unwrap(), nb.attach_prefix(&full).unwrap());
            assert_eq!(hit, (16, 16), "the decoded blocks serve a prefix");
            let ids = Array::from_slice(&full[16..], &[1, (full.len() - 16) as i32]).unwrap();
            let (la, lb) = (a.forward(&ids, &mut na, true).unwrap(), b.forward(&ids, &mut nb, true).unwrap());
            assert_eq!(values(&la), values(&lb), "logits after the restored snapshot");
        }
    }
    // Several sequences' eager batch (each row its own cache).
    let (a, b) = (model(&dir, Some(4)), model(&dir, Some(4)));
    let mut rows_a: Vec<ModelCache> = (0..2).map(|_| a.new_cache()).collect();
    let mut rows_b: Vec<ModelCache> = (0..2).map(|_| b.new_cache()).collect();
    for (i, (x, y)) in rows_a.iter_mut().zip(rows_b.iter_mut()).enumerate() {
        crate::generate::prefill(&a, x, &prompt[i..], 16).unwrap();
        crate::generate::prefill(&b, y, &prompt[i..], 16).unwrap();
    }
    for &id in &fed[..5] {
        let ids = Array::from_slice(&[id, id + 1], &[2, 1]).unwrap();
        let mut ra: Vec<&mut ModelCache> = rows_a.iter_mut().collect();
        let la = a.forward_batch(&ids, &mut ra).unwrap();
        let mut rb: Vec<&mut ModelCache> = rows_b.iter_mut().collect();
        let mut pass = RowsPass::new(&mut rb).unwrap();
        let h = b.hidden(&ids, &mut StepUpdating(&mut pass)).unwrap();
        pass.finish().unwrap();
        let lb = b.head(&h).unwrap().reshape(&[2, -1]).unwrap();
        assert_eq!(values(&la), values(&lb), "the rows' logits");
    }
    for (x, y) in rows_a.iter().zip(&rows_b) {
        assert_eq!(states(x), states(y), "a row's conv states");
    }
    // The stacked step's pass keeps the handed state as its output.
    let prev = crate::mlx::arange(0., 12., 1., Dtype::Float32).unwrap().reshape(&[1, 2, 6]).unwrap();
    let x = crate::mlx::arange(50., 56., 1., Dtype::Float32).unwrap().reshape(&[1, 1, 6]).unwrap();
    let padded = concatenate(&[&prev, &x], 1).unwrap();
    let pos = Array::scalar(3.0, Dtype::Int32).unwrap();
    let mut p1 = StackedPass::new(&[false], pos.clone(), vec![prev.clone()]).unwrap();
    p1.conv_update(0, &padded, 2).unwrap();
    let mut p2 = StackedPass::new(&[false], pos, vec![prev.clone()]).unwrap();
    p2.conv_step_update(0, &prev, &padded.slice_axis(1, 1, 3).unwrap()).unwrap();
    assert_eq!(values(&p1.into_state()[0]), values(&p2.into_state()[0]));
    // Mismatched states are refused, naming both shapes.
    let e = padded_from_step(&prev, &x).unwrap_err().to_string();
    assert!(e.contains("[1, 2, 6]") && e.contains("[1, 1, 6]"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The zeros a fresh conv state reads are made once per shape and kept:
/// evaluated (no node in a pass's graph), still zero after ops that could
/// have taken an unshared buffer over, one array per shape and dtype.
#[test]
fn kept_conv_zeros_stay_zero_and_add_no_nodes() {
    use crate::mlx::{full, graph_ops};
    let shape = ConvShape { batch: 2, keep: 3, dim: 8, dtype: Dtype::Float32 };
    let z = shape.zeros().unwrap();
    assert!(graph_ops(&[&z]).unwrap().is_empty(), "{:?}", graph_ops(&[&z]).unwrap());
    let y = z.add(&full(&[2, 3, 8], 1.0, Dtype::Float32).unwrap()).unwrap();
    let cat = concatenate(&[&z, &y], 1).unwrap();
    drop(z);
    drop(y);
    cat.eval().unwrap();
    let again = shape.zeros().unwrap();
    assert_eq!(again.shape(), vec![2, 3, 8]);
    assert!(values(&again).iter().all(|&v| v == 0.0));
    let bf = ConvShape { dtype: Dtype::Bfloat16, ..shape }.zeros().unwrap();
    assert_eq!(bf.dtype(), Dtype::Bfloat16);
    let wider = ConvShape { dim: 16, ..shape }.zeros().unwrap();
    assert_eq!(wider.shape(), vec![2, 3, 16]);
    assert!(values(&wider).iter().all(|&v| v == 0.0));
    // One array a shape, the same one asked again; at most KEPT_SHAPES.
    let kept = super::kept_zero_shapes();
    for _ in 0..3 {
        shape.zeros().unwrap();
    }
    assert_eq!(super::kept_zero_shapes(), kept, "a shape asked again is served from what is kept");
    for batch in 10..40 {
        ConvShape { batch, ..shape }.zeros().unwrap();
    }
    assert_eq!(super::kept_zero_shapes(), super::KEPT_SHAPES);
}
