//! Cluster membership calls: node cordon/uncordon/drain and join tokens (admin), and the
//! join/heartbeat an edge sends (authorized by a join token: build the client with it as
//! the key).

use dsec_wire::api::{DrainPolicy, DrainRequest, JoinAnswer, JoinRequest, JoinToken, NodeAction};
use reqwest::Method;

use crate::{json, Client, Result};

impl Client {
    /// `POST /v1/nodes/{id}/cordon` (admin): no new placements on the node.
    pub async fn cordon_node(&self, node: &str) -> Result<NodeAction> {
        self.node_action(node, "cordon", None).await
    }

    /// `POST /v1/nodes/{id}/uncordon` (admin): placements again (also after a drain).
    pub async fn uncordon_node(&self, node: &str) -> Result<NodeAction> {
        self.node_action(node, "uncordon", None).await
    }

    /// `POST /v1/nodes/{id}/drain` (admin): no new placements, then every live sandbox
    /// paused or stopped.
    pub async fn drain_node(&self, node: &str, policy: DrainPolicy) -> Result<NodeAction> {
        self.node_action(node, "drain", Some(DrainRequest { policy }))
            .await
    }

    async fn node_action(
        &self,
        node: &str,
        verb: &str,
        body: Option<DrainRequest>,
    ) -> Result<NodeAction> {
        let (b, u) = self.request(Method::POST, self.url(&["v1", "nodes", node, verb])?);
        let b = match body {
            Some(req) => b.json(&req),
            None => b,
        };
        json(self.send((b, u)).await?).await
    }

    /// `POST /v1/nodes/tokens` (admin): a cluster join token for `dsec edge --join`.
    pub async fn create_join_token(&self) -> Result<JoinToken> {
        let (b, u) = self.request(Method::POST, self.url(&["v1", "nodes", "tokens"])?);
        json(self.send((b, u)).await?).await
    }

    /// `POST /v1/nodes/join`; the client's key must be a cluster join token.
    pub async fn join(&self, req: &JoinRequest) -> Result<JoinAnswer> {
        let (b, u) = self.request(Method::POST, self.url(&["v1", "nodes", "join"])?);
        json(self.send((b.json(req), u)).await?).await
    }

    /// `POST /v1/nodes/{id}/heartbeat`; the client's key must be a cluster join token.
    pub async fn heartbeat(&self, node: &str) -> Result<JoinAnswer> {
        let (b, u) = self.request(Method::POST, self.url(&["v1", "nodes", node, "heartbeat"])?);
        json(self.send((b, u)).await?).await
    }
}
