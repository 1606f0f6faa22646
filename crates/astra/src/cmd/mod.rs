//! One module per subcommand.

pub mod inspect;
pub mod parity;
pub mod pull;
pub mod tokenize;
