//! astra's OpenAI-compatible server: `serve` binds the port at once, loads the model
//! behind it (`/health` says when it is ready), and runs the continuous-batching
//! scheduler on its own thread while tokio serves HTTP.

pub mod api;
mod connection;
pub mod generation;
pub mod http;
pub mod keep_awake;
pub mod metrics;
pub mod scheduler;
mod serve;
pub mod telemetry;
pub mod tools;

pub use serve::{serve_on, BackendFactory, ServeOptions};
