//! `astra chat`: a conversation in the terminal. Each turn renders the whole
//! conversation with the model's chat template and runs only the tokens after what the
//! session already holds (the prompt cache between turns); answers stream as they are
//! generated, thinking dimmed. Ctrl-C stops an answer (once its prompt has been read),
//! Ctrl-D (or `/exit`) leaves.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use astra_engine::{Backend, Model, Session, StopMatcher, StopOutcome};
use astra_tokenizer::{ChatMessage, ChatTemplate, EncodeOptions, StreamDecoder, Tokenizer};

use super::backend::{with_model, BackendArgs, OnModel};
use super::run::SamplingArgs;

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF path or a known model name (pulled if missing).
    #[arg(long, short, default_value = astra_models::DEFAULT_MODEL)]
    model: String,
    /// The system message the conversation starts with.
    #[arg(long)]
    system: Option<String>,
    /// Tokens an answer may take at most.
    #[arg(short = 'n', long, default_value_t = 1024)]
    n_predict: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Worker threads (default: every core).
    #[arg(long, short)]
    threads: Option<usize>,
    /// Context size in tokens: the conversation's room.
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    #[command(flatten)]
    backend: BackendArgs,
}

const HELP: &str = "/reset starts again, /system TEXT sets the system message, /exit (or Ctrl-D) \
                    leaves; Ctrl-C stops an answer";

pub fn run(args: Args) -> Result<()> {
    if args.n_predict == 0 {
        bail!("-n must be at least 1");
    }
    let path = astra_models::resolve(&args.model)?;
    let threads = args.threads.unwrap_or_else(super::run::default_threads);
    with_model(args.backend, &path, threads, args)
}

impl OnModel for Args {
    fn run<B: Backend>(self, model: Arc<Model<B>>) -> Result<()> {
        chat(&self, &model)
    }
}

/// Ctrl-C: set while an answer is being generated, it stops the answer; at the input
/// prompt it reminds how to leave.
struct Interrupt {
    requested: AtomicBool,
    generating: AtomicBool,
}

impl Interrupt {
    /// Takes over Ctrl-C for the rest of the process.
    fn install() -> Result<Arc<Interrupt>> {
        let me = Arc::new(Interrupt {
            requested: AtomicBool::new(false),
            generating: AtomicBool::new(false),
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handler = Arc::clone(&me);
        // The handler is registered before the first prompt is shown.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            rt.block_on(async {
                let mut interrupts = match Interrupts::register() {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                while interrupts.next().await {
                    if handler.generating.load(Ordering::SeqCst) {
                        handler.requested.store(true, Ordering::SeqCst);
                    } else {
                        print!("\n({HELP})\n> ");
                        let _ = std::io::stdout().flush();
                    }
                }
            })
        });
        ready_rx.recv()??;
        Ok(me)
    }
}

/// Ctrl-C presses, the handler registered at once.
#[cfg(unix)]
struct Interrupts(tokio::signal::unix::Signal);

#[cfg(unix)]
impl Interrupts {
    fn register() -> std::io::Result<Interrupts> {
        use tokio::signal::unix::{signal, SignalKind};
        signal(SignalKind::interrupt()).map(Interrupts)
    }

    async fn next(&mut self) -> bool {
        self.0.recv().await.is_some()
    }
}

#[cfg(not(unix))]
struct Interrupts;

#[cfg(not(unix))]
impl Interrupts {
    fn register() -> std::io::Result<Interrupts> {
        Ok(Interrupts)
    }

    async fn next(&mut self) -> bool {
        tokio::signal::ctrl_c().await.is_ok()
    }
}

/// ANSI styling, where the output is a terminal.
struct Style {
    on: bool,
}

impl Style {
    fn dim(&self) -> &'static str {
        if self.on {
            "\x1b[2m"
        } else {
            ""
        }
    }
    fn reset(&self) -> &'static str {
        if self.on {
            "\x1b[0m"
        } else {
            ""
        }
    }
}

/// Splits streamed text at `<think>` and `</think>`: the thinking, markers included,
/// is shown dimmed.
struct Thinking {
    inside: bool,
    marker: StopMatcher,
}

impl Thinking {
    fn new() -> Thinking {
        Thinking {
            inside: false,
            marker: StopMatcher::new(vec!["<think>".into()]),
        }
    }

    /// `text` as shown.
    fn push(&mut self, text: &str, style: &Style) -> String {
        let mut out = String::new();
        let mut rest = text.to_owned();
        loop {
            match self.marker.push_split(&rest) {
                (StopOutcome::Continue(p), _) => {
                    out.push_str(&p);
                    return out;
                }
                (StopOutcome::Stopped(p), after) => {
                    out.push_str(&p);
                    if self.inside {
                        out.push_str("</think>");
                        out.push_str(style.reset());
                    } else {
                        out.push_str(style.dim());
                        out.push_str("<think>");
                    }
                    self.inside = !self.inside;
                    let next = if self.inside { "</think>" } else { "<think>" };
                    self.marker = StopMatcher::new(vec![next.into()]);
                    rest = after;
                }
            }
        }
    }

    /// What is held back at the end of an answer, the style closed.
    fn finish(&mut self, style: &Style) -> String {
        let mut out = self.marker.finish();
        if self.inside {
            out.push_str(style.reset());
        }
        *self = Thinking::new();
        out
    }
}

/// The conversation and what the session holds of it.
struct Conversation<B: Backend> {
    system: Option<String>,
    turns: Vec<ChatMessage>,
    session: Session<B>,
    /// The ids whose keys and values the session holds, in order.
    held: Vec<u32>,
}

impl<B: Backend> Conversation<B> {
    fn messages(&self) -> Vec<ChatMessage> {
        let system = self
            .system
            .iter()
            .map(|s| ChatMessage::new("system", s.clone()));
        system.chain(self.turns.iter().cloned()).collect()
    }

    /// Keeps the longest prefix of `ids` the session holds, leaving at least the last
    /// id to run (its logits start the answer); returns how many it kept.
    fn reuse(&mut self, ids: &[u32]) -> usize {
        let common = self
            .held
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count();
        let kept = self.session.rewind(common.min(ids.len() - 1));
        self.held.truncate(kept);
        kept
    }
}

fn chat<B: Backend>(args: &Args, model: &Model<B>) -> Result<()> {
    let tok = Tokenizer::from_metadata(model.file.metadata())?;
    let template = ChatTemplate::for_model(model.file.metadata(), &tok)?;
    let ctx = args.ctx.min(model.cfg.ctx_train);
    let interrupt = Interrupt::install()?;
    let style = Style {
        on: std::io::stdout().is_terminal(),
    };
    let mut conv = Conversation {
        system: args.system.clone(),
        turns: Vec::new(),
        session: model.session(ctx)?,
        held: Vec::new(),
    };
    let mut out = std::io::stdout();
    writeln!(
        out,
        "{}chatting with {} ({}); {HELP}{}",
        style.dim(),
        model.cfg.arch.name(),
        model.backend.describe(),
        style.reset()
    )?;
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        write!(out, "> ")?;
        out.flush()?;
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 {
            writeln!(out)?;
            return Ok(());
        }
        let input = line.trim_end_matches(['\n', '\r']);
        match input.trim() {
            "" => continue,
            "/exit" | "/quit" => return Ok(()),
            "/reset" => {
                conv.turns.clear();
                writeln!(out, "{}(a new conversation){}", style.dim(), style.reset())?;
                continue;
            }
            cmd if cmd.starts_with("/system") => {
                let text = cmd["/system".len()..].trim();
                conv.system = (!text.is_empty()).then(|| text.to_owned());
                conv.turns.clear();
                let said = if text.is_empty() { "cleared" } else { "set" };
                writeln!(
                    out,
                    "{}(system message {said}; a new conversation){}",
                    style.dim(),
                    style.reset()
                )?;
                continue;
            }
            cmd if cmd.starts_with('/') => {
                writeln!(out, "{}{HELP}{}", style.dim(), style.reset())?;
                continue;
            }
            _ => {}
        }
        conv.turns.push(ChatMessage::new("user", input.to_owned()));
        let prompt = template.prompt(&conv.messages(), tok.vocab().add_bos)?;
        let ids = tok.encode(&prompt, EncodeOptions::default());
        if ids.len() + 1 > ctx {
            conv.turns.pop();
            writeln!(
                out,
                "{}(the conversation, {} tokens, fills the context of {ctx}: /reset to start again){}",
                style.dim(),
                ids.len(),
                style.reset()
            )?;
            continue;
        }
        interrupt.requested.store(false, Ordering::SeqCst);
        interrupt.generating.store(true, Ordering::SeqCst);
        let answer = answer(args, model, &tok, &mut conv, &ids, &interrupt, &style);
        interrupt.generating.store(false, Ordering::SeqCst);
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                conv.turns.pop();
                // The session's state is unknown after a failed step: start it again.
                conv.held.clear();
                conv.session.rewind(0);
                writeln!(out, "\nerror: {e:#}")?;
                continue;
            }
        };
        conv.turns.push(ChatMessage::new("assistant", answer));
    }
}

/// Generates the answer to the conversation whose prompt is `ids`, streaming it;
/// returns its text (as far as it went, when stopped).
fn answer<B: Backend>(
    args: &Args,
    model: &Model<B>,
    tok: &Tokenizer,
    conv: &mut Conversation<B>,
    ids: &[u32],
    interrupt: &Interrupt,
    style: &Style,
) -> Result<String> {
    let mut out = std::io::stdout();
    let cached = conv.reuse(ids);
    let t0 = Instant::now();
    let mut logits = model.prefill(&mut conv.session, &ids[cached..])?;
    conv.held.extend_from_slice(&ids[cached..]);
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut sampler = args.sampling.sampler();
    sampler.accept(ids);
    let mut stream = StreamDecoder::new();
    let mut thinking = Thinking::new();
    let mut text = String::new();
    let (mut generated, mut stopped) = (0usize, false);
    let room = args.n_predict.min(conv.session.ctx() - conv.held.len());
    let t1 = Instant::now();
    while generated < room {
        if interrupt.requested.load(Ordering::SeqCst) {
            stopped = true;
            break;
        }
        let id = sampler.sample(&mut logits);
        if tok.vocab().eog.contains(&id) {
            break;
        }
        generated += 1;
        let mut bytes = Vec::new();
        tok.token_bytes(id, false, &mut bytes);
        let piece = stream.push(&bytes);
        text.push_str(&piece);
        write!(out, "{}", thinking.push(&piece, style))?;
        out.flush()?;
        if generated == room {
            break;
        }
        logits = model.forward(&mut conv.session, &[id], 0)?;
        conv.held.push(id);
    }
    let tail = stream.finish();
    text.push_str(&tail);
    let shown = thinking.push(&tail, style) + &thinking.finish(style);
    let decode_s = t1.elapsed().as_secs_f64();
    let rate = if decode_s > 0.0 {
        generated as f64 / decode_s
    } else {
        0.0
    };
    let end = if stopped { " · stopped" } else { "" };
    writeln!(
        out,
        "{shown}\n{}[prompt {} tokens, {cached} cached, {:.0} ms · {generated} tokens, {rate:.1} tok/s{end}]{}",
        style.dim(),
        ids.len(),
        prefill_s * 1e3,
        style.reset()
    )?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thinking_is_dimmed_across_pieces() {
        let style = Style { on: true };
        let mut t = Thinking::new();
        let shown: String = ["a<th", "ink>b</", "think>c", "<t"]
            .iter()
            .map(|p| t.push(p, &style))
            .collect::<String>()
            + &t.finish(&style);
        assert_eq!(shown, "a\x1b[2m<think>b</think>\x1b[0mc<t");
        // Stopped inside the thinking: the style is closed.
        let mut t = Thinking::new();
        let shown = t.push("<think>hm", &style) + &t.finish(&style);
        assert_eq!(shown, "\x1b[2m<think>hm\x1b[0m");
        let plain = Style { on: false };
        assert_eq!(t.push("<think>x</think>y", &plain), "<think>x</think>y");
    }
}
