//! The paged KV cache: one block pool per loaded model, shared by every
//! sequence, with content-addressed prefix reuse.
//!
//! - Storage: per attention layer a K and a V pool `[kv_heads, blocks,
//!   block_size, head_dim]`; a sequence owns a block table. Blocks are
//!   refcounted; the pool grows on demand up to a memory budget, then evicts
//!   the least recently used block nobody references.
//! - Prefix reuse: a full block is published under a hash chain over its
//!   token ids (salted per model), so a later request whose prompt starts
//!   with the same tokens takes those blocks instead of recomputing them.
//!   The chain key is only an index: the block's own tokens and its parent's
//!   key are compared on every hit, so a hash collision cannot serve wrong
//!   K/V.
//! - Conv layers keep no KV, and their state cannot be rebuilt from K/V, so
//!   each published block carries a snapshot of every conv layer's state
//!   after its last token. A hit restores that snapshot and runs only the
//!   suffix through the model.

pub mod disk;
pub mod prefetch;

use crate::error::{Error, Result};
use crate::mlx::{concatenate, eval, stack, zeros, Array, Dtype};
use disk::{BlockSpec, DiskStats, DiskTier, HostBlock};
use prefetch::Prefetcher;
use parking_lot::Mutex;
use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// Default tokens per block.
pub const DEFAULT_BLOCK_SIZE: usize = 32;
/// Default memory budget for the pool (K/V and conv snapshots).
pub const DEFAULT_BUDGET_MB: usize = 2048;
/// Decode attends over a block table padded to a multiple of this many
/// tokens, so the compiled step's shapes change only every so often (the
/// same step as the flat cache: equal shapes, equal results).
pub const TABLE_STEP_TOKENS: usize = super::flat::KV_STEP;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedConfig {
    pub block_size: usize,
    pub budget_bytes: usize,
}

impl PagedConfig {
    pub fn validate(&self) -> Result<()> {
        if !(1..=4096).contains(&self.block_size) {
            return Err(Error::config(format!(
                "paged cache block size {} is out of range; use 1..4096 tokens",
                self.block_size
            )));
        }
        Ok(())
    }
}

/// The shapes one pool serves.
#[derive(Debug, Clone)]
pub struct PoolShape {
    pub attn_layers: usize,
    pub conv_layers: usize,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub conv_keep: i32,
    pub hidden: i32,
    pub dtype: Dtype,
}

impl PoolShape {
    fn block_bytes(&self, bs: usize) -> usize {
        let kv = 2 * self.attn_layers * (self.kv_heads * self.head_dim) as usize * bs;
        let snap = self.conv_layers * (self.conv_keep * self.hidden) as usize;
        (kv + snap) * self.dtype.size()
    }
}

const NONE: u32 = u32::MAX;

#[derive(Default)]
struct BlockMeta {
    refs: u32,
    /// Set while the block is in the prefix index.
    key: Option<u64>,
    parent_key: u64,
    tokens: Vec<u32>,
    /// Every conv layer's state after the block's last token,
    /// `[conv_layers, 1, keep, hidden]`.
    snapshot: Option<Array>,
    depth: u32,
    last_used: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PagedStats {
    pub block_size: usize,
    pub capacity_blocks: usize,
    pub max_blocks: usize,
    pub blocks_in_use: usize,
    pub blocks_cached: usize,
    pub evictions: u64,
    pub hits: u64,
    pub hit_tokens: u64,
    /// The disk tier's counters, when the pool has one.
    pub disk: Option<DiskStats>,
}

pub struct PagedPool {
    cfg: PagedConfig,
    shape: PoolShape,
    max_blocks: usize,
    salt: u64,
    keys: Vec<Array>,
    values: Vec<Array>,
    meta: Vec<BlockMeta>,
    free: Vec<u32>,
    index: HashMap<u64, u32>,
    /// Unreferenced published blocks, oldest first; deeper blocks of a chain
    /// go before their parents on ties (a child is useless without them).
    evictable: BTreeSet<(u64, Reverse<u32>, u32)>,
    tick: u64,
    evictions: u64,
    hits: u64,
    hit_tokens: u64,
    /// Tokens of prefix hits that were read back from disk.
    disk_hit_tokens: u64,
    /// The end of finished requests: their last, partial block and the conv
    /// states after it, keyed by the chain key of the full blocks before
    /// it. A later prompt that continues exactly (the next chat turn) takes
    /// a copy and runs only what is new. Each holds a reference to its
    /// block; they are dropped oldest first when blocks run out.
    tails: HashMap<u64, Tail>,
    /// Where evicted blocks go, and where lookups that miss in memory look
    /// next (see disk.rs).
    disk: Option<DiskTier>,
    /// Evicted blocks on their way to the disk tier.
    spills: Vec<Spill>,
}

/// A block leaving memory for disk: its identity, and its K/V (per layer K
/// then V) and snapshot, evaluated asynchronously.
struct Spill {
    key: u64,
    parent_key: u64,
    depth: u32,
    tokens: Vec<u32>,
    kv: Vec<Array>,
    snapshot: Array,
}

struct Tail {
    block: u32,
    tokens: Vec<u32>,
    snapshot: Array,
    last_used: u64,
}

/// Most request ends kept for exact continuation.
const MAX_TAILS: usize = 64;

/// Most bytes of blocks read ahead from disk and not yet used (host memory
/// beside the pool's budget; never more than that budget).
const PREFETCH_MAX_BYTES: usize = 256 << 20;

pub type SharedPool = Arc<Mutex<PagedPool>>;

fn chain_key(salt: u64, parent: u64, tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    salt.hash(&mut h);
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl PagedPool {
    /// `salt` ties published blocks to one model (weights, dtype): a pool is
    /// per model today, the salt keeps it so if pools are ever shared.
    pub fn new(cfg: PagedConfig, shape: PoolShape, salt: u64) -> Result<PagedPool> {
        cfg.validate()?;
        let per_block = shape.block_bytes(cfg.block_size).max(1);
        let max_blocks = (cfg.budget_bytes / per_block).min(NONE as usize - 1);
        if max_blocks == 0 {
            return Err(Error::config(format!(
                "paged cache budget of {} bytes cannot hold one block of {} tokens ({per_block} bytes)",
                cfg.budget_bytes, cfg.block_size
            )));
        }
        Ok(PagedPool {
            cfg,
            shape,
            max_blocks,
            salt,
            keys: vec![],
            values: vec![],
            meta: vec![],
            free: vec![],
            index: HashMap::new(),
            evictable: BTreeSet::new(),
            tick: 0,
            evictions: 0,
            hits: 0,
            hit_tokens: 0,
            disk_hit_tokens: 0,
            tails: HashMap::new(),
            disk: None,
            spills: vec![],
        })
    }

    /// Gives the pool a disk tier in `dir` (created when missing), of
    /// `budget` bytes, for blocks of the model with `fingerprint`.
    pub fn attach_disk(&mut self, dir: &std::path::Path, budget: u64, fingerprint: &str) -> Result<()> {
        let s = &self.shape;
        let bs = self.cfg.block_size;
        let (h, d) = (s.kv_heads as usize, s.head_dim as usize);
        let spec = BlockSpec {
            dtype: crate::engine::session_file::st_dtype(s.dtype)?,
            attn_layers: s.attn_layers,
            kv_shape: vec![h, 1, bs, d],
            kv_bytes: h * bs * d * s.dtype.size(),
            snapshot_shape: if s.conv_layers == 0 {
                vec![1]
            } else {
                vec![s.conv_layers, 1, s.conv_keep as usize, s.hidden as usize]
            },
            // The block's bytes, and room for its metadata (the tokens as JSON).
            max_len: (s.block_bytes(bs) * 2 + bs * 16 + (64 << 10)) as u64,
        };
        let ahead = PREFETCH_MAX_BYTES.min(self.cfg.budget_bytes).max(s.block_bytes(bs) * 2 + bs * 4);
        let disk = DiskTier::open(dir, budget, fingerprint, spec, ahead)?;
        for &key in self.index.keys() {
            disk.set_resident(key, true);
        }
        self.disk = Some(disk);
        Ok(())
    }

    /// A handle that reads a prompt's blocks from disk ahead of its
    /// admission, off the worker (None without a disk tier).
    pub fn prefetcher(&self) -> Option<Prefetcher> {
        self.disk.as_ref().map(|d| d.prefetcher(self.salt, self.cfg.block_size))
    }

    /// Queues published block `b` for the disk tier (unless it is there
    /// already): its K/V and snapshot are sliced out and evaluated
    /// asynchronously, so the step that evicted it does not wait for the
    /// copy; [`PagedPool::drain_spills`] hands the bytes to the writer
    /// thread after the step. The slices hold the pool's arrays as they
    /// were, so the block may be overwritten meanwhile.
    fn spill(&mut self, b: u32) {
        let Some(disk) = &self.disk else { return };
        let m = &self.meta[b as usize];
        let (Some(key), Some(snapshot)) = (m.key, m.snapshot.clone()) else { return };
        if disk.has(key) {
            return;
        }
        let (h, bs, d) = (self.shape.kv_heads, self.cfg.block_size as i32, self.shape.head_dim);
        let bi = b as i32;
        let sliced = (|| -> Result<Vec<Array>> {
            let mut kv = Vec::with_capacity(2 * self.keys.len());
            for i in 0..self.keys.len() {
                for pool in [&self.keys[i], &self.values[i]] {
                    kv.push(pool.slice(&[0, bi, 0, 0], &[h, bi + 1, bs, d], &[1, 1, 1, 1])?.contiguous()?);
                }
            }
            let refs: Vec<&Array> = kv.iter().chain(std::iter::once(&snapshot)).collect();
            crate::mlx::async_eval(&refs)?;
            Ok(kv)
        })();
        match sliced {
            Ok(kv) => self.spills.push(Spill { key, parent_key: m.parent_key, depth: m.depth, tokens: m.tokens.clone(), kv, snapshot }),
            Err(e) => eprintln!("mlx-lfm: a prefix-cache block could not be copied for the disk: {}", e.message),
        }
    }

    /// Hands the blocks queued by `spill` to the disk writer as host bytes.
    pub fn drain_spills(&mut self) {
        let Some(disk) = &self.disk else { return };
        for s in self.spills.drain(..) {
            let host = (|| -> Result<HostBlock> {
                let st = crate::engine::session_file::st_dtype;
                let shape = |a: &Array| a.shape().iter().map(|&x| x as usize).collect::<Vec<_>>();
                Ok(HostBlock {
                    key: s.key,
                    parent_key: s.parent_key,
                    depth: s.depth,
                    tokens: s.tokens,
                    dtype: st(self.shape.dtype)?,
                    kv: s.kv.iter().map(|a| Ok((shape(a), a.to_bytes()?))).collect::<Result<_>>()?,
                    snapshot: (st(s.snapshot.dtype())?, shape(&s.snapshot), s.snapshot.contiguous()?.to_bytes()?),
                })
            })();
            match host {
                Ok(hb) => disk.write(hb),
                Err(e) => eprintln!("mlx-lfm: a prefix-cache block could not be copied for the disk: {}", e.message),
            }
        }
    }

    /// Whether blocks wait in [`PagedPool::drain_spills`].
    pub fn has_spills(&self) -> bool {
        !self.spills.is_empty()
    }

    /// Writes every published block to the disk tier and waits for the
    /// writes (at close).
    pub fn persist(&mut self) {
        if self.disk.is_none() {
            return;
        }
        let mut blocks: Vec<u32> = self.index.values().copied().collect();
        blocks.sort();
        for b in blocks {
            self.spill(b);
        }
        self.drain_spills();
        if let Some(d) = &self.disk {
            d.flush();
        }
    }

    /// Block `j` of a prompt from the disk tier, into a fresh pool block
    /// (published, held once). None when the disk has no usable copy. The
    /// file was read and checked by the disk tier (usually ahead, off this
    /// thread); only the arrays are made here.
    fn load_from_disk(&mut self, parent: u64, j: usize, toks: &[u32], key: u64) -> Option<u32> {
        let disk = self.disk.as_ref()?;
        let s = &self.shape;
        let (h, bs, d) = (s.kv_heads as usize, self.cfg.block_size, s.head_dim as usize);
        let layers = s.attn_layers;
        let hb = disk.read(key, parent, toks)?;
        let arrays = (|| -> Result<(Vec<Array>, Array)> {
            let shape = [h as i32, 1, bs as i32, d as i32];
            let kv = hb.kv.iter().map(|(_, bytes)| Array::from_bytes(bytes, &shape, s.dtype)).collect::<Result<Vec<_>>>()?;
            let (sd, ss, sb) = &hb.snapshot;
            let sdt = crate::engine::session_file::mlx_dtype(*sd).ok_or_else(|| Error::invalid("snapshot dtype"))?;
            let sshape: Vec<i32> = ss.iter().map(|&x| x as i32).collect();
            Ok((kv, Array::from_bytes(sb, &sshape, sdt)?))
        })();
        let (kv, snap) = arrays.ok()?;
        let b = self.alloc().ok()?;
        let bi = b as i32;
        let (hi, bsi, di) = (h as i32, bs as i32, d as i32);
        let written = (|| -> Result<()> {
            for i in 0..layers {
                let k = self.keys[i].slice_update(&kv[2 * i], &[0, bi, 0, 0], &[hi, bi + 1, bsi, di])?;
                let v = self.values[i].slice_update(&kv[2 * i + 1], &[0, bi, 0, 0], &[hi, bi + 1, bsi, di])?;
                self.set_layer(i, k, v);
            }
            Ok(())
        })();
        if written.is_err() {
            self.release(b);
            return None;
        }
        self.publish(b, parent, j as u32, toks, snap);
        Some(b)
    }

    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }
    pub fn capacity(&self) -> usize {
        self.meta.len()
    }

    pub fn stats(&self) -> PagedStats {
        PagedStats {
            block_size: self.cfg.block_size,
            capacity_blocks: self.meta.len(),
            max_blocks: self.max_blocks,
            // A kept request end holds one reference to its block; that is
            // cache, not use.
            blocks_in_use: self
                .meta
                .iter()
                .enumerate()
                .filter(|(b, m)| m.refs > self.tails.values().filter(|t| t.block as usize == *b).count() as u32)
                .count(),
            blocks_cached: self.index.len() + self.tails.len(),
            evictions: self.evictions,
            hits: self.hits,
            hit_tokens: self.hit_tokens,
            disk: self.disk.as_ref().map(|d| d.stats()),
        }
    }

    /// Bytes the pool holds now (allocated blocks and snapshots).
    pub fn nbytes(&self) -> usize {
        self.keys.iter().chain(&self.values).map(|a| a.nbytes()).sum::<usize>()
            + self.meta.iter().filter_map(|m| m.snapshot.as_ref()).map(|a| a.nbytes()).sum::<usize>()
            + self.tails.values().map(|t| t.snapshot.nbytes()).sum::<usize>()
    }

    /// Grows the pool by at least one block, doubling while under budget.
    fn grow(&mut self) -> Result<bool> {
        let cap = self.meta.len();
        if cap >= self.max_blocks {
            return Ok(false);
        }
        // Start at 4096 tokens' worth, then double: few growths (each copies
        // the pool), and nothing allocated up front.
        let min_step = 4096usize.div_ceil(self.cfg.block_size).max(1);
        let new_cap = (cap * 2).max(cap + min_step).min(self.max_blocks);
        let add = (new_cap - cap) as i32;
        let s = &self.shape;
        let (h, bs, d) = (s.kv_heads, self.cfg.block_size as i32, s.head_dim);
        let fresh = zeros(&[h, add, bs, d], s.dtype)?;
        let grow = |old: Option<&Array>| -> Result<Array> {
            match old {
                Some(o) => concatenate(&[o, &fresh], 1),
                None => Ok(fresh.clone()),
            }
        };
        let mut keys = Vec::with_capacity(s.attn_layers);
        let mut values = Vec::with_capacity(s.attn_layers);
        for i in 0..s.attn_layers {
            keys.push(grow(self.keys.get(i))?);
            values.push(grow(self.values.get(i))?);
        }
        // Materialise now so the old pools are freed, not kept in a graph.
        let all: Vec<&Array> = keys.iter().chain(&values).collect();
        eval(&all)?;
        self.keys = keys;
        self.values = values;
        for b in (cap..new_cap).rev() {
            self.free.push(b as u32);
        }
        self.meta.resize_with(new_cap, BlockMeta::default);
        Ok(true)
    }

    fn unpublish(&mut self, b: u32) {
        let m = &mut self.meta[b as usize];
        if let Some(k) = m.key.take() {
            if self.index.get(&k) == Some(&b) {
                self.index.remove(&k);
                if let Some(d) = &self.disk {
                    d.set_resident(k, false);
                }
            }
        }
        m.snapshot = None;
        m.tokens.clear();
    }

    /// One block for a sequence to write into (refcount 1).
    fn alloc(&mut self) -> Result<u32> {
        while self.free.is_empty() {
            if self.grow()? {
                continue;
            }
            if let Some(&victim) = self.evictable.iter().next() {
                self.evictable.remove(&victim);
                self.spill(victim.2);
                self.unpublish(victim.2);
                self.evictions += 1;
                self.free.push(victim.2);
                continue;
            }
            if self.drop_oldest_tail() {
                continue;
            }
            return Err(Error::invalid(format!(
                "the paged KV cache is full: all {} blocks of {} tokens ({} MiB budget) are held by running \
                 requests; raise pagedCacheBudgetMb, shorten the request, or run fewer at once",
                self.max_blocks,
                self.cfg.block_size,
                self.cfg.budget_bytes >> 20
            )));
        }
        let b = self.free.pop().expect("a free block after growing or evicting");
        let m = &mut self.meta[b as usize];
        m.refs = 1;
        m.depth = 0;
        Ok(b)
    }

    fn drop_oldest_tail(&mut self) -> bool {
        let Some((&k, _)) = self.tails.iter().min_by_key(|(_, t)| t.last_used) else { return false };
        let t = self.tails.remove(&k).expect("the tail just found");
        self.release(t.block);
        true
    }

    /// Keeps a finished request's end (see `tails`).
    fn keep_tail(&mut self, parent_key: u64, block: u32, tokens: Vec<u32>, snapshot: Array) {
        self.retain(block);
        let last_used = self.tick;
        if let Some(old) = self.tails.insert(parent_key, Tail { block, tokens, snapshot, last_used }) {
            self.release(old.block);
        }
        while self.tails.len() > MAX_TAILS {
            self.drop_oldest_tail();
        }
    }

    fn touch(&mut self, b: u32) {
        self.tick += 1;
        self.meta[b as usize].last_used = self.tick;
    }

    fn retain(&mut self, b: u32) {
        let m = &self.meta[b as usize];
        if m.refs == 0 {
            self.evictable.remove(&(m.last_used, Reverse(m.depth), b));
        }
        self.meta[b as usize].refs += 1;
        self.touch(b);
    }

    fn release(&mut self, b: u32) {
        let m = &mut self.meta[b as usize];
        debug_assert!(m.refs > 0, "block {b} released more often than taken");
        m.refs = m.refs.saturating_sub(1);
        if m.refs > 0 {
            return;
        }
        if m.key.is_some() {
            self.touch(b);
            let m = &self.meta[b as usize];
            self.evictable.insert((m.last_used, Reverse(m.depth), b));
        } else {
            self.unpublish(b);
            self.free.push(b);
        }
    }

    /// The longest run of published blocks that starts `tokens` and leaves
    /// at least one token to run. Returns the blocks (taken), the conv
    /// snapshot after the last of them and the chain key they end with.
    fn match_prefix(&mut self, tokens: &[u32]) -> (Vec<u32>, Option<Array>, u64) {
        let bs = self.cfg.block_size;
        let mut parent = 0u64;
        let mut found: Vec<u32> = vec![];
        let mut snapshot = None;
        let mut j = 0;
        while (j + 1) * bs < tokens.len() {
            let toks = &tokens[j * bs..(j + 1) * bs];
            let key = chain_key(self.salt, parent, toks);
            let b = match self.index.get(&key) {
                Some(&b) => {
                    let m = &self.meta[b as usize];
                    if m.parent_key != parent || m.tokens != toks || m.snapshot.is_none() {
                        break;
                    }
                    // Taken as found: a block read from disk below must not
                    // evict it.
                    self.retain(b);
                    b
                }
                None => match self.load_from_disk(parent, j, toks, key) {
                    Some(b) => {
                        self.disk_hit_tokens += bs as u64;
                        b
                    }
                    None => break,
                },
            };
            snapshot = self.meta[b as usize].snapshot.clone();
            found.push(b);
            parent = key;
            j += 1;
        }
        if !found.is_empty() {
            self.hits += 1;
            self.hit_tokens += (found.len() * bs) as u64;
        }
        (found, snapshot, parent)
    }

    /// Puts a full block in the prefix index. A block whose content is
    /// already published (two requests computed the same prefix) stays
    /// private and is freed with its sequence.
    fn publish(&mut self, b: u32, parent_key: u64, depth: u32, tokens: &[u32], snapshot: Array) -> u64 {
        let key = chain_key(self.salt, parent_key, tokens);
        if self.index.contains_key(&key) {
            return key;
        }
        let m = &mut self.meta[b as usize];
        m.key = Some(key);
        m.parent_key = parent_key;
        m.tokens = tokens.to_vec();
        m.snapshot = Some(snapshot);
        m.depth = depth;
        self.index.insert(key, b);
        if let Some(d) = &self.disk {
            d.set_resident(key, true);
        }
        key
    }

    /// Drops every published block nobody holds and every kept request end.
    /// When no running request holds a block either, the pool's storage
    /// goes too (it grows again on demand), so memory returns to the
    /// model's own.
    pub fn clear_cached(&mut self) {
        while self.drop_oldest_tail() {}
        let victims: Vec<u32> = self.evictable.iter().map(|e| e.2).collect();
        self.evictable.clear();
        for b in victims {
            self.unpublish(b);
            self.free.push(b);
        }
        if self.meta.iter().all(|m| m.refs == 0) {
            self.keys.clear();
            self.values.clear();
            self.meta.clear();
            self.free.clear();
        }
    }

    pub fn keys(&self, layer: usize) -> &Array {
        &self.keys[layer]
    }
    pub fn values(&self, layer: usize) -> &Array {
        &self.values[layer]
    }
    pub fn set_layer(&mut self, layer: usize, k: Array, v: Array) {
        self.keys[layer] = k;
        self.values[layer] = v;
    }
    pub fn layer_arrays(&self) -> Vec<&Array> {
        self.keys.iter().chain(&self.values).collect()
    }
}

/// One sequence's view of the pool: its block table and what is known about
/// the tokens in it. Dropping it returns its blocks (so a cancelled or
/// failed request gives them back without any extra path). It keeps no
/// length of its own: the sequence's position (`ModelCache::pos`) is passed
/// in as `len`, and only the methods here change its bookkeeping (the pool
/// handle and the cached-token count are readable, never written, outside).
pub struct PagedSeq {
    pub pool: SharedPool,
    blocks: Vec<u32>,
    /// Token ids of positions `0..tokens.len()` as far as the host knows
    /// them (a decoded token is known only after it is read back).
    tokens: Vec<u32>,
    /// Leading blocks that are in the index (taken from it or published).
    published: usize,
    parent_key: u64,
    /// Conv snapshots of full blocks not yet published, by block index.
    snaps: HashMap<usize, Array>,
    /// Tokens taken from the prefix cache by the last [`PagedSeq::attach`].
    pub cached_tokens: usize,
    block_size: usize,
    /// Rows of a conv state (`L-1`), the width of a conv snapshot.
    conv_keep: i32,
    /// Decode mirrors: per attention layer the sequence's K and V in
    /// contiguous `[1, kv_heads, view_cap, head_dim]` buffers, gathered from
    /// the blocks once when decode starts and grown like a flat cache. A
    /// decode step writes and attends over the mirrors only, exactly as a
    /// flat step does (the same compiled step, no gather per token, and the
    /// pool is not an input of the compiled function, so pool growth never
    /// retraces it); whole blocks are copied into the pool as they fill.
    views: Vec<(Array, Array)>,
    view_cap: usize,
    /// Positions whose K/V are in the pool (the rest are only in the
    /// mirrors).
    flushed: usize,
}

impl PagedSeq {
    pub fn new(pool: SharedPool) -> PagedSeq {
        let (block_size, conv_keep) = {
            let p = pool.lock();
            (p.block_size(), p.shape.conv_keep)
        };
        PagedSeq {
            pool,
            blocks: vec![],
            tokens: vec![],
            published: 0,
            parent_key: 0,
            snaps: HashMap::new(),
            cached_tokens: 0,
            block_size,
            conv_keep,
            views: vec![],
            view_cap: 0,
            flushed: 0,
        }
    }

    /// Makes sure the decode mirrors cover positions `0..upto`: built from
    /// the pool (everything written so far is there when there are no
    /// mirrors), grown by whole `TABLE_STEP_TOKENS` like a flat cache.
    pub fn ensure_views(&mut self, len: usize, upto: usize) -> Result<()> {
        if !self.views.is_empty() {
            if upto <= self.view_cap {
                return Ok(());
            }
            let add = (upto - self.view_cap).div_ceil(TABLE_STEP_TOKENS) * TABLE_STEP_TOKENS;
            let mut grown = Vec::with_capacity(self.views.len());
            for (k, v) in &self.views {
                let z = |a: &Array| zeros(&[1, a.dim(1), add as i32, a.dim(3)], a.dtype());
                grown.push((concatenate(&[k, &z(k)?], 2)?, concatenate(&[v, &z(v)?], 2)?));
            }
            self.views = grown;
            self.view_cap += add;
            return Ok(());
        }
        if self.flushed != len {
            return Err(Error::invalid(format!(
                "paged decode mirrors built at position {len} while the pool holds {} positions",
                self.flushed
            )));
        }
        let table = self.table(upto, true)?;
        let pool = self.pool.lock();
        let n = pool.keys.len();
        let mut views = Vec::with_capacity(n);
        for i in 0..n {
            views.push((gather(&pool.keys[i], &table)?, gather(&pool.values[i], &table)?));
        }
        drop(pool);
        self.view_cap = table.dim(0) as usize * self.block_size;
        self.views = views;
        Ok(())
    }

    /// Copies positions `flushed..len` from the mirrors into the pool.
    fn flush(&mut self, len: usize) -> Result<()> {
        if self.views.is_empty() || self.flushed >= len {
            return Ok(());
        }
        let (from, to) = (self.flushed as i32, len as i32);
        let pool_arc = self.pool.clone();
        let mut pool = pool_arc.lock();
        for (i, (k, v)) in self.views.iter().enumerate() {
            let ks = k.slice_axis(2, from, to)?;
            let vs = v.slice_axis(2, from, to)?;
            write_prefill(&mut pool, self, i, self.flushed, &ks, &vs)?;
        }
        self.flushed = len;
        Ok(())
    }

    /// After positions up to `len` were written: into the pool (a prefill,
    /// or a decode batch's rows written back), or into the decode mirrors
    /// (a decode step), where a block that just filled goes to the pool.
    pub fn wrote(&mut self, len: usize, to_pool: bool) -> Result<()> {
        if to_pool {
            self.flushed = len;
        } else if len.is_multiple_of(self.block_size) {
            self.flush(len)?;
        }
        Ok(())
    }

    /// Positions whose K/V are in the pool.
    pub fn flushed(&self) -> usize {
        self.flushed
    }

    /// Attention layer `ord`'s decode mirrors (K, V), when built.
    pub fn view(&self, ord: usize) -> Option<&(Array, Array)> {
        self.views.get(ord)
    }

    /// Takes back a mirror a decode step wrote one token into.
    pub fn set_view(&mut self, ord: usize, kv: (Array, Array)) {
        self.views[ord] = kv;
    }

    /// Whether decode mirrors are held (a sequence inside a stacked decode
    /// batch holds none: the batch row is its copy).
    pub fn has_views(&self) -> bool {
        !self.views.is_empty()
    }

    /// Positions the decode mirrors hold.
    pub fn view_cap(&self) -> usize {
        self.view_cap
    }

    /// Before a multi-token step: the pool must hold everything, and the
    /// mirrors go (prefill reads the blocks).
    pub fn drop_views(&mut self, len: usize) -> Result<()> {
        self.flush(len)?;
        self.views.clear();
        self.view_cap = 0;
        Ok(())
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn conv_keep(&self) -> i32 {
        self.conv_keep
    }

    /// On an empty sequence: takes the longest cached prefix of `prompt`.
    /// Returns how many tokens are cached and, when any, the conv snapshot
    /// to restore.
    pub fn attach(&mut self, prompt: &[u32]) -> Result<(usize, Option<Array>)> {
        debug_assert!(self.flushed == 0 && self.blocks.is_empty());
        let bs = self.block_size;
        let pool_arc = self.pool.clone();
        let mut pool = pool_arc.lock();
        let (blocks, mut snap, parent) = pool.match_prefix(prompt);
        let mut n = blocks.len() * bs;
        self.published = blocks.len();
        self.blocks = blocks;
        self.parent_key = parent;
        // The exact end of an earlier request that this prompt continues:
        // copy its partial block (it stays the earlier request's) and take
        // the conv states after it.
        let tail = pool.tails.get(&parent).and_then(|t| {
            let tl = t.tokens.len();
            (n + tl < prompt.len() && prompt[n..n + tl] == t.tokens[..]).then(|| (t.block, tl, t.snapshot.clone()))
        });
        if let Some((src, tl, tail_snap)) = tail {
            pool.retain(src); // not dropped while a block is found for the copy
            let copied = pool.alloc().and_then(|b| {
                for i in 0..pool.keys.len() {
                    let copy = |a: &Array| -> Result<Array> {
                        let (h, d) = (a.dim(0), a.dim(3));
                        let rows = a.slice(&[0, src as i32, 0, 0], &[h, src as i32 + 1, tl as i32, d], &[1, 1, 1, 1])?;
                        a.slice_update(&rows, &[0, b as i32, 0, 0], &[h, b as i32 + 1, tl as i32, d])
                    };
                    let (k, v) = (copy(&pool.keys[i])?, copy(&pool.values[i])?);
                    pool.set_layer(i, k, v);
                }
                Ok(b)
            });
            pool.release(src);
            let b = copied?;
            let tick = pool.tick;
            if let Some(t) = pool.tails.get_mut(&parent) {
                t.last_used = tick;
            }
            pool.hit_tokens += tl as u64;
            if n == 0 {
                pool.hits += 1;
            }
            self.blocks.push(b);
            n += tl;
            snap = Some(tail_snap);
        }
        drop(pool);
        self.flushed = n;
        self.tokens = prompt[..n].to_vec();
        self.cached_tokens = n;
        Ok((n, snap))
    }

    /// At the end of a request: keeps its last, partial block and the conv
    /// states after it (`conv_states`, one per conv layer) for a prompt
    /// that continues exactly. Only when every full block before it is in
    /// the index (so its key is known) and every token in it is known.
    pub fn keep_tail(&mut self, len: usize, conv_states: &[&Array]) -> Result<()> {
        let bs = self.block_size;
        let full = len / bs;
        if len.is_multiple_of(bs) || self.published != full || self.tokens.len() < len {
            return Ok(());
        }
        self.flush(len)?;
        let snapshot = snapshot_of(conv_states)?;
        let tokens = self.tokens[full * bs..len].to_vec();
        self.pool.lock().keep_tail(self.parent_key, self.blocks[full], tokens, snapshot);
        Ok(())
    }

    /// Allocates blocks so that `t` more positions fit after `len`.
    pub fn reserve(&mut self, len: usize, t: usize) -> Result<()> {
        let need = (len + t).div_ceil(self.block_size);
        if need > self.blocks.len() {
            let mut pool = self.pool.lock();
            while self.blocks.len() < need {
                let b = pool.alloc()?;
                self.blocks.push(b);
            }
        }
        Ok(())
    }

    /// Host-known token ids for positions `len - ids.len() .. len`, after a
    /// forward pass wrote them.
    pub fn note_tokens(&mut self, ids: &[u32]) {
        self.tokens.extend_from_slice(ids);
    }

    /// Keeps the conv snapshot for the block ending at position `end`.
    pub fn keep_snapshot(&mut self, end: usize, snapshot: Array) {
        debug_assert!(end.is_multiple_of(self.block_size) && end > 0);
        self.snaps.insert(end / self.block_size - 1, snapshot);
    }

    /// Publishes every full block whose tokens and snapshot are known.
    pub fn publish_ready(&mut self, len: usize) {
        let bs = self.block_size;
        let mut pool = None;
        while self.published < self.blocks.len()
            && (self.published + 1) * bs <= self.tokens.len().min(len).min(self.flushed)
        {
            let j = self.published;
            let Some(snap) = self.snaps.remove(&j) else { break };
            let p = pool.get_or_insert_with(|| self.pool.lock());
            self.parent_key = p.publish(self.blocks[j], self.parent_key, j as u32, &self.tokens[j * bs..(j + 1) * bs], snap);
            self.published += 1;
        }
    }

    /// The conv states after each full block of `tokens` (the tokens of
    /// this sequence's first positions): the sequence's own snapshot where
    /// its block is not published yet, else the published one (its own
    /// block, or the block already indexed for the same content).
    pub fn block_snapshots(&self, tokens: &[u32]) -> Result<Vec<Array>> {
        let bs = self.block_size;
        let pool = self.pool.lock();
        let mut parent = 0u64;
        let mut out = Vec::with_capacity(tokens.len() / bs);
        for j in 0..tokens.len() / bs {
            let toks = &tokens[j * bs..(j + 1) * bs];
            let key = chain_key(pool.salt, parent, toks);
            let published = || {
                let m = &pool.meta[*pool.index.get(&key)? as usize];
                (m.parent_key == parent && m.tokens == toks).then(|| m.snapshot.clone()).flatten()
            };
            let snap = self.snaps.get(&j).cloned().or_else(published);
            out.push(snap.ok_or_else(|| Error::invalid(format!("the paged cache no longer holds the conv states after block {j}")))?);
            parent = key;
        }
        Ok(out)
    }

    /// Snapshots waiting for their block's tokens (to evaluate them with
    /// the step that produced them).
    pub fn pending_snapshots(&self) -> Vec<&Array> {
        self.snaps.values().collect()
    }

    /// The pool indices for attending over `0..upto` (prefill), or over a
    /// table padded to `TABLE_STEP_TOKENS` (decode: the padding repeats
    /// block 0 and is masked out).
    pub fn table(&self, upto: usize, padded: bool) -> Result<Array> {
        let used = upto.div_ceil(self.block_size).max(1);
        let mut t: Vec<i32> = self.blocks[..used.min(self.blocks.len())].iter().map(|&b| b as i32).collect();
        if padded {
            let step = TABLE_STEP_TOKENS.div_ceil(self.block_size).max(1);
            let n = t.len().div_ceil(step) * step;
            let fill = t.first().copied().unwrap_or(0);
            t.resize(n, fill);
        }
        Array::from_slice(&t, &[t.len() as i32])
    }

    /// `(block, offset)` of position `pos`.
    pub fn slot(&self, pos: usize) -> (u32, usize) {
        (self.blocks[pos / self.block_size], pos % self.block_size)
    }
}

impl Drop for PagedSeq {
    fn drop(&mut self) {
        let mut pool = self.pool.lock();
        for &b in &self.blocks {
            pool.release(b);
        }
    }
}

/// Stacks per-conv-layer states (`[1, keep, hidden]` each) into one
/// snapshot array that owns its memory (a placeholder for a model without
/// conv layers: there is nothing to restore).
pub fn snapshot_of(states: &[&Array]) -> Result<Array> {
    if states.is_empty() {
        return zeros(&[1], Dtype::Float32);
    }
    stack(states, 0)
}

/// Writes `k`/`v` (`[1, kv_heads, T, head_dim]`) for positions
/// `start..start+T` of `seq` into attention layer `layer`'s pools.
pub fn write_prefill(pool: &mut PagedPool, seq: &PagedSeq, layer: usize, start: usize, k: &Array, v: &Array) -> Result<()> {
    let mut kp = pool.keys[layer].clone();
    let mut vp = pool.values[layer].clone();
    for (p, n, b0, nb) in write_runs(seq, start, k.dim(2) as usize) {
        kp = write_run(&kp, k, p - start, n, b0, nb, seq.block_size, p % seq.block_size)?;
        vp = write_run(&vp, v, p - start, n, b0, nb, seq.block_size, p % seq.block_size)?;
    }
    pool.set_layer(layer, kp, vp);
    Ok(())
}

/// Positions `start..start+t` split into runs that land in consecutive
/// pool blocks: `(position, tokens, first block, blocks)`. A run is one
/// partial block, or whole blocks that follow each other in the pool (a
/// fresh sequence's blocks usually do), so a chunk is written with a few
/// updates instead of one per block (each is a kernel launch on a GPU).
fn write_runs(seq: &PagedSeq, start: usize, t: usize) -> Vec<(usize, usize, u32, usize)> {
    let bs = seq.block_size;
    let end = start + t;
    let mut runs: Vec<(usize, usize, u32, usize)> = vec![];
    let mut p = start;
    while p < end {
        let (b, off) = seq.slot(p);
        let n = (bs - off).min(end - p);
        let whole = off == 0 && n == bs;
        match runs.last_mut() {
            Some(r) if whole && r.1 % bs == 0 && r.0 % bs == 0 && r.2 + r.3 as u32 == b => {
                r.1 += n;
                r.3 += 1;
            }
            _ => runs.push((p, n, b, 1)),
        }
        p += n;
    }
    runs
}

/// Writes rows `r0..r0+n` of `x` (`[1, kv_heads, T, head_dim]`) into `nb`
/// consecutive blocks from `b0`, at offset `off` within the first.
#[allow(clippy::too_many_arguments)]
fn write_run(pool_arr: &Array, x: &Array, r0: usize, n: usize, b0: u32, nb: usize, bs: usize, off: usize) -> Result<Array> {
    let (h, d) = (x.dim(1), x.dim(3));
    let rows = x.slice_axis(2, r0 as i32, (r0 + n) as i32)?;
    let (b0, nb32) = (b0 as i32, nb as i32);
    if nb == 1 {
        let (off, n) = (off as i32, n as i32);
        let u = rows.reshape(&[h, 1, n, d])?;
        return pool_arr.slice_update(&u, &[0, b0, off, 0], &[h, b0 + 1, off + n, d]);
    }
    let u = rows.reshape(&[h, nb32, bs as i32, d])?;
    pool_arr.slice_update(&u, &[0, b0, 0, 0], &[h, b0 + nb32, bs as i32, d])
}

/// The sequence's K or V for one layer through `table`:
/// `[1, kv_heads, table_len * block_size, head_dim]`.
pub fn gather(pool_arr: &Array, table: &Array) -> Result<Array> {
    let g = pool_arr.take(table, 1)?;
    let (h, n, bs, d) = (g.dim(0), g.dim(1), g.dim(2), g.dim(3));
    g.reshape(&[1, h, n * bs, d])
}

#[cfg(test)]
mod tests;
