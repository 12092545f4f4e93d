//! Reading a request's prefix blocks from disk before it is admitted.
//!
//! Reading a block file (the read, the parse, the SHA-256 of its tensors)
//! is host work that needs no MLX; done at admission it ran on the model's
//! worker, and every running request's decode waited for it. Here, as soon
//! as a prompt is known (on the model's render thread), the blocks of its
//! prefix that are on disk and not in memory are handed to a reader thread,
//! which reads and checks them exactly as the worker would (fingerprint,
//! key, parent, tokens, shapes) and keeps them as host bytes. At admission
//! [`Prefetch::take`] hands over a block read ahead, waits for one still
//! being read (a file is never read twice), and answers None otherwise (the
//! worker then reads it itself, as before).
//!
//! - Bounded: at most `max_bytes` of blocks are kept, the oldest dropped
//!   first; a prompt whose own blocks fill it has the rest read at
//!   admission.
//! - Blocks read ahead are counted as disk hits only when a request uses
//!   them; a damaged file the reader finds is removed (one warning, counted
//!   damaged) and the lookup at admission then misses, as it would have.
//! - A block read ahead whose file is removed before it is used (the disk
//!   budget, another process) is still used: its bytes were checked when
//!   they were read, and nothing about the block changes with its file.

use super::disk::{HostBlock, Store};
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

enum Slot {
    /// Queued for the reader, or being read.
    Reading,
    Ready { block: Box<HostBlock>, seq: u64 },
}

#[derive(Default)]
struct State {
    slots: HashMap<u64, Slot>,
    /// Ready blocks by arrival, oldest first.
    order: BTreeMap<u64, u64>,
    seq: u64,
    bytes: usize,
}

impl State {
    fn remove_ready(&mut self, key: u64) -> Option<Box<HostBlock>> {
        match self.slots.remove(&key) {
            Some(Slot::Ready { block, seq }) => {
                self.order.remove(&seq);
                self.bytes -= block.nbytes();
                Some(block)
            }
            Some(Slot::Reading) => {
                self.slots.insert(key, Slot::Reading);
                None
            }
            None => None,
        }
    }

    /// Drops blocks read up to `since` (other prompts'), oldest first,
    /// until `size` more bytes fit in `max`. False when they cannot.
    fn make_room(&mut self, size: usize, max: usize, since: u64) -> bool {
        while self.bytes + size > max {
            match self.order.first_key_value() {
                Some((&seq, &key)) if seq <= since => {
                    self.remove_ready(key);
                }
                _ => return false,
            }
        }
        true
    }
}

struct Shared {
    state: Mutex<State>,
    /// Signalled whenever a slot stops being `Reading`.
    changed: Condvar,
    /// Keys of the blocks in the pool's prefix index (never read ahead).
    resident: Mutex<HashSet<u64>>,
    /// The reader's queue; taken when the disk tier closes.
    tx: Mutex<Option<Sender<Job>>>,
    max_bytes: usize,
}

/// One prompt's blocks to read, in chain order: `(key, parent key, tokens)`.
struct Job {
    blocks: Vec<(u64, u64, Vec<u32>)>,
    done: Arc<AtomicBool>,
}

/// Says when the reader has finished a prompt's blocks (read, or given up
/// on them).
pub struct Ticket(Arc<AtomicBool>);

impl Ticket {
    /// A ticket for nothing to read.
    pub fn done() -> Ticket {
        Ticket(Arc::new(AtomicBool::new(true)))
    }

    pub fn is_done(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// The reader thread and what it has read; owned by the disk tier.
pub(super) struct Prefetch {
    shared: Arc<Shared>,
    reader: Option<JoinHandle<()>>,
}

/// Clears the slots still marked `Reading` when the reader stops (also by
/// a panic), so that nobody waits for them.
struct ReaderGone(Arc<Shared>);

impl Drop for ReaderGone {
    fn drop(&mut self) {
        self.0.state.lock().slots.retain(|_, s| matches!(s, Slot::Ready { .. }));
        self.0.changed.notify_all();
    }
}

impl Prefetch {
    pub(super) fn start(store: Arc<Store>, max_bytes: usize) -> Result<Prefetch> {
        let (tx, rx) = channel::<Job>();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            resident: Mutex::new(HashSet::new()),
            tx: Mutex::new(Some(tx)),
            max_bytes,
        });
        let sh = shared.clone();
        let reader = std::thread::Builder::new()
            .name("mlx-lfm-disk-read".into())
            .spawn(move || {
                let _gone = ReaderGone(sh.clone());
                for job in rx {
                    read_job(&sh, &store, job);
                }
            })
            .map_err(|e| Error::mlx(format!("could not start the prefix cache's disk reader: {e}")))?;
        Ok(Prefetch { shared, reader: Some(reader) })
    }

    /// The block with `key` read ahead, waiting while it is being read.
    /// None when it was not read ahead (or could not be).
    pub(super) fn take(&self, key: u64) -> Option<HostBlock> {
        let mut st = self.shared.state.lock();
        while matches!(st.slots.get(&key), Some(Slot::Reading)) {
            self.shared.changed.wait(&mut st);
        }
        st.remove_ready(key).map(|b| *b)
    }

    pub(super) fn set_resident(&self, key: u64, resident: bool) {
        let mut r = self.shared.resident.lock();
        if resident {
            r.insert(key);
        } else {
            r.remove(&key);
        }
    }

    pub(super) fn handle(&self, store: Arc<Store>, salt: u64, block_size: usize) -> Prefetcher {
        Prefetcher { shared: self.shared.clone(), store, salt, block_size }
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.shared.tx.lock().take();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        // A render thread may outlive the model: what was read goes now.
        let mut st = self.shared.state.lock();
        *st = State::default();
    }
}

/// The reader's work on one prompt: its blocks in order, stopping at the
/// first that cannot be used (the chain is useless after it) or that does
/// not fit.
fn read_job(sh: &Shared, store: &Store, job: Job) {
    let since = sh.state.lock().seq;
    let mut going = true;
    for (key, parent, tokens) in job.blocks {
        let block = if going {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.load(key, parent, &tokens))).ok().flatten()
        } else {
            None
        };
        let mut st = sh.state.lock();
        st.slots.remove(&key);
        match block {
            Some(b) if st.make_room(b.nbytes(), sh.max_bytes, since) => {
                store.count_prefetched();
                st.seq += 1;
                let seq = st.seq;
                st.bytes += b.nbytes();
                st.order.insert(seq, key);
                st.slots.insert(key, Slot::Ready { block: Box::new(b), seq });
            }
            _ => going = false,
        }
        drop(st);
        sh.changed.notify_all();
    }
    job.done.store(true, Ordering::Release);
}

/// Starts reading prompts' blocks ahead; cheap to clone, usable from any
/// thread, holds no MLX state.
#[derive(Clone)]
pub struct Prefetcher {
    shared: Arc<Shared>,
    store: Arc<Store>,
    salt: u64,
    block_size: usize,
}

impl Prefetcher {
    /// Queues the blocks of `prompt`'s prefix that a lookup would read from
    /// disk: the chain as the pool walks it (full blocks leaving at least
    /// one token), past the blocks in memory, up to the first block with no
    /// file. None when there is nothing to read.
    pub fn prefetch(&self, prompt: &[u32]) -> Option<Ticket> {
        let bs = self.block_size;
        let mut want = vec![];
        {
            let resident = self.shared.resident.lock();
            let mut parent = 0u64;
            let mut j = 0;
            while (j + 1) * bs < prompt.len() {
                let toks = &prompt[j * bs..(j + 1) * bs];
                let key = super::chain_key(self.salt, parent, toks);
                if !resident.contains(&key) {
                    want.push((key, parent, toks));
                }
                parent = key;
                j += 1;
            }
        }
        let mut blocks = vec![];
        for (key, parent, toks) in want {
            if !self.store.exists(key) {
                break;
            }
            blocks.push((key, parent, toks.to_vec()));
        }
        {
            // A block another prompt is already reading is not read again.
            let mut st = self.shared.state.lock();
            blocks.retain(|(key, _, _)| !st.slots.contains_key(key));
            for (key, _, _) in &blocks {
                st.slots.insert(*key, Slot::Reading);
            }
        }
        if blocks.is_empty() {
            return None;
        }
        let done = Arc::new(AtomicBool::new(false));
        let keys: Vec<u64> = blocks.iter().map(|b| b.0).collect();
        let sent = match self.shared.tx.lock().as_ref() {
            Some(tx) => tx.send(Job { blocks, done: done.clone() }).is_ok(),
            None => false,
        };
        if !sent {
            let mut st = self.shared.state.lock();
            for k in keys {
                st.slots.remove(&k);
            }
            drop(st);
            self.shared.changed.notify_all();
            return None;
        }
        Some(Ticket(done))
    }
}
