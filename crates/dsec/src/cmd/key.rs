//! `dsec key create|revoke` (admin).

use anyhow::Context;
use clap::Subcommand;
use dsec_client::Client;
use dsec_wire::admin::CreateKeyRequest;

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
    Revoke {
        key_id: String,
        /// Also stop every sandbox the key's principal created (end reason `quota_revoked`).
        #[arg(long)]
        stop_sandboxes: bool,
    },
}

pub async fn key(c: &Client, cmd: KeyCommand) -> anyhow::Result<()> {
    match cmd {
        KeyCommand::Create {
            principal,
            project,
            kind,
            quiet,
        } => {
            let req = CreateKeyRequest {
                principal: principal.clone(),
                project,
                kind,
            };
            let k = c
                .create_key(&req)
                .await
                .with_context(|| format!("create a key for {principal}"))?;
            if quiet {
                println!("{}", k.key);
                Ok(())
            } else {
                super::print_json(&k)
            }
        }
        KeyCommand::Revoke {
            key_id,
            stop_sandboxes,
        } => {
            let r = if stop_sandboxes {
                c.revoke_key_and_stop(&key_id).await
            } else {
                c.revoke_key(&key_id).await
            };
            let r = r.with_context(|| format!("revoke key {key_id}"))?;
            super::print_json(&r)
        }
    }
}
