//! `Lfm2Model.load(dir, { onProgress })`: the loading thread's byte counts
//! handed to a JS callback.
//!
//! The loading thread never waits for JS: every report is queued on a
//! threadsafe function without blocking (its queue is unbounded, so none is
//! dropped) and the thread reads on. The promise is settled through the same
//! queue, after the last report, so a caller that awaits the load has seen
//! every report, the final one included.

use super::args::type_error;
use super::convert::LoadProgress;
use super::model::js_error;
use crate::model::Progress;
use napi::bindgen_prelude::*;
use napi::threadsafe_function::{ThreadsafeFunction, ThreadsafeFunctionCallMode, UnknownReturnValue};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

// Weak: the pending load's own promise keeps the process alive; a callback
// that outlived its load must not.
type Callback = ThreadsafeFunction<LoadProgress, UnknownReturnValue, LoadProgress, Status, false, true, 0>;

struct Shared {
    callback: Callback,
    /// What the callback threw first; the load then stops and rejects with it.
    thrown: Mutex<Option<napi::Error>>,
    failed: AtomicBool,
    total: AtomicUsize,
}

impl Shared {
    /// Queues one report; never blocks.
    fn report(self: &Arc<Self>, loaded: usize, total: usize, phase: &str, then: impl FnOnce() + Send + 'static) -> bool {
        let value = LoadProgress { loaded_bytes: loaded as f64, total_bytes: total as f64, phase: phase.into() };
        let me = self.clone();
        let status = self.callback.call_with_return_value(value, ThreadsafeFunctionCallMode::NonBlocking, move |r, _| {
            if let Err(e) = r {
                me.failed.store(true, Ordering::SeqCst);
                me.thrown.lock().get_or_insert(e);
            }
            then();
            Ok(())
        });
        status == Status::Ok
    }
}

pub(crate) struct Reporter(Arc<Shared>);

impl Reporter {
    /// Checks that `f` is a function and makes it callable from the loading thread.
    pub fn new(f: &Unknown) -> Result<Reporter> {
        if f.get_type()? != ValueType::Function {
            return Err(type_error(format!("options.onProgress must be a function, found {}", super::args::kind_of(f))));
        }
        // SAFETY: checked to be a function of the current call's environment.
        let f: Function<LoadProgress, UnknownReturnValue> = unsafe { Function::from_napi_value(f.value().env, f.raw()) }?;
        let callback = f.build_threadsafe_function().callee_handled::<false>().weak::<true>().build()?;
        Ok(Reporter(Arc::new(Shared { callback, thrown: Mutex::new(None), failed: AtomicBool::new(false), total: AtomicUsize::new(0) })))
    }

    /// The engine's side: reports "weights" progress, and stops the load
    /// once the callback has thrown.
    pub fn engine_progress(&self) -> Progress {
        let shared = self.0.clone();
        Progress(Arc::new(move |loaded, total| {
            shared.total.store(total, Ordering::SeqCst);
            !shared.failed.load(Ordering::SeqCst) && shared.report(loaded, total, "weights", || ())
        }))
    }

    /// Settles the load: a loaded model after one last "ready" report (and
    /// only if the callback never threw), else the error.
    pub fn finish<T: Send + 'static>(self, r: crate::Result<T>, settle: impl FnOnce(Result<T>) + Send + 'static) {
        let shared = self.0;
        let thrown = |s: &Shared| s.thrown.lock().take();
        let value = match r {
            Ok(v) => v,
            // Stopped because the callback threw: that error, not ours.
            Err(e) => return settle(Err(thrown(&shared).unwrap_or_else(|| js_error(e)))),
        };
        let total = shared.total.load(Ordering::SeqCst);
        // The settling runs on the JS thread after the report, or here if the
        // report could not be queued (the environment is closing).
        let slot = Arc::new(Mutex::new(Some((value, settle))));
        let later = slot.clone();
        let me = shared.clone();
        let queued = shared.report(total, total, "ready", move || {
            if let Some((value, settle)) = later.lock().take() {
                // The model is dropped (closed) if a report threw.
                settle(match thrown(&me) {
                    Some(e) => Err(e),
                    None => Ok(value),
                });
            }
        });
        if !queued {
            if let Some((value, settle)) = slot.lock().take() {
                settle(Ok(value));
            }
        }
    }
}
