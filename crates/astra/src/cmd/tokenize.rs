//! `astra tokenize`: text to token ids as the model's tokenizer gives them.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use astra_gguf::GgufFile;
use astra_tokenizer::{EncodeOptions, Tokenizer};
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF path or a known model name (pulled if missing).
    #[arg(long, short, default_value = astra_models::DEFAULT_MODEL)]
    model: String,
    /// Do not add BOS/EOS even where the model adds them.
    #[arg(long)]
    no_bos: bool,
    /// Treat special-token texts such as `<|im_start|>` as plain text.
    #[arg(long)]
    no_special: bool,
    /// Print `{id, piece}` objects instead of bare ids.
    #[arg(long)]
    pieces: bool,
    /// Read the text from this file, byte for byte.
    #[arg(long, conflicts_with = "text")]
    file: Option<PathBuf>,
    /// The text to tokenize.
    #[arg(required_unless_present = "file")]
    text: Option<String>,
}

pub fn run(args: Args) -> Result<()> {
    let text = match (&args.file, args.text) {
        (Some(path), _) => {
            let bytes =
                std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            match String::from_utf8(bytes) {
                Ok(s) => s,
                Err(e) => bail!(
                    "{} is not UTF-8 text (invalid byte at offset {})",
                    path.display(),
                    e.utf8_error().valid_up_to()
                ),
            }
        }
        (None, Some(text)) => text,
        (None, None) => bail!("give the text to tokenize, or --file FILE"),
    };
    let file = GgufFile::open(astra_models::resolve(&args.model)?)?;
    let tok = Tokenizer::from_metadata(file.metadata())?;
    let ids = tok.encode(
        &text,
        EncodeOptions {
            add_special: !args.no_bos,
            parse_special: !args.no_special,
        },
    );
    let out = if args.pieces {
        json!(ids
            .iter()
            .map(|&id| {
                let mut bytes = Vec::new();
                tok.token_bytes(id, true, &mut bytes);
                json!({"id": id, "piece": String::from_utf8_lossy(&bytes)})
            })
            .collect::<Vec<_>>())
    } else {
        json!(ids)
    };
    println!("{out}");
    Ok(())
}
