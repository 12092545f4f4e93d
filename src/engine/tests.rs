//! The paged cache through the engine: paged equals flat, a warm turn equals
//! a cold run of the same prompt while running only the suffix, eviction
//! under a tiny budget stays correct, and failed or cancelled requests give
//! their blocks back.

use super::{DecodePath, Engine, EngineOptions, Prompt};
use crate::fixture::{self, FixtureSpec, Preset};
use crate::generate::{GenerateParams, Generation, NoObserver, Observer};
use std::path::PathBuf;

fn fixture_dir(name: &str, preset: Preset) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mlxlfm-engine-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    fixture::generate(&FixtureSpec::new(preset), &d).unwrap();
    d
}

fn engine(dir: &PathBuf, paged: bool, block: usize, budget_mb: usize, path: Option<DecodePath>) -> Engine {
    let opts = EngineOptions {
        paged_cache: Some(paged),
        paged_block_size: Some(block),
        paged_cache_budget_mb: Some(budget_mb),
        decode_path: path,
        prefill_chunk: Some(16),
        ..Default::default()
    };
    Engine::load(dir, &opts).unwrap()
}

fn run(e: &mut Engine, prompt: &[u32], n: usize) -> Generation {
    let p = GenerateParams { max_tokens: n, ignore_eos: true, ..Default::default() };
    e.generate(Prompt::Tokens(prompt.to_vec()), p, &mut NoObserver).unwrap()
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + seed * 101 + 3) % 900 + 1).collect()
}

#[test]
fn paged_gives_the_flat_tokens_on_both_decode_paths() {
    let dir = fixture_dir("paged-flat", Preset::Tiny);
    for path in [DecodePath::Eager, DecodePath::Compiled] {
        let mut flat = engine(&dir, false, 16, 64, Some(path));
        let mut paged = engine(&dir, true, 16, 64, Some(path));
        assert_eq!(flat.info().cache_kind, "flat");
        assert_eq!(paged.info().cache_kind, "paged");
        for (len, seed) in [(5, 1), (40, 2), (100, 3)] {
            let p = prompt(len, seed);
            let a = run(&mut flat, &p, 48);
            let b = run(&mut paged, &p, 48);
            assert_eq!(a.tokens, b.tokens, "{path:?}, prompt of {len}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn warm_turn_equals_cold_run_and_counts_only_the_suffix() {
    let dir = fixture_dir("warm", Preset::Tiny);
    for path in [DecodePath::Eager, DecodePath::Compiled] {
        let mut e = engine(&dir, true, 16, 64, Some(path));
        // Turn 1, then turn 2 = turn 1's prompt + its reply + new tokens
        // (the shape of a chat's next turn).
        let p1 = prompt(70, 4);
        let g1 = run(&mut e, &p1, 30);
        let mut p2 = p1.clone();
        p2.extend(&g1.tokens);
        p2.extend(prompt(23, 5));
        let warm = run(&mut e, &p2, 40);
        // Turn 1 ran 70 + 29 fed tokens = 99 positions: 6 full blocks of 16
        // and its end (3 positions in a partial block), kept as a tail.
        assert_eq!(warm.metrics.cached_tokens, 99, "{path:?}");
        assert_eq!(warm.metrics.prefill_tokens, p2.len() - 99);
        assert_eq!(warm.prompt_tokens, p2.len());
        e.clear_prefix_cache();
        let cold = run(&mut e, &p2, 40);
        assert_eq!(cold.metrics.cached_tokens, 0);
        assert_eq!(cold.metrics.prefill_tokens, p2.len());
        assert_eq!(warm.tokens, cold.tokens, "{path:?}: warm turn differs from the cold run");
        // And both equal a flat engine that never caches anything.
        let mut flat = engine(&dir, false, 16, 64, Some(path));
        assert_eq!(run(&mut flat, &p2, 40).tokens, cold.tokens);
        // The same prompt again: everything but the last token is cached.
        let again = run(&mut e, &p2, 40);
        assert_eq!(again.tokens, cold.tokens);
        assert_eq!(again.metrics.cached_tokens, (p2.len() - 1) / 16 * 16);
        // A prompt sharing only the first block reuses just that block.
        let mut p3 = p2[..16].to_vec();
        p3.extend(prompt(40, 9));
        let g3 = run(&mut e, &p3, 8);
        assert_eq!(g3.metrics.cached_tokens, 16);
        assert_eq!(e.cache_stats().unwrap().blocks_in_use, 0, "finished requests hold no blocks");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn moe_warm_turn_equals_cold_run() {
    let dir = fixture_dir("warm-moe", Preset::TinyMoe);
    let mut e = engine(&dir, true, 8, 64, None);
    let p1 = prompt(33, 6);
    let g1 = run(&mut e, &p1, 20);
    let mut p2 = p1.clone();
    p2.extend(&g1.tokens);
    p2.extend(prompt(9, 7));
    let warm = run(&mut e, &p2, 24);
    assert!(warm.metrics.cached_tokens >= 48, "cached {}", warm.metrics.cached_tokens);
    e.clear_prefix_cache();
    let cold = run(&mut e, &p2, 24);
    assert_eq!(warm.tokens, cold.tokens);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn eviction_under_a_tiny_budget_stays_correct() {
    let dir = fixture_dir("evict", Preset::Tiny);
    // 1 MiB holds only a few hundred tokens of this model's K/V: every
    // request below evicts earlier prefixes.
    let mut small = engine(&dir, true, 16, 1, None);
    let mut flat = engine(&dir, false, 16, 64, None);
    let max_blocks = small.cache_stats().unwrap().max_blocks;
    let max_tokens = max_blocks * 16;
    assert!(max_tokens < 4000, "budget too large for the test: {max_tokens} tokens");
    let len = max_tokens / 3;
    for round in 0..2 {
        for seed in 0..5 {
            let p = prompt(len, 20 + seed);
            let a = run(&mut small, &p, 16);
            let b = run(&mut flat, &p, 16);
            assert_eq!(a.tokens, b.tokens, "round {round}, prompt {seed}");
        }
    }
    let s = small.cache_stats().unwrap();
    assert!(s.evictions > 0, "nothing was evicted: {s:?}");
    assert!(s.capacity_blocks <= s.max_blocks);
    assert_eq!(s.blocks_in_use, 0);
    // A prompt larger than the whole budget fails with a clear error and
    // leaves the pool usable.
    let huge = prompt(max_tokens + 64, 3);
    let p = GenerateParams { max_tokens: 4, ignore_eos: true, ..Default::default() };
    let err = small.generate(Prompt::Tokens(huge), p, &mut NoObserver).unwrap_err();
    assert!(err.message.contains("paged KV cache is full"), "{}", err.message);
    assert_eq!(small.cache_stats().unwrap().blocks_in_use, 0, "the failed request kept blocks");
    let p = prompt(len, 40);
    assert_eq!(run(&mut small, &p, 16).tokens, run(&mut flat, &p, 16).tokens);
    std::fs::remove_dir_all(&dir).ok();
}

struct CancelAfter(usize);
impl Observer for CancelAfter {
    fn cancelled(&mut self) -> bool {
        if self.0 == 0 {
            return true;
        }
        self.0 -= 1;
        false
    }
}

#[test]
fn cancelled_requests_return_their_blocks() {
    let dir = fixture_dir("cancel", Preset::Tiny);
    let mut e = engine(&dir, true, 16, 64, None);
    let mut flat = engine(&dir, false, 16, 64, None);
    let p = prompt(90, 11);
    let params = GenerateParams { max_tokens: 50, ignore_eos: true, ..Default::default() };
    // Cancelled during prefill (after 2 of 6 chunks), then during decode.
    for polls in [2, 12] {
        let g = e.generate(Prompt::Tokens(p.clone()), params.clone(), &mut CancelAfter(polls)).unwrap();
        assert_eq!(g.finish_reason.name(), "abort");
        assert_eq!(e.cache_stats().unwrap().blocks_in_use, 0);
    }
    // What a cancelled request published is sound: the next run reuses it
    // and still gives the flat engine's tokens.
    let g = run(&mut e, &p, 30);
    assert!(g.metrics.cached_tokens > 0);
    assert_eq!(g.tokens, run(&mut flat, &p, 30).tokens);
    std::fs::remove_dir_all(&dir).ok();
}

/// Drives the continuous-batching scheduler directly: requests are admitted
/// at different steps, stop at different lengths, and each must produce
/// exactly the tokens it produces alone.
fn batched_equals_sequential(preset: Preset, paged: bool, path: DecodePath, name: &str) {
    use super::{Request, Scheduler};
    use std::sync::{Arc, Mutex};
    let dir = fixture_dir(name, preset);
    let mut e = engine(&dir, paged, 16, 64, Some(path));
    let jobs: Vec<(Vec<u32>, usize, usize)> = vec![
        // (prompt, max tokens, step at which it arrives)
        (prompt(30, 1), 40, 0),
        (prompt(7, 2), 12, 0),
        (prompt(75, 3), 33, 0),
        (prompt(18, 4), 25, 3),
        (prompt(50, 5), 20, 9),
        (prompt(3, 6), 30, 9),
        // Crosses 256 positions inside the batch: every row's buffers grow.
        (prompt(240, 7), 30, 2),
        // Sampled (seeded) while it runs with greedy rows.
        (prompt(20, 8), 24, 1),
    ];
    let sampled = jobs.len() - 1;
    let params = |i: usize, n: usize| {
        let mut p = GenerateParams { max_tokens: n, ignore_eos: true, ..Default::default() };
        if i == sampled {
            p.sampling.temperature = 0.9;
            p.sampling.seed = Some(5);
        }
        p
    };
    let want: Vec<Vec<u32>> = jobs
        .iter()
        .enumerate()
        .map(|(i, (p, n, _))| e.generate(Prompt::Tokens(p.clone()), params(i, *n), &mut NoObserver).unwrap().tokens)
        .collect();
    e.clear_prefix_cache();
    let got: Arc<Mutex<Vec<Option<Vec<u32>>>>> = Arc::new(Mutex::new(vec![None; jobs.len()]));
    let mut s = Scheduler::new();
    let mut max_batch = 0;
    let mut step = 0;
    loop {
        for (i, (p, n, at)) in jobs.iter().enumerate() {
            if *at == step {
                let (p, got, params) = (p.clone(), got.clone(), params(i, *n));
                let req = Request::tokens(p, params, move |r| got.lock().unwrap()[i] = Some(r.unwrap().tokens));
                s.admit(&mut e, req);
            }
        }
        if s.running() == 0 && step > 9 {
            break;
        }
        max_batch = max_batch.max(s.running());
        s.step_active(&mut e);
        step += 1;
    }
    assert!(max_batch >= 4, "{name}: at most {max_batch} requests ran together");
    if path == DecodePath::Compiled {
        assert!(s.stacked_steps > 20, "{name}: the compiled batched step ran {} times", s.stacked_steps);
    } else {
        assert_eq!(s.stacked_steps, 0, "{name}: the eager path took the compiled batched step");
    }
    let got = got.lock().unwrap().clone();
    for (i, w) in want.iter().enumerate() {
        assert_eq!(got[i].as_ref(), Some(w), "{name}: request {i} differs when batched");
    }
    if paged {
        assert_eq!(e.cache_stats().unwrap().blocks_in_use, 0);
        // What the batch handed back to each request's cache (the blocks it
        // filled, the conv states after them, the exact end) serves a
        // continuation: every position the request ran is reused, and the
        // tokens equal a cold run of the same prompt on a flat cache.
        let mut cold = engine(&dir, false, 16, 64, Some(path));
        for (i, (p, n, _)) in jobs.iter().enumerate() {
            let mut cont = p.clone();
            cont.extend(got[i].as_ref().unwrap());
            cont.extend(prompt(5, 50 + i as u32));
            let warm = run(&mut e, &cont, 6);
            assert_eq!(warm.metrics.cached_tokens, p.len() + n - 1, "{name}: request {i}'s continuation reused");
            assert_eq!(warm.tokens, run(&mut cold, &cont, 6).tokens, "{name}: request {i}'s continuation differs");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn batched_decode_gives_each_request_its_own_tokens() {
    for path in [DecodePath::Compiled, DecodePath::Eager] {
        batched_equals_sequential(Preset::Tiny, true, path, &format!("batch-paged-{path:?}"));
        batched_equals_sequential(Preset::Tiny, false, path, &format!("batch-flat-{path:?}"));
        batched_equals_sequential(Preset::TinyMoe, true, path, &format!("batch-moe-{path:?}"));
    }
}

/// A long prompt is prefilled a chunk per scheduler step: a running request
/// keeps producing tokens meanwhile (here it finishes before the long
/// prompt is read), and both give their solo tokens.
#[test]
fn a_long_prefill_does_not_stall_running_requests() {
    use super::{Request, Scheduler};
    use std::sync::{Arc, Mutex};
    let dir = fixture_dir("interleave", Preset::Tiny);
    let mut e = engine(&dir, true, 16, 64, None);
    let (short, long) = (prompt(9, 1), prompt(200, 2));
    let want_short = run(&mut e, &short, 6).tokens;
    let want_long = run(&mut e, &long, 10).tokens;
    e.clear_prefix_cache();
    let got: Arc<Mutex<Vec<(usize, Vec<u32>)>>> = Arc::new(Mutex::new(vec![]));
    let request = |id: usize, p: Vec<u32>, n: usize| {
        let got = got.clone();
        // prefill_chunk 0: the engine's (16 tokens here).
        let params = GenerateParams { max_tokens: n, ignore_eos: true, prefill_chunk: 0, ..Default::default() };
        Request::tokens(p, params, move |r| got.lock().unwrap().push((id, r.unwrap().tokens)))
    };
    let mut s = Scheduler::new();
    assert!(s.admit(&mut e, request(0, short.clone(), 6)));
    s.submit(&mut e, request(1, long.clone(), 10));
    let mut chunks = 0;
    while !s.is_idle() {
        chunks += s.prefill_next(&mut e);
        s.step_active(&mut e);
    }
    assert_eq!(chunks, 200usize.div_ceil(16), "one chunk per step");
    let got = got.lock().unwrap();
    assert_eq!(got[0], (0, want_short), "the short request finished first, with its solo tokens");
    assert_eq!(got[1], (1, want_long));
    std::fs::remove_dir_all(&dir).ok();
}

/// Two requests decoding together when the paged pool has one free block
/// left and both need a new one at the same step: the first gets it and
/// finishes with its solo tokens; only the second fails, with the pool's
/// error, and every block comes back.
#[test]
fn a_full_pool_fails_only_the_request_it_cannot_serve() {
    use super::{Request, Scheduler};
    use std::sync::{Arc, Mutex};
    let dir = fixture_dir("pool-full", Preset::Tiny);
    for path in [DecodePath::Compiled, DecodePath::Eager] {
        let mut e = engine(&dir, true, 16, 1, Some(path));
        let m = e.cache_stats().unwrap().max_blocks;
        // Prompts of whole blocks: both need block k+1 at their first step.
        let (ka, kb) = ((m - 1) / 2, m - 1 - (m - 1) / 2);
        let (pa, pb) = (prompt(16 * ka, 61), prompt(16 * kb, 62));
        let mut roomy = engine(&dir, true, 16, 64, Some(path));
        let want_a = run(&mut roomy, &pa, 12).tokens;
        let got: Arc<Mutex<Vec<(usize, Result<Vec<u32>, String>)>>> = Arc::new(Mutex::new(vec![]));
        let mut s = Scheduler::new();
        for (id, p) in [(0, pa.clone()), (1, pb.clone())] {
            let got = got.clone();
            let params = GenerateParams { max_tokens: 12, ignore_eos: true, ..Default::default() };
            let req = Request::tokens(p, params, move |r| got.lock().unwrap().push((id, r.map(|g| g.tokens).map_err(|e| e.message))));
            assert!(s.admit(&mut e, req), "both prompts fit");
        }
        assert_eq!(e.cache_stats().unwrap().blocks_in_use, m - 1, "{path:?}: one block left after both prefills");
        while s.running() > 0 {
            s.step_active(&mut e);
        }
        let got = got.lock().unwrap();
        assert_eq!(got.len(), 2);
        let b = got.iter().find(|(id, _)| *id == 1).unwrap();
        let err = b.1.as_ref().expect_err("the second request cannot get a block");
        assert!(err.contains("paged KV cache is full"), "{path:?}: {err}");
        let a = got.iter().find(|(id, _)| *id == 0).unwrap();
        assert_eq!(a.1.as_ref().ok(), Some(&want_a), "{path:?}: the first request is untouched by the second's failure");
        assert_eq!(e.cache_stats().unwrap().blocks_in_use, 0, "{path:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The warm-up runs a batched and a single step on throwaway prompts,
/// changes no later result, holds no blocks after, and does nothing while
/// requests are batched (their rows are not disturbed).
#[test]
fn warm_up_builds_the_batched_step_and_changes_nothing() {
    use super::{Request, Scheduler};
    use std::sync::{Arc, Mutex};
    let dir = fixture_dir("warm-up", Preset::Tiny);
    let mut e = engine(&dir, true, 16, 64, None);
    let mut fresh = engine(&dir, true, 16, 64, None);
    let mut s = Scheduler::new();
    let ms = s.warm_up(&mut e).unwrap().expect("nothing was running");
    assert!(ms > 0.0);
    assert!(s.stacked_steps > 0, "the warm-up did not take the batched step");
    assert!(s.is_idle());
    assert_eq!(e.cache_stats().unwrap().blocks_in_use, 0);
    let (pa, pb) = (prompt(40, 71), prompt(25, 72));
    let (want_a, want_b) = (run(&mut fresh, &pa, 20).tokens, run(&mut fresh, &pb, 20).tokens);
    let got: Arc<Mutex<Vec<(usize, Vec<u32>)>>> = Arc::new(Mutex::new(vec![]));
    for (id, p) in [(0, pa.clone()), (1, pb.clone())] {
        let got = got.clone();
        let params = GenerateParams { max_tokens: 20, ignore_eos: true, ..Default::default() };
        let req = Request::tokens(p, params, move |r| got.lock().unwrap().push((id, r.unwrap().tokens)));
        assert!(s.admit(&mut e, req));
    }
    let mut steps = 0;
    while s.running() > 0 {
        s.step_active(&mut e);
        steps += 1;
        if steps == 5 {
            assert_eq!(s.warm_up(&mut e).unwrap(), None, "a warm-up ran over a running batch");
        }
    }
    let mut got = got.lock().unwrap().clone();
    got.sort();
    assert_eq!(got, vec![(0, want_a), (1, want_b)]);
    std::fs::remove_dir_all(&dir).ok();
}

/// Several fresh prompts prefilled as one right-padded batch leave each
/// cache as its own prefill would: the same next token and close logits,
/// the same greedy continuation, and (paged) blocks and conv snapshots that
/// serve a later prompt's prefix exactly.
#[test]
fn prefill_rows_equals_single_prefills() {
    use crate::generate::prefill;
    use crate::mlx::Dtype;
    let dir = fixture_dir("prefill-rows", Preset::Tiny);
    let argmax = |l: &crate::mlx::Array| l.argmax(-1, false).unwrap().astype(Dtype::Uint32).unwrap().reshape(&[1, 1]).unwrap();
    for paged in [true, false] {
        let e = engine(&dir, paged, 16, 64, Some(DecodePath::Eager));
        let single = engine(&dir, paged, 16, 64, Some(DecodePath::Eager));
        let prompts = [prompt(5, 81), prompt(40, 82), prompt(77, 83), prompt(1, 84)];
        let mut rows: Vec<crate::model::ModelCache> = prompts.iter().map(|_| e.model.new_cache()).collect();
        let ids: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
        let mut refs: Vec<&mut crate::model::ModelCache> = rows.iter_mut().collect();
        let lb = e.model.prefill_rows(&ids, &mut refs).unwrap();
        drop(refs);
        for (i, p) in prompts.iter().enumerate() {
            rows[i].note_tokens(p);
            let mut c = single.model.new_cache();
            let ls = prefill(&single.model, &mut c, p, 512).unwrap();
            let lr = lb.slice_axis(0, i as i32, i as i32 + 1).unwrap();
            let diff = lr.sub(&ls).unwrap().abs().unwrap().max(&[0, 1], false).unwrap().item::<f32>().unwrap();
            assert!(diff < 1e-3, "paged {paged}, prompt {i}: logits differ by {diff}");
            let (mut tb, mut ts) = (argmax(&lr), argmax(&ls));
            assert_eq!(rows[i].pos, p.len());
            for step in 0..16 {
                assert_eq!(tb.item::<u32>().unwrap(), ts.item::<u32>().unwrap(), "paged {paged}, prompt {i}, step {step}");
                tb = argmax(&e.model.forward(&tb, &mut rows[i], true).unwrap().reshape(&[1, -1]).unwrap());
                ts = argmax(&single.model.forward(&ts, &mut c, true).unwrap().reshape(&[1, -1]).unwrap());
            }
        }
        drop(rows);
        if paged {
            // The 77-token prompt's four full blocks (and the conv states
            // after them) serve a prompt that starts with it.
            let mut cont = prompts[2].clone();
            cont.extend(prompt(9, 85));
            let mut e = e;
            let mut cold = engine(&dir, false, 16, 64, Some(DecodePath::Eager));
            let warm = run(&mut e, &cont, 8);
            assert_eq!(warm.metrics.cached_tokens, 64);
            assert_eq!(warm.tokens, run(&mut cold, &cont, 8).tokens);
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Arrivals at the same time: the fresh short prompts are prefilled as one
/// batch (as many as fit one chunk of padded tokens), a prompt longer than
/// a chunk and one that continues a cached prefix go alone, and every
/// request gets its solo tokens.
#[test]
fn short_fresh_arrivals_are_prefilled_together() {
    use super::{Request, Scheduler};
    use std::sync::{Arc, Mutex};
    let dir = fixture_dir("prefill-group", Preset::Tiny);
    for path in [DecodePath::Compiled, DecodePath::Eager] {
        let opts = |paged: bool| EngineOptions {
            paged_cache: Some(paged),
            paged_block_size: Some(16),
            decode_path: Some(path),
            prefill_chunk: Some(128),
            ..Default::default()
        };
        let mut e = Engine::load(&dir, &opts(true)).unwrap();
        let mut cold = Engine::load(&dir, &opts(false)).unwrap();
        let base = prompt(40, 90);
        run(&mut e, &base, 4);
        let mut cont = base.clone();
        cont.extend(prompt(6, 91));
        let jobs: Vec<(Vec<u32>, usize)> = vec![
            (prompt(20, 92), 12),
            (cont, 10),            // 32 tokens cached: alone
            (prompt(33, 93), 9),
            (prompt(300, 94), 6),  // longer than a chunk: alone, in chunks
            (prompt(7, 95), 14),
            (prompt(50, 96), 8),   // 4 x 50 padded tokens > 128: next group
            (prompt(1, 97), 5),
        ];
        let want: Vec<Vec<u32>> = jobs.iter().map(|(p, n)| run(&mut cold, p, *n).tokens).collect();
        let got: Arc<Mutex<Vec<Option<Vec<u32>>>>> = Arc::new(Mutex::new(vec![None; jobs.len()]));
        let mut s = Scheduler::new();
        for (i, (p, n)) in jobs.iter().enumerate() {
            let got = got.clone();
            let params = GenerateParams { max_tokens: *n, ignore_eos: true, ..Default::default() };
            s.submit(&mut e, Request::tokens(p.clone(), params, move |r| got.lock().unwrap()[i] = Some(r.unwrap().tokens)));
        }
        assert_eq!(s.prefilling(), jobs.len());
        let mut groups = vec![];
        while !s.is_idle() {
            groups.push(s.prefill_next(&mut e));
            s.step_active(&mut e);
        }
        // 20, 33, 7 and 1 together (4 x 33 = 132 > 128, so 20, 33, 7 first
        // and 1 joins 50 later), the cached one and the long one alone.
        assert_eq!(groups.iter().filter(|&&n| n > 1).count(), 2, "{path:?}: groups {groups:?}");
        assert_eq!(groups.iter().copied().max(), Some(3), "{path:?}: groups {groups:?}");
        let got = got.lock().unwrap();
        for (i, w) in want.iter().enumerate() {
            assert_eq!(got[i].as_ref(), Some(w), "{path:?}: request {i}");
        }
        assert_eq!(e.cache_stats().unwrap().blocks_in_use, 0);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A batched prefill whose last arrival the paged pool cannot hold: the
/// others are prefilled together and finish with their solo tokens; only
/// that one fails, with the pool's error.
#[test]
fn a_full_pool_fails_only_the_arrival_it_cannot_hold() {
    use super::{Request, Scheduler};
    use std::sync::{Arc, Mutex};
    let dir = fixture_dir("prefill-full", Preset::Tiny);
    let opts = |budget: usize| EngineOptions {
        paged_cache: Some(true),
        paged_block_size: Some(16),
        paged_cache_budget_mb: Some(budget),
        prefill_chunk: Some(8192),
        ..Default::default()
    };
    let mut e = Engine::load(&dir, &opts(1)).unwrap();
    let mut roomy = Engine::load(&dir, &opts(64)).unwrap();
    let m = e.cache_stats().unwrap().max_blocks;
    // Two prompts leave one block free; the third needs three.
    let (ka, kb) = ((m - 1) / 2, m - 1 - (m - 1) / 2);
    let prompts = [prompt(16 * ka - 3, 101), prompt(16 * kb - 3, 102), prompt(48, 103)];
    let want: Vec<Vec<u32>> = prompts[..2].iter().map(|p| run(&mut roomy, p, 2).tokens).collect();
    let got: Arc<Mutex<Vec<Option<Result<Vec<u32>, String>>>>> = Arc::new(Mutex::new(vec![None, None, None]));
    let mut s = Scheduler::new();
    for (i, p) in prompts.iter().enumerate() {
        let got = got.clone();
        let params = GenerateParams { max_tokens: 2, ignore_eos: true, ..Default::default() };
        s.submit(&mut e, Request::tokens(p.clone(), params, move |r| got.lock().unwrap()[i] = Some(r.map(|g| g.tokens).map_err(|e| e.message))));
    }
    assert_eq!(s.prefill_next(&mut e), 3, "the three arrivals are one prefill group");
    assert_eq!(s.running(), 2);
    assert_eq!(s.prefilling(), 0);
    while s.running() > 0 {
        s.step_active(&mut e);
    }
    let got = got.lock().unwrap();
    for i in 0..2 {
        assert_eq!(got[i].as_ref().unwrap().as_ref().ok(), Some(&want[i]), "request {i}");
    }
    let err = got[2].as_ref().unwrap().as_ref().expect_err("the third cannot be held");
    assert!(err.contains("paged KV cache is full"), "{err}");
    assert_eq!(e.cache_stats().unwrap().blocks_in_use, 0);
    std::fs::remove_dir_all(&dir).ok();
}

/// Weights that make the logits NaN: every request fails naming the step
/// (alone, eager or compiled, and in a batch) instead of streaming whatever
/// argmax makes of NaN; the engine keeps serving after.
#[test]
fn non_finite_logits_are_an_error_naming_the_step() {
    use super::{Request, Scheduler};
    use crate::mlx::{load_safetensors, save_safetensors};
    use std::sync::{Arc, Mutex};
    let dir = fixture_dir("nan-logits", Preset::Tiny);
    let file = dir.join("model.safetensors");
    let (arrays, _) = load_safetensors(&file).unwrap();
    let arrays: Vec<(String, crate::mlx::Array)> = arrays
        .into_iter()
        .map(|(n, a)| if n == "model.embedding_norm.weight" { let b = a.mul_scalar(f64::NAN).unwrap(); (n, b) } else { (n, a) })
        .collect();
    save_safetensors(&file, &arrays, &[]).unwrap();
    for path in [DecodePath::Compiled, DecodePath::Eager] {
        let mut e = engine(&dir, true, 16, 64, Some(path));
        let params = GenerateParams { max_tokens: 8, ignore_eos: true, ..Default::default() };
        let err = e.generate(Prompt::Tokens(prompt(10, 1)), params.clone(), &mut NoObserver).unwrap_err();
        assert!(err.message.contains("non-finite logits (NaN or infinity) at generation step 1"), "{path:?}: {err}");
        let got: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(vec![]));
        let mut s = Scheduler::new();
        for i in 0..3 {
            let got = got.clone();
            let req = Request::tokens(prompt(12, 10 + i), params.clone(), move |r| {
                got.lock().unwrap().push(r.map(|_| "finished".to_string()).unwrap_or_else(|e| e.message))
            });
            s.submit(&mut e, req);
        }
        while !s.is_idle() {
            s.step(&mut e);
        }
        let got = got.lock().unwrap();
        assert_eq!(got.len(), 3);
        for m in got.iter() {
            assert!(m.contains("non-finite logits"), "{path:?}: {m}");
        }
        assert_eq!(e.cache_stats().unwrap().blocks_in_use, 0, "{path:?}: the failed requests gave their blocks back");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A request that does not fit the context (config.json's, or a lower
/// `contextLength`) fails before any compute, naming both lengths.
#[test]
fn a_request_beyond_the_context_length_fails_before_any_compute() {
    let dir = fixture_dir("context", Preset::Tiny);
    let mut e = Engine::load(&dir, &EngineOptions { context_length: Some(40), ..Default::default() }).unwrap();
    assert_eq!(e.info().context_length, 40);
    let p = |n: usize| GenerateParams { max_tokens: n, ignore_eos: true, ..Default::default() };
    let err = e.generate(Prompt::Tokens(prompt(36, 1)), p(8), &mut NoObserver).unwrap_err();
    assert!(
        err.message.contains("the prompt has 36 tokens and asks for up to 8 more, beyond the model's context length of 40"),
        "{err}"
    );
    assert_eq!(e.cache_stats().unwrap().blocks_in_use, 0);
    assert_eq!(e.generate(Prompt::Tokens(prompt(32, 1)), p(8), &mut NoObserver).unwrap().tokens.len(), 8);
    let max = e.model.config.max_position_embeddings;
    for bad in [0, max + 1] {
        let err = Engine::load(&dir, &EngineOptions { context_length: Some(bad), ..Default::default() }).err().unwrap();
        assert!(err.message.contains(&format!("contextLength {bad} is out of range")), "{err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A request's prompt is rendered off the worker (the model's render
/// thread), so a slow render (a hostile template or a huge request) does not
/// stall the requests already running: one that is decoding finishes while
/// the next one's render still sleeps. Before, the render ran on the worker
/// in the request's turn and held every running request for its length.
#[test]
fn a_slow_render_does_not_stall_running_requests() {
    use super::worker::ModelWorker;
    use super::Request;
    use std::sync::mpsc::channel;
    use std::time::{Duration, Instant};
    let dir = fixture_dir("render", Preset::Tiny);
    let (ltx, lrx) = channel();
    ModelWorker::spawn(dir.clone(), EngineOptions::default(), move |r| {
        ltx.send(r.map(|(w, _, _)| w)).ok();
    });
    let worker = lrx.recv().unwrap().unwrap();
    let (dtx, drx) = channel::<(&str, Instant, bool)>();
    let params = GenerateParams { max_tokens: 48, ignore_eos: true, ..Default::default() };
    let a = dtx.clone();
    worker.generate(Request::tokens(prompt(12, 1), params.clone(), move |r| {
        a.send(("running", Instant::now(), r.is_ok())).ok();
    }));
    let render_end = std::sync::Arc::new(parking_lot::Mutex::new(None::<Instant>));
    let end = render_end.clone();
    let slow_prompt = prompt(12, 2);
    let b = dtx.clone();
    worker.generate(Request {
        prepare: None,
        render: Some(Box::new(move || {
            std::thread::sleep(Duration::from_millis(1500));
            *end.lock() = Some(Instant::now());
            Ok((slow_prompt, params))
        })),
        observer: Box::new(NoObserver),
        resume: None,
        reply: Some(Box::new(move |r| {
            b.send(("rendered", Instant::now(), r.is_ok())).ok();
        })),
    });
    let first = drx.recv_timeout(Duration::from_secs(60)).unwrap();
    let second = drx.recv_timeout(Duration::from_secs(60)).unwrap();
    assert_eq!((first.0, first.2), ("running", true), "the running request finishes first");
    assert_eq!((second.0, second.2), ("rendered", true));
    let rendered_at = render_end.lock().expect("the render ran");
    assert!(first.1 < rendered_at, "the running request waited for another request's render");
    worker.close();
    std::fs::remove_dir_all(&dir).ok();
}

/// A JSON schema on the random-weight fixture at temperature 1: alone
/// (Engine::generate) and batched with unconstrained requests (the
/// scheduler's compiled stacked step), the output parses and fits the
/// schema, and the same seed gives the same text on both paths.
#[test]
fn json_schema_constrains_alone_and_batched() {
    use super::{Request, Scheduler};
    use crate::generate::constraint::Grammar;
    use std::sync::{Arc, Mutex};
    let dir = fixture_dir("constrained", Preset::Tiny);
    let mut e = engine(&dir, true, 16, 64, Some(DecodePath::Compiled));
    let schema = serde_json::json!({
        "type": "object",
        "properties": { "k": { "enum": ["a", "bb"] }, "n": { "type": "integer", "minimum": 0, "maximum": 50 } },
        "required": ["k", "n"],
        "additionalProperties": false
    });
    let params = |seed: u64, grammar: bool| {
        let mut p = GenerateParams { max_tokens: 64, ..Default::default() };
        p.sampling.temperature = 1.0;
        p.sampling.seed = Some(seed);
        p.grammar = grammar.then(|| Grammar::JsonSchema(schema.clone()));
        p
    };
    let check = |text: &str| {
        let v: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|err| panic!("{text:?}: {err}"));
        assert!(v["k"] == "a" || v["k"] == "bb", "{v}");
        assert!(v["n"].as_i64().is_some_and(|n| (0..=50).contains(&n)), "{v}");
        assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
    };
    let alone: Vec<String> = (0..3)
        .map(|seed| {
            let g = e.generate(Prompt::Tokens(prompt(9, seed as u32)), params(seed, true), &mut NoObserver).unwrap();
            assert_eq!(g.finish_reason, crate::generate::FinishReason::Stop);
            check(&g.text);
            g.text
        })
        .collect();
    e.clear_prefix_cache();
    let got: Arc<Mutex<Vec<Option<String>>>> = Arc::new(Mutex::new(vec![None; 5]));
    let mut s = Scheduler::new();
    for i in 0..5usize {
        // Three constrained rows and two free ones in one batch.
        let (constrained, seed) = (i < 3, i as u64);
        let got = got.clone();
        let req = Request::tokens(prompt(9, seed as u32), params(seed, constrained), move |r| {
            got.lock().unwrap()[i] = Some(r.unwrap().text)
        });
        s.admit(&mut e, req);
    }
    while s.running() > 0 {
        s.step_active(&mut e);
    }
    assert!(s.stacked_steps > 0);
    let got = got.lock().unwrap().clone();
    for i in 0..3 {
        assert_eq!(got[i].as_deref(), Some(alone[i].as_str()), "row {i} differs when batched");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Constrained rows of one batch do their parser work on several threads
/// at once (`generate::prepare_constrained`): seeded at temperature 1, rows
/// under a JSON schema, regexes (one that completes, one that never does),
/// a Lark grammar, a required tool call, 'auto' tools that open calls (the
/// start marker biased up, so the watch hands over to the call's grammar
/// and back inside the batch) and free rows, arriving at different steps
/// with different lengths, each give the tokens and finish reason they
/// give alone, on the compiled batched step and the eager one.
#[test]
fn batched_constrained_rows_equal_each_row_alone() {
    use super::{Request, Scheduler};
    use crate::generate::constraint::Grammar;
    use crate::generate::FinishReason;
    use serde_json::json;
    use std::sync::{Arc, Mutex};
    let dir = fixture_dir("constrained-rows", Preset::Tiny);
    let tools = vec![(
        "f".to_string(),
        json!({ "type": "object", "properties": { "x": { "enum": [1, 22, 333] } }, "required": ["x"], "additionalProperties": false }),
    )];
    let schema = json!({
        "type": "object",
        "properties": { "k": { "enum": ["a", "bb"] }, "s": { "type": "string", "maxLength": 12 } },
        "required": ["k", "s"],
        "additionalProperties": false
    });
    // (grammar, max tokens, step at which it arrives)
    let rows: Vec<(Option<Grammar>, usize, usize)> = vec![
        (Some(Grammar::JsonSchema(schema.clone())), 48, 0),
        (Some(Grammar::Regex("[a-z]{1,6}( [a-z]{1,6}){0,3}".into())), 40, 0),
        (None, 30, 0),
        (Some(Grammar::Regex("([a-z]+ )+".into())), 36, 1),
        (Some(Grammar::Lark(r#"start: "n=" /[0-9]{1,4}/ ("," /[0-9]{1,4}/)* ";""#.into())), 44, 0),
        (Some(Grammar::ToolCalls { tools: tools.clone(), single: true }), 48, 2),
        (Some(Grammar::ToolCallsAuto { tools }), 60, 0),
        (Some(Grammar::JsonSchema(schema)), 20, 3),
        (None, 25, 5),
    ];
    let auto = 6;
    for path in [DecodePath::Compiled, DecodePath::Eager] {
        let mut e = engine(&dir, true, 16, 64, Some(path));
        let id = |t: &str| e.tokenizer.token_to_id(t).unwrap_or_else(|| panic!("the fixture has no {t} token"));
        let (start, end, close) = (id("<|tool_call_start|>"), id("<|tool_call_end|>"), id("]"));
        let params = |i: usize| {
            let (g, n, _) = &rows[i];
            let mut p = GenerateParams { max_tokens: *n, grammar: g.clone(), ..Default::default() };
            p.sampling.temperature = 1.0;
            p.sampling.seed = Some(100 + i as u64);
            if i == auto {
                // Calls open at once, and close (one call each) as soon as the grammar lets them.
                p.sampling.logit_bias = vec![(start, 30.0), (end, 30.0), (close, 15.0)];
            }
            p
        };
        let alone: Vec<Generation> = (0..rows.len())
            .map(|i| e.generate(Prompt::Tokens(prompt(9 + i, i as u32)), params(i), &mut NoObserver).unwrap())
            .collect();
        // The rows really are varied: some grammars complete, some run to
        // maxTokens, and the 'auto' row opened (and closed) tool calls.
        let reasons: Vec<FinishReason> = alone.iter().map(|g| g.finish_reason).collect();
        assert!(reasons.contains(&FinishReason::Stop) && reasons.contains(&FinishReason::Length), "{reasons:?}");
        let opened = alone[auto].tokens.iter().filter(|&&t| t == start).count();
        assert!(opened >= 3, "the 'auto' row opened {opened} tool calls: {:?}", alone[auto].text);
        e.clear_prefix_cache();
        let got: Arc<Mutex<Vec<Option<Generation>>>> = Arc::new(Mutex::new(vec![None; rows.len()]));
        let mut s = Scheduler::new();
        let mut step = 0;
        while step < 6 || s.running() > 0 {
            for (i, (_, _, at)) in rows.iter().enumerate() {
                if *at == step {
                    let got = got.clone();
                    let req = Request::tokens(prompt(9 + i, i as u32), params(i), move |r| got.lock().unwrap()[i] = Some(r.unwrap()));
                    s.admit(&mut e, req);
                }
            }
            s.step_active(&mut e);
            step += 1;
        }
        assert!(s.prepared_steps > 10, "{path:?}: the rows were prepared together in {} steps", s.prepared_steps);
        if path == DecodePath::Compiled {
            assert!(s.stacked_steps > 10, "the compiled batched step ran {} times", s.stacked_steps);
        }
        let got = got.lock().unwrap().clone();
        for (i, want) in alone.iter().enumerate() {
            let g = got[i].as_ref().unwrap_or_else(|| panic!("{path:?}: row {i} got no result"));
            assert_eq!(g.tokens, want.tokens, "{path:?}: row {i} differs when batched");
            assert_eq!(g.finish_reason, want.finish_reason, "{path:?}: row {i}'s finish reason differs when batched");
        }
    }
}

/// Serves `p` through a model worker while another request decodes, and
/// returns its generation and the disk tier's counters after it.
fn serve_beside_another(dir: &PathBuf, opts: &EngineOptions, p: &[u32], params: &GenerateParams) -> (Generation, crate::cache::paged::disk::DiskStats) {
    use super::worker::ModelWorker;
    use super::Request;
    use std::sync::mpsc::channel;
    use std::time::Duration;
    let (ltx, lrx) = channel();
    ModelWorker::spawn(dir.clone(), opts.clone(), move |r| {
        ltx.send(r.map(|(w, _, _)| w)).ok();
    });
    let worker = lrx.recv().unwrap().unwrap();
    let (btx, brx) = channel();
    let long = GenerateParams { max_tokens: 64, ignore_eos: true, ..Default::default() };
    worker.generate(Request::tokens(prompt(12, 1), long, move |r| {
        btx.send(r.map(|g| g.tokens.len())).ok();
    }));
    let (gtx, grx) = channel();
    worker.generate(Request::tokens(p.to_vec(), params.clone(), move |r| {
        gtx.send(r).ok();
    }));
    let g = grx.recv_timeout(Duration::from_secs(120)).unwrap().unwrap();
    assert_eq!(brx.recv_timeout(Duration::from_secs(120)).unwrap().unwrap(), 64);
    let (stx, srx) = channel();
    worker.run(|e| Ok(e.cache_stats()), move |r| {
        stx.send(r).ok();
    });
    let stats = srx.recv_timeout(Duration::from_secs(60)).unwrap().unwrap().unwrap().disk.unwrap();
    worker.close();
    (g, stats)
}

/// With a prefix cache on disk, the model's render thread starts reading a
/// request's prefix blocks as soon as its prompt is known (off the worker,
/// which only makes arrays of them): served beside a running request, every
/// disk hit is a block read ahead, each file is read once, and the tokens
/// are a cold run's. With every file damaged, the reader finds the first
/// one unusable (one damaged file: the chain stops there) and the request
/// is recomputed to the same tokens.
#[test]
fn prefix_blocks_read_ahead_off_the_worker_give_cold_run_tokens() {
    let dir = fixture_dir("ahead", Preset::Tiny);
    let cache = dir.join("prefix-cache");
    let opts = EngineOptions { paged_block_size: Some(8), prefix_cache_dir: Some(cache.clone()), ..Default::default() };
    let p = prompt(70, 3);
    let params = GenerateParams { max_tokens: 12, ignore_eos: true, ..Default::default() };
    let cold = {
        let mut e = Engine::load(&dir, &opts).unwrap();
        let g = e.generate(Prompt::Tokens(p.clone()), params.clone(), &mut NoObserver).unwrap();
        e.persist_prefix_cache();
        g
    };
    assert_eq!(cold.metrics.cached_tokens, 0);
    // A copy of the directory with every file damaged.
    let damaged = dir.join("prefix-cache-damaged");
    std::fs::create_dir_all(&damaged).unwrap();
    for f in std::fs::read_dir(&cache).unwrap() {
        let f = f.unwrap().path();
        let mut bytes = std::fs::read(&f).unwrap();
        let n = bytes.len();
        bytes[n - 3] ^= 0xff;
        std::fs::write(damaged.join(f.file_name().unwrap()), bytes).unwrap();
    }

    let (warm, s) = serve_beside_another(&dir, &opts, &p, &params);
    assert_eq!(warm.tokens, cold.tokens);
    // 70 tokens in blocks of 8: 8 full blocks leave a token to run.
    assert_eq!(warm.metrics.cached_tokens, 64);
    assert_eq!((s.hits, s.prefetched, s.reads, s.damaged), (8, 8, 8, 0), "{s:?}");

    let opts = EngineOptions { prefix_cache_dir: Some(damaged), ..opts };
    let (again, s) = serve_beside_another(&dir, &opts, &p, &params);
    assert_eq!(again.tokens, cold.tokens);
    assert_eq!(again.metrics.cached_tokens, 0);
    assert_eq!((s.hits, s.prefetched, s.reads, s.damaged), (0, 0, 1, 1), "{s:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Cancels once the first token has been heard (its log-probabilities come
/// before its text, and always, whatever the text).
struct StopAtFirstToken(bool);
impl Observer for StopAtFirstToken {
    fn on_logprob(&mut self, _entry: &crate::generate::TokenLogprob) {
        self.0 = true;
    }
    fn cancelled(&mut self) -> bool {
        self.0
    }
}

/// The first token reaches the caller before the host builds the step after
/// it (that build was counted in the time to the first token): a request
/// stopped at its first token leaves the cache at the prompt's end, no step
/// queued for a token nobody wants; on both decode paths.
#[test]
fn the_first_token_is_delivered_before_the_next_step_is_queued() {
    let dir = fixture_dir("first-token", Preset::Tiny);
    for path in [DecodePath::Eager, DecodePath::Compiled] {
        let mut e = engine(&dir, false, 16, 64, Some(path));
        let p = prompt(12, 5);
        let mut asked = GenerateParams { max_tokens: 20, ignore_eos: true, ..Default::default() };
        asked.sampling.logprobs = true;
        let params = e.params(asked.clone());
        let mut cache = e.model.new_cache();
        let mut stepper = crate::generate::Stepper::new(&e.model, e.compiled.as_ref());
        let mut obs = StopAtFirstToken(false);
        let started = std::time::Instant::now();
        let g = crate::generate::generate_with_cache(&mut stepper, None, &mut cache, &e.tokenizer, &e.eos, &p, &params, &mut obs, started)
            .unwrap();
        assert_eq!((g.finish_reason.name(), g.tokens.len()), ("abort", 1), "{path:?}");
        assert_eq!(cache.pos, p.len(), "{path:?}: a step ran after the first token");
        // Not stopped, the same request runs on from there as before.
        let full = e.generate(Prompt::Tokens(p.clone()), asked, &mut NoObserver).unwrap().tokens;
        assert_eq!(full[0], g.tokens[0], "{path:?}");
        assert_eq!(full.len(), 20, "{path:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Engines of one process built under different switches (`mlx-lfm-bench
/// --ab`): each keeps what it was built with, the override does not leak
/// to the thread after it, and the tokens are the same.
#[test]
fn engines_built_under_overrides_keep_their_own_switches() {
    let dir = fixture_dir("knobs", Preset::Tiny);
    let ops = |e: &Engine| -> usize {
        crate::generate::decode_step_ops(&e.model, e.compiled.as_ref(), &prompt(8, 1)).unwrap().iter().map(|(_, n)| n).sum()
    };
    let mut plain = engine(&dir, false, 16, 64, Some(DecodePath::Compiled));
    let apart = vec![("MLX_LFM_FUSE_PROJECTIONS".to_string(), Some("0".to_string()))];
    let mut split = crate::knobs::with_overrides(&apart, || engine(&dir, false, 16, 64, Some(DecodePath::Compiled)));
    let (a, b) = (ops(&plain), ops(&split));
    assert!(b > a, "projections kept apart must add nodes to the step: {b} vs {a}");
    let again = engine(&dir, false, 16, 64, Some(DecodePath::Compiled));
    assert_eq!(ops(&again), a, "the override leaked past its scope");
    let p = prompt(20, 4);
    assert_eq!(run(&mut plain, &p, 24).tokens, run(&mut split, &p, 24).tokens);
    std::fs::remove_dir_all(&dir).ok();
}

/// `prompts` submitted to one scheduler, `max_tokens` each past EOS,
/// stepped (stacked where it can) until idle: each request's tokens, in
/// the prompts' order.
fn scheduled_tokens(e: &mut Engine, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    use super::{Request, Scheduler};
    use std::sync::{Arc, Mutex};
    type Done = Arc<Mutex<Vec<(usize, Vec<u32>)>>>;
    let got: Done = Arc::new(Mutex::new(vec![]));
    let mut s = Scheduler::new();
    for (i, p) in prompts.iter().enumerate() {
        let got = got.clone();
        let params = GenerateParams { max_tokens, ignore_eos: true, ..Default::default() };
        s.submit(e, Request::tokens(p.clone(), params, move |r| got.lock().unwrap().push((i, r.unwrap().tokens))));
    }
    while !s.is_idle() {
        s.prefill_next(e);
        s.step_active(e);
    }
    let mut got = std::mem::take(&mut *got.lock().unwrap());
    got.sort();
    got.into_iter().map(|(_, t)| t).collect()
}

/// `MLX_LFM_SYNC_STEPS=1` (a measurement switch: each decode step waited
/// for right after its dispatch) gives the same tokens and counts that
/// wait, which the pipelined loop does not.
#[test]
fn synchronous_steps_give_the_same_tokens_and_count_their_wait() {
    let dir = fixture_dir("sync-steps", Preset::Tiny);
    let mut e = engine(&dir, false, 16, 64, Some(DecodePath::Compiled));
    let p = prompt(20, 5);
    crate::generate::timing::take();
    let want = run(&mut e, &p, 24).tokens;
    let plain = crate::generate::timing::take();
    let sync = vec![("MLX_LFM_SYNC_STEPS".to_string(), Some("1".to_string()))];
    let got = crate::knobs::with_overrides(&sync, || run(&mut e, &p, 24)).tokens;
    let synced = crate::generate::timing::take();
    assert_eq!(got, want, "waiting on each step changed the tokens");
    assert!(synced.sync_ns > 0, "no step was waited for after its dispatch: {synced:?}");
    if std::env::var_os("MLX_LFM_SYNC_STEPS").is_none() {
        // (Only this thread's override turns it on: no other test's steps count.)
        assert_eq!(plain.sync_ns, 0, "the pipelined loop waited after a dispatch: {plain:?}");
    }
    // And the scheduler's stacked batch step: the same tokens per request,
    // its phases counted, its sync only under the switch.
    let prompts = [prompt(9, 1), prompt(14, 2), prompt(11, 3)];
    let batched = |e: &mut Engine| scheduled_tokens(e, &prompts, 12);
    crate::generate::timing::take_batch();
    let want = batched(&mut e);
    let plain = crate::generate::timing::take_batch();
    let got = crate::knobs::with_overrides(&sync, || batched(&mut e));
    let synced = crate::generate::timing::take_batch();
    assert_eq!(got, want, "waiting on each batch step changed the tokens");
    assert!(plain.stacked > 0 && plain.steps >= plain.stacked && plain.build_ns > 0, "{plain:?}");
    assert!(synced.stacked > 0 && synced.sync_ns > 0, "no batch step was waited for after its dispatch: {synced:?}");
    if std::env::var_os("MLX_LFM_SYNC_STEPS").is_none() {
        assert_eq!(plain.sync_ns, 0, "{plain:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `MLX_LFM_COUNT_STEP_NODES=1` (a measurement switch: each decode step's
/// dispatched graph walked and its nodes counted) gives the same tokens,
/// counts every step of the loop it is on for and only those, and a
/// stacked step of three rows hands MLX more nodes than a one-row step.
#[test]
fn counted_steps_give_the_same_tokens_and_their_nodes() {
    // (Not `take_batch`: the sync test beside it reads and resets those
    // counters; the node counts are this test's and the bench's alone.)
    use crate::generate::timing::{take_batch_nodes, take_single_nodes};
    if std::env::var_os("MLX_LFM_COUNT_STEP_NODES").is_some() {
        // (Set for the process, every test's steps would count into the
        // same counters, and this test's bounds would not hold.)
        eprintln!("counted_steps_give_the_same_tokens_and_their_nodes: skipped, MLX_LFM_COUNT_STEP_NODES is set for the process");
        return;
    }
    let dir = fixture_dir("count-nodes", Preset::Tiny);
    let mut e = engine(&dir, false, 16, 64, Some(DecodePath::Compiled));
    let count = vec![("MLX_LFM_COUNT_STEP_NODES".to_string(), Some("1".to_string()))];
    let p = prompt(20, 6);
    take_single_nodes();
    let want = run(&mut e, &p, 24).tokens;
    let plain = take_single_nodes();
    let got = crate::knobs::with_overrides(&count, || run(&mut e, &p, 24)).tokens;
    let single = take_single_nodes();
    assert_eq!(got, want, "counting the nodes changed the tokens");
    // (Only this thread's override turns it on: no other test's steps count.)
    assert_eq!(plain.steps, 0, "{plain:?}");
    // A step a token after the first (the prefill's draw), each with a graph.
    assert!(single.steps >= 20 && single.min > 0 && single.max >= single.min, "{single:?}");
    let prompts = [prompt(9, 1), prompt(14, 2), prompt(11, 3)];
    let batched = |e: &mut Engine| scheduled_tokens(e, &prompts, 12);
    take_batch_nodes();
    let want = batched(&mut e);
    let plain = take_batch_nodes();
    let got = crate::knobs::with_overrides(&count, || batched(&mut e));
    let nodes = take_batch_nodes();
    assert_eq!(got, want, "counting the nodes changed a request's tokens");
    assert_eq!(plain.steps, 0, "{plain:?}");
    // (Three requests of 12 tokens, the first of each from its prefill: at
    // most 11 stacked steps a row.)
    assert!(nodes.steps > 0 && nodes.steps <= 33, "{nodes:?}");
    // Three rows' step: more nodes than one row's (each row's token and
    // finiteness flag are their own slices), however the layers serve.
    assert!(nodes.min > single.min, "{nodes:?} against one row's {single:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `MLX_LFM_DECODE_ROWS=1` (a decode step's residual stream as `[B, D]`
/// rows): the same tokens as `[B, 1, D]`, dense and MoE (bf16 and 4-bit),
/// flat and paged, alone and batched, with the Flatten/Unflatten pairs
/// MLX's matmul puts around a 3-D input gone from the dense steps.
#[test]
fn decode_rows_give_the_same_tokens_with_fewer_nodes() {
    let set = |rows: &str| {
        vec![
            ("MLX_LFM_DECODE_ROWS".to_string(), Some(rows.to_string())),
            // The one-batch matmul takes the same views away: off in both.
            ("MLX_LFM_BATCH1_MATMUL".to_string(), Some("0".to_string())),
        ]
    };
    let (rows, off) = (set("1"), set("0"));
    let ops = |e: &Engine| -> Vec<(String, usize)> {
        crate::generate::decode_step_ops(&e.model, e.compiled.as_ref(), &prompt(8, 1)).unwrap()
    };
    let count = |ops: &[(String, usize)], name: &str| ops.iter().filter(|(k, _)| k == name).map(|(_, n)| n).sum::<usize>();
    let total = |ops: &[(String, usize)]| ops.iter().map(|(_, n)| n).sum::<usize>();
    for (preset, q4) in [(Preset::Tiny, false), (Preset::TinyMoe, false), (Preset::TinyMoe, true)] {
        let mut dir = fixture_dir(&format!("rows-{preset:?}-{q4}"), preset);
        if q4 {
            // The 8B-A1B's kind: 4-bit projections, embedding and experts.
            use crate::convert::{convert, ConvertRecipe};
            let q = dir.with_extension("q4");
            std::fs::remove_dir_all(&q).ok();
            let recipe = ConvertRecipe::quantized(crate::mlx::QuantMode::Affine, Some(4), Some(32)).unwrap();
            convert(&dir, &q, &recipe).unwrap();
            std::fs::remove_dir_all(&dir).ok();
            dir = q;
        }
        for paged in [false, true] {
            let what = format!("{preset:?} (4-bit: {q4}), paged {paged}");
            let p = prompt(21, 3);
            // (Both off for the reference: on CUDA they are the defaults.)
            let (plain_ops, want) = crate::knobs::with_overrides(&off, || {
                let mut plain = engine(&dir, paged, 16, 64, Some(DecodePath::Compiled));
                (ops(&plain), run(&mut plain, &p, 40).tokens)
            });
            let (rows_ops, got) = crate::knobs::with_overrides(&rows, || {
                let mut e = engine(&dir, paged, 16, 64, Some(DecodePath::Compiled));
                (ops(&e), run(&mut e, &p, 40).tokens)
            });
            assert_eq!(got, want, "{what}: decode rows changed the tokens");
            let (pf, rf) = (count(&plain_ops, "Flatten") + count(&plain_ops, "Unflatten"), count(&rows_ops, "Flatten") + count(&rows_ops, "Unflatten"));
            // Quantized products take 3-D inputs without folding them, and on
            // this CPU the stock conv and experts put a time axis back
            // (+2 nodes a layer; on CUDA the kernels take the rows as they
            // are): only the tokens are checked there.
            if !q4 {
                assert!(pf >= 8 && rf * 3 <= pf, "{what}: Flatten/Unflatten {rf} with rows against {pf}");
                assert!(total(&rows_ops) < total(&plain_ops), "{what}: {} nodes with rows against {}", total(&rows_ops), total(&plain_ops));
            }
            eprintln!("{what}: step nodes {} -> {} (Flatten/Unflatten {pf} -> {rf})", total(&plain_ops), total(&rows_ops));
        }
        std::fs::remove_dir_all(&dir).ok();
    }
    crate::knobs::with_overrides(&rows, || {
        batched_equals_sequential(Preset::Tiny, true, DecodePath::Compiled, "batch-rows-paged");
        batched_equals_sequential(Preset::TinyMoe, false, DecodePath::Compiled, "batch-rows-moe");
    });
}

/// The compiled prefill (`MLX_LFM_COMPILED_PREFILL`) through the engine:
/// `generate` and a request the scheduler admits take it for a fresh prompt
/// and give the tokens the eager prefill gives, on flat and paged caches;
/// a paged request's next turn reuses every position of the first (the
/// blocks and conv states the compiled pass wrote) and equals a cold run.
#[test]
fn compiled_prefill_gives_the_eager_tokens_through_the_engine() {
    use super::{Request, Scheduler};
    use std::sync::{Arc, Mutex};
    let dir = fixture_dir("compiled-prefill", Preset::Tiny);
    for paged in [false, true] {
        let opts = EngineOptions {
            paged_cache: Some(paged),
            paged_block_size: Some(16),
            decode_path: Some(DecodePath::Compiled),
            prefill_chunk: Some(512),
            ..Default::default()
        };
        let mut plain = Engine::load(&dir, &opts).unwrap();
        let on = [("MLX_LFM_COMPILED_PREFILL".to_string(), Some("64".to_string()))];
        let mut fast = crate::knobs::with_overrides(&on, || Engine::load(&dir, &opts)).unwrap();
        let runs = |e: &Engine| e.compiled.as_ref().and_then(|c| c.fresh.as_ref()).map(|f| f.runs()).expect("switched on");
        assert!(plain.compiled.as_ref().is_some_and(|c| c.fresh.is_none()), "off unless asked");
        for (len, seed) in [(5, 1), (23, 2), (40, 3)] {
            let what = format!("paged {paged}, prompt of {len}");
            let p = prompt(len, seed);
            let before = runs(&fast);
            let want = run(&mut plain, &p, 24);
            let got = run(&mut fast, &p, 24);
            assert_eq!(runs(&fast), before + 1, "{what}: generate took the compiled prefill");
            assert_eq!(got.tokens, want.tokens, "{what}: generate");
            if paged {
                let mut cont = p.clone();
                cont.extend(&got.tokens);
                cont.extend(prompt(5, 50 + seed));
                let warm = run(&mut fast, &cont, 6);
                assert_eq!(warm.metrics.cached_tokens, len + 24 - 1, "{what}: the next turn reused");
                plain.clear_prefix_cache();
                assert_eq!(warm.tokens, run(&mut plain, &cont, 6).tokens, "{what}: the next turn");
                fast.clear_prefix_cache();
            }
            // The same prompt admitted by the scheduler (the server's path).
            let before = runs(&fast);
            let out: Arc<Mutex<Option<Vec<u32>>>> = Arc::new(Mutex::new(None));
            let o = out.clone();
            let params = GenerateParams { max_tokens: 24, ignore_eos: true, ..Default::default() };
            let mut s = Scheduler::new();
            s.admit(&mut fast, Request::tokens(p.clone(), params, move |r| *o.lock().unwrap() = Some(r.unwrap().tokens)));
            while s.running() > 0 {
                s.step_active(&mut fast);
            }
            assert_eq!(runs(&fast), before + 1, "{what}: the scheduler took the compiled prefill");
            assert_eq!(out.lock().unwrap().as_ref(), Some(&want.tokens), "{what}: the scheduler");
            fast.clear_prefix_cache();
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
