//! One dedicated thread per loaded model. MLX is not safe to drive from
//! several threads at once, so the engine (and every array it owns) lives on
//! this thread only; work arrives through a channel. Generations are
//! scheduled with continuous batching (see `schedule`); other work runs in
//! order between decode steps.

use super::{Engine, EngineOptions, ModelInfo, Request, Scheduler};
use crate::cache::paged::prefetch::{Prefetcher, Ticket};
use crate::error::{Error, ErrorKind, Result};
use crate::mlx::runtime;
use crate::text::Tokenizer;
use parking_lot::Mutex;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::path::PathBuf;
use std::collections::VecDeque;
use std::sync::mpsc::{channel, Sender};
use std::sync::OnceLock;
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce(&mut Engine, &mut Scheduler) + Send>;

/// What the worker's queue carries: plain work on the engine, or a
/// generation for the continuous-batching scheduler (with, once the render
/// thread has seen its prompt, the read-ahead of its prefix from disk).
enum Msg {
    Run(Job),
    Generate(Request, Option<Ticket>),
}

type SharedSender = Arc<Mutex<Option<Sender<Msg>>>>;

pub struct ModelWorker {
    tx: SharedSender,
    thread: Option<JoinHandle<()>>,
}

/// Every model thread still running, so the process can free the models
/// before it exits. Without this, a model whose JS object is finalized at
/// exit is freed on its thread while the main thread is already running
/// libmlx's static destructors: heap corruption at exit.
struct Live {
    senders: Vec<(u64, SharedSender)>,
    running: usize,
    next_id: u64,
}

static LIVE: Mutex<Live> = Mutex::new(Live { senders: Vec::new(), running: 0, next_id: 0 });
static LIVE_CHANGED: parking_lot::Condvar = parking_lot::Condvar::new();

/// Closes every model's queue and waits (up to `timeout`) until their
/// threads have finished the job at hand and freed their models. Called
/// when the JS environment shuts down.
pub fn shutdown_all(timeout: std::time::Duration) {
    let deadline = std::time::Instant::now() + timeout;
    let mut live = LIVE.lock();
    for (_, tx) in live.senders.drain(..) {
        tx.lock().take();
    }
    while live.running > 0 {
        if LIVE_CHANGED.wait_until(&mut live, deadline).timed_out() {
            eprintln!("mlx-lfm: {} model thread(s) still busy at exit", live.running);
            break;
        }
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

impl ModelWorker {
    /// Starts the thread and loads the model on it; `on_loaded` hears the
    /// outcome (on the worker thread). On failure the thread exits and
    /// nothing stays loaded.
    pub fn spawn(
        dir: PathBuf,
        opts: EngineOptions,
        on_loaded: impl FnOnce(Result<(ModelWorker, Arc<Mutex<ModelInfo>>, Arc<Tokenizer>)>) + Send + 'static,
    ) {
        let (tx, front_rx) = channel::<Msg>();
        let tx: SharedSender = Arc::new(Mutex::new(Some(tx)));
        // Everything sent to the model passes a render thread first, in
        // order: it renders chat templates and tokenizes prompts (CPU work
        // bounded by the template's fuel, seconds for a hostile 4 MiB
        // request) so the worker's running requests never wait on it, and
        // forwards every message unchanged otherwise. When the model is
        // closed its queue ends, and then the worker's. With a prefix
        // cache on disk it also starts reading the prompt's blocks from
        // there (see cache/paged/prefetch.rs), so the worker does not.
        let (wtx, rx) = channel::<Msg>();
        let prefetcher: Arc<OnceLock<Prefetcher>> = Arc::new(OnceLock::new());
        let ahead = prefetcher.clone();
        let front = std::thread::Builder::new().name("mlx-lfm-render".into()).spawn(move || {
            for mut msg in front_rx {
                if let Msg::Generate(req, ticket) = &mut msg {
                    *ticket = req.render_then(|prompt| ahead.get().and_then(|p| p.prefetch(prompt))).flatten();
                }
                if let Err(std::sync::mpsc::SendError(Msg::Generate(req, _))) = wtx.send(msg) {
                    req.fail(Error::new(ErrorKind::Closed, "this model has been closed"));
                }
            }
        });
        if let Err(e) = front {
            on_loaded(Err(Error::mlx(format!("could not start the model's render thread: {e}"))));
            return;
        }
        let id = {
            let mut live = LIVE.lock();
            live.next_id += 1;
            live.running += 1;
            let id = live.next_id;
            live.senders.push((id, tx.clone()));
            id
        };
        let finished = move || {
            let mut live = LIVE.lock();
            live.senders.retain(|(i, _)| *i != id);
            live.running -= 1;
            LIVE_CHANGED.notify_all();
        };
        let (ready_tx, ready_rx) = channel::<JoinHandle<()>>();
        let spawn = std::thread::Builder::new().name("mlx-lfm-model".into()).spawn(move || {
            let mut opts = opts;
            let loaded = catch_unwind(AssertUnwindSafe(|| -> Result<Engine> {
                runtime::use_new_stream()?;
                Engine::load(&dir, &opts)
            }))
            .unwrap_or_else(|p| Err(Error::new(ErrorKind::Mlx, format!("panic while loading: {}", panic_message(p)))));
            // This thread lives as long as the model: the progress callback
            // (a JS function behind it) is let go as soon as the load is over.
            opts.progress = None;
            let thread = ready_rx.recv().ok();
            let mut engine = match loaded {
                Ok(e) => e,
                Err(e) => {
                    tx.lock().take();
                    on_loaded(Err(e));
                    finished();
                    return;
                }
            };
            if let Some(p) = engine.prefetcher() {
                let _ = prefetcher.set(p);
            }
            let info = engine.shared_info();
            let tokenizer = engine.tokenizer.clone();
            on_loaded(Ok((ModelWorker { tx, thread }, info, tokenizer)));
            schedule(&mut engine, rx);
            // Closing: the prefix cache's blocks go to its disk tier first.
            let _ = catch_unwind(AssertUnwindSafe(|| engine.persist_prefix_cache()));
            drop(engine);
            finished();
        });
        match spawn {
            Ok(h) => {
                let _ = ready_tx.send(h);
            }
            Err(e) => {
                // The closure (and on_loaded) were dropped with the failed spawn.
                let mut live = LIVE.lock();
                live.senders.retain(|(i, _)| *i != id);
                live.running -= 1;
                eprintln!("mlx-lfm: could not start the model thread: {e}");
            }
        }
    }

    /// Queues `f`; its result (or a panic turned into an error) goes to
    /// `reply`, exactly once, also when the model is closed.
    pub fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Engine) -> Result<T> + Send + 'static,
        reply: impl FnOnce(Result<T>) + Send + 'static,
    ) {
        self.run_scheduled(move |engine, _| f(engine), reply)
    }

    /// [`ModelWorker::run`] for work that also needs the scheduler (the
    /// warm-up, which must not run over live requests).
    pub fn run_scheduled<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Engine, &mut Scheduler) -> Result<T> + Send + 'static,
        reply: impl FnOnce(Result<T>) + Send + 'static,
    ) {
        let slot = Arc::new(Mutex::new(Some(reply)));
        let job_slot = slot.clone();
        let job: Job = Box::new(move |engine, sched| {
            let r = catch_unwind(AssertUnwindSafe(|| f(engine, sched)))
                .unwrap_or_else(|p| Err(Error::new(ErrorKind::Mlx, format!("internal panic: {}", panic_message(p)))));
            if let Some(reply) = job_slot.lock().take() {
                reply(r);
            }
        });
        let sent = match self.tx.lock().as_ref() {
            Some(tx) => tx.send(Msg::Run(job)).is_ok(),
            None => false,
        };
        if !sent {
            if let Some(reply) = slot.lock().take() {
                reply(Err(Error::new(ErrorKind::Closed, "this model has been closed")));
            }
        }
    }

    /// Queues a generation; it joins the running batch at the next step.
    /// Its reply is called exactly once, also when the model is closed.
    pub fn generate(&self, req: Request) {
        let rejected = match self.tx.lock().as_ref() {
            Some(tx) => tx.send(Msg::Generate(req, None)).err().map(|e| e.0),
            None => Some(Msg::Generate(req, None)),
        };
        if let Some(Msg::Generate(req, _)) = rejected {
            req.fail(Error::new(ErrorKind::Closed, "this model has been closed"));
        }
    }

    pub fn is_closed(&self) -> bool {
        self.tx.lock().is_none()
    }

    /// Stops accepting work; queued jobs still run, then the thread frees the model.
    pub fn close(&self) {
        self.tx.lock().take();
    }
}

/// The worker's loop: continuous batching. Queued work runs between decode
/// steps; new generations are prefilled a chunk per step (the running ones
/// advance meanwhile) and then join the running ones, which advance one token
/// per step together; each leaves the batch as soon as it finishes. With
/// nothing running it sleeps on the queue.
///
/// A generation whose prefix blocks are still being read from disk (off
/// this thread) waits in `parked`, in arrival order with the ones after it,
/// while the running requests step; with nothing running it starts at once
/// (its admission waits for the read, which then holds nobody up).
fn schedule(engine: &mut Engine, rx: std::sync::mpsc::Receiver<Msg>) {
    use std::sync::mpsc::TryRecvError;
    let mut sched = Scheduler::new();
    // Tensor parallel: rank 0 announces what it does (lockstep.rs); the
    // other ranks take no requests of their own (their `follow` job
    // replays rank 0's).
    let leader = engine.leader();
    let follower = engine.follower().map(|g| g.rank());
    let start = |engine: &mut Engine, sched: &mut Scheduler, req: Request| {
        if let Some(rank) = follower {
            req.fail(Error::invalid(format!(
                "this process is rank {rank} of a tensor-parallel group: it follows rank 0, which takes the requests"
            )));
            return;
        }
        let req = match &leader {
            Some(g) => match super::lockstep::lead_request(engine, g, req) {
                Ok(Some(r)) => r,
                Ok(None) => return,
                Err(e) => {
                    eprintln!("mlx-lfm: could not reach the other ranks: {}", e.message);
                    return;
                }
            },
            None => req,
        };
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| sched.submit(engine, req))) {
            eprintln!("mlx-lfm: internal panic while starting a request: {}", panic_message(p));
        }
    };
    let mut parked: VecDeque<(Request, Ticket)> = VecDeque::new();
    let mut open = true;
    loop {
        while parked.front().is_some_and(|(_, t)| t.is_done() || sched.is_idle()) {
            let (req, ticket) = parked.pop_front().expect("the request just seen");
            start(engine, &mut sched, req);
            drop(ticket);
        }
        let msg = if sched.is_idle() {
            if !open {
                break;
            }
            match rx.recv() {
                Ok(m) => Some(m),
                Err(_) => break,
            }
        } else if open {
            match rx.try_recv() {
                Ok(m) => Some(m),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    None
                }
            }
        } else {
            None
        };
        match msg {
            Some(Msg::Run(job)) => {
                // A panicking job must not take the model down with it; the
                // job's own wrapper reports the failure to its caller.
                let _ = catch_unwind(AssertUnwindSafe(|| job(engine, &mut sched)));
                let _ = catch_unwind(AssertUnwindSafe(|| engine.drain_spills()));
                continue;
            }
            Some(Msg::Generate(req, ticket)) => {
                match ticket {
                    Some(t) if !parked.is_empty() || !(t.is_done() || sched.is_idle()) => parked.push_back((req, t)),
                    _ if !parked.is_empty() => parked.push_back((req, Ticket::done())),
                    _ => start(engine, &mut sched, req),
                }
                // Take every arrival before the next step.
                continue;
            }
            None => {}
        }
        if let Some(g) = &leader {
            if let Err(e) = super::lockstep::announce(g, &super::lockstep::Command::Step) {
                // The group is broken: nothing can run any more.
                eprintln!("mlx-lfm: could not reach the other ranks: {}", e.message);
                sched.abandon();
                continue;
            }
        }
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| sched.prefill_next(engine))) {
            eprintln!("mlx-lfm: internal panic during a prefill: {}", panic_message(p));
        }
        if catch_unwind(AssertUnwindSafe(|| sched.step_active(engine))).is_err() {
            // The requests' replies fire as they are dropped; their batch
            // rows go with them.
            sched.forget();
        }
        // After the step, not inside it: blocks it evicted go to disk.
        let _ = catch_unwind(AssertUnwindSafe(|| engine.drain_spills()));
    }
    if let Some(g) = &leader {
        let _ = super::lockstep::announce(g, &super::lockstep::Command::Close);
    }
}

impl Drop for ModelWorker {
    fn drop(&mut self) {
        self.tx.lock().take();
        // Don't join: Drop may run on the JS thread, and the worker may be
        // mid-request. It exits by itself once the queue is drained.
        self.thread.take();
    }
}
