//! Exposed ports (issue 18): what the port tunnel needs from the manager.

use super::Manager;
use crate::error::EdgeError;

impl Manager {
    /// What a connection to a port of sandbox `id` needs (resumes a paused sandbox, resets its
    /// idle clock). Containers only so far.
    pub async fn port_target(&self, id: &str) -> Result<crate::ports::PortTarget, EdgeError> {
        let e = self.touch(id).await?;
        let info = e.info();
        let reachable = self
            .substrates
            .capabilities(info.substrate)
            .is_some_and(|c| c.ports_in_netns);
        if !reachable {
            return Err(EdgeError::Unsupported(format!(
                "exposed ports reach container sandboxes so far; sandbox {id} is a {:?}",
                info.substrate
            )));
        }
        Ok(crate::ports::PortTarget {
            pid: e.sandbox.pid(),
            public_ports: info.public_ports,
        })
    }

    /// Whether sandbox `id` is live here (not ended).
    pub fn is_live(&self, id: &str) -> bool {
        self.entry(id).is_ok_and(|e| !e.ended.initialized())
    }
}
