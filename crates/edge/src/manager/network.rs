//! A sandbox's network: its status and replacing its rules.

use crate::error::EdgeError;

use super::{lock, Manager};

impl Manager {
    /// The sandbox's network policy, addresses and denied counters.
    pub async fn network_status(
        &self,
        id: &str,
    ) -> Result<dsec_wire::api::NetworkStatus, EdgeError> {
        let e = self.entry(id)?;
        let groups = lock(&e.info).network_rules.clone();
        Ok(self.net.status(id, &groups).await)
    }

    /// Replaces a running sandbox's network rules (effective for the next new connection).
    pub async fn set_network(
        &self,
        id: &str,
        spec: dsec_wire::api::NetworkSpec,
    ) -> Result<dsec_wire::api::NetworkStatus, EdgeError> {
        let e = self.running(id)?;
        let request = serde_json::to_value(&spec).unwrap_or_default();
        if let Err(err) = self.net.update(id, &spec).await {
            let err = EdgeError::from(err);
            self.traj.note(id, "network", request, Err(&err));
            return Err(err);
        }
        self.traj.note(
            id,
            "network",
            request,
            Ok(serde_json::json!({ "applied": true })),
        );
        crate::network::saved(&self.net, id, &e.dir);
        let st = self
            .net
            .status(id, &std::collections::BTreeMap::new())
            .await;
        lock(&e.info).network_rules = st.groups.clone();
        Ok(st)
    }
}
