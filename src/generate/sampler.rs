//! Token sampling on the device, with the semantics of mlx-lm's sampler:
//! logits processors (repetition penalty over a context window), then
//! log-probabilities filtered by top-p, min-p and top-k, then a categorical
//! draw at the given temperature. Greedy when temperature is 0. Everything is
//! lazy so the next step can be queued before the current token is read.

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
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    key: Option<Array>,
    /// The penalty window on the device (so it can include tokens not yet read back).
    window: Option<Array>,
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
        let window = if params.repetition_penalty.is_some() && !context.is_empty() {
            let tail = &context[context.len().saturating_sub(params.repetition_context_size)..];
            Some(Array::from_slice(tail, &[tail.len() as i32])?)
        } else {
            None
        };
        Ok(Sampler { params, key, window })
    }

    /// Plain greedy: the token is the argmax and nothing else changes
    /// (a batch of such rows takes one argmax for all).
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0 && self.params.repetition_penalty.is_none()
    }

    /// Draws the next token from `logits` (`[1, V]`); returns a lazy `[1]` uint32.
    pub fn sample(&mut self, logits: &Array) -> Result<Array> {
        let mut logits = logits.clone();
        if let (Some(penalty), Some(w)) = (self.params.repetition_penalty, &self.window) {
            logits = apply_repetition_penalty(&logits, w, penalty)?;
        }
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
        if self.params.repetition_penalty.is_some() {
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

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn invalid_params_are_named() {
        let e = SamplingParams { top_p: 0.0, ..Default::default() }.validate().unwrap_err();
        assert!(e.message.contains("topP"));
        let e = SamplingParams { temperature: -1.0, ..Default::default() }.validate().unwrap_err();
        assert!(e.message.contains("temperature"));
    }
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
    s.mul_scalar(0.0)?.eq_scalar(0.0)?.astype(Dtype::Uint32)?.reshape(&[-1])
}
