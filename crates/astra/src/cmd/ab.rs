//! `astra ab`: two arms (two builds, or one build with two settings) measured on the
//! same inputs in interleaved pairs of fresh processes, with the verdict the pairs
//! support. A is the baseline, B the candidate; a ratio is B's time over A's.
//!
//! Each run is `BIN bench --greedy --json …` (a prefill and a greedy decode, timed in
//! the process after one warm-up); the arms run A/B, B/A, A/B, … so that a machine
//! getting slower or faster over the session weighs on both alike.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::backend::BackendKind;

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF path or a known model name (pulled by each arm if missing).
    #[arg(long, short, default_value = astra_models::DEFAULT_MODEL)]
    model: String,
    /// The baseline's binary (default: this one).
    #[arg(long)]
    a: Option<PathBuf>,
    /// The candidate's binary (default: this one).
    #[arg(long)]
    b: Option<PathBuf>,
    /// Arguments of the baseline's runs, after the common ones (split at whitespace).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    a_args: String,
    /// Arguments of the candidate's runs.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    b_args: String,
    /// An environment variable of the baseline's runs, `K=V` (repeatable).
    #[arg(long, value_parser = parse_env)]
    a_env: Vec<(String, String)>,
    /// An environment variable of the candidate's runs, `K=V` (repeatable).
    #[arg(long, value_parser = parse_env)]
    b_env: Vec<(String, String)>,
    /// Prompt lengths, comma-separated: each a case with each decode length.
    #[arg(short = 'p', long, value_delimiter = ',', default_value = "512")]
    n_prompt: Vec<usize>,
    /// Decode lengths, comma-separated (0: the prefill alone).
    #[arg(short = 'n', long, value_delimiter = ',', default_value = "128")]
    n_gen: Vec<usize>,
    /// Tokens in each sequence's cache before its prompt (prefilled, not timed).
    #[arg(short = 'd', long, default_value_t = 0)]
    depth: usize,
    /// Sequences prefilled and decoded together.
    #[arg(short = 's', long, default_value_t = 1)]
    sequences: usize,
    /// Which engine both arms run on.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// Worker threads of both arms (default: each arm's own default).
    #[arg(long, short)]
    threads: Option<usize>,
    /// Measured pairs per case.
    #[arg(long, default_value_t = 6)]
    pairs: usize,
    /// Runs of each arm before the pairs, per case, not counted.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// The smallest difference called: ratios within 1 ± this are "inconclusive".
    #[arg(long, default_value_t = 0.02)]
    threshold: f64,
    /// Where plan.json and result.json go.
    #[arg(long, default_value = "ab-results")]
    out: PathBuf,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?} is not K=V")),
    }
}

/// One side of the comparison.
#[derive(Clone, Debug, Serialize)]
pub struct Arm {
    pub binary: PathBuf,
    pub sha256: String,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Side {
    A,
    B,
}

/// The inputs of one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Case {
    pub n_prompt: usize,
    pub n_gen: usize,
    pub depth: usize,
    pub sequences: usize,
}

/// What one run measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Figures {
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Each sequence's generated ids.
    pub tokens: Vec<Vec<u32>>,
}

/// Runs an arm on a case: a fresh process in the command, set figures in the tests.
pub trait Runner {
    fn run(&mut self, side: Side, case: &Case) -> Result<Figures>;
}

/// A measured pair: both arms' figures, and B's time over A's.
#[derive(Clone, Debug, Serialize)]
pub struct Pair {
    /// Which arm ran first.
    pub first: Side,
    pub a: Figures,
    pub b: Figures,
    pub prefill_ratio: f64,
    pub decode_ratio: Option<f64>,
}

/// What the pairs say of one measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// B takes less time: every pair's ratio below 1 − threshold.
    Faster,
    /// B takes more time: every pair's ratio above 1 + threshold.
    Slower,
    /// Anything else: a median within 1 ± threshold, or a spread across pairs that
    /// reaches into it.
    Inconclusive,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Faster => "faster",
            Verdict::Slower => "slower",
            Verdict::Inconclusive => "inconclusive",
        }
    }
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct Measure {
    pub verdict: Verdict,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// Where the arms first generated different ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Difference {
    pub pair: usize,
    pub sequence: usize,
    pub position: usize,
}

/// An arm's last run over its first (pairs only), per measure: how far the machine
/// moved during the case.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Drift {
    pub prefill: f64,
    pub decode: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct CaseResult {
    pub case: Case,
    pub pairs: Vec<Pair>,
    pub identical_tokens: bool,
    pub first_difference: Option<Difference>,
    pub drift: BTreeMap<&'static str, Drift>,
    pub verdict: BTreeMap<&'static str, Option<Measure>>,
}

/// Which arm runs first in pair `i`: A/B, B/A, A/B, …
pub fn first_of_pair(i: usize) -> Side {
    if i.is_multiple_of(2) {
        Side::A
    } else {
        Side::B
    }
}

/// The median of `v` (not empty).
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// The verdict on B's times over A's, pair by pair; `None` for no ratios.
pub fn judge(ratios: &[f64], threshold: f64) -> Option<Measure> {
    if ratios.is_empty() {
        return None;
    }
    let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let max = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let verdict = if max < 1.0 - threshold {
        Verdict::Faster
    } else if min > 1.0 + threshold {
        Verdict::Slower
    } else {
        Verdict::Inconclusive
    };
    Some(Measure {
        verdict,
        median: median(ratios),
        min,
        max,
    })
}

/// The first pair, sequence and position where the arms' ids differ.
pub fn first_difference(pairs: &[Pair]) -> Option<Difference> {
    for (pair, p) in pairs.iter().enumerate() {
        let seqs = p.a.tokens.len().max(p.b.tokens.len());
        for sequence in 0..seqs {
            let empty = Vec::new();
            let a = p.a.tokens.get(sequence).unwrap_or(&empty);
            let b = p.b.tokens.get(sequence).unwrap_or(&empty);
            if a != b {
                let position = a.iter().zip(b).take_while(|(x, y)| x == y).count();
                return Some(Difference {
                    pair,
                    sequence,
                    position,
                });
            }
        }
    }
    None
}

/// `warmup` runs of each arm, then `pairs` pairs, and what they show.
pub fn run_case(
    runner: &mut dyn Runner,
    case: &Case,
    warmup: usize,
    pairs: usize,
    threshold: f64,
) -> Result<CaseResult> {
    for _ in 0..warmup {
        runner.run(Side::A, case)?;
        runner.run(Side::B, case)?;
    }
    let mut measured = Vec::with_capacity(pairs);
    for i in 0..pairs {
        let first = first_of_pair(i);
        let (a, b) = match first {
            Side::A => {
                let a = runner.run(Side::A, case)?;
                (a, runner.run(Side::B, case)?)
            }
            Side::B => {
                let b = runner.run(Side::B, case)?;
                (runner.run(Side::A, case)?, b)
            }
        };
        let decode_ratio = (case.n_gen > 0).then(|| b.decode_s / a.decode_s);
        measured.push(Pair {
            first,
            prefill_ratio: b.prefill_s / a.prefill_s,
            decode_ratio,
            a,
            b,
        });
    }
    let prefill: Vec<f64> = measured.iter().map(|p| p.prefill_ratio).collect();
    let decode: Vec<f64> = measured.iter().filter_map(|p| p.decode_ratio).collect();
    let drift = |f: fn(&Pair) -> &Figures| {
        let (first, last) = (f(measured.first()?), f(measured.last()?));
        Some(Drift {
            prefill: last.prefill_s / first.prefill_s,
            decode: (case.n_gen > 0).then(|| last.decode_s / first.decode_s),
        })
    };
    let mut drifts = BTreeMap::new();
    if let (Some(a), Some(b)) = (drift(|p| &p.a), drift(|p| &p.b)) {
        drifts.insert("a", a);
        drifts.insert("b", b);
    }
    let difference = first_difference(&measured);
    Ok(CaseResult {
        case: *case,
        identical_tokens: difference.is_none(),
        first_difference: difference,
        drift: drifts,
        verdict: BTreeMap::from([
            ("prefill", judge(&prefill, threshold)),
            ("decode", judge(&decode, threshold)),
        ]),
        pairs: measured,
    })
}

/// Fresh processes of the arms' binaries.
struct Processes<'a> {
    arms: [&'a Arm; 2],
    common: Vec<String>,
}

impl Runner for Processes<'_> {
    fn run(&mut self, side: Side, case: &Case) -> Result<Figures> {
        let arm = self.arms[side as usize];
        let out = Command::new(&arm.binary)
            .arg("bench")
            .args(&self.common)
            .args([
                "--greedy",
                "--json",
                "-r",
                "1",
                "-p",
                &case.n_prompt.to_string(),
                "-n",
                &case.n_gen.to_string(),
                "-d",
                &case.depth.to_string(),
                "-s",
                &case.sequences.to_string(),
            ])
            .args(&arm.args)
            .envs(&arm.env)
            .output()
            .with_context(|| format!("running {}", arm.binary.display()))?;
        if !out.status.success() {
            bail!(
                "arm {side:?} ({}) failed: {}",
                arm.binary.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let last = stdout.lines().last().unwrap_or_default();
        let v: Value = serde_json::from_str(last).with_context(|| {
            format!("arm {side:?} printed no figures (needs `bench --greedy`): {last:?}")
        })?;
        let first = |k: &str| v[k].get(0).and_then(Value::as_f64);
        let (Some(prefill_s), Some(decode_s)) = (first("prefill_s"), first("decode_s")) else {
            bail!("arm {side:?} printed no times: {last}");
        };
        let tokens = serde_json::from_value(v["tokens"].clone())
            .with_context(|| format!("arm {side:?} printed no token ids: {last}"))?;
        Ok(Figures {
            prefill_s,
            decode_s,
            tokens,
        })
    }
}

fn sha256_of(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).with_context(|| format!("reading {}", path.display()))?;
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The CPU's model, flags and cores, and the GPUs where `nvidia-smi` answers.
fn machine() -> Value {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
    };
    let flags: Vec<String> = field("flags")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let gpus: Vec<String> = Command::new("nvidia-smi")
        .args([
            "--query-gpu=name,driver_version,memory.total",
            "--format=csv,noheader",
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    json!({
        "cpu": field("model name"), "flags": flags, "cores": cores, "gpus": gpus,
        "os": std::env::consts::OS, "arch": std::env::consts::ARCH,
    })
}

/// `name` as the process runner finds it: a path as given, a bare name on `PATH`.
fn resolve(name: PathBuf) -> Result<PathBuf> {
    if name.components().count() > 1 || name.is_file() {
        return Ok(name);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(&name))
        .find(|p| p.is_file())
        .with_context(|| format!("{} is not a file here or on PATH", name.display()))
}

fn arm(binary: Option<PathBuf>, args: &str, env: Vec<(String, String)>) -> Result<Arm> {
    let binary = match binary {
        Some(b) => resolve(b)?,
        None => std::env::current_exe().context("finding this binary")?,
    };
    Ok(Arm {
        sha256: sha256_of(&binary)?,
        binary,
        args: args.split_whitespace().map(str::to_owned).collect(),
        env: env.into_iter().collect(),
    })
}

fn write_json(path: &Path, v: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(v)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

pub fn run(args: Args) -> Result<()> {
    if args.pairs == 0 || args.pairs > 1000 {
        bail!("--pairs must be between 1 and 1000");
    }
    if args.warmup > 100 {
        bail!("--warmup must be at most 100");
    }
    if !(0.0..1.0).contains(&args.threshold) {
        bail!("--threshold must be at least 0 and below 1");
    }
    if args.n_prompt.contains(&0) {
        bail!("every -p must be at least 1 (the first generated token comes from the prompt)");
    }
    let arms = [
        arm(args.a, &args.a_args, args.a_env)?,
        arm(args.b, &args.b_args, args.b_env)?,
    ];
    let cases: Vec<Case> = args
        .n_prompt
        .iter()
        .flat_map(|&p| {
            args.n_gen.iter().map(move |&n| Case {
                n_prompt: p,
                n_gen: n,
                depth: args.depth,
                sequences: args.sequences,
            })
        })
        .collect();
    let backend = match args.backend {
        BackendKind::Cpu => "cpu",
        BackendKind::Cuda => "cuda",
    };
    let mut common = vec![
        "-m".to_owned(),
        args.model.clone(),
        "--backend".into(),
        backend.into(),
    ];
    if let Some(t) = args.threads {
        common.extend(["-t".to_owned(), t.to_string()]);
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let plan = json!({
        "arms": {"a": arms[0], "b": arms[1]},
        "common_args": common,
        "machine": machine(),
        "inputs": {"model": args.model, "backend": backend, "cases": cases},
        "pairs": args.pairs, "warmup": args.warmup, "threshold": args.threshold,
    });
    write_json(&args.out.join("plan.json"), &plan)?;
    let mut runner = Processes {
        arms: [&arms[0], &arms[1]],
        common,
    };
    let mut results = Vec::new();
    for case in &cases {
        eprintln!(
            "case p{} n{} d{} × {}: {} warm-up and {} pairs",
            case.n_prompt, case.n_gen, case.depth, case.sequences, args.warmup, args.pairs
        );
        results.push(run_case(
            &mut runner,
            case,
            args.warmup,
            args.pairs,
            args.threshold,
        )?);
    }
    let identical = results.iter().all(|r| r.identical_tokens);
    write_json(
        &args.out.join("result.json"),
        &json!({"identical_tokens": identical, "cases": results}),
    )?;
    print_table(&results, args.threshold);
    println!(
        "plan and result in {}",
        args.out.join("result.json").display()
    );
    Ok(())
}

fn print_table(results: &[CaseResult], threshold: f64) {
    println!("| case | measure | A (median s) | B (median s) | B/A median | B/A range | verdict |");
    println!("|------|---------|-------------:|-------------:|-----------:|----------:|---------|");
    for r in results {
        let c = &r.case;
        let name = format!(
            "p{} n{} d{} × {}",
            c.n_prompt, c.n_gen, c.depth, c.sequences
        );
        for (measure, time) in [
            (
                "prefill",
                (|f: &Figures| f.prefill_s) as fn(&Figures) -> f64,
            ),
            ("decode", |f: &Figures| f.decode_s),
        ] {
            let Some(Some(m)) = r.verdict.get(measure) else {
                continue;
            };
            let a: Vec<f64> = r.pairs.iter().map(|p| time(&p.a)).collect();
            let b: Vec<f64> = r.pairs.iter().map(|p| time(&p.b)).collect();
            println!(
                "| {name} | {measure} | {:.4} | {:.4} | {:.3} | {:.3}–{:.3} | {} |",
                median(&a),
                median(&b),
                m.median,
                m.min,
                m.max,
                m.verdict.name()
            );
        }
        match r.first_difference {
            None => println!("| {name} | tokens | identical | | | | |"),
            Some(d) => println!(
                "| {name} | tokens | differ: pair {}, sequence {}, position {} | | | | |",
                d.pair, d.sequence, d.position
            ),
        }
        for (arm, d) in &r.drift {
            println!(
                "| {name} | drift {arm} | prefill {:.3} | {} | | | |",
                d.prefill,
                d.decode.map_or(String::new(), |x| format!("decode {x:.3}"))
            );
        }
    }
    println!("(ratios are B's time over A's; a verdict needs every pair beyond 1 ± {threshold})");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An arm with set times: `base` seconds scaled by its factor, by a drift per run
    /// of the machine (both arms alike, by the run's place in the session) and by noise
    /// from a fixed sequence.
    struct Fake {
        base: (f64, f64),
        factor: [f64; 2],
        drift_per_run: f64,
        noise: f64,
        runs: usize,
        seed: u64,
        /// Generated ids of each arm (B's replaced at `diverge` = (run, position)).
        diverge: Option<(usize, usize)>,
        log: Vec<Side>,
    }

    impl Fake {
        fn new(factor_b: f64) -> Fake {
            Fake {
                base: (0.5, 2.0),
                factor: [1.0, factor_b],
                drift_per_run: 0.0,
                noise: 0.0,
                runs: 0,
                seed: 1,
                diverge: None,
                log: Vec::new(),
            }
        }

        /// A value in [-1, 1).
        fn jitter(&mut self) -> f64 {
            self.seed = self
                .seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        }
    }

    impl Runner for Fake {
        fn run(&mut self, side: Side, case: &Case) -> Result<Figures> {
            self.log.push(side);
            let machine = 1.0 + self.drift_per_run * self.runs as f64;
            let f = self.factor[side as usize] * machine;
            let (p, d) = (self.base.0 * f, self.base.1 * f);
            let (np, nd) = (self.jitter(), self.jitter());
            let mut ids: Vec<u32> = (0..case.n_gen as u32 + 1).collect();
            if let (Side::B, Some((run, pos))) = (side, self.diverge) {
                if self.runs == run {
                    ids[pos] = 999;
                }
            }
            self.runs += 1;
            Ok(Figures {
                prefill_s: p * (1.0 + self.noise * np),
                decode_s: d * (1.0 + self.noise * nd),
                tokens: vec![ids.clone(), ids],
            })
        }
    }

    const CASE: Case = Case {
        n_prompt: 16,
        n_gen: 8,
        depth: 0,
        sequences: 2,
    };

    fn verdicts(fake: &mut Fake, pairs: usize) -> (Verdict, Verdict, CaseResult) {
        let r = run_case(fake, &CASE, 1, pairs, 0.02).unwrap();
        let v = |m: &str| r.verdict[m].expect("measured").verdict;
        (v("prefill"), v("decode"), r)
    }

    #[test]
    fn pairs_alternate_after_the_warm_up() {
        let mut fake = Fake::new(1.0);
        run_case(&mut fake, &CASE, 2, 4, 0.02).unwrap();
        use Side::{A, B};
        let want = [A, B, A, B, A, B, B, A, A, B, B, A];
        assert_eq!(fake.log, want);
    }

    #[test]
    fn a_real_difference_beyond_the_noise_is_called() {
        let mut fake = Fake::new(0.8);
        fake.noise = 0.03;
        let (p, d, r) = verdicts(&mut fake, 6);
        assert_eq!((p, d), (Verdict::Faster, Verdict::Faster));
        let m = r.verdict["decode"].unwrap();
        assert!((m.median - 0.8).abs() < 0.05, "{m:?}");
        let mut fake = Fake::new(1.25);
        fake.noise = 0.03;
        assert_eq!(verdicts(&mut fake, 6).1, Verdict::Slower);
    }

    #[test]
    fn noise_alone_is_inconclusive() {
        let mut fake = Fake::new(1.0);
        fake.noise = 0.05;
        let (p, d, _) = verdicts(&mut fake, 8);
        assert_eq!((p, d), (Verdict::Inconclusive, Verdict::Inconclusive));
    }

    #[test]
    fn a_difference_below_the_threshold_is_never_called() {
        // Exactly 1% faster in every pair, no noise: real, but under the threshold.
        let mut fake = Fake::new(0.99);
        let (p, d, r) = verdicts(&mut fake, 6);
        assert_eq!((p, d), (Verdict::Inconclusive, Verdict::Inconclusive));
        let m = r.verdict["prefill"].unwrap();
        assert!((m.min - 0.99).abs() < 1e-9 && (m.max - 0.99).abs() < 1e-9);
        let mut fake = Fake::new(1.015);
        assert_eq!(verdicts(&mut fake, 6).1, Verdict::Inconclusive);
    }

    #[test]
    fn a_spread_reaching_into_the_band_is_inconclusive() {
        // A median well past the threshold, but pairs that reach back across it.
        let ratios = [0.90, 0.91, 0.92, 0.99, 0.90];
        let m = judge(&ratios, 0.02).unwrap();
        assert_eq!((m.verdict, m.median), (Verdict::Inconclusive, 0.91));
        let m = judge(&[1.10, 1.12, 1.01], 0.02).unwrap();
        assert_eq!(m.verdict, Verdict::Inconclusive);
        assert_eq!(
            judge(&[0.97, 0.975], 0.02).unwrap().verdict,
            Verdict::Faster
        );
        assert_eq!(judge(&[1.05, 1.03], 0.02).unwrap().verdict, Verdict::Slower);
        assert!(judge(&[], 0.02).is_none());
    }

    #[test]
    fn drift_is_reported_and_the_alternation_cancels_it() {
        // The machine slows 1% a run: both arms alike, so pairs see the same arms.
        let mut fake = Fake::new(1.0);
        fake.drift_per_run = 0.01;
        let (p, d, r) = verdicts(&mut fake, 6);
        assert_eq!((p, d), (Verdict::Inconclusive, Verdict::Inconclusive));
        let a = r.drift["a"];
        // A's first pair run is run 2 (after two warm-ups), its last run 13.
        assert!((a.prefill - 1.13 / 1.02).abs() < 1e-9, "{a:?}");
        assert!((a.decode.unwrap() - 1.13 / 1.02).abs() < 1e-9);
    }

    #[test]
    fn the_first_differing_pair_and_position_are_named() {
        let mut fake = Fake::new(1.0);
        let (_, _, r) = verdicts(&mut fake, 3);
        assert!(r.identical_tokens && r.first_difference.is_none());
        // Run 4 is pair 1's first, B's (warm-up A B, then pairs A B, B A, …).
        let mut fake = Fake::new(1.0);
        fake.diverge = Some((4, 3));
        let (_, _, r) = verdicts(&mut fake, 3);
        assert!(!r.identical_tokens);
        assert_eq!(
            r.first_difference,
            Some(Difference {
                pair: 1,
                sequence: 0,
                position: 3
            })
        );
    }

    #[test]
    fn prefill_alone_has_no_decode_verdict() {
        let mut fake = Fake::new(0.5);
        let case = Case { n_gen: 0, ..CASE };
        let r = run_case(&mut fake, &case, 0, 2, 0.02).unwrap();
        assert_eq!(r.verdict["prefill"].unwrap().verdict, Verdict::Faster);
        assert!(r.verdict["decode"].is_none());
    }
}
