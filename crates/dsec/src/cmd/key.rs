//! `dsec key create|revoke` (admin).

use clap::Subcommand;
use reqwest::Method;
use serde_json::json;

use super::bench::Api;

#[derive(Subcommand, Debug)]
pub enum KeyCommand {
    /// Issue a key for a principal (a person or an agent), creating the principal if needed.
    Create {
        principal: String,
        /// Home project of a new principal (default `default`).
        #[arg(long)]
        project: Option<String>,
        /// `user` (default) or `admin`.
        #[arg(long)]
        kind: Option<String>,
        /// Print only the key.
        #[arg(long)]
        quiet: bool,
    },
    /// Revoke a key by its key_id (or the key itself).
    Revoke { key_id: String },
}

pub async fn key(api: &Api, c: KeyCommand) -> anyhow::Result<()> {
    match c {
        KeyCommand::Create {
            principal,
            project,
            kind,
            quiet,
        } => {
            let v = api
                .call(
                    Method::POST,
                    "/v1/keys",
                    Some(&json!({"principal": principal, "project": project, "kind": kind})),
                )
                .await?;
            if quiet {
                println!("{}", v["key"].as_str().unwrap_or(""));
                Ok(())
            } else {
                super::print_json(&v)
            }
        }
        KeyCommand::Revoke { key_id } => {
            let v = api
                .call(Method::DELETE, &format!("/v1/keys/{key_id}"), None)
                .await?;
            super::print_json(&v)
        }
    }
}
