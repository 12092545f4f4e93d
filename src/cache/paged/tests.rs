//! The paged pool's bookkeeping on its own (no model): block refcounts,
//! LRU eviction, hash-chain lookups that a collision cannot fool, and the
//! decode mirrors reaching the pool at each block end.

use super::*;

const BS: usize = 4;

fn shape() -> PoolShape {
    PoolShape { attn_layers: 1, conv_layers: 1, kv_heads: 1, head_dim: 2, conv_keep: 1, hidden: 2, dtype: Dtype::Float32 }
}

/// A pool with room for exactly `blocks` blocks.
fn pool(blocks: usize) -> PagedPool {
    let budget = shape().block_bytes(BS) * blocks;
    let p = PagedPool::new(PagedConfig { block_size: BS, budget_bytes: budget }, shape(), 7).unwrap();
    assert_eq!(p.max_blocks(), blocks);
    p
}

fn snap() -> Array {
    zeros(&[1, 1, 1, 2], Dtype::Float32).unwrap()
}

fn block_tokens(first: u32) -> Vec<u32> {
    (first..first + BS as u32).collect()
}

/// `tokens` followed by one more (a prefix match always leaves a token to run).
fn prompt(blocks: &[&[u32]]) -> Vec<u32> {
    let mut p: Vec<u32> = blocks.concat();
    p.push(999);
    p
}

#[test]
fn refcounts_keep_published_blocks_until_evicted_and_free_private_ones() {
    let mut p = pool(8);
    let a = p.alloc().unwrap();
    assert_eq!(p.stats().blocks_in_use, 1);
    let t = block_tokens(10);
    let key = p.publish(a, 0, 0, &t, snap());
    p.release(a);
    // Unreferenced but published: cached, not free.
    let s = p.stats();
    assert_eq!((s.blocks_in_use, s.blocks_cached), (0, 1));
    assert!(!p.free.contains(&a));
    // Two requests take it; one gives it back: still held.
    let (found, snapshot, k) = p.match_prefix(&prompt(&[&t]));
    assert_eq!((found.as_slice(), k), (&[a][..], key));
    assert!(snapshot.is_some());
    p.match_prefix(&prompt(&[&t]));
    assert_eq!(p.meta[a as usize].refs, 2);
    p.release(a);
    assert_eq!(p.stats().blocks_in_use, 1);
    p.release(a);
    assert_eq!(p.stats().blocks_in_use, 0);
    assert_eq!((p.stats().hits, p.stats().hit_tokens), (2, 2 * BS as u64));
    // A prompt that is exactly the cached block leaves nothing to run: no hit.
    assert!(p.match_prefix(&t).0.is_empty());
    // A private block goes straight back to the free list.
    let b = p.alloc().unwrap();
    assert_ne!(b, a);
    p.release(b);
    assert!(p.free.contains(&b));
    // Clearing the cache while a request holds a block frees the published
    // one and keeps the storage.
    let held = p.alloc().unwrap();
    p.clear_cached();
    assert!(p.free.contains(&a));
    assert_eq!(p.stats().blocks_cached, 0);
    assert!(p.match_prefix(&prompt(&[&t])).0.is_empty());
    assert!(p.capacity() > 0 && p.nbytes() > 0);
    // With nothing held, the storage goes too, and grows again on demand.
    p.release(held);
    p.clear_cached();
    assert_eq!((p.capacity(), p.nbytes(), p.stats().blocks_in_use), (0, 0, 0));
    let again = p.alloc().unwrap();
    assert!(p.capacity() > 0);
    p.release(again);
}

#[test]
fn eviction_takes_the_least_recently_used_cached_block_and_never_a_held_one() {
    let mut p = pool(3);
    let (ta, tb, tc) = (block_tokens(10), block_tokens(20), block_tokens(30));
    let mut blocks = vec![];
    for t in [&ta, &tb, &tc] {
        let b = p.alloc().unwrap();
        p.publish(b, 0, 0, t, snap());
        blocks.push(b);
    }
    for &b in &blocks {
        p.release(b);
    }
    // `ta` is used again: `tb` is now the oldest.
    let (got, _, _) = p.match_prefix(&prompt(&[&ta]));
    p.release(got[0]);
    let fresh = p.alloc().unwrap();
    assert_eq!(fresh, blocks[1], "the least recently used block is reused");
    assert_eq!(p.stats().evictions, 1);
    assert!(p.match_prefix(&prompt(&[&tb])).0.is_empty(), "an evicted block is no longer found");
    assert_eq!(p.match_prefix(&prompt(&[&ta])).0, vec![blocks[0]]);
    // Now every block is held (ta by the match above, tb's slot by `fresh`,
    // and tc once taken): nothing can be evicted.
    let (held, _, _) = p.match_prefix(&prompt(&[&tc]));
    assert_eq!(held, vec![blocks[2]]);
    let err = p.alloc().unwrap_err();
    assert!(err.message.contains("paged KV cache is full"), "{}", err.message);
    assert_eq!(p.stats().evictions, 1);
    // Deeper blocks of a chain go before their parents on equal age.
    let mut q = pool(2);
    let (root, child) = (q.alloc().unwrap(), q.alloc().unwrap());
    let k0 = q.publish(root, 0, 0, &ta, snap());
    q.publish(child, k0, 1, &tb, snap());
    q.meta[root as usize].refs = 0;
    q.meta[child as usize].refs = 0;
    for (b, depth) in [(root, 0u32), (child, 1)] {
        q.meta[b as usize].last_used = 5;
        q.evictable.insert((5, Reverse(depth), b));
    }
    assert_eq!(q.alloc().unwrap(), child, "the child goes first: it is useless without its parent");
}

#[test]
fn a_hash_collision_never_serves_another_prefix() {
    let mut p = pool(8);
    let (t1, t2) = (block_tokens(10), block_tokens(50));
    let a = p.alloc().unwrap();
    let k1 = p.publish(a, 0, 0, &t1, snap());
    p.release(a);
    // Forge a 64-bit collision: t2's chain key names the block holding t1.
    p.index.insert(chain_key(p.salt, 0, &t2), a);
    assert!(p.match_prefix(&prompt(&[&t2])).0.is_empty(), "the block's own tokens are compared");
    // The same tokens under another parent: t2 published after t1, and a
    // forged root entry for t2 pointing at it.
    let b = p.alloc().unwrap();
    p.publish(b, k1, 1, &t2, snap());
    p.release(b);
    p.index.insert(chain_key(p.salt, 0, &t2), b);
    assert!(p.match_prefix(&prompt(&[&t2])).0.is_empty(), "the parent's key is compared");
    // The real chain still matches, both blocks.
    assert_eq!(p.match_prefix(&prompt(&[&t1, &t2])).0, vec![a, b]);
    // A pool salted for another model has other keys for the same tokens.
    assert_ne!(chain_key(7, 0, &t1), chain_key(8, 0, &t1));
}

/// Decode writes into the mirrors only; positions reach the pool when a
/// block fills (and when the mirrors are dropped), never half a block
/// early, and the pool then holds exactly what the mirrors held.
#[test]
fn decode_mirrors_reach_the_pool_at_each_block_end() {
    let shared: SharedPool = Arc::new(Mutex::new(pool(64)));
    let mut seq = PagedSeq::new(shared.clone());
    let rows = |from: usize, n: usize, off: f32| -> Array {
        let v: Vec<f32> = (0..n * 2).map(|i| (from * 2 + i) as f32 + off).collect();
        Array::from_slice(&v, &[1, 1, n as i32, 2]).unwrap()
    };
    let in_pool = |seq: &PagedSeq, n: usize| -> Vec<f32> {
        let p = shared.lock();
        gather(p.keys(0), &seq.table(n, false).unwrap()).unwrap().slice_axis(2, 0, n as i32).unwrap().to_vec().unwrap()
    };
    // Six positions prefilled straight into the blocks.
    seq.reserve(0, 6).unwrap();
    write_prefill(&mut shared.lock(), &seq, 0, 0, &rows(0, 6, 0.0), &rows(0, 6, 100.0)).unwrap();
    seq.wrote(6, true).unwrap();
    seq.ensure_views(6, 7).unwrap();
    assert_eq!(seq.view_cap(), TABLE_STEP_TOKENS);
    let mirror = seq.view(0).unwrap().0.slice_axis(2, 0, 6).unwrap();
    assert_eq!(mirror.to_vec::<f32>().unwrap(), rows(0, 6, 0.0).to_vec::<f32>().unwrap());
    for len in 6..10 {
        seq.reserve(len, 1).unwrap();
        let (k, v) = seq.view(0).unwrap().clone();
        let p = len as i32;
        let k = k.slice_update(&rows(len, 1, 0.0), &[0, 0, p, 0], &[1, 1, p + 1, 2]).unwrap();
        let v = v.slice_update(&rows(len, 1, 100.0), &[0, 0, p, 0], &[1, 1, p + 1, 2]).unwrap();
        seq.set_view(0, (k, v));
        seq.wrote(len + 1, false).unwrap();
        let want_flushed = if (len + 1) % BS == 0 { len + 1 } else { (len + 1) / BS * BS };
        assert_eq!(seq.flushed(), want_flushed.max(6), "after position {len}");
    }
    // Positions 0..8: a full block flushed; 8 and 9 only in the mirrors.
    assert_eq!(in_pool(&seq, 8), rows(0, 8, 0.0).to_vec::<f32>().unwrap());
    let past: Vec<f32> = in_pool(&seq, 10)[16..].to_vec();
    assert_eq!(past, vec![0.0; 4], "positions 8 and 9 reached the pool before their block filled");
    seq.drop_views(10).unwrap();
    assert!(!seq.has_views());
    assert_eq!(seq.flushed(), 10);
    assert_eq!(in_pool(&seq, 10), rows(0, 10, 0.0).to_vec::<f32>().unwrap());
}
