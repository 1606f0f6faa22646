//! `astra chat` in a real terminal: a tmux session typed into with send-keys and read
//! with capture-pane.

use std::process::Command;
use std::time::{Duration, Instant};

/// A tmux session running one command, killed when dropped.
struct Tmux {
    name: String,
}

impl Tmux {
    fn start(command: &str) -> Tmux {
        let name = format!("astra-chat-test-{}", std::process::id());
        let ok = Command::new("tmux")
            .args([
                "new-session",
                "-d",
                "-s",
                &name,
                "-x",
                "200",
                "-y",
                "80",
                command,
            ])
            .status()
            .expect("tmux")
            .success();
        assert!(ok, "tmux new-session failed");
        Tmux { name }
    }

    fn send(&self, keys: &[&str]) {
        let ok = Command::new("tmux")
            .args(["send-keys", "-t", &self.name])
            .args(keys)
            .status()
            .unwrap()
            .success();
        assert!(ok, "tmux send-keys {keys:?}");
    }

    /// The pane's text, lines joined where the terminal wrapped them.
    fn screen(&self) -> String {
        let out = Command::new("tmux")
            .args(["capture-pane", "-p", "-J", "-S", "-", "-t", &self.name])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The screen once `done` holds for it, within two minutes.
    fn wait_for(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let s = self.screen();
            if done(&s) {
                return s;
            }
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "waited for {what}; the screen:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.name])
            .status();
    }
}

/// The figures of each `[prompt N tokens, C cached, …]` line: (N, C).
fn turns(screen: &str) -> Vec<(usize, usize)> {
    screen
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("[prompt ")?;
            let (n, rest) = rest.split_once(" tokens, ")?;
            let (c, _) = rest.split_once(" cached")?;
            Some((n.parse().ok()?, c.parse().ok()?))
        })
        .collect()
}

fn tmux_present() -> bool {
    if Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return true;
    }
    let why = "tmux is not installed";
    if std::env::var("ASTRA_REQUIRE_TMUX").is_ok_and(|v| v == "1") {
        panic!("{why}");
    }
    eprintln!("SKIPPED: {why}");
    false
}

#[test]
fn chat_answers_reuses_the_cache_and_stops_on_ctrl_c() {
    let Some(model) = astra_models::model_for_test("smollm2-135m") else {
        return;
    };
    if !tmux_present() {
        return;
    }
    let bin = env!("CARGO_BIN_EXE_astra");
    let model = model.to_string_lossy().into_owned();
    let question = "What is the capital of France?";
    // The first turn is `astra run --chat`'s generation.
    let run = Command::new(bin)
        .args([
            "run", "-m", &model, "--chat", "-p", question, "--temp", "0", "-n", "200",
        ])
        .args(["-t", "2", "--json"])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let run: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let first_answer = run["text"].as_str().unwrap().to_owned();

    let t = Tmux::start(&format!(
        "{bin} chat -m {model} --temp 0 -n 200 -t 2; echo EXITED $?; sleep 600"
    ));
    t.wait_for("the first prompt", |s| {
        s.contains("\n> ") || s.ends_with("> ")
    });
    t.send(&[question, "Enter"]);
    let s = t.wait_for("the first answer", |s| turns(s).len() == 1);
    let (prompt, cached) = turns(&s)[0];
    assert_eq!(cached, 0, "{s}");
    assert_eq!(
        prompt,
        run["timings"]["prompt_tokens"].as_u64().unwrap() as usize
    );
    let first_line = first_answer.trim().lines().next().unwrap();
    assert!(
        s.contains(first_line),
        "run said {first_answer:?}; chat:\n{s}"
    );

    t.send(&["And of Germany?", "Enter"]);
    let s = t.wait_for("the second answer", |s| turns(s).len() == 2);
    let (second, cached) = turns(&s)[1];
    // Everything of the first turn's prompt is reused; the new message is not.
    assert!(cached >= prompt && cached < second, "{s}");

    t.send(&["Write a long story about a dragon.", "Enter"]);
    t.wait_for("the story to begin", |s| {
        s.split("Write a long story about a dragon.")
            .nth(1)
            .is_some_and(|after| after.trim().len() > 20)
    });
    t.send(&["C-c"]);
    let s = t.wait_for("the stopped answer", |s| turns(s).len() == 3);
    assert!(s.contains("stopped]"), "{s}");
    assert!(!s.contains("EXITED"), "Ctrl-C ended the program:\n{s}");

    t.send(&["/reset", "Enter"]);
    t.wait_for("the reset", |s| s.contains("(a new conversation)"));
    t.send(&["Hello", "Enter"]);
    let s = t.wait_for("an answer after the reset", |s| turns(s).len() == 4);
    assert!(turns(&s)[3].0 < second, "the history was cleared:\n{s}");
    t.send(&["C-d"]);
    t.wait_for("the exit", |s| s.contains("EXITED 0"));
}
