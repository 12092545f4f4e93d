//! The scheduler: continuous batching of a model's requests. Admission (a
//! request's prompt and prefix-cache lookup), prefill grouping (one chunk
//! of a long prompt per step, or short fresh prompts together), batch
//! membership (which running requests share the stacked decode batch) and
//! step dispatch (the compiled stacked step, the compiled single step, or
//! the eager batch). The worker loop (worker.rs) feeds it requests and
//! calls [`Scheduler::step`]; the load policy is in load.rs.

use super::Engine;
use crate::cache::batch::{self, DecodeBatch, Member};
use crate::cache::ModelCache;
use crate::error::{Error, Result};
use crate::generate::{self, Advance, GenerateParams, Generation, Observer, Pending, Sequence, Started, Stepper};
use crate::mlx::{Array, Dtype};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// A request for the scheduler.
pub struct Request {
    /// Builds the prompt and parameters on the worker when the request
    /// starts.
    pub prepare: Option<Box<dyn FnOnce(&mut Engine) -> Result<(Vec<u32>, GenerateParams)> + Send>>,
    /// Builds them without the engine (the chat template, the tokenizer):
    /// run by the model's render thread before the request reaches the
    /// worker (see src/engine/worker.rs), so a slow render never stalls
    /// the requests the worker is running.
    pub render: Option<Box<dyn FnOnce() -> Result<(Vec<u32>, GenerateParams)> + Send>>,
    pub observer: Box<dyn Observer + Send>,
    pub reply: Option<Box<dyn FnOnce(Result<Generation>) + Send>>,
    /// A restored session's kept state to continue from (see
    /// `Engine::load_session`), used when the prompt continues its history.
    pub resume: Option<u64>,
}

impl Request {
    /// A request for a prompt already in token ids, nothing streamed.
    pub fn tokens(prompt: Vec<u32>, params: GenerateParams, reply: impl FnOnce(Result<Generation>) + Send + 'static) -> Request {
        Request {
            prepare: None,
            // Known before the worker: the render thread passes it on at
            // once (and can start reading its prefix from disk).
            render: Some(Box::new(move || Ok((prompt, params)))),
            observer: Box::new(generate::NoObserver),
            reply: Some(Box::new(reply)),
            resume: None,
        }
    }

    /// Runs `render` (a panic becomes an error) and leaves its outcome for
    /// the worker as `prepare`: the request then fails or starts in its
    /// turn, as if rendered there.
    pub(crate) fn render_now(&mut self) {
        self.render_then(|_| ());
    }

    /// [`Request::render_now`], then `look` at the rendered prompt (None
    /// when there was nothing to render, or it failed).
    pub(crate) fn render_then<T>(&mut self, look: impl FnOnce(&[u32]) -> T) -> Option<T> {
        let render = self.render.take()?;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(render)).unwrap_or_else(|p| {
            let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
            Err(Error::mlx(format!("internal panic while rendering the prompt: {}", msg.unwrap_or_default())))
        });
        let seen = r.as_ref().ok().map(|(prompt, _)| look(prompt));
        self.prepare = Some(Box::new(move |_| r));
        seen
    }

    pub(crate) fn succeed(mut self, g: Generation) {
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


/// The requests of one model and the decode batch they share.
#[derive(Default)]
pub struct Scheduler {
    /// Requests still reading their prompts, in arrival order.
    waiting: VecDeque<Prefilling>,
    /// Requests generating.
    active: Vec<Active>,
    /// The running requests' caches stacked for the compiled batched step.
    batch: DecodeBatch,
    next_id: u64,
    /// Compiled batched steps run (tests check which path batches took).
    pub(crate) stacked_steps: usize,
    /// Steps whose constrained rows did their parser work together.
    pub(crate) prepared_steps: usize,
}

impl Scheduler {
    pub fn new() -> Scheduler {
        Scheduler::default()
    }

    /// Nothing waiting and nothing running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.active.is_empty()
    }

    /// Requests generating now.
    pub fn running(&self) -> usize {
        self.active.len()
    }

    /// Requests still reading their prompts.
    pub fn prefilling(&self) -> usize {
        self.waiting.len()
    }

    /// Takes a request: its prompt is prepared now and prefilled by later
    /// steps. A request that fails to start is answered at once.
    pub fn submit(&mut self, e: &mut Engine, req: Request) {
        if let Some(p) = self.begin(e, req) {
            self.waiting.push_back(p);
        }
    }

    /// One scheduler step: the next prefill work (a chunk of one prompt, or
    /// several short ones together), then one decode step for every
    /// running request.
    pub fn step(&mut self, e: &mut Engine) {
        self.prefill_next(e);
        self.step_active(e);
    }

    /// Drops every request without writing batch rows back (a step
    /// panicked: their caches are in an unknown state). Their replies fire
    /// as they are dropped.
    pub fn forget(&mut self) {
        self.active.clear();
        self.batch = DecodeBatch::default();
    }

    /// Drops the waiting requests too (a tensor-parallel group that can no
    /// longer run anything): every caller hears an error now, where the
    /// waiting ones were left unanswered while the loop retried.
    pub fn abandon(&mut self) {
        self.forget();
        self.waiting.clear();
    }

    /// Starts a request at once: prefills it and samples its first token.
    /// True when it is running; false when it is already over (cancelled
    /// during prefill, or failed: `reply` heard).
    pub fn admit(&mut self, e: &mut Engine, req: Request) -> bool {
        let Some(mut p) = self.begin(e, req) else { return false };
        loop {
            match self.advance(e, p) {
                Admission::Prefilling(next) => p = next,
                Admission::Running(a) => {
                    self.active.push(a);
                    return true;
                }
                Admission::Over => return false,
            }
        }
    }

    /// Prepares a request (prompt, parameters, prefix-cache lookup) without
    /// running it. None when that fails (`reply` heard).
    fn begin(&mut self, e: &mut Engine, mut req: Request) -> Option<Prefilling> {
        let started = Instant::now();
        // A request handed to the scheduler without the worker's render
        // thread (the benchmark, tests) is rendered here.
        req.render_now();
        let prepared = match req.prepare.take() {
            Some(prepare) => prepare(e),
            None => Err(Error::invalid("a request with nothing to run")),
        };
        let resume = req.resume.take();
        let pending = prepared.and_then(|(prompt, params)| {
            let params = e.params(params);
            let guide = e.guide_for(&params)?;
            let cache = e.take_resume(resume, &prompt).unwrap_or_else(|| e.model.new_cache());
            Pending::new(&e.model, guide.as_deref(), cache, prompt, &params, started)
        });
        match pending {
            Ok(p) => Some(Prefilling { pending: p, req }),
            Err(err) => {
                req.fail(err);
                None
            }
        }
    }

    /// Runs one prefill chunk of a starting request.
    fn advance(&mut self, e: &mut Engine, p: Prefilling) -> Admission {
        let Prefilling { pending, mut req } = p;
        match pending.advance(&e.model, e.compiled.as_ref(), &e.tokenizer, req.observer.as_mut()) {
            Ok(Advance::More(pending)) => Admission::Prefilling(Prefilling { pending, req }),
            Ok(Advance::Done(s)) => self.admitted(e, s, req),
            Err(err) => {
                req.fail(err);
                Admission::Over
            }
        }
    }

    /// A request whose prefill ended: running (with its batch id), or over.
    /// Its first token is handed over here, before the next step is queued
    /// (see [`generate::Sequence::deliver_first`]).
    fn admitted(&mut self, e: &Engine, s: Started, mut req: Request) -> Admission {
        match s {
            Started::Running(mut seq) => match seq.deliver_first(&e.eos, req.observer.as_mut()) {
                Ok(true) => {
                    self.next_id += 1;
                    Admission::Running(Active { id: self.next_id, seq, req })
                }
                Ok(false) => {
                    match seq.finish(req.observer.as_mut()) {
                        Ok((g, _)) => req.succeed(g),
                        Err(err) => req.fail(err),
                    }
                    Admission::Over
                }
                Err(err) => {
                    req.fail(err);
                    Admission::Over
                }
            },
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
    fn take_prefill_group(&mut self, prefill_chunk: usize) -> Vec<Prefilling> {
        let mut first = match self.waiting.pop_front() {
            Some(p) => p,
            None => return vec![],
        };
        let fits = |p: &mut Prefilling| {
            let n = p.pending.batchable_prompt().map(|x| x.len());
            n.filter(|_| !p.req.observer.cancelled())
        };
        let Some(mut longest) = fits(&mut first) else { return vec![first] };
        let mut group = vec![first];
        let mut rest = VecDeque::with_capacity(self.waiting.len());
        while let Some(mut p) = self.waiting.pop_front() {
            match fits(&mut p) {
                Some(n) if (group.len() + 1) * longest.max(n) <= prefill_chunk => {
                    longest = longest.max(n);
                    group.push(p);
                }
                _ => rest.push_back(p),
            }
        }
        self.waiting = rest;
        group
    }

    /// The prefill work of one step: the next group of waiting requests
    /// runs; the ones it starts join the running requests, one still
    /// reading its prompt goes back to the front of the queue. Returns how
    /// many requests it ran.
    pub fn prefill_next(&mut self, e: &mut Engine) -> usize {
        let group = self.take_prefill_group(e.prefill_chunk);
        let n = group.len();
        for a in self.advance_group(e, group) {
            match a {
                Admission::Prefilling(p) => self.waiting.push_front(p),
                Admission::Running(a) => self.active.push(a),
                Admission::Over => {}
            }
        }
        n
    }

    /// Runs a prefill group: one prefill chunk of a lone request, or the
    /// whole prompts of several in one batch.
    fn advance_group(&mut self, e: &mut Engine, group: Vec<Prefilling>) -> Vec<Admission> {
        if group.len() <= 1 {
            return group.into_iter().map(|p| self.advance(e, p)).collect();
        }
        // Blocks first, in arrival order: a request the paged pool cannot
        // hold fails alone, as it would prefilled by itself.
        let mut out = vec![];
        let mut ready = vec![];
        for mut p in group {
            match p.pending.reserve_prompt() {
                Ok(()) => ready.push(p),
                Err(err) => {
                    p.req.fail(err);
                    out.push(Admission::Over);
                }
            }
        }
        if ready.len() <= 1 {
            out.extend(ready.into_iter().map(|p| self.advance(e, p)));
            return out;
        }
        let (pendings, reqs): (Vec<Pending>, Vec<Request>) = ready.into_iter().map(|p| (p.pending, p.req)).unzip();
        match generate::prefill_together(&e.model, &e.tokenizer, pendings) {
            Ok(started) => out.extend(started.into_iter().zip(reqs).map(|(s, req)| self.admitted(e, s, req))),
            Err(err) => out.extend(reqs.into_iter().map(|r| {
                r.fail(err.clone());
                Admission::Over
            })),
        }
        out
    }

    /// One decode step for every running request: a single request takes
    /// the compiled step; several take the compiled batched step over their
    /// stacked caches (see `cache::batch`), or, on the eager path or with a
    /// quantized KV cache, one eager pass with attention per sequence.
    /// Finished requests are answered and removed.
    pub fn step_active(&mut self, e: &mut Engine) {
        if self.active.is_empty() {
            return;
        }
        let mut active = std::mem::take(&mut self.active);
        // Room for the next token first: a request the paged pool cannot
        // give a block fails alone, the others step.
        let mut refused: Vec<(usize, Error)> = vec![];
        let mut want: Vec<usize> = Vec::with_capacity(active.len());
        for (i, a) in active.iter_mut().enumerate() {
            if a.seq.wants_next() {
                match a.seq.cache.reserve_token() {
                    Ok(()) => want.push(i),
                    Err(err) => refused.push((i, err)),
                }
            }
        }
        let mut nexts: Vec<Option<Array>> = (0..active.len()).map(|_| None).collect();
        let stepped = self.step_wanted(e, &mut active, &want).map(|ns| {
            for (i, n) in ns {
                nexts[i] = Some(n);
            }
        });
        if let Err(err) = stepped {
            // The step's caches are in an unknown state: every request in it fails.
            self.batch = DecodeBatch::default();
            for a in active.drain(..) {
                a.req.fail(err.clone());
            }
            return;
        }
        // The constrained rows' parser work runs on several threads at once;
        // `accept` below takes it over (the refused rows are not accepted).
        let rows = active.iter_mut().zip(&nexts).enumerate();
        let rows = rows.filter(|(i, _)| !refused.iter().any(|(j, _)| j == i)).map(|(_, (a, n))| (&mut a.seq, n.is_some()));
        if generate::prepare_constrained(rows, &e.eos) {
            self.prepared_steps += 1;
        }
        let mut keep = Vec::with_capacity(active.len());
        let accepting = Instant::now();
        for (i, (mut a, next)) in active.drain(..).zip(nexts).enumerate() {
            if let Some(k) = refused.iter().position(|(j, _)| *j == i) {
                a.req.fail(refused.swap_remove(k).1);
                continue;
            }
            match a.seq.accept(next, &e.eos, a.req.observer.as_mut()) {
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
                        Err(err) => req.fail(err),
                    }
                }
                Err(err) => a.req.fail(err),
            }
        }
        generate::timing::batch_accept(accepting);
        self.active = keep;
    }

    /// Steps the requests `want` (indices into `active`); returns each
    /// one's queued next token.
    fn step_wanted(&mut self, e: &mut Engine, active: &mut [Active], want: &[usize]) -> Result<Vec<(usize, Array)>> {
        let stacked =
            want.len() > 1 && e.compiled.is_some() && want.iter().all(|&i| batch::stackable(&active[i].seq.cache));
        if stacked {
            if let Some(out) = self.step_stacked(e, active, want)? {
                return Ok(out);
            }
        }
        // Every other step reads the sequences' own caches.
        self.reconcile_batch(e, active, &[])?;
        if want.len() == 1 {
            let i = want[0];
            let mut stepper = Stepper::new(&e.model, e.compiled.as_ref());
            let a = &mut active[i];
            let r = a.seq.y.reshape(&[1, 1]).and_then(|ids| stepper.step(&ids, &mut a.seq.cache)).and_then(|l| a.seq.sample(&l));
            let failure = stepper.failure.take();
            e.note_failure(failure);
            return Ok(vec![(i, r?)]);
        }
        if want.is_empty() {
            return Ok(vec![]);
        }
        let ids = pending_ids(active, want)?;
        let mut caches: Vec<&mut ModelCache> =
            active.iter_mut().enumerate().filter(|(i, _)| want.contains(i)).map(|(_, a)| &mut a.seq.cache).collect();
        let logits = e.model.forward_batch(&ids, &mut caches)?;
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
    fn step_stacked(&mut self, e: &mut Engine, active: &mut [Active], want: &[usize]) -> Result<Option<Vec<(usize, Array)>>> {
        let started = Instant::now();
        self.reconcile_batch(e, active, want)?;
        let rows = self.batch.ids();
        let order: Vec<usize> = rows
            .iter()
            .map(|id| active.iter().position(|a| a.id == *id).ok_or_else(|| Error::invalid("batch row without a request")))
            .collect::<Result<_>>()?;
        let positions: Vec<i32> = order.iter().map(|&i| active[i].seq.cache.pos as i32).collect();
        let positions = self.batch.positions_for(&positions)?;
        let ids = match self.batch.take_carry()? {
            Some(ids) => ids,
            None => pending_ids(active, &order)?,
        };
        let built = e.compiled.as_ref().expect("checked by the caller").step_batch(&e.model, &ids, &positions, &mut self.batch, true);
        let logits = match built {
            Ok(l) => {
                self.stacked_steps += 1;
                l
            }
            Err(err) => {
                e.note_failure(Some(err));
                return Ok(None);
            }
        };
        for (&i, &id) in order.iter().zip(&rows) {
            self.batch.end_token(id, &mut active[i].seq.cache)?;
        }
        let mut out = Vec::with_capacity(order.len());
        // Greedy rows all at once: one argmax over the batch, not one per row.
        let greedy = if order.iter().all(|&i| active[i].seq.is_greedy()) {
            Some(logits.argmax(-1, false)?.astype(Dtype::Uint32)?)
        } else {
            None
        };
        let finite = match &greedy {
            Some(_) => Some(crate::generate::sampler::finite_rows(&logits)?),
            None => None,
        };
        for (k, &i) in order.iter().enumerate() {
            let k = k as i32;
            out.push((
                i,
                match (&greedy, &finite) {
                    (Some(t), Some(f)) => {
                        active[i].seq.set_finite(f.slice_axis(0, k, k + 1)?);
                        t.slice_axis(0, k, k + 1)?
                    }
                    _ => active[i].seq.draw(&logits.slice_axis(0, k, k + 1)?)?,
                },
            ));
        }
        // Each row's finiteness flag (the very array its accept() reads) is
        // evaluated with the tokens, so reading it costs no eval of its own.
        let flags: Vec<Array> = order.iter().flat_map(|&i| active[i].seq.pending_extras()).collect();
        let mut toks: Vec<&Array> = out.iter().map(|(_, t)| t).collect();
        toks.extend(flags.iter());
        let mut caches: Vec<&mut ModelCache> =
            active.iter_mut().enumerate().filter(|(i, _)| want.contains(i)).map(|(_, a)| &mut a.seq.cache).collect();
        generate::timing::batch_build(started);
        generate::dispatch_step(&toks, &mut caches, &generate::timing::BATCH)?;
        if let Some(t) = greedy {
            self.batch.set_carry(t);
        }
        Ok(Some(out))
    }

    /// Makes the batch hold exactly the requests `want` (none: every row
    /// goes back to its request's cache).
    fn reconcile_batch(&mut self, e: &Engine, active: &mut [Active], want: &[usize]) -> Result<()> {
        if self.batch.is_empty() && want.len() < 2 {
            return Ok(());
        }
        let shape = e.model.batch_shape();
        let mut members: Vec<Member> = active
            .iter_mut()
            .enumerate()
            .map(|(i, a)| Member { id: a.id, wanted: want.contains(&i), cache: &mut a.seq.cache })
            .collect();
        self.batch.reconcile(&shape, &mut members)
    }

    /// Runs two short throwaway generations, together and then one alone,
    /// so the kernels and compiled steps serving needs are built now and
    /// not while requests wait: on CUDA the first batched step compiles
    /// kernels (about 19 s the first time on a machine, cached on disk
    /// after that; ~0.2 s per new batch shape). Returns the time taken, or
    /// None when requests are waiting or running (they are not disturbed).
    pub fn warm_up(&mut self, e: &mut Engine) -> Result<Option<f64>> {
        if !self.is_idle() || !self.batch.is_empty() {
            return Ok(None);
        }
        let t = Instant::now();
        let failed: Arc<Mutex<Option<Error>>> = Arc::new(Mutex::new(None));
        let vocab = e.model.config.vocab_size as u32;
        for (i, n) in [(0u32, 3usize), (1, 6)] {
            let prompt: Vec<u32> = (0..8u32).map(|k| (k * 7 + i * 13 + 3) % vocab.max(1)).collect();
            let failed = failed.clone();
            let params = GenerateParams { max_tokens: n, ignore_eos: true, ..Default::default() };
            let req = Request::tokens(prompt, params, move |r| {
                if let Err(err) = r {
                    failed.lock().get_or_insert(err);
                }
            });
            self.admit(e, req);
        }
        while !self.active.is_empty() {
            self.step_active(e);
        }
        let failure = failed.lock().take();
        match failure {
            Some(err) => Err(err),
            None => Ok(Some(t.elapsed().as_secs_f64() * 1000.0)),
        }
    }
}
