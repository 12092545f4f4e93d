//! A loaded model ready to serve: weights, tokenizer, stop tokens and the
//! request entry points. Plain Rust (no Node types), driven by the worker
//! thread in worker.rs, by `cargo test` and by the benchmark binary.

pub mod worker;

use crate::error::{Error, Result};
use crate::compiled::CompiledDecoder;
use crate::generate::{self, Advance, GenerateParams, Generation, Observer, Pending, Sequence, Started, Stepper};
use crate::mlx::Array;
use crate::mlx::{runtime, Dtype};
use crate::model::config::token_ids;
use crate::kvquant::KvCacheConfig;
use crate::model::batch::{self, DecodeBatch, Member};
use crate::model::lfm2::Operator;
use crate::model::paged::{self, PagedConfig, PagedStats};
use crate::model::{load_model, Lfm2Model, LoadOptions};
use crate::text::{ChatMessage, Tokenizer};
use serde_json::Value;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Clone, Default)]
pub struct EngineOptions {
    pub dtype: Option<Dtype>,
    /// Tokens per prefill chunk (default 2048).
    pub prefill_chunk: Option<usize>,
    /// "cpu" or "gpu"; default: MLX's default device.
    pub device: Option<runtime::DeviceType>,
    /// Force a decode path; default: compiled when eligible.
    pub decode_path: Option<DecodePath>,
    /// KV cache storage (`default`, `affine4`, `affine8`, `rotorquant`, ...;
    /// see `kvquant::VALID_NAMES`); default: MLX_LFM_KV_CACHE, else `default`.
    pub kv_cache: Option<String>,
    /// `rotorquant-adaptive`: attention layers kept in full precision at
    /// each end (default `kvquant::DEFAULT_FULL_PRECISION_LAYERS`).
    pub kv_cache_full_precision_layers: Option<usize>,
    /// Paged KV cache with prefix reuse (true) or flat caches (false);
    /// wins over config.json's `use_block_paged_cache`. Default: paged for
    /// unquantized checkpoints, flat for quantized ones.
    pub paged_cache: Option<bool>,
    /// Tokens per paged block (default `paged::DEFAULT_BLOCK_SIZE`, or
    /// config.json `paged_block_size`).
    pub paged_block_size: Option<usize>,
    /// Paged pool budget in MiB (default `paged::DEFAULT_BUDGET_MB`, or
    /// config.json `paged_cache_budget_mb`).
    pub paged_cache_budget_mb: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodePath {
    Compiled,
    Eager,
}

/// Reads a boolean MLX_LFM_* variable; anything but the listed values is an
/// error (a typo must not silently change behaviour).
pub fn env_flag(name: &str) -> Result<Option<bool>> {
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(_) => Err(Error::config(format!("{name} is not valid UTF-8; use 0 or 1"))),
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "" => Ok(None),
            "1" | "true" | "yes" | "on" => Ok(Some(true)),
            "0" | "false" | "no" | "off" => Ok(Some(false)),
            _ => Err(Error::config(format!("{name}={v} is not valid; use 1/true/yes/on or 0/false/no/off"))),
        },
    }
}

#[derive(Debug, Clone)]
pub struct QuantSummary {
    pub mode: String,
    pub bits: i32,
    pub group_size: i32,
    pub projections: usize,
}

#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub path: PathBuf,
    pub model_type: String,
    pub layer_kinds: Vec<String>,
    pub dtype: String,
    pub quantization: Vec<QuantSummary>,
    /// "paged", "flat" or "quantized".
    pub cache_kind: String,
    /// Why that cache was chosen.
    pub cache_reason: String,
    pub paged_block_size: Option<usize>,
    pub paged_cache_budget_mb: Option<usize>,
    /// The kvCache setting in effect ("default", "rotorquant-adaptive", ...).
    pub kv_cache: String,
    /// Per attention layer (in layer order): what its KV cache stores
    /// ("default" = full precision, "affine4", "rotorquant-dense", ...).
    pub kv_cache_layers: Vec<String>,
    /// KV cache bytes one token takes over all attention layers (batch 1).
    pub kv_bytes_per_token: usize,
    pub decode_path: String,
    pub decode_path_reason: String,
    pub parameter_count: usize,
    pub weight_bytes: usize,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_experts: Option<usize>,
    pub experts_per_token: Option<usize>,
    pub eos_token_ids: Vec<u32>,
    pub has_chat_template: bool,
    pub backend: String,
    pub device: String,
}

/// A request for the continuous-batching scheduler (engine/worker.rs).
pub struct Request {
    /// Builds the prompt and parameters on the worker (chat template,
    /// tokenizer) when the request starts.
    pub prepare: Option<Box<dyn FnOnce(&mut Engine) -> Result<(Vec<u32>, GenerateParams)> + Send>>,
    pub observer: Box<dyn Observer + Send>,
    pub reply: Option<Box<dyn FnOnce(Result<Generation>) + Send>>,
}

impl Request {
    /// A request for a prompt already in token ids, nothing streamed.
    pub fn tokens(prompt: Vec<u32>, params: GenerateParams, reply: impl FnOnce(Result<Generation>) + Send + 'static) -> Request {
        Request {
            prepare: Some(Box::new(move |_| Ok((prompt, params)))),
            observer: Box::new(generate::NoObserver),
            reply: Some(Box::new(reply)),
        }
    }

    fn succeed(mut self, g: Generation) {
        self.observer.finished();
        if let Some(r) = self.reply.take() {
            r(Ok(g));
        }
    }
    pub fn fail(mut self, e: Error) {
        self.observer.finished();
        if let Some(r) = self.reply.take() {
            r(Err(e));
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // Never leave a caller waiting (a panic unwinding through the
        // scheduler drops requests it was holding).
        if let Some(r) = self.reply.take() {
            r(Err(Error::mlx("the request was dropped before it finished (internal error)")));
        }
    }
}

/// A request whose prompt is being prefilled.
pub struct Prefilling {
    pending: Pending,
    req: Request,
}

/// Where a starting request stands after a prefill chunk.
pub enum Admission {
    Prefilling(Prefilling),
    Running(Active),
    /// Finished (cancelled during prefill) or failed; its reply was heard.
    Over,
}

/// A request being generated.
pub struct Active {
    /// Unique per engine: names the request's row in the decode batch.
    pub id: u64,
    pub seq: Sequence,
    pub req: Request,
}

/// The pending tokens of `active[rows]`, as the ids `[B, 1]` of a batch step.
fn pending_ids(active: &[Active], rows: &[usize]) -> Result<Array> {
    let ids: Vec<Array> = rows.iter().map(|&i| active[i].seq.y.reshape(&[1, 1])).collect::<Result<_>>()?;
    let refs: Vec<&Array> = ids.iter().collect();
    crate::mlx::concatenate(&refs, 0)
}

pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

pub struct Engine {
    pub model: Lfm2Model,
    pub compiled: Option<CompiledDecoder>,
    pub tokenizer: Arc<Tokenizer>,
    pub eos: HashSet<u32>,
    pub prefill_chunk: usize,
    /// Shared with the JS object so runtime changes (a compiled-path
    /// fallback) show in info().
    info: Arc<Mutex<ModelInfo>>,
    /// The running requests' caches stacked for the compiled batched step.
    batch: DecodeBatch,
    next_id: u64,
    /// Compiled batched steps run (tests check which path batches took).
    pub(crate) stacked_steps: usize,
}

fn generation_config_eos(dir: &Path) -> Result<Vec<u32>> {
    let p = dir.join("generation_config.json");
    if !p.exists() {
        return Ok(vec![]);
    }
    let text = std::fs::read_to_string(&p)?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(format!("{} is not valid JSON: {e}", p.display())))?;
    token_ids(v.get("eos_token_id"), "eos_token_id", "generation_config.json")
}

/// KV bytes per token over all attention layers (batch 1), as stored.
pub fn kv_bytes_per_token(model: &Lfm2Model) -> usize {
    model
        .layers
        .iter()
        .enumerate()
        .filter_map(|(i, l)| match &l.operator {
            Operator::Attention(a) => {
                let per_vector = match model.kv_codecs.get(i).and_then(|c| c.as_ref()) {
                    Some(codec) => codec.bytes_per_vector(model.dtype),
                    None => a.head_dim as usize * model.dtype.size(),
                };
                Some(2 * a.n_kv_heads as usize * per_vector)
            }
            Operator::Conv(_) => None,
        })
        .sum()
}

fn config_field<'a>(model: &'a Lfm2Model, k: &str) -> Option<&'a Value> {
    model.config.raw.get(k).filter(|v| !v.is_null())
}

fn config_usize(model: &Lfm2Model, k: &str) -> Result<Option<usize>> {
    match config_field(model, k) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|&n| n > 0)
            .map(|n| Some(n as usize))
            .ok_or_else(|| Error::config(format!("config.json field `{k}` must be a positive integer, found {v}"))),
    }
}

/// Paged or flat, and why. An explicit choice (load option, then
/// config.json `use_block_paged_cache`) always wins; unset: paged for
/// unquantized checkpoints, flat for quantized ones (the registry, built
/// from the `.scales` tensors, says which).
fn choose_cache(model: &Lfm2Model, opts: &EngineOptions, kv: &KvCacheConfig) -> Result<(Option<PagedConfig>, String)> {
    let from_config = match config_field(model, "use_block_paged_cache") {
        None => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(v) => return Err(Error::config(format!("config.json field `use_block_paged_cache` must be true or false, found {v}"))),
    };
    let (paged, reason) = match (opts.paged_cache, from_config) {
        (Some(p), _) => (p, format!("useBlockPagedCache: {p} (load option)")),
        (None, Some(p)) => (p, format!("use_block_paged_cache: {p} in config.json")),
        (None, None) if kv.kind.is_quantized() => {
            (false, format!("kvCache `{}` keeps K/V quantized in per-sequence caches", kv.name))
        }
        (None, None) if !model.registry.is_empty() => (
            false,
            "default for quantized checkpoints: flat per-sequence caches (no prefix reuse); set useBlockPagedCache to \
             change"
                .to_string(),
        ),
        (None, None) => (true, "default for unquantized checkpoints: paged blocks with prefix reuse".to_string()),
    };
    if !paged {
        return Ok((None, reason));
    }
    if kv.kind.is_quantized() {
        return Err(Error::config(format!(
            "the paged KV cache ({reason}) cannot be combined with kvCache `{}`; choose one",
            kv.name
        )));
    }
    let block_size = match opts.paged_block_size {
        Some(b) => b,
        None => config_usize(model, "paged_block_size")?.unwrap_or(paged::DEFAULT_BLOCK_SIZE),
    };
    let mb = match opts.paged_cache_budget_mb {
        Some(b) => b,
        None => config_usize(model, "paged_cache_budget_mb")?.unwrap_or(paged::DEFAULT_BUDGET_MB),
    };
    let cfg = PagedConfig { block_size, budget_bytes: mb.saturating_mul(1 << 20) };
    cfg.validate()?;
    Ok((Some(cfg), reason))
}

/// Ties a pool's prefix index to one model: its files, config and dtype.
fn model_salt(dir: &Path, model: &Lfm2Model, weight_bytes: usize) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    dir.hash(&mut h);
    serde_json::to_string(&model.config.raw).unwrap_or_default().hash(&mut h);
    weight_bytes.hash(&mut h);
    model.dtype.name().hash(&mut h);
    h.finish()
}

impl Engine {
    pub fn load(dir: &Path, opts: &EngineOptions) -> Result<Engine> {
        if !dir.is_dir() {
            return Err(Error::load(format!("model path {} is not a directory", dir.display())));
        }
        // Validated before anything else happens, so a bad name changes nothing.
        let kv_cfg = KvCacheConfig::resolve(opts.kv_cache.as_deref(), opts.kv_cache_full_precision_layers)?;
        if kv_cfg.kind.is_quantized() && opts.decode_path == Some(DecodePath::Compiled) {
            return Err(Error::config(format!(
                "decodePath `compiled` cannot be used with kvCache `{}`: the compiled step reads only the flat \
                 full-precision cache; use decodePath `eager` or leave it unset",
                kv_cfg.name
            )));
        }
        if let Some(d) = opts.device {
            runtime::set_default_device(d)?;
        }
        let disabled = env_flag("MLX_LFM_DISABLE_COMPILED")?;
        let tokenizer = Arc::new(Tokenizer::load(dir)?);
        let loaded = load_model(dir, &LoadOptions { dtype: opts.dtype })?;
        let mut model = loaded.model;
        let kv_kinds = model.set_kv_cache(&kv_cfg)?;
        let (paged_cfg, cache_reason) = choose_cache(&model, opts, &kv_cfg)?;
        if let Some(pc) = paged_cfg {
            model.use_paged_cache(pc, model_salt(&loaded.dir, &model, loaded.weight_bytes))?;
        }
        let c = &model.config;
        let mut eos: HashSet<u32> = c.eos_token_ids.iter().copied().collect();
        eos.extend(generation_config_eos(dir)?);
        eos.extend(tokenizer.eos_token_ids());
        if let Some(&bad) = eos.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::config(format!("end-of-sequence id {bad} is outside vocab_size {}", c.vocab_size)));
        }
        let (compiled, decode_path_reason) = if kv_cfg.kind.is_quantized() {
            (
                None,
                format!(
                    "kvCache `{}` keeps K/V quantized and the compiled step reads only the flat full-precision \
                     cache, so decode runs eager",
                    kv_cfg.name
                ),
            )
        } else {
            match (opts.decode_path, disabled) {
                (Some(DecodePath::Eager), _) => (None, "eager requested by the decodePath load option".to_string()),
                (None, Some(true)) => (None, "MLX_LFM_DISABLE_COMPILED=1".to_string()),
                (forced, _) => match CompiledDecoder::new(&model) {
                    Ok(d) => (
                        Some(d),
                        if forced.is_some() {
                            "compiled requested by the decodePath load option".to_string()
                        } else {
                            "default: the compiled step covers every layer of this model".to_string()
                        },
                    ),
                    Err(e) if forced.is_some() => return Err(e.context("the compiled decode path was requested but could not be built")),
                    Err(e) => (None, format!("the compiled step could not be built ({}); using eager", e.message)),
                },
            }
        };
        let mut eos_sorted: Vec<u32> = eos.iter().copied().collect();
        eos_sorted.sort();
        let info = ModelInfo {
            path: loaded.dir.clone(),
            model_type: c.model_type.name().to_string(),
            layer_kinds: c.attn_layers.iter().map(|&a| if a { "attention" } else { "conv" }.to_string()).collect(),
            dtype: model.dtype.name().to_string(),
            quantization: model
                .registry
                .summary()
                .into_iter()
                .map(|(s, n)| QuantSummary {
                    mode: s.mode.name().to_string(),
                    bits: s.bits,
                    group_size: s.group_size,
                    projections: n,
                })
                .collect(),
            cache_kind: if paged_cfg.is_some() {
                "paged"
            } else if kv_cfg.kind.is_quantized() {
                "quantized"
            } else {
                "flat"
            }
            .into(),
            cache_reason,
            paged_block_size: paged_cfg.map(|p| p.block_size),
            paged_cache_budget_mb: paged_cfg.map(|p| p.budget_bytes >> 20),
            kv_cache: kv_cfg.name.clone(),
            kv_cache_layers: kv_kinds.iter().flatten().map(|k| k.name()).collect(),
            kv_bytes_per_token: kv_bytes_per_token(&model),
            decode_path: if compiled.is_some() { "compiled" } else { "eager" }.into(),
            decode_path_reason,
            parameter_count: model.parameter_count(),
            weight_bytes: loaded.weight_bytes,
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            num_layers: c.num_layers,
            num_experts: c.moe.as_ref().map(|m| m.num_experts),
            experts_per_token: c.moe.as_ref().map(|m| m.experts_per_token),
            eos_token_ids: eos_sorted,
            has_chat_template: tokenizer.chat_template().is_some(),
            backend: runtime::backend().name().to_string(),
            device: match runtime::default_device() {
                runtime::DeviceType::Cpu => "cpu".into(),
                runtime::DeviceType::Gpu => "gpu".into(),
            },
        };
        Ok(Engine {
            model,
            compiled,
            tokenizer,
            eos,
            prefill_chunk: opts.prefill_chunk.unwrap_or(2048).max(1),
            info: Arc::new(Mutex::new(info)),
            batch: DecodeBatch::default(),
            next_id: 0,
            stacked_steps: 0,
        })
    }

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

    /// Forgets every cached prefix no request is using.
    pub fn clear_prefix_cache(&self) {
        if let Some(p) = &self.model.paged {
            p.lock().clear_cached();
        }
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

    pub fn chat_prompt(&self, messages: &[ChatMessage], tools: Option<&Value>) -> Result<Vec<u32>> {
        if messages.is_empty() {
            return Err(Error::invalid("messages is empty"));
        }
        self.tokenizer.apply_chat_template(messages, tools, true, None)
    }

    pub fn chat(
        &mut self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        params: GenerateParams,
        observer: &mut dyn Observer,
    ) -> Result<Generation> {
        let started = Instant::now();
        let prompt = self.chat_prompt(messages, tools)?;
        let params = self.params(params);
        self.run(&prompt, &params, observer, started)
    }

    fn run(&mut self, prompt: &[u32], params: &GenerateParams, observer: &mut dyn Observer, started: Instant) -> Result<Generation> {
        let mut stepper = Stepper::new(&self.model, self.compiled.as_ref());
        let r = generate::generate(&mut stepper, &self.tokenizer, &self.eos, prompt, params, observer, started);
        let failure = stepper.failure.take();
        self.note_failure(failure);
        r
    }

    /// A compiled step that failed is reported once; the model stays on
    /// the eager path from then on.
    fn note_failure(&mut self, failure: Option<Error>) {
        if let Some(e) = failure {
            eprintln!("mlx-lfm: the compiled decode step failed ({}); continuing on the eager path", e.message);
            self.compiled = None;
            let mut info = self.info.lock();
            info.decode_path = "eager".into();
            info.decode_path_reason = format!("the compiled step failed at run time: {}", e.message);
        }
    }

    /// Starts a request for continuous batching: prefills it and samples
    /// its first token. Returns the running request, or None when it is
    /// already over (cancelled during prefill, or failed: `reply` heard).
    pub fn admit(&mut self, req: Request) -> Option<Active> {
        let mut p = self.begin(req)?;
        loop {
            match self.advance(p) {
                Admission::Prefilling(next) => p = next,
                Admission::Running(a) => return Some(a),
                Admission::Over => return None,
            }
        }
    }

    /// Prepares a request (prompt, parameters, prefix-cache lookup) without
    /// running it. None when that fails (`reply` heard).
    pub fn begin(&mut self, mut req: Request) -> Option<Prefilling> {
        let started = Instant::now();
        let prepared = (req.prepare.take().expect("a request is begun once"))(self);
        let pending = prepared.and_then(|(prompt, params)| {
            let params = self.params(params);
            Pending::new(&self.model, self.model.new_cache(), prompt, &params, started)
        });
        match pending {
            Ok(p) => Some(Prefilling { pending: p, req }),
            Err(e) => {
                req.fail(e);
                None
            }
        }
    }

    /// Runs one prefill chunk of a starting request.
    pub fn advance(&mut self, p: Prefilling) -> Admission {
        let Prefilling { pending, mut req } = p;
        match pending.advance(&self.model, &self.tokenizer, req.observer.as_mut()) {
            Ok(Advance::More(pending)) => Admission::Prefilling(Prefilling { pending, req }),
            Ok(Advance::Done(s)) => self.admitted(s, req),
            Err(e) => {
                req.fail(e);
                Admission::Over
            }
        }
    }

    /// A request whose prefill ended: running (with its batch id), or over.
    fn admitted(&mut self, s: Started, req: Request) -> Admission {
        match s {
            Started::Running(seq) => {
                self.next_id += 1;
                Admission::Running(Active { id: self.next_id, seq, req })
            }
            Started::Finished(g, _) => {
                req.succeed(g);
                Admission::Over
            }
        }
    }

    /// The next prefill work from the waiting requests, in arrival order:
    /// the first alone (one chunk of it), or, when it can be prefilled in a
    /// batch, it and every other waiting request that can, as long as the
    /// padded batch stays within one prefill chunk of tokens.
    pub fn take_prefill_group(&self, waiting: &mut std::collections::VecDeque<Prefilling>) -> Vec<Prefilling> {
        let mut first = match waiting.pop_front() {
            Some(p) => p,
            None => return vec![],
        };
        let fits = |p: &mut Prefilling| {
            let n = p.pending.batchable_prompt().map(|x| x.len());
            n.filter(|_| !p.req.observer.cancelled())
        };
        let Some(mut longest) = fits(&mut first) else { return vec![first] };
        let mut group = vec![first];
        let mut rest = std::collections::VecDeque::with_capacity(waiting.len());
        while let Some(mut p) = waiting.pop_front() {
            match fits(&mut p) {
                Some(n) if (group.len() + 1) * longest.max(n) <= self.prefill_chunk => {
                    longest = longest.max(n);
                    group.push(p);
                }
                _ => rest.push_back(p),
            }
        }
        *waiting = rest;
        group
    }

    /// The scheduler's prefill work for one step: the next group of waiting
    /// requests runs; the ones it starts join `active`, one still reading
    /// its prompt goes back to the front of `waiting`.
    pub fn prefill_next(&mut self, waiting: &mut std::collections::VecDeque<Prefilling>, active: &mut Vec<Active>) {
        let group = self.take_prefill_group(waiting);
        for a in self.advance_group(group) {
            match a {
                Admission::Prefilling(p) => waiting.push_front(p),
                Admission::Running(a) => active.push(a),
                Admission::Over => {}
            }
        }
    }

    /// Runs a group from [`Engine::take_prefill_group`]: one prefill chunk
    /// of a lone request, or the whole prompts of several in one batch.
    pub fn advance_group(&mut self, group: Vec<Prefilling>) -> Vec<Admission> {
        if group.len() <= 1 {
            return group.into_iter().map(|p| self.advance(p)).collect();
        }
        // Blocks first, in arrival order: a request the paged pool cannot
        // hold fails alone, as it would prefilled by itself.
        let mut out = vec![];
        let mut ready = vec![];
        for mut p in group {
            match p.pending.reserve_prompt() {
                Ok(()) => ready.push(p),
                Err(e) => {
                    p.req.fail(e);
                    out.push(Admission::Over);
                }
            }
        }
        if ready.len() <= 1 {
            out.extend(ready.into_iter().map(|p| self.advance(p)));
            return out;
        }
        let (pendings, reqs): (Vec<Pending>, Vec<Request>) = ready.into_iter().map(|p| (p.pending, p.req)).unzip();
        out.extend(self.prefill_group(pendings, reqs));
        out
    }

    fn prefill_group(&mut self, pendings: Vec<Pending>, reqs: Vec<Request>) -> Vec<Admission> {
        match generate::prefill_together(&self.model, &self.tokenizer, pendings) {
            Ok(started) => started.into_iter().zip(reqs).map(|(s, req)| self.admitted(s, req)).collect(),
            Err(e) => reqs
                .into_iter()
                .map(|r| {
                    r.fail(e.clone());
                    Admission::Over
                })
                .collect(),
        }
    }

    /// One decode step for every running request: a single request takes
    /// the compiled step; several take the compiled batched step over their
    /// stacked caches (see `model::batch`), or, on the eager path or with a
    /// quantized KV cache, one eager forward with attention per sequence.
    /// Finished requests are answered and removed.
    pub fn step_active(&mut self, active: &mut Vec<Active>) {
        // Room for the next token first: a request the paged pool cannot
        // give a block fails alone, the others step.
        let mut refused: Vec<(usize, Error)> = vec![];
        let mut want: Vec<usize> = Vec::with_capacity(active.len());
        for (i, a) in active.iter_mut().enumerate() {
            if a.seq.wants_next() {
                match a.seq.cache.reserve_token() {
                    Ok(()) => want.push(i),
                    Err(e) => refused.push((i, e)),
                }
            }
        }
        let mut nexts: Vec<Option<Array>> = (0..active.len()).map(|_| None).collect();
        let stepped = self.step_wanted(active, &want).map(|ns| {
            for (i, n) in ns {
                nexts[i] = Some(n);
            }
        });
        if let Err(e) = stepped {
            // The step's caches are in an unknown state: every request in it fails.
            self.batch = DecodeBatch::default();
            for a in active.drain(..) {
                a.req.fail(e.clone());
            }
            return;
        }
        let mut keep = Vec::with_capacity(active.len());
        for (i, (mut a, next)) in active.drain(..).zip(nexts).enumerate() {
            if let Some(k) = refused.iter().position(|(j, _)| *j == i) {
                a.req.fail(refused.swap_remove(k).1);
                continue;
            }
            match a.seq.accept(next, &self.eos, a.req.observer.as_mut()) {
                Ok(true) => keep.push(a),
                Ok(false) => {
                    // A request leaving the batch takes its K/V and conv
                    // states back first (a paged cache keeps its end).
                    let synced = if self.batch.contains(a.id) {
                        let pos = a.seq.cache.pos;
                        self.batch.sync(a.id, &mut a.seq.cache, pos)
                    } else {
                        Ok(())
                    };
                    let Active { seq, mut req, .. } = a;
                    match synced.and_then(|_| seq.finish(req.observer.as_mut())) {
                        Ok((g, _)) => req.succeed(g),
                        Err(e) => req.fail(e),
                    }
                }
                Err(e) => a.req.fail(e),
            }
        }
        *active = keep;
    }

    /// Steps the requests `want` (indices into `active`); returns each
    /// one's queued next token.
    fn step_wanted(&mut self, active: &mut [Active], want: &[usize]) -> Result<Vec<(usize, Array)>> {
        let stacked =
            want.len() > 1 && self.compiled.is_some() && want.iter().all(|&i| batch::stackable(&active[i].seq.cache));
        if stacked {
            if let Some(out) = self.step_stacked(active, want)? {
                return Ok(out);
            }
        }
        // Every other step reads the sequences' own caches.
        self.reconcile_batch(active, &[])?;
        if want.len() == 1 {
            let i = want[0];
            let mut stepper = Stepper::new(&self.model, self.compiled.as_ref());
            let a = &mut active[i];
            let r = a.seq.y.reshape(&[1, 1]).and_then(|ids| stepper.step(&ids, &mut a.seq.cache)).and_then(|l| a.seq.sample(&l));
            let failure = stepper.failure.take();
            self.note_failure(failure);
            return Ok(vec![(i, r?)]);
        }
        if want.is_empty() {
            return Ok(vec![]);
        }
        let ids = pending_ids(active, want)?;
        let mut caches: Vec<&mut crate::model::ModelCache> = active
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| want.contains(i))
            .map(|(_, a)| &mut a.seq.cache)
            .collect();
        let logits = self.model.forward_batch(&ids, &mut caches)?;
        drop(caches);
        let mut out = Vec::with_capacity(want.len());
        for (k, &i) in want.iter().enumerate() {
            let l = logits.slice_axis(0, k as i32, k as i32 + 1)?;
            out.push((i, active[i].seq.sample(&l)?));
        }
        Ok(out)
    }

    /// The compiled batched step. None when the compiled step could not be
    /// built (noted; the batch was given back intact and the caller falls
    /// back to the eager batch).
    fn step_stacked(&mut self, active: &mut [Active], want: &[usize]) -> Result<Option<Vec<(usize, Array)>>> {
        self.reconcile_batch(active, want)?;
        let rows = self.batch.ids();
        let order: Vec<usize> = rows
            .iter()
            .map(|id| active.iter().position(|a| a.id == *id).ok_or_else(|| Error::invalid("batch row without a request")))
            .collect::<Result<_>>()?;
        let (ids, positions) = match self.batch.take_carry()? {
            Some(carried) => carried,
            None => {
                let positions: Vec<i32> = order.iter().map(|&i| active[i].seq.cache.pos as i32).collect();
                (pending_ids(active, &order)?, Array::from_slice(&positions, &[positions.len() as i32])?)
            }
        };
        let built = self.compiled.as_ref().expect("checked by the caller").step_batch(&ids, &positions, &mut self.batch, true);
        let logits = match built {
            Ok(l) => {
                self.stacked_steps += 1;
                l
            }
            Err(e) => {
                self.note_failure(Some(e));
                return Ok(None);
            }
        };
        for (&i, &id) in order.iter().zip(&rows) {
            let c = &mut active[i].seq.cache;
            // A paged cache about to fill a block needs the block (and the
            // conv states after it) back in its own buffers to publish it.
            if let Some(bs) = c.paged.as_ref().map(|s| s.block_size()) {
                if (c.pos + 1) % bs == 0 {
                    let upto = c.pos + 1;
                    self.batch.sync(id, c, upto)?;
                }
            }
            c.end_decode_token()?;
        }
        let mut out = Vec::with_capacity(order.len());
        // Greedy rows all at once: one argmax over the batch, not one per row.
        let greedy = if order.iter().all(|&i| active[i].seq.is_greedy()) {
            Some(logits.argmax(-1, false)?.astype(crate::mlx::Dtype::Uint32)?)
        } else {
            None
        };
        for (k, &i) in order.iter().enumerate() {
            let k = k as i32;
            out.push((
                i,
                match &greedy {
                    Some(t) => t.slice_axis(0, k, k + 1)?,
                    None => active[i].seq.draw(&logits.slice_axis(0, k, k + 1)?)?,
                },
            ));
        }
        let toks: Vec<&Array> = out.iter().map(|(_, t)| t).collect();
        let mut caches: Vec<&mut crate::model::ModelCache> =
            active.iter_mut().enumerate().filter(|(i, _)| want.contains(i)).map(|(_, a)| &mut a.seq.cache).collect();
        generate::queue_tokens(&toks, &mut caches)?;
        if let Some(t) = greedy {
            self.batch.set_carry(t, positions);
        }
        Ok(Some(out))
    }

    /// Runs two short throwaway generations, together and then one alone,
    /// so the kernels and compiled steps serving needs are built now and
    /// not while requests wait: on CUDA the first batched step compiles
    /// kernels (about 19 s the first time on a machine, cached on disk
    /// after that; ~0.2 s per new batch shape). Returns the time taken, or
    /// None when requests are running (their batch is not disturbed).
    pub fn warm_up(&mut self) -> Result<Option<f64>> {
        if !self.batch.is_empty() {
            return Ok(None);
        }
        let t = Instant::now();
        let failed: Arc<Mutex<Option<Error>>> = Arc::new(Mutex::new(None));
        let vocab = self.model.config.vocab_size as u32;
        let mut active = vec![];
        for (i, n) in [(0u32, 3usize), (1, 6)] {
            let prompt: Vec<u32> = (0..8u32).map(|k| (k * 7 + i * 13 + 3) % vocab.max(1)).collect();
            let failed = failed.clone();
            let params = GenerateParams { max_tokens: n, ignore_eos: true, ..Default::default() };
            let req = Request::tokens(prompt, params, move |r| {
                if let Err(e) = r {
                    failed.lock().get_or_insert(e);
                }
            });
            active.extend(self.admit(req));
        }
        while !active.is_empty() {
            self.step_active(&mut active);
        }
        let failure = failed.lock().take();
        match failure {
            Some(e) => Err(e),
            None => Ok(Some(t.elapsed().as_secs_f64() * 1000.0)),
        }
    }

    /// Drops the decode batch without writing rows back (its requests are
    /// gone: a step panicked).
    pub fn forget_batch(&mut self) {
        self.batch = DecodeBatch::default();
    }

    /// Makes the batch hold exactly the requests `want` (none: every row
    /// goes back to its request's cache).
    fn reconcile_batch(&mut self, active: &mut [Active], want: &[usize]) -> Result<()> {
        if self.batch.is_empty() && want.len() < 2 {
            return Ok(());
        }
        let shape = self.model.batch_shape();
        let mut members: Vec<Member> = active
            .iter_mut()
            .enumerate()
            .map(|(i, a)| Member { id: a.id, wanted: want.contains(&i), cache: &mut a.seq.cache })
            .collect();
        self.batch.reconcile(&shape, &mut members)
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
