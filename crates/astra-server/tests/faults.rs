//! A backend that fails in the middle of a step: the requests in that step get an error,
//! and the server goes on to answer the next request as it would have answered it
//! before. The faults are a device error (an operation that records a failure, as the
//! CUDA backend does) and a worker task that panics in the CPU backend's pool.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use astra_engine::attention::{KvCache, KvLayout, KvType};
use astra_engine::backend::{Activation, Attend, Rope, SeqRows};
use astra_engine::cpu::{CpuMatrix, CpuTensor};
use astra_engine::weights::MatRef;
use astra_engine::{Backend, CpuBackend, EngineError};
use astra_gguf::GgufFile;
use astra_quant::matmul::Parallel;
use astra_server::http::ImagePolicy;
use astra_server::{serve_on, ServeOptions};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// An operation fails the way a device operation does: its error is recorded for
    /// the step's check.
    Device,
    /// A task of the CPU backend's worker pool panics.
    WorkerPanic,
}

/// When to fail: at the `countdown`-th matrix product from now (0: never).
#[derive(Default)]
struct Plan {
    countdown: AtomicUsize,
    fault: Mutex<Option<Fault>>,
    device_error: Mutex<Option<String>>,
}

impl Plan {
    fn arm(&self, fault: Fault, after_products: usize) {
        *self.fault.lock().unwrap() = Some(fault);
        self.countdown.store(after_products, Ordering::SeqCst);
    }
}

/// The CPU backend with a [`Plan`] of faults.
struct Faulty {
    inner: CpuBackend,
    plan: Arc<Plan>,
}

impl Faulty {
    fn maybe_fail(&self) {
        let due = self
            .countdown_hit()
            .then(|| self.plan.fault.lock().unwrap().take())
            .flatten();
        match due {
            Some(Fault::Device) => {
                *self.plan.device_error.lock().unwrap() = Some("injected device fault".into())
            }
            Some(Fault::WorkerPanic) => self
                .inner
                .pool()
                .run(4, &|i| assert!(i != 2, "injected worker panic")),
            None => {}
        }
    }

    fn countdown_hit(&self) -> bool {
        self.plan
            .countdown
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok_and(|n| n == 1)
    }
}

impl Backend for Faulty {
    type Tensor = CpuTensor;
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type KvCache = KvCache;
    type Ids = Vec<u32>;
    type Graph = ();
    type Host = Vec<f32>;

    fn name(&self) -> &'static str {
        "faulty"
    }
    fn describe(&self) -> String {
        format!("faulty {}", self.inner.describe())
    }
    fn matrix(&self, file: &Arc<GgufFile>, m: &MatRef) -> Result<CpuMatrix, EngineError> {
        self.inner.matrix(file, m)
    }
    fn vector(&self, v: &[f32]) -> Result<Vec<f32>, EngineError> {
        self.inner.vector(v)
    }
    fn tensor(&self, rows: usize, width: usize) -> Result<CpuTensor, EngineError> {
        self.inner.tensor(rows, width)
    }
    fn tensor_from(&self, data: &[f32], width: usize) -> Result<CpuTensor, EngineError> {
        self.inner.tensor_from(data, width)
    }
    fn kv_cache(&self, layout: &KvLayout) -> Result<KvCache, EngineError> {
        self.inner.kv_cache(layout)
    }
    fn kv_type(&self) -> KvType {
        self.inner.kv_type()
    }
    fn read(&self, t: &CpuTensor) -> Result<Vec<f32>, EngineError> {
        self.inner.read(t)
    }
    fn read_append(&self, t: &CpuTensor, out: &mut Vec<f32>) -> Result<(), EngineError> {
        self.inner.read_append(t, out)
    }
    fn check(&self) -> Result<(), EngineError> {
        if let Some(e) = self.plan.device_error.lock().unwrap().take() {
            return Err(EngineError::Backend(e));
        }
        self.inner.check()
    }
    fn embed(&self, table: &CpuMatrix, ids: &Vec<u32>, scale: Option<f32>, out: &mut CpuTensor) {
        self.inner.embed(table, ids, scale, out)
    }
    fn gather(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor, EngineError> {
        self.inner.gather(x, rows)
    }
    fn rms_norm(&self, x: &CpuTensor, w: &Vec<f32>, eps: f32, out: &mut CpuTensor) {
        self.inner.rms_norm(x, w, eps, out)
    }
    fn rms_norm_groups(&self, x: &mut CpuTensor, w: &Vec<f32>, eps: f32) {
        self.inner.rms_norm_groups(x, w, eps)
    }
    fn matmul(&self, x: &CpuTensor, outs: &mut [(&CpuMatrix, &mut CpuTensor)]) {
        self.maybe_fail();
        self.inner.matmul(x, outs)
    }
    fn ids(&self, v: &[u32]) -> Result<Vec<u32>, EngineError> {
        self.inner.ids(v)
    }
    fn write_ids(&self, dst: &mut Vec<u32>, v: &[u32]) {
        self.inner.write_ids(dst, v)
    }
    fn rope(&self, x: &mut CpuTensor, head_dim: usize, positions: &Vec<u32>, rope: Rope) {
        self.inner.rope(x, head_dim, positions, rope)
    }
    fn scale(&self, x: &mut CpuTensor, s: f32) {
        self.inner.scale(x, s)
    }
    fn add(&self, x: &mut CpuTensor, y: &CpuTensor) {
        self.inner.add(x, y)
    }
    fn glu(&self, gate: &mut CpuTensor, up: &CpuTensor, act: Activation) {
        self.inner.glu(gate, up, act)
    }
    fn add_bias(&self, x: &mut CpuTensor, b: &Vec<f32>) {
        self.inner.add_bias(x, b)
    }
    fn mul(&self, x: &mut CpuTensor, y: &CpuTensor) {
        self.inner.mul(x, y)
    }
    fn tanh(&self, x: &mut CpuTensor) {
        self.inner.tanh(x)
    }
    fn scale_rows(&self, x: &mut CpuTensor, s: &[f32]) {
        self.inner.scale_rows(x, s)
    }
    fn scatter(&self, src: &CpuTensor, rows: &[usize], dst: &mut CpuTensor) {
        self.inner.scatter(src, rows, dst)
    }
    fn kv_store(
        &self,
        layer: usize,
        seqs: &mut [SeqRows<'_, KvCache>],
        positions: &Vec<u32>,
        k: &CpuTensor,
        v: &CpuTensor,
    ) {
        self.inner.kv_store(layer, seqs, positions, k, v)
    }
    fn attention(&self, a: Attend<'_, '_, Self>, out: &mut CpuTensor) {
        let Attend {
            layer,
            seqs,
            positions,
            q,
            scale,
        } = a;
        let a = Attend {
            layer,
            seqs,
            positions,
            q,
            scale,
        };
        self.inner.attention(a, out)
    }
}

/// A request over a fresh connection: the status code and the body.
fn post(port: u16, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response");
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {out:?}"));
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}

fn wait_ready(port: u16) {
    let start = Instant::now();
    loop {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = s
                .write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            if out.contains("\"ready\"") {
                return;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "server not ready"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn options(model: PathBuf, port: u16) -> ServeOptions {
    ServeOptions {
        model,
        model_name: "smollm2".into(),
        host: "127.0.0.1".into(),
        port,
        parallel: 2,
        ctx: 512,
        arena_mib: 64,
        threads: 2,
        queue: 8,
        body_limit: 1 << 20,
        shutdown_grace: Duration::from_secs(1),
        think_markers: None,
        chat_template: None,
        answer_room: 0,
        images: ImagePolicy::Reject,
        min_free_mem_mib: None,
        keep_alive: None,
        api_key: None,
        kv_type: astra_engine::KvType::F16,
        max_connections: 64,
        stall_timeout: Duration::from_secs(30),
        header_timeout: Duration::from_secs(10),
        body_timeout: Duration::from_secs(30),
        allowed_hosts: Vec::new(),
        cors_origins: Vec::new(),
    }
}

#[test]
fn a_failed_step_fails_its_requests_and_the_server_serves_the_next() {
    let Some(model) = astra_models::model_for_test("smollm2-135m") else {
        return;
    };
    let plan = Arc::new(Plan::default());
    let port = free_port();
    let factory_plan = Arc::clone(&plan);
    let opts = options(model, port);
    std::thread::spawn(move || {
        let factory = Arc::new(move || {
            Ok(Faulty {
                inner: CpuBackend::new(2),
                plan: Arc::clone(&factory_plan),
            })
        });
        serve_on(opts, factory).expect("serve");
    });
    wait_ready(port);
    let request = r#"{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}"#;
    let (status, clean) = post(port, "/v1/completions", request);
    assert_eq!(status, 200, "{clean}");
    let text = |body: &str| -> String {
        let v: serde_json::Value = serde_json::from_str(body).expect("JSON body");
        v["choices"][0]["text"].as_str().expect("a text").to_owned()
    };
    let expected = text(&clean);
    for (fault, after) in [
        (Fault::Device, 5),
        (Fault::WorkerPanic, 5),
        (Fault::Device, 200),
    ] {
        plan.arm(fault, after);
        let (status, body) = post(port, "/v1/completions", request);
        assert_eq!(status, 500, "{fault:?} after {after} products: {body}");
        let err: serde_json::Value = serde_json::from_str(&body).expect("JSON error");
        let message = err["error"]["message"].as_str().expect("an error message");
        let want = match fault {
            Fault::Device => "injected device fault",
            Fault::WorkerPanic => "injected worker panic",
        };
        assert!(message.contains(want), "{fault:?}: {message}");
        let (status, body) = post(port, "/v1/completions", request);
        assert_eq!(status, 200, "after {fault:?}: {body}");
        assert_eq!(text(&body), expected, "after {fault:?}");
    }
}
