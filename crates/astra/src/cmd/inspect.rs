//! `astra inspect MODEL`: what a GGUF file holds, for people (`--json` for scripts).

use std::collections::BTreeMap;

use anyhow::Result;
use astra_gguf::{GgmlType, GgufFile, Metadata, Value};
use serde_json::{json, Map};

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF path or a known model name (pulled if missing).
    model: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let path = astra_models::resolve(&args.model)?;
    let file = GgufFile::open(&path)?;
    let report = Report::of(&file);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report.to_json())?);
    } else {
        report.print();
    }
    Ok(())
}

/// Tensor count and total bytes of one ggml type.
#[derive(Default)]
struct TypeTally {
    tensors: usize,
    bytes: u64,
}

struct Report<'a> {
    file: &'a GgufFile,
    architecture: Option<&'a str>,
    /// Metadata keys under the architecture's prefix, without it.
    hyperparameters: Vec<(String, &'a Value)>,
    types: BTreeMap<GgmlType, TypeTally>,
}

impl<'a> Report<'a> {
    fn of(file: &'a GgufFile) -> Self {
        let md = file.metadata();
        let architecture = md.str("general.architecture").ok();
        let prefix = architecture.map(|a| format!("{a}."));
        let hyperparameters = md
            .iter()
            .filter_map(|(k, v)| {
                let rest = k.strip_prefix(prefix.as_deref()?)?;
                Some((rest.to_owned(), v))
            })
            .collect();
        let mut types: BTreeMap<GgmlType, TypeTally> = BTreeMap::new();
        for t in file.tensors() {
            let tally = types.entry(t.ty).or_default();
            tally.tensors += 1;
            tally.bytes += t.size;
        }
        Report {
            file,
            architecture,
            hyperparameters,
            types,
        }
    }

    fn block_count(&self) -> Option<u64> {
        let arch = self.architecture?;
        self.file
            .metadata()
            .u64(&format!("{arch}.block_count"))
            .ok()
    }

    fn print(&self) {
        let h = self.file.header();
        let md = self.file.metadata();
        println!(
            "file:          {} ({})",
            self.file.path().display(),
            human_bytes(self.file.len())
        );
        println!(
            "format:        GGUF v{}, alignment {}, {} metadata keys, {} tensors",
            h.version,
            h.alignment,
            md.len(),
            self.file.tensors().len()
        );
        println!(
            "architecture:  {}",
            self.architecture.unwrap_or("(not set)")
        );
        if let Ok(name) = md.str("general.name") {
            println!("name:          {name}");
        }
        if let Some(blocks) = self.block_count() {
            println!("blocks:        {blocks}");
        }
        println!("hyperparameters:");
        for (k, v) in &self.hyperparameters {
            println!("  {k:<40} {}", v.summary());
        }
        println!("tokenizer:     {}", tokenizer_summary(md));
        match md.str("tokenizer.chat_template") {
            Ok(t) => println!("chat template: present ({} bytes)", t.len()),
            Err(_) => println!("chat template: absent"),
        }
        println!("\n| type    | tensors |        bytes |");
        println!("|---------|--------:|-------------:|");
        for (ty, tally) in &self.types {
            println!(
                "| {:<7} | {:>7} | {:>12} |",
                ty.name(),
                tally.tensors,
                tally.bytes
            );
        }
    }

    fn to_json(&self) -> serde_json::Value {
        let h = self.file.header();
        let md = self.file.metadata();
        let hyper: Map<String, serde_json::Value> = self
            .hyperparameters
            .iter()
            .map(|(k, v)| (k.clone(), value_json(v)))
            .collect();
        let types: Map<String, serde_json::Value> = self
            .types
            .iter()
            .map(|(t, tally)| {
                (
                    t.name().to_owned(),
                    json!({"tensors": tally.tensors, "bytes": tally.bytes}),
                )
            })
            .collect();
        json!({
            "path": self.file.path(),
            "file_bytes": self.file.len(),
            "version": h.version,
            "alignment": h.alignment,
            "metadata_keys": md.len(),
            "architecture": self.architecture,
            "name": md.str("general.name").ok(),
            "block_count": self.block_count(),
            "hyperparameters": hyper,
            "tokenizer": {
                "model": md.str("tokenizer.ggml.model").ok(),
                "pre": md.str("tokenizer.ggml.pre").ok(),
                "tokens": md.array("tokenizer.ggml.tokens").map(|a| a.len()).ok(),
                "merges": md.array("tokenizer.ggml.merges").map(|a| a.len()).ok(),
                "bos_token_id": md.u64("tokenizer.ggml.bos_token_id").ok(),
                "eos_token_id": md.u64("tokenizer.ggml.eos_token_id").ok(),
                "add_bos_token": md.bool("tokenizer.ggml.add_bos_token").ok(),
            },
            "chat_template": md.str("tokenizer.chat_template").is_ok(),
            "tensor_count": self.file.tensors().len(),
            "tensor_types": types,
        })
    }
}

fn tokenizer_summary(md: &Metadata) -> String {
    let Ok(model) = md.str("tokenizer.ggml.model") else {
        return "(none)".to_owned();
    };
    let mut parts = vec![format!("model {model}")];
    if let Ok(pre) = md.str("tokenizer.ggml.pre") {
        parts.push(format!("pre {pre}"));
    }
    if let Ok(tokens) = md.array("tokenizer.ggml.tokens") {
        parts.push(format!("{} tokens", tokens.len()));
    }
    if let Ok(merges) = md.array("tokenizer.ggml.merges") {
        parts.push(format!("{} merges", merges.len()));
    }
    for (key, label) in [("bos_token_id", "bos"), ("eos_token_id", "eos")] {
        if let Ok(id) = md.u64(&format!("tokenizer.ggml.{key}")) {
            parts.push(format!("{label} {id}"));
        }
    }
    if let Ok(add) = md.bool("tokenizer.ggml.add_bos_token") {
        parts.push(format!("add_bos {add}"));
    }
    parts.join(", ")
}

/// Scalars as JSON; arrays summarised by element type and length (a vocabulary
/// would drown the report).
fn value_json(v: &Value) -> serde_json::Value {
    match v {
        Value::String(s) => json!(s),
        Value::Bool(b) => json!(b),
        Value::F32(x) => json!(x),
        Value::F64(x) => json!(x),
        Value::Array(a) => json!({"array": a.element_type().name(), "len": a.len()}),
        other => match (other.as_u64(), other.as_f64()) {
            (Some(u), _) => json!(u),
            (None, Some(f)) => json!(f as i64),
            _ => serde_json::Value::Null,
        },
    }
}

fn human_bytes(n: u64) -> String {
    format!("{:.1} MiB", n as f64 / (1024.0 * 1024.0))
}
