//! One sequence's decoding after its prompt: sampling, end-of-generation tokens, the
//! token budget, text streamed through UTF-8 reassembly, the split of thinking from
//! the answer (with the answer reservation's wrap-up), stop strings, and the log
//! probabilities a client asked for.

use astra_engine::sampler::{Sampler, SamplerConfig};
use astra_engine::{StopMatcher, StopOutcome};
use astra_grammar::Constraint;
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

/// The sentence injected when a thinking budget runs out inside the thinking.
pub const WRAP_UP: &str = "I have thought about this long enough; time to give my answer.";

/// Thinking tokens before the budget's end at which the wrap-up may come early, so that
/// it lands where a word ends rather than inside one.
const WRAP_UP_WINDOW: usize = 8;

/// How a thinking request is run.
#[derive(Clone, Debug)]
pub struct ThinkingParams {
    /// The marker that ends the thinking (`</think>`).
    pub end: String,
    /// Thinking tokens allowed before the wrap-up is injected; `None`: unlimited.
    pub budget: Option<usize>,
    /// The wrap-up (the sentence and the end marker): text and tokens.
    pub wrap_up: (String, Vec<u32>),
    /// The end marker fed in place of an end of turn inside the thinking, so that the
    /// model goes on to answer: text and tokens; `None`: the turn ends there.
    pub close: Option<(String, Vec<u32>)>,
    /// The budget's terms (cap, answer room, budget) for the per-request log line;
    /// `None`: not logged.
    pub log: Option<String>,
}

/// What a client asked of the generation.
#[derive(Clone, Debug)]
pub struct GenParams {
    pub sampler: SamplerConfig,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Alternatives reported per token with its log probability; `None`: no logprobs.
    pub logprobs: Option<usize>,
    /// `Some` when the generation starts inside the thinking.
    pub thinking: Option<ThinkingParams>,
    /// The grammar the answer follows (from the end of the thinking on).
    pub constraint: Option<Constraint>,
}

/// A token's log probability under the model (before any bias or penalty), with the
/// most likely alternatives.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// The outcome of one step.
#[derive(Clone, Debug, Default)]
pub struct Emitted {
    /// The sampled token to feed next; `None` when the sequence ended on an
    /// end-of-generation token, or when `inject` replaces it.
    pub id: Option<u32>,
    /// Tokens to feed instead of a sampled one (the thinking wrap-up).
    pub inject: Option<Vec<u32>>,
    /// Thinking text released by this step.
    pub reasoning: String,
    /// Answer text released by this step (possibly empty while a stop string may be
    /// forming or a UTF-8 sequence is incomplete).
    pub content: String,
    pub logprob: Option<TokenLogprob>,
    pub finish: Option<FinishReason>,
    /// The sequence failed (its grammar broke down): the request fails with this.
    pub error: Option<String>,
    /// The stop string that ended the sequence, if one did.
    pub stop_string: Option<String>,
}

pub struct Generation {
    params: GenParams,
    sampler: Sampler,
    decoder: StreamDecoder,
    stops: StopMatcher,
    constraint: Option<Constraint>,
    /// Splits the thinking off while it lasts.
    think: Option<StopMatcher>,
    /// The answer has started (leading whitespace after the thinking is dropped).
    answering: bool,
    pub generated: Vec<u32>,
    pub thinking_tokens: usize,
    /// How the thinking ended, if the server ended it.
    pub injected: Option<Injected>,
}

/// What the server fed to end a request's thinking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Injected {
    /// The wrap-up, when the thinking budget ran out.
    WrapUp,
    /// The end marker, when the model ended its turn inside the thinking.
    Close,
}

impl Injected {
    /// The per-request log line's word for it.
    pub fn name(injected: Option<Injected>) -> &'static str {
        match injected {
            Some(Injected::WrapUp) => "wrap_up",
            Some(Injected::Close) => "end_marker",
            None => "none",
        }
    }
}

/// Whether a token's text starts a new word (so that text injected before it does not
/// split a word).
fn starts_word(bytes: &[u8]) -> bool {
    bytes
        .first()
        .is_none_or(|&b| !(b.is_ascii_alphanumeric() || b >= 0x80))
}

impl Generation {
    /// A generation continuing `prompt` (seen by the repetition penalties).
    pub fn new(mut params: GenParams, prompt: &[u32]) -> Generation {
        let constraint = params.constraint.take();
        let mut sampler = Sampler::new(params.sampler.clone());
        sampler.accept(prompt);
        let stops = StopMatcher::new(params.stop.clone());
        let think = params
            .thinking
            .as_ref()
            .map(|t| StopMatcher::new(vec![t.end.clone()]));
        Generation {
            params,
            sampler,
            decoder: StreamDecoder::new(),
            stops,
            constraint,
            think,
            answering: false,
            generated: Vec::new(),
            thinking_tokens: 0,
            injected: None,
        }
    }

    pub fn params(&self) -> &GenParams {
        &self.params
    }

    /// Routes released text to the thinking or the answer.
    fn route(&mut self, text: &str, out: &mut Emitted) -> bool {
        let mut rest = text.to_owned();
        if let Some(think) = &mut self.think {
            match think.push_split(&rest) {
                (StopOutcome::Continue(t), _) => {
                    out.reasoning.push_str(&t);
                    return false;
                }
                (StopOutcome::Stopped(t), after) => {
                    out.reasoning.push_str(&t);
                    rest = after;
                    self.think = None;
                }
            }
        }
        if !self.answering {
            rest = rest.trim_start().to_owned();
            self.answering = !rest.is_empty();
        }
        match self.stops.push(&rest) {
            StopOutcome::Continue(t) => {
                out.content.push_str(&t);
                false
            }
            StopOutcome::Stopped(t) => {
                out.content.push_str(&t);
                out.stop_string = self.stops.matched().map(str::to_owned);
                true
            }
        }
    }

    /// Whether the thinking budget calls for the wrap-up before a token with `bytes`.
    fn wrap_up_due(&self, bytes: &[u8]) -> bool {
        let Some(budget) = self.params.thinking.as_ref().and_then(|t| t.budget) else {
            return false;
        };
        self.think.is_some()
            && self.injected.is_none()
            && (self.thinking_tokens >= budget
                || (self.thinking_tokens + WRAP_UP_WINDOW >= budget && starts_word(bytes)))
    }

    /// Picks the next token from `logits`; `room` is how many more positions the
    /// context holds after this token.
    pub fn step(&mut self, tok: &Tokenizer, logits: &mut [f32], room: usize) -> Emitted {
        let log_probs = self.params.logprobs.map(|n| (log_softmax(logits), n));
        // The grammar takes over once the thinking is over.
        let constraint = self.constraint.as_mut().filter(|_| self.think.is_none());
        let constrained = constraint.is_some();
        if let Some(c) = constraint {
            if let Err(e) = c.mask(logits) {
                return Emitted {
                    error: Some(e.to_string()),
                    ..Emitted::default()
                };
            }
        }
        let id = self.sampler.sample(logits);
        let logprob = log_probs.map(|(lp, n)| TokenLogprob {
            id,
            logprob: lp[id as usize],
            top: top_n(&lp, n),
        });
        let mut out = Emitted {
            logprob,
            ..Emitted::default()
        };
        if tok.vocab().eog.contains(&id) {
            // Inside the thinking (so nothing injected yet: both injections end it), the
            // end of turn is dropped and the end marker fed in its place.
            let close = self
                .params
                .thinking
                .as_ref()
                .and_then(|t| t.close.clone())
                .filter(|(_, tokens)| self.think.is_some() && room > tokens.len());
            if let Some((text, tokens)) = close {
                self.injected = Some(Injected::Close);
                self.inject(text, tokens, &mut out);
                return out;
            }
            let tail = self.decoder.finish();
            self.route(&tail, &mut out);
            self.release_held(&mut out);
            out.finish = Some(FinishReason::Stop);
            return out;
        }
        let mut bytes = Vec::new();
        tok.token_bytes(id, false, &mut bytes);
        let wrap_up_fits = self
            .params
            .thinking
            .as_ref()
            .is_some_and(|t| room > t.wrap_up.1.len());
        if wrap_up_fits && self.wrap_up_due(&bytes) {
            // The sampled token is dropped; the wrap-up is fed in its place.
            self.injected = Some(Injected::WrapUp);
            let (text, tokens) = self
                .params
                .thinking
                .as_ref()
                .expect("budget implies thinking")
                .wrap_up
                .clone();
            self.inject(text, tokens, &mut out);
            return out;
        }
        let mut complete = false;
        if let Some(c) = self.constraint.as_mut().filter(|_| constrained) {
            if let Err(e) = c.accept(id) {
                out.error = Some(e.to_string());
                return out;
            }
            complete = c.is_complete();
        }
        self.generated.push(id);
        if self.think.is_some() {
            self.thinking_tokens += 1;
        }
        out.id = Some(id);
        let piece = self.decoder.push(&bytes);
        let stopped = self.route(&piece, &mut out);
        if stopped {
            out.finish = Some(FinishReason::Stop);
        } else if complete {
            // A complete grammar allows only an end of generation: it ends here.
            let tail = self.decoder.finish();
            if !self.route(&tail, &mut out) {
                self.release_held(&mut out);
            }
            out.finish = Some(FinishReason::Stop);
        } else if self.generated.len() >= self.params.max_tokens || room == 0 {
            let tail = self.decoder.finish();
            if !self.route(&tail, &mut out) {
                self.release_held(&mut out);
            }
            out.finish = Some(FinishReason::Length);
        }
        out
    }

    /// Feeds `tokens` (whose text is `text`) in place of the sampled token.
    fn inject(&mut self, text: String, tokens: Vec<u32>, out: &mut Emitted) {
        let text = format!("{}{text}", self.decoder.finish());
        out.logprob = None;
        out.inject = Some(tokens);
        self.route(&text, out);
    }

    /// Releases text held back for a possible marker or stop string at the end.
    fn release_held(&mut self, out: &mut Emitted) {
        if let Some(think) = &mut self.think {
            out.reasoning.push_str(&think.finish());
        }
        out.content.push_str(&self.stops.finish());
    }
}

/// The `n` largest values with their indices, largest first (ties: lower index first).
fn top_n(values: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut all: Vec<(u32, f32)> = values
        .iter()
        .enumerate()
        .map(|(i, &v)| (i as u32, v))
        .collect();
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

    #[test]
    fn word_starts() {
        assert!(starts_word(b" the"));
        assert!(starts_word(b"\n"));
        assert!(starts_word(b","));
        assert!(!starts_word(b"ing"));
        assert!(!starts_word("é".as_bytes()));
    }
}
