//! A loaded model ready to serve: weights, tokenizer, stop tokens, its
//! compiled step and the one-request entry points. Plain Rust (no Node
//! types), driven by the worker thread (worker.rs: one thread per model,
//! its loop feeds the scheduler), by `cargo test` and by the benchmark
//! binary.
//!
//! - load.rs: the load policy (options, cache and decode-path choice, info).
//! - scheduler.rs: continuous batching (admission, prefill grouping, batch
//!   membership, step dispatch).
//! - worker.rs: the model's thread and its message loop.

pub mod fingerprint;
mod load;
pub mod session_file;
pub mod lockstep;
pub mod scheduler;
pub mod worker;

pub use load::{env_flag, kv_bytes_per_token, DecodePath, EngineOptions, ModelInfo, QuantSummary};
pub use scheduler::{Request, Scheduler};

use crate::cache::paged::PagedStats;
use crate::compiled::CompiledStep;
use crate::error::{Error, Result};
use crate::generate::constraint::Guide;
use crate::generate::{self, GenerateParams, Generation, Observer, Stepper};
use crate::mlx::Dtype;
use crate::model::Lfm2Model;
use crate::text::Tokenizer;
use parking_lot::Mutex;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

pub struct Engine {
    pub model: Lfm2Model,
    pub compiled: Option<CompiledStep>,
    pub tokenizer: Arc<Tokenizer>,
    pub eos: HashSet<u32>,
    pub prefill_chunk: usize,
    /// Shared with the JS object so runtime changes (a compiled-path
    /// fallback) show in info().
    pub(crate) info: Arc<Mutex<ModelInfo>>,
    /// The vocabulary for constrained decoding, built by the first request
    /// with a grammar.
    pub(crate) guide: Option<Arc<Guide>>,
    pub fingerprint: fingerprint::Fingerprint,
    /// Restored session states waiting for their session's first turn
    /// (flat caches only; a paged restore goes into the prefix cache), by
    /// the id `loadSession` gave the session.
    pub(crate) resumes: std::collections::HashMap<u64, session_file::Resume>,
    pub(crate) next_resume: u64,
}

impl Engine {
    /// The paged pool's counters (None with flat caches).
    pub fn cache_stats(&self) -> Option<PagedStats> {
        self.model.paged.as_ref().map(|p| p.lock().stats())
    }

    /// The counters and the bytes the pool holds.
    pub fn cache_stats_with_bytes(&self) -> Option<(PagedStats, usize)> {
        self.model.paged.as_ref().map(|p| {
            let p = p.lock();
            (p.stats(), p.nbytes())
        })
    }

    /// Writes every published prefix block to the disk tier (if any) and
    /// waits for the writes: the model is closing.
    pub fn persist_prefix_cache(&self) {
        if let Some(p) = &self.model.paged {
            p.lock().persist();
        }
    }

    /// Hands blocks evicted during the last step to the disk tier's writer
    /// (their copies were started asynchronously when they were evicted).
    pub fn drain_spills(&self) {
        if let Some(p) = &self.model.paged {
            let mut p = p.lock();
            if p.has_spills() {
                p.drain_spills();
            }
        }
    }

    /// Reads prompts' prefix blocks from the disk tier ahead of their
    /// admission, from another thread (None without a disk tier).
    pub fn prefetcher(&self) -> Option<crate::cache::paged::prefetch::Prefetcher> {
        self.model.paged.as_ref().and_then(|p| p.lock().prefetcher())
    }

    /// Forgets every cached prefix no request is using.
    /// MLX's cache of freed buffers is emptied too: what a long request
    /// used would otherwise stay allocated to the process.
    pub fn clear_prefix_cache(&self) {
        if let Some(p) = &self.model.paged {
            p.lock().clear_cached();
        }
        crate::mlx::runtime::clear_cache();
    }

    /// The group when this process is rank 0 of a tensor-parallel model:
    /// it decides, and tells the other ranks first (see lockstep.rs).
    pub fn leader(&self) -> Option<crate::mlx::distributed::Group> {
        self.model.shard.as_ref().filter(|s| s.rank == 0).map(|s| s.group.clone())
    }

    /// The group when this process is another rank: it only follows.
    pub fn follower(&self) -> Option<crate::mlx::distributed::Group> {
        self.model.shard.as_ref().filter(|s| s.rank != 0).map(|s| s.group.clone())
    }

    pub fn info(&self) -> ModelInfo {
        self.info.lock().clone()
    }

    pub fn shared_info(&self) -> Arc<Mutex<ModelInfo>> {
        self.info.clone()
    }

    pub fn params(&self, mut p: GenerateParams) -> GenerateParams {
        if p.prefill_chunk == 0 {
            p.prefill_chunk = self.prefill_chunk;
        }
        p
    }

    /// The constrained-decoding vocabulary when `params` has a grammar.
    pub fn guide_for(&mut self, params: &GenerateParams) -> Result<Option<Arc<Guide>>> {
        if params.grammar.is_none() {
            return Ok(None);
        }
        if self.guide.is_none() {
            let mut eos: Vec<u32> = self.eos.iter().copied().collect();
            eos.sort_unstable();
            self.guide = Some(Arc::new(Guide::new(&self.tokenizer, self.model.config.vocab_size, &eos)?));
        }
        Ok(self.guide.clone())
    }

    fn run(&mut self, prompt: &[u32], params: &GenerateParams, observer: &mut dyn Observer, started: Instant) -> Result<Generation> {
        let guide = self.guide_for(params)?;
        let mut stepper = Stepper::new(&self.model, self.compiled.as_ref());
        let r = generate::generate(&mut stepper, guide.as_deref(), &self.tokenizer, &self.eos, prompt, params, observer, started);
        let failure = stepper.failure.take();
        self.note_failure(failure);
        r
    }

    /// A compiled step that failed is reported once; the model stays on
    /// the eager path from then on.
    pub(crate) fn note_failure(&mut self, failure: Option<Error>) {
        if let Some(e) = failure {
            eprintln!("mlx-lfm: the compiled decode step failed ({}); continuing on the eager path", e.message);
            self.compiled = None;
            let mut info = self.info.lock();
            info.decode_path = "eager".into();
            info.decode_path_reason = format!("the compiled step failed at run time: {}", e.message);
        }
    }

    pub fn generate(&mut self, prompt: Prompt, params: GenerateParams, observer: &mut dyn Observer) -> Result<Generation> {
        let started = Instant::now();
        let ids = match prompt {
            Prompt::Text(t) => self.tokenizer.encode_for_generation(&t)?,
            Prompt::Tokens(ids) => ids,
        };
        let params = self.params(params);
        self.run(&ids, &params, observer, started)
    }

    /// The last position's logits for `ids`, in float32.
    pub fn logits(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let mut cache = self.model.new_cache();
        let l = generate::prefill(&self.model, &mut cache, ids, self.prefill_chunk)?;
        l.astype(Dtype::Float32)?.to_vec()
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tp_tests;
