//! Tensor parallelism against one process, with real ranks: this test
//! binary starts itself again once per rank (the ignored `tp_rank` test,
//! told what to do through the environment), the ranks form an MLX `ring`
//! group over loopback (MLX_HOSTFILE, MLX_RANK) and write what they
//! computed to a file; the parent computes the same in one process and
//! compares.

use super::{DecodePath, Engine, EngineOptions, Prompt, Request, Scheduler};
use crate::fixture::{self, FixtureSpec, Preset};
use crate::generate::{self, GenerateParams, Observer};
use crate::mlx::distributed::Group;
use crate::mlx::{Array, Dtype};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const JOB: &str = "MLX_LFM_TP_TEST_JOB";
const GEN: usize = 32;

fn fixture_dir(name: &str, preset: Preset) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mlxlfm-tp-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    fixture::generate(&FixtureSpec::new(preset), &d).unwrap();
    d
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + seed * 101 + 3) % 900 + 1).collect()
}

fn engine(dir: &Path, paged: bool, path: DecodePath, group: Option<Group>) -> crate::Result<Engine> {
    let opts = EngineOptions {
        paged_cache: Some(paged),
        paged_block_size: Some(16),
        decode_path: Some(path),
        prefill_chunk: Some(16),
        group,
        ..Default::default()
    };
    Engine::load(dir, &opts)
}

fn greedy() -> GenerateParams {
    GenerateParams { max_tokens: GEN, ignore_eos: true, ..Default::default() }
}

/// What one engine computes for the comparison: greedy tokens through
/// `generate`, the logits of every step (prefill, then each greedy token
/// fed back) through the model's forward over the engine's own kind of
/// cache, and the tokens of 4 requests run together by the scheduler.
fn compute(e: &mut Engine) -> crate::Result<Value> {
    let p = prompt(23, 1);
    let g = e.generate(Prompt::Tokens(p.clone()), greedy(), &mut generate::NoObserver)?;
    let mut cache = e.model.new_cache();
    let mut logits: Vec<Vec<f32>> = vec![];
    let last = generate::prefill(&e.model, &mut cache, &p, 16)?;
    logits.push(last.astype(Dtype::Float32)?.to_vec()?);
    for &t in &g.tokens[..GEN - 1] {
        let ids = Array::from_slice(&[t], &[1, 1])?;
        let l = e.model.forward(&ids, &mut cache, true)?;
        logits.push(l.astype(Dtype::Float32)?.to_vec()?);
    }
    let batch = Arc::new(Mutex::new(vec![vec![]; 4]));
    let mut sched = Scheduler::new();
    for i in 0..4 {
        let out = batch.clone();
        let req = Request::tokens(prompt(9 + 7 * i, 10 + i as u32), greedy(), move |r| {
            out.lock().unwrap()[i] = r.map(|g| g.tokens).unwrap_or_default();
        });
        sched.submit(e, req);
    }
    while sched.prefilling() > 0 || sched.running() > 0 {
        if sched.prefilling() > 0 {
            sched.prefill_next(e);
        } else {
            sched.step_active(e);
        }
    }
    let batch = batch.lock().unwrap().clone();
    Ok(json!({ "tokens": g.tokens, "logits": logits, "batch": batch }))
}

/// The worker as a server runs it: rank 0 takes 4 requests arriving a
/// little apart (so its batches depend on timing) and one it cancels
/// mid-way; the other ranks run the `follow` job.
fn serve(dir: &Path, paged: bool, path: DecodePath, rank: usize) -> crate::Result<Value> {
    use super::worker::ModelWorker;
    let group = Group::init_within("ring", Duration::from_secs(60))?;
    let opts = EngineOptions {
        paged_cache: Some(paged),
        paged_block_size: Some(16),
        decode_path: Some(path),
        prefill_chunk: Some(16),
        group: Some(group),
        ..Default::default()
    };
    let (tx, rx) = std::sync::mpsc::channel();
    ModelWorker::spawn(dir.to_path_buf(), opts, move |r| {
        let _ = tx.send(r.map(|(w, _, _)| w));
    });
    let worker = rx.recv().unwrap()?;
    if rank != 0 {
        let (tx, rx) = std::sync::mpsc::channel();
        worker.run_scheduled(
            |eng, _| match eng.follower() {
                Some(g) => super::lockstep::follow(eng, &g),
                None => Err(crate::Error::invalid("not a follower")),
            },
            move |r| {
                let _ = tx.send(r);
            },
        );
        rx.recv().unwrap()?;
        // A follower refuses requests of its own.
        let (tx, rx) = std::sync::mpsc::channel();
        worker.generate(Request::tokens(prompt(5, 1), greedy(), move |r| {
            let _ = tx.send(r.err().map(|e| e.message));
        }));
        let refused = rx.recv().unwrap();
        worker.close();
        return Ok(json!({ "followed": true, "refused": refused }));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    for i in 0..4usize {
        let tx = tx.clone();
        worker.generate(Request::tokens(prompt(9 + 7 * i, 10 + i as u32), greedy(), move |r| {
            let _ = tx.send((i, r.map(|g| g.tokens).map_err(|e| e.message)));
        }));
        std::thread::sleep(Duration::from_millis(15 * i as u64));
    }
    // A request its client abandons after a few tokens.
    struct StopAfter(usize);
    impl Observer for StopAfter {
        fn cancelled(&mut self) -> bool {
            self.0 = self.0.saturating_sub(1);
            self.0 == 0
        }
    }
    let mut req = Request::tokens(prompt(12, 40), GenerateParams { max_tokens: 1000, ignore_eos: true, ..Default::default() }, {
        let tx = tx.clone();
        move |r| {
            let _ = tx.send((4, r.map(|g| g.tokens).map_err(|e| e.message)));
        }
    });
    req.observer = Box::new(StopAfter(6));
    worker.generate(req);
    drop(tx);
    let mut batch = vec![Value::Null; 5];
    for (i, r) in rx {
        batch[i] = match r {
            Ok(t) => json!(t),
            Err(e) => json!({ "error": e }),
        };
    }
    // A request after the batch: the followers are still in step.
    let (tx, rx) = std::sync::mpsc::channel();
    worker.generate(Request::tokens(prompt(23, 1), greedy(), move |r| {
        let _ = tx.send(r.map(|g| g.tokens).map_err(|e| e.message));
    }));
    let tokens = rx.recv().unwrap().map_err(crate::Error::mlx)?;
    // The worker announces the end to the followers once its queue is
    // done: wait for it (as the addon does when Node exits).
    worker.close();
    super::worker::shutdown_all(Duration::from_secs(60));
    Ok(json!({ "batch": batch, "tokens": tokens }))
}

/// The bridge's other collectives, as a rank sees them.
fn collectives(g: &Group) -> crate::Result<Value> {
    let r = g.rank() as i32;
    let mine = Array::from_slice(&[r, 10 + r], &[2])?;
    let gathered: Vec<i32> = g.all_gather(&mine)?.to_vec()?;
    let max: Vec<i32> = g.all_max(&mine)?.to_vec()?;
    let from_root = g.broadcast(&[7 + r, -3 * r])?;
    let text = if r == 0 { "rank 0's bytes: ünïcode, 19 long".as_bytes().to_vec() } else { b"ignored".to_vec() };
    let bytes = String::from_utf8(g.broadcast_bytes(&text)?).unwrap();
    let empty = g.broadcast_bytes(if r == 0 { b"" } else { b"xyz" })?;
    // Point to point, rank 0 first: it sends to rank 1 and then receives
    // from it; rank 1 does the reverse (a send completes only once its
    // peer receives).
    let other = 1 - g.rank().min(1);
    let out = Array::from_slice(&[100 + r], &[1])?;
    let got = if r == 0 {
        crate::mlx::eval(&[&g.send(&out, other)?])?;
        g.recv(&[1], Dtype::Int32, other)?
    } else {
        let got = g.recv(&[1], Dtype::Int32, other)?;
        crate::mlx::eval(&[&got])?;
        crate::mlx::eval(&[&g.send(&out, other)?])?;
        got
    };
    Ok(json!({
        "gathered": gathered, "max": max, "fromRoot": from_root, "bytes": bytes, "empty": empty.len(),
        "received": got.to_vec::<i32>()?,
    }))
}

/// Counts decode steps into a file, so the parent knows the ranks are
/// mid-generation.
struct Progress(PathBuf, usize);
impl Observer for Progress {
    fn cancelled(&mut self) -> bool {
        self.1 += 1;
        std::fs::write(&self.0, self.1.to_string()).ok();
        false
    }
}

/// One rank's part of a job (the parent sets MLX_LFM_TP_TEST_JOB).
#[test]
#[ignore = "a rank of the tensor-parallel tests; they start it"]
fn tp_rank() {
    let job: Value = serde_json::from_str(&std::env::var(JOB).expect("started by a tensor-parallel test")).unwrap();
    let out = PathBuf::from(job["out"].as_str().unwrap());
    let rank: usize = std::env::var("MLX_RANK").unwrap().parse().unwrap();
    let result = (|| -> crate::Result<Value> {
        let group = Group::init_within("ring", Duration::from_secs(60))?;
        assert_eq!(group.rank(), rank);
        let dir = PathBuf::from(job["dir"].as_str().unwrap());
        let paged = job["paged"].as_bool().unwrap();
        let path = if job["compiled"].as_bool().unwrap() { DecodePath::Compiled } else { DecodePath::Eager };
        let mut e = engine(&dir, paged, path, Some(group))?;
        let info = e.info();
        match job["mode"].as_str().unwrap() {
            "compare" => {
                let mut v = compute(&mut e)?;
                v["collectives"] = collectives(e.model.shard.as_ref().map(|s| &s.group).expect("a sharded model"))?;
                v["worldSize"] = json!(info.world_size);
                v["rank"] = json!(info.rank);
                v["weightBytes"] = json!(info.weight_bytes);
                v["decodePath"] = json!(info.decode_path);
                Ok(v)
            }
            "long" => {
                let params = GenerateParams { max_tokens: 100_000, ignore_eos: true, ..Default::default() };
                let mut obs = Progress(out.with_extension("progress"), 0);
                e.generate(Prompt::Tokens(prompt(8, 3)), params, &mut obs)?;
                Ok(json!({ "finished": true }))
            }
            "serve" => {
                drop(e);
                serve(&dir, paged, path, rank)
            }
            m => panic!("unknown mode {m}"),
        }
    })();
    let v = match result {
        Ok(v) => v,
        Err(e) => json!({ "error": e.message }),
    };
    std::fs::write(&out, v.to_string()).unwrap();
}

struct Ranks {
    children: Vec<Child>,
    outs: Vec<PathBuf>,
    _tmp: PathBuf,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Starts `n` ranks of `job` (each gets its own `out` file).
fn start(n: usize, name: &str, job: Value) -> Ranks {
    let tmp = std::env::temp_dir().join(format!("mlxlfm-tp-run-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&tmp).ok();
    std::fs::create_dir_all(&tmp).unwrap();
    let hosts: Vec<Vec<String>> = (0..n).map(|_| vec![format!("127.0.0.1:{}", free_port())]).collect();
    let hostfile = tmp.join("hosts.json");
    std::fs::write(&hostfile, serde_json::to_string(&hosts).unwrap()).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut children = vec![];
    let mut outs = vec![];
    for r in 0..n {
        let out = tmp.join(format!("rank{r}.json"));
        let mut j = job.clone();
        j["out"] = json!(out.to_str().unwrap());
        let child = Command::new(&exe)
            .args(["--exact", "engine::tp_tests::tp_rank", "--ignored", "--nocapture", "--test-threads=1"])
            .env(JOB, j.to_string())
            .env("MLX_HOSTFILE", &hostfile)
            .env("MLX_RANK", r.to_string())
            // A rank left alone by a dead peer ends within this (the steps
            // here take milliseconds).
            .env("MLX_LFM_TP_TIMEOUT_S", "15")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(tmp.join(format!("rank{r}.stderr"))).unwrap())
            .spawn()
            .unwrap();
        children.push(child);
        outs.push(out);
    }
    Ranks { children, outs, _tmp: tmp }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.children {
            c.kill().ok();
            c.wait().ok();
        }
        std::fs::remove_dir_all(&self._tmp).ok();
    }
}

impl Ranks {
    /// Waits for every rank (at most `limit`), then reads their outputs.
    fn results(mut self, limit: Duration) -> Vec<Value> {
        let t = Instant::now();
        for i in 0..self.children.len() {
            let c = &mut self.children[i];
            loop {
                if c.try_wait().unwrap().is_some() {
                    break;
                }
                if t.elapsed() > limit {
                    panic!("the ranks did not finish within {limit:?}");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.outs
            .iter()
            .map(|o| {
                let text = std::fs::read_to_string(o).unwrap_or_else(|_| {
                    let err: String = self
                        .outs
                        .iter()
                        .map(|o| format!("{}:\n{}", o.display(), std::fs::read_to_string(o.with_extension("stderr")).unwrap_or_default()))
                        .collect();
                    panic!("{} was not written; the ranks' stderr:\n{err}", o.display())
                });
                serde_json::from_str(&text).unwrap()
            })
            .collect()
    }
}

fn max_diff(a: &Value, b: &Value) -> f64 {
    let rows = |v: &Value| -> Vec<Vec<f64>> {
        v.as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()).collect()
    };
    let (a, b) = (rows(a), rows(b));
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f64::max)
}

fn parity(preset: Preset, name: &str, quant: Option<(crate::mlx::QuantMode, i32, i32)>) {
    let mut dir = fixture_dir(name, preset);
    let mut cases = vec![(false, true), (true, false)];
    if let Some((mode, bits, group)) = quant {
        let q = dir.with_extension("q");
        std::fs::remove_dir_all(&q).ok();
        let recipe = crate::convert::ConvertRecipe::quantized(mode, Some(bits), Some(group)).unwrap();
        crate::convert::convert(&dir, &q, &recipe).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        dir = q;
        // Quantized checkpoints default to flat caches; one case is enough
        // for the split on group boundaries.
        cases = vec![(false, true)];
    }
    for (paged, compiled) in cases {
        let path = if compiled { DecodePath::Compiled } else { DecodePath::Eager };
        let mut one = engine(&dir, paged, path, None).unwrap();
        assert_eq!(one.info().world_size, 1);
        let whole_bytes = one.info().weight_bytes as u64;
        let want = compute(&mut one).unwrap();
        drop(one);
        let job = json!({ "mode": "compare", "dir": dir.to_str().unwrap(), "paged": paged, "compiled": compiled });
        let got = start(2, name, job).results(Duration::from_secs(300));
        let case = format!("{name}, paged {paged}, compiled {compiled}");
        for (r, g) in got.iter().enumerate() {
            assert!(g.get("error").is_none(), "{case}: rank {r} failed: {}", g["error"]);
            assert_eq!(g["worldSize"], 2, "{case}");
            assert_eq!(g["rank"], r, "{case}");
            // Each rank holds its shard (the embedding, norms and routers
            // are replicated, so less than the whole but more than half).
            let bytes = g["weightBytes"].as_u64().unwrap();
            assert!(bytes < whole_bytes * 3 / 4 && bytes > whole_bytes / 2, "{case}: rank {r} holds {bytes} of {whole_bytes} bytes");
            assert_eq!(g["decodePath"], if compiled { "compiled" } else { "eager" }, "{case}");
            assert_eq!(g["tokens"], want["tokens"], "{case}: rank {r}'s greedy tokens differ from one process");
            assert_eq!(g["batch"], want["batch"], "{case}: rank {r}'s batch of 4 differs from one process");
            let d = max_diff(&g["logits"], &want["logits"]);
            assert!(d < 1e-4, "{case}: rank {r}'s logits differ from one process by {d}");
        }
        assert!(want["batch"].as_array().unwrap().iter().all(|t| t.as_array().unwrap().len() == GEN));
        for (r, g) in got.iter().enumerate() {
            let c = &g["collectives"];
            assert_eq!(c["gathered"], json!([0, 10, 1, 11]), "rank {r}");
            assert_eq!(c["max"], json!([1, 11]), "rank {r}");
            assert_eq!(c["fromRoot"], json!([7, 0]), "rank {r}");
            assert_eq!(c["bytes"], "rank 0's bytes: ünïcode, 19 long", "rank {r}");
            assert_eq!(c["empty"], 0, "rank {r}");
            assert_eq!(c["received"], json!([100 + (1 - r as i32)]), "rank {r}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn two_ranks_match_one_process_dense() {
    parity(Preset::Tiny, "dense", None);
}

#[test]
fn two_ranks_match_one_process_moe() {
    parity(Preset::TinyMoe, "moe", None);
}

#[test]
fn two_ranks_match_one_process_quantized() {
    // affine 4-bit in groups of 32: row-sharded inputs of 64 and 192 split
    // into 32 and 96 per rank, whole groups.
    parity(Preset::Tiny, "quant", Some((crate::mlx::QuantMode::Affine, 4, 32)));
}

#[test]
fn two_ranks_serve_as_rank_0_decides() {
    let dir = fixture_dir("serve", Preset::Tiny);
    for (paged, compiled) in [(false, true), (true, false)] {
        let path = if compiled { DecodePath::Compiled } else { DecodePath::Eager };
        let want = compute(&mut engine(&dir, paged, path, None).unwrap()).unwrap();
        let job = json!({ "mode": "serve", "dir": dir.to_str().unwrap(), "paged": paged, "compiled": compiled });
        let got = start(2, "serve", job).results(Duration::from_secs(300));
        let case = format!("paged {paged}, compiled {compiled}");
        assert!(got[0].get("error").is_none(), "{case}: rank 0 failed: {}", got[0]["error"]);
        assert!(got[1].get("error").is_none(), "{case}: rank 1 failed: {}", got[1]["error"]);
        assert_eq!(got[1]["followed"], true);
        assert!(got[1]["refused"].as_str().unwrap().contains("it follows rank 0"), "{}", got[1]["refused"]);
        let batch = got[0]["batch"].as_array().unwrap();
        assert_eq!(json!(batch[..4]), want["batch"], "{case}: 4 requests served by 2 ranks differ from one process");
        let cancelled = batch[4].as_array().unwrap_or_else(|| panic!("{case}: {}", batch[4]));
        assert!(cancelled.len() < 1000, "{case}: the cancelled request ran to the end");
        assert_eq!(got[0]["tokens"], want["tokens"], "{case}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_model_the_group_cannot_split_is_refused_at_load() {
    // The tiny model has 2 KV heads: 3 ranks cannot share them.
    let dir = fixture_dir("refuse", Preset::Tiny);
    let job = json!({ "mode": "compare", "dir": dir.to_str().unwrap(), "paged": false, "compiled": false });
    let got = start(3, "refuse", job).results(Duration::from_secs(120));
    for g in got {
        let msg = g["error"].as_str().expect("a rank loaded an unsplittable model");
        assert!(
            msg.contains("tensor parallelism over 3 ranks needs num_key_value_heads (2) to be divisible by 3"),
            "{msg}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_rank_killed_mid_generation_is_an_error_on_the_other() {
    let dir = fixture_dir("kill", Preset::Tiny);
    let job = json!({ "mode": "long", "dir": dir.to_str().unwrap(), "paged": false, "compiled": false });
    let mut ranks = start(2, "kill", job);
    let progress = ranks.outs[1].with_extension("progress");
    let t = Instant::now();
    while std::fs::read_to_string(&progress).ok().and_then(|s| s.parse::<usize>().ok()).unwrap_or(0) < 20 {
        assert!(t.elapsed() < Duration::from_secs(120), "the ranks never started generating");
        std::thread::sleep(Duration::from_millis(20));
    }
    ranks.children[1].kill().unwrap();
    let killed_at = Instant::now();
    let mut survivor = ranks.children.remove(0);
    let out = ranks.outs.remove(0);
    loop {
        if survivor.try_wait().unwrap().is_some() {
            break;
        }
        if killed_at.elapsed() > Duration::from_secs(60) {
            survivor.kill().ok();
            panic!("rank 0 still runs 60 s after rank 1 was killed");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Either MLX's error reached the engine (the rank wrote it), or the
    // eval that caught it could not return and the watchdog ended the rank
    // with its own message; never a hang, never a result.
    let status = survivor.wait().unwrap();
    assert!(!status.success() || out.exists(), "rank 0 exited cleanly without a result");
    let stderr = std::fs::read_to_string(out.with_extension("stderr")).unwrap_or_default();
    match std::fs::read_to_string(&out) {
        Ok(text) => {
            let v: Value = serde_json::from_str(&text).unwrap();
            let msg = v["error"].as_str().unwrap_or_else(|| panic!("rank 0 finished without an error: {v}"));
            assert!(msg.contains("peer was lost"), "{msg}");
        }
        Err(_) => {
            assert_eq!(status.code(), Some(75), "rank 0 ended with {status}; stderr: {stderr}");
            assert!(stderr.contains("another rank died or stopped answering"), "{stderr}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
