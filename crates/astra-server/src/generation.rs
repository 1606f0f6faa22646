//! One sequence's decoding after its prompt: sampling, end-of-generation tokens, the
//! token budget, text streamed through UTF-8 reassembly and stop strings, and the log
//! probabilities a client asked for.

use astra_engine::sampler::{Sampler, SamplerConfig};
use astra_engine::{StopMatcher, StopOutcome};
use astra_tokenizer::{StreamDecoder, Tokenizer};

/// Why a sequence ended, in OpenAI's words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// The token budget or the context ran out.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What a client asked of the generation.
#[derive(Clone, Debug)]
pub struct GenParams {
    pub sampler: SamplerConfig,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Alternatives reported per token with its log probability; `None`: no logprobs.
    pub logprobs: Option<usize>,
}

/// A token's log probability under the model (before any bias or penalty), with the
/// most likely alternatives.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// The outcome of one generated token.
#[derive(Clone, Debug)]
pub struct Emitted {
    /// The token, or `None` when an end-of-generation token ended the sequence.
    pub id: Option<u32>,
    /// Text released by this token (possibly empty while a stop string may be forming
    /// or a UTF-8 sequence is incomplete).
    pub text: String,
    pub logprob: Option<TokenLogprob>,
    pub finish: Option<FinishReason>,
}

pub struct Generation {
    params: GenParams,
    sampler: Sampler,
    decoder: StreamDecoder,
    stops: StopMatcher,
    pub generated: Vec<u32>,
}

impl Generation {
    /// A generation continuing `prompt` (seen by the repetition penalties).
    pub fn new(params: GenParams, prompt: &[u32]) -> Generation {
        let mut sampler = Sampler::new(params.sampler.clone());
        sampler.accept(prompt);
        let stops = StopMatcher::new(params.stop.clone());
        Generation { params, sampler, decoder: StreamDecoder::new(), stops, generated: Vec::new() }
    }

    /// Picks the next token from `logits`; `room` is how many more positions the
    /// context holds after this token.
    pub fn step(&mut self, tok: &Tokenizer, logits: &mut [f32], room: usize) -> Emitted {
        let log_probs = self.params.logprobs.map(|n| (log_softmax(logits), n));
        let id = self.sampler.sample(logits);
        let logprob = log_probs.map(|(lp, n)| TokenLogprob { id, logprob: lp[id as usize], top: top_n(&lp, n) });
        if tok.vocab().eog.contains(&id) {
            return Emitted { id: None, text: self.flush(), logprob, finish: Some(FinishReason::Stop) };
        }
        self.generated.push(id);
        let mut bytes = Vec::new();
        tok.token_bytes(id, false, &mut bytes);
        let piece = self.decoder.push(&bytes);
        let (mut text, stopped) = match self.stops.push(&piece) {
            StopOutcome::Continue(t) => (t, false),
            StopOutcome::Stopped(t) => (t, true),
        };
        let finish = if stopped {
            Some(FinishReason::Stop)
        } else if self.generated.len() >= self.params.max_tokens || room == 0 {
            text.push_str(&self.flush());
            Some(FinishReason::Length)
        } else {
            None
        };
        Emitted { id: Some(id), text, logprob, finish }
    }

    /// Releases held text at the end of a sequence (a stop string in it still ends it
    /// there).
    fn flush(&mut self) -> String {
        match self.stops.push(&self.decoder.finish()) {
            StopOutcome::Continue(t) => t + &self.stops.finish(),
            StopOutcome::Stopped(t) => t,
        }
    }
}

/// The `n` largest values with their indices, largest first (ties: lower index first).
fn top_n(values: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut all: Vec<(u32, f32)> = values.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let n = n.min(all.len());
    if n == 0 {
        return Vec::new();
    }
    all.select_nth_unstable_by(n - 1, order);
    all.truncate(n);
    all.sort_by(order);
    all
}

/// `ln softmax(logits)`, summed in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&l| (l as f64 - lse) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_n_is_the_sorted_prefix() {
        let v = [0.5f32, 3.0, -1.0, 3.0, 2.0];
        assert_eq!(top_n(&v, 3), vec![(1, 3.0), (3, 3.0), (4, 2.0)]);
        assert_eq!(top_n(&v, 9).len(), 5);
        assert!(top_n(&v, 0).is_empty());
    }

    #[test]
    fn log_softmax_matches_f64_definition() {
        let logits = [1.0f32, 2.0, 3.0, -1.0];
        let lp = log_softmax(&logits);
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for (l, p) in logits.iter().zip(&lp) {
            assert!(((*l as f64 - z.ln()) - *p as f64).abs() < 1e-6);
        }
    }
}
