//! tracing-subscriber to stderr; `RUST_LOG` wins over `--log-level`.
//!
//! Colours (ANSI escapes) only when stderr is a terminal: `dsec up` usually logs to a file or
//! a journal, where the escapes are noise for every grep and cost formatting and bytes on each
//! line of the per-request hot path.

use std::io::IsTerminal as _;

use anyhow::Context;
use tracing_subscriber::EnvFilter;

pub fn init(level: &str, json: bool) -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.is_empty() => {
            EnvFilter::try_new(&v).with_context(|| format!("invalid RUST_LOG {v:?}"))?
        }
        _ => EnvFilter::try_new(level).with_context(|| format!("invalid --log-level {level:?}"))?,
    };
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if json {
        b.json().init();
    } else {
        b.init();
    }
    Ok(())
}
