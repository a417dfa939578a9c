//! Admin calls: projects and quotas, API keys, the cluster view.

use dsec_wire::admin::{
    ClusterView, CreateKeyRequest, CreateProjectRequest, CreatedKey, ProjectList, ProjectView,
    Quota, RevokedKey,
};
use reqwest::Method;

use crate::{json, Client, Result};

impl Client {
    /// `GET /v1/projects`: every project with its quota and usage.
    pub async fn projects(&self) -> Result<ProjectList> {
        json(
            self.send(self.request(Method::GET, self.url(&["v1", "projects"])?))
                .await?,
        )
        .await
    }

    /// `POST /v1/projects` (admin): a project under a parent, its quota delegated from it.
    pub async fn create_project(&self, req: &CreateProjectRequest) -> Result<ProjectView> {
        let (b, u) = self.request(Method::POST, self.url(&["v1", "projects"])?);
        json(self.send((b.json(req), u)).await?).await
    }

    /// `PUT /v1/projects/{name}/quota` (admin): replaces a project's quota.
    pub async fn set_quota(&self, project: &str, quota: &Quota) -> Result<ProjectView> {
        let (b, u) = self.request(
            Method::PUT,
            self.url(&["v1", "projects", project, "quota"])?,
        );
        json(self.send((b.json(quota), u)).await?).await
    }

    /// `POST /v1/keys` (admin): issues a key, creating the principal when needed. The answer
    /// is the only copy of the plaintext key.
    pub async fn create_key(&self, req: &CreateKeyRequest) -> Result<CreatedKey> {
        let (b, u) = self.request(Method::POST, self.url(&["v1", "keys"])?);
        json(self.send((b.json(req), u)).await?).await
    }

    /// `DELETE /v1/keys/{id}` (admin): revokes a key by its key id (or the key itself).
    pub async fn revoke_key(&self, key_id: &str) -> Result<RevokedKey> {
        json(
            self.send(self.request(Method::DELETE, self.url(&["v1", "keys", key_id])?))
                .await?,
        )
        .await
    }

    /// Revokes a key and stops every sandbox its principal created (end reason
    /// `quota_revoked`); the answer lists them.
    pub async fn revoke_key_and_stop(&self, key_id: &str) -> Result<RevokedKey> {
        let mut u = self.url(&["v1", "keys", key_id])?;
        u.query_pairs_mut().append_pair("stop_sandboxes", "true");
        json(self.send(self.request(Method::DELETE, u)).await?).await
    }

    /// `GET /v1/cluster`: nodes, capacity, load and this apiserver's counters.
    pub async fn cluster(&self) -> Result<ClusterView> {
        json(
            self.send(self.request(Method::GET, self.url(&["v1", "cluster"])?))
                .await?,
        )
        .await
    }
}
