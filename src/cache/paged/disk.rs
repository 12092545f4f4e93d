//! The paged prefix cache's disk tier: full blocks (their K/V and the conv
//! states after them) in one directory, one file per block, named by the
//! block's chain key (which the fingerprint salts), so a later process with
//! the same model finds them.
//!
//! - Writes go through a writer thread fed with host copies: the worker
//!   only copies a block to the host (when it is evicted, and for every
//!   published block at close) and queues it; the file is written to a
//!   temporary name and renamed, so no reader (another process included)
//!   ever sees half a block.
//! - The directory is kept within its budget, least recently used files
//!   first (this process's view: the files found at start with their
//!   modification times, then its own writes and hits).
//! - A file that cannot be used (truncated, damaged, another model's, other
//!   shapes) is removed, with one warning per process.
//! - Reads: a request's blocks are read ahead by a reader thread when its
//!   prompt is known (prefetch.rs), so the worker only turns checked host
//!   bytes into arrays at admission; a block nobody read ahead is read on
//!   the worker, as before.

use crate::engine::fingerprint::sha256_hex;
use crate::engine::session_file::write_atomically;
use crate::error::{Error, Result};
use super::prefetch::{Prefetch, Prefetcher};
use parking_lot::Mutex;
use safetensors::tensor::{Dtype as StDtype, TensorView};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::SystemTime;

const FORMAT: &str = "mlx-lfm-block";
const VERSION: u32 = 1;
const EXT: &str = "blk";

/// A block's content on the host: per attention layer K and V
/// (`[kv_heads, 1, block_size, head_dim]` each), and the conv snapshot.
pub struct HostBlock {
    pub key: u64,
    pub parent_key: u64,
    pub depth: u32,
    pub tokens: Vec<u32>,
    pub dtype: StDtype,
    /// `(shape, bytes)` of each layer's K then V, layer by layer.
    pub kv: Vec<(Vec<usize>, Vec<u8>)>,
    pub snapshot: (StDtype, Vec<usize>, Vec<u8>),
}

impl HostBlock {
    /// Host bytes it holds.
    pub(super) fn nbytes(&self) -> usize {
        self.kv.iter().map(|(_, b)| b.len()).sum::<usize>() + self.snapshot.2.len() + 4 * self.tokens.len()
    }
}

/// What a block of one pool looks like: a file is used only when its block
/// has exactly these dtypes and shapes.
#[derive(Debug, Clone)]
pub struct BlockSpec {
    pub dtype: StDtype,
    pub attn_layers: usize,
    /// `[kv_heads, 1, block_size, head_dim]`, and its bytes.
    pub kv_shape: Vec<usize>,
    pub kv_bytes: usize,
    pub snapshot_shape: Vec<usize>,
    /// Largest file read: the block's bytes and room for its metadata.
    pub max_len: u64,
}

impl BlockSpec {
    fn admits(&self, b: &HostBlock) -> bool {
        b.dtype == self.dtype
            && b.kv.len() == 2 * self.attn_layers
            && b.kv.iter().all(|(shape, bytes)| *shape == self.kv_shape && bytes.len() == self.kv_bytes)
            && b.snapshot.1 == self.snapshot_shape
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiskStats {
    /// Blocks read back from disk (counted when a request uses them), and
    /// lookups the disk could not answer.
    pub hits: u64,
    pub misses: u64,
    /// Block files read whole (by the worker or the reader thread), and of
    /// those the blocks the reader thread read ahead of their request.
    pub reads: u64,
    pub prefetched: u64,
    /// Blocks written, removed for the budget, and unusable files removed.
    pub writes: u64,
    pub evictions: u64,
    pub damaged: u64,
    /// Bytes of block files in the directory (this process's view).
    pub bytes: u64,
}

struct Entry {
    size: u64,
    used: SystemTime,
}

struct Shared {
    dir: PathBuf,
    budget: u64,
    entries: HashMap<PathBuf, Entry>,
    stats: DiskStats,
}

impl Shared {
    fn total(&self) -> u64 {
        self.entries.values().map(|e| e.size).sum()
    }

    /// Removes least recently used files until the directory fits.
    fn enforce_budget(&mut self) {
        let mut total = self.total();
        while total > self.budget {
            let Some(oldest) = self.entries.iter().min_by_key(|(_, e)| e.used).map(|(p, _)| p.clone()) else { break };
            let e = self.entries.remove(&oldest).expect("the entry just found");
            let _ = std::fs::remove_file(&oldest);
            total -= e.size;
            self.stats.evictions += 1;
        }
        self.stats.bytes = total;
    }
}

enum Msg {
    Write(Box<HostBlock>),
    /// A block read from this file was used.
    Used(u64),
    /// Wait for every write queued before this.
    Flush(Sender<()>),
}

/// The directory and what reading a block from it takes, shared by the
/// worker, the writer thread and the reader thread.
pub(super) struct Store {
    shared: Mutex<Shared>,
    fingerprint: String,
    spec: BlockSpec,
    warned: AtomicBool,
}

impl Store {
    fn path(&self, key: u64) -> PathBuf {
        self.shared.lock().dir.join(file_name(key))
    }

    /// Whether block `key` has a file: one this process knows, or one
    /// another process wrote since.
    pub(super) fn exists(&self, key: u64) -> bool {
        let path = self.path(key);
        self.shared.lock().entries.contains_key(&path) || path.exists()
    }

    /// Reads block `key` whose parent is `parent_key` and whose tokens are
    /// `tokens`, checked against the model (fingerprint, checksum, shapes).
    /// None when it has no file, or when the file does not hold exactly
    /// that block (then it is removed). Uses are counted by the caller.
    pub(super) fn load(&self, key: u64, parent_key: u64, tokens: &[u32]) -> Option<HostBlock> {
        let path = self.path(key);
        let max_len = self.spec.max_len;
        let read = std::fs::metadata(&path).and_then(|m| {
            if m.len() > max_len {
                Ok(Err(Error::invalid(format!("it is {} bytes, more than a block of this model ({max_len})", m.len()))))
            } else {
                std::fs::read(&path).map(Ok)
            }
        });
        let bytes = match read {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => return self.discard(&path, &e),
            Err(_) => {
                self.shared.lock().entries.remove(&path);
                return None;
            }
        };
        self.shared.lock().stats.reads += 1;
        match parse_block(&bytes, &self.fingerprint).and_then(|b| {
            if b.key != key || b.parent_key != parent_key || b.tokens != tokens || !self.spec.admits(&b) {
                Err(Error::invalid("it holds another block"))
            } else {
                Ok(b)
            }
        }) {
            Ok(b) => Some(b),
            Err(e) => self.discard(&path, &e),
        }
    }

    /// Block `key`'s file (when it is still there) becomes the most
    /// recently used; on the writer thread, as it touches the file.
    fn mark_used(&self, key: u64) {
        let path = self.path(key);
        let mut s = self.shared.lock();
        match std::fs::metadata(&path) {
            Ok(m) => {
                s.entries.insert(path.clone(), Entry { size: m.len(), used: SystemTime::now() });
                drop(s);
                // Other processes see the use too (their LRU reads mtimes at start).
                if let Ok(f) = std::fs::File::options().append(true).open(&path) {
                    let _ = f.set_modified(SystemTime::now());
                }
            }
            // Read ahead, and removed since (the budget, another process):
            // the block was checked when it was read, only the file is gone.
            Err(_) => {
                s.entries.remove(&path);
            }
        }
    }

    pub(super) fn count_prefetched(&self) {
        self.shared.lock().stats.prefetched += 1;
    }

    /// A damaged, truncated or foreign block file: one warning per process,
    /// the file removed.
    fn discard<T>(&self, path: &Path, e: &Error) -> Option<T> {
        warn_once(&self.warned, &format!("prefix-cache file {} is unusable: {}", path.display(), e.message));
        let _ = std::fs::remove_file(path);
        let mut s = self.shared.lock();
        s.entries.remove(path);
        s.stats.damaged += 1;
        None
    }
}

pub struct DiskTier {
    store: Arc<Store>,
    tx: Option<Sender<Msg>>,
    writer: Option<JoinHandle<()>>,
    prefetch: Prefetch,
}

fn warn_once(warned: &AtomicBool, msg: &str) {
    if !warned.swap(true, Ordering::SeqCst) {
        eprintln!("mlx-lfm: {msg} (removed; later damaged prefix-cache files are removed silently)");
    }
}

impl DiskTier {
    /// Opens (creating) `dir` with a budget of `budget` bytes for blocks of
    /// the model with `fingerprint`, shaped as `spec`; up to
    /// `prefetch_bytes` of blocks are kept read ahead.
    pub fn open(dir: &Path, budget: u64, fingerprint: &str, spec: BlockSpec, prefetch_bytes: usize) -> Result<DiskTier> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::config(format!("prefixCacheDir {}: cannot create it: {e}", dir.display())))?;
        let listing = std::fs::read_dir(dir)
            .map_err(|e| Error::config(format!("prefixCacheDir {}: cannot read it: {e}", dir.display())))?;
        let mut entries = HashMap::new();
        for ent in listing.flatten() {
            let p = ent.path();
            if p.extension().and_then(|e| e.to_str()) != Some(EXT) {
                continue;
            }
            if let Ok(m) = ent.metadata() {
                entries.insert(p, Entry { size: m.len(), used: m.modified().unwrap_or(SystemTime::UNIX_EPOCH) });
            }
        }
        let mut shared = Shared { dir: dir.to_path_buf(), budget, entries, stats: DiskStats::default() };
        shared.enforce_budget();
        shared.stats.evictions = 0;
        let store = Arc::new(Store { shared: Mutex::new(shared), fingerprint: fingerprint.to_string(), spec, warned: AtomicBool::new(false) });
        let prefetch = Prefetch::start(store.clone(), prefetch_bytes)?;
        let (tx, rx) = channel::<Msg>();
        let w = store.clone();
        let writer = std::thread::Builder::new()
            .name("mlx-lfm-disk".into())
            .spawn(move || {
                for msg in rx {
                    match msg {
                        Msg::Write(b) => {
                            let path = w.path(b.key);
                            if path.exists() {
                                continue;
                            }
                            match write_block(&path, &b, &w.fingerprint) {
                                Ok(size) => {
                                    let mut s = w.shared.lock();
                                    s.entries.insert(path, Entry { size, used: SystemTime::now() });
                                    s.stats.writes += 1;
                                    s.enforce_budget();
                                }
                                Err(e) => eprintln!("mlx-lfm: could not write a prefix-cache block: {}", e.message),
                            }
                        }
                        Msg::Used(key) => w.mark_used(key),
                        Msg::Flush(done) => {
                            let _ = done.send(());
                        }
                    }
                }
            })
            .map_err(|e| Error::mlx(format!("could not start the prefix cache's disk writer: {e}")))?;
        Ok(DiskTier { store, tx: Some(tx), writer: Some(writer), prefetch })
    }

    pub fn stats(&self) -> DiskStats {
        let s = self.store.shared.lock();
        let mut st = s.stats.clone();
        st.bytes = s.total();
        st
    }

    /// Whether a block with `key` is on disk (as far as this process knows).
    pub fn has(&self, key: u64) -> bool {
        let s = self.store.shared.lock();
        s.entries.contains_key(&s.dir.join(file_name(key)))
    }

    /// Queues a block for writing (off the worker).
    pub fn write(&self, block: HostBlock) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Msg::Write(Box::new(block)));
        }
    }

    /// Waits until every queued write is on disk.
    pub fn flush(&self) {
        let (done_tx, done_rx) = channel();
        if let Some(tx) = &self.tx {
            if tx.send(Msg::Flush(done_tx)).is_ok() {
                let _ = done_rx.recv();
            }
        }
    }

    /// The block with `key` whose parent is `parent_key` and whose tokens
    /// are `tokens`: the copy read ahead for it (waiting while it is being
    /// read), else read now. None when the disk has no usable copy (a file
    /// that does not hold exactly that block of this model is removed).
    pub fn read(&self, key: u64, parent_key: u64, tokens: &[u32]) -> Option<HostBlock> {
        let ahead = self.prefetch.take(key).filter(|b| b.parent_key == parent_key && b.tokens == tokens);
        match ahead.or_else(|| self.store.load(key, parent_key, tokens)) {
            Some(b) => {
                self.store.shared.lock().stats.hits += 1;
                if let Some(tx) = &self.tx {
                    let _ = tx.send(Msg::Used(key));
                }
                Some(b)
            }
            None => {
                self.store.shared.lock().stats.misses += 1;
                None
            }
        }
    }

    /// Tells the reader thread whether the block with `key` is in memory
    /// (it reads ahead only blocks that are not).
    pub fn set_resident(&self, key: u64, resident: bool) {
        self.prefetch.set_resident(key, resident);
    }

    /// A handle that starts reading a prompt's blocks ahead, from any
    /// thread (the model's render thread); keys as the pool computes them.
    pub fn prefetcher(&self, salt: u64, block_size: usize) -> Prefetcher {
        self.prefetch.handle(self.store.clone(), salt, block_size)
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        // Every queued block is written before the model is gone; the
        // reader thread stops with the Prefetch.
        self.tx.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

fn file_name(key: u64) -> String {
    format!("{key:016x}.{EXT}")
}

fn write_block(path: &Path, b: &HostBlock, fingerprint: &str) -> Result<u64> {
    let mut views: Vec<(String, TensorView)> = vec![];
    let mut chunks: Vec<Vec<u8>> = vec![];
    for (i, (shape, bytes)) in b.kv.iter().enumerate() {
        let name = format!("{}.{}", if i % 2 == 0 { "k" } else { "v" }, i / 2);
        chunks.push(name.as_bytes().to_vec());
        views.push((name, TensorView::new(b.dtype, shape.clone(), bytes).map_err(|e| Error::invalid(e.to_string()))?));
    }
    let (sd, ss, sb) = &b.snapshot;
    views.push(("snapshot".into(), TensorView::new(*sd, ss.clone(), sb).map_err(|e| Error::invalid(e.to_string()))?));
    let mut sum_parts: Vec<&[u8]> = vec![];
    for (i, (_, bytes)) in b.kv.iter().enumerate() {
        sum_parts.push(&chunks[i]);
        sum_parts.push(bytes);
    }
    sum_parts.push(b"snapshot");
    sum_parts.push(sb);
    let meta: HashMap<String, String> = [
        ("format", FORMAT.to_string()),
        ("version", VERSION.to_string()),
        ("fingerprint", fingerprint.to_string()),
        ("key", b.key.to_string()),
        ("parent_key", b.parent_key.to_string()),
        ("depth", b.depth.to_string()),
        ("tokens", json!(b.tokens).to_string()),
        ("layers", (b.kv.len() / 2).to_string()),
        ("checksum", sha256_hex(&sum_parts)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    write_atomically(path, |tmp| {
        safetensors::serialize_to_file(views, Some(meta), tmp).map_err(|e| Error::invalid(format!("{}: {e}", tmp.display())))
    })?;
    Ok(std::fs::metadata(path).map(|m| m.len()).unwrap_or(0))
}

fn parse_block(bytes: &[u8], fingerprint: &str) -> Result<HostBlock> {
    let bad = |what: &str| Error::invalid(what.to_string());
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| Error::invalid(format!("{e} (truncated or not a block file)")))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| Error::invalid(e.to_string()))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let get = |k: &str| meta.get(k).cloned().ok_or_else(|| Error::invalid(format!("its metadata lacks `{k}`")));
    if get("format")? != FORMAT || get("version")? != VERSION.to_string() {
        return Err(bad("another format or version"));
    }
    if get("fingerprint")? != fingerprint {
        return Err(bad("it was written by another model"));
    }
    let num = |k: &str| -> Result<u64> { get(k)?.parse::<u64>().map_err(|_| Error::invalid(format!("its `{k}` is not a number"))) };
    let layers = num("layers")? as usize;
    if layers > 4096 {
        return Err(bad("too many layers"));
    }
    let tokens: Vec<u32> = serde_json::from_str::<Value>(&get("tokens")?)
        .ok()
        .and_then(|v| serde_json::from_value(v).ok())
        .ok_or_else(|| bad("its token list is invalid"))?;
    let mut kv = vec![];
    let mut dtype = None;
    let mut names = vec![];
    for i in 0..2 * layers {
        let name = format!("{}.{}", if i % 2 == 0 { "k" } else { "v" }, i / 2);
        let t = st.tensor(&name).map_err(|_| Error::invalid(format!("it lacks tensor `{name}`")))?;
        if dtype.is_some_and(|d| d != t.dtype()) {
            return Err(bad("its K/V dtypes differ"));
        }
        dtype = Some(t.dtype());
        kv.push((t.shape().to_vec(), t.data().to_vec()));
        names.push(name);
    }
    let s = st.tensor("snapshot").map_err(|_| bad("it lacks its conv snapshot"))?;
    if st.len() != 2 * layers + 1 {
        return Err(bad("it holds other tensors"));
    }
    let mut sum_parts: Vec<&[u8]> = vec![];
    for (i, (_, b)) in kv.iter().enumerate() {
        sum_parts.push(names[i].as_bytes());
        sum_parts.push(b);
    }
    sum_parts.push(b"snapshot");
    sum_parts.push(s.data());
    if sha256_hex(&sum_parts) != get("checksum")? {
        return Err(bad("its bytes do not match its checksum"));
    }
    Ok(HostBlock {
        key: num("key")?,
        parent_key: num("parent_key")?,
        depth: num("depth")? as u32,
        tokens,
        dtype: dtype.unwrap_or(StDtype::F32),
        kv,
        snapshot: (s.dtype(), s.shape().to_vec(), s.data().to_vec()),
    })
}
