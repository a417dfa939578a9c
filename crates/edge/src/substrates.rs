//! The edge's substrates: a registry keyed by the API's substrate name.
//!
//! Every substrate implements [`dsec_runtime::substrate::Substrate`]; what differs between
//! them is in its [`Capabilities`], which the manager queries instead of branching on the kind.
//! Adding a substrate means one module in `dsec_runtime` and one line in [`REGISTRY`].
//!
//! A substrate that cannot run on this node (QEMU or the guest artefacts missing) is kept with
//! the reason, so that a create asking for it answers 501 saying why.

use std::sync::Arc;

use dsec_runtime::container::substrate::ContainerDriver;
use dsec_runtime::fullvm::substrate::FullVmDriver;
use dsec_runtime::microvm::substrate::MicroVmDriver;
use dsec_runtime::substrate::{Capabilities, OpenContext, Substrate, Unavailable};
use dsec_wire::api::Substrate as Kind;

use crate::error::EdgeError;

/// Opens a substrate for this node, or says why it cannot run here.
type Open = fn(&OpenContext) -> Result<Arc<dyn Substrate>, Unavailable>;

/// Every substrate an edge knows: its kind, its name in messages, how to open it.
const REGISTRY: &[(Kind, &str, Open)] = &[
    (Kind::Container, "container", ContainerDriver::open),
    (Kind::Microvm, "microVM", MicroVmDriver::open),
    (Kind::Vm, "full-VM", FullVmDriver::open),
];

struct Slot {
    kind: Kind,
    what: &'static str,
    /// The substrate, or why this node has none; `None`: not opened on this edge.
    opened: Option<Result<Arc<dyn Substrate>, Unavailable>>,
}

/// The substrates of one edge.
pub struct Substrates {
    node_id: String,
    slots: Vec<Slot>,
}

impl Substrates {
    /// Opens every substrate of [`REGISTRY`] (those that cannot run here keep the reason),
    /// except those `given` already opened (the container substrate, whose network namespace
    /// pool the function-call workers share).
    pub fn open(node_id: &str, ctx: &OpenContext, given: Vec<Arc<dyn Substrate>>) -> Self {
        let mut s = Self::empty(node_id);
        for (kind, what, open) in REGISTRY {
            let opened = match given.iter().find(|g| g.kind() == *kind) {
                Some(g) => Ok(g.clone()),
                None => open(ctx),
            };
            if let Err(why) = &opened {
                tracing::info!(substrate = what, reason = %why, "substrate not available");
            }
            s.slots.push(Slot {
                kind: *kind,
                what,
                opened: Some(opened),
            });
        }
        s
    }

    /// No substrates but `substrate` (tests, custom edges); the others of [`REGISTRY`] answer
    /// that they are not available on this node.
    pub fn only(node_id: &str, substrate: Arc<dyn Substrate>) -> Self {
        let mut s = Self::empty(node_id);
        let kind = substrate.kind();
        for (k, what, _) in REGISTRY {
            s.slots.push(Slot {
                kind: *k,
                what,
                opened: (*k == kind).then(|| Ok(substrate.clone())),
            });
        }
        s
    }

    fn empty(node_id: &str) -> Self {
        Self {
            node_id: node_id.to_string(),
            slots: Vec::new(),
        }
    }

    /// The substrate for `kind`, or a 501 saying why this node has none.
    pub fn get(&self, kind: Kind) -> Result<Arc<dyn Substrate>, EdgeError> {
        let node = &self.node_id;
        let Some(slot) = self.slots.iter().find(|s| s.kind == kind) else {
            return Err(EdgeError::Unsupported(format!(
                "substrate {kind:?} is not supported on node {node}: this edge runs {} sandboxes only",
                self.names()
            )));
        };
        let what = slot.what;
        match &slot.opened {
            Some(Ok(s)) => Ok(s.clone()),
            Some(Err(why)) => Err(EdgeError::Unsupported(format!(
                "{what} sandboxes are not available on node {node}: {why}"
            ))),
            None => Err(EdgeError::Unsupported(format!(
                "{what} sandboxes are not available on node {node}"
            ))),
        }
    }

    /// The capabilities of `kind`'s substrate when this node runs it.
    pub fn capabilities(&self, kind: Kind) -> Option<Capabilities> {
        self.get(kind).ok().map(|s| s.capabilities())
    }

    /// The substrates this node runs, in registry order.
    pub fn available(&self) -> impl Iterator<Item = &Arc<dyn Substrate>> {
        self.slots.iter().filter_map(|s| match &s.opened {
            Some(Ok(s)) => Some(s),
            _ => None,
        })
    }

    /// The name of `kind` in messages (`microVM`, `full-VM`).
    pub fn label(&self, kind: Kind) -> &'static str {
        REGISTRY
            .iter()
            .find(|(k, _, _)| *k == kind)
            .map_or("unknown", |(_, what, _)| what)
    }

    /// The kinds this node runs (for the node status).
    pub fn kinds(&self) -> Vec<Kind> {
        self.available().map(|s| s.kind()).collect()
    }

    /// `` `container`, `microvm` and `vm` ``: every kind of the registry, for messages.
    fn names(&self) -> String {
        let names: Vec<String> = self
            .slots
            .iter()
            .map(|s| {
                serde_json::to_value(s.kind)
                    .ok()
                    .and_then(|v| v.as_str().map(|n| format!("`{n}`")))
                    .unwrap_or_default()
            })
            .collect();
        match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
            Some((last, _)) => last.clone(),
            None => "no".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A substrate that is never asked to create anything.
    struct Idle;

    impl Substrate for Idle {
        fn kind(&self) -> Kind {
            Kind::Container
        }
        fn capabilities(&self) -> Capabilities {
            dsec_runtime::container::substrate::CAPABILITIES
        }
        fn create(
            &self,
            _spec: dsec_runtime::substrate::SandboxSpec,
            _opts: dsec_runtime::substrate::CreateOptions,
        ) -> dsec_runtime::substrate::BoxFut<
            '_,
            Result<
                Box<dyn dsec_runtime::substrate::LiveSandbox>,
                dsec_runtime::substrate::CreateSandboxError,
            >,
        > {
            unreachable!("the registry test creates nothing")
        }
    }

    #[test]
    fn missing_substrates_say_why() {
        let s = Substrates::only("n0", Arc::new(Idle));
        assert_eq!(s.kinds(), vec![Kind::Container]);
        assert!(s.capabilities(Kind::Container).is_some_and(|c| c.pack_diff));
        assert!(s.capabilities(Kind::Vm).is_none());
        let e = s.get(Kind::Microvm).err().unwrap();
        assert_eq!(e.code(), "unsupported");
        assert!(
            e.to_string()
                .contains("microVM sandboxes are not available on node n0"),
            "{e}"
        );
        let e = s.get(Kind::Function).err().unwrap();
        assert!(
            e.to_string()
                .contains("this edge runs `container`, `microvm` and `vm` sandboxes only"),
            "{e}"
        );
    }

    #[test]
    fn unavailable_substrates_keep_the_reason() {
        let mut s = Substrates::only("n0", Arc::new(Idle));
        s.slots[1].opened = Some(Err(Unavailable("qemu is not installed".into())));
        let e = s.get(Kind::Microvm).err().unwrap();
        assert!(e.to_string().ends_with(": qemu is not installed"), "{e}");
        assert_eq!(s.available().count(), 1);
    }
}
