//! Finds the API URL and key: flags/environment, then `/var/lib/dsec/env`.

use std::path::Path;

use anyhow::Context;

use crate::Global;

/// The env file `dsec up` writes by default.
pub const DEFAULT_ENV_FILE: &str = "/var/lib/dsec/env";

pub fn client(g: &Global) -> anyhow::Result<dsec_client::Client> {
    client_with(g, &dsec_client::ClientOptions::default())
}

/// Like [`client`], with [`dsec_client::ClientOptions`].
pub fn client_with(
    g: &Global,
    opts: &dsec_client::ClientOptions,
) -> anyhow::Result<dsec_client::Client> {
    let (mut url, mut key) = (g.url.clone(), g.api_key.clone());
    if url.is_none() || key.is_none() {
        if let Ok(vars) = crate::envfile::read(Path::new(DEFAULT_ENV_FILE)) {
            url = url.or_else(|| vars.get(dsec_client::ENV_URL).cloned());
            key = key.or_else(|| vars.get(dsec_client::ENV_KEY).cloned());
        }
    }
    let url = url.ok_or_else(|| {
        crate::UsageError(format!(
            "no API URL: set DSEC_API_URL or pass --url (or run `dsec up`, which writes {DEFAULT_ENV_FILE})"
        ))
    })?;
    let key = key.ok_or_else(|| {
        crate::UsageError(format!(
            "no API key: set DSEC_API_KEY or pass --api-key (or run `dsec up`, which writes {DEFAULT_ENV_FILE})"
        ))
    })?;
    dsec_client::Client::with_options(&url, &key, opts).context("configure API client")
}
