//! The S3 requests the blob store makes (HEAD, ranged GET, PUT, multipart upload, DELETE,
//! ListObjectsV2, ListMultipartUploads), path-style against any S3-compatible endpoint.
//!
//! Why hand-written over `reqwest` instead of an SDK: the workspace already builds `reqwest`
//! with rustls, and the store needs eight request kinds; `aws-sdk-s3` adds ~120 crates and
//! `object_store`/`rust-s3` several dozen (minutes of build on this 2-core machine), while
//! SigV4 is ~100 lines (`sigv4.rs`).

use std::time::Duration;

use reqwest::{Method, StatusCode};

use super::sigv4::{self, Credentials, UNSIGNED_PAYLOAD};
use super::S3Error;

#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    endpoint: String,
    host: String,
    bucket: String,
    creds: Credentials,
}

impl Client {
    pub fn new(
        endpoint: &str,
        bucket: &str,
        creds: Credentials,
        timeout: Duration,
    ) -> Result<Self, S3Error> {
        let endpoint = endpoint.trim_end_matches('/').to_string();
        let url = reqwest::Url::parse(&endpoint).map_err(|e| S3Error::Config {
            key: "endpoint",
            message: format!("{endpoint:?} is not a URL: {e}"),
        })?;
        let host = match (url.host_str(), url.port()) {
            (Some(h), Some(p)) => format!("{h}:{p}"),
            (Some(h), None) => h.to_string(),
            _ => {
                return Err(S3Error::Config {
                    key: "endpoint",
                    message: format!("{endpoint:?} has no host"),
                })
            }
        };
        let http = reqwest::Client::builder()
            .connect_timeout(timeout)
            // Whole requests (16 MiB parts included) get a generous bound; chunk reads are
            // bounded by the cache's own `timeout` around each attempt.
            .timeout(timeout.max(Duration::from_secs(120)))
            .pool_idle_timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| S3Error::Http(format!("build HTTP client: {e}")))?;
        Ok(Client {
            http,
            endpoint,
            host,
            bucket: bucket.to_string(),
            creds,
        })
    }

    fn request(
        &self,
        method: Method,
        object: Option<&str>,
        query: &[(String, String)],
    ) -> reqwest::RequestBuilder {
        let path = match object {
            Some(o) => format!(
                "/{}/{}",
                sigv4::uri_encode(&self.bucket, false),
                sigv4::uri_encode(o, true)
            ),
            None => format!("/{}", sigv4::uri_encode(&self.bucket, false)),
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        let headers = sigv4::sign(
            &self.creds,
            method.as_str(),
            &self.host,
            &path,
            query,
            UNSIGNED_PAYLOAD,
            now,
        );
        let mut url = format!("{}{path}", self.endpoint);
        if !query.is_empty() {
            url.push('?');
            url.push_str(
                &query
                    .iter()
                    .map(|(k, v)| {
                        if v.is_empty() {
                            sigv4::uri_encode(k, false)
                        } else {
                            format!(
                                "{}={}",
                                sigv4::uri_encode(k, false),
                                sigv4::uri_encode(v, false)
                            )
                        }
                    })
                    .collect::<Vec<_>>()
                    .join("&"),
            );
        }
        let mut rb = self.http.request(method, url);
        for (k, v) in headers {
            rb = rb.header(k, v);
        }
        rb
    }

    async fn send(
        &self,
        what: &str,
        rb: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, S3Error> {
        rb.send().await.map_err(|e| S3Error::Unreachable {
            what: what.to_string(),
            message: if e.is_timeout() {
                format!("timed out: {e}")
            } else {
                e.to_string()
            },
        })
    }

    async fn check(what: &str, resp: reqwest::Response) -> Result<reqwest::Response, S3Error> {
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        Err(S3Error::Status {
            what: what.to_string(),
            status: status.as_u16(),
            code: tag(&body, "Code").unwrap_or_default(),
        })
    }

    /// Sends `rb` and turns anything but a 2xx into [`S3Error::Status`].
    async fn exchange(
        &self,
        what: &str,
        rb: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, S3Error> {
        Self::check(what, self.send(what, rb).await?).await
    }

    /// As [`Self::exchange`], but a 404 (the object or upload is gone) answers `None`.
    async fn exchange_unless_missing(
        &self,
        what: &str,
        rb: reqwest::RequestBuilder,
    ) -> Result<Option<reqwest::Response>, S3Error> {
        let resp = self.send(what, rb).await?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        Self::check(what, resp).await.map(Some)
    }

    /// As [`Self::exchange`], returning the body as text (the XML answers).
    async fn exchange_text(
        &self,
        what: &str,
        rb: reqwest::RequestBuilder,
    ) -> Result<String, S3Error> {
        Ok(self
            .exchange(what, rb)
            .await?
            .text()
            .await
            .unwrap_or_default())
    }

    /// The object's size, `None` when it does not exist.
    pub async fn head(&self, object: &str) -> Result<Option<u64>, S3Error> {
        let what = format!("HEAD {object}");
        let Some(resp) = self
            .exchange_unless_missing(&what, self.request(Method::HEAD, Some(object), &[]))
            .await?
        else {
            return Ok(None);
        };
        // Not `content_length()`: for HEAD that is the (empty) body's size.
        resp.headers()
            .get("content-length")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .map(Some)
            .ok_or_else(|| S3Error::Protocol(format!("{what}: no Content-Length")))
    }

    /// `len` bytes at `offset` (fewer at the end of the object).
    pub async fn get_range(&self, object: &str, offset: u64, len: u64) -> Result<Vec<u8>, S3Error> {
        let what = format!("GET {object} bytes {offset}+{len}");
        if len == 0 {
            return Ok(Vec::new());
        }
        let rb = self
            .request(Method::GET, Some(object), &[])
            .header("range", format!("bytes={offset}-{}", offset + len - 1));
        let resp = self.send(&what, rb).await?;
        if resp.status() == StatusCode::RANGE_NOT_SATISFIABLE {
            return Ok(Vec::new());
        }
        let resp = Self::check(&what, resp).await?;
        let body = resp.bytes().await.map_err(|e| S3Error::Unreachable {
            what: what.clone(),
            message: e.to_string(),
        })?;
        Ok(body.to_vec())
    }

    /// The whole object, streamed to `write`.
    pub async fn get_to(
        &self,
        object: &str,
        mut write: impl FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<u64, S3Error> {
        let what = format!("GET {object}");
        let mut resp = self
            .exchange(&what, self.request(Method::GET, Some(object), &[]))
            .await?;
        let mut total = 0u64;
        while let Some(chunk) = resp.chunk().await.map_err(|e| S3Error::Unreachable {
            what: what.clone(),
            message: e.to_string(),
        })? {
            write(&chunk).map_err(|e| S3Error::Local(format!("{what}: {e}")))?;
            total += chunk.len() as u64;
        }
        Ok(total)
    }

    pub async fn put(&self, object: &str, body: Vec<u8>) -> Result<(), S3Error> {
        let what = format!("PUT {object}");
        self.exchange(
            &what,
            self.request(Method::PUT, Some(object), &[]).body(body),
        )
        .await
        .map(|_| ())
    }

    pub async fn delete(&self, object: &str) -> Result<(), S3Error> {
        let what = format!("DELETE {object}");
        self.exchange_unless_missing(&what, self.request(Method::DELETE, Some(object), &[]))
            .await
            .map(|_| ())
    }

    /// Starts a multipart upload; returns its upload id.
    pub async fn create_multipart(&self, object: &str) -> Result<String, S3Error> {
        let what = format!("CreateMultipartUpload {object}");
        let q = [("uploads".to_string(), String::new())];
        let body = self
            .exchange_text(&what, self.request(Method::POST, Some(object), &q))
            .await?;
        tag(&body, "UploadId")
            .ok_or_else(|| S3Error::Protocol(format!("{what}: no UploadId in {body:?}")))
    }

    /// Uploads part `n` (1-based); returns its ETag.
    pub async fn upload_part(
        &self,
        object: &str,
        upload_id: &str,
        n: u32,
        body: Vec<u8>,
    ) -> Result<String, S3Error> {
        let what = format!("UploadPart {object} #{n}");
        let q = [
            ("partNumber".to_string(), n.to_string()),
            ("uploadId".to_string(), upload_id.to_string()),
        ];
        let resp = self
            .exchange(
                &what,
                self.request(Method::PUT, Some(object), &q).body(body),
            )
            .await?;
        resp.headers()
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .ok_or_else(|| S3Error::Protocol(format!("{what}: no ETag")))
    }

    pub async fn complete_multipart(
        &self,
        object: &str,
        upload_id: &str,
        etags: &[String],
    ) -> Result<(), S3Error> {
        let what = format!("CompleteMultipartUpload {object}");
        let mut xml = String::from("<CompleteMultipartUpload>");
        for (i, e) in etags.iter().enumerate() {
            xml.push_str(&format!(
                "<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>",
                i + 1,
                xml_escape(e)
            ));
        }
        xml.push_str("</CompleteMultipartUpload>");
        let q = [("uploadId".to_string(), upload_id.to_string())];
        let body = self
            .exchange_text(
                &what,
                self.request(Method::POST, Some(object), &q).body(xml),
            )
            .await?;
        // S3 may answer 200 with an <Error> body.
        if body.contains("<Error>") {
            return Err(S3Error::Status {
                what,
                status: 200,
                code: tag(&body, "Code").unwrap_or_default(),
            });
        }
        Ok(())
    }

    pub async fn abort_multipart(&self, object: &str, upload_id: &str) -> Result<(), S3Error> {
        let what = format!("AbortMultipartUpload {object}");
        let q = [("uploadId".to_string(), upload_id.to_string())];
        self.exchange_unless_missing(&what, self.request(Method::DELETE, Some(object), &q))
            .await
            .map(|_| ())
    }

    /// Every object name under `prefix`.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, S3Error> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        for _ in 0..100_000 {
            let mut q = vec![
                ("list-type".to_string(), "2".to_string()),
                ("prefix".to_string(), prefix.to_string()),
            ];
            if let Some(t) = &token {
                q.push(("continuation-token".to_string(), t.clone()));
            }
            let what = format!("ListObjectsV2 {prefix}");
            let body = self
                .exchange_text(&what, self.request(Method::GET, None, &q))
                .await?;
            out.extend(tags(&body, "Key"));
            token = tag(&body, "NextContinuationToken");
            if tag(&body, "IsTruncated").as_deref() != Some("true") || token.is_none() {
                break;
            }
        }
        Ok(out)
    }

    /// `(object, upload id)` of the multipart uploads in progress under `prefix`.
    pub async fn list_uploads(&self, prefix: &str) -> Result<Vec<(String, String)>, S3Error> {
        let what = format!("ListMultipartUploads {prefix}");
        let q = [
            ("prefix".to_string(), prefix.to_string()),
            ("uploads".to_string(), String::new()),
        ];
        let body = self
            .exchange_text(&what, self.request(Method::GET, None, &q))
            .await?;
        Ok(tags(&body, "Upload")
            .into_iter()
            .filter_map(|u| Some((tag(&u, "Key")?, tag(&u, "UploadId")?)))
            .collect())
    }
}

/// The text of the first `<name>...</name>` in `xml` (entities decoded).
fn tag(xml: &str, name: &str) -> Option<String> {
    tags(xml, name).into_iter().next()
}

/// The texts of every `<name>...</name>` in `xml` (entities decoded).
fn tags(xml: &str, name: &str) -> Vec<String> {
    let open = format!("<{name}>");
    let close = format!("</{name}>");
    let mut out = Vec::new();
    let mut rest = xml;
    while let Some(i) = rest.find(&open) {
        let after = &rest[i + open.len()..];
        let Some(j) = after.find(&close) else { break };
        out.push(xml_unescape(&after[..j]));
        rest = &after[j + close.len()..];
    }
    out
}

fn xml_unescape(s: &str) -> String {
    s.replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xml_tags() {
        let x = "<R><Upload><Key>p/a.blob</Key><UploadId>2~x</UploadId></Upload><Upload><Key>b&amp;c</Key><UploadId>y</UploadId></Upload><IsTruncated>false</IsTruncated></R>";
        let ups: Vec<_> = tags(x, "Upload")
            .into_iter()
            .filter_map(|u| Some((tag(&u, "Key")?, tag(&u, "UploadId")?)))
            .collect();
        assert_eq!(
            ups,
            vec![
                ("p/a.blob".to_string(), "2~x".to_string()),
                ("b&c".to_string(), "y".to_string())
            ]
        );
        assert_eq!(tag(x, "IsTruncated").as_deref(), Some("false"));
        assert_eq!(tag(x, "Nope"), None);
        assert_eq!(xml_escape("\"e\""), "&quot;e&quot;");
    }
}
