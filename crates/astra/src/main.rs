//! The `astra` command line: parses arguments and hands each command to its module.

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "astra",
    version,
    about = "Local LLM inference engine and OpenAI-compatible server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fetch a known model into the cache ($ASTRA_HOME, default ~/.cache/astra).
    Pull(cmd::pull::Args),
    /// Show a GGUF file's architecture, hyperparameters, tokenizer and tensors.
    Inspect(cmd::inspect::Args),
    /// Check kernels against references (`astra parity kernels`).
    Parity(cmd::parity::Args),
    /// Tokenize text with a model's tokenizer; prints a JSON array.
    Tokenize(cmd::tokenize::Args),
    /// Generate text from one prompt.
    Run(cmd::run::Args),
    /// Chat with the model in the terminal.
    Chat(cmd::chat::Args),
    /// Measure prefill and decode speed.
    Bench(cmd::bench::Args),
    /// Compare two builds or settings in interleaved runs, with a verdict.
    Ab(cmd::ab::Args),
    /// Perplexity of a text, as llama-perplexity measures it.
    Perplexity(cmd::perplexity::Args),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(cmd::serve::Args),
    /// Quantize a GGUF file's F32/F16/BF16 tensors as llama-quantize does.
    Quantize(cmd::quantize::Args),
    /// Write a random-weight GGUF of a known model's shape.
    Synth(cmd::synth::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Pull(args) => cmd::pull::run(args),
        Command::Inspect(args) => cmd::inspect::run(args),
        Command::Parity(args) => cmd::parity::run(args),
        Command::Tokenize(args) => cmd::tokenize::run(args),
        Command::Run(args) => cmd::run::run(args),
        Command::Chat(args) => cmd::chat::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Ab(args) => cmd::ab::run(args),
        Command::Perplexity(args) => cmd::perplexity::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::Quantize(args) => cmd::quantize::run(args),
        Command::Synth(args) => cmd::synth::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
