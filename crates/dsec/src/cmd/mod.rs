//! Client commands, one file per resource.

pub mod bench;
pub mod cp;
pub mod exec;
pub mod fn_;
pub mod image;
pub mod key;
pub mod node;
pub mod nodes;
pub mod pause;
pub mod port;
pub mod proc_;
pub mod project;
pub mod sandbox;
pub mod shell;
pub mod snapshot;
pub mod top;
pub mod trajectory;
pub mod vm;
pub mod volume;

/// Prints a value as pretty JSON on stdout.
pub fn print_json<T: serde::Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}
