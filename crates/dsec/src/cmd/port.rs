//! `dsec port ID PORT`: the URL of a TCP port inside a sandbox, through the apiserver.

use anyhow::Context;
use clap::Args;
use dsec_client::Client;

#[derive(Args, Debug)]
pub struct PortArgs {
    /// Sandbox id.
    pub id: String,
    /// TCP port inside the sandbox (a server listening there).
    pub port: u16,
    /// Print the plain URL (needs the API key, or the port among the sandbox's public_ports)
    /// instead of a signed one.
    #[arg(long)]
    pub unsigned: bool,
    /// Seconds the signed URL stays valid.
    #[arg(long, default_value_t = dsec_wire::api::DEFAULT_PORT_TOKEN_SECS)]
    pub expires_in: u64,
    /// Print the whole answer (path, token, expiry, host form) as JSON.
    #[arg(long)]
    pub json: bool,
}

pub async fn port(c: &Client, a: PortArgs) -> anyhow::Result<()> {
    if a.port == 0 {
        return Err(crate::UsageError("PORT must be 1..=65535".into()).into());
    }
    if a.unsigned {
        println!("{}", c.port_base_url(&a.id, a.port)?);
        return Ok(());
    }
    let p = c
        .port_url(&a.id, a.port, Some(a.expires_in))
        .await
        .with_context(|| format!("sign a URL for port {} of {}", a.port, a.id))?;
    if a.json {
        return super::print_json(&p);
    }
    let base = c.base_url().as_str().trim_end_matches('/');
    println!("{base}{}", p.path);
    Ok(())
}
