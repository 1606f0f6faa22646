//! The harness shared by the server tests: `astra serve` started on a free loopback
//! port with the real SmolLM2 model, and small HTTP helpers.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub struct Server {
    pub child: Child,
    pub base: String,
    /// The server's log (stderr) so far.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts `astra serve` on a free port with `extra` arguments; waits until ready.
    pub fn start(extra: &[&str]) -> Option<Server> {
        Self::start_with_env(extra, &[])
    }

    /// As [`Server::start`], with environment variables set for the server.
    pub fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Option<Server> {
        Self::start_model("smollm2-135m", extra, env)
    }

    /// As [`Server::start_with_env`], serving the known model `name`.
    pub fn start_model(name: &str, extra: &[&str], env: &[(&str, &str)]) -> Option<Server> {
        let model = astra_models::model_for_test(name)?;
        let mut child = Command::new(env!("CARGO_BIN_EXE_astra"))
            .args([
                "serve",
                "--port",
                "0",
                "--threads",
                "2",
                "--ctx",
                "2048",
                "--model",
            ])
            .arg(&model)
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start astra serve");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (sink, stderr) = (Arc::clone(&log), child.stderr.take().unwrap());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[server] {line}");
                sink.lock().unwrap().push(line);
            }
        });
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines.next().expect("a first line").unwrap();
        let addr = line
            .strip_prefix("astra: listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_owned();
        // Keep draining stdout so the server never blocks on it.
        std::thread::spawn(move || for _ in lines {});
        let server = Server {
            child,
            base: addr,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (status, _) = server.get("/health");
            if status == 200 {
                return Some(server);
            }
            assert_eq!(status, 503, "/health while loading");
            assert!(Instant::now() < deadline, "the model did not load in 60 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn agent() -> ureq::Agent {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into()
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        let mut r = Self::agent()
            .get(&format!("{}{path}", self.base))
            .call()
            .expect("GET");
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    }

    pub fn post_raw(&self, path: &str, body: &str) -> (u16, String) {
        post_to(&self.base, path, body)
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.post_raw(path, &body.to_string());
        (
            status,
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}")),
        )
    }

    /// A successful chat completion.
    pub fn chat(&self, body: &Value) -> Value {
        let (status, v) = self.post("/v1/chat/completions", body);
        assert_eq!(status, 200, "{v}");
        v
    }

    /// Lines of the server's log containing `text`.
    pub fn log_lines(&self, text: &str) -> Vec<String> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(text))
            .cloned()
            .collect()
    }

    /// Lines of the server's log containing `text`, waiting up to 10 s for a first one
    /// (the log arrives through a pipe, possibly after the response that followed it).
    pub fn wait_for_log(&self, text: &str) -> Vec<String> {
        let t0 = Instant::now();
        loop {
            let lines = self.log_lines(text);
            if !lines.is_empty() || t0.elapsed() > Duration::from_secs(10) {
                return lines;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)
                    .and_then(|rest| rest.trim().parse().ok())
            })
            .unwrap_or_else(|| panic!("metric {name} missing"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// POSTs a JSON body to `base` + `path` (from any thread); returns status and body.
pub fn post_to(base: &str, path: &str, body: &str) -> (u16, String) {
    let mut r = Server::agent()
        .post(&format!("{base}{path}"))
        .header("content-type", "application/json")
        .send(body)
        .expect("POST");
    (
        r.status().as_u16(),
        r.body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .unwrap(),
    )
}

pub fn content(v: &Value) -> &str {
    v["choices"][0]["message"]["content"].as_str().unwrap()
}

pub fn user(text: &str, max_tokens: usize) -> Value {
    json!({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0})
}

/// Reads a streamed response's `data:` payloads.
pub fn sse_events(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}
