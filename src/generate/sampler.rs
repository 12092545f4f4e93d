//! Token sampling on the device, with the semantics of mlx-lm's sampler:
//! logits processors (logit bias, then the repetition, presence and
//! frequency penalties over a context window), then log-probabilities
//! filtered by top-p, min-p and top-k, then a categorical draw at the given
//! temperature. Greedy when temperature is 0. Everything is lazy so the next
//! step can be queued before the current token is read.
//!
//! Reported log-probabilities are mlx-lm's: the log-softmax of the logits
//! after the processors (bias and penalties, and a constraint's mask) and
//! before temperature and the top-p / min-p / top-k filters.

use crate::error::{Error, Result};
use crate::mlx::{self, concatenate, random, Array, Dtype};

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: Option<f32>,
    pub repetition_context_size: usize,
    pub seed: Option<u64>,
    /// Subtracted from the logit of every token in the penalty window
    /// (the last `repetition_context_size` tokens), once (0 = off).
    pub presence_penalty: f32,
    /// Subtracted once per occurrence in that window (0 = off).
    pub frequency_penalty: f32,
    /// Added to the logits of these token ids.
    pub logit_bias: Vec<(u32, f32)>,
    /// Report each drawn token's log-probability.
    pub logprobs: bool,
    /// And the most likely alternatives at each step (0..=20).
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: None,
            repetition_context_size: 20,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: vec![],
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::invalid(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!("temperature must be a finite number >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("topP must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("minP must be in [0, 1], got {}", self.min_p));
        }
        if let Some(p) = self.repetition_penalty {
            if !p.is_finite() || p <= 0.0 {
                return bad(format!("repetitionPenalty must be a positive number, got {p}"));
            }
        }
        if self.repetition_context_size == 0 {
            return bad("repetitionContextSize must be at least 1".into());
        }
        for (name, v) in [("presencePenalty", self.presence_penalty), ("frequencyPenalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be from -2 to 2, got {v}"));
            }
        }
        for &(id, b) in &self.logit_bias {
            if !(-100.0..=100.0).contains(&b) {
                return bad(format!("logitBias[{id}] must be from -100 to 100, got {b}"));
            }
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return bad(format!("topLogprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {}", self.top_logprobs));
        }
        Ok(())
    }

    /// Checks the ids that name tokens against the vocabulary (known only
    /// once a model is loaded).
    pub fn validate_vocab(&self, vocab: usize) -> Result<()> {
        match self.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
            Some((id, _)) => Err(Error::invalid(format!(
                "logitBias names token id {id}, but the vocabulary has {vocab} tokens (ids 0 to {})",
                vocab.saturating_sub(1)
            ))),
            None => Ok(()),
        }
    }

    /// Whether any logits processor runs before the draw.
    fn processes(&self) -> bool {
        self.repetition_penalty.is_some() || self.penalizes_presence() || !self.logit_bias.is_empty()
    }

    fn penalizes_presence(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Whether the window of recent tokens is kept.
    fn keeps_window(&self) -> bool {
        self.repetition_penalty.is_some() || self.penalizes_presence()
    }
}

/// The most alternatives a step reports (OpenAI's bound).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One drawn token's log-probability and the top alternatives, lazy (read
/// back with the token).
pub struct LogprobArrays {
    /// `[1]` float32.
    pub token: Array,
    /// `[k]` uint32 ids and `[k]` float32 log-probabilities, unordered.
    pub top: Option<(Array, Array)>,
}

impl LogprobArrays {
    /// The arrays to evaluate with the token.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = vec![&self.token];
        if let Some((i, l)) = &self.top {
            v.push(i);
            v.push(l);
        }
        v
    }

    /// Reads them back: the token's log-probability and the alternatives,
    /// most likely first.
    pub fn read(&self) -> Result<(f32, Vec<(u32, f32)>)> {
        let lp = self.token.item::<f32>()?;
        let mut top = vec![];
        if let Some((i, l)) = &self.top {
            top = i.to_vec::<u32>()?.into_iter().zip(l.to_vec::<f32>()?).collect();
            top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        }
        Ok((lp, top))
    }
}

pub struct Sampler {
    params: SamplingParams,
    key: Option<Array>,
    /// The penalty window on the device (so it can include tokens not yet read back).
    window: Option<Array>,
    /// The logit bias as ids `[1, n]` and values `[1, n]`, uploaded once.
    bias: Option<(Array, Array)>,
    /// The last draw's log-probabilities (when asked for).
    last_logprobs: Option<LogprobArrays>,
}

impl Sampler {
    /// `context` seeds the repetition-penalty window (the prompt's tail).
    pub fn new(params: SamplingParams, context: &[u32]) -> Result<Sampler> {
        params.validate()?;
        let key = if params.temperature > 0.0 {
            let seed = params.seed.unwrap_or_else(|| {
                let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                t.as_nanos() as u64 ^ (std::process::id() as u64) << 32
            });
            Some(random::key(seed)?)
        } else {
            None
        };
        let window = if params.keeps_window() && !context.is_empty() {
            let tail = &context[context.len().saturating_sub(params.repetition_context_size)..];
            Some(Array::from_slice(tail, &[tail.len() as i32])?)
        } else {
            None
        };
        let bias = if params.logit_bias.is_empty() {
            None
        } else {
            let n = params.logit_bias.len() as i32;
            let ids: Vec<u32> = params.logit_bias.iter().map(|b| b.0).collect();
            let vals: Vec<f32> = params.logit_bias.iter().map(|b| b.1).collect();
            Some((Array::from_slice(&ids, &[1, n])?, Array::from_slice(&vals, &[1, n])?))
        };
        Ok(Sampler { params, key, window, bias, last_logprobs: None })
    }

    /// Plain greedy: the token is the argmax and nothing else changes
    /// (a batch of such rows takes one argmax for all).
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0 && !self.params.processes() && !self.params.logprobs
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The log-probabilities of the last draw, once (None unless asked for).
    pub fn take_logprobs(&mut self) -> Option<LogprobArrays> {
        self.last_logprobs.take()
    }

    /// The logits processors: logit bias, then the penalties over the window
    /// (mlx-lm's order).
    pub fn process(&self, logits: &Array) -> Result<Array> {
        let mut logits = logits.clone();
        if let Some((ids, vals)) = &self.bias {
            let sel = logits.take_along_axis(ids, -1)?;
            logits = logits.put_along_axis(ids, &sel.add(&vals.astype(sel.dtype())?)?, -1)?;
        }
        if let Some(w) = &self.window {
            if let Some(penalty) = self.params.repetition_penalty {
                logits = apply_repetition_penalty(&logits, w, penalty)?;
            }
            if self.params.penalizes_presence() {
                logits = apply_presence_penalties(&logits, w, self.params.presence_penalty, self.params.frequency_penalty)?;
            }
        }
        Ok(logits)
    }

    /// Draws the next token from `logits` (`[1, V]`); returns a lazy `[1]` uint32.
    pub fn sample(&mut self, logits: &Array) -> Result<Array> {
        let logits = self.process(logits)?;
        self.draw_processed(&logits)
    }

    /// [`Sampler::sample`] on logits already through [`Sampler::process`]
    /// (and any constraint's mask).
    pub fn draw_processed(&mut self, logits: &Array) -> Result<Array> {
        let logits = logits.clone();
        let lp_all = if self.params.logprobs {
            let l = logits.astype(Dtype::Float32)?;
            Some(l.sub(&l.logsumexp(&[-1], true)?)?)
        } else {
            None
        };
        let tok = if self.params.temperature == 0.0 {
            logits.argmax(-1, false)?
        } else {
            let logits = logits.astype(Dtype::Float32)?;
            let mut lp = logits.sub(&logits.logsumexp(&[-1], true)?)?;
            let v = lp.dim(-1) as usize;
            if self.params.top_p > 0.0 && self.params.top_p < 1.0 {
                lp = apply_top_p(&lp, self.params.top_p)?;
            }
            if self.params.min_p > 0.0 {
                lp = apply_min_p(&lp, self.params.min_p)?;
            }
            if self.params.top_k > 0 && self.params.top_k < v {
                lp = apply_top_k(&lp, self.params.top_k)?;
            }
            let (next, sub) = random::split(self.key.as_ref().unwrap())?;
            self.key = Some(next);
            random::categorical(&lp.mul_scalar(1.0 / self.params.temperature as f64)?, -1, Some(&sub))?
        };
        let tok = tok.astype(Dtype::Uint32)?;
        if let Some(lp) = lp_all {
            self.last_logprobs = Some(logprobs_of(&lp, &tok, self.params.top_logprobs)?);
        }
        if self.params.keeps_window() {
            let w = match &self.window {
                Some(w) => concatenate(&[w, &tok], 0)?,
                None => tok.clone(),
            };
            let n = w.dim(0);
            let keep = self.params.repetition_context_size as i32;
            self.window = Some(if n > keep { w.slice_axis(0, n - keep, n)? } else { w });
        }
        Ok(tok)
    }
}

/// Sign-aware multiplicative penalty on the logits of recently seen tokens.
fn apply_repetition_penalty(logits: &Array, window: &Array, penalty: f32) -> Result<Array> {
    let idx = window.reshape(&[1, -1])?;
    let sel = logits.take_along_axis(&idx, -1)?;
    let zero = Array::scalar(0.0, sel.dtype())?;
    let pen = mlx::where_(&sel.lt(&zero)?, &sel.mul_scalar(penalty as f64)?, &sel.div_scalar(penalty as f64)?)?;
    logits.put_along_axis(&idx, &pen, -1)
}

/// OpenAI's presence and frequency penalties over the window, as mlx-lm
/// applies them: `presence` once per distinct token, `frequency` once per
/// occurrence.
fn apply_presence_penalties(logits: &Array, window: &Array, presence: f32, frequency: f32) -> Result<Array> {
    let idx = window.reshape(&[1, -1])?;
    let sel = logits.take_along_axis(&idx, -1)?;
    // Occurrences of each window entry in the window ([1, n]): every
    // duplicate then writes the same value back.
    let counts = idx.reshape(&[-1, 1])?.eq(&idx)?.astype(sel.dtype())?.sum(&[0], true)?;
    let pen = sel.sub_scalar(presence as f64)?.sub(&counts.mul_scalar(frequency as f64)?)?;
    logits.put_along_axis(&idx, &pen, -1)
}

/// The drawn token's entry of `lp` (`[1, V]` log-probabilities) and the `k`
/// largest.
fn logprobs_of(lp: &Array, tok: &Array, k: usize) -> Result<LogprobArrays> {
    let token = lp.take_along_axis(&tok.astype(Dtype::Uint32)?.reshape(&[1, 1])?, -1)?.reshape(&[1])?;
    let top = if k > 0 {
        let v = lp.dim(-1);
        let k = (k as i32).min(v);
        let ids = lp.neg()?.argpartition(k - 1, -1)?.slice_axis(-1, 0, k)?;
        let vals = lp.take_along_axis(&ids, -1)?.reshape(&[-1])?;
        Some((ids.astype(Dtype::Uint32)?.reshape(&[-1])?, vals))
    } else {
        None
    };
    Ok(LogprobArrays { token, top })
}

fn neg_inf() -> Result<Array> {
    Array::scalar(f64::NEG_INFINITY, Dtype::Float32)
}

/// Keeps the smallest set of tokens whose probability mass reaches `top_p`.
fn apply_top_p(lp: &Array, top_p: f32) -> Result<Array> {
    let sorted = lp.sort(-1)?;
    let probs = sorted.exp()?;
    let above = probs.cumsum(-1, true, false)?;
    let total = above.slice_axis(-1, 0, 1)?.add(&probs.slice_axis(-1, 0, 1)?)?;
    let dropped = above.ge(&total.mul_scalar(top_p as f64)?)?.astype(Dtype::Int32)?.sum(&[-1], true)?;
    let threshold = sorted.take_along_axis(&dropped, -1)?;
    mlx::where_(&lp.lt(&threshold)?, &neg_inf()?, lp)
}

/// Drops tokens less likely than `min_p` times the most likely one.
fn apply_min_p(lp: &Array, min_p: f32) -> Result<Array> {
    let top = lp.max(&[-1], true)?;
    let cut = top.add_scalar((min_p as f64).ln())?;
    mlx::where_(&lp.lt(&cut)?, &neg_inf()?, lp)
}

fn apply_top_k(lp: &Array, k: usize) -> Result<Array> {
    let v = lp.dim(-1);
    let idx = lp.neg()?.argpartition(k as i32 - 1, -1)?.slice_axis(-1, k as i32, v)?;
    let fill = neg_inf()?.broadcast_to(&idx.shape())?;
    lp.put_along_axis(&idx, &fill, -1)
}

/// Per row of `logits` (`[B, V]`), 1 when every value is finite, 0 when it
/// holds a NaN or an infinity (`[B]` uint32, lazy: evaluated with the
/// step's token and read with it, so it costs no extra sync).
pub fn finite_rows(logits: &Array) -> Result<Array> {
    // A row's sum is finite exactly when all of it is (NaN and ±inf
    // propagate), and finite * 0 == 0 while NaN * 0 is not.
    // Summed in the logits' own dtype when its range allows (only
    // finiteness matters, and a float32 copy of a vocabulary-wide row costs
    // a kernel per token); float16 would overflow summing a large
    // vocabulary, so it is widened first.
    let s = if logits.dtype() == Dtype::Float16 { logits.astype(Dtype::Float32)? } else { logits.clone() };
    let s = s.sum(&[-1], false)?;
    // A finite sum less itself is 0, which equals itself; an infinity's or a
    // NaN's is NaN, which equals nothing. (No scalar operands: `* 0 == 0`
    // put two broadcast nodes into every decode step.)
    let d = s.sub(&s)?;
    let f = d.eq(&d)?.astype(Dtype::Uint32)?;
    if f.ndim() == 1 {
        Ok(f)
    } else {
        f.reshape(&[-1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each row's flag: 1 for finite rows (large values too), 0 for a row
    /// holding a NaN, +inf or -inf, in float32, bfloat16 and float16.
    #[test]
    fn finite_rows_flags_each_row() {
        let v = 60000.0f32;
        let rows = [[1.0, -2.0, 3.0], [v, v, -v], [f32::NAN, 0.0, 1.0], [0.0, f32::INFINITY, 1.0], [f32::NEG_INFINITY, 1.0, 2.0]];
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        for dt in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
            let l = Array::from_slice(&flat, &[5, 3]).unwrap().astype(dt).unwrap();
            let f: Vec<u32> = finite_rows(&l).unwrap().to_vec().unwrap();
            assert_eq!(f, vec![1, 1, 0, 0, 0], "{dt:?}");
        }
    }

    fn logits(v: &[f32]) -> Array {
        Array::from_slice(v, &[1, v.len() as i32]).unwrap()
    }

    #[test]
    fn greedy_takes_argmax() {
        let mut s = Sampler::new(SamplingParams::default(), &[]).unwrap();
        assert_eq!(s.sample(&logits(&[0.1, 3.0, 2.0])).unwrap().to_vec::<u32>().unwrap(), vec![1]);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_filters_hold() {
        let l = logits(&[5.0, 4.9, 1.0, 0.5, -3.0, 4.8]);
        let draw = |p: SamplingParams| -> Vec<u32> {
            let mut s = Sampler::new(p, &[]).unwrap();
            (0..40).map(|_| s.sample(&l).unwrap().item::<u32>().unwrap()).collect()
        };
        let base = SamplingParams { temperature: 1.0, seed: Some(3), ..Default::default() };
        assert_eq!(draw(base.clone()), draw(base.clone()));
        let k2 = draw(SamplingParams { top_k: 2, ..base.clone() });
        assert!(k2.iter().all(|&t| t == 0 || t == 1), "{k2:?}");
        assert!(k2.contains(&0) && k2.contains(&1));
        // min_p 0.5: keeps tokens with p >= 0.5 * p_max: ids 0, 1, 5.
        let mp = draw(SamplingParams { min_p: 0.5, ..base.clone() });
        assert!(mp.iter().all(|t| [0, 1, 5].contains(t)), "{mp:?}");
        // top_p tiny: only the top token survives.
        let tp = draw(SamplingParams { top_p: 0.01, ..base.clone() });
        assert!(tp.iter().all(|&t| t == 0), "{tp:?}");
    }

    #[test]
    fn repetition_penalty_changes_greedy_choice() {
        let p = SamplingParams { repetition_penalty: Some(2.0), ..Default::default() };
        let mut s = Sampler::new(p, &[1]).unwrap();
        // Token 1 (3.0) is penalized to 1.5, so token 2 (2.0) wins.
        assert_eq!(s.sample(&logits(&[0.1, 3.0, 2.0])).unwrap().item::<u32>().unwrap(), 2);
        // Now token 2 is in the window too: 3.0/2 = 1.5 vs 2.0/2 = 1.0 -> token 1.
        assert_eq!(s.sample(&logits(&[0.1, 3.0, 2.0])).unwrap().item::<u32>().unwrap(), 1);
        let neg = SamplingParams { repetition_penalty: Some(2.0), ..Default::default() };
        let mut s = Sampler::new(neg, &[0]).unwrap();
        // A negative logit is multiplied: -1 -> -2, so token 1 (-1.5) wins.
        assert_eq!(s.sample(&logits(&[-1.0, -1.5])).unwrap().item::<u32>().unwrap(), 1);
    }

    /// log-softmax computed here on the CPU, in f64.
    fn log_softmax(v: &[f32]) -> Vec<f64> {
        let m = v.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z: f64 = v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
        v.iter().map(|&x| x as f64 - z).collect()
    }

    #[test]
    fn bias_and_penalties_change_the_logits_as_mlx_lm_does() {
        let p = SamplingParams {
            logit_bias: vec![(0, 1.5), (3, -2.0)],
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            logprobs: true,
            top_logprobs: 2,
            ..Default::default()
        };
        // Window (prompt tail): token 1 twice, token 2 once.
        let mut s = Sampler::new(p, &[1, 2, 1]).unwrap();
        let raw = [0.1f32, 3.0, 2.0, 1.0];
        let out = s.process(&logits(&raw)).unwrap().to_vec::<f32>().unwrap();
        let want = [0.1 + 1.5, 3.0 - 0.5 - 2.0 * 0.25, 2.0 - 0.5 - 0.25, 1.0 - 2.0];
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 1e-6, "{out:?} vs {want:?}");
        }
        // Greedy on the processed logits: token 1 (2.0) ties none; token 0 is 1.6.
        let tok = s.sample(&logits(&raw)).unwrap();
        assert_eq!(tok.item::<u32>().unwrap(), 1);
        let (lp, top) = s.take_logprobs().unwrap().read().unwrap();
        let reference = log_softmax(&want);
        assert!((lp as f64 - reference[1]).abs() < 1e-5, "{lp} vs {}", reference[1]);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 0]);
        assert!((top[1].1 as f64 - reference[0]).abs() < 1e-5);
        // The drawn token joined the window: token 1 now occurs 3 times.
        let out = s.process(&logits(&raw)).unwrap().to_vec::<f32>().unwrap();
        assert!((out[1] - (3.0 - 0.5 - 0.75)).abs() < 1e-6, "{out:?}");
    }

    #[test]
    fn sampled_logprobs_are_of_the_drawn_token() {
        let p = SamplingParams { temperature: 1.0, seed: Some(7), logprobs: true, top_logprobs: 20, ..Default::default() };
        let raw = [0.3f32, 1.0, -0.5, 0.9, 0.0];
        let reference = log_softmax(&raw);
        let mut s = Sampler::new(p, &[]).unwrap();
        for _ in 0..10 {
            let t = s.sample(&logits(&raw)).unwrap().item::<u32>().unwrap();
            let (lp, top) = s.take_logprobs().unwrap().read().unwrap();
            assert!((lp as f64 - reference[t as usize]).abs() < 1e-5);
            // More asked for than the vocabulary holds: all of it, in order.
            assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 0, 4, 2]);
        }
    }

    #[test]
    fn new_params_are_range_checked() {
        let e = SamplingParams { presence_penalty: 2.5, ..Default::default() }.validate().unwrap_err();
        assert!(e.message.contains("presencePenalty"), "{}", e.message);
        let e = SamplingParams { top_logprobs: 21, ..Default::default() }.validate().unwrap_err();
        assert!(e.message.contains("topLogprobs"), "{}", e.message);
        let e = SamplingParams { logit_bias: vec![(9, 1.0)], ..Default::default() }.validate_vocab(9).unwrap_err();
        assert!(e.message.contains("logitBias") && e.message.contains('9'), "{}", e.message);
    }

    #[test]
    fn invalid_params_are_named() {
        let e = SamplingParams { top_p: 0.0, ..Default::default() }.validate().unwrap_err();
        assert!(e.message.contains("topP"));
        let e = SamplingParams { temperature: -1.0, ..Default::default() }.validate().unwrap_err();
        assert!(e.message.contains("temperature"));
    }
}
