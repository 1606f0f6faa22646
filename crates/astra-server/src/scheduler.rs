//! Continuous batching over a fixed number of slots, with the prompt cache.
//!
//! Protocol (one scheduler thread owns the model's sequences):
//! 1. Requests wait in a bounded queue; a request joins between steps when a slot is
//!    free.
//! 2. A joining request starts from the sequence whose cached tokens share the longest
//!    prefix with its prompt (a finished request's sequence stays idle with its tokens:
//!    the prompt cache; a running one counts too): where the backend shares KV pages
//!    it forks that sequence at the prefix, else it takes an idle one over and rewinds
//!    it. It feeds only the rest.
//! 3. Each step runs every active sequence together in one forward pass: one token per
//!    decoding sequence, and prompt chunks of prefilling ones in the room left in the
//!    batch. Each result goes to its client as it is sampled; finished or abandoned
//!    requests leave before the next step.
//!
//! Invariants: a sequence's logits do not depend on the others in the batch
//! ([`Model::forward_many`]), so a request's output is the same alone or under load;
//! idle sequences and active ones together stay within the memory budget (a paged
//! backend's pages, a page shared by several sequences counted once), the least
//! recently used idle ones dropped first.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use astra_engine::attention::CHUNK as KV_PAGE_POSITIONS;
use astra_engine::{Backend, EngineError, Logits, Model, Session, Step, MAX_BATCH};
use astra_tokenizer::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::generation::{Emitted, FinishReason, GenParams, Generation, Injected};
use crate::metrics::Metrics;

/// What the prompt cache is keyed by: the prompt's tokens and the digests of the
/// images that came with it (a changed image, even of the same length, changes the key).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptKey {
    pub tokens: Vec<u32>,
    pub media: Vec<[u8; 32]>,
}

impl PromptKey {
    /// Tokens of this prompt a sequence cached under `cached` can skip: their common
    /// prefix (none when the images differ), short of the prompt's last token, whose
    /// logits start the generation.
    pub fn reusable_from(&self, cached: &PromptKey) -> usize {
        self.reusable_from_tokens(&cached.tokens, &cached.media)
    }

    /// As [`PromptKey::reusable_from`], for a sequence holding `tokens` that came with
    /// images of digests `media`.
    pub fn reusable_from_tokens(&self, tokens: &[u32], media: &[[u8; 32]]) -> usize {
        if self.media != media {
            return 0;
        }
        common_prefix(&self.tokens, tokens).min(self.tokens.len().saturating_sub(1))
    }
}

/// Whether the model is in memory, as `/health` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Loading,
    Ready,
    /// Unloaded after `--keep-alive` of idleness; the next request loads it.
    Idle,
}

#[derive(Default)]
pub struct ModelStatus(AtomicU8);

impl ModelStatus {
    pub fn get(&self) -> Status {
        match self.0.load(Ordering::Acquire) {
            1 => Status::Ready,
            2 => Status::Idle,
            _ => Status::Loading,
        }
    }

    pub fn set(&self, s: Status) {
        self.0.store(
            match s {
                Status::Loading => 0,
                Status::Ready => 1,
                Status::Idle => 2,
            },
            Ordering::Release,
        );
    }
}

/// Events a request's response has not taken yet beyond which its generation pauses:
/// a client that stops reading holds this much, not everything generated since.
pub const MAX_BACKLOG: usize = 64;

/// A request's events on their way from the scheduler to its response, counted until
/// the response takes them.
pub fn event_channel() -> (EventSender, EventReceiver) {
    let (tx, rx) = unbounded_channel();
    let backlog = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    (
        EventSender {
            tx,
            backlog: Arc::clone(&backlog),
        },
        EventReceiver { rx, backlog },
    )
}

#[derive(Clone)]
pub struct EventSender {
    tx: UnboundedSender<Event>,
    backlog: Arc<std::sync::atomic::AtomicUsize>,
}

impl EventSender {
    pub fn send(&self, e: Event) {
        self.backlog.fetch_add(1, Ordering::SeqCst);
        if self.tx.send(e).is_err() {
            self.backlog.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// The response is gone (its client disconnected).
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Events sent and not yet taken.
    pub fn backlog(&self) -> usize {
        self.backlog.load(Ordering::SeqCst)
    }
}

pub struct EventReceiver {
    rx: UnboundedReceiver<Event>,
    backlog: Arc<std::sync::atomic::AtomicUsize>,
}

impl EventReceiver {
    pub async fn recv(&mut self) -> Option<Event> {
        let e = self.rx.recv().await;
        if e.is_some() {
            self.backlog.fetch_sub(1, Ordering::SeqCst);
        }
        e
    }

    /// An event if one is waiting.
    pub fn try_recv(&mut self) -> Result<Event, tokio::sync::mpsc::error::TryRecvError> {
        let e = self.rx.try_recv()?;
        self.backlog.fetch_sub(1, Ordering::SeqCst);
        Ok(e)
    }
}

/// One sequence to generate: a request's prompt (one per requested choice).
pub struct Job {
    pub key: PromptKey,
    pub params: GenParams,
    /// The choice index within the request.
    pub index: usize,
    pub events: EventSender,
    pub received: Instant,
    /// How long the model stays loaded after this request (`Some(None)`: for good;
    /// `None`: the server's `--keep-alive`).
    pub keep_alive: Option<Option<Duration>>,
}

/// Token counts and timings of a finished sequence.
#[derive(Clone, Debug, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub reasoning_tokens: usize,
    pub prompt_ms: f64,
    pub predicted_ms: f64,
}

pub enum Event {
    Token {
        index: usize,
        emitted: Emitted,
    },
    Done {
        index: usize,
        finish: FinishReason,
        usage: Usage,
    },
    Failed {
        index: usize,
        message: String,
    },
}

struct Idle<B: Backend> {
    session: Session<B>,
    key: PromptKey,
    used: u64,
}

struct Active<B: Backend> {
    job: Job,
    session: Session<B>,
    /// The tokens in the session's cache, in order.
    tokens: Vec<u32>,
    /// The tokens to have in the cache before sampling: the prompt, or for a request
    /// resumed after a pause, every token it had.
    feed: Vec<u32>,
    /// Tokens of `feed` already in the cache.
    fed: usize,
    /// Tokens to feed next: the last sampled one, or an injected wrap-up.
    next: Vec<u32>,
    generation: Generation,
    cached: usize,
    prompt_done: Option<Instant>,
    last_token: Instant,
    /// Since when the response has held MAX_BACKLOG events untaken (its client not
    /// reading): the sequence waits, and after `Limits::stall_timeout` is cancelled.
    stalled_since: Option<Instant>,
}

/// A request waiting for a sequence: a new one, or one paused for want of KV pages
/// (its cache let go of, to be rebuilt from its tokens once pages are free).
struct Pending {
    job: Job,
    /// The tokens to have in the cache before sampling: the prompt, or every token a
    /// paused sequence had, the last sampled one included.
    feed: Vec<u32>,
    generation: Generation,
    /// Prompt tokens the request found cached, once it has started.
    cached: Option<usize>,
    prompt_done: Option<Instant>,
    last_token: Instant,
}

/// Loads the model (again, after an idle unload).
pub type Loader<B> = Box<dyn Fn() -> Result<Arc<Model<B>>, String> + Send>;

/// The scheduler's limits.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Sequences decoded together.
    pub parallel: usize,
    /// Positions per sequence.
    pub ctx: usize,
    /// Bytes all sequences (active and idle) may take.
    pub budget: usize,
    /// Idle time before the model is unloaded; `None`: never.
    pub keep_alive: Option<Duration>,
    /// How long a sequence whose client stopped reading waits before it is cancelled.
    pub stall_timeout: Duration,
}

pub struct Scheduler<B: Backend> {
    model: Option<Arc<Model<B>>>,
    loader: Loader<B>,
    status: Arc<ModelStatus>,
    tok: Arc<Tokenizer>,
    jobs: Receiver<Job>,
    metrics: Arc<Metrics>,
    limits: Limits,
    /// Idle time before unloading, as the last finished request set it.
    hold: Option<Duration>,
    idle: Vec<Idle<B>>,
    active: Vec<Active<B>>,
    /// Requests paused for want of KV pages, in the order they paused; they resume
    /// before any new request starts.
    paused: VecDeque<Pending>,
    clock: u64,
    /// When device memory was last sampled.
    sampled: Option<Instant>,
    pace: PrefillPace,
    /// The last step's logits, their memory kept for the next step.
    logits: Logits<B>,
}

/// How many prompt tokens a step may take beside decoding rows: the chunked prefill's
/// pace, from a running fit of a step's time as a fixed part plus a part per row
/// (decoding row or prompt token), weighted toward the newest steps.
#[derive(Debug, Default)]
struct PrefillPace {
    /// Decayed sums over the steps seen: weight, rows, seconds, rows², rows·seconds.
    n: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl PrefillPace {
    /// How much of the sums each new step keeps.
    const KEEP: f64 = 0.9;

    /// (seconds a step takes whatever its rows, seconds a row adds), once measured.
    fn fit(&self) -> Option<(f64, f64)> {
        if self.n == 0.0 {
            return None;
        }
        let (mx, my) = (self.x / self.n, self.y / self.n);
        let var = self.xx / self.n - mx * mx;
        let per_row = match var > 0.25 {
            true => (self.xy / self.n - mx * my) / var,
            false => 0.0,
        };
        // Without spread in the rows seen (or with a fit that says a row costs nothing
        // or the fixed part is negative), the time is taken as all per row.
        let fixed = my - per_row * mx;
        if per_row > 0.0 && fixed >= 0.0 {
            Some((fixed, per_row))
        } else {
            (mx > 0.0).then(|| (0.0, my / mx))
        }
    }

    /// Prompt tokens that a step with `decode_rows` decoding rows may take: as many as
    /// add the time of a step of those rows alone (at least one, so that a prompt always
    /// advances); before anything is measured, as many as there are decoding rows.
    fn prompt_rows(&self, decode_rows: usize) -> usize {
        match self.fit() {
            Some((fixed, per_row)) if per_row > 0.0 => {
                let step = fixed + per_row * decode_rows as f64;
                ((step / per_row).round() as usize).clamp(1, MAX_BATCH)
            }
            _ => decode_rows.max(1),
        }
    }

    /// Learns from a step of `rows` rows that took `seconds`.
    fn observe(&mut self, rows: usize, seconds: f64) {
        let x = rows as f64;
        self.n = Self::KEEP * self.n + 1.0;
        self.x = Self::KEEP * self.x + x;
        self.y = Self::KEEP * self.y + seconds;
        self.xx = Self::KEEP * self.xx + x * x;
        self.xy = Self::KEEP * self.xy + x * seconds;
    }
}

/// How long a prompt may wait behind shorter ones before it goes first.
const PROMPT_PATIENCE: Duration = Duration::from_secs(2);

/// Lets go of the least recently used finished sequence; false when there is none.
fn evict_lru<B: Backend>(idle: &mut Vec<Idle<B>>) -> bool {
    let Some(lru) = (0..idle.len()).min_by_key(|&i| idle[i].used) else {
        return false;
    };
    idle.swap_remove(lru);
    true
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<B: Backend> Scheduler<B> {
    /// A scheduler for `model` (loaded by `loader`, which reloads it after an idle
    /// unload), reporting its state in `status`.
    pub fn new(
        model: Arc<Model<B>>,
        loader: Loader<B>,
        status: Arc<ModelStatus>,
        tok: Arc<Tokenizer>,
        jobs: Receiver<Job>,
        metrics: Arc<Metrics>,
        limits: Limits,
    ) -> Scheduler<B> {
        metrics
            .slots_total
            .store(limits.parallel as u64, Ordering::Relaxed);
        status.set(Status::Ready);
        model.backend.set_kv_limit(limits.budget);
        Scheduler {
            model: Some(model),
            loader,
            status,
            tok,
            jobs,
            metrics,
            hold: limits.keep_alive,
            limits,
            idle: Vec::new(),
            active: Vec::new(),
            paused: VecDeque::new(),
            clock: 0,
            sampled: None,
            pace: PrefillPace::default(),
            logits: Logits::default(),
        }
    }

    /// Samples the device's memory in use, at most once a second (the model's backend
    /// lives on this thread).
    fn sample_device(&mut self) {
        if self
            .sampled
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        self.sampled = Some(Instant::now());
        if let Some(bytes) = self
            .model
            .as_ref()
            .and_then(|m| m.backend.device_memory_in_use())
        {
            self.metrics
                .device_memory_in_use
                .store(bytes, Ordering::Relaxed);
        }
    }

    /// Waits for the next job while nothing is active, unloading the model once it
    /// has been idle for the hold time. `None`: the queue is closed.
    fn wait_for_job(&mut self) -> Option<Job> {
        if let (Some(_), Some(hold)) = (&self.model, self.hold) {
            match self.jobs.recv_timeout(hold) {
                Ok(job) => return Some(job),
                Err(RecvTimeoutError::Disconnected) => return None,
                Err(RecvTimeoutError::Timeout) => {
                    self.idle.clear();
                    // The logits' memory is the device's too (page-locked).
                    self.logits = Logits::default();
                    self.model = None;
                    self.status.set(Status::Idle);
                    eprintln!("astra: INFO model unloaded after {hold:?} idle");
                }
            }
        }
        self.jobs.recv().ok()
    }

    /// The model, loading it first if it was unloaded.
    fn ensure_loaded(&mut self) -> Result<Arc<Model<B>>, String> {
        if let Some(m) = &self.model {
            return Ok(Arc::clone(m));
        }
        self.status.set(Status::Loading);
        let loaded = (self.loader)();
        match &loaded {
            Ok(m) => {
                m.backend.set_kv_limit(self.limits.budget);
                self.model = Some(Arc::clone(m));
                self.status.set(Status::Ready);
                eprintln!("astra: INFO model loaded again");
            }
            Err(_) => self.status.set(Status::Idle),
        }
        loaded
    }

    /// Serves jobs until the queue's senders are gone and every job has finished.
    pub fn run(mut self) {
        loop {
            if !self.admit() {
                return;
            }
            self.drop_abandoned();
            self.sample_device();
            self.publish_slots();
            if self.active.is_empty() {
                continue;
            }
            if self.step() {
                // Requests that finished in the step free their slots now, not when the
                // next request arrives.
                self.publish_slots();
            } else {
                // Every sequence waits for its client to read.
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// The busy-slot gauge (`/health`, `/metrics`) as the slots are now.
    fn publish_slots(&self) {
        self.metrics
            .slots_busy
            .store(self.active.len() as u64, Ordering::Relaxed);
        self.publish_pages();
    }

    /// The KV page gauges, where the backend pages its caches: pages in existence,
    /// those held by more than one sequence, and those only finished sequences hold
    /// (the prompt cache).
    fn publish_pages(&self) {
        let Some(model) = &self.model else { return };
        let be = &model.backend;
        let Some(usage) = be.kv_usage() else { return };
        // Per page: (sequences holding it, whether a running one does).
        let mut holders: HashMap<usize, (usize, bool)> = HashMap::new();
        let sessions = (self.active.iter().map(|a| (&a.session, true)))
            .chain(self.idle.iter().map(|i| (&i.session, false)));
        for (session, running) in sessions {
            for id in be.kv_page_ids(session.kv()) {
                let h = holders.entry(id).or_default();
                h.0 += 1;
                h.1 |= running;
            }
        }
        let shared = holders.values().filter(|h| h.0 > 1).count();
        let cached = holders.values().filter(|h| !h.1).count();
        let m = &self.metrics;
        m.kv_pages.store(usage.pages as u64, Ordering::Relaxed);
        m.kv_pages_shared.store(shared as u64, Ordering::Relaxed);
        m.kv_pages_cached.store(cached as u64, Ordering::Relaxed);
        m.kv_bytes.store(usage.bytes as u64, Ordering::Relaxed);
    }

    /// Bytes of KV cache the sequences take: the backend's pages, or, where it does
    /// not page, every sequence's whole cache.
    fn kv_used(&self) -> usize {
        let paged = self.model.as_ref().and_then(|m| m.backend.kv_usage());
        paged.map_or_else(|| self.session_bytes(), |u| u.bytes)
    }

    /// Moves queued jobs into free slots, waiting for one when nothing is active.
    /// Returns false when the queue is closed and nothing is left to do.
    fn admit(&mut self) -> bool {
        while self.active.len() < self.limits.parallel {
            if let Some(p) = self.paused.front() {
                // A paused request goes before the prompt cache.
                let need = p.feed.len();
                while !self.active.is_empty() && !self.room_for(need) && evict_lru(&mut self.idle) {
                }
                if !self.active.is_empty() && !self.room_for(need) {
                    break;
                }
                let p = self.paused.pop_front().expect("a paused request");
                if let Err(message) = self.activate(p) {
                    eprintln!("astra: {message}");
                }
                continue;
            }
            let job = if self.active.is_empty() {
                match self.wait_for_job() {
                    Some(j) => j,
                    None => return false,
                }
            } else {
                match self.jobs.try_recv() {
                    Ok(j) => j,
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            };
            self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            if job.events.is_closed() {
                continue;
            }
            if let Err(message) = self.start(job) {
                eprintln!("astra: {message}");
            }
        }
        true
    }

    fn session_bytes(&self) -> usize {
        self.idle
            .iter()
            .map(|i| i.session.kv_bytes())
            .chain(self.active.iter().map(|a| a.session.kv_bytes()))
            .sum()
    }

    /// Whether the KV pages left hold a sequence of `tokens` tokens and a page more
    /// for each of the running sequences (always, where the backend does not page).
    fn room_for(&self, tokens: usize) -> bool {
        let Some(model) = &self.model else {
            return true;
        };
        let Some(usage) = model.backend.kv_usage() else {
            return true;
        };
        let per_page = usage.bytes.checked_div(usage.pages).unwrap_or(0);
        let pages = tokens.div_ceil(KV_PAGE_POSITIONS) + 1 + self.active.len();
        usage.bytes + pages * per_page <= usage.limit
    }

    fn start(&mut self, job: Job) -> Result<(), String> {
        let generation = Generation::new(job.params.clone(), &job.key.tokens);
        let feed = job.key.tokens.clone();
        self.activate(Pending {
            job,
            feed,
            generation,
            cached: None,
            prompt_done: None,
            last_token: Instant::now(),
        })
    }

    /// A request running: its tokens fed to a sequence from the longest cached prefix,
    /// after which a paused one samples on as if it had never paused.
    fn activate(&mut self, p: Pending) -> Result<(), String> {
        let key = PromptKey {
            tokens: p.feed,
            media: p.job.key.media.clone(),
        };
        let (session, keep) = match self.open_session(&key) {
            Ok(s) => s,
            Err(message) => {
                p.job.events.send(Event::Failed {
                    index: p.job.index,
                    message: message.clone(),
                });
                return Err(message);
            }
        };
        let cached = p.cached.unwrap_or_else(|| {
            Metrics::add(&self.metrics.prompt_tokens, key.tokens.len());
            Metrics::add(&self.metrics.cached_tokens, keep);
            keep
        });
        self.active.push(Active {
            job: p.job,
            session,
            tokens: key.tokens[..keep].to_vec(),
            feed: key.tokens,
            fed: keep,
            next: Vec::new(),
            generation: p.generation,
            cached,
            prompt_done: p.prompt_done,
            last_token: p.last_token,
            stalled_since: None,
        });
        Ok(())
    }

    /// The running request that started last, paused: its pages let go of, and what it
    /// needs to go on kept until pages are free again.
    fn pause_newest(&mut self) {
        let Some(i) = (0..self.active.len()).max_by_key(|&i| self.active[i].job.received) else {
            return;
        };
        let mut a = self.active.swap_remove(i);
        let feed = if a.fed < a.feed.len() {
            a.feed
        } else {
            a.tokens.append(&mut a.next);
            a.tokens
        };
        Metrics::add(&self.metrics.preemptions, 1);
        self.paused.push_back(Pending {
            job: a.job,
            feed,
            generation: a.generation,
            cached: Some(a.cached),
            prompt_done: a.prompt_done,
            last_token: a.last_token,
        });
    }

    /// A sequence for `key`: where the backend shares caches, one sharing the longest
    /// cached prefix of its tokens, in a finished sequence or a running one; else a
    /// finished sequence taken over, or a new one. With how many of its first tokens
    /// are in the cache already.
    fn open_session(&mut self, key: &PromptKey) -> Result<(Session<B>, usize), String> {
        let model = self
            .ensure_loaded()
            .map_err(|e| format!("loading the model: {e}"))?;
        let reusable = |k: &PromptKey| key.reusable_from(k);
        // (finished sequence or not, its index, positions reusable)
        let mut source: Option<(bool, usize, usize)> = None;
        let candidates = (self.idle.iter().enumerate())
            .map(|(i, entry)| (true, i, reusable(&entry.key)))
            .chain(self.active.iter().enumerate().map(|(i, a)| {
                let n = key.reusable_from_tokens(&a.tokens, &a.job.key.media);
                (false, i, n)
            }));
        for c in candidates {
            if c.2 > source.map_or(0, |s| s.2) {
                source = Some(c);
            }
        }
        let forked = source.and_then(|(finished, i, n)| {
            let from = match finished {
                true => &self.idle[i].session,
                false => &self.active[i].session,
            };
            Some((model.fork(from, n)?, n, finished.then_some(i)))
        });
        let forked = forked.map(|(session, n, idle)| {
            if let Some(i) = idle {
                // The finished sequence shared from is the last to be let go of.
                self.clock += 1;
                self.idle[i].used = self.clock;
            }
            (session, n)
        });
        let paged = model.backend.kv_usage().is_some();
        let best =
            (0..self.idle.len()).max_by_key(|&i| (reusable(&self.idle[i].key), self.idle[i].used));
        let mut taken = match best {
            _ if forked.is_some() => None,
            Some(i) if reusable(&self.idle[i].key) > 0 => Some(self.idle.swap_remove(i)),
            _ => None,
        };
        if taken.is_none() && forked.is_none() && !paged {
            let new_bytes = self.idle.first().map(|i| i.session.kv_bytes());
            let fits = new_bytes.is_none_or(|b| self.session_bytes() + b <= self.limits.budget);
            if !fits {
                // Recycle the least recently used idle sequence.
                let lru = (0..self.idle.len())
                    .min_by_key(|&i| self.idle[i].used)
                    .expect("an idle sequence exists");
                taken = Some(self.idle.swap_remove(lru));
            }
        }
        let (mut session, reuse) = match (forked, taken) {
            (Some(f), _) => f,
            (None, Some(i)) => {
                let n = reusable(&i.key);
                (i.session, n)
            }
            (None, None) => (
                model.session(self.limits.ctx).map_err(|e| e.to_string())?,
                0,
            ),
        };
        let keep = session.rewind(reuse);
        Ok((session, keep))
    }

    /// Frees the slots of clients that went away.
    fn drop_abandoned(&mut self) {
        self.paused.retain(|p| !p.job.events.is_closed());
        let mut i = 0;
        while i < self.active.len() {
            let a = &self.active[i];
            let stalled = a
                .stalled_since
                .is_some_and(|t| t.elapsed() >= self.limits.stall_timeout);
            if stalled {
                a.job.events.send(Event::Failed {
                    index: a.job.index,
                    message: format!(
                        "the client read nothing for {:?}; the request was cancelled",
                        self.limits.stall_timeout
                    ),
                });
            }
            if stalled || a.job.events.is_closed() {
                let a = self.active.swap_remove(i);
                self.retire(a);
            } else {
                i += 1;
            }
        }
    }

    /// Returns a finished sequence to the idle set (the prompt cache).
    fn retire(&mut self, a: Active<B>) {
        self.clock += 1;
        self.hold = a.job.keep_alive.unwrap_or(self.limits.keep_alive);
        let key = PromptKey {
            tokens: a.tokens,
            media: a.job.key.media,
        };
        self.idle.push(Idle {
            session: a.session,
            key,
            used: self.clock,
        });
        while self.kv_used() > self.limits.budget && evict_lru(&mut self.idle) {}
    }

    /// Runs one batch; false when every sequence waits for its client to read.
    fn step(&mut self) -> bool {
        // Decoding sequences first (one token each), prompt chunks in the room left;
        // a sequence whose client has not taken its last MAX_BACKLOG events waits.
        let mut room = MAX_BATCH;
        let mut plan: Vec<(usize, usize)> = Vec::with_capacity(self.active.len()); // (active index, tokens)
        for (i, a) in self.active.iter_mut().enumerate() {
            if a.fed == a.feed.len() {
                if a.job.events.backlog() >= MAX_BACKLOG {
                    a.stalled_since.get_or_insert_with(Instant::now);
                    continue;
                }
                a.stalled_since = None;
                plan.push((i, a.next.len()));
                room = room.saturating_sub(a.next.len());
            }
        }
        // No model loaded means no active sequence, so nothing to run.
        let Some(model) = self.model.clone() else {
            return false;
        };
        let decode_rows = MAX_BATCH - room;
        // While sequences decode, prompts are fed in chunks that keep a step within
        // about twice a decoding step's time (where the bits do not depend on how a
        // prompt is cut).
        if decode_rows > 0 && !model.backend.batches_as_llama_server() {
            room = room.min(self.pace.prompt_rows(decode_rows));
        }
        // The prompts with the least left go first: a short prompt arriving beside a
        // long one starts answering at once rather than after it. Prompts that have
        // waited past PROMPT_PATIENCE go before those, oldest first, so that a stream of
        // short prompts cannot hold one back for good.
        let now = Instant::now();
        let mut prompts: Vec<(bool, usize, Instant, usize)> = (self.active.iter().enumerate())
            .filter(|(_, a)| a.fed < a.feed.len())
            .map(|(i, a)| {
                let fresh = now.duration_since(a.job.received) < PROMPT_PATIENCE;
                let left = if fresh { a.feed.len() - a.fed } else { 0 };
                (fresh, left, a.job.received, i)
            })
            .collect();
        prompts.sort_unstable();
        for (.., i) in prompts {
            let a = &self.active[i];
            let total = a.feed.len();
            if room > 0 {
                // A prompt's next batch ends where the model says (for llama.cpp's
                // arithmetic, where llama-server's would).
                let n = (model.prompt_batch_end(a.fed, total, None) - a.fed).min(room);
                plan.push((i, n));
                room -= n;
            }
        }
        if plan.is_empty() {
            return false;
        }
        plan.sort_unstable();
        let mut steps = Vec::with_capacity(plan.len());
        let mut planned = plan.iter().peekable();
        for (i, a) in self.active.iter_mut().enumerate() {
            let Some(&&(_, n)) = planned.peek().filter(|(j, _)| *j == i) else {
                continue;
            };
            planned.next();
            let Active {
                session,
                feed,
                fed,
                next,
                ..
            } = a;
            let (tokens, logits_from) = if *fed == feed.len() {
                (&next[..], next.len() - 1)
            } else {
                let chunk = &feed[*fed..*fed + n];
                let last = *fed + n == feed.len();
                (chunk, if last { n - 1 } else { n })
            };
            steps.push(Step {
                session,
                tokens,
                logits_from,
            });
        }
        // Where the pages run out, finished sequences' pages go first, least recently
        // used first; then the newest running request pauses (while others run).
        let rows = steps.iter().map(|s| s.tokens.len()).sum::<usize>();
        let started = Instant::now();
        let result = loop {
            match model.forward_many(&mut steps, &mut self.logits) {
                Err(EngineError::KvFull { .. }) if evict_lru(&mut self.idle) => {}
                r => break r,
            }
        };
        drop(steps);
        if matches!(result, Err(EngineError::KvFull { .. })) && self.active.len() > 1 {
            self.pause_newest();
            return true;
        }
        self.metrics
            .batch_rows
            .store(rows as u64, Ordering::Relaxed);
        self.pace.observe(rows, started.elapsed().as_secs_f64());
        if let Err(e) = result {
            for a in std::mem::take(&mut self.active) {
                a.job.events.send(Event::Failed {
                    index: a.job.index,
                    message: e.to_string(),
                });
            }
            return true;
        }
        let mut finished = Vec::new();
        for (k, &(i, n)) in plan.iter().enumerate() {
            let logits = self.logits.get_mut(k);
            let a = &mut self.active[i];
            if a.fed == a.feed.len() {
                a.tokens.append(&mut a.next);
            } else {
                a.tokens.extend_from_slice(&a.feed[a.fed..a.fed + n]);
                a.fed += n;
            }
            if logits.is_empty() {
                continue;
            }
            let now = Instant::now();
            match a.prompt_done {
                None => {
                    a.prompt_done = Some(now);
                    self.metrics
                        .time_to_first_token
                        .observe((now - a.job.received).as_secs_f64());
                }
                Some(_) => self
                    .metrics
                    .inter_token_latency
                    .observe((now - a.last_token).as_secs_f64()),
            }
            a.last_token = now;
            let room = self.limits.ctx - a.session.n_past();
            let emitted = a.generation.step(&self.tok, logits, room);
            if let Some(id) = emitted.id {
                a.next = vec![id];
                Metrics::add(&self.metrics.generated_tokens, 1);
            }
            if let Some(tokens) = &emitted.inject {
                a.next = tokens.clone();
            }
            if let Some(message) = emitted.error {
                a.job.events.send(Event::Failed {
                    index: a.job.index,
                    message,
                });
                finished.push((i, None));
                continue;
            }
            let finish = emitted.finish;
            a.job.events.send(Event::Token {
                index: a.job.index,
                emitted,
            });
            if let Some(finish) = finish {
                finished.push((i, Some(finish)));
            }
        }
        // Highest index first, so that swap_remove leaves the rest in place.
        finished.sort_unstable_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, finish) in finished {
            let a = self.active.swap_remove(i);
            let Some(finish) = finish else {
                self.retire(a);
                continue;
            };
            let now = Instant::now();
            let prompt_done = a.prompt_done.unwrap_or(now);
            let usage = Usage {
                prompt_tokens: a.job.key.tokens.len(),
                cached_tokens: a.cached,
                completion_tokens: a.generation.generated.len(),
                reasoning_tokens: a.generation.thinking_tokens,
                prompt_ms: (prompt_done - a.job.received).as_secs_f64() * 1e3,
                predicted_ms: (now - prompt_done).as_secs_f64() * 1e3,
            };
            if let Some(t) = a
                .generation
                .params()
                .thinking
                .as_ref()
                .filter(|t| t.log.is_some())
            {
                let injected = Injected::name(a.generation.injected);
                eprintln!(
                    "astra: INFO reasoning budget: {} thinking_tokens={} injected={injected}",
                    t.log.as_deref().unwrap_or(""),
                    usage.reasoning_tokens
                );
            }
            a.job.events.send(Event::Done {
                index: a.job.index,
                finish,
                usage,
            });
            self.retire(a);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_keeps_a_step_within_about_two_decoding_steps() {
        let mut pace = PrefillPace::default();
        // Nothing measured: as many prompt tokens as decoding rows.
        assert_eq!(pace.prompt_rows(16), 16);
        // Steps of 10 ms plus 1 ms a row: 16 decoding rows take 26 ms, which buys 26
        // prompt tokens; 64 take 74 ms, 74 tokens.
        for rows in [16, 40, 16, 64, 30, 16, 80] {
            pace.observe(rows, 0.010 + 0.001 * rows as f64);
        }
        assert_eq!(pace.prompt_rows(16), 26);
        assert_eq!(pace.prompt_rows(64), 74);
        // Steps all of one size: their time is taken as all per row.
        let mut same = PrefillPace::default();
        same.observe(16, 0.032);
        same.observe(16, 0.032);
        assert_eq!(same.prompt_rows(16), 16);
        // A step never goes below one prompt token, nor above a batch.
        let mut alone = PrefillPace::default();
        alone.observe(512, 0.512);
        assert_eq!(alone.prompt_rows(0), 1);
        let mut fixed = PrefillPace::default();
        for rows in [1, 8, 1, 8] {
            fixed.observe(rows, 0.100 + 0.0001 * rows as f64);
        }
        assert_eq!(fixed.prompt_rows(1), MAX_BATCH);
    }

    #[test]
    fn prompt_keys_reuse_only_with_the_same_images() {
        let key = |tokens: &[u32], media: &[u8]| PromptKey {
            tokens: tokens.to_vec(),
            media: media.iter().map(|&b| [b; 32]).collect(),
        };
        let cached = key(&[1, 2, 3, 4, 5], &[7]);
        assert_eq!(key(&[1, 2, 3, 9], &[7]).reusable_from(&cached), 3);
        // The whole cached prompt again: all but the last token.
        assert_eq!(key(&[1, 2, 3, 4, 5], &[7]).reusable_from(&cached), 4);
        // A changed image (same length, other bytes) or one more or less: nothing.
        assert_eq!(key(&[1, 2, 3, 4, 5], &[8]).reusable_from(&cached), 0);
        assert_eq!(key(&[1, 2, 3, 4, 5], &[]).reusable_from(&cached), 0);
        assert_eq!(key(&[1, 2, 3, 4, 5], &[7, 7]).reusable_from(&cached), 0);
    }
}
