//! `astra pull NAME`: fetch a known model into the cache.

use anyhow::{bail, Result};

#[derive(clap::Args)]
pub struct Args {
    /// Model name (`astra pull --list` shows them).
    #[arg(required_unless_present = "list")]
    name: Option<String>,
    /// List the known models and where they are cached.
    #[arg(long)]
    list: bool,
    /// Download again even when the model is already cached.
    #[arg(long)]
    force: bool,
}

pub fn run(args: Args) -> Result<()> {
    if args.list {
        for m in astra_models::KNOWN_MODELS {
            let path = astra_models::cached_path(m);
            let state = if path.is_file() {
                "cached"
            } else {
                "not cached"
            };
            println!(
                "{:<14} {:<50} {state}: {}",
                m.name,
                m.description,
                path.display()
            );
        }
        return Ok(());
    }
    let name = args.name.unwrap_or_default();
    let Some(model) = astra_models::known(&name) else {
        let known: Vec<_> = astra_models::KNOWN_MODELS.iter().map(|m| m.name).collect();
        bail!("unknown model {name:?} (known: {})", known.join(", "));
    };
    let path = astra_models::cached_path(model);
    if path.is_file() && !args.force {
        println!("{} is already cached at {}", model.name, path.display());
        return Ok(());
    }
    let path = astra_models::pull(model)?;
    println!("{}", path.display());
    Ok(())
}
