//! Applying a QoS class to a running container: its processes and its cgroup
//! (see [`crate::qos`]).

use super::ContainerSandbox;
use crate::qos::{ApplyQosError, QosApplied, QosSettings};

impl ContainerSandbox {
    /// Applies the class to aether, every process already in the sandbox's cgroup and the
    /// cgroup's CPU weight. Blocking (a few file writes and a 0.2 ms pause between passes).
    pub fn apply_qos(&self, settings: &QosSettings) -> Result<QosApplied, ApplyQosError> {
        crate::qos::apply(self.process.pid, Some(&self.cgroup), settings)
    }
}
