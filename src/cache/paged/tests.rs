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

/// A fresh directory for a disk tier.
fn disk_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("mlxlfm-paged-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    d
}

/// Writes two chained blocks (`a` then `b`) with distinct K/V to a disk
/// tier in `dir`, as a closing model does. Returns the K values of the pool
/// they were in and their blocks there.
fn write_two_blocks(dir: &std::path::Path, a: &[u32], b: &[u32]) -> (Vec<f32>, [u32; 2]) {
    let mut p = pool(8);
    p.attach_disk(dir, 1 << 20, "fp").unwrap();
    let (x, y) = (p.alloc().unwrap(), p.alloc().unwrap());
    let n = p.capacity();
    let k: Vec<f32> = (0..n * BS * 2).map(|i| i as f32 + 0.5).collect();
    let v: Vec<f32> = k.iter().map(|x| -x).collect();
    let shape = [1, n as i32, BS as i32, 2];
    p.set_layer(0, Array::from_slice(&k, &shape).unwrap(), Array::from_slice(&v, &shape).unwrap());
    let kx = p.publish(x, 0, 0, a, snap());
    p.publish(y, kx, 1, b, snap());
    p.release(x);
    p.release(y);
    p.persist();
    (k, [x, y])
}

fn wait_for(t: &prefetch::Ticket) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !t.is_done() {
        assert!(std::time::Instant::now() < deadline, "the disk reader did not finish");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

fn block_k(p: &PagedPool, b: u32) -> Vec<f32> {
    p.keys(0).slice_axis(1, b as i32, b as i32 + 1).unwrap().to_vec().unwrap()
}

/// A prompt's blocks read ahead by the reader thread are what its lookup
/// uses: the files are removed once they are read, and the lookup still
/// finds both blocks, with the K/V that were written, without reading a
/// file again (the reads counter stays at 2). Nothing of it is read ahead a
/// second time once it is in memory.
#[test]
fn blocks_read_ahead_are_used_at_admission_without_a_second_read() {
    let dir = disk_dir("ahead");
    let (a, b) = (block_tokens(10), block_tokens(20));
    let (k, written) = write_two_blocks(&dir, &a, &b);
    let mut p = pool(8);
    p.attach_disk(&dir, 1 << 20, "fp").unwrap();
    let ahead = p.prefetcher().unwrap();
    let t = ahead.prefetch(&prompt(&[&a, &b])).expect("two blocks to read");
    wait_for(&t);
    let s = p.stats().disk.unwrap();
    assert_eq!((s.reads, s.prefetched, s.hits, s.misses), (2, 2, 0, 0), "{s:?}");
    for f in std::fs::read_dir(&dir).unwrap() {
        std::fs::remove_file(f.unwrap().path()).unwrap();
    }
    let (found, snapshot, _) = p.match_prefix(&prompt(&[&a, &b]));
    assert_eq!(found.len(), 2);
    assert!(snapshot.is_some());
    let s = p.stats().disk.unwrap();
    assert_eq!((s.reads, s.hits, s.misses, s.damaged), (2, 2, 0, 0), "{s:?}");
    // The files are gone: the directory's accounting (the writer thread
    // keeps it) does not keep them.
    p.disk.as_ref().unwrap().flush();
    assert_eq!(p.stats().disk.unwrap().bytes, 0);
    let per = BS * 2;
    for (got, was) in found.iter().zip(written) {
        assert_eq!(block_k(&p, *got), k[was as usize * per..(was as usize + 1) * per]);
    }
    assert!(ahead.prefetch(&prompt(&[&a, &b])).is_none(), "blocks in memory are not read ahead");
    std::fs::remove_dir_all(&dir).ok();
}

/// A lookup right after the read-ahead starts takes its blocks (waiting
/// for them when the reader is still on them: timing decides which here);
/// a prompt whose blocks are being read already does not read them again;
/// a prompt with nothing on disk queues nothing.
#[test]
fn a_lookup_waits_for_blocks_being_read_and_no_file_is_read_twice() {
    let dir = disk_dir("inflight");
    let (a, b) = (block_tokens(10), block_tokens(20));
    write_two_blocks(&dir, &a, &b);
    let mut p = pool(8);
    p.attach_disk(&dir, 1 << 20, "fp").unwrap();
    let ahead = p.prefetcher().unwrap();
    let t = ahead.prefetch(&prompt(&[&a, &b]));
    assert!(ahead.prefetch(&prompt(&[&a, &b])).is_none(), "both blocks are on their way already");
    assert!(ahead.prefetch(&prompt(&[&block_tokens(50)])).is_none(), "no file, nothing to read");
    // No wait here: the lookup takes what the reader is reading.
    let (found, _, _) = p.match_prefix(&prompt(&[&a, &b]));
    assert_eq!(found.len(), 2);
    let s = p.stats().disk.unwrap();
    assert_eq!((s.reads, s.prefetched, s.hits), (2, 2, 2), "{s:?}");
    wait_for(&t.unwrap());
    std::fs::remove_dir_all(&dir).ok();
}

/// A damaged file the reader finds is removed with the usual accounting
/// (one damaged file), the chain is not read past it, and the lookup at
/// admission misses instead of using anything of it.
#[test]
fn a_damaged_file_found_by_the_reader_is_removed_and_the_lookup_misses() {
    let dir = disk_dir("damaged");
    let (a, b) = (block_tokens(10), block_tokens(20));
    write_two_blocks(&dir, &a, &b);
    let first = dir.join(format!("{:016x}.blk", chain_key(7, 0, &a)));
    let mut bytes = std::fs::read(&first).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0xff;
    std::fs::write(&first, bytes).unwrap();
    let mut p = pool(8);
    p.attach_disk(&dir, 1 << 20, "fp").unwrap();
    let t = p.prefetcher().unwrap().prefetch(&prompt(&[&a, &b])).expect("blocks to read");
    wait_for(&t);
    let s = p.stats().disk.unwrap();
    assert_eq!((s.reads, s.prefetched, s.damaged), (1, 0, 1), "{s:?}");
    assert!(!first.exists(), "the damaged file is removed");
    let (found, snapshot, _) = p.match_prefix(&prompt(&[&a, &b]));
    assert!(found.is_empty() && snapshot.is_none());
    let s = p.stats().disk.unwrap();
    assert_eq!((s.reads, s.hits, s.misses, s.damaged), (1, 0, 1, 1), "{s:?}");
    std::fs::remove_dir_all(&dir).ok();
}
