//! A client that stops reading: its sequence pauses once MAX_BACKLOG events wait
//! untaken (memory stays bounded, the model stops spending steps on it), and after the
//! stall timeout it is cancelled and its slot freed, the others served as before.

use std::sync::atomic::Ordering;
use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::time::{Duration, Instant};

use astra_engine::{CpuBackend, Model, SamplerConfig};
use astra_server::generation::GenParams;
use astra_server::metrics::Metrics;
use astra_server::scheduler::{
    event_channel, Event, Job, Limits, Loader, ModelStatus, PromptKey, Scheduler, MAX_BACKLOG,
};
use astra_tokenizer::{EncodeOptions, Tokenizer};

fn job(tokens: Vec<u32>, max_tokens: usize) -> (Job, astra_server::scheduler::EventReceiver) {
    let (events, rx) = event_channel();
    let job = Job {
        key: PromptKey {
            tokens,
            media: Vec::new(),
        },
        params: GenParams {
            sampler: SamplerConfig {
                temperature: 0.0,
                ..SamplerConfig::default()
            },
            max_tokens,
            stop: Vec::new(),
            logprobs: Some(20),
            thinking: None,
            constraint: None,
        },
        index: 0,
        events,
        received: Instant::now(),
        keep_alive: None,
    };
    (job, rx)
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "waited for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_client_that_stops_reading_pauses_then_is_cancelled() {
    let Some(path) = astra_models::model_for_test("smollm2-135m") else {
        return;
    };
    let model = Model::load_on(CpuBackend::new(2), &path).unwrap();
    let tok = Arc::new(Tokenizer::from_metadata(model.file.metadata()).unwrap());
    // A story has no end within the tokens asked for.
    let prompt = tok.encode(
        "Once upon a time, in a land far away,",
        EncodeOptions::default(),
    );
    let (queue, jobs) = sync_channel(4);
    let metrics = Arc::new(Metrics::default());
    let limits = Limits {
        parallel: 2,
        ctx: 1024,
        budget: 1 << 30,
        keep_alive: None,
        stall_timeout: Duration::from_secs(2),
    };
    let loader: Loader<CpuBackend> = Box::new(|| Err("no reload in this test".into()));
    let status = Arc::new(ModelStatus::default());
    let scheduler = Scheduler::new(
        model,
        loader,
        status,
        Arc::clone(&tok),
        jobs,
        Arc::clone(&metrics),
        limits,
    );
    let running = std::thread::spawn(move || scheduler.run());

    let (stalled, mut unread) = job(prompt.clone(), 900);
    queue.send(stalled).unwrap();
    let generated = || metrics.generated_tokens.load(Ordering::SeqCst) as usize;
    wait_until("the backlog to fill", || generated() >= MAX_BACKLOG);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(generated(), MAX_BACKLOG, "generation paused at the backlog");

    // Another request is served meanwhile, in full.
    let (reader, mut read) = job(prompt.clone(), 40);
    queue.send(reader).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (mut tokens, mut done) = (0, false);
    while let Some(e) = rt.block_on(read.recv()) {
        match e {
            Event::Token { .. } => tokens += 1,
            Event::Done { .. } => {
                done = true;
                break;
            }
            Event::Failed { message, .. } => panic!("{message}"),
        }
    }
    assert!(done && tokens == 40, "{tokens} tokens");

    // The stalled one is cancelled after its timeout, its slot freed.
    wait_until("the cancellation", || {
        metrics.slots_busy.load(Ordering::SeqCst) == 0
    });
    let mut seen = Vec::new();
    while let Ok(e) = unread.try_recv() {
        seen.push(e);
    }
    assert_eq!(seen.len(), MAX_BACKLOG + 1);
    match seen.last() {
        Some(Event::Failed { message, .. }) => {
            assert!(message.contains("read nothing"), "{message}")
        }
        _ => panic!("the last event is the cancellation"),
    }
    assert_eq!(generated(), MAX_BACKLOG + 40);
    drop(queue);
    running.join().unwrap();
}
