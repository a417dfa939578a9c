//! Exposed ports (issue 18): URLs of a TCP port inside a sandbox, through the apiserver.

use dsec_wire::api::{PortUrl, PortUrlRequest};
use reqwest::Method;
use url::Url;

use crate::{json, Client, Result};

impl Client {
    /// The proxy URL of `port` in sandbox `id` (needs the API key, or the port among the
    /// sandbox's `public_ports`): `{base}/v1/sandboxes/{id}/ports/{port}/`.
    pub fn port_base_url(&self, id: &str, port: u16) -> Result<Url> {
        let port = port.to_string();
        let mut u = self.sandbox_url(id, &["ports", &port, ""])?;
        u.set_query(None);
        Ok(u)
    }

    /// Signs a URL for `port` of sandbox `id` valid for `expires_in` seconds (default 3600):
    /// whoever holds it reaches that port without the API key.
    pub async fn port_url(&self, id: &str, port: u16, expires_in: Option<u64>) -> Result<PortUrl> {
        let (b, u) = self.request(Method::POST, self.sandbox_url(id, &["port_urls"])?);
        let body = PortUrlRequest { port, expires_in };
        json(self.send((b.json(&body), u)).await?).await
    }

    /// The full signed URL (`{base}{path}`) for `port` of sandbox `id`.
    pub async fn signed_port_url(
        &self,
        id: &str,
        port: u16,
        expires_in: Option<u64>,
    ) -> Result<String> {
        let p = self.port_url(id, port, expires_in).await?;
        let base = self.base_url().as_str().trim_end_matches('/');
        Ok(format!("{base}{}", p.path))
    }
}
