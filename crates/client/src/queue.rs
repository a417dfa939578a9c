//! Burst queueing: creates that wait for capacity (`wait_s`) and batches (`create_many`).

use dsec_wire::api::{BatchStatus, CreateBatchRequest, CreateSandboxRequest, QueuedSandboxInfo};
use reqwest::Method;

use crate::{json, Client, Result};

impl Client {
    /// `POST /v1/sandboxes` with `wait_s`: waits up to `wait_s` seconds in the apiserver's
    /// queue (per project FIFO, projects in turn) for a node with room instead of being refused
    /// with `node_full`. The answer says how long it waited (`queue`).
    pub async fn create_waiting(
        &self,
        req: &CreateSandboxRequest,
        wait_s: f64,
    ) -> Result<QueuedSandboxInfo> {
        let mut req = req.clone();
        req.wait_s = Some(wait_s);
        let (b, u) = self.request(Method::POST, self.url(&["v1", "sandboxes"])?);
        json(self.send((b.json(&req), u)).await?).await
    }

    /// `POST /v1/batches`: `count` sandboxes of one shape, placed as capacity frees.
    pub async fn create_many(&self, req: &CreateBatchRequest) -> Result<BatchStatus> {
        let (b, u) = self.request(Method::POST, self.url(&["v1", "batches"])?);
        json(self.send((b.json(req), u)).await?).await
    }

    /// `GET /v1/batches/{id}`: progress (placed / queued / failed).
    pub async fn batch(&self, id: &str) -> Result<BatchStatus> {
        json(
            self.send(self.request(Method::GET, self.url(&["v1", "batches", id])?))
                .await?,
        )
        .await
    }

    /// `DELETE /v1/batches/{id}`: drops the creates still queued.
    pub async fn cancel_batch(&self, id: &str) -> Result<BatchStatus> {
        json(
            self.send(self.request(Method::DELETE, self.url(&["v1", "batches", id])?))
                .await?,
        )
        .await
    }
}
