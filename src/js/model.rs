//! The `Lfm2Model` class. Every call validates its arguments on the JS
//! thread, then queues the work on the model's worker thread and returns a
//! promise that the worker settles; the event loop is never blocked.

use super::convert::{generate_params, to_chat_messages, to_chat_result, to_model_info, ChatMessage, ChatResult, GenerateOptions, LoadOptions, ModelInfo};
use crate::engine::worker::ModelWorker;
use crate::engine::{self, Prompt};
use crate::generate::NoObserver;
use napi::bindgen_prelude::*;
use napi_derive::napi;
use std::path::PathBuf;
use std::sync::Arc;

pub(crate) fn js_error(e: crate::Error) -> napi::Error {
    napi::Error::new(Status::GenericFailure, e.to_string())
}

/// Runs `f` on a short-lived thread (tokenizer work that must not wait
/// behind a generation on the model's worker, nor block the event loop).
pub(crate) fn off_thread<'e, T: ToNapiValue + Send + 'static>(
    env: &'e Env,
    f: impl FnOnce() -> crate::Result<T> + Send + 'static,
) -> Result<Object<'e>> {
    let (deferred, promise) = env.create_deferred()?;
    std::thread::spawn(move || match f() {
        Ok(v) => deferred.resolve(move |_| Ok(v)),
        Err(e) => deferred.reject(js_error(e)),
    });
    Ok(promise)
}

/// A loaded LFM2 / LFM2-MoE model. Create it with `Lfm2Model.load(path)`.
#[napi]
pub struct Lfm2Model {
    worker: Arc<ModelWorker>,
    info: Arc<parking_lot::Mutex<engine::ModelInfo>>,
    tokenizer: Arc<crate::text::Tokenizer>,
}

#[napi]
impl Lfm2Model {
    /// Loads a checkpoint directory (Hugging Face or MLX layout).
    #[napi(ts_return_type = "Promise<Lfm2Model>")]
    pub fn load(env: &Env, path: String, options: Option<LoadOptions>) -> Result<Object<'_>> {
        let opts = super::convert::engine_options(options)?;
        let (deferred, promise) = env.create_deferred()?;
        ModelWorker::spawn(PathBuf::from(path), opts, move |r| match r {
            Ok((worker, info, tokenizer)) => {
                deferred.resolve(move |_| Ok(Lfm2Model { worker: Arc::new(worker), info, tokenizer }))
            }
            Err(e) => deferred.reject(js_error(e)),
        });
        Ok(promise)
    }

    /// Chats with the model: renders `messages` with the checkpoint's chat
    /// template and generates the assistant's reply.
    #[napi(ts_return_type = "Promise<ChatResult>")]
    pub fn chat<'e>(&self, env: &'e Env, messages: Vec<ChatMessage>, options: Option<GenerateOptions>) -> Result<Object<'e>> {
        let msgs = to_chat_messages(messages)?;
        let tools = options.as_ref().and_then(|o| o.tools.clone()).map(serde_json::Value::Array);
        let params = generate_params(options.as_ref())?;
        self.queue(env, move |eng| eng.chat(&msgs, tools.as_ref(), params, &mut NoObserver).map(to_chat_result))
    }

    /// Raw completion without a chat template. A string is tokenized (adding
    /// the BOS token unless it is already there); an array of token ids is
    /// used exactly.
    #[napi(ts_return_type = "Promise<ChatResult>")]
    pub fn generate<'e>(
        &self,
        env: &'e Env,
        prompt: Either<String, Vec<u32>>,
        options: Option<GenerateOptions>,
    ) -> Result<Object<'e>> {
        let prompt = match prompt {
            Either::A(s) => Prompt::Text(s),
            Either::B(ids) => Prompt::Tokens(ids),
        };
        let params = generate_params(options.as_ref())?;
        self.queue(env, move |eng| eng.generate(prompt, params, &mut NoObserver).map(to_chat_result))
    }

    /// The logits of the last position after running `tokenIds` (float32).
    #[napi(ts_return_type = "Promise<Float32Array>")]
    pub fn logits<'e>(&self, env: &'e Env, token_ids: Vec<u32>) -> Result<Object<'e>> {
        let (deferred, promise) = env.create_deferred()?;
        self.worker.run(
            move |eng| eng.logits(&token_ids),
            move |r| match r {
                Ok(v) => deferred.resolve(move |_| Ok(Float32Array::new(v))),
                Err(e) => deferred.reject(js_error(e)),
            },
        );
        Ok(promise)
    }

    /// Token ids for `text` (with the tokenizer's special tokens, e.g. BOS, unless
    /// `addSpecialTokens` is false).
    #[napi(ts_return_type = "Promise<number[]>")]
    pub fn tokenize<'e>(&self, env: &'e Env, text: String, add_special_tokens: Option<bool>) -> Result<Object<'e>> {
        let tok = self.tokenizer.clone();
        off_thread(env, move || tok.encode(&text, add_special_tokens.unwrap_or(true)))
    }

    /// Text for token ids (special tokens included unless `skipSpecialTokens`).
    #[napi(ts_return_type = "Promise<string>")]
    pub fn detokenize<'e>(&self, env: &'e Env, token_ids: Vec<u32>, skip_special_tokens: Option<bool>) -> Result<Object<'e>> {
        let tok = self.tokenizer.clone();
        off_thread(env, move || tok.decode(&token_ids, skip_special_tokens.unwrap_or(false)))
    }

    /// The prompt token ids `chat()` would run for `messages` (the checkpoint's
    /// chat template with the generation prompt appended).
    #[napi(ts_return_type = "Promise<number[]>")]
    pub fn apply_chat_template<'e>(&self, env: &'e Env, messages: Vec<ChatMessage>, options: Option<GenerateOptions>) -> Result<Object<'e>> {
        let msgs = to_chat_messages(messages)?;
        let tools = options.and_then(|o| o.tools).map(serde_json::Value::Array);
        let tok = self.tokenizer.clone();
        off_thread(env, move || tok.apply_chat_template(&msgs, tools.as_ref(), true, None))
    }

    /// What was loaded and how it runs.
    #[napi]
    pub fn info(&self) -> ModelInfo {
        to_model_info(&self.info.lock())
    }

    /// Frees the model once queued requests finish; later calls reject.
    #[napi]
    pub fn close(&self) {
        self.worker.close();
    }

    fn queue<'e>(
        &self,
        env: &'e Env,
        f: impl FnOnce(&mut engine::Engine) -> crate::Result<ChatResult> + Send + 'static,
    ) -> Result<Object<'e>> {
        let (deferred, promise) = env.create_deferred()?;
        self.worker.run(f, move |r| match r {
            Ok(v) => deferred.resolve(move |_| Ok(v)),
            Err(e) => deferred.reject(js_error(e)),
        });
        Ok(promise)
    }
}
