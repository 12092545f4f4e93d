//! JS-facing option and result objects, and their conversion to and from
//! the engine's plain Rust types.

use super::args::{range_error, type_error};
use super::model::js_error;
use crate::engine::{self, EngineOptions};
use crate::error::Error;
use crate::generate::sampler::{SamplingParams, MAX_TOP_LOGPROBS};
use crate::generate::constraint::Grammar;
use crate::generate::{GenerateParams, Generation};
use crate::mlx::{runtime, Dtype};
use crate::text::tool_calls;
use napi::bindgen_prelude::*;
use napi_derive::napi;

#[napi(object, object_to_js = false)]
pub struct LoadOptions<'env> {
    /// Cast floating-point weights: "float32", "float16" or "bfloat16"
    /// (or their short names).
    #[napi(ts_type = "'float32' | 'float16' | 'bfloat16' | 'f32' | 'f16' | 'bf16'")]
    pub dtype: Option<String>,
    /// Tokens per prefill chunk (default 2048).
    pub prefill_chunk_size: Option<f64>,
    /// "cpu" or "gpu" (default: MLX's default device).
    #[napi(ts_type = "'cpu' | 'gpu'")]
    pub device: Option<String>,
    /// "compiled" or "eager" (default: compiled when the model is eligible;
    /// MLX_LFM_DISABLE_COMPILED=1 turns it off).
    #[napi(ts_type = "'compiled' | 'eager'")]
    pub decode_path: Option<String>,
    /// KV cache storage: "default" (full precision), "affine4" / "affine8"
    /// (MLX affine, group 64), "rotorquant" (IsoQuant 3-bit, dense rotation),
    /// "rotorquant-dense", "rotorquant-quaternion", or "rotorquant-adaptive"
    /// (the first and last `kvCacheFullPrecisionLayers` attention layers in
    /// full precision). Default: MLX_LFM_KV_CACHE, else "default". Quantized
    /// caches decode on the eager path.
    #[napi(ts_type = "'default' | 'affine4' | 'affine8' | 'rotorquant' | 'rotorquant-dense' | 'rotorquant-quaternion' | 'rotorquant-adaptive'")]
    pub kv_cache: Option<String>,
    /// For "rotorquant-adaptive": attention layers kept in full precision at
    /// each end (default 1; LFM2 has 6 attention layers).
    pub kv_cache_full_precision_layers: Option<f64>,
    /// Paged KV cache with cross-request prefix reuse (true) or flat
    /// per-request caches (false). Wins over config.json's
    /// `use_block_paged_cache`; default: paged for unquantized checkpoints,
    /// flat for quantized ones. `info().cacheKind` / `cacheReason` say which.
    pub use_block_paged_cache: Option<bool>,
    /// Tokens per paged block (default 32, or config.json `paged_block_size`):
    /// prefixes are reused in whole blocks.
    pub paged_block_size: Option<f64>,
    /// Memory the paged pool may use, in MiB (default 2048, or config.json
    /// `paged_cache_budget_mb`); least recently used cached prefixes are
    /// evicted beyond it.
    pub paged_cache_budget_mb: Option<f64>,
    /// Positions a request may use, prompt plus generated tokens (default:
    /// config.json `max_position_embeddings`; only lower values are
    /// accepted). A longer request fails before any compute.
    pub context_length: Option<f64>,
    /// A directory for the paged prefix cache's disk tier: blocks evicted
    /// from memory, and every cached block when the model closes, are
    /// written there (keyed by the model fingerprint), and a later process
    /// loading the same model with the same directory reuses them. Needs
    /// the paged cache.
    pub prefix_cache_dir: Option<String>,
    /// The disk tier's budget in MiB (default 4096); least recently used
    /// block files are removed beyond it.
    pub prefix_cache_disk_mb: Option<f64>,
    /// Called on the JS thread as the weights are read and evaluated (after
    /// every few tensors), then once with phase "ready" just before the
    /// promise resolves. `loadedBytes` only grows and ends equal to
    /// `totalBytes`. If it throws, the load stops and rejects with that error.
    #[napi(ts_type = "(progress: LoadProgress) => void")]
    pub on_progress: Option<Unknown<'env>>,
    /// Tensor parallelism: join the MLX distributed group this process was
    /// started in (`ring` reads MLX_HOSTFILE and MLX_RANK, as `mlx.launch`
    /// sets them) and load only this rank's shard. Every rank must then make
    /// the same calls in the same order (greedy or seeded sampling), as with
    /// mlx-lm's sharded models. A rank that never joins fails the load after
    /// MLX_LFM_TP_TIMEOUT_S (default 300); `info().worldSize` and `rank` say
    /// where this process stands.
    #[napi(ts_type = "'ring' | 'nccl' | 'jaccl' | 'mpi' | 'any'")]
    pub distributed: Option<String>,
}

/// How far a load is (see `LoadOptions.onProgress`).
#[napi(object, object_from_js = false)]
pub struct LoadProgress {
    /// Bytes of weights in memory so far (as the model holds them: cast
    /// and stacked).
    pub loaded_bytes: f64,
    pub total_bytes: f64,
    /// "weights" while they are read, "ready" once the model can be used.
    #[napi(ts_type = "'weights' | 'ready'")]
    pub phase: String,
}

/// `LoadOptions`' keys as JS spells them: any other key is an error
/// naming the closest of these (napi's conversion would drop it silently).
pub const LOAD_OPTION_KEYS: &[&str] = &[
    "dtype",
    "prefillChunkSize",
    "device",
    "decodePath",
    "kvCache",
    "kvCacheFullPrecisionLayers",
    "useBlockPagedCache",
    "pagedBlockSize",
    "pagedCacheBudgetMb",
    "contextLength",
    "prefixCacheDir",
    "prefixCacheDiskMb",
    "onProgress",
    "distributed",
];

#[napi(object, object_to_js = false)]
pub struct GenerateOptions<'env> {
    /// Most tokens to generate (default 256).
    pub max_tokens: Option<f64>,
    /// 0 (the default) is greedy.
    pub temperature: Option<f64>,
    pub top_k: Option<f64>,
    pub top_p: Option<f64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// Tokens the repetition penalty looks back over (default 20).
    pub repetition_context_size: Option<f64>,
    /// Seed for reproducible sampling (an integer from 0 to 2^53 - 1).
    pub seed: Option<f64>,
    /// Stop strings (not included in the result).
    pub stop: Option<Either<String, Vec<String>>>,
    /// OpenAI's presence penalty (-2 to 2): subtracted from the logit of
    /// every token among the last `repetitionContextSize` tokens (prompt
    /// included, as mlx-lm does).
    pub presence_penalty: Option<f64>,
    /// OpenAI's frequency penalty (-2 to 2): subtracted once per occurrence
    /// in that window.
    pub frequency_penalty: Option<f64>,
    /// Token id (a key such as "42") -> a bias from -100 to 100 added to its logit.
    pub logit_bias: Option<std::collections::HashMap<String, f64>>,
    /// Give the result (and stream events) a `logprobs` entry per token:
    /// the log-softmax of the logits after logit bias and penalties, before
    /// temperature and top-p / min-p / top-k.
    pub logprobs: Option<bool>,
    /// With `logprobs`: the most likely alternatives per token (0 to 20).
    pub top_logprobs: Option<f64>,
    /// The output is JSON valid against this schema (llguidance's JSON
    /// schema support; compact unless the schema's `x-guidance` says
    /// otherwise). A bad schema rejects before any compute.
    #[napi(ts_type = "Record<string, unknown> | boolean")]
    pub json_schema: Option<serde_json::Value>,
    /// The output matches this grammar (llguidance's Lark dialect).
    pub grammar: Option<String>,
    /// The whole output matches this regular expression.
    pub regex: Option<String>,
    /// Chat with `tools`: unset (free: the model may call tools), "auto"
    /// (free, but a call the model starts is completed under the tools'
    /// schemas),
    /// "none" (tools are not offered), "required" (the reply is one or more
    /// tool calls, their arguments valid against the tools' parameter
    /// schemas), or a tool's name (`{ name }` or OpenAI's
    /// `{ type: 'function', function: { name } }`: exactly one call to it).
    #[napi(ts_type = "'auto' | 'none' | 'required' | { name: string } | { type: 'function'; function: { name: string } }")]
    pub tool_choice: Option<serde_json::Value>,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: Option<bool>,
    /// Tools in the OpenAI function shape, rendered by the chat template (chat only).
    #[napi(ts_type = "Array<FunctionTool>")]
    pub tools: Option<Vec<serde_json::Value>>,
    /// For trusted callers only (chat): control tokens written in message
    /// content and names (`<|im_end|>`, `<|im_start|>`, ...) become the
    /// special tokens they spell, as in the template's own markup. By
    /// default (false) they stay text, so a message cannot end its turn or
    /// open another one (prompt injection).
    pub allow_special_tokens: Option<bool>,
    /// Fails the request before any compute when its prompt has more tokens
    /// than this (a bound on what one request may cost, below the context
    /// length).
    pub max_prompt_tokens: Option<f64>,
    /// Aborting stops the request within one step (a prefill chunk or a
    /// decode step); it then resolves with `finishReason: 'abort'` and the
    /// text so far. An already-aborted signal resolves at once, doing no work.
    #[napi(ts_type = "AbortSignal")]
    pub signal: Option<Object<'env>>,
}

/// `GenerateOptions`' keys as JS spells them (see `LOAD_OPTION_KEYS`).
pub const GENERATE_OPTION_KEYS: &[&str] = &[
    "maxTokens",
    "temperature",
    "topK",
    "topP",
    "minP",
    "repetitionPenalty",
    "repetitionContextSize",
    "seed",
    "stop",
    "presencePenalty",
    "frequencyPenalty",
    "logitBias",
    "logprobs",
    "topLogprobs",
    "jsonSchema",
    "grammar",
    "regex",
    "toolChoice",
    "ignoreEos",
    "tools",
    "allowSpecialTokens",
    "maxPromptTokens",
    "signal",
];

/// The options without the signal: plain values that can be kept (session
/// defaults) and merged.
#[derive(Clone, Default)]
pub struct OptionValues {
    // JS numbers as given: integers are checked (never truncated or
    // wrapped) when the parameters are built.
    pub max_tokens: Option<f64>,
    pub temperature: Option<f64>,
    pub top_k: Option<f64>,
    pub top_p: Option<f64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub repetition_context_size: Option<f64>,
    pub seed: Option<f64>,
    pub stop: Option<Vec<String>>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logit_bias: Option<std::collections::HashMap<String, f64>>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<f64>,
    pub json_schema: Option<serde_json::Value>,
    pub grammar: Option<String>,
    pub regex: Option<String>,
    pub tool_choice: Option<serde_json::Value>,
    pub ignore_eos: Option<bool>,
    pub tools: Option<Vec<serde_json::Value>>,
    pub allow_special_tokens: Option<bool>,
    pub max_prompt_tokens: Option<f64>,
}

impl OptionValues {
    pub fn from_options(o: Option<&GenerateOptions<'_>>) -> OptionValues {
        let Some(o) = o else { return OptionValues::default() };
        OptionValues {
            max_tokens: o.max_tokens,
            temperature: o.temperature,
            top_k: o.top_k,
            top_p: o.top_p,
            min_p: o.min_p,
            repetition_penalty: o.repetition_penalty,
            repetition_context_size: o.repetition_context_size,
            seed: o.seed,
            stop: o.stop.as_ref().map(|s| match s {
                Either::A(s) => vec![s.clone()],
                Either::B(v) => v.clone(),
            }),
            presence_penalty: o.presence_penalty,
            frequency_penalty: o.frequency_penalty,
            logit_bias: o.logit_bias.clone(),
            logprobs: o.logprobs,
            top_logprobs: o.top_logprobs,
            json_schema: o.json_schema.clone(),
            grammar: o.grammar.clone(),
            regex: o.regex.clone(),
            tool_choice: o.tool_choice.clone(),
            ignore_eos: o.ignore_eos,
            tools: o.tools.clone(),
            allow_special_tokens: o.allow_special_tokens,
            max_prompt_tokens: o.max_prompt_tokens,
        }
    }

    /// `self` with every option that `over` sets replaced by `over`'s.
    pub fn overlay(&self, over: &OptionValues) -> OptionValues {
        OptionValues {
            max_tokens: over.max_tokens.or(self.max_tokens),
            temperature: over.temperature.or(self.temperature),
            top_k: over.top_k.or(self.top_k),
            top_p: over.top_p.or(self.top_p),
            min_p: over.min_p.or(self.min_p),
            repetition_penalty: over.repetition_penalty.or(self.repetition_penalty),
            repetition_context_size: over.repetition_context_size.or(self.repetition_context_size),
            seed: over.seed.or(self.seed),
            stop: over.stop.clone().or_else(|| self.stop.clone()),
            presence_penalty: over.presence_penalty.or(self.presence_penalty),
            frequency_penalty: over.frequency_penalty.or(self.frequency_penalty),
            logit_bias: over.logit_bias.clone().or_else(|| self.logit_bias.clone()),
            logprobs: over.logprobs.or(self.logprobs),
            top_logprobs: over.top_logprobs.or(self.top_logprobs),
            json_schema: over.json_schema.clone().or_else(|| self.json_schema.clone()),
            grammar: over.grammar.clone().or_else(|| self.grammar.clone()),
            regex: over.regex.clone().or_else(|| self.regex.clone()),
            tool_choice: over.tool_choice.clone().or_else(|| self.tool_choice.clone()),
            ignore_eos: over.ignore_eos.or(self.ignore_eos),
            tools: over.tools.clone().or_else(|| self.tools.clone()),
            allow_special_tokens: over.allow_special_tokens.or(self.allow_special_tokens),
            max_prompt_tokens: over.max_prompt_tokens.or(self.max_prompt_tokens),
        }
    }

    /// The tools for the chat template (none with `toolChoice: 'none'`).
    pub fn tools_value(&self) -> Option<serde_json::Value> {
        if self.tool_choice.as_ref().and_then(|c| c.as_str()) == Some("none") {
            return None;
        }
        self.tools.clone().map(serde_json::Value::Array)
    }

    /// Whether message text may hold real special tokens (`allowSpecialTokens`).
    pub fn trusted(&self) -> bool {
        self.allow_special_tokens.unwrap_or(false)
    }
}

#[napi(object)]
#[derive(Clone)]
pub struct ChatMessage {
    #[napi(ts_type = "'system' | 'user' | 'assistant' | 'tool'")]
    pub role: String,
    pub content: Option<String>,
    /// An assistant turn's tool calls (as a chat result's `toolCalls`).
    #[napi(ts_type = "Array<ToolCall>")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

/// `ChatMessage`'s keys as JS spells them (see `LOAD_OPTION_KEYS`).
pub const MESSAGE_KEYS: &[&str] = &["role", "content", "toolCalls", "toolCallId", "name"];

#[napi(object)]
#[derive(Clone)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
}

#[napi(object)]
#[derive(Clone)]
pub struct Metrics {
    /// Time from the call reaching the model to the first token, in ms.
    pub ttft_ms: f64,
    /// Tokens actually run through the model during prefill.
    pub prefill_tokens: u32,
    /// Prompt tokens reused from the paged prefix cache (not run).
    pub cached_tokens: u32,
    /// prefillTokens divided by the prefill time.
    pub prefill_tokens_per_second: f64,
    pub prefill_ms: f64,
    /// Tokens after the first, divided by the time after the first.
    pub decode_tokens_per_second: f64,
    pub decode_ms: f64,
    pub total_ms: f64,
}

#[napi(object)]
#[derive(Clone)]
pub struct ChatResult {
    /// The reply; for chat, the text outside tool-call markers.
    pub text: String,
    /// "stop" (end-of-sequence or a stop string), "length", "abort", or
    /// "tool_calls" (chat: the reply holds tool calls that all parsed and
    /// generation stopped normally).
    /// "constraint": the jsonSchema / grammar / regex / toolChoice allowed
    /// no further token (the output is incomplete).
    #[napi(ts_type = "'stop' | 'length' | 'abort' | 'tool_calls' | 'constraint'")]
    pub finish_reason: String,
    /// Completion token ids (without the end-of-sequence token).
    pub tokens: Vec<u32>,
    pub usage: Usage,
    pub metrics: Metrics,
    /// Tool calls the model made (chat only), in the OpenAI shape.
    pub tool_calls: Option<Vec<ToolCall>>,
    /// Tool-call regions that could not be parsed (chat only); while there
    /// are any, `finishReason` is not "tool_calls".
    pub tool_call_errors: Option<Vec<ToolCallError>>,
    /// One entry per token of `tokens` (with the `logprobs` option).
    pub logprobs: Option<Vec<TokenLogprob>>,
}

/// A generated token's log-probability (see `GenerateOptions.logprobs`).
#[napi(object)]
#[derive(Clone)]
pub struct TokenLogprob {
    pub token: u32,
    /// The token alone, decoded.
    pub text: String,
    pub logprob: f64,
    /// The most likely tokens at this step, most likely first (`topLogprobs` of them).
    pub top_logprobs: Vec<TopLogprob>,
}

#[napi(object)]
#[derive(Clone)]
pub struct TopLogprob {
    pub token: u32,
    pub text: String,
    pub logprob: f64,
}

pub fn to_token_logprob(e: &crate::generate::TokenLogprob) -> TokenLogprob {
    TokenLogprob {
        token: e.token,
        text: e.text.clone(),
        logprob: e.logprob as f64,
        top_logprobs: e.top.iter().map(|(t, s, l)| TopLogprob { token: *t, text: s.clone(), logprob: *l as f64 }).collect(),
    }
}

/// A tool call in the OpenAI shape.
#[napi(object)]
#[derive(Clone)]
pub struct ToolCall {
    /// A fresh id (`call_...`); answer it with a tool message carrying this `toolCallId`.
    pub id: String,
    #[napi(js_name = "type", ts_type = "'function'")]
    pub kind: String,
    pub function: ToolCallFunction,
}

#[napi(object)]
#[derive(Clone)]
pub struct ToolCallFunction {
    pub name: String,
    /// The arguments as a JSON object string.
    pub arguments: String,
}

/// A tool offered to the model, in the OpenAI function shape (only the
/// type: `tools` are handed to the chat template as given).
#[napi(object)]
#[allow(dead_code)] // never built: it exists for its TypeScript declaration
pub struct FunctionTool {
    #[napi(js_name = "type", ts_type = "'function'")]
    pub kind: String,
    pub function: FunctionDefinition,
}

#[napi(object)]
#[allow(dead_code)] // as FunctionTool
pub struct FunctionDefinition {
    pub name: String,
    pub description: Option<String>,
    /// A JSON Schema for the arguments.
    #[napi(ts_type = "Record<string, unknown>")]
    pub parameters: Option<serde_json::Value>,
}

/// A tool call that could not be parsed.
#[napi(object)]
#[derive(Clone)]
pub struct ToolCallError {
    /// The region as generated, markers included.
    pub raw: String,
    /// What is wrong and where (an offset into the region's content).
    pub message: String,
}

/// Text split into plain text and tool calls (see `parseToolCalls`).
#[napi(object)]
pub struct ParsedToolCalls {
    pub text: String,
    pub tool_calls: Vec<ToolCall>,
    pub tool_call_errors: Vec<ToolCallError>,
}

#[napi(object)]
pub struct QuantizationInfo {
    #[napi(ts_type = "'affine' | 'mxfp4' | 'mxfp8' | 'nvfp4'")]
    pub mode: String,
    pub bits: i32,
    pub group_size: i32,
    /// How many projections use this format.
    pub projections: u32,
}

#[napi(object)]
pub struct ModelInfo {
    pub path: String,
    #[napi(ts_type = "'lfm2' | 'lfm2_moe'")]
    pub model_type: String,
    /// Per layer.
    #[napi(ts_type = "Array<'attention' | 'conv'>")]
    pub layer_kinds: Vec<String>,
    /// Activation dtype.
    #[napi(ts_type = "'float32' | 'float16' | 'bfloat16'")]
    pub dtype: String,
    /// Quantized formats in use; empty for an unquantized checkpoint.
    pub quantization: Vec<QuantizationInfo>,
    /// "quantized" is a kvCache other than "default".
    #[napi(ts_type = "'paged' | 'flat' | 'quantized'")]
    pub cache_kind: String,
    /// Why that cache was chosen.
    pub cache_reason: String,
    /// Tokens per block of the paged cache (paged only).
    pub paged_block_size: Option<u32>,
    /// The paged pool's memory budget in MiB (paged only).
    pub paged_cache_budget_mb: Option<u32>,
    /// The kvCache setting in effect.
    #[napi(ts_type = "'default' | 'affine4' | 'affine8' | 'rotorquant' | 'rotorquant-dense' | 'rotorquant-quaternion' | 'rotorquant-adaptive'")]
    pub kv_cache: String,
    /// Per attention layer: what its KV cache stores ("default" = full precision).
    #[napi(ts_type = "Array<'default' | 'affine4' | 'affine8' | 'rotorquant-dense' | 'rotorquant-quaternion'>")]
    pub kv_cache_layers: Vec<String>,
    /// KV cache bytes per token over all attention layers.
    pub kv_bytes_per_token: f64,
    #[napi(ts_type = "'compiled' | 'eager'")]
    pub decode_path: String,
    /// Why that decode path was chosen.
    pub decode_path_reason: String,
    /// Positions a request may use (prompt plus generated tokens).
    pub context_length: u32,
    pub parameter_count: f64,
    pub weight_bytes: f64,
    pub vocab_size: u32,
    pub hidden_size: u32,
    pub num_layers: u32,
    pub num_experts: Option<u32>,
    pub experts_per_token: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub has_chat_template: bool,
    /// SHA-256 (hex) over the model's config, weight headers, tokenizer,
    /// chat template and KV cache kind: saved sessions and prefix blocks on
    /// disk are only used by a model with the same fingerprint.
    pub fingerprint: String,
    #[napi(ts_type = "'cpu' | 'cuda' | 'metal'")]
    pub backend: String,
    #[napi(ts_type = "'cpu' | 'gpu'")]
    pub device: String,
    /// Processes the model is split over (1 unless loaded with `distributed`).
    pub world_size: u32,
    /// This process's rank in that group (0 alone).
    pub rank: u32,
}

/// The engine's options (all but `onProgress`, which `Lfm2Model::load`
/// turns into the engine's progress report).
pub fn engine_options(o: Option<LoadOptions>) -> Result<EngineOptions> {
    let mut e = EngineOptions::default();
    if let Some(o) = o {
        if let Some(d) = o.dtype {
            e.dtype = Some(Dtype::parse(&d).ok_or_else(|| {
                js_error(Error::invalid(format!("dtype `{d}` is not valid; use float32, float16 or bfloat16")))
            })?);
        }
        e.prefill_chunk = int_option("prefillChunkSize", o.prefill_chunk_size, 1, 1 << 24)?.map(|n| n as usize);
        if let Some(p) = o.decode_path {
            e.decode_path = Some(match p.as_str() {
                "compiled" => engine::DecodePath::Compiled,
                "eager" => engine::DecodePath::Eager,
                _ => return Err(js_error(Error::invalid(format!("decodePath `{p}` is not valid; use compiled or eager")))),
            });
        }
        e.kv_cache = o.kv_cache;
        e.paged_cache = o.use_block_paged_cache;
        e.paged_block_size = int_option("pagedBlockSize", o.paged_block_size, 1, 1 << 20)?.map(|n| n as usize);
        e.paged_cache_budget_mb = int_option("pagedCacheBudgetMb", o.paged_cache_budget_mb, 1, 1 << 30)?.map(|n| n as usize);
        e.kv_cache_full_precision_layers =
            int_option("kvCacheFullPrecisionLayers", o.kv_cache_full_precision_layers, 0, 1 << 16)?.map(|n| n as usize);
        e.context_length = int_option("contextLength", o.context_length, 1, MAX_TOKENS)?.map(|n| n as usize);
        if let Some(d) = o.prefix_cache_dir {
            if d.is_empty() {
                return Err(js_error(Error::invalid("prefixCacheDir is empty; give a directory")));
            }
            e.prefix_cache_dir = Some(std::path::PathBuf::from(d));
        }
        e.prefix_cache_disk_mb = int_option("prefixCacheDiskMb", o.prefix_cache_disk_mb, 1, 1 << 30)?.map(|n| n as usize);
        if let Some(b) = o.distributed {
            if !crate::mlx::distributed::BACKENDS.contains(&b.as_str()) {
                return Err(js_error(Error::invalid(format!(
                    "distributed `{b}` is not valid; use {}",
                    crate::mlx::distributed::BACKENDS.join(", ")
                ))));
            }
            e.distributed = Some(b);
        }
        if let Some(d) = o.device {
            e.device = Some(match d.as_str() {
                "cpu" => runtime::DeviceType::Cpu,
                "gpu" => runtime::DeviceType::Gpu,
                _ => return Err(js_error(Error::invalid(format!("device `{d}` is not valid; use cpu or gpu")))),
            });
        }
    }
    Ok(e)
}

/// An integer option in `lo..=hi`, from a JS number that must hold one
/// exactly (1.7, -1, NaN and 2^32 + 3 are errors naming the option, not 1,
/// 4294967295, 0 and 3).
pub(crate) fn int_option(name: &str, v: Option<f64>, lo: u64, hi: u64) -> Result<Option<u64>> {
    match v {
        None => Ok(None),
        Some(x) if x.fract() == 0.0 && x >= lo as f64 && x <= hi as f64 => Ok(Some(x as u64)),
        Some(x) if !x.is_finite() || x.fract() != 0.0 => Err(type_error(format!("{name} must be an integer, found {x}"))),
        Some(x) => Err(range_error(format!("{name} must be from {lo} to {hi}, found {x}"))),
    }
}

/// Token ids from JS numbers: each an integer in `0..2^32`, never
/// truncated (5.9) or wrapped (2^32 + 5).
pub fn token_ids(name: &str, ids: Vec<f64>) -> Result<Vec<u32>> {
    ids.into_iter()
        .enumerate()
        .map(|(i, x)| {
            if x.fract() == 0.0 && (0.0..=u32::MAX as f64).contains(&x) {
                Ok(x as u32)
            } else {
                Err(range_error(format!("{name}[{i}] is {x}, not a token id (an integer from 0 to 2^32 - 1)")))
            }
        })
        .collect()
}

/// Largest maxTokens (no context is longer, see `model::config::LIMITS`).
const MAX_TOKENS: u64 = 1 << 27;

pub fn generate_params(o: &OptionValues) -> Result<GenerateParams> {
    let mut p = GenerateParams { prefill_chunk: 0, ..Default::default() };
    if let Some(m) = int_option("maxTokens", o.max_tokens, 1, MAX_TOKENS)? {
        p.max_tokens = m as usize;
    }
    let s = &mut p.sampling;
    *s = SamplingParams {
        temperature: o.temperature.unwrap_or(0.0) as f32,
        top_k: int_option("topK", o.top_k, 0, 1 << 24)?.unwrap_or(0) as usize,
        top_p: o.top_p.unwrap_or(1.0) as f32,
        min_p: o.min_p.unwrap_or(0.0) as f32,
        repetition_penalty: o.repetition_penalty.map(|x| x as f32),
        repetition_context_size: int_option("repetitionContextSize", o.repetition_context_size, 1, 1 << 20)?.unwrap_or(20)
            as usize,
        seed: int_option("seed", o.seed, 0, (1u64 << 53) - 1)?,
        presence_penalty: o.presence_penalty.unwrap_or(0.0) as f32,
        frequency_penalty: o.frequency_penalty.unwrap_or(0.0) as f32,
        logit_bias: logit_bias(o.logit_bias.as_ref())?,
        logprobs: o.logprobs.unwrap_or(false) || o.top_logprobs.is_some_and(|n| n > 0.0),
        top_logprobs: int_option("topLogprobs", o.top_logprobs, 0, MAX_TOP_LOGPROBS as u64)?.unwrap_or(0) as usize,
    };
    for (name, v) in [("presencePenalty", o.presence_penalty), ("frequencyPenalty", o.frequency_penalty)] {
        if v.is_some_and(|x| !x.is_finite()) {
            return Err(range_error(format!("{name} must be from -2 to 2, found {}", v.unwrap_or_default())));
        }
    }
    s.validate().map_err(js_error)?;
    p.stop = o.stop.clone().unwrap_or_default();
    p.ignore_eos = o.ignore_eos.unwrap_or(false);
    p.max_prompt_tokens = int_option("maxPromptTokens", o.max_prompt_tokens, 1, MAX_TOKENS)?.map(|n| n as usize);
    p.grammar = grammar(o)?;
    Ok(p)
}

/// The constraint the options ask for (at most one of jsonSchema, grammar,
/// regex and a forcing toolChoice).
fn grammar(o: &OptionValues) -> Result<Option<Grammar>> {
    let mut found: Vec<Grammar> = vec![];
    if let Some(s) = &o.json_schema {
        if !s.is_object() && !s.is_boolean() {
            return Err(type_error("jsonSchema must be a JSON schema (an object)"));
        }
        found.push(Grammar::JsonSchema(s.clone()));
    }
    if let Some(g) = &o.grammar {
        found.push(Grammar::Lark(g.clone()));
    }
    if let Some(r) = &o.regex {
        found.push(Grammar::Regex(r.clone()));
    }
    if let Some(c) = &o.tool_choice {
        if let Some(g) = tool_choice(c, o.tools.as_deref())? {
            found.push(g);
        }
    }
    // 'auto' only watches for a call: another constraint wins (its output
    // can never hold the start marker).
    if found.len() > 1 {
        found.retain(|g| !matches!(g, Grammar::ToolCallsAuto { .. }));
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|g| g.option_name()).collect();
        return Err(type_error(format!("{} cannot be used together; give one", names.join(" and "))));
    }
    Ok(found.pop())
}

/// `toolChoice` as a constraint (None for "auto" and "none").
fn tool_choice(c: &serde_json::Value, tools: Option<&[serde_json::Value]>) -> Result<Option<Grammar>> {
    use serde_json::Value;
    let named = match c {
        Value::String(s) if s == "none" => return Ok(None),
        // Without tools there is no call to complete.
        Value::String(s) if s == "auto" && tools.is_none_or(|t| t.is_empty()) => return Ok(None),
        Value::String(s) if s == "auto" => None,
        Value::String(s) if s == "required" => None,
        Value::Object(m) => {
            let name = m.get("name").or_else(|| m.get("function").and_then(|f| f.get("name")));
            match name.and_then(|n| n.as_str()) {
                Some(n) => Some(n.to_string()),
                None => return Err(type_error("toolChoice must be 'auto', 'none', 'required', { name } or { type: 'function', function: { name } }")),
            }
        }
        _ => return Err(type_error(format!("toolChoice must be 'auto', 'none', 'required' or {{ name }}, found {c}"))),
    };
    let tools = tools.filter(|t| !t.is_empty()).ok_or_else(|| type_error("toolChoice 'required' or a named tool needs `tools`"))?;
    let mut out = vec![];
    for (i, t) in tools.iter().enumerate() {
        let f = t.get("function").unwrap_or(t);
        let name = f.get("name").and_then(|n| n.as_str()).ok_or_else(|| type_error(format!("tools[{i}] has no function name")))?;
        if named.as_deref().is_some_and(|n| n != name) {
            continue;
        }
        // A tool without parameters takes none.
        let params = f
            .get("parameters")
            .cloned()
            .unwrap_or_else(|| serde_json::json!({ "type": "object", "properties": {}, "additionalProperties": false }));
        out.push((name.to_string(), params));
    }
    if let Some(n) = &named {
        if out.is_empty() {
            return Err(range_error(format!("toolChoice names `{n}`, which is not one of the tools")));
        }
    }
    if c.as_str() == Some("auto") {
        return Ok(Some(Grammar::ToolCallsAuto { tools: out }));
    }
    Ok(Some(Grammar::ToolCalls { tools: out, single: named.is_some() }))
}

/// `logitBias` keys as token ids (each an integer string; the vocabulary
/// bound is checked once the model is known), in id order.
fn logit_bias(b: Option<&std::collections::HashMap<String, f64>>) -> Result<Vec<(u32, f32)>> {
    let Some(b) = b else { return Ok(vec![]) };
    let mut out = b
        .iter()
        .map(|(k, &v)| {
            let id = k
                .parse::<u32>()
                .ok()
                .filter(|id| id.to_string() == *k)
                .ok_or_else(|| type_error(format!("logitBias key `{k}` is not a token id (an integer from 0 to 2^32 - 1)")))?;
            if !(-100.0..=100.0).contains(&v) {
                return Err(range_error(format!("logitBias[{k}] must be from -100 to 100, found {v}")));
            }
            Ok((id, v as f32))
        })
        .collect::<Result<Vec<_>>>()?;
    out.sort_by_key(|e| e.0);
    Ok(out)
}

pub fn to_chat_messages(msgs: Vec<ChatMessage>) -> Result<Vec<crate::text::ChatMessage>> {
    msgs.into_iter()
        .enumerate()
        .map(|(i, m)| {
            const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];
            if !ROLES.contains(&m.role.as_str()) {
                return Err(js_error(Error::invalid(format!(
                    "messages[{i}].role is {:?}; use one of system, user, assistant or tool",
                    m.role
                ))));
            }
            // Only an assistant turn may be empty of text (it can hold only
            // tool calls); anything else without content is a caller's slip
            // the template would turn into an obscure error or silence.
            let has_calls = m.tool_calls.as_ref().is_some_and(|c| !c.is_empty());
            if m.content.is_none() && !(m.role == "assistant" && has_calls) {
                return Err(js_error(Error::invalid(format!(
                    "messages[{i}] ({}) has no content; give it `content` (a string){}",
                    m.role,
                    if m.role == "assistant" { " or `toolCalls`" } else { "" }
                ))));
            }
            if m.role == "tool" && m.tool_call_id.is_none() && m.name.is_none() {
                return Err(js_error(Error::invalid(format!(
                    "messages[{i}] (tool) needs `toolCallId` (the id of the call it answers) or `name`"
                ))));
            }
            Ok(crate::text::ChatMessage {
                role: m.role,
                content: m.content.map(serde_json::Value::String),
                tool_calls: m.tool_calls.map(serde_json::Value::Array),
                tool_call_id: m.tool_call_id,
                name: m.name,
            })
        })
        .collect()
}

pub fn to_tool_calls(calls: Vec<tool_calls::ParsedCall>) -> Vec<ToolCall> {
    calls
        .into_iter()
        .map(|c| ToolCall {
            id: tool_calls::new_call_id(),
            kind: "function".into(),
            function: ToolCallFunction { arguments: c.arguments_json(), name: c.name },
        })
        .collect()
}

pub fn to_tool_call_errors(errors: Vec<tool_calls::ToolCallError>) -> Vec<ToolCallError> {
    errors.into_iter().map(|e| ToolCallError { raw: e.raw, message: e.message }).collect()
}

/// The result of a chat request: tool calls parsed out of the text.
pub fn to_chat_reply(g: Generation) -> ChatResult {
    let out = tool_calls::parse_output(&g.text);
    let mut r = to_chat_result(Generation { text: out.text, ..g });
    if !out.calls.is_empty() && out.errors.is_empty() && r.finish_reason == "stop" {
        r.finish_reason = "tool_calls".into();
    }
    if !out.calls.is_empty() {
        r.tool_calls = Some(to_tool_calls(out.calls));
    }
    if !out.errors.is_empty() {
        r.tool_call_errors = Some(to_tool_call_errors(out.errors));
    }
    r
}

/// What a request that was aborted before it started resolves with.
pub fn aborted_result() -> ChatResult {
    to_chat_result(Generation {
        text: String::new(),
        tokens: vec![],
        finish_reason: crate::generate::FinishReason::Abort,
        prompt_tokens: 0,
        completion_tokens: 0,
        metrics: Default::default(),
        logprobs: None,
    })
}

pub fn to_chat_result(g: Generation) -> ChatResult {
    let m = &g.metrics;
    ChatResult {
        tool_calls: None,
        tool_call_errors: None,
        usage: Usage {
            prompt_tokens: g.prompt_tokens as u32,
            completion_tokens: g.completion_tokens as u32,
            total_tokens: (g.prompt_tokens + g.completion_tokens) as u32,
        },
        metrics: Metrics {
            ttft_ms: m.ttft_ms,
            prefill_tokens: m.prefill_tokens as u32,
            cached_tokens: m.cached_tokens as u32,
            prefill_tokens_per_second: m.prefill_tokens_per_second,
            prefill_ms: m.prefill_ms,
            decode_tokens_per_second: m.decode_tokens_per_second,
            decode_ms: m.decode_ms,
            total_ms: m.total_ms,
        },
        finish_reason: g.finish_reason.name().to_string(),
        logprobs: g.logprobs.as_ref().map(|v| v.iter().map(to_token_logprob).collect()),
        tokens: g.tokens,
        text: g.text,
    }
}

/// The paged pool's counters.
#[napi(object)]
pub struct CacheStats {
    pub block_size: u32,
    /// Blocks allocated so far (the pool grows on demand).
    pub capacity_blocks: u32,
    /// Blocks the budget allows.
    pub max_blocks: u32,
    /// Blocks held by running requests.
    pub blocks_in_use: u32,
    /// Blocks reusable by later requests: full blocks in the prefix index,
    /// and the last partial block of recent requests (kept for a prompt that
    /// continues them exactly).
    pub blocks_cached: u32,
    pub evictions: f64,
    /// Requests that reused a cached prefix, and the tokens they reused.
    pub hits: f64,
    pub hit_tokens: f64,
    /// Bytes the pool holds (K/V blocks and conv snapshots).
    pub bytes: f64,
    /// With `prefixCacheDir`: blocks read back from disk, lookups the disk
    /// could not answer, bytes of block files, files removed for the
    /// budget, blocks written, and unusable files removed.
    pub disk_hits: Option<f64>,
    pub disk_misses: Option<f64>,
    pub disk_bytes: Option<f64>,
    pub disk_evictions: Option<f64>,
    pub disk_writes: Option<f64>,
    pub disk_damaged: Option<f64>,
}

pub fn to_cache_stats(s: &crate::cache::paged::PagedStats, bytes: usize) -> CacheStats {
    CacheStats {
        block_size: s.block_size as u32,
        capacity_blocks: s.capacity_blocks as u32,
        max_blocks: s.max_blocks as u32,
        blocks_in_use: s.blocks_in_use as u32,
        blocks_cached: s.blocks_cached as u32,
        evictions: s.evictions as f64,
        hits: s.hits as f64,
        hit_tokens: s.hit_tokens as f64,
        bytes: bytes as f64,
        disk_hits: s.disk.as_ref().map(|d| d.hits as f64),
        disk_misses: s.disk.as_ref().map(|d| d.misses as f64),
        disk_bytes: s.disk.as_ref().map(|d| d.bytes as f64),
        disk_evictions: s.disk.as_ref().map(|d| d.evictions as f64),
        disk_writes: s.disk.as_ref().map(|d| d.writes as f64),
        disk_damaged: s.disk.as_ref().map(|d| d.damaged as f64),
    }
}

pub fn to_model_info(i: &engine::ModelInfo) -> ModelInfo {
    ModelInfo {
        path: i.path.display().to_string(),
        model_type: i.model_type.clone(),
        layer_kinds: i.layer_kinds.clone(),
        dtype: i.dtype.clone(),
        quantization: i
            .quantization
            .iter()
            .map(|q| QuantizationInfo { mode: q.mode.clone(), bits: q.bits, group_size: q.group_size, projections: q.projections as u32 })
            .collect(),
        cache_kind: i.cache_kind.clone(),
        cache_reason: i.cache_reason.clone(),
        paged_block_size: i.paged_block_size.map(|x| x as u32),
        paged_cache_budget_mb: i.paged_cache_budget_mb.map(|x| x as u32),
        kv_cache: i.kv_cache.clone(),
        kv_cache_layers: i.kv_cache_layers.clone(),
        kv_bytes_per_token: i.kv_bytes_per_token as f64,
        decode_path: i.decode_path.clone(),
        decode_path_reason: i.decode_path_reason.clone(),
        context_length: i.context_length as u32,
        parameter_count: i.parameter_count as f64,
        weight_bytes: i.weight_bytes as f64,
        vocab_size: i.vocab_size as u32,
        hidden_size: i.hidden_size as u32,
        num_layers: i.num_layers as u32,
        num_experts: i.num_experts.map(|x| x as u32),
        experts_per_token: i.experts_per_token.map(|x| x as u32),
        eos_token_ids: i.eos_token_ids.clone(),
        has_chat_template: i.has_chat_template,
        fingerprint: i.fingerprint.clone(),
        backend: i.backend.clone(),
        device: i.device.clone(),
        world_size: i.world_size as u32,
        rank: i.rank as u32,
    }
}
