//! A loaded model and the sequences it runs: batches cut from several sequences' tokens,
//! the decode step a session keeps (and a backend may record and replay), and the
//! output head. The layers are the architecture's ([`crate::models`]); the device is the
//! backend's, a type parameter.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use astra_gguf::GgufFile;

use crate::attention::KvLayout;
use crate::backend::{Backend, HostBuf, Input, SeqRows};
use crate::config::Config;
use crate::cpu::CpuBackend;
use crate::models::{Activations, Pass, Stage, Weights};
use crate::EngineError;

/// Tokens per forward batch; longer inputs run as consecutive batches (with the same
/// results, by the determinism of every step).
pub const MAX_BATCH: usize = 512;

/// How llama-server (`-b 2048`, the default) feeds a prompt to llama.cpp, which
/// [`Model::prompt_batch_end`] follows where the bits depend on it: batches of at most
/// [`LLAMA_SERVER_BATCH`] tokens, each run in micro-batches of [`MAX_BATCH`] (its
/// `n_ubatch`); and, for a model with a sliding window, a batch ends
/// [`LLAMA_SERVER_CHECKPOINTS`] tokens before the prompt's end, where the server
/// checkpoints the cache.
const LLAMA_SERVER_BATCH: usize = 2048;
/// See [`LLAMA_SERVER_BATCH`]: 4 + `n_ubatch` and 4 tokens before a prompt's end.
const LLAMA_SERVER_CHECKPOINTS: [usize; 2] = [4 + MAX_BATCH, 4];

pub struct Model<B: Backend = CpuBackend> {
    pub file: Arc<GgufFile>,
    pub cfg: Config,
    pub backend: B,
    weights: Weights<B>,
    weight_bytes_per_token: usize,
}

/// One sequence's state: its KV cache and how many positions it holds.
pub struct Session<B: Backend = CpuBackend> {
    kv: B::KvCache,
    ctx: usize,
    kv_bytes: usize,
    rewind_limit: usize,
    /// Positions held (the next token goes at this position).
    n_past: usize,
    /// The highest position count reached since the cache was last emptied.
    high: usize,
    /// The decode step's buffers and recorded launches, made at the first one.
    decode: Option<DecodeStep<B>>,
}

impl<B: Backend> Session<B> {
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Positions held: the next token goes at this position.
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Keeps the first `n` positions (at most those held) to continue from, and returns
    /// how many it kept: `n`, or 0 when a sliding-window ring has already overwritten
    /// entries that continuing from `n` would need.
    pub fn rewind(&mut self, n: usize) -> usize {
        let n = n.min(self.n_past);
        self.n_past = if self.high - n <= self.rewind_limit {
            n
        } else {
            0
        };
        if self.n_past == 0 {
            self.high = 0;
        }
        self.n_past
    }

    /// The session's KV cache.
    pub fn kv(&self) -> &B::KvCache {
        &self.kv
    }

    /// Bytes of KV cache the session can take at its whole context.
    pub fn kv_bytes(&self) -> usize {
        self.kv_bytes
    }

    /// Counts `n` more positions held.
    fn advance(&mut self, n: usize) {
        self.n_past += n;
        self.high = self.high.max(self.n_past);
    }
}

/// What a session's decode steps (one token, its logits wanted) run over: every
/// buffer they write or read, kept from step to step, and the launches recorded over
/// them where the backend records.
struct DecodeStep<B: Backend> {
    acts: Activations<B>,
    normed: B::Tensor,
    logits: B::Tensor,
    token: B::Ids,
    position: B::Ids,
    graph: Option<B::Graph>,
}

impl<B: Backend> DecodeStep<B> {
    fn new(be: &B, cfg: &Config) -> Result<DecodeStep<B>, EngineError> {
        Ok(DecodeStep {
            acts: Activations::new(be, cfg, 1)?,
            normed: be.tensor(1, cfg.n_embd)?,
            logits: be.tensor(1, cfg.n_vocab)?,
            token: be.ids(&[0])?,
            position: be.ids(&[0])?,
            graph: None,
        })
    }
}

/// Tokens for one sequence in [`Model::forward_many`]: logits are returned for the
/// tokens from index `logits_from` on.
pub struct Step<'a, B: Backend = CpuBackend> {
    pub session: &'a mut Session<B>,
    pub tokens: &'a [u32],
    pub logits_from: usize,
}

/// What [`Model::forward_many`] returns: each [`Step`]'s logits, one step after
/// another in host memory of the backend's. Kept by the caller from step to step, it
/// allocates nothing once it has grown to the largest batch.
pub struct Logits<B: Backend = CpuBackend> {
    values: B::Host,
    spans: Vec<Range<usize>>,
}

impl<B: Backend> Default for Logits<B> {
    fn default() -> Logits<B> {
        Logits {
            values: B::Host::default(),
            spans: Vec::new(),
        }
    }
}

impl<B: Backend> Logits<B> {
    /// How many steps' logits it holds.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Step `i`'s logits (token-major, `n_vocab` each; empty where none were wanted).
    pub fn get(&self, i: usize) -> &[f32] {
        &self.values[self.spans[i].clone()]
    }

    pub fn get_mut(&mut self, i: usize) -> &mut [f32] {
        &mut self.values[self.spans[i].clone()]
    }

    /// Each step's logits as a vector of its own.
    pub fn to_vecs(&self) -> Vec<Vec<f32>> {
        (0..self.len()).map(|i| self.get(i).to_vec()).collect()
    }

    fn clear(&mut self) {
        self.values.clear();
        self.spans.clear();
    }

    /// Records that `step`'s logits continue with `values[r]`. A step's rows come in
    /// consecutive batches, its last rows of one batch directly before its first of
    /// the next, so its values are consecutive.
    fn extend(&mut self, step: usize, r: Range<usize>) {
        let span = &mut self.spans[step];
        if span.start == span.end {
            *span = r;
        } else {
            debug_assert_eq!(span.end, r.start, "a step's logits are consecutive");
            span.end = r.end;
        }
    }
}

/// What [`Model::trace`] read back: every token's residual stream at each stage, in
/// forward order, and every token's logits.
pub struct Trace {
    pub stages: Vec<(Stage, Vec<f32>)>,
    pub logits: Vec<f32>,
}

/// A sequence's slice of one batch: `tokens[range]` of step `step`.
struct Part {
    step: usize,
    range: std::ops::Range<usize>,
}

impl Model<CpuBackend> {
    /// Loads a GGUF model to run on the CPU with `threads` threads.
    pub fn load(path: &Path, threads: usize) -> Result<Arc<Model>, EngineError> {
        Model::load_on(CpuBackend::new(threads), path)
    }

    pub fn threads(&self) -> usize {
        self.backend.threads()
    }
}

impl<B: Backend> Model<B> {
    /// Loads a GGUF model onto `backend`.
    pub fn load_on(backend: B, path: &Path) -> Result<Arc<Model<B>>, EngineError> {
        let file = Arc::new(GgufFile::open(path).map_err(|e| EngineError::Load(e.to_string()))?);
        let cfg = Config::from_metadata(file.metadata())?;
        let (weights, weight_bytes_per_token) = Weights::load(&backend, &file, &cfg)?;
        Ok(Arc::new(Model {
            weight_bytes_per_token,
            file,
            cfg,
            backend,
            weights,
        }))
    }

    /// Bytes of weights read to decode one token: every matrix once, plus one embedding
    /// row.
    pub fn weight_bytes_per_token(&self) -> usize {
        self.weight_bytes_per_token
    }

    /// A new sequence with room for `ctx` positions.
    pub fn session(&self, ctx: usize) -> Result<Session<B>, EngineError> {
        if ctx == 0 || ctx > self.cfg.ctx_train.max(1) {
            return Err(EngineError::Invalid(format!(
                "context {ctx} is outside 1..={} (the model's training context)",
                self.cfg.ctx_train
            )));
        }
        let layout = KvLayout::new(&self.cfg, ctx, MAX_BATCH).of(self.backend.kv_type());
        Ok(Session {
            kv: self.backend.kv_cache(&layout)?,
            kv_bytes: layout.bytes(),
            rewind_limit: layout.rewind_limit(),
            ctx,
            n_past: 0,
            high: 0,
            decode: None,
        })
    }

    /// A new sequence holding the first `n` positions of `s` (at most those it holds),
    /// sharing `s`'s memory for them where the backend shares caches: what continuing
    /// `s` from `n` would see, with `s` left as it is. `None` where the backend does
    /// not share caches or a sliding window of `s` has already let go of what
    /// continuing from `n` needs.
    pub fn fork(&self, s: &Session<B>, n: usize) -> Option<Session<B>> {
        let n = n.min(s.n_past);
        if s.high - n > s.rewind_limit {
            return None;
        }
        Some(Session {
            kv: self.backend.kv_fork(&s.kv, n)?,
            kv_bytes: s.kv_bytes,
            rewind_limit: s.rewind_limit,
            ctx: s.ctx,
            n_past: n,
            // The pages a window let go of are those of `s`, reckoned from its highest
            // position: a rewind of the fork is bounded from there.
            high: s.high,
            decode: None,
        })
    }

    /// Runs `tokens` at the session's next positions and returns the logits of the
    /// tokens from index `logits_from` on (token-major, `n_vocab` each).
    pub fn forward(
        &self,
        s: &mut Session<B>,
        tokens: &[u32],
        logits_from: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let mut out = Logits::default();
        self.forward_many(
            &mut [Step {
                session: s,
                tokens,
                logits_from,
            }],
            &mut out,
        )?;
        Ok(out.values.into_vec())
    }

    /// Runs a prompt's `tokens` after what `s` holds of it and returns the last token's
    /// logits: in batches cut as [`Model::prompt_batch_end`] says.
    pub fn prefill(&self, s: &mut Session<B>, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::Invalid("an empty prompt has no logits".into()));
        }
        let (from, n) = (s.n_past, s.n_past + tokens.len());
        let mut fed = from;
        loop {
            let end = self.prompt_batch_end(fed, n, None);
            let part = &tokens[fed - from..end - from];
            let logits = self.forward(s, part, part.len() - 1)?;
            if end == n {
                return Ok(logits);
            }
            fed = end;
        }
    }

    /// Where the batch starting at position `fed` of an `n`-token prompt ends. With
    /// astra's arithmetic, at `n`: the bits are the same however a prompt is cut, so it
    /// runs in the largest batches. Where they depend on the batches (llama.cpp's
    /// arithmetic), as llama-server cuts it (`LLAMA_SERVER_BATCH`), so that a prompt
    /// gets llama-server's logits; `user_turn`, the position where a chat prompt's last
    /// user turn starts, also ends a batch for a sliding-window model, as llama-server
    /// does where it knows the template's turns.
    pub fn prompt_batch_end(&self, fed: usize, n: usize, user_turn: Option<usize>) -> usize {
        if !self.backend.batches_as_llama_server() || fed >= n {
            return n;
        }
        let end = n.min(fed + LLAMA_SERVER_BATCH);
        if self.cfg.sliding_window.is_none() {
            return end;
        }
        let cuts = LLAMA_SERVER_CHECKPOINTS
            .iter()
            .map(|&back| n.saturating_sub(back))
            .chain(user_turn);
        cuts.filter(|&c| c > fed && c < end).min().unwrap_or(end)
    }

    /// Runs several sequences together, their tokens sharing each batch (up to
    /// [`MAX_BATCH`] tokens a batch), and puts each one's logits in `out` as
    /// [`Model::forward`] would return them: bitwise the same, whatever else is in the
    /// batch.
    pub fn forward_many(
        &self,
        steps: &mut [Step<'_, B>],
        out: &mut Logits<B>,
    ) -> Result<(), EngineError> {
        out.clear();
        for st in steps.iter() {
            self.check_room(st.session, st.tokens)?;
        }
        out.spans.resize(steps.len(), 0..0);
        // A few sequences' decode rows, each its session's recorded step in turn (the
        // same bits as in one batch).
        let decoding = steps
            .iter()
            .all(|st| st.tokens.len() == 1 && st.logits_from == 0);
        if decoding && steps.len() <= self.backend.separate_decode_steps() {
            for (i, st) in steps.iter_mut().enumerate() {
                let from = out.values.len();
                self.decode_step(st.session, st.tokens[0], &mut out.values)?;
                out.extend(i, from..out.values.len());
            }
            return Ok(());
        }
        let mut done = vec![0usize; steps.len()];
        loop {
            // Fill a batch with the next tokens of each sequence in turn.
            let mut parts = Vec::new();
            let mut room = MAX_BATCH;
            for (i, st) in steps.iter().enumerate() {
                let take = (st.tokens.len() - done[i]).min(room);
                if take > 0 {
                    parts.push(Part {
                        step: i,
                        range: done[i]..done[i] + take,
                    });
                    room -= take;
                }
            }
            if parts.is_empty() {
                break;
            }
            let from = out.values.len();
            let counts = self.forward_batch(steps, &parts, &mut out.values)?;
            let mut at = from;
            for (p, n) in parts.iter().zip(counts) {
                if n > 0 {
                    out.extend(p.step, at..at + n);
                }
                at += n;
                done[p.step] = p.range.end;
            }
        }
        Ok(())
    }

    /// That `tokens` fit in `s` after what it holds and are in the vocabulary.
    fn check_room(&self, s: &Session<B>, tokens: &[u32]) -> Result<(), EngineError> {
        let needed = s.n_past + tokens.len();
        if needed > s.ctx {
            return Err(EngineError::ContextFull { ctx: s.ctx, needed });
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.n_vocab) {
            return Err(EngineError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.cfg.n_vocab
            )));
        }
        Ok(())
    }

    /// Runs `tokens` (one batch, at most [`MAX_BATCH`]) at the session's next positions
    /// as [`Model::forward`] does, reading the residual stream back after the embedding
    /// and after every layer's attention and feed-forward blocks: where two backends
    /// part, and by how much, stage by stage.
    pub fn trace(&self, s: &mut Session<B>, tokens: &[u32]) -> Result<Trace, EngineError> {
        if tokens.is_empty() || tokens.len() > MAX_BATCH {
            return Err(EngineError::Invalid(format!(
                "a trace takes 1..={MAX_BATCH} tokens, not {}",
                tokens.len()
            )));
        }
        self.check_room(s, tokens)?;
        let (cfg, be) = (&self.cfg, &self.backend);
        be.kv_reserve(&mut s.kv, s.n_past..s.n_past + tokens.len())?;
        let positions: Vec<u32> = (s.n_past..s.n_past + tokens.len())
            .map(|p| p as u32)
            .collect();
        let mut acts = Activations::new(be, cfg, tokens.len())?;
        let mut read = Vec::new();
        let mut probe = |stage: Stage, x: &B::Tensor| read.push((stage, be.read(x)));
        let pos = s.n_past;
        let mut seqs = [SeqRows {
            kv: &mut s.kv,
            rows: 0..tokens.len(),
            pos,
        }];
        let (tokens_on, positions_on) = (be.ids(tokens)?, be.ids(&positions)?);
        self.weights.forward(
            be,
            cfg,
            Pass {
                acts: &mut acts,
                tokens: &tokens_on,
                positions: &positions_on,
                seqs: &mut seqs,
                probe: Some(&mut probe),
            },
        )?;
        s.advance(tokens.len());
        let mut normed = be.tensor(tokens.len(), cfg.n_embd)?;
        let mut logits = be.tensor(tokens.len(), cfg.n_vocab)?;
        self.head(&acts.x, &mut normed, &mut logits);
        let logits = be.read_owned(logits)?;
        be.check()?;
        let stages = read
            .into_iter()
            .map(|(stage, x)| Ok((stage, x?)))
            .collect::<Result<_, EngineError>>()?;
        Ok(Trace { stages, logits })
    }

    /// One batch through the model: each part's logits for its tokens at or after its
    /// step's `logits_from` appended to `out`, part after part; returns how many values
    /// each part appended.
    fn forward_batch(
        &self,
        steps: &mut [Step<'_, B>],
        parts: &[Part],
        out: &mut B::Host,
    ) -> Result<Vec<usize>, EngineError> {
        if let [p] = parts {
            let st = &mut steps[p.step];
            if p.range.len() == 1 && p.range.start >= st.logits_from {
                let from = out.len();
                self.decode_step(st.session, st.tokens[p.range.start], out)?;
                return Ok(vec![out.len() - from]);
            }
        }
        let (cfg, be) = (&self.cfg, &self.backend);
        for p in parts {
            let s = &mut *steps[p.step].session;
            be.kv_reserve(&mut s.kv, s.n_past..s.n_past + p.range.len())?;
        }
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::with_capacity(parts.len());
        let mut wanted = Vec::new();
        for p in parts {
            let st = &steps[p.step];
            let start = tokens.len();
            let first_pos = st.session.n_past;
            for (i, j) in p.range.clone().enumerate() {
                if j >= st.logits_from {
                    wanted.push(start + i);
                }
                tokens.push(st.tokens[j]);
                positions.push((first_pos + i) as u32);
            }
            spans.push((start..tokens.len(), first_pos));
        }
        let t = tokens.len();
        let mut acts = Activations::new(be, cfg, t)?;
        let (tokens, positions) = (be.ids(&tokens)?, be.ids(&positions)?);
        {
            let mut sessions: Vec<Option<&mut Session<B>>> =
                steps.iter_mut().map(|s| Some(&mut *s.session)).collect();
            let mut seqs: Vec<SeqRows<'_, B::KvCache>> = parts
                .iter()
                .zip(&spans)
                .map(|(p, (rows, pos))| {
                    let s = sessions[p.step]
                        .take()
                        .expect("one part per sequence in a batch");
                    SeqRows {
                        kv: &mut s.kv,
                        rows: rows.clone(),
                        pos: *pos,
                    }
                })
                .collect();
            let pass = Pass {
                acts: &mut acts,
                tokens: &tokens,
                positions: &positions,
                seqs: &mut seqs,
                probe: None,
            };
            self.weights.forward(be, cfg, pass)?;
        }
        for p in parts {
            let s = &mut *steps[p.step].session;
            s.advance(p.range.len());
        }
        if wanted.is_empty() {
            be.check()?;
            return Ok(vec![0; parts.len()]);
        }
        let mut normed = be.tensor(wanted.len(), cfg.n_embd)?;
        let mut logits = be.tensor(wanted.len(), cfg.n_vocab)?;
        if wanted.len() == t {
            self.head(&acts.x, &mut normed, &mut logits);
        } else {
            self.head(&be.gather(&acts.x, &wanted)?, &mut normed, &mut logits);
        }
        // `wanted` is in batch order, so each part's rows are consecutive.
        let counts: Vec<usize> = spans
            .iter()
            .map(|(span, _)| wanted.iter().filter(|r| span.contains(r)).count() * cfg.n_vocab)
            .collect();
        be.read_append(&logits, out)?;
        be.check()?;
        Ok(counts)
    }

    /// One token of one sequence, its logits wanted: the decode step. It runs over
    /// buffers the session keeps, so that a backend that records its launches replays
    /// them for every later step, with only the token and position written anew.
    fn decode_step(
        &self,
        s: &mut Session<B>,
        token: u32,
        out: &mut B::Host,
    ) -> Result<(), EngineError> {
        let (be, cfg) = (&self.backend, &self.cfg);
        let pos = s.n_past;
        be.kv_reserve(&mut s.kv, pos..pos + 1)?;
        if s.decode.is_none() {
            s.decode = Some(DecodeStep::new(be, cfg)?);
        }
        let d = s.decode.as_mut().expect("made above");
        be.write_ids(&mut d.token, &[token]);
        be.write_ids(&mut d.position, &[pos as u32]);
        if !d.graph.as_ref().is_some_and(|g| be.replay(g)) {
            let kv = &mut s.kv;
            let DecodeStep {
                acts,
                normed,
                logits,
                token,
                position,
                graph,
            } = d;
            let mut outcome = Ok(());
            let mut launches = || {
                let pass = Pass {
                    acts: &mut *acts,
                    tokens: token,
                    positions: position,
                    seqs: &mut [SeqRows {
                        kv: &mut *kv,
                        rows: 0..1,
                        pos,
                    }],
                    probe: None,
                };
                outcome = self.weights.forward(be, cfg, pass);
                self.head(&acts.x, normed, logits);
            };
            // Routing reads the router's scores on the host mid-pass: such a step
            // cannot be recorded.
            *graph = if cfg.moe.is_some() {
                launches();
                None
            } else {
                be.record(&mut launches)
            };
            outcome?;
        }
        let read = be.read_append(&d.logits, out);
        s.advance(1);
        read?;
        be.check()
    }

    /// The output norm and matrix: `logits` of the rows of `x`.
    fn head(&self, x: &B::Tensor, normed: &mut B::Tensor, logits: &mut B::Tensor) {
        let (be, w) = (&self.backend, &self.weights);
        be.product(
            Input::Normed {
                x,
                w: &w.output_norm,
                eps: self.cfg.rms_eps,
                normed,
            },
            &mut [(w.output(), logits)],
            None,
        );
    }
}
