//! One module per subcommand.

pub mod ab;
pub mod backend;
pub mod bench;
pub mod chat;
pub mod inspect;
pub mod parity;
pub mod parity_layers;
pub mod perplexity;
pub mod pull;
pub mod quantize;
pub mod run;
pub mod serve;
pub mod synth;
pub mod tokenize;
