//! Saved sessions: one safetensors file holding a sequence's state at the
//! end of its history (per attention layer its K/V, or a quantized cache's
//! codes and full-precision tail; per conv layer its state; with the paged
//! cache, the conv states after every full block too, so the blocks can be
//! published as prefix-cache entries again) and JSON metadata (format and
//! version, the model fingerprint, the history's token ids, a checksum of
//! the tensor bytes, and what the caller keeps with it: the conversation).
//!
//! Saving runs the history through the model only where the cache lacks it
//! (a paged cache usually holds the whole conversation already; a flat
//! cache keeps nothing between turns, so it runs the history once).
//! Restoring never runs the model: a paged restore publishes the blocks
//! and the exact end into the prefix cache, a flat one is kept for the
//! session's next turn ([`Resume`]), which then runs only what is new.

use super::fingerprint::sha256_hex;
use super::Engine;
use crate::cache::paged;
use crate::cache::{LayerCache, ModelCache};
use crate::error::{Error, Result};
use crate::kvquant::cache::QuantKvState;
use crate::mlx::{eval, Array, Dtype};
use crate::model::lfm2::Operator;
use safetensors::tensor::{Dtype as StDtype, TensorView};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What the `format` metadata key says.
pub const FORMAT: &str = "mlx-lfm-session";
/// Bumped whenever the layout of the tensors or metadata changes.
pub const VERSION: u32 = 1;

/// A restored flat state waiting for its session's next turn.
pub struct Resume {
    pub tokens: Vec<u32>,
    pub cache: ModelCache,
}

/// What [`Engine::save_session`] wrote.
#[derive(Debug, Clone)]
pub struct Saved {
    pub tokens: usize,
    pub bytes: u64,
}

/// A session file read and checked against the model, ready to install.
pub struct Loaded {
    pub tokens: Vec<u32>,
    /// The caller's metadata (the conversation).
    pub app: Value,
    /// Id of the flat state kept for the next turn (see [`Resume`]); None
    /// when it went into the paged prefix cache.
    pub resume: Option<u64>,
}

pub(crate) fn st_dtype(d: Dtype) -> Result<StDtype> {
    Ok(match d {
        Dtype::Float32 => StDtype::F32,
        Dtype::Float16 => StDtype::F16,
        Dtype::Bfloat16 => StDtype::BF16,
        Dtype::Uint8 => StDtype::U8,
        Dtype::Uint32 => StDtype::U32,
        Dtype::Int32 => StDtype::I32,
        Dtype::Int8 => StDtype::I8,
        Dtype::Uint16 => StDtype::U16,
        other => return Err(Error::invalid(format!("cannot save an array of dtype {other}"))),
    })
}

pub(crate) fn mlx_dtype(d: StDtype) -> Option<Dtype> {
    Some(match d {
        StDtype::F32 => Dtype::Float32,
        StDtype::F16 => Dtype::Float16,
        StDtype::BF16 => Dtype::Bfloat16,
        StDtype::U8 => Dtype::Uint8,
        StDtype::U32 => Dtype::Uint32,
        StDtype::I32 => Dtype::Int32,
        StDtype::I8 => Dtype::Int8,
        StDtype::U16 => Dtype::Uint16,
        _ => return None,
    })
}

/// The file's tensors, named by layer.
fn kv_names(layer: usize) -> (String, String) {
    (format!("layers.{layer}.keys"), format!("layers.{layer}.values"))
}

/// Host copies of named arrays, ready for the safetensors writer.
struct HostTensors(Vec<(String, Dtype, Vec<usize>, Vec<u8>)>);

impl HostTensors {
    fn push(&mut self, name: String, a: &Array) -> Result<()> {
        let a = a.contiguous()?;
        let shape = a.shape().iter().map(|&d| d as usize).collect();
        self.0.push((name, a.dtype(), shape, a.to_bytes()?));
        Ok(())
    }

    /// Checksum over every tensor's name and bytes, in name order.
    fn checksum(&self) -> String {
        let mut sorted: Vec<&(String, Dtype, Vec<usize>, Vec<u8>)> = self.0.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        let mut chunks: Vec<&[u8]> = vec![];
        for (n, _, _, b) in &sorted {
            chunks.push(n.as_bytes());
            chunks.push(b);
        }
        sha256_hex(&chunks)
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory
/// and a rename, so a reader never sees a half-written file.
pub fn write_atomically(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| Error::invalid(format!("{} is not a file path", path.display())))?;
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp: PathBuf = dir.join(format!(".{}.{}-{n}.tmp", name.to_string_lossy(), std::process::id()));
    let r = write(&tmp).and_then(|_| {
        std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(|e| Error::invalid(format!("cannot sync {}: {e}", tmp.display())))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::invalid(format!("cannot rename {} to {}: {e}", tmp.display(), path.display())))
    });
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

fn io_err(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::invalid(format!("cannot {what} {}: {e}", path.display()))
}

impl Engine {
    /// The cache's state after `tokens`: whatever the paged cache holds of
    /// them is taken from it, the rest is run.
    fn state_after(&self, tokens: &[u32]) -> Result<ModelCache> {
        let mut cache = self.model.new_cache();
        crate::generate::prefill(&self.model, &mut cache, tokens, self.prefill_chunk)?;
        cache.eval_state()?;
        Ok(cache)
    }

    /// A tensor-parallel rank holds only its share of the K/V and conv
    /// state, and saving runs a prefill on this rank alone (the others would
    /// not join its collectives): refused before anything runs.
    fn refuse_sessions_across_ranks(&self, what: &str) -> Result<()> {
        let n = self.model.world_size();
        if n > 1 {
            return Err(Error::invalid(format!(
                "sessions cannot be {what} on a model split over {n} ranks (tensor parallelism) yet: each rank holds only its share of the state"
            )));
        }
        Ok(())
    }

    /// Saves the state after `tokens` (the rendered history) with `app`
    /// (the caller's metadata) to `path`.
    pub fn save_session(&mut self, tokens: &[u32], app: &Value, path: &Path) -> Result<Saved> {
        self.refuse_sessions_across_ranks("saved")?;
        if tokens.is_empty() {
            return Err(Error::invalid("the session has no history to save"));
        }
        if tokens.len() >= self.model.context_length {
            return Err(Error::invalid(format!(
                "the session's history has {} tokens, the model's context length is {}",
                tokens.len(),
                self.model.context_length
            )));
        }
        let n = tokens.len();
        let cache = self.state_after(tokens)?;
        let mut host = HostTensors(vec![]);
        let mut quant_meta = serde_json::Map::new();
        for (i, lc) in cache.layers.iter().enumerate() {
            match lc {
                LayerCache::Attention(kv) => {
                    let (kn, vn) = kv_names(i);
                    if let Some(q) = &kv.quant {
                        let s = q.state()?;
                        for (j, a) in s.keys.iter().enumerate() {
                            host.push(format!("layers.{i}.kq.{j}"), a)?;
                        }
                        for (j, a) in s.values.iter().enumerate() {
                            host.push(format!("layers.{i}.vq.{j}"), a)?;
                        }
                        if let Some((k, v)) = &s.pending {
                            host.push(kn, k)?;
                            host.push(vn, v)?;
                        }
                        quant_meta.insert(i.to_string(), json!({ "quantized": s.quantized, "pending": s.pending_len, "parts": s.keys.len() }));
                    } else {
                        let (k, v) = kv.contents(n)?.ok_or_else(|| Error::invalid("the cache holds no K/V after the history"))?;
                        host.push(kn, &k)?;
                        host.push(vn, &v)?;
                    }
                }
                LayerCache::Paged(ord) => {
                    let seq = cache.paged.as_ref().ok_or_else(|| Error::invalid("paged layer without a paged sequence"))?;
                    let table = seq.table(n, false)?;
                    let pool = seq.pool.lock();
                    let k = paged::gather(pool.keys(*ord), &table)?.slice_axis(2, 0, n as i32)?;
                    let v = paged::gather(pool.values(*ord), &table)?.slice_axis(2, 0, n as i32)?;
                    drop(pool);
                    let (kn, vn) = kv_names(i);
                    host.push(kn, &k)?;
                    host.push(vn, &v)?;
                }
                LayerCache::Conv(s) => {
                    let s = s.as_ref().ok_or_else(|| Error::invalid("a conv layer has no state after the history"))?;
                    host.push(format!("layers.{i}.conv"), s)?;
                }
            }
        }
        if let Some(seq) = &cache.paged {
            for (j, snap) in seq.block_snapshots(tokens)?.iter().enumerate() {
                host.push(format!("blocks.{j}.conv"), snap)?;
            }
        }
        drop(cache);
        let fp = &self.fingerprint;
        let meta: HashMap<String, String> = [
            ("format", FORMAT.to_string()),
            ("version", VERSION.to_string()),
            ("fingerprint", fp.hash.clone()),
            ("fingerprint_parts", Value::Object(fp.parts.iter().map(|(k, v)| (k.clone(), json!(v))).collect()).to_string()),
            ("cache", fp.cache.clone()),
            ("tokens", json!(tokens).to_string()),
            ("quantized_kv", Value::Object(quant_meta).to_string()),
            ("checksum", host.checksum()),
            ("session", app.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let views: Vec<(String, TensorView)> = host
            .0
            .iter()
            .map(|(name, dt, shape, bytes)| {
                let view = TensorView::new(st_dtype(*dt)?, shape.clone(), bytes).map_err(|e| Error::invalid(format!("tensor {name}: {e}")))?;
                Ok((name.clone(), view))
            })
            .collect::<Result<_>>()?;
        write_atomically(path, |tmp| {
            safetensors::serialize_to_file(views, Some(meta), tmp).map_err(|e| io_err(tmp, "write", e))
        })?;
        let bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        Ok(Saved { tokens: n, bytes })
    }

    /// Reads `path`, checks it against this model and installs its state:
    /// into the paged prefix cache, or kept for the session's next turn.
    /// Nothing is installed unless the whole file checks out.
    pub fn load_session(&mut self, path: &Path) -> Result<Loaded> {
        self.refuse_sessions_across_ranks("loaded")?;
        let bad = |what: String| Error::invalid(format!("{} is not a usable session file: {what}", path.display()));
        // Bounded before it is read: the K/V and conv states of a whole
        // context (at 4 bytes a value, conv states as often as every token),
        // and room for the metadata.
        let size = std::fs::metadata(path).map_err(|e| io_err(path, "read the session file", e))?.len();
        let conv_bytes: usize = self
            .model
            .layers
            .iter()
            .filter_map(|l| match &l.operator {
                Operator::Conv(c) => Some((c.kernel.max(1) - 1) as usize * c.dim as usize * 4),
                Operator::Attention(_) => None,
            })
            .sum();
        let per_token = (super::kv_bytes_per_token(&self.model) * 2 + conv_bytes) as u64;
        let limit = (self.model.context_length as u64).saturating_mul(per_token).saturating_add(64 << 20);
        if size > limit {
            return Err(bad(format!("it is {size} bytes, more than a whole context of this model could need ({limit})")));
        }
        let bytes = std::fs::read(path).map_err(|e| io_err(path, "read the session file", e))?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(format!("{e} (truncated or not a safetensors file)")))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let get = |k: &str| meta.get(k).ok_or_else(|| bad(format!("its metadata lacks `{k}`")));
        if get("format").ok().map(String::as_str) != Some(FORMAT) {
            return Err(bad(format!("its format is {:?}, not {FORMAT:?}", meta.get("format"))));
        }
        let version = get("version")?;
        if version.parse::<u32>().ok() != Some(VERSION) {
            return Err(bad(format!("it has format version {version}; this mlx-lfm reads version {VERSION}")));
        }
        let parts: Vec<(String, String)> = match serde_json::from_str::<Value>(get("fingerprint_parts")?) {
            Ok(Value::Object(m)) => m.into_iter().map(|(k, v)| (k, v.as_str().unwrap_or_default().to_string())).collect(),
            _ => return Err(bad("its fingerprint_parts is not a JSON object".into())),
        };
        if let Some(why) = self.fingerprint.mismatch(get("fingerprint")?, &parts, get("cache")?) {
            return Err(bad(why));
        }
        let tokens: Vec<u32> = serde_json::from_str(get("tokens")?).map_err(|e| bad(format!("its token list is invalid: {e}")))?;
        let app: Value = serde_json::from_str(get("session")?).map_err(|e| bad(format!("its session metadata is invalid: {e}")))?;
        let quant: serde_json::Map<String, Value> = match serde_json::from_str(get("quantized_kv")?) {
            Ok(Value::Object(m)) => m,
            _ => return Err(bad("its quantized_kv metadata is not a JSON object".into())),
        };
        let n = tokens.len();
        if n == 0 || n >= self.model.context_length {
            return Err(bad(format!("it holds {n} tokens (this model takes 1..{})", self.model.context_length)));
        }
        self.model.check_token_ids(&tokens).map_err(|e| bad(e.message))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(format!("{e} (truncated or damaged)")))?;
        let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
        names.sort();
        let mut chunks: Vec<&[u8]> = vec![];
        for name in &names {
            chunks.push(name.as_bytes());
            chunks.push(st.tensor(name).map_err(|e| bad(e.to_string()))?.data());
        }
        if sha256_hex(&chunks) != *get("checksum")? {
            return Err(bad("its tensor bytes do not match its checksum (the file is damaged)".into()));
        }
        let mut used = 0usize;
        let mut take = |name: &str, shape: Option<&[i32]>| -> Result<Array> {
            let t = st.tensor(name).map_err(|_| bad(format!("it lacks tensor `{name}`")))?;
            let dt = mlx_dtype(t.dtype()).ok_or_else(|| bad(format!("tensor `{name}` has unsupported dtype {:?}", t.dtype())))?;
            let dims: Vec<i32> = t.shape().iter().map(|&d| i32::try_from(d).map_err(|_| bad(format!("tensor `{name}` is too large")))).collect::<Result<_>>()?;
            if let Some(want) = shape {
                if dims != want {
                    return Err(bad(format!("tensor `{name}` has shape {dims:?}, this model needs {want:?}")));
                }
            }
            used += 1;
            Array::from_bytes(t.data(), &dims, dt)
        };
        let model = &self.model;
        let mut cache = model.new_cache();
        if let Some(seq) = cache.paged.as_mut() {
            // Blocks for the whole history first: a pool that cannot hold it
            // fails before anything is written.
            seq.reserve(0, n)?;
        }
        let mut convs: Vec<Array> = vec![];
        for i in 0..cache.layers.len() {
            match &model.layers[i].operator {
                Operator::Attention(a) => {
                    let (kn, vn) = kv_names(i);
                    let want = [1, a.n_kv_heads, n as i32, a.head_dim];
                    let quant_layer = match &cache.layers[i] {
                        LayerCache::Attention(kv) => kv.quant.is_some(),
                        _ => false,
                    };
                    if quant_layer {
                        let q = quant.get(&i.to_string()).ok_or_else(|| bad(format!("layer {i}'s quantized KV state is missing")))?;
                        let field = |k: &str| q.get(k).and_then(Value::as_u64).map(|x| x as usize).ok_or_else(|| bad(format!("layer {i}'s `{k}` is missing")));
                        let (ql, pl, np) = (field("quantized")?, field("pending")?, field("parts")?);
                        if ql + pl != n || np > 8 {
                            return Err(bad(format!("layer {i} holds {} positions, the history {n}", ql + pl)));
                        }
                        let keys = (0..if ql > 0 { np } else { 0 }).map(|j| take(&format!("layers.{i}.kq.{j}"), None)).collect::<Result<Vec<_>>>()?;
                        let values = (0..if ql > 0 { np } else { 0 }).map(|j| take(&format!("layers.{i}.vq.{j}"), None)).collect::<Result<Vec<_>>>()?;
                        let pending = if pl > 0 {
                            let w = [1, a.n_kv_heads, pl as i32, a.head_dim];
                            Some((take(&kn, Some(&w))?, take(&vn, Some(&w))?))
                        } else {
                            None
                        };
                        let state = QuantKvState { keys, values, quantized: ql, pending, pending_len: pl };
                        if let LayerCache::Attention(kv) = &mut cache.layers[i] {
                            kv.quant.as_mut().expect("checked above").restore(&state).map_err(|e| bad(format!("layer {i}: {}", e.message)))?;
                        }
                    } else {
                        let (k, v) = (take(&kn, Some(&want))?, take(&vn, Some(&want))?);
                        cache.store_kv(i, 0, &k, &v)?;
                    }
                }
                Operator::Conv(c) => {
                    let s = take(&format!("layers.{i}.conv"), Some(&[1, c.kernel - 1, c.dim]))?;
                    convs.push(s);
                }
            }
        }
        let snaps = match &cache.paged {
            Some(seq) => {
                let conv_layers = convs.len() as i32;
                (0..n / seq.block_size())
                    .map(|j| {
                        let name = format!("blocks.{j}.conv");
                        if conv_layers == 0 {
                            take(&name, None)
                        } else {
                            let (keep, d) = (convs[0].dim(1), convs[0].dim(2));
                            take(&name, Some(&[conv_layers, 1, keep, d]))
                        }
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            None => vec![],
        };
        if used != names.len() {
            return Err(bad(format!("it holds {} tensors, this model reads {used} of them (saved with another layout)", names.len())));
        }
        let mut c = 0;
        for lc in cache.layers.iter_mut() {
            if let LayerCache::Conv(s) = lc {
                *s = Some(convs[c].clone());
                c += 1;
            }
        }
        cache.pos = n;
        let resume = match cache.paged.as_mut() {
            Some(seq) => {
                seq.wrote(n, true)?;
                for (j, snap) in snaps.into_iter().enumerate() {
                    seq.keep_snapshot((j + 1) * seq.block_size(), snap);
                }
                cache.note_tokens(&tokens);
                cache.keep_tail()?;
                cache.eval_state()?;
                None
            }
            None => {
                let all = cache.arrays();
                eval(&all)?;
                cache.restored = n;
                self.next_resume += 1;
                let id = self.next_resume;
                self.resumes.insert(id, Resume { tokens: tokens.clone(), cache });
                Some(id)
            }
        };
        Ok(Loaded { tokens, app, resume })
    }

    /// The state kept for a restored session's next turn, when `prompt`
    /// continues its history.
    pub(crate) fn take_resume(&mut self, id: Option<u64>, prompt: &[u32]) -> Option<ModelCache> {
        let r = self.resumes.remove(&id?)?;
        (prompt.len() > r.tokens.len() && prompt.starts_with(&r.tokens)).then_some(r.cache)
    }

    /// Forgets a restored session's kept state (the session was reset or
    /// let go before its next turn).
    pub fn drop_resume(&mut self, id: u64) {
        self.resumes.remove(&id);
    }
}
