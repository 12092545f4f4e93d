//! Cancellation and streaming for requests on a model's worker.
//!
//! Cancellation: every request gets a shared `AtomicBool`. An `AbortSignal`
//! sets it from the JS thread (an `abort` listener added with
//! `addEventListener`, removed again on the JS thread once the request is
//! over); breaking out of a stream sets it too. The worker polls it through
//! [`Observer::cancelled`] between prefill chunks and decode steps, and
//! through the return value of [`Observer::on_text`].
//!
//! Streaming: the worker appends each text delta to the stream's pending
//! buffer and wakes whoever awaits `next()`. A consumer that reads slowly
//! gets the text that piled up as one larger delta: the worker never waits
//! for JS (other requests queue behind it on the same model), and memory
//! stays bounded by the reply's text.

use super::convert::{to_token_logprob, ChatResult, TokenLogprob};
use super::model::js_error;
use crate::generate::Observer;
use crate::text::tool_calls::ToolCallSplitter;
use napi::bindgen_prelude::*;
use napi_derive::napi;
use parking_lot::Mutex;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

/// An `abort` listener on a caller's `AbortSignal`, to be removed on the JS
/// thread once the request is over (a long-lived signal must not collect
/// one listener per request).
pub struct AbortHook {
    signal: ObjectRef<false>,
    listener: FunctionRef<(), ()>,
}

impl AbortHook {
    /// Removes the listener; JS thread only.
    pub fn release(self, env: &Env) {
        if let (Ok(signal), Ok(listener)) = (self.signal.get_value(env), self.listener.borrow_back(env)) {
            if let Ok(remove) = signal.get_named_property::<Function<'_, FnArgs<(&str, Function<'_, (), ()>)>, ()>>("removeEventListener") {
                let _ = remove.apply(signal, FnArgs::from(("abort", listener)));
            }
        }
        let _ = self.signal.unref(env);
    }
}

/// A request's cancellation flag and the hook that sets it.
pub struct Abort {
    pub flag: Arc<AtomicBool>,
    pub hook: Option<AbortHook>,
}

impl Abort {
    pub fn none() -> Abort {
        Abort { flag: Arc::new(AtomicBool::new(false)), hook: None }
    }

    /// Watches `signal` (JS thread). An already-aborted signal sets the flag at once.
    pub fn watch(env: &Env, signal: Option<&Object<'_>>) -> Result<Abort> {
        let mut abort = Abort::none();
        let Some(signal) = signal else { return Ok(abort) };
        let aborted: Option<bool> = signal.get_named_property("aborted")?;
        let add: Option<Function<'_, FnArgs<(&str, Function<'_, (), ()>, Object<'_>)>, ()>> =
            match signal.get_named_property::<Unknown>("addEventListener")?.get_type()? {
                ValueType::Function => Some(signal.get_named_property("addEventListener")?),
                _ => None,
            };
        let Some(add) = add else {
            return Err(js_error(crate::Error::invalid("signal must be an AbortSignal")));
        };
        if aborted == Some(true) {
            abort.flag.store(true, Ordering::SeqCst);
            return Ok(abort);
        }
        let flag = abort.flag.clone();
        let listener = env.create_function_from_closure::<(), (), _>("onAbort", move |_| {
            flag.store(true, Ordering::SeqCst);
            Ok(())
        })?;
        let mut once = Object::new(env)?;
        once.set("once", true)?;
        add.apply(signal, FnArgs::from(("abort", listener, once)))?;
        abort.hook = Some(AbortHook { signal: signal.create_ref()?, listener: listener.create_ref()? });
        Ok(abort)
    }
}

/// Hears a non-streaming request: only cancellation.
pub struct FlagObserver(pub Arc<AtomicBool>);

impl Observer for FlagObserver {
    fn on_text(&mut self, _delta: &str) -> bool {
        !self.0.load(Ordering::Relaxed)
    }
    fn cancelled(&mut self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// A text delta of a stream.
#[napi(object, object_from_js = false)]
pub struct StreamTextEvent {
    #[napi(js_name = "type", ts_type = "'text'")]
    pub kind: String,
    /// New text: whole characters, never a part of a stop string, never
    /// tool-call markup (chat). Empty when the event only carries
    /// `logprobs` (text held back, e.g. while it may start a stop string).
    pub text: String,
    /// With the `logprobs` option: the entries of the tokens generated since
    /// the previous event (a token's text may come in a later event).
    pub logprobs: Option<Vec<TokenLogprob>>,
}

/// The last event of a stream: the same result the non-streaming call gives.
#[napi(object, object_from_js = false)]
pub struct StreamDoneEvent {
    #[napi(js_name = "type", ts_type = "'done'")]
    pub kind: String,
    pub result: ChatResult,
}

type Outcome = std::result::Result<ChatResult, crate::Error>;
type Listener = Box<dyn FnOnce(&Outcome) + Send>;

#[derive(Default)]
struct StreamState {
    pending: String,
    pending_logprobs: Vec<TokenLogprob>,
    outcome: Option<Outcome>,
    /// The done event (or the error) has been handed out.
    finished: bool,
    /// The consumer left (`return()` / `cancel()`): no more events.
    closed: bool,
    wakers: Vec<Waker>,
    listeners: Vec<Listener>,
}

impl StreamState {
    /// Wakes `cx`'s task at the next change (once, however often it polls).
    fn park(&mut self, cx: &Context<'_>) {
        if !self.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            self.wakers.push(cx.waker().clone());
        }
    }
}

pub struct StreamShared {
    state: Mutex<StreamState>,
    pub cancel: Arc<AtomicBool>,
}

impl StreamShared {
    pub fn new(cancel: Arc<AtomicBool>) -> Arc<StreamShared> {
        Arc::new(StreamShared { state: Mutex::new(StreamState::default()), cancel })
    }

    fn wake(wakers: Vec<Waker>) {
        for w in wakers {
            w.wake();
        }
    }

    /// Appends a delta (worker thread).
    pub fn push_text(&self, text: &str) {
        if text.is_empty() {
            return;
        }
        let wakers = {
            let mut s = self.state.lock();
            if s.closed {
                return;
            }
            s.pending.push_str(text);
            std::mem::take(&mut s.wakers)
        };
        Self::wake(wakers);
    }

    /// Appends a token's log-probabilities (worker thread).
    pub fn push_logprob(&self, entry: &crate::generate::TokenLogprob) {
        let wakers = {
            let mut s = self.state.lock();
            if s.closed {
                return;
            }
            s.pending_logprobs.push(to_token_logprob(entry));
            std::mem::take(&mut s.wakers)
        };
        Self::wake(wakers);
    }

    /// Records the final outcome, tells the listeners, wakes the consumer.
    pub fn finish(&self, outcome: Outcome) {
        let wakers = {
            let mut s = self.state.lock();
            // Listeners (a session's history, deferreds) run under the lock,
            // so the consumer cannot see "done" before they have run. They
            // never touch this stream.
            for l in std::mem::take(&mut s.listeners) {
                l(&outcome);
            }
            s.outcome = Some(outcome);
            std::mem::take(&mut s.wakers)
        };
        Self::wake(wakers);
    }

    /// Calls `f` with the outcome now if there is one, else when it arrives.
    pub fn on_finish(&self, f: impl FnOnce(&Outcome) + Send + 'static) {
        let mut s = self.state.lock();
        match &s.outcome {
            Some(o) => f(o),
            None => s.listeners.push(Box::new(f)),
        }
    }

    fn close(&self) {
        self.cancel.store(true, Ordering::SeqCst);
        let wakers = {
            let mut s = self.state.lock();
            s.closed = true;
            s.pending.clear();
            s.pending_logprobs.clear();
            std::mem::take(&mut s.wakers)
        };
        Self::wake(wakers);
    }
}

/// Feeds a stream from the worker. Chat streams pass the text through a
/// tool-call splitter so the markup never shows up as text.
pub struct StreamObserver {
    pub shared: Arc<StreamShared>,
    pub splitter: Option<ToolCallSplitter>,
}

impl StreamObserver {
    /// Flushes text the splitter held back (end of generation).
    pub fn flush(&mut self) {
        if let Some(s) = self.splitter.as_mut() {
            let rest = s.finish();
            self.shared.push_text(&rest);
        }
    }
}

impl Observer for StreamObserver {
    fn finished(&mut self) {
        self.flush();
    }

    fn on_text(&mut self, delta: &str) -> bool {
        match self.splitter.as_mut() {
            Some(s) => {
                let out = s.push(delta);
                self.shared.push_text(&out);
            }
            None => self.shared.push_text(delta),
        }
        !self.shared.cancel.load(Ordering::Relaxed)
    }
    fn cancelled(&mut self) -> bool {
        self.shared.cancel.load(Ordering::Relaxed)
    }
    fn on_logprob(&mut self, entry: &crate::generate::TokenLogprob) {
        self.shared.push_logprob(entry);
    }
}

/// A generation in progress. Iterate it with `for await (const ev of stream)`:
/// `{ type: 'text', text }` events, then one `{ type: 'done', result }`.
/// Breaking out of the loop stops the generation within one step; the loop
/// exits once the request has ended and given its KV blocks back. Text that
/// arrives while the consumer is busy is merged into the next event.
#[napi(async_iterator)]
pub struct GenerationStream {
    shared: Arc<StreamShared>,
}

impl GenerationStream {
    pub fn new(shared: Arc<StreamShared>) -> Self {
        GenerationStream { shared }
    }
}

#[napi]
impl GenerationStream {
    /// Stops the generation (as breaking out of the loop does); the stream
    /// then ends and `result()` resolves with `finishReason: 'abort'`.
    #[napi]
    pub fn cancel(&self) {
        self.shared.close();
    }

    /// The final result, once generation is over (also after `cancel()` or a
    /// `break`); rejects if the request failed.
    #[napi(ts_return_type = "Promise<ChatResult>")]
    pub fn result<'e>(&self, env: &'e Env) -> Result<Object<'e>> {
        let (deferred, promise) = env.create_deferred()?;
        self.shared.on_finish(move |o| {
            let o = o.clone();
            deferred.resolve(move |_| o.map_err(js_error));
        });
        Ok(promise)
    }
}

struct NextEvent {
    shared: Arc<StreamShared>,
}

type Event = Either<StreamTextEvent, StreamDoneEvent>;

impl Future for NextEvent {
    type Output = Result<Option<Event>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = self.shared.state.lock();
        if s.closed || s.finished {
            return Poll::Ready(Ok(None));
        }
        if !s.pending.is_empty() || !s.pending_logprobs.is_empty() {
            let text = std::mem::take(&mut s.pending);
            let lp = std::mem::take(&mut s.pending_logprobs);
            let logprobs = (!lp.is_empty()).then_some(lp);
            return Poll::Ready(Ok(Some(Either::A(StreamTextEvent { kind: "text".into(), text, logprobs }))));
        }
        if let Some(o) = &s.outcome {
            let o = o.clone();
            s.finished = true;
            return Poll::Ready(match o {
                Ok(result) => Ok(Some(Either::B(StreamDoneEvent { kind: "done".into(), result }))),
                Err(e) => Err(js_error(e)),
            });
        }
        s.park(cx);
        Poll::Pending
    }
}

/// Resolves when the request has an outcome (the worker is done with it).
struct Ended {
    shared: Arc<StreamShared>,
}

impl Future for Ended {
    type Output = Result<Option<Event>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = self.shared.state.lock();
        if s.outcome.is_some() {
            return Poll::Ready(Ok(None));
        }
        s.park(cx);
        Poll::Pending
    }
}

#[napi]
impl AsyncGenerator for GenerationStream {
    type Yield = Either<StreamTextEvent, StreamDoneEvent>;
    type Next = ();
    type Return = ();

    fn next(&mut self, _value: Option<()>) -> impl Future<Output = Result<Option<Self::Yield>>> + Send + 'static {
        NextEvent { shared: self.shared.clone() }
    }

    /// `break` (the loop's `return()`): stops the generation and resolves
    /// once the worker has ended the request, so code after the loop sees
    /// its KV blocks given back (a running request stops within one step or
    /// prefill chunk, a queued one when the worker reaches it; a request
    /// the worker drops is answered too).
    fn complete(&mut self, _value: Option<()>) -> impl Future<Output = Result<Option<Self::Yield>>> + Send + 'static {
        self.shared.close();
        Ended { shared: self.shared.clone() }
    }
}

/// Releases an abort hook on the JS thread once `shared` finishes. A
/// deferred is the JS-thread callback (its promise is not used).
pub fn release_hook_when_done(env: &Env, shared: &StreamShared, hook: Option<AbortHook>) -> Result<()> {
    let Some(hook) = hook else { return Ok(()) };
    let (deferred, _promise) = env.create_deferred::<(), _>()?;
    shared.on_finish(move |_| {
        deferred.resolve(move |env| {
            hook.release(&env);
            Ok(())
        })
    });
    Ok(())
}
